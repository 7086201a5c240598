"""The loss of a causal LM whose head is ``colwise`` (vocabulary-split logits)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_tensor
from mc_groups.errors import InputValueError
from mc_tp_layers.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_causal_lm_loss"]


def vocab_parallel_causal_lm_loss(
    vocab_parallel_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup,
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``transformers``' causal-LM loss on logits split along the vocabulary.

    Position t predicts ``labels[:, t + 1]``; the loss is the mean over the predicted
    positions whose label is not ``ignore_index`` (as ``ForCausalLMLoss``), computed by
    :func:`mc_tp_layers.vocab_parallel_cross_entropy` in fp32 (two all-reduces over
    ``tp_group`` in forward, none in backward): the full ``[b, s, V]`` logits are never
    gathered.

    Args:
        vocab_parallel_logits: ``[b, s, V/W]``, the output of a ``colwise`` LM head.
        labels: ``[b, s]`` token ids (usually the input ids), the same on every TP rank.
        tp_group: the group the head is split over (``pg_collection.tp``).
        ignore_index: labels equal to it are skipped.
        vocab_size: the model's whole vocabulary (``model.config.vocab_size``): when given,
            logits that are not a ``V / W`` slice are a ``ValueError`` before any collective.
            Without it, logits a ``colwise_gather_output`` head gathered (mc's all-gather
            in their autograd history) are refused too
            (:func:`~mc_tp_layers.vocab_parallel_cross_entropy`); only logits gathered by
            other code or under ``no_grad`` need it.
    """
    logits = check_tensor("vocab_parallel_logits", vocab_parallel_logits)
    target = check_tensor("labels", labels)
    if logits.dim() != 3 or tuple(target.shape) != tuple(logits.shape[:2]):
        raise InputValueError(
            f"vocab_parallel_logits {tuple(logits.shape)} and labels {tuple(target.shape)} must "
            "be [batch, sequence, V/W] and [batch, sequence]"
        )
    shifted = target[:, 1:]
    losses = vocab_parallel_cross_entropy(
        logits[:, :-1].float(),
        shifted,
        tp_group=tp_group,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
    )
    count = (shifted != ignore_index).sum().clamp(min=1)
    return losses.sum() / count
