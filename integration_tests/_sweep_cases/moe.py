"""mc-moe: ``parallelize``, ``sequence_parallel_plan`` and the state-dict functions, on a
tiny model whose MoE layer has ``transformers``' layout (a router ``gate`` and an experts
module with 3-D ``gate_up_proj`` / ``down_proj``) without importing ``transformers``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import mc_moe as _mm
from integration_tests._sweep_cases.base import Ctx, Opaque, arg, mg

mm: Any = _mm
M = "mc-moe"
EXPERTS, HIDDEN, WIDTH = 4, 4, 4


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * WIDTH, HIDDEN))
        self.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, WIDTH))
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out: torch.Tensor = self.act_fn(gate) * up
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = _Experts()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])


EP_PLAN = {"layers.*.experts": "ep_dispatch_experts"}


def _parallelize(ctx: Ctx, **kw: Any) -> object:
    args: dict[str, Any] = {
        "module": _Model(),
        "plan": {},
        "ep_plan": EP_PLAN,
        "config": mg.ModelParallelConfig(),
        "pg_collection": ctx.pgc,
    }
    args.update(kw)
    module, plan = args.pop("module"), args.pop("plan")
    return mm.parallelize(module, plan, **args)


def _converted(ctx: Ctx) -> nn.Module:
    model = _Model()
    mm.parallelize(
        model, {}, ep_plan=EP_PLAN, config=mg.ModelParallelConfig(), pg_collection=ctx.pgc
    )
    return model


def _moe_slots() -> None:
    arg(
        M,
        "parallelize(module=)",
        "misuse",
        lambda c, v: _parallelize(c, module=v),
        ("module",),
        values=(None, "model", Opaque()),
        only=True,
        control=False,
    )
    arg(
        M,
        "parallelize(plan=)",
        "misuse",
        lambda c, v: _parallelize(c, plan=v),
        ("plan",),
        values=("colwise", 3, ["layers"]),
        only=True,
        good={},
    )
    arg(
        M,
        "parallelize(ep_plan=)",
        "misuse",
        lambda c, v: _parallelize(c, ep_plan=v),
        ("ep_plan",),
        values=("ep_dispatch_experts", 3, ["layers"], {"layers.*.gate": "colwise"}),
        only=True,
        good=EP_PLAN,
    )
    arg(
        M,
        "parallelize(config=)",
        "misuse",
        lambda c, v: _parallelize(c, config=v),
        ("config",),
        values=(None, "x", Opaque()),
        only=True,
        good=mg.ModelParallelConfig(),
    )
    arg(
        M,
        "parallelize(pg_collection=)",
        "collection",
        lambda c, v: _parallelize(c, pg_collection=v),
    )
    arg(
        M,
        "parallelize(sequence_dim=)",
        "count",
        lambda c, v: _parallelize(c, sequence_dim=v),
        values=(2,),
    )
    arg(M, "parallelize(global_aux_loss=)", "flag", lambda c, v: _parallelize(c, global_aux_loss=v))
    arg(
        M,
        "sequence_parallel_plan(model=)",
        "misuse",
        lambda c, v: mm.sequence_parallel_plan(v),
        ("model",),
        values=(None, "model", Opaque()),
        only=True,
        control=False,
    )
    arg(
        M,
        "full_state_dict(pg_collection=)",
        "collection",
        lambda c, v: mm.full_state_dict(_converted(c), v),
    )
    arg(
        M,
        "load_full_state_dict(state_dict=)",
        "misuse",
        lambda c, v: mm.load_full_state_dict(_converted(c), v, c.pgc),
        ("state_dict",),
        values=(None, "x", [1.0]),
        only=True,
        control=False,
    )
