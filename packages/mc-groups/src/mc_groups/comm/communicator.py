"""Batched collectives on one group.

:func:`coalesced` (:class:`CoalescedBatch`) issues several collectives of one kind together,
through the same issuing functions as the collectives alone
(:mod:`mc_groups.comm.collectives`).

``Communicator``: one caller's batched collectives on one group, with the temporaries
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

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_group, type_name
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
    check_device,
    check_op,
    check_options,
    check_reduce_scatter,
    coalescing_manager,
    copy_unless_alias,
    dtype_name,
    fresh,
    is_gloo,
    kind_text,
    planned_text,
    ranks_of,
    schedule_check_enabled,
)
from mc_groups.comm.cross_rank import cross_check, key_device
from mc_groups.errors import CollectiveError, InputTypeError, InputValueError

__all__ = ["BoundCollectives", "CoalescedBatch", "Communicator", "coalesced"]

Pair = tuple[torch.Tensor, torch.Tensor]
"""``(output, input)`` of one reduce-scatter or all-gather."""

Entry = torch.Tensor | Pair
"""One collective of a bound list: a tensor (all-reduce) or a pair."""

_T = TypeVar("_T")
_Key = tuple[str, int, torch.dtype, torch.device]
_KINDS = ("all_reduce", "reduce_scatter", "all_gather")

_Kind = tuple[str, ReduceOp | None]


class CoalescedBatch:
    """Collectives issued together on one group.

    Use through :func:`coalesced`. After the ``with`` block, ``handle`` waits for the
    whole batch. A batch holds one kind of collective with one reduce op: NCCL coalesces
    only like with like, and (on torch 2.13 gloo) a coalesced reduce-scatter batch
    silently applies the first op's reduction to all of them. Mixing is a ``ValueError``
    raised before the odd one is issued.

    On NCCL the batch is one ``torch.distributed._coalescing_manager`` launch. On gloo,
    which gains nothing from coalescing on CPU, each collective is issued asynchronously
    as it is added (reduce-scatters and all-gathers as all-to-alls, see
    :mod:`mc_groups.comm.collectives`) and the batch's handle waits for all of them. With
    the schedule check on, the collectives are queued and issued when the block closes,
    after the batch as a whole was checked.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        async_op: bool,
        label: str,
        detail: str = "",
        allocate: Allocate = fresh,
    ) -> None:
        self._group = group
        self._allocate = allocate
        self._async = async_op
        self._label = label
        self._detail = detail
        self._size = group.size()
        self._kind: _Kind | None = None
        self._per_op = self._size > 1 and is_gloo(group)
        self._deferred = self._size > 1 and schedule_check_enabled()
        self._queued: list[Entry] = []
        self._payload: list[torch.Tensor] = []
        self._issued: list[CollectiveHandle] = []
        self.handle: CollectiveHandle = DONE
        self._closed = False

    def _claim(self, op: str, reduce_op: ReduceOp | None) -> None:
        if self._closed:
            raise RuntimeError(
                f"{self.describe()} was closed when its with block ended; add collectives "
                "inside the block, or open a new batch with coalesced()"
            )
        kind = (op, reduce_op)
        if self._kind is not None and self._kind != kind:
            raise InputValueError(
                f"coalesced batch already holds {kind_text(*self._kind)}; cannot add "
                f"{kind_text(*kind)} (one kind of collective and reduce op per batch: open "
                "a second batch)"
            )
        self._kind = kind

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM) -> None:
        """Queue ``tensor ← op over ranks``."""
        check_contiguous("tensor", tensor)
        self._add("all_reduce", check_op(op), tensor)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM
    ) -> None:
        """Queue a reduce-scatter of ``input`` into ``output`` (see
        :func:`~mc_groups.reduce_scatter`)."""
        op = check_op(op)
        check_reduce_scatter(output, input, self._size)
        self._add("reduce_scatter", op, (output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Queue an all-gather of ``input`` into ``output`` (see :func:`~mc_groups.all_gather`)."""
        check_all_gather(output, input, self._size)
        self._add("all_gather", None, (output, input))

    def _add(self, op: str, reduce_op: ReduceOp | None, entry: Entry) -> None:
        """Claim the batch for ``op`` and add a checked entry: issued now, or queued until
        the batch is checked as a whole (schedule check on). On a one-rank group the result
        is the input itself (a pair's input copied into its output): nothing is issued."""
        self._claim(op, reduce_op)
        if self._size == 1:
            if not isinstance(entry, torch.Tensor):
                copy_unless_alias(*entry)
            return
        self._payload.append(entry if isinstance(entry, torch.Tensor) else entry[1])
        if self._deferred:
            self._queued.append(entry)
        else:
            self._issued.append(self._issue(entry))

    def _issue(self, entry: Entry) -> CollectiveHandle:
        assert self._kind is not None  # claimed by _add
        op, reduce_op = self._kind
        return _issue_entry(
            op,
            entry,
            self._group,
            reduce_op,
            self._async,
            self._label,
            self._detail,
            None,
            self._allocate,
            coalesced=True,
        )

    def describe(self) -> str:
        """``coalesced batch of 2 × reduce_scatter(sum) on group ranks [0, 1] for 'label'``."""
        kind = "nothing" if self._kind is None else kind_text(*self._kind)
        text = (
            f"coalesced batch of {len(self._payload)} × {kind} on group ranks "
            f"{list(ranks_of(self._group))}"
        )
        if self._label:
            text += f" for '{self._label}'"
        if self._detail:
            text += f" [{self._detail}]"
        return text

    def _planned(self) -> str:
        kind = "nothing" if self._kind is None else kind_text(*self._kind)
        sizes = ", ".join(f"{t.numel()} × {dtype_name(t.dtype)}" for t in self._payload)
        batch = f"coalesced {len(self._payload)} × {kind}"
        return planned_text(batch, sizes, self._label, self._detail)

    def _flush(self, device: torch.device | None) -> None:
        """Deferred mode: check the whole batch, then issue it (and close it)."""
        if not self._queued:
            return
        first = self._payload[0]
        cross_check(self._group, self._planned(), device=key_device(self._group, first))
        queued, self._queued = self._queued, []
        if self._per_op:
            self._issued = [self._issue(entry) for entry in queued]
            self._close(())
            return
        with coalescing_manager(group=self._group, device=device, async_ops=self._async) as cm:
            self._issued = [self._issue(entry) for entry in queued]
        self._close(cm.works if self._async else ())

    def _close(self, manager_works: Sequence[Any]) -> None:
        """Turn what was issued into :attr:`handle` (one handle naming the batch, holding
        every collective's work and local step); wait now unless the batch is async."""
        issued = self._issued if self._per_op else []  # under the manager: its works only
        works = [*manager_works, *(w for h in issued for w in h._works)]
        finishers = [f for h in issued for f in h._finishers]
        self.handle = CollectiveHandle(works, self.describe(), finishers)
        if not self._async:
            self.handle.wait()
            self.handle = DONE


@contextmanager
def coalesced(
    group: dist.ProcessGroup,
    *,
    device: torch.device | None = None,
    async_op: bool = False,
    label: str = "",
    detail: str = "",
) -> Iterator[CoalescedBatch]:
    """Issue the batch's collectives together (see :class:`CoalescedBatch`).

    With ``async_op`` the block returns at once and ``batch.handle.wait()`` completes the
    batch; without it the block returns after the batch is done. ``label`` names the
    batch's role in records and errors; ``detail`` (e.g. a bucket's param layout) is shown
    in errors and compared by the schedule check.
    """
    check_group("group", group)
    check_options(async_op, label, detail, group=group)
    check_device(device)
    with open_batch(group, device, async_op, label, detail, fresh) as batch:
        yield batch


@contextmanager
def open_batch(
    group: dist.ProcessGroup,
    device: torch.device | None,
    async_op: bool,
    label: str,
    detail: str,
    allocate: Allocate,
) -> Iterator[CoalescedBatch]:
    """:func:`coalesced` with checked arguments; ``allocate`` gives the batch's
    reduce-scatter temporaries (a :class:`~mc_groups.comm.communicator.Communicator` passes its
    kept ones)."""
    batch = CoalescedBatch(group, async_op, label, detail, allocate)
    try:
        if group.size() == 1:
            yield batch
            return
        if batch._deferred:
            yield batch
            batch._flush(device)
            return
        if batch._per_op:
            yield batch
            batch._close(())
            return
        with coalescing_manager(group=group, device=device, async_ops=async_op) as cm:
            yield batch
        batch._close(cm.works if async_op else ())
    except CollectiveError:
        raise
    except RuntimeError as err:
        raise CollectiveError(f"{batch.describe()} failed: {err}") from err
    finally:
        batch._closed = True  # a collective added later would run outside the batch


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
        return _issue_entry(
            self._kind,
            entry,
            self._comm._group,
            self._op,
            async_op,
            self._label,
            self._detail,
            self._accumulate,
            allocate,
        )

    def _batched(self, batch: list[Entry], async_op: bool, allocate: Allocate) -> CollectiveHandle:
        group = self._comm._group
        with open_batch(group, None, async_op, self._label, self._detail, allocate) as coalesced:
            for entry in batch:  # checked when bound
                coalesced._add(self._kind, self._op, entry)
        return coalesced.handle


def _issue_entry(
    kind: str,
    entry: Entry,
    group: dist.ProcessGroup,
    op: ReduceOp | None,
    async_op: bool,
    label: str,
    detail: str,
    accumulate: torch.dtype | None,
    allocate: Allocate,
    *,
    coalesced: bool = False,
) -> CollectiveHandle:
    """One checked entry of a list of ``kind`` (a tensor to all-reduce, else an ``(output,
    input)`` pair), through its collective's issuing function: the one route of a
    :class:`BoundCollectives` entry issued alone and of every entry of a coalesced batch."""
    if isinstance(entry, torch.Tensor):
        assert op is not None  # an all-reduce's op, checked
        return _issue_all_reduce(entry, group, op, async_op, label, detail, coalesced)
    output, input = entry
    if kind == "all_gather":
        return _issue_all_gather(output, input, group, async_op, label, detail, coalesced)
    assert op is not None  # a reduce-scatter's op, checked
    return _issue_reduce_scatter(
        output, input, group, op, async_op, label, detail, accumulate, allocate, coalesced
    )


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
