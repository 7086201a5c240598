"""``Communicator``: one caller's batched collectives on one group, with the temporaries
they keep between calls (FSDP2's ``AllGather`` / ``ReduceScatter`` objects own their
allocation the same way: the caller passes tensors, the communication object owns what the
backend needs besides them).

A caller that repeats the same collectives every step, such as a DDP bucket group, holds
one communicator per group and binds its collectives once
(:meth:`Communicator.bind`): the tensors and options are checked then, and each step's
:meth:`BoundCollectives.issue` only issues (check at the boundary once, trust inside).
The temporaries are the buffers of a reduce-scatter that runs as an all-to-all (gloo, or
any backend with ``accumulate_dtype``, see :func:`~mc_groups.reduce_scatter`): the receive
buffer (the input's size) and the accumulation buffer (the output's size, when the output
is narrower than the accumulation). A fresh large CPU tensor pays page faults on first
touch at every use; a kept one is touched once (mc-ddp's README has the measurement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_group, type_name
from mc_groups.comm._coalesced import open_batch
from mc_groups.comm.collectives import (
    DONE,
    Allocate,
    CollectiveHandle,
    ReduceOp,
    _issue_all_gather,
    _issue_all_reduce,
    _issue_reduce_scatter,
    by_dtype,
    check_accumulate_dtype,
    check_all_gather,
    check_contiguous,
    check_op,
    check_options,
    check_reduce_scatter,
    copy_unless_alias,
    fresh,
    is_gloo,
    ranks_of,
)
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["BoundCollectives", "Communicator"]

Pair = tuple[torch.Tensor, torch.Tensor]
"""``(output, input)`` of one reduce-scatter or all-gather."""

Entry = torch.Tensor | Pair
"""One collective of a bound list: a tensor (all-reduce) or a pair."""

_T = TypeVar("_T")
_Key = tuple[str, int, torch.dtype, torch.device]
_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


class Communicator:
    """Batched collectives on ``group`` that keep their temporaries between calls.

    Each collective takes a list (one entry per tensor, e.g. per bucket) and returns one
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

    def bind(
        self,
        kind: str,
        items: Sequence[torch.Tensor] | Sequence[Pair],
        *,
        op: ReduceOp = ReduceOp.SUM,
        label: str = "",
        detail: str = "",
        accumulate_dtype: torch.dtype | None = None,
    ) -> BoundCollectives:
        """Check a list of collectives of ``kind`` (``"all_reduce"``: tensors;
        ``"reduce_scatter"`` / ``"all_gather"``: ``(output, input)`` pairs) and their
        options once, for :meth:`~mc_groups.comm.communicator.BoundCollectives.issue` to issue at
        every call. ``op``
        (reductions) and ``accumulate_dtype`` (reduce-scatter) as in the collectives."""
        check_group("group", self._group)
        if kind not in _KINDS:
            raise InputValueError(f"kind={kind!r} must be one of {_KINDS}")
        size = self._group.size()
        reduce_op = check_op(op) if kind != "all_gather" else None
        check_options(False, label, detail, group=self._group)
        accumulate = check_accumulate_dtype(accumulate_dtype)
        if accumulate is not None and kind != "reduce_scatter":
            raise InputValueError(f"accumulate_dtype is for reduce_scatter, not {kind}")
        entries: list[Entry]
        if kind == "all_reduce":
            tensors = _checked_list(items, "tensors", torch.Tensor)
            for i, tensor in enumerate(tensors):
                check_contiguous(f"tensors[{i}]", tensor)
            entries = list(tensors)
        else:
            check = check_reduce_scatter if kind == "reduce_scatter" else check_all_gather
            entries = list(_pairs(items, check, size))
        return BoundCollectives(self, kind, entries, reduce_op, label, detail, accumulate)

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
        bound = self.bind("all_reduce", tensors, op=op, label=label, detail=detail)
        return bound.issue(async_op)

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
        bound = self.bind(
            "reduce_scatter",
            pairs,
            op=op,
            label=label,
            detail=detail,
            accumulate_dtype=accumulate_dtype,
        )
        return bound.issue(async_op)

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
        return self.bind("all_gather", pairs, label=label, detail=detail).issue(async_op)

    def _session(self) -> Allocate:
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

    def __repr__(self) -> str:
        return f"Communicator(group ranks={list(ranks_of(self._group))}, kept={self.nbytes} B)"


class BoundCollectives:
    """A list of collectives of one kind on a :class:`Communicator`'s group, checked when
    bound (:meth:`Communicator.bind`); :meth:`issue` issues them, one entry alone, several
    in one coalesced batch (on gloo one batch per dtype, by ``by_dtype``), with the
    communicator's kept temporaries."""

    __slots__ = ("_accumulate", "_batches", "_comm", "_detail", "_kind", "_label", "_op")

    def __init__(
        self,
        comm: Communicator,
        kind: str,
        entries: Sequence[Entry],
        op: ReduceOp | None,
        label: str,
        detail: str,
        accumulate: torch.dtype | None,
    ) -> None:
        self._comm, self._kind, self._op = comm, kind, op
        self._label, self._detail, self._accumulate = label, detail, accumulate

        def dtype_of(entry: Entry) -> torch.dtype:
            return entry.dtype if isinstance(entry, torch.Tensor) else entry[1].dtype

        batches: list[list[Entry]] = [list(entries)]
        if accumulate is not None:  # each its own all-to-all (no coalesced all-to-all)
            batches = [[entry] for entry in entries]
        elif comm._by_dtype:
            batches = by_dtype(list(entries), dtype_of)
        self._batches = [batch for batch in batches if batch]

    @property
    def label(self) -> str:
        """The label every collective of the list carries."""
        return self._label

    def issue(self, async_op: object = False) -> CollectiveHandle:
        """Issue the list (asynchronously with ``async_op``: wait on the returned handle);
        nothing is checked again but ``async_op`` and the group's size."""
        if async_op is not True and async_op is not False:
            async_op = check_flag("async_op", async_op)
        group = self._comm._group
        if group.size() == 1:  # the result is the input itself
            for batch in self._batches:
                for entry in batch:
                    if not isinstance(entry, torch.Tensor):
                        copy_unless_alias(*entry)
            return DONE
        allocate = self._comm._session() if self._kind == "reduce_scatter" else fresh
        handles = [
            self._alone(batch[0], async_op, allocate)
            if len(batch) == 1
            else self._batched(batch, async_op, allocate)
            for batch in self._batches
        ]
        if len(handles) == 1:
            return handles[0]
        text = f"collectives on group ranks {list(ranks_of(group))}"
        return CollectiveHandle(
            description=f"{text} for '{self._label}'" if self._label else text,
            children=handles,
        )

    def _alone(self, entry: Entry, async_op: bool, allocate: Allocate) -> CollectiveHandle:
        group, label, detail = self._comm._group, self._label, self._detail
        if isinstance(entry, torch.Tensor):
            assert self._op is not None
            return _issue_all_reduce(entry, group, self._op, async_op, label, detail)
        output, input = entry
        if self._kind == "all_gather":
            return _issue_all_gather(output, input, group, async_op, label, detail)
        assert self._op is not None
        return _issue_reduce_scatter(
            output, input, group, self._op, async_op, label, detail, self._accumulate, allocate
        )

    def _batched(self, batch: list[Entry], async_op: bool, allocate: Allocate) -> CollectiveHandle:
        group = self._comm._group
        with open_batch(group, None, async_op, self._label, self._detail, allocate) as coalesced:
            for entry in batch:
                if isinstance(entry, torch.Tensor):
                    coalesced.all_reduce(entry, op=self._op or ReduceOp.SUM)
                elif self._kind == "all_gather":
                    coalesced.all_gather(*entry)
                else:
                    coalesced.reduce_scatter(*entry, op=self._op or ReduceOp.SUM)
        return coalesced.handle


def _checked_list(values: object, arg: str, kind: type[_T]) -> list[_T]:
    """``values`` as a list whose items are ``kind``s (``TypeError`` otherwise)."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise InputTypeError(f"{arg}={values!r} must be a list")
    items = list(values)
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise InputTypeError(f"{arg}[{i}] is a {type_name(item)}, not a {kind.__name__}")
    return items


def _pairs(
    pairs: object, check: Callable[[torch.Tensor, torch.Tensor, int], None], size: int
) -> list[Pair]:
    """Checked ``(output, input)`` pairs."""
    items = _checked_list(pairs, "pairs", tuple)
    for i, pair in enumerate(items):
        if len(pair) != 2:
            raise InputValueError(f"pairs[{i}] must be an (output, input) pair of tensors")
        try:
            check(pair[0], pair[1], size)
        except (TypeError, ValueError) as err:
            raise type(err)(f"pairs[{i}]: {err}") from None
    return [(output, input) for output, input in items]
