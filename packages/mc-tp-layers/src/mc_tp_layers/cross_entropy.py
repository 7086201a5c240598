r"""Cross-entropy over logits split along the vocabulary (the output of a column-parallel
LM head with ``gather_output=False``).

Rank r holds logits ``x[..., v]`` for ``v`` in ``[r·V/W, (r+1)·V/W)``. With
``z = x - max_v x`` (the max all-reduced, MAX)::

    log Z   = log Σ_v exp(z_v)                       Σ over every rank: all-reduce (SUM)
    nll     = log Z - z_target                       z_target lives on one rank: SUM
    loss    = (1 - α)·nll + α·(log Z - mean_v z_v)   label smoothing α (mean over all V)

Two collectives in forward (one MAX all-reduce of ``[...]``, one SUM all-reduce of the
stacked ``[..., 3]`` partial sums), none in backward::

    d loss / d x_v = (softmax_v - (1 - α)·[v = target] - α / V) · d loss

Label smoothing follows ``torch.nn.functional.cross_entropy`` (α/V on every class, the
mean over the whole vocabulary), so any TP size gives the TP=1 numbers. Megatron-Core
instead scales α by V/(V - 1) and averages log-probabilities over the local partition only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_tp_layers import _validate
from mc_tp_layers._autograd import apply
from mc_tp_layers._groups import resolve_tp_group

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        x = logits.to(_compute_dtype(logits.dtype))
        z = x - _global_max(x, group).unsqueeze(-1)
        local_target, outside = _local_target(target, group, z.shape[-1])
        picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        sums = torch.stack([picked, exp.sum(dim=-1), z.sum(dim=-1)], dim=-1)
        if group.size() > 1:
            mg.all_reduce(sums, group, label="tp cross-entropy sums")
        picked, sum_exp, sum_z = sums.unbind(-1)
        vocab = z.shape[-1] * group.size()
        log_z = sum_exp.log()
        loss = log_z - picked
        if label_smoothing > 0.0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_z / vocab)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        alpha = ctx.label_smoothing
        hit = (~outside).to(softmax.dtype) * (1.0 - alpha)
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if alpha > 0.0:
            grad = grad - alpha / ctx.vocab
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _global_max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    local = x.max(dim=-1).values
    if group.size() > 1:
        mg.all_reduce(local, group, op=mg.ReduceOp.MAX, label="tp cross-entropy max")
    return local


def _local_target(
    target: torch.Tensor, group: dist.ProcessGroup, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    start = int(group.rank()) * per_rank
    outside = (target < start) | (target >= start + per_rank)
    return (target - start).masked_fill(outside, 0), outside


def _check(
    logits: object, target: object, label_smoothing: object
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _validate.tensor(logits, "vocab_parallel_logits")
    t = _validate.tensor(target, "target")
    if not x.dtype.is_floating_point or x.dim() < 1:
        raise TypeError(
            f"vocab_parallel_logits must be a floating tensor [..., vocab/TP], got {x.dtype} "
            f"of shape {tuple(x.shape)}"
        )
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"target holds {t.dtype}; class indices must be an integer tensor")
    if tuple(t.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"target has shape {tuple(t.shape)} but vocab_parallel_logits has "
            f"{tuple(x.shape)}; target must be the logits' shape without the vocab dim"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing={label_smoothing!r} must be a float in [0, 1)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    return x, t


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits (see the module notes).

    Args:
        vocab_parallel_logits: ``[..., V/W]``, this rank's slice of the vocabulary (rank r
            holds classes ``[r·V/W, (r+1)·V/W)``). Not modified.
        target: ``[...]`` class indices in ``[0, V)``.
        label_smoothing: α in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        tp_group: the group the vocabulary is split over (None: the default
            collection's ``tp``).

    Returns:
        ``[...]`` losses (fp32, or fp64 for fp64 logits), identical on every rank. The
        gradient flows to ``vocab_parallel_logits`` in its dtype.
    """
    x, t = _check(vocab_parallel_logits, target, label_smoothing)
    group = resolve_tp_group(tp_group, None, what="vocab_parallel_cross_entropy")
    return apply(_VocabParallelCrossEntropy, x, t, float(label_smoothing), group)
