"""The collectives of the layer (:mod:`mc_groups.comm`, the only part of mc that calls
``torch.distributed`` collectives): typed, validated, bounded and recorded wrappers, each
returning a :class:`~mc_groups.CollectiveHandle`.

Why one layer:

- every collective is recorded (:func:`mc_groups.record_collectives`) so tests can count
  what ran, on which group, with how many bytes;
- inputs are validated (shapes, dtypes, devices) before anything is issued, so a bad call
  raises a ``ValueError`` on the caller's rank instead of hanging its peers;
- a group of one rank short-circuits to a local copy without touching torch.distributed;
- failures and timeouts surface as :class:`CollectiveError` naming the operation, the
  group's global ranks, the payload and the caller's ``label`` (the group's role, e.g.
  ``"grad reduce dense bucket group 0"``), from the issuing call, from
  :meth:`CollectiveHandle.wait` and from a coalesced batch alike, so a dead peer reads as
  "reduce_scatter on group ranks [0, 1] (484 × float32) for 'grad reduce dense bucket
  group 0' failed: … Connection closed by peer" rather than a gloo socket error far from
  the cause;
- an opt-in schedule check compares every collective across the group's ranks before it
  is issued (:mod:`mc_groups.comm.cross_rank`);
- torch-version shims live here (``reduce_scatter_single``/``all_gather_single`` replace
  the deprecated ``*_tensor`` names in torch 2.13).

Every wait is bounded: a handle's :meth:`CollectiveHandle.wait` takes a timeout and, when
none is given, the process group's own timeout (set at group creation; groups built by
:func:`mc_groups.initialize_model_parallel` inherit the default group's) bounds the
operation. On gloo a peer that exits is reported at once ("Connection closed by
peer"), a peer that hangs after the group's timeout.

``label`` (every call) names the collective's role in records and errors; ``detail`` (the
collectives that carry a caller's data) says what the tensor holds, e.g. a bucket's
param layout: it is shown in errors and compared by the schedule check, never recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_group, type_name
from mc_groups.collection import is_group_live
from mc_groups.comm import _gloo as gloo
from mc_groups.comm import _reduce_scatter as rs
from mc_groups.comm._coalesced import CoalescedBatch, coalesced
from mc_groups.comm._common import (
    DONE,
    TORCH_OPS,
    CollectiveHandle,
    Planned,
    ReduceOp,
    by_dtype,
    check_all_gather,
    check_contiguous,
    check_op,
    check_options,
    check_pair,
    check_reduce_scatter,
    check_schedule,
    copy_unless_alias,
    describe_later,
    dtype_name,
    failed,
    group_rank,
    group_ranks,
    group_size,
    issue,
    record,
)
from mc_groups.comm._shims import all_gather_flat
from mc_groups.comm.cross_rank import schedule_check_enabled
from mc_groups.comm.recorder import _recording
from mc_groups.errors import (
    CollectiveError,
    CollectiveScheduleError,
    InputTypeError,
    InputValueError,
)

__all__ = [
    "CoalescedBatch",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveScheduleError",
    "ReduceOp",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_reduce_flat",
    "all_to_all",
    "barrier",
    "broadcast",
    "coalesced",
    "group_rank",
    "group_ranks",
    "group_size",
    "is_group_live",
    "record_p2p_ops",
    "recv",
    "reduce_scatter",
    "send",
]


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    detail: str = "",
) -> CollectiveHandle:
    """``tensor ← op over ranks of tensor``, in place."""
    check_group("group", group)
    check_contiguous("tensor", tensor)
    op = check_op(op)
    check_options(async_op, label, detail, group=group)
    if group.size() == 1:
        return DONE
    return _issue_all_reduce(tensor, group, op, async_op, label, detail)


def _issue_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    label: str,
    detail: str = "",
) -> CollectiveHandle:
    """:func:`all_reduce` once its arguments are known good (a contiguous tensor, a live
    group of more than one rank, a checked op, a bool and strings): the schedule check,
    the record, the call, its failure named, its work on a handle. Also the eager path of
    :func:`mc_groups.all_reduce_tensor` and :func:`mc_groups.start_all_reduce`, which
    checked them.

    The steps of :func:`issue` (and of :func:`check_schedule` and :func:`record`) written
    out in one function: the TP layers run two all-reduces per block per step, and on a
    small block the Python calls around ``torch.distributed.all_reduce`` cost as much as
    the call itself (``benchmarks/host_cost.py``). What runs is the same."""
    if schedule_check_enabled():
        check_schedule("all_reduce", group, tensor, reduce_op=op, label=label, detail=detail)
    if _recording():
        record("all_reduce", group, tensor, reduce_op=op, async_op=async_op, label=label)
    try:
        work = dist.all_reduce(tensor, op=TORCH_OPS[op], group=group, async_op=async_op)
    except RuntimeError as err:
        raise failed(("all_reduce", group, tensor, label, detail), err) from err
    if not async_op or work is None:
        return DONE
    return CollectiveHandle.of_work(work, ("all_reduce", group, tensor, label, detail))


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    detail: str = "",
    accumulate_dtype: torch.dtype | None = None,
    received: torch.Tensor | None = None,
) -> CollectiveHandle:
    """Reduce the flat ``input`` over ranks; group rank r keeps slice r in ``output``.

    ``input`` is split along dim 0 into ``group size`` equal parts. ``output`` may be a view
    of ``input`` (this rank's shard of a flat buffer).

    - On gloo it runs as an all-to-all plus a local reduction in group-rank order, in fp32
      for narrower dtypes; recorded as a ``reduce_scatter``.
    - ``accumulate_dtype`` (e.g. ``torch.float32``): on every backend, an all-to-all in the
      input's dtype, then ``output = dtype(op_s acc(x_s^r))``, rounded once from the sum
      taken in ``accumulate_dtype`` (Megatron's fp32-accumulating reduce-scatter: a bf16
      ring rounds after every addition). Recorded, checked and named in errors as the
      ``all_to_all`` it communicates with.
    - ``received``: the all-to-all's receive buffer (``input``'s numel, dtype and device),
      used when the reduce-scatter runs as an all-to-all; None: a fresh one per call.
      Callers repeating the collective use a :class:`~mc_groups.Communicator`, which keeps
      its buffers. See :mod:`mc_groups.comm._reduce_scatter` for the algorithms.
    """
    check_group("group", group)
    op = check_op(op)
    check_options(async_op, label, detail, group=group)
    size = group.size()
    check_reduce_scatter(output, input, size)
    accumulate = rs.check_accumulate_dtype(accumulate_dtype)
    rs.check_received(input, received)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    allocate = rs.given(received)
    return rs.issue_reduce_scatter(
        output, input, group, op, async_op, label, detail, accumulate, allocate
    )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    label: str = "",
    detail: str = "",
) -> CollectiveHandle:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (group-rank order).

    ``input`` may be a view of ``output`` (this rank's shard of a flat buffer). On gloo it
    runs as point-to-point exchanges straight into ``output`` (each rank sends its shard to
    every other rank; no staging buffer) from 4 MiB of output on, as an all-to-all of the
    repeated input below that; recorded as one ``all_gather`` either way.
    """
    check_group("group", group)
    check_options(async_op, label, detail, group=group)
    size = group.size()
    check_all_gather(output, input, size)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    return _issue_all_gather(output, input, group, async_op, label, detail)


def _issue_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
    label: str,
    detail: str = "",
) -> CollectiveHandle:
    """:func:`all_gather` once its arguments are known good (contiguous tensors alike in
    dtype and device, ``output`` the group size times ``input``, a live group of more than
    one rank, a bool and strings), written out as :func:`_issue_all_reduce` is (also the
    eager path of :func:`mc_groups.all_gather_tensor` and :func:`mc_groups.start_all_gather`,
    which run per sequence-parallel layer call)."""
    if schedule_check_enabled():
        check_schedule("all_gather", group, input, label=label, detail=detail)
    if _recording():
        record("all_gather", group, input, reduce_op=None, async_op=async_op, label=label)
    about: Planned = ("all_gather", group, input, label, detail)
    if gloo.is_gloo(group):
        try:
            works = gloo.all_gather_works(output, input, group)
        except RuntimeError as err:
            raise failed(about, err) from err
        handle = CollectiveHandle(works, about)
        if async_op:
            return handle
        handle.wait()
        return DONE
    try:
        work = all_gather_flat(output, input, group=group, async_op=async_op)
    except RuntimeError as err:
        raise failed(about, err) from err
    if not async_op or work is None:
        return DONE
    return CollectiveHandle.of_work(work, about)


def broadcast(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    group_src: int = 0,
    async_op: bool = False,
    label: str = "",
    detail: str = "",
) -> CollectiveHandle:
    """Copy ``tensor`` from the rank whose *group* rank is ``group_src`` to every rank."""
    check_group("group", group)
    check_contiguous("tensor", tensor)
    check_options(async_op, label, detail, group=group)
    size = group.size()
    _check_group_rank(group_src, "group_src", size)
    if size == 1:
        return DONE
    op = f"broadcast from group rank {group_src}"
    check_schedule(op, group, tensor, label=label, detail=detail)
    record("broadcast", group, tensor, reduce_op=None, async_op=async_op, label=label)
    return issue(
        describe_later("broadcast", group, tensor, label, detail),
        lambda: dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op),
        async_op=async_op,
    )


def _check_group_rank(value: object, arg: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{arg}={value!r} must be an int group rank in [0, {size})")
    if not 0 <= value < size:
        raise InputValueError(f"{arg}={value!r} must be a group rank in [0, {size})")
    return value


def _check_splits(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: object,
    input_split_sizes: object,
    size: int,
) -> None:
    """Split sizes: ``size`` ints >= 0 adding up to dim 0 of their tensor; without them, dim
    0 divides by ``size`` and both tensors hold as many elements."""
    for name, splits, tensor in (
        ("input_split_sizes", input_split_sizes, input),
        ("output_split_sizes", output_split_sizes, output),
    ):
        rows = tensor.shape[0] if tensor.dim() else 1
        if splits is None:
            if rows % size:
                raise InputValueError(
                    f"all_to_all: {name.split('_')[0]} has {rows} rows (dim 0), not divisible "
                    f"by the group size {size}; pass {name}"
                )
            continue
        if isinstance(splits, str) or not isinstance(splits, Sequence):
            raise InputTypeError(f"all_to_all: {name}={splits!r} must be a list of {size} ints")
        if len(splits) != size:
            raise InputValueError(f"all_to_all: {name}={list(splits)} must have {size} entries")
        if any(isinstance(s, bool) or not isinstance(s, int) for s in splits):
            raise InputTypeError(f"all_to_all: {name}={list(splits)} must hold ints")
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise InputValueError(
                f"all_to_all: {name}={list(splits)} must be ints >= 0 adding up to the "
                f"{rows} rows (dim 0) of the {name.split('_')[0]}"
            )
    if output_split_sizes is None and input_split_sizes is None and output.numel() != input.numel():
        raise InputValueError(
            f"all_to_all: output.numel()={output.numel()} must equal input.numel()="
            f"{input.numel()} without split sizes"
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
    detail: str = "",
) -> CollectiveHandle:
    """Rank r sends split j of ``input`` (dim 0) to rank j and receives split r of theirs.

    Without split sizes, dim 0 is split evenly. (With split sizes the ranks' input sizes
    may differ, so the schedule check compares only the op, dtype, label and detail.)
    """
    check_group("group", group)
    check_contiguous("output", output)
    check_contiguous("input", input)
    check_pair(output, input, "all_to_all")
    check_options(async_op, label, detail, group=group)
    size = group.size()
    _check_splits(output, input, output_split_sizes, input_split_sizes, size)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    uneven = output_split_sizes is not None or input_split_sizes is not None
    payload = f"uneven splits × {dtype_name(input.dtype)}" if uneven else None
    check_schedule("all_to_all", group, input, label=label, detail=detail, payload=payload)
    record("all_to_all", group, input, reduce_op=None, async_op=async_op, label=label)
    out_splits = None if output_split_sizes is None else list(output_split_sizes)
    in_splits = None if input_split_sizes is None else list(input_split_sizes)
    return issue(
        describe_later("all_to_all", group, input, label, detail),
        lambda: dist.all_to_all_single(
            output, input, out_splits, in_splits, group=group, async_op=async_op
        ),
        async_op=async_op,
    )


def send(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_dst: int, label: str = ""
) -> None:
    """Point-to-point send of ``tensor`` to group rank ``group_dst`` (blocking; not
    schedule-checked: the group's other ranks take no part)."""
    check_group("group", group)
    check_contiguous("tensor", tensor)
    check_options(False, label, group=group)
    _check_peer(group, group_dst, "group_dst")
    record("send", group, tensor, reduce_op=None, async_op=False, label=label)
    issue(
        describe_later(f"send to group rank {group_dst}", group, tensor, label),
        lambda: dist.send(tensor, group=group, group_dst=group_dst),
        async_op=False,
    )


def recv(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_src: int, label: str = ""
) -> None:
    """Point-to-point receive into ``tensor`` from group rank ``group_src`` (blocking; not
    schedule-checked)."""
    check_group("group", group)
    check_contiguous("tensor", tensor)
    check_options(False, label, group=group)
    _check_peer(group, group_src, "group_src")
    record("recv", group, tensor, reduce_op=None, async_op=False, label=label)
    issue(
        describe_later(f"recv from group rank {group_src}", group, tensor, label),
        lambda: dist.recv(tensor, group=group, group_src=group_src),
        async_op=False,
    )


def record_p2p_ops(ops: object, *, label: str = "") -> None:
    """Record point-to-point ops that another engine issues itself (a ``send``/``recv``
    record per op, ``async_op=True``, on the op's group), before it issues them.

    ``torch.distributed.pipelining`` builds ``P2POp`` lists per micro-batch and sends them
    through ``torch.distributed`` directly (``P2POp`` accepts only ``dist.isend`` and
    ``dist.irecv``, so they cannot be routed through this layer); recording them here lets
    a test hold a pipeline's traffic next to mc's own collectives in one
    :func:`mc_groups.record_collectives` log. Nothing is issued or validated beyond the
    types: the engine owns the ops."""
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):  # a list of P2POp
        raise InputTypeError(
            f"ops must be a sequence of torch.distributed.P2POp, got {type_name(ops)}"
        )
    for i, op in enumerate(ops):
        if not isinstance(op, dist.P2POp):
            raise InputTypeError(f"ops[{i}] must be a torch.distributed.P2POp, got {type_name(op)}")
    if not isinstance(label, str):
        raise InputTypeError(f"label must be a str, got {type_name(label)}")
    for op in ops:
        name = "send" if op.op is dist.isend else "recv"
        group = op.group if op.group is not None else dist.group.WORLD
        assert group is not None  # P2POp resolves None to the default group
        record(name, group, op.tensor, reduce_op=None, async_op=True, label=label)


def _check_peer(group: dist.ProcessGroup, peer: object, arg: str) -> None:
    size, me = group.size(), group.rank()
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise InputTypeError(f"{arg}={peer!r} must be an int: another group rank in [0, {size})")
    if not 0 <= peer < size or peer == me:
        raise InputValueError(f"{arg}={peer!r} must be another group rank in [0, {size}), not {me}")


def barrier(group: dist.ProcessGroup, *, label: str = "") -> None:
    """Block until every rank of ``group`` reached this call (bounded by the group timeout)."""
    check_group("group", group)
    check_options(False, label, group=group)
    if group.size() == 1:
        return
    check_schedule("barrier", group, None, label=label)
    record("barrier", group, None, reduce_op=None, async_op=False, label=label)
    issue(
        describe_later("barrier", group, None, label),
        lambda: dist.barrier(group=group),
        async_op=False,
    )


def all_gather_objects(obj: object, group: dist.ProcessGroup, *, label: str = "") -> list[object]:
    """Every rank's picklable ``obj``, in group-rank order."""
    check_group("group", group)
    check_options(False, label, group=group)
    size = group.size()
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    check_schedule("all_gather_object", group, None, label=label)
    record("all_gather_object", group, None, reduce_op=None, async_op=False, label=label)
    issue(
        describe_later("all_gather_object", group, None, label),
        lambda: dist.all_gather_object(out, obj, group=group),
        async_op=False,
    )
    return out


def all_reduce_flat(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    label: str = "",
) -> None:
    """``t ← op over ranks of t`` for every tensor, in place, as few collectives as the
    dtypes allow: the tensors of one dtype and device are concatenated into one flat buffer,
    all-reduced and copied back (Megatron's ``_flatten_dense_tensors`` /
    ``_unflatten_dense_tensors`` around one ``all_reduce``), one collective per dtype in
    order of first appearance (:func:`~mc_groups.comm._common.by_dtype`). A lone contiguous
    tensor is reduced in place, without a copy. Every argument is checked first; nothing is
    issued on a one-rank group or for an empty list. Synchronous (the copies back need the
    result)."""
    check_group("group", group)
    if not isinstance(tensors, list | tuple):
        raise InputTypeError(f"tensors must be a list of tensors, got {type_name(tensors)}")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"tensors[{index}] is a {type_name(tensor)}, not a torch.Tensor")
    op = check_op(op)
    check_options(False, label, group=group)
    if group.size() == 1:
        return
    for batch in by_dtype(tensors, lambda t: (t.dtype, t.device)):
        if len(batch) == 1 and batch[0].is_contiguous():
            _issue_all_reduce(batch[0], group, op, False, label)
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in batch])
        _issue_all_reduce(flat, group, op, False, label)
        pieces = torch.split(flat, [t.numel() for t in batch])
        for tensor, piece in zip(batch, pieces, strict=True):
            tensor.copy_(piece.view_as(tensor))
