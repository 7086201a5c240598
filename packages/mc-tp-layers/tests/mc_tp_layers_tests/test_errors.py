"""mc-tp-layers' bad-input catalogue: each case a ValueError/TypeError naming the argument and
its value, raised before any collective (layers, linear functions, mappings, cross-entropy;
listed in ``docs/bad_inputs.md``).

Every case runs inside ``record_collectives()``; the log must stay empty, which proves the
check ran before anything was communicated (a rank failing mid-collective would hang its
peers instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers.gtp import shard_weight_for_gtp
from mc_tp_layers.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    param_is_not_tensor_parallel_duplicate,
)
from mc_tp_layers.linear import (
    drain_embedding_wgrad_compute,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.mappings import (
    all_to_all_hp2sp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers.random import clear_cuda_rng_tracker
from mc_tp_layers.sharded_state import tp_sharded_tensor
from mc_tp_layers.utils import VocabUtility, divide, split_tensor_along_last_dim
from mc_tp_layers_tests._helpers import config, row_parallel, world

Z = torch.nn.init.zeros_
_NOT_A_CONFIG: Any = object()
LONG_TARGET = torch.zeros(2, 2, dtype=torch.long)


def _loose(value: object) -> Any:
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


def _config_with(field: str, value: object) -> mg.ModelParallelConfig:
    """A TP=2 config whose ``field`` was set afterwards (the dataclass checks only at
    construction; a Megatron config or any object with the attributes may hold anything)."""
    cfg = config(2)
    setattr(cfg, field, value)
    return cfg


def _column(pgc: mg.ProcessGroupCollection, **kw: Any) -> tpl.ColumnParallelLinear:
    return tpl.ColumnParallelLinear(8, 4, config=config(2), init_method=Z, pg_collection=pgc, **kw)


def _row(pgc: mg.ProcessGroupCollection, **kw: Any) -> tpl.RowParallelLinear:
    kw.setdefault("input_is_parallel", True)
    kw.setdefault("skip_bias_add", False)
    kw.setdefault("bias", True)
    return tpl.RowParallelLinear(4, 8, config=config(2), init_method=Z, pg_collection=pgc, **kw)


def _linear(*args: Any, **kw: Any) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce`` on a [2, 8] input and a [2, 8]
    weight unless the arguments say otherwise (fusion, allreduce_dgrad, SP all False)."""
    x, w = kw.pop("x", torch.ones(2, 8)), kw.pop("w", torch.ones(2, 8))
    flags = kw.pop("flags", (False, False, False))
    return linear_with_grad_accumulation_and_async_allreduce(
        x, w, kw.pop("bias", None), *flags, *args, **kw
    )


def _new_cases(pgc: mg.ProcessGroupCollection) -> dict[str, Callable[[], Any]]:
    """The cases of issue 16: flags read by truthiness, non-float dtypes, indices out of
    range, raw errors below the constructors."""
    cfg = config(2)
    col = _column(pgc)
    emb = tpl.VocabParallelEmbedding(8, 4, init_method=Z, config=cfg, pg_collection=pgc)
    tracker = tpl.RNGStatesTracker("cpu")
    tracker.add("a", 1)
    fused_weight = torch.ones(2, 8)
    fused_weight.main_grad = torch.zeros(2, 8)  # type: ignore[attr-defined]
    logits = torch.ones(2, 4)
    return {
        "bias_flag": lambda: _column(pgc, bias=_loose("no")),
        "gather_output_flag": lambda: _column(pgc, gather_output=_loose(1)),
        "disable_grad_reduce_flag": lambda: _column(pgc, disable_grad_reduce=_loose("False")),
        "is_expert_flag": lambda: _column(pgc, is_expert=_loose(0)),
        "skip_bias_add_flag": lambda: _row(pgc, skip_bias_add=_loose(None)),
        "input_is_parallel_flag": lambda: _row(pgc, input_is_parallel=_loose("yes")),
        "reduce_scatter_embeddings_flag": lambda: tpl.VocabParallelEmbedding(
            8,
            4,
            init_method=Z,
            reduce_scatter_embeddings=_loose(1),
            config=cfg,
            pg_collection=pgc,
        ),
        "runtime_gather_output": lambda: col(torch.ones(2, 8), runtime_gather_output=_loose("yes")),
        "config_flag": lambda: tpl.ColumnParallelLinear(
            8,
            4,
            config=_config_with("gradient_accumulation_fusion", 1),
            init_method=Z,
            pg_collection=pgc,
        ),
        "linear_fusion_flag": lambda: _linear(flags=(_loose("no"), False, False)),
        "linear_sp_flag": lambda: _linear(flags=(False, False, _loose(1)), tp_group=pgc.tp),
        "mapping_flag": lambda: gather_from_sequence_parallel_region(
            torch.ones(2, 2), _loose("no"), group=pgc.tp
        ),
        "params_dtype": lambda: tpl.ColumnParallelLinear(
            8,
            4,
            config=_config_with("params_dtype", torch.int64),
            init_method=Z,
            pg_collection=pgc,
        ),
        "layer_output_dtype": lambda: _column(pgc, output_dtype=_loose(torch.int32)),
        "input_dtype": lambda: col(torch.ones(2, 8, dtype=torch.long)),
        "linear_dtypes": lambda: _linear(x=torch.ones(2, 8, dtype=torch.float64), tp_group=pgc.tp),
        "linear_device": lambda: _linear(x=torch.ones(2, 8, device="meta"), tp_group=pgc.tp),
        "bias_shape": lambda: _linear(bias=torch.ones(3), tp_group=pgc.tp),
        "gtp_not_a_shard": lambda: _linear(tp_group=pgc.tp, gtp_remat_size=2),
        "stride_bool": lambda: _column(pgc, stride=_loose(True)),
        "embedding_dim": lambda: tpl.VocabParallelEmbedding(
            8, 0, init_method=Z, config=cfg, pg_collection=pgc
        ),
        "layer_device": lambda: _column(pgc, device=_loose(5)),
        "layer_tracker": lambda: _column(pgc, rng_tracker=_loose("default")),
        "target_outside": lambda: tpl.vocab_parallel_cross_entropy(
            logits, torch.tensor([1, 8]), tp_group=pgc.tp
        ),
        "target_ignore_default": lambda: tpl.vocab_parallel_cross_entropy(
            logits, torch.tensor([-100, 2]), tp_group=pgc.tp
        ),
        "ignore_index_type": lambda: tpl.vocab_parallel_cross_entropy(
            logits, torch.tensor([1, 2]), tp_group=pgc.tp, ignore_index=_loose(-100.0)
        ),
        "emb_id_range": lambda: emb(torch.tensor([[0, 8]])),
        "emb_id_device": lambda: emb(torch.zeros(1, 2, dtype=torch.long, device="meta")),
        "partition_dim_wrap": lambda: tp_sharded_tensor(torch.ones(2, 4), _loose(pgc.tp), 5),
        "vocab_range_negative": lambda: VocabUtility.vocab_range_from_per_partition_vocab_size(
            4, -1, 2
        ),
        "vocab_range_rank": lambda: VocabUtility.vocab_range_from_global_vocab_size(8, 2, 2),
        "divide_zero": lambda: divide(4, 0),
        "split_partitions": lambda: split_tensor_along_last_dim(torch.ones(2, 4), 0),
        "rng_set_states_none": lambda: tracker.set_states(_loose(None)),
        "rng_set_states_value": lambda: tracker.set_states({"a": torch.zeros(3)}),
        "rng_fork_name": lambda: tracker.fork(_loose(5)).__enter__(),
        "rng_device": lambda: tpl.RNGStatesTracker(_loose(3)),
        "seed_type": lambda: tpl.model_parallel_cuda_manual_seed(
            _loose("1"), pg_collection=pgc, device="cpu", set_default=False
        ),
        "drain_weight": lambda: drain_embedding_wgrad_compute(cfg, [], [], _loose(None), pgc.tp),
        "drain_buffer_type": lambda: drain_embedding_wgrad_compute(
            cfg, _loose(None), [], fused_weight, pgc.tp
        ),
        "drain_pair_shape": lambda: drain_embedding_wgrad_compute(
            cfg, [torch.ones(2, 7)], [torch.ones(2, 2)], fused_weight, pgc.tp
        ),
        "mapping_none": lambda: copy_to_tensor_model_parallel_region(_loose(None), group=pgc.tp),
        "split_sizes_type": lambda: gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=pgc.tp, output_split_sizes=_loose(2)
        ),
        "sharded_prefix": lambda: col.sharded_state_dict(prefix=_loose(None)),
        "sharded_offsets": lambda: col.sharded_state_dict(sharded_offsets=_loose(5)),
        "row_forward_none": lambda: _row(pgc)(_loose(None)),
        "gtp_shard_none": lambda: shard_weight_for_gtp(_loose(None), _loose(pgc.tp)),
        "gtp_pad_range": lambda: gtp_local_pad_zero_count(torch.ones(4), 5, 2),
        "init_cpu_partition_dim": lambda: _initialize_affine_weight_cpu(
            torch.empty(2, 8), 4, 8, 2, 2, Z, rank=0, world_size=2
        ),
        "init_gpu_tracker": lambda: _initialize_affine_weight_gpu(
            torch.empty(2, 8), Z, 0, rng_tracker=_loose("t")
        ),
        "param_dup_none": lambda: param_is_not_tensor_parallel_duplicate(_loose(None), pgc.tp),
        "copy_attributes_none": lambda: copy_tensor_model_parallel_attributes(
            _loose(None), torch.ones(1)
        ),
    }


def _cases(pgc: mg.ProcessGroupCollection) -> dict[str, Callable[[], Any]]:
    cfg, sp = config(2), config(2, sequence_parallel=True)
    fused = config(2, gradient_accumulation_fusion=True)
    col_sp = tpl.ColumnParallelLinear(8, 4, config=sp, init_method=Z, pg_collection=pgc)
    row_sp = row_parallel(4, 8, sp, Z, bias=False, pg_collection=pgc)
    emb_rs = tpl.VocabParallelEmbedding(
        8, 4, init_method=Z, reduce_scatter_embeddings=True, config=sp, pg_collection=pgc
    )
    skip = tpl.ColumnParallelLinear(
        8, 4, config=cfg, init_method=Z, skip_weight_param_allocation=True, pg_collection=pgc
    )
    fused_col = tpl.ColumnParallelLinear(8, 4, config=fused, init_method=Z, pg_collection=pgc)
    return {
        "output_size": lambda: tpl.ColumnParallelLinear(
            8, 5, config=cfg, init_method=Z, pg_collection=pgc
        ),
        "input_size": lambda: row_parallel(5, 8, cfg, Z, pg_collection=pgc),
        "config_tp_size": lambda: tpl.ColumnParallelLinear(
            8, 4, config=config(4), init_method=Z, pg_collection=pgc
        ),
        "config_tp_size_embedding": lambda: tpl.VocabParallelEmbedding(
            8, 4, init_method=Z, config=config(4), pg_collection=pgc
        ),
        "vocab": lambda: tpl.VocabParallelEmbedding(
            9, 4, init_method=Z, config=cfg, pg_collection=pgc
        ),
        "sp_not_parallel": lambda: row_parallel(
            4, 8, sp, Z, input_is_parallel=False, pg_collection=pgc
        ),
        "rank": lambda: col_sp(torch.ones(2, 2, 2, 8)),
        "last_dim": lambda: col_sp(torch.ones(2, 2, 7)),
        "no_weight": lambda: skip(torch.ones(2, 2, 8)),
        "weight_shape": lambda: skip(torch.ones(2, 2, 8), weight=torch.ones(4, 8)),
        "main_grad": lambda: fused_col(torch.ones(2, 2, 8)),
        "sequence": lambda: row_sp(torch.ones(3, 2, 2)),
        "emb_sequence": lambda: emb_rs(torch.zeros(2, 3, dtype=torch.long)),
        "emb_ids": lambda: emb_rs(torch.zeros(2, 4)),
        "device_init": lambda: tpl.ColumnParallelLinear(
            8, 4, config=config(2, use_cpu_initialization=False), init_method=Z, pg_collection=pgc
        ),
        "defer_buffers": lambda: tpl.ColumnParallelLinear(
            8,
            4,
            config=config(2, defer_embedding_wgrad_compute=True),
            init_method=Z,
            pg_collection=pgc,
        ),
        "both_reductions": lambda: linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8), torch.ones(2, 8), None, False, True, True, tp_group=pgc.tp
        ),
        "deferral_without_fusion": lambda: linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8), torch.ones(2, 8), None, False, False, True, [], 0, pgc.tp
        ),
        "drain_mismatch": lambda: drain_embedding_wgrad_compute(
            cfg, [torch.ones(1)], [], torch.ones(2, 8), pgc.tp
        ),
        "config": lambda: tpl.ColumnParallelLinear(
            8, 4, config=_NOT_A_CONFIG, init_method=Z, pg_collection=pgc
        ),
        "mapping_group": lambda: copy_to_tensor_model_parallel_region(
            torch.ones(2, 4), group=_loose("tp")
        ),
        "split_sizes_count": lambda: gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=pgc.tp, output_split_sizes=[2]
        ),
        "split_sizes_rows": lambda: gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=pgc.tp, output_split_sizes=[3, 3]
        ),
        "last_dim_split": lambda: scatter_to_tensor_model_parallel_region(
            torch.ones(2, 3), group=pgc.tp
        ),
        "tokens_split": lambda: all_to_all_hp2sp(torch.ones(3, 3), group=pgc.tp),
        "smoothing": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), LONG_TARGET, label_smoothing=1.0, tp_group=pgc.tp
        ),
        "target_dtype": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), torch.zeros(2, 2), tp_group=pgc.tp
        ),
        "target_shape": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), torch.zeros(2, 3, dtype=torch.long), tp_group=pgc.tp
        ),
        "frozen_deferral": lambda: linear_with_frozen_weight(
            torch.ones(2, 8), torch.ones(2, 8), None, False, False, False, pgc.tp, [], None
        ),
        "output_dtype": lambda: linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8),
            torch.ones(2, 8),
            None,
            False,
            False,
            False,
            tp_group=pgc.tp,
            output_dtype=_loose("bf16"),
        ),
        "gtp_size": lambda: linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8),
            torch.ones(2, 8),
            None,
            False,
            False,
            False,
            tp_group=pgc.tp,
            gtp_remat_size=0,
        ),
    }


def _run_cases() -> dict[str, str]:
    pgc = world(2)
    clear_cuda_rng_tracker()  # "device_init" needs no default tracker in this worker
    try:
        messages: dict[str, str] = {}
        with mg.record_collectives() as log:
            for name, call in {**_cases(pgc), **_new_cases(pgc)}.items():
                try:
                    call()
                    messages[name] = "no error"
                except (ValueError, TypeError) as err:
                    messages[name] = f"{error_kind(err)}: {err}"
        messages["log"] = str([r.op for r in log])
        return messages
    finally:
        mg.destroy_model_parallel(pgc)


class Case(NamedTuple):
    """One bad input: the exception, the fragments its message must hold, and the
    catalogue cells (docs/bad_inputs.md is generated from this table)."""

    error: str
    words: tuple[str, ...]
    doc_call: str
    doc_input: str


EXPECTED: dict[str, Case] = {
    "output_size": Case(
        "ValueError",
        (
            "output_size=5",
            "tensor-parallel size 2",
            "multiple",
        ),
        "`ColumnParallelLinear(8, 5, ...)` at TP 2",
        "output size not divisible",
    ),
    "config_tp_size": Case(
        "ValueError",
        (
            "ColumnParallelLinear: config.tensor_model_parallel_size=4",
            "group has 2 rank(s)",
            "one size",
        ),
        "`ColumnParallelLinear(..., config=)` at TP 2",
        "`config.tensor_model_parallel_size=4`",
    ),
    "config_tp_size_embedding": Case(
        "ValueError",
        ("VocabParallelEmbedding: config.tensor_model_parallel_size=4", "2 rank(s)"),
        "`VocabParallelEmbedding(..., config=)` at TP 2",
        "`config.tensor_model_parallel_size=4`",
    ),
    "input_size": Case(
        "ValueError",
        (
            "input_size=5",
            "tensor-parallel size 2",
        ),
        "`RowParallelLinear(5, 8, ...)` at TP 2",
        "input size not divisible",
    ),
    "vocab": Case(
        "ValueError",
        (
            "num_embeddings=9",
            "pad the vocabulary",
        ),
        "`VocabParallelEmbedding(9, 4, ...)` at TP 2",
        "vocabulary not divisible",
    ),
    "sp_not_parallel": Case(
        "ValueError",
        (
            "sequence_parallel=True",
            "input_is_parallel=True",
        ),
        "`RowParallelLinear(..., input_is_parallel=False)`",
        "with sequence parallelism",
    ),
    "rank": Case(
        "ValueError",
        (
            "(2, 2, 2, 8)",
            "[sequence, batch, 8]",
        ),
        "`ColumnParallelLinear(...)(x)`",
        "4-D input",
    ),
    "last_dim": Case(
        "ValueError",
        (
            "(2, 2, 7)",
            "[sequence, batch, 8]",
        ),
        "`ColumnParallelLinear(8, ...)(x)`",
        "input with 7 features",
    ),
    "no_weight": Case(
        "ValueError",
        (
            "skip_weight_param_allocation=True",
            "weight=<tensor of shape [2, 8]>",
        ),
        "`ColumnParallelLinear(..., skip_weight_param_allocation=True)(x)`",
        "no `weight=`",
    ),
    "weight_shape": Case(
        "ValueError",
        (
            "(4, 8)",
            "[2, 8]",
        ),
        "`ColumnParallelLinear(...)(x, weight=)`",
        "weight of the wrong shape",
    ),
    "main_grad": Case(
        "ValueError",
        (
            "gradient_accumulation_fusion=True",
            "main_grad",
            "DistributedDataParallel",
        ),
        "`ColumnParallelLinear` with `gradient_accumulation_fusion`",
        "weight without `main_grad`",
    ),
    "sequence": Case(
        "ValueError",
        (
            "(3, 2, 2)",
            "sequence length 3",
            "tensor-parallel size 2",
        ),
        "`RowParallelLinear` under SP",
        "sequence length 3 at TP 2",
    ),
    "emb_sequence": Case(
        "ValueError",
        (
            "sequence length 3",
            "pad the",
        ),
        "`VocabParallelEmbedding(reduce_scatter_embeddings=True)`",
        "sequence length 3 at TP 2",
    ),
    "emb_ids": Case(
        "TypeError",
        (
            "torch.float32",
            "integer",
        ),
        "`VocabParallelEmbedding(...)(ids)`",
        "float ids",
    ),
    "device_init": Case(
        "ValueError",
        (
            "rng_tracker=",
            "use_cpu_initialization=True",
        ),
        "`ColumnParallelLinear` with `use_cpu_initialization=False`",
        "no RNG tracker",
    ),
    "defer_buffers": Case(
        "ValueError",
        (
            "embedding_activation_buffer",
            "grad_output_buffer",
        ),
        "`ColumnParallelLinear` with `defer_embedding_wgrad_compute`",
        "no buffers",
    ),
    "both_reductions": Case(
        "ValueError",
        (
            "allreduce_dgrad=True",
            "sequence_parallel=True",
            "allreduce_dgrad=False",
        ),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "`allreduce_dgrad` and `sequence_parallel`",
    ),
    "deferral_without_fusion": Case(
        "ValueError",
        (
            "grad_output_buffer",
            "gradient_accumulation_fusion=True",
        ),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "`grad_output_buffer` without fusion",
    ),
    "drain_mismatch": Case(
        "ValueError",
        (
            "holds 1",
            "holds 0",
        ),
        "`drain_embedding_wgrad_compute`",
        "buffers of different lengths",
    ),
    "config": Case(
        "TypeError",
        (
            "lacks",
            "ModelParallelConfig",
        ),
        "`ColumnParallelLinear(config=)`",
        "`object()`",
    ),
    "mapping_group": Case(
        "TypeError",
        ("tp_group='tp' must be a torch.distributed.ProcessGroup",),
        "`copy_to_tensor_model_parallel_region(x, group=)`",
        "`'tp'`",
    ),
    "split_sizes_count": Case(
        "ValueError",
        (
            "output_split_sizes=[2] must hold one",
            "(2 ranks)",
        ),
        "`gather_from_sequence_parallel_region(..., output_split_sizes=)`",
        "1 size for 2 ranks",
    ),
    "split_sizes_rows": Case(
        "ValueError",
        (
            "output_split_sizes=[3, 3] gives rank",
            "3 rows but input_ has shape (2, 2)",
        ),
        "`gather_from_sequence_parallel_region(..., output_split_sizes=)`",
        "sizes that disagree with the input",
    ),
    "last_dim_split": Case(
        "ValueError",
        (
            "input_ has shape (2, 3)",
            "not divisible by the tensor-parallel size 2",
            "pad it",
        ),
        "`scatter_to_tensor_model_parallel_region(x)`",
        "last dim 3 at TP 2",
    ),
    "tokens_split": Case(
        "ValueError",
        (
            "input_ has shape (3, 3)",
            "token count (dim 0, 3)",
        ),
        "`all_to_all_hp2sp(x)`",
        "3 tokens at TP 2",
    ),
    "smoothing": Case(
        "ValueError",
        ("label_smoothing=1.0 must be in [0, 1)",),
        "`vocab_parallel_cross_entropy(..., label_smoothing=)`",
        "`1.0`",
    ),
    "target_dtype": Case(
        "TypeError",
        (
            "target holds torch.float32",
            "integer tensor",
        ),
        "`vocab_parallel_cross_entropy(logits, target)`",
        "float target",
    ),
    "target_shape": Case(
        "ValueError",
        (
            "target has shape (2, 3)",
            "(2, 2, 4)",
        ),
        "`vocab_parallel_cross_entropy(logits, target)`",
        "target shape ≠ logits without vocab",
    ),
    "frozen_deferral": Case(
        "ValueError",
        (
            "grad_output_buffer and wgrad_deferral_limit",
            "pass None",
        ),
        "`linear_with_frozen_weight(..., grad_output_buffer=)`",
        "a buffer",
    ),
    "output_dtype": Case(
        "TypeError",
        ("output_dtype='bf16' must be a floating-point torch.dtype", "or None"),
        "`linear_with_grad_accumulation_and_async_allreduce(..., output_dtype=)`",
        "`'bf16'`",
    ),
    "gtp_size": Case(
        "ValueError",
        ("gtp_remat_size=0 must be >= 1",),
        "`linear_with_grad_accumulation_and_async_allreduce(..., gtp_remat_size=)`",
        "`0`",
    ),
    "bias_flag": Case(
        "TypeError",
        ("bias='no' must be a bool",),
        "`ColumnParallelLinear(..., bias=)`",
        "`'no'` (read as True before)",
    ),
    "gather_output_flag": Case(
        "TypeError",
        ("gather_output=1 must be a bool",),
        "`ColumnParallelLinear(..., gather_output=)`",
        "`1`",
    ),
    "disable_grad_reduce_flag": Case(
        "TypeError",
        ("disable_grad_reduce='False' must be a bool",),
        "`ColumnParallelLinear(..., disable_grad_reduce=)`",
        "`'False'`",
    ),
    "is_expert_flag": Case(
        "TypeError",
        ("is_expert=0 must be a bool",),
        "`ColumnParallelLinear(..., is_expert=)`",
        "`0`",
    ),
    "skip_bias_add_flag": Case(
        "TypeError",
        ("skip_bias_add=None must be a bool",),
        "`RowParallelLinear(..., skip_bias_add=)`",
        "`None`",
    ),
    "input_is_parallel_flag": Case(
        "TypeError",
        ("input_is_parallel='yes' must be a bool",),
        "`RowParallelLinear(..., input_is_parallel=)`",
        "`'yes'`",
    ),
    "reduce_scatter_embeddings_flag": Case(
        "TypeError",
        ("reduce_scatter_embeddings=1 must be a bool",),
        "`VocabParallelEmbedding(..., reduce_scatter_embeddings=)`",
        "`1`",
    ),
    "runtime_gather_output": Case(
        "TypeError",
        ("runtime_gather_output='yes' must be a bool",),
        "`ColumnParallelLinear(...)(x, runtime_gather_output=)`",
        "`'yes'`",
    ),
    "config_flag": Case(
        "TypeError",
        ("config.gradient_accumulation_fusion=1 must be a bool",),
        "`ColumnParallelLinear(config=)`",
        "a config whose `gradient_accumulation_fusion` is `1`",
    ),
    "linear_fusion_flag": Case(
        "TypeError",
        ("gradient_accumulation_fusion='no' must be a bool",),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "`gradient_accumulation_fusion='no'`",
    ),
    "linear_sp_flag": Case(
        "TypeError",
        ("sequence_parallel=1 must be a bool",),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "`sequence_parallel=1`",
    ),
    "mapping_flag": Case(
        "TypeError",
        ("tensor_parallel_output_grad='no' must be a bool",),
        "`gather_from_sequence_parallel_region(x, tensor_parallel_output_grad)`",
        "`'no'`",
    ),
    "params_dtype": Case(
        "TypeError",
        (
            "config.params_dtype=torch.int64",
            "floating-point dtype",
        ),
        "`ColumnParallelLinear(config=)`",
        "`params_dtype=torch.int64`",
    ),
    "layer_output_dtype": Case(
        "TypeError",
        (
            "output_dtype=torch.int32",
            "floating-point dtype",
        ),
        "`ColumnParallelLinear(..., output_dtype=)`",
        "`torch.int32`",
    ),
    "input_dtype": Case(
        "TypeError",
        (
            "input_ holds torch.int64",
            "floating-point input",
        ),
        "`ColumnParallelLinear(...)(x)`",
        "integer input",
    ),
    "linear_dtypes": Case(
        "TypeError",
        (
            "input holds torch.float64 but the weight torch.float32",
            "cast the input",
            "output_dtype=",
        ),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "fp64 input, fp32 weight",
    ),
    "linear_device": Case(
        "ValueError",
        ("input is on meta but the weight on cpu",),
        "`linear_with_grad_accumulation_and_async_allreduce`",
        "input on another device",
    ),
    "bias_shape": Case(
        "ValueError",
        (
            "bias has shape (3,)",
            "the bias must be [2]",
        ),
        "`linear_with_grad_accumulation_and_async_allreduce(..., bias)`",
        "bias of 3 for 2 output rows",
    ),
    "gtp_not_a_shard": Case(
        "ValueError",
        (
            "gtp_remat_size=2",
            "is not a gtp_remat shard",
            "shard_weight_for_gtp",
        ),
        "`linear_with_grad_accumulation_and_async_allreduce(..., gtp_remat_size=)`",
        "`2` with a plain weight",
    ),
    "stride_bool": Case(
        "TypeError",
        (
            "stride=True must be an int",
            "a bool is not a number",
        ),
        "`ColumnParallelLinear(..., stride=)`",
        "`True`",
    ),
    "embedding_dim": Case(
        "ValueError",
        ("embedding_dim=0 must be >= 1",),
        "`VocabParallelEmbedding(8, 0, ...)`",
        "`0`",
    ),
    "layer_device": Case(
        "TypeError",
        ("device=5 must be a torch.device",),
        "`ColumnParallelLinear(..., device=)`",
        "`5`",
    ),
    "layer_tracker": Case(
        "TypeError",
        ("rng_tracker='default' must be a mc_tp_layers.RNGStatesTracker",),
        "`ColumnParallelLinear(..., rng_tracker=)` (CPU init)",
        "`'default'`",
    ),
    "target_outside": Case(
        "ValueError",
        (
            "target holds 1 class index(es) outside [0, 8)",
            "e.g. 8 at index (1,)",
            "ignore_index=",
        ),
        "`vocab_parallel_cross_entropy(logits, target)` at TP 2",
        "target 8 with V = 8",
    ),
    "target_ignore_default": Case(
        "ValueError",
        (
            "outside [0, 8)",
            "e.g. -100",
            "pass ignore_index=<that value>",
        ),
        "`vocab_parallel_cross_entropy(logits, target)`",
        "torch's `-100` without `ignore_index`",
    ),
    "ignore_index_type": Case(
        "TypeError",
        ("ignore_index=-100.0 must be an int",),
        "`vocab_parallel_cross_entropy(..., ignore_index=)`",
        "`-100.0`",
    ),
    "emb_id_range": Case(
        "ValueError",
        (
            "input_ holds 1 token id(s) outside [0, 8)",
            "e.g. 8 at index (0, 1)",
            "num_embeddings=8",
        ),
        "`VocabParallelEmbedding(8, ...)(ids)` at TP 2",
        "id 8 (zeros before)",
    ),
    "emb_id_device": Case(
        "ValueError",
        ("input_ is on meta but the embedding table is on cpu",),
        "`VocabParallelEmbedding(...)(ids)`",
        "ids on another device",
    ),
    "partition_dim_wrap": Case(
        "ValueError",
        (
            "partition_dim=5 is not a dimension of a 2-D tensor",
            "[0, 1]",
        ),
        "`tp_sharded_tensor(t, group, partition_dim)`",
        "`5` on a 2-D tensor (wrapped to 1 before)",
    ),
    "vocab_range_negative": Case(
        "ValueError",
        ("rank=-1 must be >= 0",),
        "`VocabUtility.vocab_range_from_per_partition_vocab_size(4, rank, 2)`",
        "`rank=-1`",
    ),
    "vocab_range_rank": Case(
        "ValueError",
        ("rank=2 must be < world_size=2",),
        "`VocabUtility.vocab_range_from_global_vocab_size(8, rank, 2)`",
        "`rank=2`",
    ),
    "divide_zero": Case(
        "ValueError",
        ("denominator=0 must be >= 1",),
        "`divide(4, 0)`",
        "`0`",
    ),
    "split_partitions": Case(
        "ValueError",
        ("num_partitions=0 must be >= 1",),
        "`split_tensor_along_last_dim(t, 0)`",
        "`0`",
    ),
    "rng_set_states_none": Case(
        "TypeError",
        (
            "states must be a dict",
            "got NoneType",
        ),
        "`RNGStatesTracker.set_states(states)`",
        "`None`",
    ),
    "rng_set_states_value": Case(
        "ValueError",
        (
            "states['a'] is torch.float32 of shape (3,)",
            "torch.uint8 CPU tensor of shape (5056,)",
        ),
        "`RNGStatesTracker.set_states(states)`",
        "a float tensor as a state",
    ),
    "rng_fork_name": Case(
        "TypeError",
        ("name=5 must be a non-empty str",),
        "`RNGStatesTracker.fork(name)`",
        "`5`",
    ),
    "rng_device": Case(
        "TypeError",
        ("device=3 must be a torch.device or a str",),
        "`RNGStatesTracker(device)`",
        "`3`",
    ),
    "seed_type": Case(
        "TypeError",
        ("seed='1' must be an int",),
        "`model_parallel_cuda_manual_seed(seed)`",
        "`'1'`",
    ),
    "drain_weight": Case(
        "TypeError",
        ("weight must be a torch.Tensor, got NoneType",),
        "`drain_embedding_wgrad_compute(..., weight)`",
        "`None`",
    ),
    "drain_buffer_type": Case(
        "TypeError",
        ("embedding_activation_buffer must be a list, got NoneType",),
        "`drain_embedding_wgrad_compute(cfg, buffer, ...)`",
        "`None`",
    ),
    "drain_pair_shape": Case(
        "ValueError",
        (
            "embedding_activation_buffer[0]",
            "shape (2, 7)",
            "[..., 8]",
        ),
        "`drain_embedding_wgrad_compute`",
        "an activation of 7 features for a weight of 8",
    ),
    "mapping_none": Case(
        "TypeError",
        ("input_ must be a torch.Tensor, got NoneType",),
        "`copy_to_tensor_model_parallel_region(x)`",
        "`None`",
    ),
    "split_sizes_type": Case(
        "TypeError",
        ("output_split_sizes=2 must be a list of ints",),
        "`gather_from_sequence_parallel_region(..., output_split_sizes=)`",
        "`2`",
    ),
    "sharded_prefix": Case(
        "TypeError",
        ("prefix=None must be a str",),
        "`layer.sharded_state_dict(prefix)`",
        "`None`",
    ),
    "sharded_offsets": Case(
        "TypeError",
        ("sharded_offsets=5 must be a tuple",),
        "`layer.sharded_state_dict(sharded_offsets=)`",
        "`5`",
    ),
    "row_forward_none": Case(
        "TypeError",
        ("input_ must be a torch.Tensor, got NoneType",),
        "`RowParallelLinear(...)(x)`",
        "`None`",
    ),
    "gtp_shard_none": Case(
        "TypeError",
        ("weight must be a torch.Tensor, got NoneType",),
        "`shard_weight_for_gtp(weight, group)`",
        "`None`",
    ),
    "gtp_pad_range": Case(
        "ValueError",
        ("range_end=2 < range_start=5",),
        "`gtp_local_pad_zero_count(shard, start, end)`",
        "start after end",
    ),
    "init_cpu_partition_dim": Case(
        "ValueError",
        ("partition_dim=2 is not a dimension of a 2-D tensor",),
        "`_initialize_affine_weight_cpu(..., partition_dim, ...)`",
        "`2`",
    ),
    "init_gpu_tracker": Case(
        "TypeError",
        ("rng_tracker='t' must be a mc_tp_layers.RNGStatesTracker",),
        "`_initialize_affine_weight_gpu(..., rng_tracker=)`",
        "`'t'`",
    ),
    "param_dup_none": Case(
        "TypeError",
        ("param must be a torch.Tensor, got NoneType",),
        "`param_is_not_tensor_parallel_duplicate(param)`",
        "`None` (True before)",
    ),
    "copy_attributes_none": Case(
        "TypeError",
        ("destination_tensor must be a torch.Tensor, got NoneType",),
        "`copy_tensor_model_parallel_attributes(dst, src)`",
        "`None`",
    ),
}


def test_bad_input_is_a_clear_error_before_any_collective(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_run_cases):
        assert out["log"] == "[]"
        for name, case in EXPECTED.items():
            for part in (case.error, *case.words):
                assert part in out[name], f"{name}: {part!r} not in {out[name]!r}"
