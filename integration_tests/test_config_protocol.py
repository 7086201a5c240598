"""One config protocol (issue 38): a TP layer, DDP and finalize read a config the same way.

Each package takes any object with Megatron-Core's field names (``mc_groups.config``): a
field it lacks reads Megatron's default, a field it has is checked where the config is
received, with the same message in every package. Held here on one config, in one process
(every error comes before any group is used or any collective starts).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import mc_ddp
import mc_finalize
import mc_tp_layers

# Every field any package requires, with Megatron's defaults.
_COMPLETE = {
    "sequence_parallel": False,
    "calculate_per_token_loss": False,
    "params_dtype": torch.float32,
    "use_cpu_initialization": True,
    "perform_initialization": True,
    "gradient_accumulation_fusion": False,
    "defer_embedding_wgrad_compute": False,
    "wgrad_deferral_limit": 0,
}


class _Chunk(torch.nn.Module):
    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        raise AssertionError("finalize must refuse the config before any step runs")


def _layer(config: Any) -> object:
    return mc_tp_layers.ColumnParallelLinear(
        4, 4, config=config, init_method=torch.nn.init.zeros_, bias=False
    )


def _ddp(config: Any) -> object:
    return mc_ddp.DistributedDataParallel(
        config,
        mc_ddp.DistributedDataParallelConfig(),
        torch.nn.Linear(2, 2),
    )


def _finalize(config: Any) -> object:
    mc_finalize.finalize_model_grads([_Chunk(config)])
    return None


_ENTRY_POINTS: dict[str, Callable[[Any], object]] = {
    "layer": _layer,
    "ddp": _ddp,
    "finalize": _finalize,
}


@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("gtp_remat_size", 0, ValueError, "config.gtp_remat_size=0 must be >= 1"),
        ("sequence_parallel", "no", TypeError, "config.sequence_parallel='no' must be a bool"),
        ("moe_router_load_balancing_type", 3, TypeError, "must be a str or a list of str"),
    ],
)
def test_a_bad_field_is_the_same_error_everywhere(
    entry: str, field: str, value: object, error: type[Exception], message: str
) -> None:
    config = SimpleNamespace(**(_COMPLETE | {field: value}))
    with pytest.raises(error) as info:
        _ENTRY_POINTS[entry](config)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("entry", "missing"),
    [("layer", "params_dtype"), ("ddp", "calculate_per_token_loss")],
)
def test_a_required_field_missing_names_it_and_the_caller(entry: str, missing: str) -> None:
    config = SimpleNamespace(**{k: v for k, v in _COMPLETE.items() if k != missing})
    with pytest.raises(TypeError) as info:
        _ENTRY_POINTS[entry](config)
    text = str(info.value)
    assert f"lacks ['{missing}']" in text, text
    assert "mc_groups.TransformerConfigLike" in text, text
