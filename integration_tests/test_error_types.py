"""Bad input to mc can be caught the way Megatron-Core's is (issue 20).

Megatron-Core states its argument conditions as ``assert`` statements, so code written for it
(its own unit tests, a user's ``except AssertionError``) expects an ``AssertionError``; mc
raises ``ValueError`` / ``TypeError`` / ``RuntimeError`` naming the argument and the fix.
``mc_groups.errors`` has types that are both, and this file holds the rule two ways:
statically (no package source raises the plain built-ins for bad input) and on calls into
every package, each caught with ``pytest.raises(AssertionError)`` as upstream writes it and
with mc's own type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mc_buffers
import mc_ddp
import mc_finalize
import mc_tp_layers
import mc_tp_layers.layers
from mc_groups.collection import MissingGroupError
from mc_groups.errors import InputStateError, InputTypeError, InputValueError
from mc_groups.rank_generator import RankGenerator

ROOT = Path(__file__).resolve().parents[1]
_PLAIN = re.compile(r"\braise (ValueError|TypeError)\(")


def test_no_package_raises_a_plain_value_or_type_error() -> None:
    offenders = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if "testing" in path.parts:  # the test harness reports harness misuse, not user input
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _PLAIN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], (
        "raise mc_groups.errors.InputValueError / InputTypeError instead (a ValueError / "
        "TypeError that is also an AssertionError, as Megatron asserts):\n" + "\n".join(offenders)
    )


def test_the_types_are_both() -> None:
    assert issubclass(InputValueError, ValueError)
    assert issubclass(InputValueError, AssertionError)
    assert issubclass(InputTypeError, TypeError)
    assert issubclass(InputTypeError, AssertionError)
    assert issubclass(InputStateError, RuntimeError)
    assert issubclass(InputStateError, AssertionError)
    # the named errors built on them keep their old base too
    assert issubclass(MissingGroupError, ValueError)
    assert issubclass(MissingGroupError, AssertionError)
    assert issubclass(mc_ddp.DataParallelAgreementError, AssertionError)
    assert issubclass(mc_tp_layers.TensorParallelAgreementError, AssertionError)


def _linear_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(3))


CALLS: dict[str, tuple[Callable[[], object], type[Exception]]] = {
    # Megatron: assert not (param_name_patterns... and grad_reduce_in_fp32)
    "ddp config": (
        lambda: mc_ddp.DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, param_name_patterns_for_fp32_local_accumulation=("all",)
        ),
        ValueError,
    ),
    "buffer layout type": (
        lambda: mc_buffers.ParamAndGradBuffer([_linear_param()], param_layout=3),  # type: ignore[arg-type]
        TypeError,
    ),
    "bucket size": (
        lambda: mc_buffers.compute_default_per_buffer_param_layout([_linear_param()], 0),
        ValueError,
    ),
    "finalize model list": (
        lambda: mc_finalize.finalize_model_grads(torch.nn.Linear(2, 2)),  # type: ignore[arg-type]
        TypeError,
    ),
    "tp attribute dim": (
        lambda: mc_tp_layers.layers.set_tensor_model_parallel_attributes(
            torch.zeros(2), True, 5, 1
        ),
        ValueError,
    ),
    "rank generator": (
        lambda: RankGenerator(tp=0, ep=1, dp=1, pp=1, cp=1, order="tp-dp"),
        ValueError,
    ),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_bad_input_is_an_assertion_error_too(case: str) -> None:
    call, own = CALLS[case]
    with pytest.raises(AssertionError) as caught:
        call()
    assert isinstance(caught.value, own), type(caught.value)
