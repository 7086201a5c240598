r"""Collectives that return a new tensor and trace under ``torch.compile(fullgraph=True)``.

Why: Dynamo refuses ``async_op=True`` collectives (and the Python bookkeeping around
them: the recorder's lock, handles, gloo's point-to-point exchanges), so a layer that
calls :func:`mc_groups.all_reduce` breaks its graph. These functions take the same group
and label as the in-place collectives and pick their path when called:

- **eager** (not compiling): the in-place collectives of :mod:`mc_groups.comm.collectives` on
  a new output tensor, so nothing changes there: validated, recorded, schedule-checked,
  failures named (:class:`~mc_groups.CollectiveError`), gloo's emulations, async work on
  a :class:`~mc_groups.CollectiveHandle`;
- **compiling** (``torch.compiler.is_compiling()``, decided once per trace): torch's
  functional collectives (``torch.ops._c10d_functional``: ``all_reduce``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
  ``wait_tensor``) on the group's name (a string, which Dynamo traces: pytorch #129942),
  so each collective is a node of the graph that Inductor schedules; its wait is where
  :meth:`PendingTensor.wait` is called.

Both paths send the same bytes with the same algorithm::

    op               NCCL (and others)          gloo
    all_reduce       all-reduce                 all-reduce
    all_gather       all-gather                 all-to-all of the repeated input
    reduce_scatter   reduce-scatter             all-to-all + local sum in group-rank order
                                                (in fp32 for narrower dtypes)
    all_to_all       all-to-all (even splits)   all-to-all (even splits)

**Compiled code: what runs outside the graph.** While a recorder is open or the schedule
check is on, each collective traced into a graph is preceded by the custom op
``mc_groups::collective`` (:func:`_tap`, below): an ordered side effect, which Inductor
keeps in program order among mc's collectives. Both switches are read while tracing and
Dynamo guards them, so opening a recorder (or turning the check on) around a graph traced
without retraces it with the op, and closing it goes back to the graph without. A graph
without the op holds no side-effect operator, which Inductor's FX graph cache refuses
(``with_effects`` is not cacheable in torch 2.13): training code compiles once and later
runs load it from the cache. When
the compiled code runs, it does in Python what the eager path does before issuing: the
per-collective check behind ``MC_CHECK_COLLECTIVE_SCHEDULE``
(:mod:`mc_groups.comm.cross_rank`) and a :class:`~mc_groups.CollectiveRecord` with
``compiled=True`` (same op, group, dtype, size, ``async_op`` and label as the eager call)
in every open
:func:`~mc_groups.record_collectives` log. So a compiled step records its collectives
when they run, as an eager step does. Differences: the collective may be placed before
its record by Inductor (nothing orders them); a backend failure in a compiled graph is
torch's error, not a :class:`~mc_groups.CollectiveError`; inputs are checked when the
graph is traced (Dynamo guards shapes and dtypes: another shape retraces and checks
again).

Autograd: none, as the in-place collectives (mc's mappings and linear functions call
these inside their ``torch.autograd.Function``\ s). On a group of one rank each returns
the input itself and communicates nothing. Inputs of any shape; dim 0 is the gathered or
scattered one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_group, check_str, check_tensor
from mc_groups.collection import is_group_live
from mc_groups.comm.collectives import (
    DONE,
    CollectiveHandle,
    ReduceOp,
    _issue_all_gather,
    _issue_all_reduce,
    _issue_reduce_scatter,
    all_to_all,
    check_op,
    check_schedule,
    is_gloo,
    record,
    schedule_check_enabled,
)
from mc_groups.comm.recorder import _REGISTRY
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "PendingTensor",
    "all_gather_tensor",
    "all_reduce_tensor",
    "all_to_all_tensor",
    "reduce_scatter_tensor",
    "start_all_gather",
    "start_all_reduce",
    "start_reduce_scatter",
]

_FUNCTIONAL_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
}

_Finish = Callable[[torch.Tensor], torch.Tensor]


class PendingTensor:
    """A collective in flight; :meth:`wait` returns its result.

    Eager: the output tensor and the :class:`~mc_groups.CollectiveHandle` of its work.
    Compiling: the functional collective's tensor and the local step that completes it
    (the reshape, or gloo's sum after the all-to-all), applied after ``wait_tensor``.
    """

    __slots__ = ("_finish", "_handle", "_tensor")

    def __init__(
        self,
        tensor: torch.Tensor,
        handle: CollectiveHandle | None = None,
        finish: _Finish | None = None,
    ) -> None:
        self._tensor, self._handle, self._finish = tensor, handle, finish

    def wait(self) -> torch.Tensor:
        """Block until the collective completed (bounded as the handle's wait); return
        its result."""
        if self._handle is not None:
            self._handle.wait()
            return self._tensor
        if self._finish is None:  # a one-rank group: the input itself
            return self._tensor
        return self._finish(torch.ops._c10d_functional.wait_tensor(self._tensor))


def _checked(tensor: object, group: object) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """The tensor, the group and its size. A destroyed group is refused by the in-place
    collective the eager path calls next (and here while tracing); a one-rank group never
    communicates, so it is not looked up (the in-place collectives skip it too)."""
    if not isinstance(tensor, torch.Tensor) or not isinstance(group, dist.ProcessGroup):
        check_tensor("tensor", tensor)
        check_group("group", group)
    elif torch.compiler.is_compiling():
        check_group("group", group)
    x: torch.Tensor = tensor  # type: ignore[assignment]  # checked above (no cast() calls:
    g: dist.ProcessGroup = group  # type: ignore[assignment]  # this runs per collective)
    return x, g, int(g.size())


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() else 1


def _divisible(x: torch.Tensor, size: int, op: str) -> None:
    if _rows(x) % size:
        raise InputValueError(
            f"{op}: tensor has shape {tuple(x.shape)}; its dim 0 ({_rows(x)}) must divide by "
            f"the group size {size}"
        )


def _splits(value: object, size: int, name: str) -> list[int] | None:
    """None, or ``size`` ints >= 0 (rows per rank)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"all_to_all_tensor: {name}={value!r} must be a list of {size} ints")
    listed = list(value)
    if len(listed) != size or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in listed
    ):
        raise InputValueError(
            f"all_to_all_tensor: {name}={listed} must hold {size} ints >= 0 (rows per rank)"
        )
    return listed


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1)


# -- compiling: functional collectives -------------------------------------------------


def _traced_all_reduce(
    tensor: object, group: object, op: object, label: str, async_op: bool
) -> PendingTensor:
    """The compiled path of :func:`all_reduce_tensor` and :func:`start_all_reduce`."""
    x, g, size = _checked(tensor, group)
    reduce = check_op(op)
    if size == 1:
        return PendingTensor(x)
    flat = _flat(x)
    _tap(flat, "all_reduce", reduce, g, async_op, label)
    out = torch.ops._c10d_functional.all_reduce(flat, _FUNCTIONAL_OPS[reduce], g.group_name)
    shape = x.shape
    return PendingTensor(out, finish=lambda done: done.view(shape))


def _traced_all_gather(tensor: object, group: object, label: str, async_op: bool) -> PendingTensor:
    """The compiled path of :func:`all_gather_tensor` and :func:`start_all_gather`."""
    x, g, size = _checked(tensor, group)
    if size == 1:
        return PendingTensor(x)
    flat = _flat(x)
    _tap(flat, "all_gather", None, g, async_op, label)
    shape = (size * _rows(x), *x.shape[1:])
    if is_gloo(g):  # the all-to-all of the repeated input (module notes)
        repeated = flat.unsqueeze(0).expand(size, -1).reshape(-1)
        splits = [flat.numel()] * size
        out = torch.ops._c10d_functional.all_to_all_single(repeated, splits, splits, g.group_name)
    else:
        out = torch.ops._c10d_functional.all_gather_into_tensor(flat, size, g.group_name)
    return PendingTensor(out, finish=lambda done: done.view(shape))


def _traced_reduce_scatter(
    tensor: object, group: object, reduce_op: object, label: str, async_op: bool, who: str
) -> PendingTensor:
    """The compiled path of :func:`reduce_scatter_tensor` and :func:`start_reduce_scatter`
    (``who``: the public name, for the error)."""
    x, g, size = _checked(tensor, group)
    op = check_op(reduce_op)
    _divisible(x, size, who)
    if size == 1:
        return PendingTensor(x)
    flat = _flat(x)
    _tap(flat, "reduce_scatter", op, g, async_op, label)
    shape = (_rows(x) // size, *x.shape[1:])
    if not is_gloo(g):
        out = torch.ops._c10d_functional.reduce_scatter_tensor(
            flat, _FUNCTIONAL_OPS[op], size, g.group_name
        )
        return PendingTensor(out, finish=lambda done: done.view(shape))
    splits = [flat.numel() // size] * size
    received = torch.ops._c10d_functional.all_to_all_single(flat, splits, splits, g.group_name)
    dtype = x.dtype

    def finish(done: torch.Tensor) -> torch.Tensor:
        return _reduce_rows(done.view(size, -1), op, dtype).view(shape)

    return PendingTensor(received, finish=finish)


def _reduce_rows(rows: torch.Tensor, op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    """The local step of gloo's reduce-scatter, out of place (the eager one is
    :func:`mc_groups.comm.collectives._reduce_rows`)."""
    if op is ReduceOp.MAX:
        return rows.amax(dim=0)
    if op is ReduceOp.MIN:
        return rows.amin(dim=0)
    wide = rows.dtype in (torch.float32, torch.float64)
    total = rows.sum(dim=0, dtype=rows.dtype if wide else torch.float32)
    if op is ReduceOp.AVG:
        total = total / rows.shape[0]
    return total.to(dtype)


def _traced_all_to_all(
    x: torch.Tensor,
    g: dist.ProcessGroup,
    size: int,
    outs: list[int] | None,
    ins: list[int] | None,
    label: str,
) -> torch.Tensor:
    flat = _flat(x)
    _tap(flat, "all_to_all", None, g, False, label)
    row = flat.numel() // _rows(x) if _rows(x) else 0
    even = [_rows(x) // size] * size
    out_rows = even if outs is None else outs
    in_rows = even if ins is None else ins
    out = torch.ops._c10d_functional.all_to_all_single(
        flat, [n * row for n in out_rows], [n * row for n in in_rows], g.group_name
    )
    done: torch.Tensor = torch.ops._c10d_functional.wait_tensor(out)
    return done.view(sum(out_rows), *x.shape[1:])


# -- the public functions ---------------------------------------------------------------


def _eager_all_reduce(
    tensor: object, group: object, op: object, label: object, inplace: object, async_op: bool
) -> tuple[torch.Tensor, CollectiveHandle]:
    """The eager path of :func:`all_reduce_tensor` and :func:`start_all_reduce`: the reduced
    tensor and its handle (complete on a one-rank group, and when ``async_op`` is False).

    Exact types (a plain tensor, a live :class:`~torch.distributed.ProcessGroup`, a
    :class:`ReduceOp`, a ``str`` label, a ``bool``) go straight to
    :func:`mc_groups.comm.collectives._issue_all_reduce`: the checks below are what the
    general path's would find, done with one test each (a small TP block runs this twice
    per step). Anything else (a torch ``ReduceOp``, a subclass, a wrong type) takes the
    general checks and is converted or refused as before."""
    if (
        type(tensor) is not torch.Tensor
        or type(op) is not ReduceOp
        or type(label) is not str
        or type(inplace) is not bool
        or not isinstance(group, dist.ProcessGroup)
    ):
        tensor, group, _ = _checked(tensor, group)
        op = check_op(op)
        label = label if isinstance(label, str) else check_str("label", label)
        inplace = check_flag("inplace", inplace)
    if group.size() == 1:
        return tensor, DONE
    if not is_group_live(group):
        check_group("group", group)  # raises: the group was destroyed
    # what the in-place all-reduce overwrites: the tensor itself when allowed
    if inplace and tensor.is_contiguous():
        out = tensor
    else:
        out = torch.clone(tensor, memory_format=torch.contiguous_format)
    return out, _issue_all_reduce(out, group, op, async_op, label)


def all_reduce_tensor(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    label: str = "",
    inplace: bool = False,
) -> torch.Tensor:
    """``op`` over the ranks of ``group`` into a new tensor (``tensor`` is not changed).

    ``inplace=True``: the caller no longer needs ``tensor``, so the eager path reduces it
    in place (when contiguous: no copy) and returns it; compiled code returns a new tensor
    either way (Inductor reuses buffers itself).
    """
    if not torch.compiler.is_compiling():
        return _eager_all_reduce(tensor, group, op, label, inplace, False)[0]
    return _traced_all_reduce(tensor, group, op, label, False).wait()


def start_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    label: str = "",
    inplace: bool = False,
) -> PendingTensor:
    """Start :func:`all_reduce_tensor` (asynchronous: compute may run until ``wait()``)."""
    if not torch.compiler.is_compiling():
        return PendingTensor(*_eager_all_reduce(tensor, group, op, label, inplace, True))
    return _traced_all_reduce(tensor, group, op, label, True)


def _gather_output(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.new_empty((size * _rows(x), *x.shape[1:]))


def _eager_all_gather(
    tensor: object, group: object, label: object, async_op: bool
) -> tuple[torch.Tensor, CollectiveHandle]:
    """The eager path of :func:`all_gather_tensor` and :func:`start_all_gather` (as
    :func:`_eager_all_reduce`: exact types go straight to the issuing step; the output is
    built here, so the in-place all-gather's pair checks hold by construction). The tensors
    keep their shapes (flat views cost ~1 µs each; the collectives take any contiguous
    shape with the right sizes)."""
    if (
        type(tensor) is not torch.Tensor
        or type(label) is not str
        or not isinstance(group, dist.ProcessGroup)
    ):
        tensor, group, _ = _checked(tensor, group)
        label = check_str("label", label)
    size = group.size()
    if size == 1:
        return tensor, DONE
    if not is_group_live(group):
        check_group("group", group)  # raises: the group was destroyed
    out = _gather_output(tensor, size)
    return out, _issue_all_gather(out, tensor.contiguous(), group, async_op, label)


def all_gather_tensor(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, label: str = ""
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in group-rank order (a new tensor)."""
    if not torch.compiler.is_compiling():
        return _eager_all_gather(tensor, group, label, False)[0]
    return _traced_all_gather(tensor, group, label, False).wait()


def start_all_gather(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, label: str = ""
) -> PendingTensor:
    """Start :func:`all_gather_tensor` (asynchronous: compute may run until ``wait()``)."""
    if not torch.compiler.is_compiling():
        return PendingTensor(*_eager_all_gather(tensor, group, label, True))
    return _traced_all_gather(tensor, group, label, True)


def _scatter_output(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.new_empty((_rows(x) // size, *x.shape[1:]))


def _eager_reduce_scatter(
    tensor: object, group: object, op: object, label: object, async_op: bool, who: str
) -> tuple[torch.Tensor, CollectiveHandle]:
    """The eager path of :func:`reduce_scatter_tensor` and :func:`start_reduce_scatter`
    (``who``: the public name, for the error), as :func:`_eager_all_gather`."""
    if (
        type(tensor) is not torch.Tensor
        or type(op) is not ReduceOp
        or type(label) is not str
        or not isinstance(group, dist.ProcessGroup)
    ):
        tensor, group, _ = _checked(tensor, group)
        op = check_op(op)
        label = check_str("label", label)
    size = group.size()
    _divisible(tensor, size, who)
    if size == 1:
        return tensor, DONE
    if not is_group_live(group):
        check_group("group", group)  # raises: the group was destroyed
    out = _scatter_output(tensor, size)
    handle = _issue_reduce_scatter(out, tensor.contiguous(), group, op, async_op, label)
    return out, handle


def reduce_scatter_tensor(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    label: str = "",
) -> torch.Tensor:
    """``op`` over ranks; group rank r keeps part r of dim 0 (a new tensor; dim 0 must
    divide by the group size)."""
    if not torch.compiler.is_compiling():
        return _eager_reduce_scatter(tensor, group, op, label, False, "reduce_scatter_tensor")[0]
    return _traced_reduce_scatter(tensor, group, op, label, False, "reduce_scatter_tensor").wait()


def start_reduce_scatter(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: ReduceOp = ReduceOp.SUM,
    label: str = "",
) -> PendingTensor:
    """Start :func:`reduce_scatter_tensor` (asynchronous: compute may run until ``wait()``)."""
    if not torch.compiler.is_compiling():
        out, handle = _eager_reduce_scatter(tensor, group, op, label, True, "start_reduce_scatter")
        return PendingTensor(out, handle)
    return _traced_reduce_scatter(tensor, group, op, label, True, "start_reduce_scatter")


def all_to_all_tensor(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    label: str = "",
) -> torch.Tensor:
    """Rank r sends split j of dim 0 to rank j and receives split r of every rank, in
    group-rank order, into a new tensor (even splits, or rows per rank as
    :func:`mc_groups.all_to_all` takes them)."""
    x, g, size = _checked(tensor, group)
    outs = _splits(output_split_sizes, size, "output_split_sizes")
    ins = _splits(input_split_sizes, size, "input_split_sizes")
    if ins is None:
        _divisible(x, size, "all_to_all_tensor")
    elif sum(ins) != _rows(x):
        raise InputValueError(
            f"all_to_all_tensor: input_split_sizes={ins} must add up to the {_rows(x)} rows "
            "(dim 0) of the tensor"
        )
    rows = _rows(x) if outs is None else sum(outs)
    if size == 1:
        return x
    if torch.compiler.is_compiling():
        return _traced_all_to_all(x, g, size, outs, ins, label)
    out = x.new_empty((rows, *x.shape[1:]))
    all_to_all(
        out,
        x.contiguous(),
        g,
        output_split_sizes=outs,
        input_split_sizes=ins,
        label=label,
    )
    return out


# -- the run-time side of compiled collectives ---------------------------------------------
# While a recorder is open or the schedule check is on (module notes), each traced collective
# is preceded by the custom op ``mc_groups::collective`` (:func:`_tap`).
# Registered as an *ordered side effect* (AOTAutograd threads an effect token through it: it
# is never dead code and keeps program order among mc's collectives), it is called, in
# Python, every time the compiled graph runs, and does what the eager path does before
# issuing: the schedule check (when on) and a ``CollectiveRecord`` with ``compiled=True``.
# While tracing (fake tensors) it does nothing. The op is defined once per process, at
# import (torch's operator registry holds it, this module keeps the handle alive); a torch
# without effect registration (private in 2.13: ``torch.library._register_effectful_op``)
# gets no tap, so compiled code then records nothing and skips the schedule check.

_SCHEMA = (
    "collective(Tensor input, str op, str reduce_op, str group_name, bool async_op, "
    "str label) -> ()"
)


def _issued(
    input: torch.Tensor, op: str, reduce_op: str, group_name: str, async_op: bool, label: str
) -> None:
    """At run time, before the compiled collective: the schedule check, then the record."""
    resolve: Any = getattr(dist.distributed_c10d, "_resolve_process_group")  # noqa: B009
    group: dist.ProcessGroup = resolve(group_name)
    reduce = ReduceOp(reduce_op) if reduce_op else None
    check_schedule(op, group, input, reduce_op=reduce, label=label)
    record(op, group, input, reduce_op=reduce, async_op=async_op, label=label, compiled=True)


def _traced(*_args: object) -> None:
    """While tracing: nothing (the op has no output)."""


def _define() -> tuple[torch.library.Library | None, bool]:
    """Register the op (once per process); whether compiled code gets the tap."""
    register_effect = getattr(torch.library, "_register_effectful_op", None)
    try:
        from torch._library.effects import EffectType  # noqa: PLC0415 (optional in torch)
    except ImportError:
        return None, False
    if register_effect is None:
        return None, False
    try:
        lib = torch.library.Library("mc_groups", "DEF")  # type: ignore[no-untyped-call]
    except RuntimeError:  # defined already (this module reloaded): the op is there
        return None, hasattr(torch.ops.mc_groups, "collective")
    lib.define(_SCHEMA)  # type: ignore[no-untyped-call]
    lib.impl("collective", _issued, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake("mc_groups::collective", _traced, lib=lib)
    register_effect("mc_groups::collective", EffectType.ORDERED)
    return lib, True


_LIBRARY, _TAPPED = _define()


def _tap(
    input: torch.Tensor,
    op: str,
    reduce_op: ReduceOp | None,
    group: dist.ProcessGroup,
    async_op: bool,
    label: str,
) -> None:
    """While tracing: put the op into the graph before the collective on ``input`` when a
    recorder is open or the schedule check is on (module notes); else nothing."""
    if _TAPPED and (_REGISTRY.active or schedule_check_enabled()):
        reduce = "" if reduce_op is None else reduce_op.value
        torch.ops.mc_groups.collective(input, op, reduce, group.group_name, async_op, label)
