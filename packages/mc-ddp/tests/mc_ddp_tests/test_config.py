"""DistributedDataParallelConfig: Megatron's defaults, type errors, incompatible combinations.

Localizes validation only (no processes, no tensors): each bad value must be a TypeError or
ValueError whose message names the field(s) and the value, with nothing communicated (the
recorder stays empty). Exact comparisons, no tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"bucket_size": True}, "bucket_size=True"),
        ({"bucket_size": 1.5}, "bucket_size=1.5"),
        ({"num_buckets": "4"}, "num_buckets='4'"),
        ({"num_distributed_optimizer_instances": None}, "num_distributed_optimizer_instances"),
        ({"overlap_grad_reduce": 1}, "overlap_grad_reduce=1"),
        ({"use_distributed_optimizer": "yes"}, "use_distributed_optimizer='yes'"),
        ({"param_name_patterns_for_fp32_local_accumulation": "all"}, "['all']"),
        ({"param_name_patterns_for_fp32_local_accumulation": [1]}, "holds 1"),
    ],
)
def test_wrong_types_are_type_errors(fields: dict[str, Any], named: str) -> None:
    with record_collectives() as log, pytest.raises(TypeError) as info:
        DistributedDataParallelConfig(**fields)
    assert named in str(info.value)
    assert log == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"bucket_size": 0}, ["bucket_size=0"]),
        ({"num_buckets": -2}, ["num_buckets=-2"]),
        (
            {"num_distributed_optimizer_instances": 2},
            ["num_distributed_optimizer_instances=2", "use_distributed_optimizer"],
        ),
        ({"bucket_size": 10, "num_buckets": 2}, ["bucket_size=10", "num_buckets=2"]),
        ({"overlap_param_gather": True}, ["overlap_param_gather", "use_distributed_optimizer"]),
        (
            {"align_param_gather": True, "use_distributed_optimizer": True},
            ["align_param_gather", "overlap_param_gather"],
        ),
        (
            {
                "param_name_patterns_for_fp32_local_accumulation": ["*.bias"],
                "grad_reduce_in_fp32": True,
            },
            ["param_name_patterns_for_fp32_local_accumulation", "grad_reduce_in_fp32"],
        ),
        (
            {"reduce_scatter_with_fp32_accumulation": True},
            ["reduce_scatter_with_fp32_accumulation", "use_distributed_optimizer"],
        ),
        (
            {
                "reduce_scatter_with_fp32_accumulation": True,
                "use_distributed_optimizer": True,
                "num_distributed_optimizer_instances": 2,
            },
            ["reduce_scatter_with_fp32_accumulation", "num_distributed_optimizer_instances=2"],
        ),
        ({"fp8_param_gather": True}, ["fp8_param_gather", "Transformer Engine"]),
        ({"fp4_param_gather": True}, ["fp4_param_gather", "Transformer Engine"]),
    ],
)
def test_bad_values_and_combinations_are_value_errors(
    fields: dict[str, Any], named: list[str]
) -> None:
    with record_collectives() as log, pytest.raises(ValueError) as info:
        DistributedDataParallelConfig(**fields)
    for part in named:
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
