"""Coalesced batches: several collectives of one kind issued together on one group, through
the same issuing functions as the collectives alone (:mod:`mc_groups.comm.collectives`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_group
from mc_groups.comm.collectives import (
    DONE,
    Allocate,
    CollectiveHandle,
    ReduceOp,
    _issue_all_gather,
    _issue_all_reduce,
    _issue_reduce_scatter,
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
from mc_groups.errors import CollectiveError, InputValueError

__all__ = ["CoalescedBatch", "coalesced"]

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
        self._queued: list[Callable[[], CollectiveHandle]] = []
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

    def _submit(self, tensor: torch.Tensor, issue: Callable[[], CollectiveHandle]) -> None:
        self._payload.append(tensor)
        if self._deferred:
            self._queued.append(issue)
        else:
            self._issued.append(issue())

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM) -> None:
        """Queue ``tensor ← op over ranks``."""
        check_contiguous("tensor", tensor)
        op = check_op(op)
        self._claim("all_reduce", op)
        if self._size == 1:
            return
        self._submit(
            tensor,
            lambda: _issue_all_reduce(
                tensor, self._group, op, self._async, self._label, self._detail, coalesced=True
            ),
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM
    ) -> None:
        """Queue a reduce-scatter of ``input`` into ``output`` (see
        :func:`~mc_groups.reduce_scatter`)."""
        op = check_op(op)
        check_reduce_scatter(output, input, self._size)
        if self._copied_locally("reduce_scatter", op, output, input):
            return
        self._submit(
            input,
            lambda: _issue_reduce_scatter(
                output,
                input,
                self._group,
                op,
                self._async,
                self._label,
                self._detail,
                None,
                self._allocate,
                coalesced=True,
            ),
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Queue an all-gather of ``input`` into ``output`` (see :func:`~mc_groups.all_gather`)."""
        check_all_gather(output, input, self._size)
        if self._copied_locally("all_gather", None, output, input):
            return
        self._submit(
            input,
            lambda: _issue_all_gather(
                output, input, self._group, self._async, self._label, self._detail, coalesced=True
            ),
        )

    def _copied_locally(
        self, op: str, reduce_op: ReduceOp | None, output: torch.Tensor, input: torch.Tensor
    ) -> bool:
        """Claim the batch for ``op``; on a one-rank group the result is ``input`` itself:
        copy it into ``output`` and return True (nothing to issue)."""
        self._claim(op, reduce_op)
        if self._size > 1:
            return False
        copy_unless_alias(output, input)
        return True

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
            self._issued = [issue() for issue in queued]
            self._close(())
            return
        with coalescing_manager(group=self._group, device=device, async_ops=self._async) as cm:
            self._issued = [issue() for issue in queued]
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
