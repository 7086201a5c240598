r"""The routers of ``transformers`` MoE models and Megatron-Core's router steps.

**Aux-loss-free expert bias** (arXiv:2408.15664; Megatron's ``moe_router_enable_expert_bias``).
A router holding a per-expert ``e_score_correction_bias`` (DeepSeek-V3's: added to the
scores that choose the experts, not to the weights) gets what Megatron's
``finalize_model_grads`` reads (``mc_finalize._update_router_expert_bias``):
``expert_bias`` (the same tensor, a buffer not saved: the state dict keeps the model's own
name; the hook below re-points it after ``module.to()`` copied the buffers apart) and
``local_tokens_per_expert`` (a float32 buffer, not saved), which a forward hook adds each
training forward's routed tokens to (with gradients enabled, as Megatron counts them).
Finalize then, once per global batch::

    t    ← Σ_{tp·dp·cp} local_tokens_per_expert        (one all-reduce, all routers stacked)
    bias ← bias + rate · sign(mean_e(t) − t)            rate = moe_router_bias_update_rate

and zeroes the counters.

**Global-batch load-balancing loss.** ``transformers``' MoE causal LMs (Mixtral, Qwen3-MoE,
OLMoE, gpt-oss) add ``router_aux_loss_coef · aux`` to the loss when asked for router logits,
with ``load_balancing_loss_func``: over the router logits of every layer pooled (L layers,
R = L·T rows, E experts, top-k)::

    f_e = #(rows choosing e) / R        P_e = Σ_rows softmax(logits)_e / R
    aux = E · Σ_e f_e · P_e

computed from the rank's own tokens, so a data-parallel run trains another objective than
one process. :func:`use_global_aux_loss` makes the model's forward compute the same formula
from the statistics of the global batch: the counts, probability sums and row counts of
every rank that holds different tokens (``tp_dp_cp``: data-parallel ranks, and the TP ranks'
sequence parts under sequence parallelism) summed in one all-reduce of ``2E + 1`` floats per
forward. The backward of that sum multiplies the probability sums' gradient by ``|dp_cp|``:
every rank holds the same ``∂aux/∂P`` and DDP then averages over ``dp_cp``, so each rank's
share enters the step once, as in one process.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.argcheck import type_name
from mc_groups.errors import InputValueError

__all__ = [
    "enable_expert_bias",
    "global_load_balancing_loss",
    "routers_with_bias",
    "use_global_aux_loss",
]

BIAS = "e_score_correction_bias"
AUX_LABEL = "moe aux loss statistics"


def routers_with_bias(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The routers of ``model`` that hold a per-expert ``e_score_correction_bias``."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, BIAS, None), torch.Tensor)
    ]


def enable_expert_bias(model: torch.nn.Module) -> None:
    """Give every router with an ``e_score_correction_bias`` Megatron's ``expert_bias`` /
    ``local_tokens_per_expert`` and the counting hook (module notes). A model without such a
    router is an error naming ``config.moe_router_enable_expert_bias``. No communication."""
    routers = routers_with_bias(model)
    if not routers:
        raise InputValueError(
            f"config.moe_router_enable_expert_bias=True but {type_name(model)} has no router "
            f"with a per-expert bias that routing reads ({BIAS}, as DeepSeek-V3's): its "
            "routers cannot take Megatron's aux-loss-free balancing; set "
            "moe_router_enable_expert_bias=False"
        )
    for _, router in routers:
        if hasattr(router, "local_tokens_per_expert"):
            continue  # wired already
        bias: torch.Tensor = getattr(router, BIAS)
        router.register_buffer(
            "local_tokens_per_expert",
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device),
            persistent=False,
        )
        router.register_buffer("expert_bias", bias, persistent=False)
        router.register_forward_hook(_count_routed_tokens)


def _count_routed_tokens(module: torch.nn.Module, _args: Any, output: Any) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return
    bias: torch.Tensor = getattr(module, BIAS)
    if module.expert_bias is not bias:  # moved since (module.to() copies each buffer apart)
        module.register_buffer("expert_bias", bias, persistent=False)
    indices = output[-1]  # (logits, weights, top-k indices), as transformers' routers return
    counts: torch.Tensor = module.local_tokens_per_expert  # type: ignore[assignment]
    with torch.no_grad():
        counts += torch.bincount(indices.reshape(-1), minlength=counts.numel()).to(counts.dtype)


class _SumWithScaledGrad(torch.autograd.Function):
    """Forward: SUM over ``group`` (a new tensor); backward: the gradient times ``scale``
    (no communication: every rank holds the same upstream gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = x.clone()
        mg.all_reduce(out, group, label=AUX_LABEL)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale, None, None


def global_load_balancing_loss(
    router_logits: list[torch.Tensor],
    num_experts: int,
    top_k: int,
    group: dist.ProcessGroup,
    grad_scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``transformers``' ``load_balancing_loss_func`` on the global batch (module notes):
    ``router_logits`` this rank's per-layer ``[rows, E]`` logits, ``mask`` its rows' flat
    attention mask (1 = counted), ``group`` the ranks holding different tokens."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = torch.zeros(1, dtype=torch.float32, device=counts.device)
    weight = None if mask is None else mask.reshape(-1).to(torch.float32)
    for logits in router_logits:
        routing = torch.nn.functional.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        if weight is None:
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts)
            probs = probs + routing.float().sum(dim=0)
            rows = rows + routing.shape[0]
        else:
            picked = weight.repeat_interleave(top_k)
            counts = counts.scatter_add(0, chosen.reshape(-1), picked)
            probs = probs + (routing.float() * weight.unsqueeze(-1)).sum(dim=0)
            rows = rows + weight.sum()
    stats = torch.cat([counts.detach(), probs, rows.detach()])
    total = _SumWithScaledGrad.apply(stats, group, grad_scale)  # type: ignore[no-untyped-call]
    f, p, n = total[:num_experts], total[num_experts : 2 * num_experts], total[-1]
    return torch.sum((f / n) * (p / n).unsqueeze(0)) * num_experts


def use_global_aux_loss(
    model: torch.nn.Module,
    routers: list[torch.nn.Module],
    pg_collection: mg.ProcessGroupCollection,
    sequence_dim: int = 1,
) -> None:
    """Make ``model``'s forward (a ``transformers`` MoE causal LM with
    ``router_aux_loss_coef``) compute its load-balancing loss on the global batch (module
    notes) whenever it computes one (``output_router_logits``); the routers' logits are
    read by forward hooks, the model's own aux loss is not computed. No communication
    here; one all-reduce of ``2E + 1`` floats over ``tp_dp_cp`` per forward that computes
    the loss."""
    group = pg_collection.require("tp_dp_cp", "the global-batch load-balancing loss")
    dp = mg.group_size(pg_collection.require("dp_cp", "the global-batch load-balancing loss"))
    tp = pg_collection.require("tp", "the global-batch load-balancing loss")
    captured: list[torch.Tensor] = []
    recording = [False]  # only inside a forward that computes the loss

    def record(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        if recording[0]:
            captured.append(output[0])

    for router in routers:
        router.register_forward_hook(record)
    original: Callable[..., Any] = model.forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        wanted = kwargs.pop("output_router_logits", None)
        config = getattr(self, "config", None)
        if wanted is None:
            wanted = bool(getattr(config, "output_router_logits", False))
        if not wanted:
            return original(*args, output_router_logits=False, **kwargs)
        captured.clear()
        recording[0] = True
        try:
            out = original(*args, output_router_logits=False, **kwargs)
        finally:
            recording[0] = False
        logits, mask = list(captured), _local_mask(kwargs.get("attention_mask"), tp, sequence_dim)
        captured.clear()
        own: Any = self  # a transformers MoE causal LM (checked by the caller)
        aux = global_load_balancing_loss(
            logits, int(own.num_experts), int(own.num_experts_per_tok), group, float(dp), mask
        )
        if out.loss is not None and kwargs.get("labels") is not None:
            out.loss = out.loss + own.router_aux_loss_coef * aux.to(out.loss.device)
        out.aux_loss, out.router_logits = aux, tuple(logits)
        return out

    model.forward = types.MethodType(forward, model)


def _local_mask(
    mask: torch.Tensor | None, tp: dist.ProcessGroup, sequence_dim: int
) -> torch.Tensor | None:
    """This rank's rows of a ``[b, s]`` attention mask: its part of the sequence under
    sequence parallelism (the routers saw ``[b, s/W]``)."""
    if mask is None or mask.dim() != 2:
        return mask
    size = mg.group_size(tp)
    if size == 1:
        return mask
    part = mask.shape[sequence_dim] // size
    return mask.narrow(sequence_dim, mg.group_rank(tp) * part, part)
