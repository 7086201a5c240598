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

**Targets.** Every target must lie in ``[0, V)``, except positions equal to the optional
``ignore_index`` (as ``F.cross_entropy(..., reduction="none", ignore_index=)``: loss 0 and
no gradient there). Megatron-Core scores a target outside ``[0, V)`` as ``log Z`` (torch's
``-100`` included); mc refuses it at every TP size: on CPU a ``ValueError`` before any
collective, on a device an asynchronous device assert (no host synchronisation; a failure
surfaces at a later CUDA call and ends that process's CUDA context).

**Agreement.** The vocabulary slice and the other per-call arguments must be the same on
every rank of the group, or the numbers are silently wrong (each rank places its slice at
``rank · V_local``). They ride along the MAX all-reduce, which already runs: its payload
grows by 10 numbers holding ``(V_local, a digest of target, label_smoothing,
ignore_index)`` and their negatives, so after it every rank holds the maximum and minus the
minimum of each and knows whether the ranks agree, with no extra collective. On CPU a
disagreement makes every rank exchange the four values (only then) and raise the same
:class:`~mc_tp_layers.TensorParallelAgreementError` naming the argument and the ranks; on a
device it is an asynchronous device assert. Not checked: the logits' values (they differ by
design), and that the slices are in rank order (a permuted group gives a permuted
vocabulary).

**Gathered logits.** Logits that already hold the whole vocabulary on every rank (a
column-parallel head with ``gather_output=True``, ``transformers``' ``colwise_gather_output``)
look like a slice of ``V·W`` classes: every rank agrees, targets are in range, and the loss
would come out as the true loss + log(W) with no other sign (Megatron-LM #7452 row 2). Their
values cannot tell (a ``[..., V]`` tensor is a valid slice of a ``V·W`` vocabulary, and
Megatron's own test passes one tensor to every rank), but their history can: the call
follows the logits' autograd graph back through ops that keep the vocabulary dim whole
(views, transposes, slices of other dims, casts, copies, scaling by a number) and refuses,
before any collective, logits that come straight out of mc's all-gather along the last dim
(:func:`~mc_tp_layers.mappings.gather_from_tensor_model_parallel_region`, which a column-parallel
layer with ``gather_output`` runs). Logits without that history (computed under
``no_grad``, gathered by other code) are not recognised: pass the full vocabulary size
(``vocab_size=``, a Python int: no device work) and the call checks
``V_local · W == vocab_size`` before any collective.

**Under torch.compile** both checks take their device form on every device
(``torch._assert_async`` in the graph: on CPU a ``RuntimeError`` naming the check when the
compiled code runs, before the loss is returned), so the function traces without a graph
break; its two all-reduces are functional collectives (:mod:`mc_groups.comm.traceable`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.argcheck import check_int, check_tensor
from mc_groups.comm import traceable
from mc_groups.comm.cross_rank import differences
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.agreement import TensorParallelAgreementError
from mc_tp_layers.mappings import _apply, _GatherFromModelParallelRegion
from mc_tp_layers.utils import _check_index_range, _resolve_tp_group

__all__ = ["vocab_parallel_cross_entropy"]

_DIGEST_MODULUS = 1 << 20  # digests and small ints stay exact in fp32 (< 2**24)
_NO_IGNORE = float(1 << 21)
_PROBE_FIELDS = ("vocab_parallel_logits.shape[-1]", "target", "label_smoothing", "ignore_index")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: dist.ProcessGroup,
        ignore_index: int | None,
    ) -> torch.Tensor:
        x = logits.to(_compute_dtype(logits.dtype))
        z = x - _global_max(x, group, (target, label_smoothing, ignore_index)).unsqueeze(-1)
        local_target, outside = _local_target(target, group, z.shape[-1])
        picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        sums = torch.stack([picked, exp.sum(dim=-1), z.sum(dim=-1)], dim=-1)
        if group.size() > 1:
            sums = traceable.all_reduce_tensor(
                sums, group, label="tp cross-entropy sums", inplace=True
            )
        picked, sum_exp, sum_z = sums.unbind(-1)
        vocab = z.shape[-1] * group.size()
        log_z = sum_exp.log()
        loss = log_z - picked
        if label_smoothing > 0.0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_z / vocab)
        ignored = None if ignore_index is None else target == ignore_index
        if ignored is not None:
            loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        alpha = ctx.label_smoothing
        hit = (~outside).to(softmax.dtype) * (1.0 - alpha)
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if alpha > 0.0:
            grad = grad - alpha / ctx.vocab
        if ignored is not None:
            grad_loss = grad_loss.masked_fill(ignored, 0.0)
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _probe(
    x: torch.Tensor, target: torch.Tensor, label_smoothing: float, ignore_index: int | None
) -> torch.Tensor:
    """``(V_local // 4096, V_local % 4096, digest(target), α, ignore_index)``, built on the
    logits' device without a host-to-device copy (fills, no synchronisation)."""
    flat = target.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device).remainder_(8191).add_(1)
    digest = torch.remainder(((flat + 1) * weights).sum(), _DIGEST_MODULUS).to(x.dtype)
    vocab = x.shape[-1]
    ignore = _NO_IGNORE if ignore_index is None else float(ignore_index % _DIGEST_MODULUS)
    parts = [x.new_full((), float(vocab // 4096)), x.new_full((), float(vocab % 4096))]
    parts += [digest, x.new_full((), label_smoothing), x.new_full((), ignore)]
    return torch.stack(parts)


def _global_max(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    args: tuple[torch.Tensor, float, int | None],
) -> torch.Tensor:
    """The max over the whole vocabulary; the agreement probe rides along (see notes)."""
    local = x.max(dim=-1).values
    if group.size() == 1:
        return local
    probe = _probe(x, *args)
    payload = torch.cat([local.reshape(-1), probe, -probe])
    payload = traceable.all_reduce_tensor(
        payload, group, op=mg.ReduceOp.MAX, label="tp cross-entropy max", inplace=True
    )
    count, width = local.numel(), probe.numel()
    highest, lowest = payload[count : count + width], -payload[count + width :]
    agreed = (highest == lowest).all()
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(
            agreed,
            "vocab_parallel_cross_entropy: the ranks of the tensor-parallel group disagree "
            "on the vocabulary slice, target, label_smoothing or ignore_index",
        )
    elif not bool(agreed):
        _raise_disagreement(group, x.shape[-1], *args)
    return payload[:count].view_as(local)


def _raise_disagreement(
    group: dist.ProcessGroup,
    vocab_local: int,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int | None,
) -> None:
    """Every rank found the disagreement in the MAX all-reduce: exchange the arguments
    (only now; the target as its shape and first values) and raise the same error, naming
    each argument that differs and which ranks hold what."""
    head = target.reshape(-1)[:6].tolist()
    mine = (vocab_local, f"{list(target.shape)} {head}", label_smoothing, ignore_index)
    everyone = mg.all_gather_objects(mine, group, label="tp cross-entropy agreement")
    ranks = list(mg.group_ranks(group))
    rows = [
        dict(zip(_PROBE_FIELDS, cast(tuple[object, ...], theirs), strict=True))
        for theirs in everyone
    ]
    found = differences(ranks, rows)
    lines = [f"  {difference.describe(', ')}" for difference in found]
    if not lines:  # targets alike in shape and first values: they differ further on
        lines.append("  target: differs after its first values (digests differ)")
    raise TensorParallelAgreementError(
        "\n".join(
            [
                f"vocab_parallel_cross_entropy: tensor-parallel group ranks {ranks} called it "
                "with different arguments (found in the MAX all-reduce, before the loss):",
                *lines,
                "Every rank must pass its own equal slice of the vocabulary (rank r: classes "
                "[r·V/W, (r+1)·V/W)) and the same target, label_smoothing and ignore_index.",
            ]
        ),
        "vocab_parallel_cross_entropy",
        ranks,
        found,
    )


def _local_target(
    target: torch.Tensor, group: dist.ProcessGroup, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    start = int(group.rank()) * per_rank
    outside = (target < start) | (target >= start + per_rank)
    return (target - start).masked_fill(outside, 0), outside


# Autograd nodes of ops that keep the last (vocabulary) dim as it is: the walk back from the
# logits to the op that made them passes through these (elementwise scaling only when one
# input carries a gradient: a temperature, a mask).
_KEEP_VOCAB = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "CloneBackward0",
        "DivBackward0",
        "DivBackward1",
        "ExpandBackward0",
        "MulBackward0",
        "MulBackward1",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "ToCopyBackward0",
        "TransposeBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)
_WALK_LIMIT = 64


def _gathered(x: torch.Tensor) -> bool:
    """``x`` comes out of mc's all-gather along the last dim through ops that keep that dim
    (see notes); False when its history says otherwise or is unknown."""
    if torch.compiler.is_compiling():
        return False
    node = x.grad_fn
    for _ in range(_WALK_LIMIT):
        if node is None:
            return False
        if isinstance(node, _GatherFromModelParallelRegion._backward_cls):
            return True
        if type(node).__name__ not in _KEEP_VOCAB:
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def _check_vocab_size(vocab_size: object, local: int, tp_size: int, what: str) -> None:
    """``local · tp_size == vocab_size`` when ``vocab_size`` is given (ints only: no device
    work), else an error naming gathered logits when they look gathered."""
    if vocab_size is None:
        return
    full = check_int("vocab_size", vocab_size, minimum=1)
    if local * tp_size == full:
        return
    if local == full and tp_size > 1:
        raise InputValueError(
            f"{what}: the logits' last dim is {local} = vocab_size, the whole vocabulary, but "
            f"a vocabulary-parallel loss takes this rank's slice of {full} / {tp_size} classes: "
            "the logits were gathered (gather_output=True, a colwise_gather_output head), and "
            f"the loss would be the true loss + log({tp_size}) with no other sign. Pass the "
            "head's split output (gather_output=False, 'colwise'), or use "
            "torch.nn.functional.cross_entropy on gathered logits"
        )
    raise InputValueError(
        f"{what}: the logits hold {local} classes on each of {tp_size} tensor-parallel ranks "
        f"= {local * tp_size}, but vocab_size={full}; pass each rank's equal slice of the "
        "vocabulary (the column-parallel head's output) and the model's vocabulary size"
    )


def _check(
    logits: object, target: object, label_smoothing: object, ignore_index: object
) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    x = check_tensor("vocab_parallel_logits", logits)
    t = check_tensor("target", target)
    if not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] == 0:
        raise InputTypeError(
            f"vocab_parallel_logits must be a floating tensor [..., vocab/TP] with at least "
            f"one class, got {x.dtype} of shape {tuple(x.shape)}"
        )
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InputTypeError(f"target holds {t.dtype}; class indices must be an integer tensor")
    if tuple(t.shape) != tuple(x.shape[:-1]):
        raise InputValueError(
            f"target has shape {tuple(t.shape)} but vocab_parallel_logits has "
            f"{tuple(x.shape)}; target must be the logits' shape without the vocab dim"
        )
    if t.device != x.device:
        raise InputValueError(
            f"target is on {t.device} but vocab_parallel_logits on {x.device}; move the "
            "target to the logits' device"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise InputTypeError(f"label_smoothing={label_smoothing!r} must be a float in [0, 1)")
    if not 0.0 <= label_smoothing < 1.0:
        raise InputValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    ignore = (
        None if ignore_index is None else check_int("ignore_index", ignore_index, minimum=-(2**63))
    )
    return x, t, ignore


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits (see the module notes).

    Args:
        vocab_parallel_logits: ``[..., V/W]``, this rank's slice of the vocabulary (rank r
            holds classes ``[r·V/W, (r+1)·V/W)``). Not modified.
        target: ``[...]`` class indices in ``[0, V)`` (or equal to ``ignore_index``), the
            same on every rank.
        label_smoothing: α in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        tp_group: the group the vocabulary is split over (None: the default
            collection's ``tp``).
        ignore_index: positions whose target equals it get loss 0 and no gradient, as
            ``F.cross_entropy(..., reduction="none", ignore_index=)`` (mc addition; pass
            ``-100`` for torch's convention). None (the default): every target must lie in
            ``[0, V)``.
        vocab_size: the whole vocabulary's size V (mc addition): when given, logits that
            are not a ``V / TP`` slice (e.g. gathered ones, which would add log(TP) to the
            loss) are a ``ValueError`` before any collective. Without it, logits that come
            from mc's all-gather along the vocabulary are refused too (see notes).

    Returns:
        ``[...]`` losses (fp32, or fp64 for fp64 logits), identical on every rank. The
        gradient flows to ``vocab_parallel_logits`` in its dtype.

    Raises:
        ValueError: a target outside ``[0, V)`` that is not ``ignore_index`` (on CPU,
            before any collective; on a device, an asynchronous device assert); logits that
            are not a ``vocab_size / TP`` slice, or that an all-gather along the vocabulary
            produced (before any collective).
        TensorParallelAgreementError: the ranks passed different vocabulary slices,
            targets, ``label_smoothing`` or ``ignore_index`` (every rank, after the MAX
            all-reduce; on a device, an asynchronous device assert).
    """
    x, t, ignore = _check(vocab_parallel_logits, target, label_smoothing, ignore_index)
    group = _resolve_tp_group(tp_group, None, what="vocab_parallel_cross_entropy")
    size = int(group.size())
    _check_vocab_size(vocab_size, x.shape[-1], size, "vocab_parallel_cross_entropy")
    if size > 1 and _gathered(x):
        raise InputValueError(
            "vocab_parallel_cross_entropy: vocab_parallel_logits come from an all-gather "
            "along the vocabulary (a column-parallel head with gather_output=True, "
            "transformers' colwise_gather_output): every rank holds the whole vocabulary, "
            f"and the loss would be the true loss + log({size}). Pass the head's split "
            "output (gather_output=False, the plan style 'colwise'), or use "
            "torch.nn.functional.cross_entropy on gathered logits"
        )
    vocab = x.shape[-1] * int(group.size())
    fix = (
        "pass ignore_index=<that value> to skip those positions (as F.cross_entropy, whose "
        "default is -100)"
        if ignore is None
        else "targets index the whole vocabulary, V = vocab_parallel_logits.shape[-1] × TP size"
    )
    _check_index_range(t, vocab, "target", "class index(es)", fix, ignore=ignore)
    return _apply(_VocabParallelCrossEntropy, x, t, float(label_smoothing), group, ignore)
