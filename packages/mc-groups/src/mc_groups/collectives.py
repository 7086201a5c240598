"""The collective layer: the only mc module that calls ``torch.distributed`` collectives.

Why one layer:
- every collective is recorded (:func:`mc_groups.record_collectives`) so tests can count
  what ran, on which group, with how many bytes;
- inputs are validated (shapes, dtypes, devices) before anything is issued, so a bad call
  raises a ``ValueError`` on the caller's rank instead of hanging its peers;
- a group of one rank short-circuits to a local copy without touching torch.distributed;
- failures and timeouts surface as :class:`CollectiveError` naming the operation, the
  group's ranks and the payload, so a dead peer reads as "all_reduce on ranks [0, 1]
  failed" rather than a gloo socket error far from the cause;
- torch-version shims live here (``reduce_scatter_single``/``all_gather_single`` replace
  the deprecated ``*_tensor`` names in torch 2.13).

Every wait is bounded: a handle's :meth:`CollectiveHandle.wait` takes a timeout and, when
none is given, the process group's own timeout (set at group creation) bounds the
operation.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mc_groups.recorder import CollectiveRecord, _emit, _recording

__all__ = [
    "CoalescedBatch",
    "CollectiveError",
    "CollectiveHandle",
    "ReduceOp",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "coalesced",
    "group_rank",
    "group_ranks",
    "group_size",
    "needs_staging",
    "recv",
    "reduce_scatter",
    "send",
]


class ReduceOp(enum.Enum):
    """Reductions mc uses. ``AVG`` divides by the group size inside the collective."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


# torch 2.13 renamed the flat-tensor collectives; older releases only have *_tensor.
def _first_attr(*names: str) -> Callable[..., Any]:
    for name in names:
        found = getattr(dist, name, None)
        if found is not None:
            return found  # type: ignore[no-any-return]
    raise ImportError(f"torch.distributed has none of {names}")


_reduce_scatter_flat = _first_attr("reduce_scatter_single", "reduce_scatter_tensor")
_all_gather_flat = _first_attr("all_gather_single", "all_gather_into_tensor")
_coalescing_manager: Callable[..., Any] = _first_attr("_coalescing_manager")


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time; the message names op and group."""


class _Waitable(Protocol):
    def wait(self, timeout: timedelta = ...) -> Any: ...


class CollectiveHandle:
    """An issued collective. ``wait()`` blocks until it is done, bounded by a timeout.

    Synchronous calls and single-rank groups return an already-completed handle.
    ``finishers`` run once, in order, after every work finished (the local step of a
    collective composed from others, e.g. the sum after a gloo all-to-all).
    """

    def __init__(
        self,
        works: Sequence[Any],
        description: str,
        finishers: Sequence[Callable[[], None]] = (),
    ) -> None:
        self._works = list(works)
        self._finishers = list(finishers)
        self._description = description

    @property
    def description(self) -> str:
        """What this handle waits for, e.g. ``all_reduce on ranks [0, 1] (8 × float32)``."""
        return self._description

    def is_completed(self) -> bool:
        """True once every underlying work object has finished (never blocks)."""
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for completion; raise :class:`CollectiveError` on failure or timeout.

        Args:
            timeout: seconds to wait at most; ``None`` relies on the process group's
                timeout, which torch enforces on every operation.
        """
        works, self._works = self._works, []
        for work in works:
            try:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=timeout))
            except RuntimeError as err:
                raise CollectiveError(f"{self._description} failed: {err}") from err
        finishers, self._finishers = self._finishers, []
        for finish in finishers:
            finish()


_DONE = CollectiveHandle((), "completed")


def group_size(group: dist.ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return int(group.size())


def group_rank(group: dist.ProcessGroup) -> int:
    """This process's rank inside ``group``."""
    return int(group.rank())


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order."""
    if group.size() == 1 and not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group))


def _describe(op: str, group: dist.ProcessGroup, tensor: torch.Tensor | None) -> str:
    payload = "" if tensor is None else f" ({tensor.numel()} × {_dtype_name(tensor.dtype)})"
    return f"{op} on group ranks {list(group_ranks(group))}{payload}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _record(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None,
    *,
    reduce_op: ReduceOp | None,
    async_op: bool,
    coalesced: bool = False,
    label: str = "",
) -> None:
    if not _recording():
        return
    numel = 0 if tensor is None else tensor.numel()
    _emit(
        CollectiveRecord(
            op=op,
            reduce_op=None if reduce_op is None else reduce_op.value,
            group_ranks=group_ranks(group),
            dtype=None if tensor is None else tensor.dtype,
            numel=numel,
            bytes=0 if tensor is None else numel * tensor.element_size(),
            async_op=async_op,
            coalesced=coalesced,
            label=label,
        )
    )


def _issue(description: str, call: Callable[[], Any], *, async_op: bool) -> CollectiveHandle:
    """Run a torch.distributed call; wrap its failure; wrap its work in a handle."""
    try:
        work = call()
    except RuntimeError as err:
        raise CollectiveError(f"{description} failed: {err}") from err
    if not async_op or work is None:
        return _DONE
    return CollectiveHandle([work], description)


def _check_group(group: object, arg: str = "group") -> None:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{arg}={group!r} must be a torch.distributed.ProcessGroup")


def _check_tensor(t: object, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{arg} (shape {tuple(t.shape)}) must be contiguous; call .contiguous()")
    return t


def _check_pair(out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    if out.dtype != inp.dtype:
        raise ValueError(f"{op}: output dtype {out.dtype} differs from input dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{op}: output device {out.device} differs from input {inp.device}")


def _check_op(op: object) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op={op!r} must be a mc_groups.ReduceOp (SUM, AVG, MAX or MIN)")
    return op


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
) -> CollectiveHandle:
    """``tensor ← op over ranks of tensor``, in place."""
    _check_group(group)
    _check_tensor(tensor, "tensor")
    _check_op(op)
    if group.size() == 1:
        return _DONE
    _record("all_reduce", group, tensor, reduce_op=op, async_op=async_op, label=label)
    return _issue(
        _describe("all_reduce", group, tensor),
        lambda: dist.all_reduce(tensor, op=_TORCH_OPS[op], group=group, async_op=async_op),
        async_op=async_op,
    )


def _check_reduce_scatter(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_pair(output, input, "reduce_scatter")
    if input.numel() != output.numel() * size:
        raise ValueError(
            f"reduce_scatter: input.numel()={input.numel()} must equal "
            f"output.numel()={output.numel()} × group size {size}"
        )


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return bool(dist.get_backend(group) == "gloo")


def needs_staging(group: dist.ProcessGroup) -> bool:
    """True when :func:`reduce_scatter` / :func:`all_gather` on ``group`` use a staging
    tensor the size of the full (unsharded) buffer: gloo groups of more than one rank.

    Callers that repeat a collective on the same buffer pass a kept ``staging`` tensor:
    on CPU a fresh 33 MB tensor costs about 27 ms of page faults per use, a reused one
    1.5 ms to fill (measured on this project's 2-core machines).
    """
    return group.size() > 1 and _is_gloo(group)


def _staging_for(full: torch.Tensor, staging: torch.Tensor | None) -> torch.Tensor:
    if staging is None:
        return torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    if (
        not isinstance(staging, torch.Tensor)
        or staging.numel() != full.numel()
        or staging.dtype != full.dtype
        or staging.device != full.device
        or not staging.is_contiguous()
    ):
        shown = (
            staging
            if not isinstance(staging, torch.Tensor)
            else (f"{staging.numel()} × {_dtype_name(staging.dtype)} on {staging.device}")
        )
        raise ValueError(
            f"staging={shown} must be a contiguous tensor of {full.numel()} × "
            f"{_dtype_name(full.dtype)} on {full.device} (the full buffer's size)"
        )
    return staging.view(-1)


def _reduce_rows(rows: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> None:
    """``out ← op over dim 0 of rows`` (one row per rank, in group-rank order).

    Sums are taken in fp32 and rounded once into ``out``'s dtype.
    """
    if op is ReduceOp.MAX:
        torch.amax(rows, dim=0, out=out)
        return
    if op is ReduceOp.MIN:
        torch.amin(rows, dim=0, out=out)
        return
    if out.dtype in (torch.float32, torch.float64):
        torch.sum(rows, dim=0, out=out)
        if op is ReduceOp.AVG:
            out.div_(rows.shape[0])
        return
    total = rows.sum(dim=0, dtype=torch.float32)
    if op is ReduceOp.AVG:
        total.div_(rows.shape[0])
    out.copy_(total)


def _reduce_scatter_by_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    received: torch.Tensor,
) -> tuple[Any, Callable[[], None]]:
    """Gloo's reduce-scatter, built from an all-to-all and a local reduction.

    Rank r receives slice r of every rank's ``input`` into ``staging`` (row j = rank j's
    copy), then reduces the rows into ``output``. torch 2.13 gloo's own reduce-scatter
    reduces everything and then slices: about twice an all-reduce; this one moves the same
    bytes as a ring reduce-scatter (100 MB on 2 ranks: 200 → 53 ms, measured). ``output``
    may alias ``input``: it is written only after the all-to-all completed. ``received``
    is a flat buffer of ``input``'s numel and dtype.
    """
    work = dist.all_to_all_single(received, input.view(-1), group=group, async_op=async_op)

    def finish() -> None:
        _reduce_rows(received.view(group.size(), -1), op, output.view(-1))

    return work, finish


def _all_gather_by_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
    repeated: torch.Tensor,
) -> Any:
    """Gloo's all-gather as an all-to-all of the repeated shard.

    Rank r sends ``[x_r | x_r | … | x_r]`` (``staging``); rank r then receives chunk r of
    every rank's input, which is ``x_s`` from rank s: ``output = [x_0 | … | x_{W-1}]``.
    torch 2.13 gloo's ``all_gather_single`` took 175 ms for 100 MB on 2 ranks, this 53 ms
    (measured). ``input`` may be a view of ``output``: it is copied into ``repeated`` (a flat
    buffer of ``output``'s numel and dtype) before the collective.
    """
    repeated.view(group.size(), -1).copy_(input.reshape(1, -1).expand(group.size(), -1))
    return dist.all_to_all_single(output.view(-1), repeated, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    staging: torch.Tensor | None = None,
) -> CollectiveHandle:
    """Reduce the flat ``input`` over ranks; group rank r keeps slice r in ``output``.

    ``input`` is split along dim 0 into ``group size`` equal parts. ``output`` may be a view
    of ``input`` (this rank's shard of a flat buffer). On gloo it runs as an all-to-all plus
    a local reduction in group-rank order, in fp32 for narrower dtypes (see
    :func:`needs_staging`; ``staging`` is an optional reused receive buffer of
    ``input``'s numel and dtype).
    """
    _check_group(group)
    _check_op(op)
    size = group.size()
    _check_reduce_scatter(output, input, size)
    if size == 1:
        _copy_unless_alias(output, input)
        return _DONE
    description = _describe("reduce_scatter", group, input)
    if _is_gloo(group):
        received = _staging_for(input, staging)
        _record("reduce_scatter", group, input, reduce_op=op, async_op=async_op, label=label)
        try:
            work, finish = _reduce_scatter_by_all_to_all(
                output, input, group, op, async_op, received
            )
        except RuntimeError as err:
            raise CollectiveError(f"{description} failed: {err}") from err
        if not async_op:
            finish()
            return _DONE
        return CollectiveHandle([work], description, [finish])
    _record("reduce_scatter", group, input, reduce_op=op, async_op=async_op, label=label)
    return _issue(
        description,
        lambda: _reduce_scatter_flat(
            output, input, op=_TORCH_OPS[op], group=group, async_op=async_op
        ),
        async_op=async_op,
    )


def _check_all_gather(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_pair(output, input, "all_gather")
    if output.numel() != input.numel() * size:
        raise ValueError(
            f"all_gather: output.numel()={output.numel()} must equal "
            f"input.numel()={input.numel()} × group size {size}"
        )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    label: str = "",
    staging: torch.Tensor | None = None,
) -> CollectiveHandle:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (group-rank order).

    ``input`` may be a view of ``output`` (this rank's shard of a flat buffer). On gloo it
    runs as an all-to-all of the repeated input (see :func:`needs_staging`; ``staging`` is
    an optional reused send buffer of ``output``'s numel and dtype).
    """
    _check_group(group)
    size = group.size()
    _check_all_gather(output, input, size)
    if size == 1:
        _copy_unless_alias(output, input)
        return _DONE
    description = _describe("all_gather", group, input)
    if _is_gloo(group):
        repeated = _staging_for(output, staging)
        _record("all_gather", group, input, reduce_op=None, async_op=async_op, label=label)
        return _issue(
            description,
            lambda: _all_gather_by_all_to_all(output, input, group, async_op, repeated),
            async_op=async_op,
        )
    _record("all_gather", group, input, reduce_op=None, async_op=async_op, label=label)
    return _issue(
        description,
        lambda: _all_gather_flat(output, input, group=group, async_op=async_op),
        async_op=async_op,
    )


def broadcast(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    group_src: int = 0,
    async_op: bool = False,
    label: str = "",
) -> CollectiveHandle:
    """Copy ``tensor`` from the rank whose *group* rank is ``group_src`` to every rank."""
    _check_group(group)
    _check_tensor(tensor, "tensor")
    size = group.size()
    if isinstance(group_src, bool) or not isinstance(group_src, int) or not 0 <= group_src < size:
        raise ValueError(f"group_src={group_src!r} must be a group rank in [0, {size})")
    if size == 1:
        return _DONE
    _record("broadcast", group, tensor, reduce_op=None, async_op=async_op, label=label)
    return _issue(
        _describe("broadcast", group, tensor),
        lambda: dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op),
        async_op=async_op,
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    async_op: bool = False,
    label: str = "",
) -> CollectiveHandle:
    """Rank r sends split j of ``input`` (dim 0) to rank j and receives split r of theirs.

    Without split sizes, dim 0 is split evenly.
    """
    _check_group(group)
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_pair(output, input, "all_to_all")
    size = group.size()
    for name, splits in (
        ("input_split_sizes", input_split_sizes),
        ("output_split_sizes", output_split_sizes),
    ):
        if splits is not None and len(splits) != size:
            raise ValueError(f"all_to_all: {name}={list(splits)} must have {size} entries")
    if size == 1:
        _copy_unless_alias(output, input)
        return _DONE
    _record("all_to_all", group, input, reduce_op=None, async_op=async_op, label=label)
    out_splits = None if output_split_sizes is None else list(output_split_sizes)
    in_splits = None if input_split_sizes is None else list(input_split_sizes)
    return _issue(
        _describe("all_to_all", group, input),
        lambda: dist.all_to_all_single(
            output, input, out_splits, in_splits, group=group, async_op=async_op
        ),
        async_op=async_op,
    )


def send(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_dst: int, label: str = ""
) -> None:
    """Point-to-point send of ``tensor`` to group rank ``group_dst`` (blocking)."""
    _check_group(group)
    _check_tensor(tensor, "tensor")
    _check_peer(group, group_dst, "group_dst")
    _record("send", group, tensor, reduce_op=None, async_op=False, label=label)
    _issue(
        _describe("send", group, tensor),
        lambda: dist.send(tensor, group=group, group_dst=group_dst),
        async_op=False,
    )


def recv(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_src: int, label: str = ""
) -> None:
    """Point-to-point receive into ``tensor`` from group rank ``group_src`` (blocking)."""
    _check_group(group)
    _check_tensor(tensor, "tensor")
    _check_peer(group, group_src, "group_src")
    _record("recv", group, tensor, reduce_op=None, async_op=False, label=label)
    _issue(
        _describe("recv", group, tensor),
        lambda: dist.recv(tensor, group=group, group_src=group_src),
        async_op=False,
    )


def _check_peer(group: dist.ProcessGroup, peer: object, arg: str) -> None:
    size, me = group.size(), group.rank()
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size or peer == me:
        raise ValueError(f"{arg}={peer!r} must be another group rank in [0, {size}), not {me}")


def barrier(group: dist.ProcessGroup, *, label: str = "") -> None:
    """Block until every rank of ``group`` reached this call (bounded by the group timeout)."""
    _check_group(group)
    if group.size() == 1:
        return
    _record("barrier", group, None, reduce_op=None, async_op=False, label=label)
    _issue(_describe("barrier", group, None), lambda: dist.barrier(group=group), async_op=False)


def all_gather_objects(obj: object, group: dist.ProcessGroup, *, label: str = "") -> list[object]:
    """Every rank's picklable ``obj``, in group-rank order."""
    _check_group(group)
    size = group.size()
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    _record("all_gather_object", group, None, reduce_op=None, async_op=False, label=label)
    _issue(
        _describe("all_gather_object", group, None),
        lambda: dist.all_gather_object(out, obj, group=group),
        async_op=False,
    )
    return out


def _copy_unless_alias(output: torch.Tensor, input: torch.Tensor) -> None:
    same = output.data_ptr() == input.data_ptr() and output.numel() == input.numel()
    if not same:
        output.view(-1).copy_(input.view(-1))


class CoalescedBatch:
    """Collectives issued together on one group.

    Use through :func:`coalesced`. After the ``with`` block, :attr:`handle` waits for the
    whole batch. A batch holds one kind of collective with one reduce op: NCCL coalesces
    only like with like, and (measured on torch 2.13 gloo) a coalesced reduce-scatter batch
    silently applies the first op's reduction to all of them. Mixing is a ``ValueError``
    raised before the odd one is issued.

    On NCCL the batch is one ``torch.distributed._coalescing_manager`` launch. On gloo,
    which gains nothing from coalescing on CPU, each collective is issued asynchronously
    as it is added (reduce-scatters as all-to-all + local reduction, see
    :func:`reduce_scatter`) and the batch's handle waits for all of them.
    """

    def __init__(self, group: dist.ProcessGroup, async_op: bool, label: str) -> None:
        self._group = group
        self._async = async_op
        self._label = label
        self._size = group.size()
        self._kind: tuple[str, ReduceOp | None] | None = None
        self._per_op = self._size > 1 and _is_gloo(group)
        self._works: list[Any] = []
        self._finishers: list[Callable[[], None]] = []
        self.handle: CollectiveHandle = _DONE

    def _claim(self, op: str, reduce_op: ReduceOp | None) -> None:
        kind = (op, reduce_op)
        if self._kind is not None and self._kind != kind:
            raise ValueError(
                f"coalesced batch already holds {_kind_text(self._kind)}; cannot add "
                f"{_kind_text(kind)} (one kind of collective and reduce op per batch: open "
                "a second batch)"
            )
        self._kind = kind

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM) -> None:
        """Queue ``tensor ← op over ranks``."""
        _check_tensor(tensor, "tensor")
        _check_op(op)
        self._claim("all_reduce", op)
        if self._size == 1:
            return
        self._note("all_reduce", tensor, op)
        self._add(
            dist.all_reduce(
                tensor, op=_TORCH_OPS[op], group=self._group, async_op=self._async or self._per_op
            )
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: ReduceOp = ReduceOp.SUM,
        staging: torch.Tensor | None = None,
    ) -> None:
        """Queue a reduce-scatter of ``input`` into ``output`` (see :func:`reduce_scatter`)."""
        _check_op(op)
        _check_reduce_scatter(output, input, self._size)
        self._claim("reduce_scatter", op)
        if self._size == 1:
            _copy_unless_alias(output, input)
            return
        if self._per_op:
            received = _staging_for(input, staging)
            self._note("reduce_scatter", input, op)
            work, finish = _reduce_scatter_by_all_to_all(
                output, input, self._group, op, True, received
            )
            self._add(work, finish)
            return
        self._note("reduce_scatter", input, op)
        self._add(
            _reduce_scatter_flat(
                output, input, op=_TORCH_OPS[op], group=self._group, async_op=self._async
            )
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, staging: torch.Tensor | None = None
    ) -> None:
        """Queue an all-gather of ``input`` into ``output`` (see :func:`all_gather`)."""
        _check_all_gather(output, input, self._size)
        self._claim("all_gather", None)
        if self._size == 1:
            _copy_unless_alias(output, input)
            return
        if self._per_op:
            repeated = _staging_for(output, staging)
            self._note("all_gather", input, None)
            self._add(_all_gather_by_all_to_all(output, input, self._group, True, repeated))
            return
        self._note("all_gather", input, None)
        self._add(_all_gather_flat(output, input, group=self._group, async_op=self._async))

    def _add(self, work: Any, finish: Callable[[], None] | None = None) -> None:
        if self._per_op and work is not None:
            self._works.append(work)
        if finish is not None:
            self._finishers.append(finish)

    def _note(self, op: str, tensor: torch.Tensor, reduce_op: ReduceOp | None) -> None:
        _record(
            op,
            self._group,
            tensor,
            reduce_op=reduce_op,
            async_op=self._async,
            coalesced=True,
            label=self._label,
        )

    def _close(self, description: str, manager_works: Sequence[Any]) -> None:
        """Turn what was issued into :attr:`handle`; wait now unless the batch is async."""
        works = self._works if self._per_op else list(manager_works)
        self.handle = CollectiveHandle(works, description, self._finishers)
        if not self._async:
            self.handle.wait()
            self.handle = _DONE


def _kind_text(kind: tuple[str, ReduceOp | None]) -> str:
    op, reduce_op = kind
    return op if reduce_op is None else f"{op}({reduce_op.value})"


@contextmanager
def coalesced(
    group: dist.ProcessGroup,
    *,
    device: torch.device | None = None,
    async_op: bool = False,
    label: str = "",
) -> Iterator[CoalescedBatch]:
    """Issue the batch's collectives together (see :class:`CoalescedBatch`).

    With ``async_op`` the block returns at once and ``batch.handle.wait()`` completes the
    batch; without it the block returns after the batch is done.
    """
    _check_group(group)
    batch = CoalescedBatch(group, async_op, label)
    if group.size() == 1:
        yield batch
        return
    description = f"coalesced batch on group ranks {list(group_ranks(group))}"
    try:
        if batch._per_op:
            yield batch
            batch._close(description, ())
            return
        with _coalescing_manager(group=group, device=device, async_ops=async_op) as cm:
            yield batch
        batch._close(description, cm.works if async_op else ())
    except CollectiveError:
        raise
    except RuntimeError as err:
        raise CollectiveError(f"{description} failed: {err}") from err
