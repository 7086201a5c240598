"""``Communicator``: one caller's batched collectives on one group, with the temporaries
they keep between calls (FSDP2's ``AllGather`` / ``ReduceScatter`` objects own their
allocation the same way: the caller passes tensors, the communication object owns what the
backend needs besides them).

A caller that repeats the same collectives every step, such as a DDP bucket group, holds
one communicator per group. The temporaries are the buffers of a reduce-scatter that runs
as an all-to-all (gloo, or any backend with ``accumulate_dtype``, see
:func:`~mc_groups.reduce_scatter`): the receive buffer (the input's size) and the
accumulation buffer (the output's size, when the output is narrower than the
accumulation). A fresh large CPU tensor pays page faults on first touch at every use; a
kept one is touched once (mc-ddp's README has the measurement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_group, type_name
from mc_groups.comm import _common as core
from mc_groups.comm import _reduce_scatter as rs
from mc_groups.comm._coalesced import open_batch
from mc_groups.comm._gloo import is_gloo
from mc_groups.comm.collectives import CollectiveHandle, ReduceOp, all_gather, all_reduce
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["Communicator"]

Pair = tuple[torch.Tensor, torch.Tensor]
"""``(output, input)`` of one reduce-scatter or all-gather."""

_T = TypeVar("_T")
_Key = tuple[str, int, torch.dtype, torch.device]


class Communicator:
    """Batched collectives on ``group`` that keep their temporaries between calls.

    Each method takes a list (one entry per tensor, e.g. per bucket) and returns one
    :class:`~mc_groups.CollectiveHandle` (already complete unless ``async_op``). The list
    is issued as Megatron issues a bucket group's collectives: one entry alone, several in
    one coalesced batch. On gloo the batches are split by dtype, in first-appearance order
    (gloo's coalesced collectives take one dtype; mc's gloo batches issue each collective
    on its own, so this fixes the issue order and which collectives are recorded as
    coalesced). With ``accumulate_dtype`` each reduce-scatter is its own all-to-all (torch's
    coalescing manager batches no all-to-all).

    Buffers: the k-th temporary of a given role, size, dtype and device that a call asks
    for is the same tensor at every call, allocated on first use and kept until
    :meth:`free`. A call's buffers are in use until its handle was waited on: issue the
    next call that needs them after that (a bucket group has one reduction in flight at a
    time). Every argument is checked before anything is issued.

    Args:
        group: the process group (live).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = check_group("group", group)
        self._by_dtype = is_gloo(group)
        self._buffers: dict[_Key, list[torch.Tensor]] = {}

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group."""
        return self._group

    @property
    def nbytes(self) -> int:
        """Bytes of the kept temporaries."""
        return sum(t.nbytes for kept in self._buffers.values() for t in kept)

    def free(self) -> None:
        """Drop every kept temporary; the next call that needs one allocates again. A
        collective still in flight keeps the buffers it uses alive until it completes."""
        self._buffers.clear()

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        label: str = "",
        detail: str = "",
    ) -> CollectiveHandle:
        """``t ← op over ranks of t`` for each tensor, in place (see
        :func:`~mc_groups.all_reduce`)."""
        check_group("group", self._group)
        items = _checked_list(tensors, "tensors", torch.Tensor)
        for i, tensor in enumerate(items):
            core.check_contiguous(f"tensors[{i}]", tensor)
        op = core.check_op(op)
        core.check_options(async_op, label, detail, group=self._group)

        def alone(tensor: torch.Tensor) -> CollectiveHandle:
            return all_reduce(
                tensor, self._group, op=op, async_op=async_op, label=label, detail=detail
            )

        def batched(batch: list[torch.Tensor]) -> CollectiveHandle:
            with open_batch(self._group, None, async_op, label, detail, rs.fresh) as coalesced:
                for tensor in batch:
                    coalesced.all_reduce(tensor, op=op)
            return coalesced.handle

        return self._issue(items, lambda t: t.dtype, alone, batched, label)

    def reduce_scatter(
        self,
        pairs: Sequence[Pair],
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        label: str = "",
        detail: str = "",
        accumulate_dtype: torch.dtype | None = None,
    ) -> CollectiveHandle:
        """For each ``(output, input)``: group rank r keeps slice r of ``op over ranks of
        input`` in ``output`` (see :func:`~mc_groups.reduce_scatter`; ``output`` may be a
        view of ``input``). Its temporaries are kept (see the class notes)."""
        items = self._pairs(pairs, core.check_reduce_scatter)
        op = core.check_op(op)
        core.check_options(async_op, label, detail, group=self._group)
        accumulate = rs.check_accumulate_dtype(accumulate_dtype)
        if self._group.size() == 1:
            for output, input in items:
                core.copy_unless_alias(output, input)
            return core.DONE
        allocate = self._session()

        def alone(pair: Pair) -> CollectiveHandle:
            output, input = pair
            return rs.issue_reduce_scatter(
                output, input, self._group, op, async_op, label, detail, accumulate, allocate
            )

        if accumulate is not None:
            return _joined([alone(pair) for pair in items], self._text("reduce_scatter", label))

        def batched(batch: list[Pair]) -> CollectiveHandle:
            with open_batch(self._group, None, async_op, label, detail, allocate) as coalesced:
                for output, input in batch:
                    coalesced.reduce_scatter(output, input, op=op)
            return coalesced.handle

        return self._issue(items, lambda p: p[1].dtype, alone, batched, label)

    def all_gather(
        self,
        pairs: Sequence[Pair],
        *,
        async_op: bool = False,
        label: str = "",
        detail: str = "",
    ) -> CollectiveHandle:
        """For each ``(output, input)``: every rank's ``input`` concatenated into ``output``
        in group-rank order (see :func:`~mc_groups.all_gather`; ``input`` may be a view of
        ``output``). Needs no temporaries of its own."""
        items = self._pairs(pairs, core.check_all_gather)
        core.check_options(async_op, label, detail, group=self._group)

        def alone(pair: Pair) -> CollectiveHandle:
            output, input = pair
            return all_gather(
                output, input, self._group, async_op=async_op, label=label, detail=detail
            )

        def batched(batch: list[Pair]) -> CollectiveHandle:
            with open_batch(self._group, None, async_op, label, detail, rs.fresh) as coalesced:
                for output, input in batch:
                    coalesced.all_gather(output, input)
            return coalesced.handle

        return self._issue(items, lambda p: p[1].dtype, alone, batched, label)

    # -- helpers ----------------------------------------------------------------------

    def _issue(
        self,
        items: list[_T],
        dtype_of: Callable[[_T], torch.dtype],
        alone: Callable[[_T], CollectiveHandle],
        batched: Callable[[list[_T]], CollectiveHandle],
        label: str,
    ) -> CollectiveHandle:
        """One entry alone, several in one batch (on gloo: one batch per dtype)."""
        batches = core.by_dtype(items, dtype_of) if self._by_dtype else [items]
        handles = [alone(b[0]) if len(b) == 1 else batched(b) for b in batches if b]
        return _joined(handles, self._text("collectives", label))

    def _pairs(
        self, pairs: object, check: Callable[[torch.Tensor, torch.Tensor, int], None]
    ) -> list[Pair]:
        """Checked ``(output, input)`` pairs (the group first)."""
        size = check_group("group", self._group).size()
        items = _checked_list(pairs, "pairs", tuple)
        for i, pair in enumerate(items):
            if len(pair) != 2:
                raise InputValueError(f"pairs[{i}] must be an (output, input) pair of tensors")
            try:
                check(pair[0], pair[1], size)
            except (TypeError, ValueError) as err:
                raise type(err)(f"pairs[{i}]: {err}") from None
        return [(output, input) for output, input in items]

    def _session(self) -> rs.Allocate:
        """The allocator of one call: its k-th request for a (role, numel, dtype, device)
        gets the k-th kept buffer of that key."""
        taken: dict[_Key, int] = {}

        def allocate(
            role: str, numel: int, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            key = (role, numel, dtype, device)
            index = taken.get(key, 0)
            taken[key] = index + 1
            kept = self._buffers.setdefault(key, [])
            if index == len(kept):
                kept.append(torch.empty(numel, dtype=dtype, device=device))
            return kept[index]

        return allocate

    def _text(self, what: str, label: str) -> str:
        text = f"{what} on group ranks {list(core.ranks_of(self._group))}"
        return f"{text} for '{label}'" if label else text

    def __repr__(self) -> str:
        return f"Communicator(group ranks={list(core.ranks_of(self._group))}, kept={self.nbytes} B)"


def _checked_list(values: object, arg: str, kind: type[_T]) -> list[_T]:
    """``values`` as a list whose items are ``kind``s (``TypeError`` otherwise)."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise InputTypeError(f"{arg}={values!r} must be a list")
    items = list(values)
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise InputTypeError(f"{arg}[{i}] is a {type_name(item)}, not a {kind.__name__}")
    return items


def _joined(handles: list[CollectiveHandle], description: str) -> CollectiveHandle:
    """One handle for ``handles``: the only one itself, else a parent of them."""
    if not handles:
        return core.DONE
    if len(handles) == 1:
        return handles[0]
    return CollectiveHandle(description=description, children=handles)
