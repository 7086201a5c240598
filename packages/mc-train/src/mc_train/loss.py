r"""Per-token losses, and how a pipeline step turns them into the gradient's scale.

A pipeline's loss function returns the loss of every target position (``[b, ...]``, shaped
like the micro-batch's targets, 0 where the target is ``ignore_index``); the pipeline
reduces it, as Megatron's ``forward_step`` does, one of two ways (``config``'s
``calculate_per_token_loss``)::

    mean      loss_m = Σ_t ℓ_t / max(n_m, 1) / M     per micro-batch m of M (n_m counted
                                                    targets); the M backwards sum to the
                                                    mean's gradient, DDP averages over DP
    per-token loss_m = Σ_t ℓ_t                       finalize_model_grads divides every grad
                                                    by N = Σ_{DP} Σ_m n_m (num_tokens,
                                                    broadcast from the last stage), DDP sums

So the mean mode weighs micro-batches equally (equal to the mean over all targets when
every micro-batch counts as many), and the per-token mode weighs every counted target
equally, whatever the padding.

:func:`token_cross_entropy` builds the usual one: the cross-entropy of logits against
next-token labels, with the vocabulary whole or split over TP
(:func:`mc_tp_layers.vocab_parallel_cross_entropy`: two all-reduces over ``tp`` in
forward, the logits never gathered).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mc_groups.argcheck import check_flag, check_optional_group, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import vocab_parallel_cross_entropy

__all__ = ["IGNORE_INDEX", "TokenLoss", "causal_targets", "token_cross_entropy"]

IGNORE_INDEX = -100
"""The target of a position that counts for nothing (no loss, no gradient, not counted):
torch's and ``transformers``' convention."""


class TokenLoss(Protocol):
    """``loss_fn(output, target) -> losses``: the last stage's output for one micro-batch
    and its targets (``[b, ...]``) → the loss of every target position, shaped like
    ``target``, 0 where ``target == ignore_index`` (module notes)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-token losses (see the class)."""
        ...


def causal_targets(input_ids: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of ``input_ids`` (``[b, s]``): ``target[:, t] = input_ids[:, t + 1]``
    and ``ignore_index`` at the last position (as ``transformers`` shifts ``labels``)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InputTypeError(
            f"input_ids must be a [batch, sequence] tensor of token ids, got {input_ids!r:.60}"
        )
    out = torch.full_like(input_ids, ignore_index)
    out[:, :-1] = input_ids[:, 1:]
    return out


def token_cross_entropy(
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_first: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> TokenLoss:
    """A :class:`TokenLoss`: the cross-entropy of ``logits`` (``[b, s, V]``, or ``[s, b, V]``
    with ``sequence_first``; fp32 math) against ``target`` (``[b, s]`` class ids).

    ``tp_group``: the logits hold this rank's slice of the vocabulary (a ``colwise`` LM
    head), and :func:`mc_tp_layers.vocab_parallel_cross_entropy` combines the slices over it;
    None: the logits hold the whole vocabulary (``F.cross_entropy``)."""
    check_optional_group("tp_group", tp_group, what="token_cross_entropy")
    seq_first = check_flag("sequence_first", sequence_first)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise InputTypeError(f"ignore_index={ignore_index!r} must be an int, e.g. -100")

    def losses(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.transpose(0, 1) if seq_first else output
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(target.shape):
            raise InputValueError(
                f"logits {tuple(output.shape)} and target {tuple(target.shape)} do not match: "
                f"expected logits [{'s, b' if seq_first else 'b, s'}, V] for a [b, s] target"
            )
        if tp_group is not None:
            # [s, b] order as Megatron computes it; returned as a [b, s] view
            ce = vocab_parallel_cross_entropy(
                logits.transpose(0, 1),
                target.transpose(0, 1),
                tp_group=tp_group,
                ignore_index=ignore_index,
            )
            return ce.transpose(0, 1)
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction="none",
        )
        return flat.view(target.shape)

    return losses


def _type_check(loss_fn: object) -> TokenLoss:
    if not callable(loss_fn):
        raise InputTypeError(
            f"loss_fn must be callable as loss_fn(output, target) -> per-token losses, got "
            f"{type_name(loss_fn)}; e.g. mc_train.token_cross_entropy()"
        )
    return loss_fn
