"""mc-finalize: ``finalize_model_grads`` and its steps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from integration_tests._sweep_cases.base import (
    INF,
    NAN,
    Chunk,
    Ctx,
    F,
    Opaque,
    Ref,
    _finalize_ready,
    arg,
    chunk_with,
    ddp,
    mf,
    mg,
    misuse,
    mp_config,
    step,
    z,
)


def _finalize(ctx: Ctx, per_token: bool = False, **kw: Any) -> None:
    model = _finalize_ready(ctx, per_token)
    args = {"pg_collection": ctx.pgc}
    args.update(kw)
    mf.finalize_model_grads(args.pop("model", [model]), **args)


def _tokens(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _finalize_slots() -> None:
    arg(
        F,
        "finalize_model_grads(model=)",
        "misuse",
        lambda c, v: _finalize(c, model=v),
        ("model",),
        values=(None, "model", [None], [Ref("ddp"), "x"], Ref("ddp"), (), [Ref("module")]),
        only=True,
    )
    arg(
        F,
        "finalize_model_grads(num_tokens=)",
        "misuse",
        lambda c, v: _finalize(c, True, num_tokens=v),
        ("num_tokens",),
        values=(
            _tokens(NAN),
            _tokens(INF),
            _tokens(-INF),
            _tokens(-1, torch.int64),
            _tokens(-0.5),
            torch.tensor([]),
            [4],
            4.0,
            4,
            _tokens(4, torch.float16),
            torch.tensor([[4]]),
            None,
        ),
        only=True,
        good=_tokens(4, torch.int64),
    )
    arg(
        F,
        "finalize_model_grads(num_tokens=) without per-token loss",
        "misuse",
        lambda c, v: _finalize(c, False, num_tokens=v),
        ("num_tokens", "calculate_per_token_loss"),
        values=(_tokens(4, torch.int64),),
        only=True,
        good=None,
    )
    arg(
        F,
        "finalize_model_grads(pg_collection=)",
        "misuse",
        lambda c, v: _finalize(c, pg_collection=v),
        ("pg_collection",),
        values=("tp", Ref("world"), {"tp": None}, 3),
        only=True,
        good=Ref("pgc"),
    )
    arg(
        F,
        "finalize_model_grads(force_all_reduce=)",
        "flag",
        lambda c, v: _finalize(c, force_all_reduce=v),
    )
    arg(F, "finalize_model_grads(peer_checks=)", "flag", lambda c, v: _finalize(c, peer_checks=v))
    misuse(
        F,
        "finalize_model_grads twice in one iteration",
        _finalize_twice,
        ("finalize", "twice", "already"),
    )
    misuse(
        F, "finalize_model_grads([ddp, ddp])", _finalize_same_chunk, ("model[1]", "same", "twice")
    )
    misuse(
        F,
        "finalize_model_grads after destroy_model_parallel",
        _finalize_after_destroy,
        ("destroy",),
    )
    arg(
        F,
        "reset_model_temporary_tensors(config=)",
        "misuse",
        lambda c, v: mf.reset_model_temporary_tensors(v, [Chunk()]),
        ("config",),
        values=(None, "x", [Ref("ddp")]),
        only=True,
        good=mp_config(),
    )
    arg(
        F,
        "reset_model_temporary_tensors(model=)",
        "misuse",
        lambda c, v: mf.reset_model_temporary_tensors(mp_config(), v),
        ("model",),
        values=(None, "x", [None], Ref("module")),
        only=True,
        good=[Chunk()],
    )


def _finalize_twice(ctx: Ctx) -> None:
    model = _finalize_ready(ctx)
    mf.finalize_model_grads([model], pg_collection=ctx.pgc)
    mf.finalize_model_grads([model], pg_collection=ctx.pgc)


def _finalize_same_chunk(ctx: Ctx) -> None:
    model = _finalize_ready(ctx)
    mf.finalize_model_grads([model, model], pg_collection=ctx.pgc)


def _finalize_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    model = ddp(ctx, pgc=pgc)
    model.zero_grad_buffer()
    step(model)
    mg.destroy_model_parallel(pgc)
    mf.finalize_model_grads([model], pg_collection=pgc)


_GROUP_STEPS = (
    ("_allreduce_non_tensor_model_parallel_grads", 2),
    ("_allreduce_layernorm_grads", 2),
    ("_allreduce_conditional_embedding_grads", 2),
    ("_allreduce_router_grads", 2),
    ("_update_router_expert_bias", 2),
    ("_update_router_qb_beta", 2),
)


def _step_slots() -> None:
    config = mp_config
    for name, _ in _GROUP_STEPS:
        fn = getattr(mf, name)
        arg(
            F,
            f"{name}(model=)",
            "misuse",
            lambda c, v, f=fn: f(v, config(), c.world_group),
            ("model",),
            values=(None, "x", [None]),
            only=True,
            good=[Chunk()],
        )
        arg(
            F,
            f"{name}(config=)",
            "misuse",
            lambda c, v, f=fn: f([Chunk()], v, c.world_group),
            ("config",),
            values=(None, "x", Opaque()),
            only=True,
            good=config(),
        )
        arg(
            F,
            f"{name}(group=)",
            "opt_group",
            lambda c, v, f=fn: f([Chunk()], config(), v),
            ("group",),
        )
    gtp = mf._allreduce_replicated_grads_over_gtp_remat_group
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(gtp_remat_group=)",
        "opt_group",
        lambda c, v: gtp([Chunk()], v, None),
        ("gtp_remat_group",),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(egtp_remat_group=)",
        "opt_group",
        lambda c, v: gtp([Chunk()], None, v),
        ("egtp_remat_group",),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(calculate_per_token_loss=)",
        "flag",
        lambda c, v: gtp([Chunk()], c.world_group, None, v),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(model=)",
        "misuse",
        lambda c, v: gtp(v, c.world_group, None),
        ("model",),
        values=(None, "x", [None]),
        only=True,
        good=[Chunk()],
    )
    embed = mf._allreduce_embedding_grad
    getter = mf._get_position_embedding_weight
    arg(
        F,
        "_allreduce_embedding_grad(embd_group=)",
        "opt_group",
        lambda c, v: embed([Chunk()], v, c.world_group, getter),
        ("embd_group",),
    )
    arg(
        F,
        "_allreduce_embedding_grad(pp_group=)",
        "opt_group",
        lambda c, v: embed([Chunk()], c.world_group, v, getter),
        ("pp_group",),
    )
    arg(
        F,
        "_allreduce_embedding_grad(weight_getter=)",
        "misuse",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, v),
        ("weight_getter",),
        values=(None, "x", 3),
        only=True,
        good=lambda m: None,
    )
    arg(
        F,
        "_allreduce_embedding_grad(skip_if_none=)",
        "flag",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, lambda m: None, v),
    )
    arg(
        F,
        "_allreduce_embedding_grad(config=)",
        "misuse",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, lambda m: None, True, v),
        ("config",),
        values=("x", 3),
        only=True,
        good=None,
    )
    words = mf._allreduce_word_embedding_grads
    arg(
        F,
        "_allreduce_word_embedding_grads(embd_group=)",
        "opt_group",
        lambda c, v: words([Chunk()], mp_config(), v, c.world_group),
        ("embd_group",),
    )
    arg(
        F,
        "_allreduce_word_embedding_grads(config=)",
        "misuse",
        lambda c, v: words([Chunk()], v, c.world_group, c.world_group),
        ("config",),
        values=(None, "x"),
        only=True,
        good=mp_config(),
    )
    positions = mf._allreduce_position_embedding_grads
    arg(
        F,
        "_allreduce_position_embedding_grads(pos_emb_group=)",
        "opt_group",
        lambda c, v: positions([Chunk()], mp_config(), v, c.world_group),
        ("pos_emb_group",),
    )
    arg(
        F,
        "_get_shared_word_embedding_weight(model_module=)",
        "misuse",
        lambda c, v: mf._get_shared_word_embedding_weight(v, mp_config()),
        ("model_module",),
        values=(None, "x", 3),
        only=True,
        good=Ref("module"),
    )
    arg(
        F,
        "_get_shared_word_embedding_weight(config=)",
        "misuse",
        lambda c, v: mf._get_shared_word_embedding_weight(_SharedModel(), v),
        ("config",),
        values=(None, "x"),
        only=True,
        good=mp_config(),
    )
    arg(
        F,
        "_get_position_embedding_weight(model_module=)",
        "misuse",
        lambda c, v: mf._get_position_embedding_weight(v),
        ("position_embeddings",),
        values=(None, "x"),
        only=True,
    )
    arg(
        F,
        "_get_main_grad_attr(param=)",
        "misuse",
        lambda c, v: mf._get_main_grad_attr(v),
        ("param",),
        values=(None, "x", 3),
        only=True,
        good=nn.Parameter(z()),
    )
    arg(
        F,
        "_unshard_if_dtensor(tensor=)",
        "misuse",
        lambda c, v: mf._unshard_if_dtensor(v),
        ("tensor",),
        values=(None, "x", 3),
        only=True,
        good=z(),
    )
    arg(
        F,
        "_reshard_if_dtensor(tensor_to_shard=)",
        "misuse",
        lambda c, v: mf._reshard_if_dtensor(v, z()),
        ("tensor_to_shard",),
        values=(None, "x"),
        only=True,
        good=z(),
    )
    arg(
        F,
        "_reshard_if_dtensor(reference_tensor=)",
        "misuse",
        lambda c, v: mf._reshard_if_dtensor(z(), v),
        ("reference_tensor",),
        values=(None, "x"),
        only=True,
        good=z(),
    )
    bias = mf._update_router_expert_bias
    qb = mf._update_router_qb_beta
    cfg = mp_config
    arg(
        F,
        "_update_router_expert_bias router state",
        "misuse",
        lambda c, v: bias([chunk_with(**v)], cfg(), c.world_group),
        ("local_tokens_per_expert", "expert_bias"),
        values=(
            {"local_tokens_per_expert": z(3)},
            {"local_tokens_per_expert": "x"},
            {"expert_bias": z(2, torch.int64)},
        ),
        only=True,
        good={},
    )
    arg(
        F,
        "_update_router_qb_beta router state",
        "misuse",
        lambda c, v: qb([chunk_with(**v)], cfg(), c.world_group),
        ("qb_beta_accum", "qb_beta_count", "qb_beta"),
        values=({"qb_beta_accum": z(3)}, {"qb_beta_count": "x"}, {"qb_beta": z(2, torch.int64)}),
        only=True,
        good={},
    )
    arg(
        F,
        "finalize config.moe_router_bias_update_rate",
        "misuse",
        lambda c, v: bias([Chunk()], _Cfg(moe_router_bias_update_rate=v), c.world_group),
        ("moe_router_bias_update_rate",),
        values=(NAN, -1.0, "x", True),
        only=True,
        good=0.1,
    )


class _Cfg:
    sequence_parallel = False
    calculate_per_token_loss = False

    def __init__(self, **attrs: Any) -> None:
        for key, value in attrs.items():
            setattr(self, key, value)


class _SharedModel(nn.Module):
    share_embeddings_and_output_weights = True

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(z())

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.weight
