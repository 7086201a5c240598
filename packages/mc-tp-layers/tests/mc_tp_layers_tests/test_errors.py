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
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import config, world

Z = torch.nn.init.zeros_
_NOT_A_CONFIG: Any = object()
LONG_TARGET = torch.zeros(2, 2, dtype=torch.long)


def _loose(value: object) -> Any:
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


def _cases(pgc: mg.ProcessGroupCollection) -> dict[str, Callable[[], Any]]:
    cfg, sp = config(2), config(2, sequence_parallel=True)
    fused = config(2, gradient_accumulation_fusion=True)
    col_sp = tpl.ColumnParallelLinear(8, 4, config=sp, init_method=Z, pg_collection=pgc)
    row_sp = tpl.RowParallelLinear(
        4,
        8,
        config=sp,
        init_method=Z,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
        pg_collection=pgc,
    )
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
        "input_size": lambda: tpl.RowParallelLinear(
            5,
            8,
            config=cfg,
            init_method=Z,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        ),
        "vocab": lambda: tpl.VocabParallelEmbedding(
            9, 4, init_method=Z, config=cfg, pg_collection=pgc
        ),
        "sp_not_parallel": lambda: tpl.RowParallelLinear(
            4,
            8,
            config=sp,
            init_method=Z,
            bias=True,
            input_is_parallel=False,
            skip_bias_add=False,
            pg_collection=pgc,
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
        "both_reductions": lambda: tpl.linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8), torch.ones(2, 8), None, False, True, True, tp_group=pgc.tp
        ),
        "deferral_without_fusion": lambda: tpl.linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8), torch.ones(2, 8), None, False, False, True, [], 0, pgc.tp
        ),
        "drain_mismatch": lambda: tpl.drain_embedding_wgrad_compute(
            cfg, [torch.ones(1)], [], torch.ones(2, 8), pgc.tp
        ),
        "config": lambda: tpl.ColumnParallelLinear(
            8, 4, config=_NOT_A_CONFIG, init_method=Z, pg_collection=pgc
        ),
        "mapping_group": lambda: tpl.copy_to_tensor_model_parallel_region(
            torch.ones(2, 4), group=_loose("tp")
        ),
        "split_sizes_count": lambda: tpl.gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=pgc.tp, output_split_sizes=[2]
        ),
        "split_sizes_rows": lambda: tpl.gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=pgc.tp, output_split_sizes=[3, 3]
        ),
        "last_dim_split": lambda: tpl.scatter_to_tensor_model_parallel_region(
            torch.ones(2, 3), group=pgc.tp
        ),
        "tokens_split": lambda: tpl.all_to_all_hp2sp(torch.ones(3, 3), group=pgc.tp),
        "smoothing": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), LONG_TARGET, label_smoothing=1.0, tp_group=pgc.tp
        ),
        "target_dtype": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), torch.zeros(2, 2), tp_group=pgc.tp
        ),
        "target_shape": lambda: tpl.vocab_parallel_cross_entropy(
            torch.ones(2, 2, 4), torch.zeros(2, 3, dtype=torch.long), tp_group=pgc.tp
        ),
        "frozen_deferral": lambda: tpl.linear_with_frozen_weight(
            torch.ones(2, 8), torch.ones(2, 8), None, False, False, False, pgc.tp, [], None
        ),
        "output_dtype": lambda: tpl.linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 8),
            torch.ones(2, 8),
            None,
            False,
            False,
            False,
            tp_group=pgc.tp,
            output_dtype=_loose("bf16"),
        ),
        "gtp_size": lambda: tpl.linear_with_grad_accumulation_and_async_allreduce(
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
    tpl.clear_cuda_rng_tracker()  # "device_init" needs no default tracker in this worker
    try:
        messages: dict[str, str] = {}
        with mg.record_collectives() as log:
            for name, call in _cases(pgc).items():
                try:
                    call()
                    messages[name] = "no error"
                except (ValueError, TypeError) as err:
                    messages[name] = f"{type(err).__name__}: {err}"
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
}


def test_bad_input_is_a_clear_error_before_any_collective(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_run_cases):
        assert out["log"] == "[]"
        for name, case in EXPECTED.items():
            for part in (case.error, *case.words):
                assert part in out[name], f"{name}: {part!r} not in {out[name]!r}"
