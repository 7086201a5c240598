"""Once per global batch: MoE router load-balancing state, then the per-batch counters reset.

Expert bias (aux-loss-free balancing, arXiv:2408.15664), for every training-mode module
with ``expert_bias`` and ``local_tokens_per_expert`` (E experts each) whose bias is not
frozen (``frozen_expert_bias`` absent or False, as in Megatron-Core):

    t      ← Σ_{tp·dp·cp} local_tokens_per_expert      (one all-reduce of a stacked copy)
    bias   ← bias + rate · sign(mean_e(t) − t)          rate = moe_router_bias_update_rate

An expert that got fewer tokens than the average gets a higher bias, so more tokens next
batch.

Quantile balancing, for every training-mode module with ``qb_beta_accum`` (sum of per
micro-batch quantile estimates), ``qb_beta_count`` (how many) and ``qb_beta``:

    q      ← AVG_{dp·cp} (qb_beta_accum / max(qb_beta_count, 1))   (one all-reduce, stacked;
             finalize_model_grads passes dp_cp_gtp_remat under gtp_remat: its peers see
             different tokens)
    b      ← ema · qb_beta + (1 − ema) · q                         ema = ..._quantile_balancing_ema
    qb_beta ← b − mean_e(b)                                         (zero-sum: no overall shift)

Eval-mode modules (e.g. a frozen teacher in distillation) keep their biases. The counters
(``local_tokens_per_expert``, ``qb_beta_accum``, ``qb_beta_count``) keep this rank's local
values through the updates and are zeroed afterwards by
:func:`reset_model_temporary_tensors`, for every module (eval mode included), as in
Megatron-Core, where the updates reduce stacked copies and only the reset zeroes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._inputs import _as_chunks, _modules, _require_group
from mc_finalize._settings import _read_settings, _Settings
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError


def _update_router_expert_bias(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    tp_dp_cp_group: dist.ProcessGroup | None = None,
) -> None:
    """Update every training router's expert bias from the global tokens per expert.

    All-reduces the routers' ``local_tokens_per_expert`` (stacked, one collective) across
    TP×DP×CP ranks and moves each bias by ``moe_router_bias_update_rate`` towards balance;
    the local counters are left for :func:`reset_model_temporary_tensors`. Routers with
    ``frozen_expert_bias=True`` keep their bias. ``tp_dp_cp_group=None`` reads the default
    collection's ``tp_dp_cp``.
    """
    chunks = _as_chunks(model)
    rate = _read_settings(config).moe_router_bias_update_rate
    group = _require_group(
        tp_dp_cp_group, "tp_dp_cp_group", "tp_dp_cp", "_update_router_expert_bias"
    )
    _update_expert_bias(chunks, rate, group)


def _update_expert_bias(
    chunks: Sequence[ModelChunk], rate: float, group: dist.ProcessGroup
) -> None:
    """The core of :func:`_update_router_expert_bias` on checked inputs."""
    routers = [
        m
        for m in _training_modules(chunks, ("expert_bias", "local_tokens_per_expert"))
        if not getattr(m, "frozen_expert_bias", False)
    ]
    if not routers:
        return  # hybrid models: dense layers only on this stage
    _check_state(routers, "local_tokens_per_expert", "expert_bias")
    with torch.no_grad():
        tokens = torch.stack([_tensor(m, "local_tokens_per_expert") for m in routers])
        mg.all_reduce(tokens, group, op=mg.ReduceOp.SUM, label="router expert bias")
        # float64: only the sign matters, and large integral counts must compare exactly.
        counts = tokens.to(torch.float64)
        offset = counts.mean(dim=-1, keepdim=True) - counts
        for router, step in zip(routers, torch.sign(offset) * rate, strict=True):
            bias = _tensor(router, "expert_bias")
            bias.add_(step.to(bias.dtype))


def _update_router_qb_beta(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    dp_cp_group: dist.ProcessGroup | None = None,
) -> None:
    """Update the quantile-balancing per-expert bias once per global batch.

    Averages each router's accumulated quantile (``qb_beta_accum / qb_beta_count``) across
    DP×CP, EMA-blends it with the current ``qb_beta``, re-centres it and writes it back;
    the accumulators are left for :func:`reset_model_temporary_tensors`.
    ``dp_cp_group=None`` reads the default's ``dp_cp``;
    ``finalize_model_grads`` passes ``dp_cp_gtp_remat`` under gtp_remat.
    """
    chunks = _as_chunks(model)
    ema = _read_settings(config).quantile_balancing_ema
    group = _require_group(dp_cp_group, "dp_cp_group", "dp_cp", "_update_router_qb_beta")
    _update_qb_beta(chunks, ema, group)


def _update_qb_beta(chunks: Sequence[ModelChunk], ema: float, group: dist.ProcessGroup) -> None:
    """The core of :func:`_update_router_qb_beta` on checked inputs."""
    routers = _training_modules(chunks, ("qb_beta", "qb_beta_accum", "qb_beta_count"))
    if not routers:
        return
    _check_state(routers, "qb_beta_accum", "qb_beta")
    for router in routers:
        _tensor(router, "qb_beta_count")
    with torch.no_grad():
        quantiles = torch.stack([_mean_quantile(m) for m in routers])
        mg.all_reduce(quantiles, group, op=mg.ReduceOp.AVG, label="router qb_beta")
        for router, quantile in zip(routers, quantiles, strict=True):
            beta = _tensor(router, "qb_beta")
            blended = ema * beta + (1.0 - ema) * quantile
            beta.copy_(blended - blended.mean(dim=-1, keepdim=True))


def reset_model_temporary_tensors(config: FinalizeConfig, model: Sequence[ModelChunk]) -> None:
    """Reset the per-global-batch accumulators of every module (no communication).

    Zeroes ``local_tokens_per_expert`` when ``config.moe_router_enable_expert_bias``; calls
    ``reset_global_aux_loss_tracker()`` when the load-balancing type includes
    ``global_aux_loss``; zeroes ``qb_beta_accum`` / ``qb_beta_count`` of every module that
    has them (whatever the load-balancing type, as Megatron-Core). Modules in eval mode are
    reset too.
    """
    _reset_temporary_tensors(_as_chunks(model), _read_settings(config))


def _reset_temporary_tensors(chunks: Sequence[ModelChunk], settings: _Settings) -> None:
    """The core of :func:`reset_model_temporary_tensors` on checked inputs."""
    for chunk in chunks:
        for module in _modules(chunk):
            if settings.moe_router_enable_expert_bias and _has(module, "local_tokens_per_expert"):
                _tensor(module, "local_tokens_per_expert").zero_()
            if settings.global_aux_loss:
                reset = getattr(module, "reset_global_aux_loss_tracker", None)
                if callable(reset):
                    reset()
            if _has(module, "qb_beta_accum"):
                _reset_quantiles(module)


def _training_modules(chunks: Sequence[ModelChunk], names: tuple[str, ...]) -> list[object]:
    return [
        module
        for chunk in chunks
        for module in _modules(chunk)
        if all(_has(module, n) for n in names) and getattr(module, "training", True)
    ]


def _has(module: object, name: str) -> bool:
    # Hash routers define the attributes as None: they own no balancing state.
    return getattr(module, name, None) is not None


def _tensor(module: object, name: str) -> torch.Tensor:
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{type_name(module)}.{name} must be a torch.Tensor, got {value!r}")
    return value


def _check_state(routers: Sequence[object], counts: str, bias: str) -> None:
    """Before the collective: every router's ``counts`` has its ``bias``'s shape, all of the
    same shape (they are stacked into one all-reduce), and the bias is floating-point (an
    integer bias would round every update to nothing)."""
    first: tuple[int, ...] | None = None
    for router in routers:
        name = type(router).__name__
        count, value = _tensor(router, counts), _tensor(router, bias)
        if count.shape != value.shape:
            raise InputValueError(
                f"{name}.{counts} has shape {tuple(count.shape)} but {name}.{bias} has "
                f"{tuple(value.shape)}: one entry per expert in both"
            )
        if not value.is_floating_point():
            raise InputTypeError(
                f"{name}.{bias} has dtype {value.dtype}; it must be floating-point"
            )
        if first is None:
            first = tuple(count.shape)
        elif tuple(count.shape) != first:
            raise InputValueError(
                f"{name}.{counts} has shape {tuple(count.shape)} but an earlier router's has "
                f"{first}: the routers' counts are reduced together, so every router needs "
                "the same number of experts"
            )


def _mean_quantile(module: object) -> torch.Tensor:
    accum = _tensor(module, "qb_beta_accum")
    count = _tensor(module, "qb_beta_count").clamp(min=1).to(accum.dtype)
    return accum / count


def _reset_quantiles(module: object) -> None:
    _tensor(module, "qb_beta_accum").zero_()
    count = getattr(module, "qb_beta_count", None)
    if isinstance(count, torch.Tensor):
        count.zero_()
