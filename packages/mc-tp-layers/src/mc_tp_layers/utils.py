"""Megatron-Core's ``core.tensor_parallel.utils`` names, and the helpers every module of
this package shares: which TP group a call talks over, and the range check of token ids
and class targets.

**Groups are passed explicitly.** A ``group=None`` / ``tp_group=None`` argument falls back
to ``pg_collection`` and then to the collection registered with
:func:`mc_groups.collection.set_default_collection`
(:func:`mc_groups.collection.collection_or_default`); when none is registered the
error says how to pass one (``_resolve_tp_group``, as Megatron's
``get_tensor_model_parallel_group_if_none``).

**Ids and targets inside** ``[0, size)`` (``_check_index_range``). On CPU the check is a
host comparison (one pass over the integers, no synchronisation to speak of) and raises
``ValueError`` before anything is communicated. On a device the same comparison is
queued as an asynchronous device assert (:func:`torch._assert_async`): no host
synchronisation per step, but a failure surfaces at a later CUDA call as a device-side
assert and leaves that process's CUDA context unusable (as an out-of-range
``F.embedding`` index on CUDA does), so the message printed on the host is generic.

While ``torch.compile`` traces, the device form is used on every device: the host check
needs the values (a graph break); the assert is a node of the graph, so compiled code still
refuses an out-of-range value on each call (on CPU a ``RuntimeError`` with the message
below, raised when the compiled code runs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_group, check_int, check_tensor
from mc_groups.collection import collection_or_default
from mc_groups.comm import traceable
from mc_groups.errors import InputValueError

__all__ = [
    "VocabUtility",
    "divide",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]

_EXPLICIT = "tp_group=<ProcessGroup> or pg_collection=<ProcessGroupCollection>"


def _resolve_tp_group(
    tp_group: object,
    pg_collection: object = None,
    *,
    is_expert: bool = False,
    what: str = "this layer",
) -> dist.ProcessGroup:
    """``tp_group`` if given, else the collection's ``tp`` (``expt_tp`` for experts)."""
    if tp_group is not None:
        return check_group("tp_group", tp_group)
    field = "expt_tp" if is_expert else "tp"
    return collection_or_default(pg_collection, what, explicit=_EXPLICIT).require(field, what)


def _resolve_gtp_group(
    gtp_remat_size: int,
    pg_collection: object,
    *,
    is_expert: bool = False,
    what: str = "this layer",
) -> dist.ProcessGroup | None:
    """The gtp_remat group when ``gtp_remat_size > 1`` (checked against its size), else None."""
    if gtp_remat_size == 1:
        return None
    field = "expt_gtp_remat" if is_expert else "gtp_remat"
    group = collection_or_default(pg_collection, what, explicit=_EXPLICIT).require(field, what)
    if group.size() != gtp_remat_size:
        raise InputValueError(
            f"config.gtp_remat_size={gtp_remat_size} but pg_collection.{field} has "
            f"{group.size()} ranks; build the groups with the same gtp_remat_size"
        )
    return group


def _check_index_range(
    values: torch.Tensor,
    size: int,
    arg: str,
    what: str,
    fix: str,
    *,
    ignore: int | None = None,
    on_device: bool | None = None,
) -> None:
    """Every element of ``values`` in ``[0, size)``, except those equal to ``ignore``.

    ``on_device`` (default: ``values.is_cuda`` or another accelerator) selects the
    asynchronous device assert; tests force it on CPU, where ``torch._assert_async``
    raises at once.
    """
    if values.numel() == 0 or values.device.type == "meta":
        return
    outside = (values < 0) | (values >= size)
    if ignore is not None:
        outside &= values != ignore
    device_side = values.device.type != "cpu" if on_device is None else on_device
    device_side = device_side or torch.compiler.is_compiling()
    if device_side:
        torch._assert_async(
            ~outside.any(), f"{arg} holds {what} outside [0, {size}) (device-side check)"
        )
        return
    if bool(outside.any()):
        bad = values[outside]
        first = tuple(int(i) for i in outside.nonzero()[0].tolist())
        kept = "" if ignore is None else f" other than ignore_index={ignore}"
        raise InputValueError(
            f"{arg} holds {bad.numel()} {what}{kept} outside [0, {size}): e.g. "
            f"{int(bad[0])} at index {first} (smallest {int(bad.min())}, largest "
            f"{int(bad.max())}); {fix}"
        )


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``; a ``ValueError`` when it does not divide evenly.

    ``numerator`` must be an int >= 0 and ``denominator`` an int >= 1 (``TypeError`` for
    other types, bools included).
    """
    check_int("numerator", numerator, minimum=0)
    check_int("denominator", denominator)
    if numerator % denominator:
        raise InputValueError(
            f"{numerator} is not divisible by {denominator} (numerator={numerator}, "
            f"denominator={denominator})"
        )
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal chunks of its last dimension."""
    check_tensor("tensor", tensor)
    if tensor.dim() < 1:
        raise InputValueError("tensor is 0-D; it needs a last dimension to split")
    check_int("num_partitions", num_partitions)
    check_flag("contiguous_split_chunks", contiguous_split_chunks)
    last = tensor.shape[-1]
    if last % num_partitions:
        raise InputValueError(
            f"{last} is not divisible by {num_partitions}: the last dimension of the tensor "
            f"(shape {tuple(tensor.shape)}) does not split into num_partitions="
            f"{num_partitions} equal chunks"
        )
    size = last // num_partitions
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This tensor-parallel rank's equal 1-D part of ``tensor`` (no communication).

    With W ranks in ``tp_group`` and n = ``tensor.numel()``, rank r gets the flat elements
    ``[r·n/W, (r+1)·n/W)``: a view of ``tensor`` (which must then be contiguous), or with
    ``new_buffer`` a fresh copy on ``tensor``'s device. :func:`gather_split_1d_tensor`
    undoes it. ``tp_group=None`` uses the default collection's ``tp`` group.

    n must divide by W (``ValueError``): Megatron floors n/W, and the gather of such parts
    silently drops the last ``n mod W`` elements.
    """
    x = check_tensor("tensor", tensor)
    check_flag("new_buffer", new_buffer)
    group = _resolve_tp_group(tp_group, None, what="split_tensor_into_1d_equal_chunks")
    size, numel = group.size(), x.numel()
    if numel % size:
        raise InputValueError(
            f"tensor has {numel} elements (shape {tuple(x.shape)}), which do not split into "
            f"{size} equal parts over tp_group's {size} ranks; pad it to a multiple of {size}"
        )
    if not new_buffer and not x.is_contiguous():
        raise InputValueError(
            f"tensor (shape {tuple(x.shape)}, strides {x.stride()}) is not contiguous, so no "
            "1-D view of it exists; pass new_buffer=True (a copy) or tensor.contiguous()"
        )
    part = numel // size
    flat = x.reshape(-1).narrow(0, group.rank() * part, part)
    return flat.clone() if new_buffer else flat


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every tensor-parallel rank's ``tensor`` flattened and concatenated in rank order: a
    new 1-D tensor of ``W · tensor.numel()`` elements (one all-gather over ``tp_group``).

    The inverse of :func:`split_tensor_into_1d_equal_chunks` (``view`` the result with the
    original shape); every rank must pass the same number of elements. ``tp_group=None``
    uses the default collection's ``tp`` group.
    """
    x = check_tensor("tensor", tensor)
    group = _resolve_tp_group(tp_group, None, what="gather_split_1d_tensor")
    flat = x.reshape(-1)
    if group.size() == 1:
        return flat.clone()
    return traceable.all_gather_tensor(flat, group, label="tp gather dim 0")


def _check_rank(rank: object, world_size: object) -> None:
    size = check_int("world_size", world_size)
    if check_int("rank", rank, minimum=0) >= size:
        raise InputValueError(f"rank={rank} must be < world_size={size}")


class VocabUtility:
    """Vocabulary ranges ``[first, last)`` owned by a tensor-parallel rank.

    The vocabulary is split into ``world_size`` contiguous, equal ranges (rank r owns
    ``[r·V/W, (r+1)·V/W)``).
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[rank·p, (rank+1)·p)`` for a partition size ``p`` (``rank`` in
        ``[0, world_size)``)."""
        check_int("per_partition_vocab_size", per_partition_vocab_size)
        _check_rank(rank, world_size)
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of ``rank`` when ``global_vocab_size`` is split over ``world_size``."""
        check_int("global_vocab_size", global_vocab_size)
        _check_rank(rank, world_size)
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
