r"""Flat slices of a tensor as rectangular pieces of a global tensor, for
``torch.distributed.checkpoint`` (DCP).

The distributed optimizer owns *flat* slices of params: elements ``[start, end)`` of the
row-major flattening of this rank's (TP-local) param. DCP stores and reshards
*rectangular* chunks of a global tensor. A flat range of a row-major ``[d0, d1, …]`` tensor
is a union of at most ``2·ndim − 1`` boxes, each itself a contiguous run of the flat range::

    shape [4, 5], flat range [7, 18):

        row 0   . . . . .
        row 1   . . # # #     head: row 1, cols 2..5   (the partial first row)
        row 2   # # # # #     body: rows 2..3, all cols (whole rows)
        row 3   # # # . .     tail: row 3, cols 0..3   (the partial last row)

    (the head and tail recurse into the row: a partial row of a 3-D tensor is again a
    head, a body and a tail one dimension down)

Each box is a view of the slice (``flat[box_start − start : box_end − start].view(sizes)``),
placed in the global tensor at ``local offsets + offset of the local tensor`` (e.g. rank r of
a TP split along dim 0 of ``n`` local rows adds ``r·n`` to the first offset).
:class:`CheckpointPieces` carries them to DCP: a tensor of the global shape that holds only
this rank's boxes and implements DCP's checkpoint protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), so ``dcp.save`` writes each box and
``dcp.load`` copies into each box in place whatever layout wrote the checkpoint. Boxes of
ranks holding the same slice (data-parallel replicas) have the same global offsets and DCP
writes one copy. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mc_groups.errors import InputTypeError, InputValueError

if TYPE_CHECKING:  # DCP is imported where it is used: importing it costs over a second
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["Box", "CheckpointPieces", "flat_range_boxes", "pieces_of_flat_slice"]


class Box(NamedTuple):
    """A rectangular part of a row-major tensor that is also a contiguous flat run:
    elements ``[flat_start, flat_start + prod(sizes))`` at ``offsets`` with ``sizes``."""

    flat_start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _check_range(shape: Sequence[int], start: int, end: int) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if not dims or any(d < 1 for d in dims):
        raise InputValueError(f"shape={dims} must have at least one dim, each >= 1")
    numel = math.prod(dims)
    if not 0 <= start <= end <= numel:
        raise InputValueError(
            f"flat range [start={start}, end={end}) must satisfy 0 <= start <= end <= "
            f"numel={numel} of shape {dims}"
        )
    return dims


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes, in flat order, that exactly cover elements ``[start, end)`` of a row-major
    tensor of ``shape`` (see the module notes): at most ``2·len(shape) − 1`` of them."""
    dims = _check_range(shape, start, end)
    return _boxes(dims, start, end, 0)


def _boxes(dims: tuple[int, ...], start: int, end: int, base: int) -> list[Box]:
    if start >= end:
        return []
    if len(dims) == 1:
        return [Box(base + start, (start,), (end - start,))]
    inner, rest = math.prod(dims[1:]), dims[1:]
    first, last = start // inner, end // inner
    out: list[Box] = []
    if start % inner:  # head: the partial first row
        head_end = min(end, (first + 1) * inner)
        out += _in_row(rest, first, start - first * inner, head_end - first * inner, base, inner)
        first += 1
    if last > first:  # body: whole rows
        out.append(Box(base + first * inner, (first,) + (0,) * len(rest), (last - first, *rest)))
    if end % inner and last >= first:  # tail: the partial last row
        out += _in_row(rest, last, 0, end - last * inner, base, inner)
    return out


def _in_row(
    rest: tuple[int, ...], row: int, start: int, end: int, base: int, inner: int
) -> list[Box]:
    return [
        Box(b.flat_start, (row, *b.offsets), (1, *b.sizes))
        for b in _boxes(rest, start, end, base + row * inner)
    ]


class CheckpointPieces(torch.Tensor):
    """A tensor of a global shape of which this rank holds rectangular pieces (views of
    its own memory), for ``torch.distributed.checkpoint`` only.

    DCP saves each piece as a chunk at its global offsets and loads into each piece in
    place (reading whatever saved chunks overlap it). Any other tensor operation raises
    ``TypeError``: the object has no storage of its own.
    """

    _pieces: list[torch.Tensor]
    _offsets: list[torch.Size]

    @staticmethod
    def __new__(
        cls,
        global_shape: Sequence[int],
        pieces: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
    ) -> CheckpointPieces:
        """``pieces[i]`` sits at ``offsets[i]`` of a tensor of ``global_shape``; every
        piece shares one dtype and device (``pieces`` may be empty: nothing held here)."""
        if len(pieces) != len(offsets):
            raise InputValueError(f"{len(pieces)} pieces but {len(offsets)} offsets")
        dtype = pieces[0].dtype if pieces else torch.float32
        device = pieces[0].device if pieces else torch.device("cpu")
        made = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=dtype, device=device
        )
        made._pieces = list(pieces)
        made._offsets = [torch.Size(o) for o in offsets]
        return made

    # torch's stub types Tensor.__torch_dispatch__ as a plain function attribute; every
    # subclass overrides it as a classmethod (as DTensor does).
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise InputTypeError(
            f"{func} on a CheckpointPieces: it only carries this rank's pieces to "
            "torch.distributed.checkpoint; read the optimizer state from the optimizer"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        sizes = [tuple(p.shape) for p in self._pieces]
        return f"CheckpointPieces(shape={tuple(self.shape)}, pieces={sizes} at {self._offsets})"

    @property
    def pieces(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """``(global offsets, tensor)`` of every piece held on this rank."""
        return list(zip(self._offsets, self._pieces, strict=True))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        """DCP: one shard write per piece."""
        from torch.distributed.checkpoint.metadata import (  # noqa: PLC0415 (see top)
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (  # noqa: PLC0415
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        del obj
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.shape),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self.shape,
                ),
            )
            for offsets, piece in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP: the chunks this rank reads into (one per piece)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # noqa: PLC0415

        return [ChunkStorageMetadata(offsets=o, sizes=p.shape) for o, p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """DCP: the piece at ``index.offset``."""
        for offsets, piece in self.pieces:
            if offsets == index.offset:
                return piece
        raise InputValueError(f"{index.fqn}: this rank holds no piece at offsets {index.offset}")


def pieces_of_flat_slice(
    flat: torch.Tensor,
    start: int,
    local_shape: Sequence[int],
    local_offsets: Sequence[int],
    global_shape: Sequence[int],
) -> CheckpointPieces:
    """``flat`` (elements ``[start, start + flat.numel())`` of a local tensor of
    ``local_shape``, which sits at ``local_offsets`` of a tensor of ``global_shape``) as
    :class:`CheckpointPieces`: one view of ``flat`` per box of the range."""
    boxes = flat_range_boxes(local_shape, start, start + flat.numel())
    views = [
        flat[b.flat_start - start : b.flat_start - start + math.prod(b.sizes)].view(b.sizes)
        for b in boxes
    ]
    offsets = [
        tuple(o + base for o, base in zip(b.offsets, local_offsets, strict=True)) for b in boxes
    ]
    return CheckpointPieces(global_shape, views, offsets)
