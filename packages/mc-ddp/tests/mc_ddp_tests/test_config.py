"""DistributedDataParallelConfig: Megatron's defaults, type errors, incompatible combinations.

Localizes validation only (no processes, no tensors): each bad value must be a TypeError or
ValueError whose message names the field(s) and the value, with nothing communicated (the
recorder stays empty). Exact comparisons, no tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

from mc_ddp import DistributedDataParallelConfig
from mc_groups import record_collectives

# Every field of Megatron-Core's DistributedDataParallelConfig, in its declaration order,
# with its default (megatron/core/distributed/distributed_data_parallel_config.py, NVIDIA/
# Megatron-LM main, read 2026-11-30). Order matters: a dataclass can be built positionally.
_MEGATRON_FIELDS: dict[str, object] = {
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
    "reduce_scatter_with_fp32_accumulation": False,
    "param_name_patterns_for_fp32_local_accumulation": (),
    "average_in_collective": False,
    "fp8_param_gather": False,
    "fp4_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "use_megatron_fsdp": False,
    "megatron_fsdp_version": 1,
    "use_custom_fsdp": False,
    "data_parallel_sharding_strategy": "no_shard",
    "gradient_reduce_div_fusion": True,
    "suggested_communication_unit_size": None,
    "keep_fp8_transpose_cache": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
    "fsdp_db_use_persist_buf_on_alloc_fail": False,
    "fsdp_all_gather_in_start_param_sync": True,
    "outer_dp_sharding_strategy": "no_shard",
    "disable_symmetric_registration": False,
    "fsdp_manual_registration": False,
    "delay_wgrad_compute": False,
    "megatron_fsdp_main_params_dtype": torch.float32,
    "megatron_fsdp_main_grads_dtype": None,
    "megatron_fsdp_grad_comm_dtype": None,
    "megatron_fsdp_use_decoupled_grad": False,
    "megatron_fsdp_cuda_graph_mode": False,
    "megatron_fsdp_enable_fine_grained_param_gather": False,
    "megatron_fsdp_max_pool_double_buffer": False,
}


def test_fields_order_and_defaults_are_megatrons() -> None:
    """A Megatron user's DistributedDataParallelConfig(...) runs unchanged: same fields, same
    order, same defaults (issue 12 §1.5)."""
    config = DistributedDataParallelConfig()
    fields = dataclasses.fields(config)
    assert [f.name for f in fields] == list(_MEGATRON_FIELDS)
    assert {f.name: getattr(config, f.name) for f in fields} == _MEGATRON_FIELDS


def test_megatron_defaults_given_explicitly_construct() -> None:
    """Every field passed explicitly at Megatron's default is accepted (ported configs spell
    them out), positionally too; disable_symmetric_registration=True as well (mc never
    registers NCCL buffers, which is what it asks for)."""
    loose: Any = DistributedDataParallelConfig  # the table's values are typed `object`
    loose(**_MEGATRON_FIELDS)
    loose(*_MEGATRON_FIELDS.values())
    assert DistributedDataParallelConfig(disable_symmetric_registration=True)


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
    "fsdp flag int": _type({"nccl_ub": 1}, "nccl_ub=1", "`nccl_ub=1`"),
    "fsdp dtype str": _type(
        {"megatron_fsdp_grad_comm_dtype": "bf16"},
        "megatron_fsdp_grad_comm_dtype='bf16'",
        "`megatron_fsdp_grad_comm_dtype='bf16'`",
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
    "fsdp version": _value(
        {"megatron_fsdp_version": 3}, ("megatron_fsdp_version=3",), "`megatron_fsdp_version=3`"
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
}


class Unimplemented(NamedTuple):
    """A Megatron field at a value mc does not implement: ``NotImplementedError`` naming it."""

    fields: dict[str, Any]
    words: tuple[str, ...]
    doc_input: str
    error: type[Exception] = NotImplementedError
    doc_call: str = "`DistributedDataParallelConfig(...)`"


def _unimplemented(name: str, value: object, feature: str) -> Unimplemented:
    return Unimplemented(
        {name: value}, (f"{name}={value!r}", feature, "Megatron's default"), f"`{name}={value!r}`"
    )


NOT_IMPLEMENTED: dict[str, Unimplemented] = {
    "fp8 gather": _unimplemented("fp8_param_gather", True, "does not enable it"),
    "fp4 gather": _unimplemented("fp4_param_gather", True, "does not enable it"),
    "mxfp8 reuse": _unimplemented("reuse_grad_buf_for_mxfp8_param_ag", True, "MXFP8"),
    "megatron fsdp": _unimplemented("use_megatron_fsdp", True, "Megatron-FSDP"),
    "custom fsdp": _unimplemented("use_custom_fsdp", True, "Megatron-FSDP"),
    "sharding": _unimplemented("data_parallel_sharding_strategy", "optim", "Megatron-FSDP"),
    "nccl_ub": _unimplemented("nccl_ub", True, "NCCL user-buffer"),
    "fsdp dtype": _unimplemented("megatron_fsdp_main_grads_dtype", torch.bfloat16, "Megatron-FSDP"),
}


@pytest.mark.parametrize("case", list(NOT_IMPLEMENTED))
def test_unimplemented_megatron_fields_are_refused(case: str) -> None:
    bad = NOT_IMPLEMENTED[case]
    with record_collectives() as log, pytest.raises(NotImplementedError) as info:
        DistributedDataParallelConfig(**bad.fields)
    for part in bad.words:
        assert part in str(info.value)
    assert log == []


def test_fp8_gather_is_refused_at_ddp_construction_when_set_later() -> None:
    """Megatron code sets fields after construction: validate() (run again by
    DistributedDataParallel) refuses them the same way."""
    config = DistributedDataParallelConfig()
    config.fp8_param_gather = True
    with pytest.raises(NotImplementedError, match="fp8_param_gather=True"):
        config.validate()


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
