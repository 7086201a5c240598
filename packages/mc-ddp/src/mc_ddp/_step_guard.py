"""The guarded part of a ShardedOptimizer step: the grad norm, the overflow flag and the
step's status in one reduction, then unscaling and clipping in one multiply.

Per step (``clip``: a max norm is set; ``S``: the loss scale, 1 without a scaler)::

    local   (checks passed) master.grad ← main_grad slice (fp32; no value changes yet)
            clip:  n_r = Σ_{counted slices} ‖g‖_p^p  (p = ∞: max ‖g‖_∞, NaN → inf + a flag)
            f_r = 1 if any owned grad (counted or not) holds inf/NaN, else 0
    reduce  one all_reduce over the world of [n_r, (nan_r,) status_r, f_r]:
            SUM for a finite p, MAX for p = ∞ (flags are 0/1: either op tells "any")
    settle  status > 0 → every rank raises (CarriedStatus), nothing changed anywhere
    decide  ‖g‖ = n^{1/p} / S  (S: the loss scale; a power of two divides exactly)
            f > 0 or ‖g‖ not finite → skip on every rank (the scaler backs off; without
            a scaler, error_if_nonfinite raises instead)
            else g ← g · (1/S) · min(1, max_norm / (‖g‖ + 1e-6))  on every owned slice

``f`` covers the copies the norm leaves out too: a NaN on a replica that is not counted
still stops the step everywhere. The multiply reaches every copy: each rank scales all the
slices it steps, counted or not, by the same factor (the reduced norm is bit-identical on
every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp.grad_scaler import DynamicGradScaler
from mc_groups.comm.cross_rank import CarriedStatus

_LABEL = "grad norm and step status"
_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s and Megatron's


@dataclass(frozen=True)
class Guard:
    """What a guarded step computes: clipping (``max_norm`` with ``norm_type``) and/or
    loss scaling (``scaler``)."""

    max_norm: float | None
    norm_type: float
    scaler: DynamicGradScaler | None
    error_if_nonfinite: bool


@dataclass(frozen=True)
class StepResult:
    """What :meth:`mc_ddp.ShardedOptimizer.step` did, the same on every rank.

    Attributes:
        skipped: the params did not change (an overflow under loss scaling, or a
            non-finite grad norm).
        grad_norm: the global grad norm before clipping (unscaled), or None when the step
            computed none (no ``max_grad_norm`` and no
            :meth:`~mc_ddp.ShardedOptimizer.clip_grad_norm` call).
        loss_scale: the scale this step's grads carried (None without a scaler); the next
            one is ``optimizer.get_loss_scale()``.
        found_inf: some owned grad on some rank held inf or NaN (a guarded step looks at
            every copy, counted in the norm or not).
    """

    skipped: bool
    grad_norm: float | None = None
    loss_scale: float | None = None
    found_inf: bool = False

    @property
    def update_successful(self) -> bool:
        """``not skipped`` (the first value of Megatron's ``optimizer.step()``)."""
        return not self.skipped


def _norm_part(grads: list[torch.Tensor], p: float) -> list[float | torch.Tensor]:
    """``Σ ‖g‖_p^p`` (float64), or for p = ∞ ``[max ‖g‖_∞ with NaN → inf, NaN seen]``."""
    if not grads:
        return [0.0, 0.0] if math.isinf(p) else [0.0]
    norms = torch.stack(torch._foreach_norm(grads, p)).to(torch.float64)
    if not math.isinf(p):
        return [norms.pow(p).sum()]
    # gloo's MAX drops a NaN that rank 0 does not hold: send inf, and a flag for the NaN.
    nan = torch.isnan(norms).any()
    return [torch.where(torch.isnan(norms), math.inf, norms).max(), nan.to(torch.float64)]


def _found_inf(grads: list[torch.Tensor]) -> float | torch.Tensor:
    if not grads:
        return 0.0
    peaks = torch.stack(torch._foreach_norm(grads, math.inf))
    return (~torch.isfinite(peaks)).any().to(torch.float64)


def reduce_step_values(
    guard: Guard,
    grads: list[torch.Tensor],
    counted: list[bool],
    status: CarriedStatus,
    device: torch.device,
) -> StepResult:
    """The local values, the one reduction over the world, the status settled (every rank
    raises when any rank's checks failed), the norm and the overflow flag read back (one
    host synchronisation). ``grads`` is empty on a rank whose checks failed."""
    p = guard.norm_type
    parts: list[float | torch.Tensor] = []
    if guard.max_norm is not None:
        parts += _norm_part([g for g, c in zip(grads, counted, strict=True) if c], p)
    parts.append(status.flag)
    parts.append(_found_inf(grads))
    payload = torch.stack(
        [torch.as_tensor(v, dtype=torch.float64).to(device) for v in parts]
    ).contiguous()
    op = mg.ReduceOp.MAX if math.isinf(p) and guard.max_norm is not None else mg.ReduceOp.SUM
    world = dist.group.WORLD
    if world is not None and dist.is_initialized():
        mg.all_reduce(payload, world, op=op, label=_LABEL)
    values = [float(v) for v in payload.tolist()]
    found_inf = values.pop() > 0
    status.settle(world, values.pop())
    scale = None if guard.scaler is None else guard.scaler.scale
    norm = None if guard.max_norm is None else _total_norm(values, p, scale)
    skipped = found_inf or (norm is not None and not math.isfinite(norm))
    return StepResult(skipped, norm, scale, found_inf)


def _total_norm(values: list[float], p: float, scale: float | None) -> float:
    if math.isinf(p):
        total = math.nan if values[1] > 0 else values[0]
    else:
        total = values[0] ** (1.0 / p) if math.isfinite(values[0]) else values[0]
    return total if scale is None else total / scale


def clip_factor(max_norm: float, norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` in fp32, as ``torch.nn.utils.clip_grad_norm_``
    computes it."""
    coef = torch.tensor(max_norm, dtype=torch.float32) / (
        torch.tensor(norm, dtype=torch.float32) + _EPS
    )
    return float(coef.clamp(max=1.0))


def apply(guard: Guard, outcome: StepResult, grads: list[torch.Tensor]) -> None:
    """Unscale and clip every owned grad in one multiply (when the step goes ahead)."""
    if outcome.skipped or not grads:
        return
    coef = 1.0
    if guard.max_norm is not None and outcome.grad_norm is not None:
        coef = clip_factor(guard.max_norm, outcome.grad_norm)
    factor = coef if outcome.loss_scale is None else coef / outcome.loss_scale
    if factor != 1.0:
        torch._foreach_mul_(grads, factor)
