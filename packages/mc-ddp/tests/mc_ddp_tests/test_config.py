"""DistributedDataParallelConfig: Megatron's defaults, type errors, incompatible combinations.

Localizes validation only (no processes, no tensors): each bad value must be a TypeError or
ValueError whose message names the field(s) and the value, with nothing communicated (the
recorder stays empty). Exact comparisons, no tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest

from mc_ddp import DistributedDataParallelConfig
from mc_groups import record_collectives

# Megatron-Core's documented defaults for the non-FSDP fields.
_MEGATRON_DEFAULTS: dict[str, object] = {
    "grad_reduce_in_fp32": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "align_param_gather": False,
    "use_distributed_optimizer": False,
    "num_distributed_optimizer_instances": 1,
    "check_for_nan_in_grad": False,
    "check_for_large_grads": False,
    "bucket_size": None,
    "num_buckets": None,
    "pad_buckets_for_high_nccl_busbw": False,
    "average_in_collective": False,
    "reduce_scatter_with_fp32_accumulation": False,
    "param_name_patterns_for_fp32_local_accumulation": [],
    "fp8_param_gather": False,
    "fp4_param_gather": False,
    "delay_wgrad_compute": False,
}


def test_fields_and_defaults_are_megatrons() -> None:
    config = DistributedDataParallelConfig()
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} == (
        _MEGATRON_DEFAULTS
    )


class Bad(NamedTuple):
    """``DistributedDataParallelConfig(**fields)`` must raise ``error`` with every fragment of
    ``words`` in its message; ``doc_input`` is the catalogue's "bad input" cell (markdown),
    read by ``scripts/gen_bad_inputs.py`` with ``doc_call``."""

    fields: dict[str, Any]
    words: tuple[str, ...]
    error: type[Exception]
    doc_input: str
    doc_call: str = "`DistributedDataParallelConfig(...)`"


def _type(fields: dict[str, Any], named: str, doc_input: str) -> Bad:
    return Bad(fields, (named,), TypeError, doc_input)


def _value(fields: dict[str, Any], named: tuple[str, ...], doc_input: str) -> Bad:
    return Bad(fields, named, ValueError, doc_input)


WRONG_TYPES: dict[str, Bad] = {
    "bucket_size bool": _type({"bucket_size": True}, "bucket_size=True", "`bucket_size=True`"),
    "bucket_size float": _type({"bucket_size": 1.5}, "bucket_size=1.5", "`bucket_size=1.5`"),
    "num_buckets str": _type({"num_buckets": "4"}, "num_buckets='4'", "`num_buckets='4'`"),
    "instances None": _type(
        {"num_distributed_optimizer_instances": None},
        "num_distributed_optimizer_instances",
        "`num_distributed_optimizer_instances=None`",
    ),
    "overlap int": _type(
        {"overlap_grad_reduce": 1}, "overlap_grad_reduce=1", "`overlap_grad_reduce=1`"
    ),
    "dist-opt str": _type(
        {"use_distributed_optimizer": "yes"},
        "use_distributed_optimizer='yes'",
        "`use_distributed_optimizer='yes'`",
    ),
    "patterns str": _type(
        {"param_name_patterns_for_fp32_local_accumulation": "all"},
        "['all']",
        "`param_name_patterns_for_fp32_local_accumulation='all'`",
    ),
    "patterns int": _type(
        {"param_name_patterns_for_fp32_local_accumulation": [1]}, "holds 1", "patterns `[1]`"
    ),
}

BAD_VALUES: dict[str, Bad] = {
    "bucket_size 0": _value({"bucket_size": 0}, ("bucket_size=0",), "`bucket_size=0`"),
    "num_buckets negative": _value({"num_buckets": -2}, ("num_buckets=-2",), "`num_buckets=-2`"),
    "instances without dist-opt": _value(
        {"num_distributed_optimizer_instances": 2},
        ("num_distributed_optimizer_instances=2", "use_distributed_optimizer"),
        "2 optimizer instances without the distributed optimizer",
    ),
    "bucket_size and num_buckets": _value(
        {"bucket_size": 10, "num_buckets": 2},
        ("bucket_size=10", "num_buckets=2"),
        "`bucket_size=10, num_buckets=2`",
    ),
    "param gather without dist-opt": _value(
        {"overlap_param_gather": True},
        ("overlap_param_gather", "use_distributed_optimizer"),
        "`overlap_param_gather` without the distributed optimizer",
    ),
    "align without overlap": _value(
        {"align_param_gather": True, "use_distributed_optimizer": True},
        ("align_param_gather", "overlap_param_gather"),
        "`align_param_gather` without `overlap_param_gather`",
    ),
    "patterns with fp32 reduce": _value(
        {
            "param_name_patterns_for_fp32_local_accumulation": ["*.bias"],
            "grad_reduce_in_fp32": True,
        },
        ("param_name_patterns_for_fp32_local_accumulation", "grad_reduce_in_fp32"),
        "fp32 local-accumulation patterns with `grad_reduce_in_fp32`",
    ),
    "fp32 reduce-scatter without dist-opt": _value(
        {"reduce_scatter_with_fp32_accumulation": True},
        ("reduce_scatter_with_fp32_accumulation", "use_distributed_optimizer"),
        "`reduce_scatter_with_fp32_accumulation` without the distributed optimizer",
    ),
    "fp32 reduce-scatter with instances": _value(
        {
            "reduce_scatter_with_fp32_accumulation": True,
            "use_distributed_optimizer": True,
            "num_distributed_optimizer_instances": 2,
        },
        ("reduce_scatter_with_fp32_accumulation", "num_distributed_optimizer_instances=2"),
        "`reduce_scatter_with_fp32_accumulation` with 2 instances",
    ),
    "fp8 gather": _value(
        {"fp8_param_gather": True},
        ("fp8_param_gather", "Transformer Engine"),
        "`fp8_param_gather=True` without Transformer Engine",
    ),
    "fp4 gather": _value(
        {"fp4_param_gather": True},
        ("fp4_param_gather", "Transformer Engine"),
        "`fp4_param_gather=True` without Transformer Engine",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_types_are_type_errors(case: str) -> None:
    bad = WRONG_TYPES[case]
    assert bad.error is TypeError
    with record_collectives() as log, pytest.raises(TypeError) as info:
        DistributedDataParallelConfig(**bad.fields)
    for part in bad.words:
        assert part in str(info.value)
    assert log == []


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_and_combinations_are_value_errors(case: str) -> None:
    bad = BAD_VALUES[case]
    assert bad.error is ValueError
    with record_collectives() as log, pytest.raises(ValueError) as info:
        DistributedDataParallelConfig(**bad.fields)
    for part in bad.words:
        assert part in str(info.value)
    assert log == []


def test_validate_catches_fields_set_after_construction() -> None:
    config = DistributedDataParallelConfig()
    config.num_distributed_optimizer_instances = 2  # Megatron code often sets fields later
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        config.validate()


def test_valid_combinations_construct() -> None:
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        align_param_gather=True,
        num_distributed_optimizer_instances=2,
        num_buckets=4,
        param_name_patterns_for_fp32_local_accumulation=["all"],
    )
    assert config.num_buckets == 4
