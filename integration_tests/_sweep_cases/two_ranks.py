"""Two ranks that disagree (each case runs on a fresh pair of ranks)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from integration_tests._sweep_cases.base import (
    Ctx,
    D,
    F,
    G,
    T,
    ddp,
    ddp_step,
    mf,
    mg,
    mlp,
    mp_config,
    step,
    tp_config,
    tpl,
    two_ranks,
)
from integration_tests._sweep_cases.finalize import (
    _tokens,
)


def _two_rank_world(**sizes: Any) -> Any:
    return mg.initialize_model_parallel(timeout=timedelta(seconds=8), **sizes)


def _ddp_disagree(ctx: Ctx, field: str, mine: object, theirs: object, **same: Any) -> None:
    """Rank 0 builds its DDP with ``field=mine``, rank 1 with ``theirs`` (``same`` on both;
    a bucket size of 4 elements with overlap makes several buckets, so a disagreement
    changes the collectives; bf16 params make grad_reduce_in_fp32 change the grad dtype)."""
    pgc = _two_rank_world()
    fields = {"overlap_grad_reduce": True, "bucket_size": 4, **same}
    fields[field] = mine if ctx.rank == 0 else theirs
    module = mlp().to(torch.bfloat16) if field == "grad_reduce_in_fp32" else None
    model = ddp(ctx, pgc=pgc, module=module, **fields)
    model.zero_grad_buffer()
    model(torch.ones(3, 4, dtype=next(model.parameters()).dtype)).sum().backward()
    model.finish_grad_sync()


def _ddp_hidden(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, module=mlp(8 if ctx.rank == 0 else 6))
    ddp_step(model)


def _ddp_per_token(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, config=mp_config(calculate_per_token_loss=ctx.rank == 0))
    ddp_step(model)
    mf.finalize_model_grads([model], pg_collection=pgc)


def _tokens_on_one_rank(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, config=mp_config(calculate_per_token_loss=True))
    model.zero_grad_buffer()
    step(model)
    tokens = _tokens(3, torch.int64) if ctx.rank == 0 else None
    mf.finalize_model_grads([model], num_tokens=tokens, pg_collection=pgc)


def _tp_disagree(ctx: Ctx) -> None:
    mg.initialize_model_parallel(
        tensor_model_parallel_size=2 if ctx.rank == 0 else 1, timeout=timedelta(seconds=8)
    )


def _init_disagree(ctx: Ctx, **sizes: Any) -> None:
    mine = {k: v[ctx.rank] for k, v in sizes.items()}
    mg.initialize_model_parallel(timeout=timedelta(seconds=8), **mine)


def _tp2(ctx: Ctx) -> tuple[Any, Any]:
    pgc = _two_rank_world(tensor_model_parallel_size=2)
    return pgc, tp_config(tensor_model_parallel_size=2)


def _column_input(ctx: Ctx) -> None:
    pgc, cfg = _tp2(ctx)
    size = 4 if ctx.rank == 0 else 6
    layer = tpl.ColumnParallelLinear(
        size, 4, config=cfg, init_method=nn.init.ones_, pg_collection=pgc, gather_output=True
    )
    layer(torch.ones(2, size, requires_grad=True))[0].sum().backward()


def _row_output(ctx: Ctx, equal_numel: bool) -> None:
    pgc, cfg = _tp2(ctx)
    out = 6 if ctx.rank == 0 else 4
    rows = (2 if ctx.rank == 0 else 3) if equal_numel else 2
    layer = tpl.RowParallelLinear(
        4,
        out,
        config=cfg,
        init_method=nn.init.ones_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
        pg_collection=pgc,
    )
    layer(torch.ones(rows, 2, requires_grad=True))[0].sum().backward()


def _embeddings(ctx: Ctx) -> None:
    pgc, cfg = _tp2(ctx)
    vocab = 8 if ctx.rank == 0 else 10
    layer = tpl.VocabParallelEmbedding(
        vocab, 4, init_method=nn.init.ones_, config=cfg, pg_collection=pgc
    )
    layer(torch.tensor([[1, 5]])).sum().backward()


def _cross_entropy(ctx: Ctx) -> None:
    pgc, _ = _tp2(ctx)
    slice_size = 4 if ctx.rank == 0 else 5
    logits = torch.zeros(3, slice_size, requires_grad=True)
    tpl.vocab_parallel_cross_entropy(
        logits, torch.tensor([0, 1, 2]), tp_group=pgc.tp
    ).sum().backward()


def _checked(fn: Callable[[Ctx], object]) -> Callable[[Ctx], object]:
    def run(ctx: Ctx) -> object:
        os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"] = "1"
        return fn(ctx)

    return run


_DISAGREEMENTS: tuple[tuple[str, str, Callable[[Ctx], object], tuple[str, ...]], ...] = (
    (G, "initialize_model_parallel: tp differs", _tp_disagree, ("tensor_model_parallel_size",)),
    (
        G,
        "initialize_model_parallel: pp differs",
        lambda c: _init_disagree(c, pipeline_model_parallel_size=(2, 1)),
        ("pipeline_model_parallel_size",),
    ),
    (
        G,
        "initialize_model_parallel: order differs",
        lambda c: _init_disagree(
            c, tensor_model_parallel_size=(2, 2), order=("tp-dp-pp", "dp-tp-pp")
        ),
        ("order",),
    ),
    (
        G,
        "initialize_model_parallel: optimizer instances differ",
        lambda c: _init_disagree(c, num_distributed_optimizer_instances=(2, 1)),
        ("num_distributed_optimizer_instances",),
    ),
    (
        G,
        "initialize_model_parallel: cp differs",
        lambda c: _init_disagree(c, context_parallel_size=(2, 1)),
        ("context_parallel_size",),
    ),
    (F, "finalize_model_grads: num_tokens on one rank only", _tokens_on_one_rank, ("num_tokens",)),
    (
        D,
        "DDP: bucket_size differs",
        lambda c: _ddp_disagree(c, "bucket_size", 4, None),
        ("bucket_size",),
    ),
    (D, "DDP: hidden sizes differ", _ddp_hidden, ("shape", "param", "numel")),
    (
        D,
        "DDP: overlap_grad_reduce differs",
        lambda c: _ddp_disagree(c, "overlap_grad_reduce", True, False),
        ("overlap_grad_reduce",),
    ),
    (
        D,
        "DDP: grad_reduce_in_fp32 differs",
        lambda c: _ddp_disagree(c, "grad_reduce_in_fp32", True, False),
        ("grad_reduce_in_fp32",),
    ),
    (
        D,
        "DDP: use_distributed_optimizer differs",
        lambda c: _ddp_disagree(c, "use_distributed_optimizer", True, False),
        ("use_distributed_optimizer",),
    ),
    (
        D,
        "DDP: check_for_nan_in_grad differs",
        lambda c: _ddp_disagree(c, "check_for_nan_in_grad", True, False),
        ("check_for_nan_in_grad",),
    ),
    (D, "DDP: calculate_per_token_loss differs", _ddp_per_token, ("calculate_per_token_loss",)),
    (T, "ColumnParallelLinear: input_size differs", _column_input, ("input_size",)),
    (
        T,
        "RowParallelLinear: output_size differs",
        lambda c: _row_output(c, False),
        ("output_size",),
    ),
    (
        T,
        "RowParallelLinear: output_size differs at equal numel",
        lambda c: _row_output(c, True),
        ("output_size",),
    ),
    (T, "VocabParallelEmbedding: num_embeddings differs", _embeddings, ("num_embeddings",)),
    (T, "vocab_parallel_cross_entropy: vocab slice differs", _cross_entropy, ("vocab", "logits")),
)


def _two_rank_slots() -> None:
    for package, key, fn, names in _DISAGREEMENTS:
        two_ranks(package, key, fn, names)
    for package, key, fn, names in _DISAGREEMENTS:
        if key.startswith("initialize_model_parallel: ") and "tp" not in key:
            continue
        two_ranks(package, f"{key} (schedule check on)", _checked(fn), names)
