"""The collectives of the layer (:mod:`mc_groups.comm`, the only part of mc that calls
``torch.distributed`` collectives): typed, validated, bounded and recorded, each returning a
:class:`~mc_groups.CollectiveHandle`; and what every collective of the layer shares (the
reduce ops, the handle, group queries, per-dtype batching, argument checks, descriptions for
errors, the record, the torch-version names of the flat collectives, the debug switch of the
per-collective check), which the traceable collectives, coalesced batches and the
Communicator import from here.

Why one layer:

- every collective is recorded (:func:`mc_groups.record_collectives`) so tests can count
  what ran, on which group, with how many bytes;
- inputs are validated (shapes, dtypes, devices) before anything is issued, so a bad call
  raises a ``ValueError`` on the caller's rank instead of hanging its peers;
- a group of one rank short-circuits to a local copy without touching torch.distributed;
- failures and timeouts surface as :class:`~mc_groups.CollectiveError` naming the operation,
  the group's global ranks, the payload and the caller's ``label`` (the group's role, e.g.
  ``"grad reduce dense bucket group 0"``), from the issuing call, from
  :meth:`CollectiveHandle.wait` and from a coalesced batch alike, so a dead peer reads as
  "reduce_scatter on group ranks [0, 1] (484 × float32) for 'grad reduce dense bucket
  group 0' failed: … Connection closed by peer" rather than a gloo socket error far from
  the cause;
- with ``MC_CHECK_COLLECTIVE_SCHEDULE=1`` (a debug switch) every collective is first
  compared across the group's ranks (:func:`mc_groups.cross_check` whose point is the
  collective: op, reduce op, numel × dtype, label, detail).

**One route.** Each collective has one issuing function (``_issue_all_reduce``,
``_issue_reduce_scatter``, ``_issue_all_gather``, and the public function itself for the
others), and every issuing function goes through :func:`_issue`: the schedule check (when
on), the record, the ``torch.distributed`` call, its failure named, its work on a handle.
The public functions check their arguments and call the issuing function; the
:mod:`traceable <mc_groups.comm.traceable>` collectives, coalesced batches and
:class:`~mc_groups.comm.communicator.Communicator` call the same issuing functions after their own
checks.

**gloo.** gloo's own reduce-scatter and all-gather are slower than an all-to-all on CPU
(torch 2.13: a reduce-scatter of 100 MB on 2 ranks took 200 ms, the all-to-all 53 ms), so
on gloo a reduce-scatter runs as an all-to-all plus a local reduction (the algorithm below,
which every backend uses with ``accumulate_dtype``) and an all-gather as an all-to-all of
the repeated input; both are recorded as the collective they stand for::

    reduce-scatter of x over W ranks, rank r keeps  op_s x_s^r
      all-to-all:  rank r receives [x_0^r | x_1^r | … | x_{W-1}^r]   (W rows, input's dtype)
      local:       output = dtype( op_s acc(x_s^r) )   (÷ W for AVG; acc = accumulate_dtype,
                   else the output's dtype for fp32/fp64 and fp32 for narrower ones)
    all-gather of x over W ranks
      all-to-all of [x | x | … | x]: rank r receives [x_0 | … | x_{W-1}]

The all-to-all needs a receive buffer of the input's size and, when ``output`` is narrower
than ``acc``, a sum buffer of the output's size. They come from an :data:`Allocate`
function: a fresh tensor per call, the caller's ``received``, or the buffers a
:class:`~mc_groups.comm.communicator.Communicator` keeps between calls.

Every wait is bounded: a handle's :meth:`CollectiveHandle.wait` takes a timeout and, when
none is given, the process group's own timeout (set at group creation; groups built by
:func:`mc_groups.initialize_model_parallel` inherit the default group's) bounds the
operation. On gloo a peer that exits is reported at once, a peer that hangs after the
group's timeout.

``label`` (every call) names the collective's role in records and errors; ``detail`` (the
collectives that carry a caller's data) says what the tensor holds, e.g. a bucket's param
layout: it is shown in errors and compared by the schedule check, never recorded.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from mc_groups.argcheck import (
    check_flag,
    check_float_dtype,
    check_group,
    check_real,
    check_str,
    check_tensor,
    type_name,
)
from mc_groups.comm.cross_rank import cross_check, key_device
from mc_groups.comm.recorder import _REGISTRY, CollectiveRecord, _emit
from mc_groups.errors import CollectiveError, InputTypeError, InputValueError

__all__ = [
    "SCHEDULE_CHECK_ENV",
    "CollectiveHandle",
    "ReduceOp",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_reduce_flat",
    "all_to_all",
    "barrier",
    "broadcast",
    "check_collective_schedule",
    "group_rank",
    "group_ranks",
    "group_size",
    "record_p2p_ops",
    "recv",
    "reduce_scatter",
    "schedule_check_enabled",
    "send",
]


def _first_attr(*names: str) -> Callable[..., Any]:
    for name in names:
        found = getattr(dist, name, None)
        if found is not None:
            return found  # type: ignore[no-any-return]
    raise ImportError(f"torch.distributed has none of {names}")


reduce_scatter_flat = _first_attr("reduce_scatter_single", "reduce_scatter_tensor")
"""torch 2.13 renamed the flat-tensor collectives (``*_single``); older releases only have
the ``*_tensor`` names."""
all_gather_flat = _first_attr("all_gather_single", "all_gather_into_tensor")
coalescing_manager: Callable[..., Any] = _first_attr("_coalescing_manager")


class ReduceOp(enum.Enum):
    """Reductions mc uses. ``AVG`` divides by the group size inside the collective."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


Planned = tuple[str, dist.ProcessGroup, torch.Tensor | None, str, str]
"""The arguments of :func:`describe` (op, group, tensor, label, detail): a collective's
description before it is formatted."""

Description = str | Planned | Callable[[], str]
"""A collective's text, or what builds it on first read (:func:`text_of`)."""


class CollectiveHandle:
    """Work in flight: issued collectives, the handles they depend on, and the local steps
    that complete them. ``wait()`` blocks until all of it is done, bounded by a timeout.

    A handle holds, all optional:

    - ``works``: torch.distributed work objects (one per issued collective or exchange);
    - ``children``: other handles (e.g. one per batch of a
      :class:`~mc_groups.comm.communicator.Communicator`
      call, or one per bucket of a caller's step);
    - ``finishers``: functions run once, in order, after every child and work finished
      (the local step of a collective composed from others, e.g. the sum after an
      all-to-all).

    ``wait()`` waits the children in order, then the works, then runs the finishers; a
    second ``wait()`` does nothing. A handle built from nothing is complete: synchronous
    calls and single-rank groups return one (``CollectiveHandle()``).
    """

    __slots__ = ("_children", "_description", "_finishers", "_works")

    def __init__(
        self,
        works: Sequence[Any] = (),
        description: Description = "completed",
        finishers: Sequence[Callable[[], None]] = (),
        *,
        children: Sequence[CollectiveHandle] = (),
    ) -> None:
        self._works = list(works)
        self._children = list(children)
        self._finishers = list(finishers)
        self._description = description

    @classmethod
    def of_work(cls, work: Any, description: Description) -> CollectiveHandle:
        """A handle of one work object and nothing else: what a single collective returns
        (the same object ``CollectiveHandle([work], description)`` builds, without the
        three list copies: this runs once per collective)."""
        handle = cls.__new__(cls)
        handle._works = [work]
        handle._children = []
        handle._finishers = []
        handle._description = description
        return handle

    @property
    def description(self) -> str:
        """What this handle waits for, e.g. ``all_reduce on group ranks [0, 1]
        (8 × float32) for 'grad reduce dense bucket group 0'``.

        Given as the arguments of ``describe`` (``describe_later(...)``) or a function,
        it is built on first read: a collective's text is needed only when it fails or is
        asked for, and formatting it (the group's ranks, the payload) costs more host time
        than issuing a small collective's bookkeeping."""
        if not isinstance(self._description, str):
            self._description = text_of(self._description)
        return self._description

    def is_completed(self) -> bool:
        """True once every child and every underlying work object has finished (never
        blocks; the finishers run at :meth:`wait`)."""
        return all(c.is_completed() for c in self._children) and all(
            w.is_completed() for w in self._works
        )

    def wait(self, timeout: float | None = None) -> None:
        """Wait for completion; raise :class:`CollectiveError` on failure or timeout.

        Args:
            timeout: seconds to wait at most for each child and work (a finite number
                > 0); ``None`` relies on the process group's timeout, which torch
                enforces on every operation.
        """
        if timeout is not None:
            check_real("timeout", timeout, positive=True, allow_zero=False)
        if self._children:
            children, self._children = self._children, []
            for child in children:
                child.wait(timeout)
        if self._works:
            works, self._works = self._works, []
            for work in works:
                try:
                    if timeout is None:
                        work.wait()
                    else:
                        work.wait(timedelta(seconds=timeout))
                except RuntimeError as err:
                    raise failed(self.description, err) from err
        if self._finishers:
            finishers, self._finishers = self._finishers, []
            for finish in finishers:
                finish()


DONE = CollectiveHandle()


def group_size(group: dist.ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return int(check_group("group", group).size())


def group_rank(group: dist.ProcessGroup) -> int:
    """This process's rank inside ``group``."""
    return int(check_group("group", group).rank())


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order."""
    return ranks_of(check_group("group", group))


def ranks_of(group: dist.ProcessGroup) -> tuple[int, ...]:
    """:func:`group_ranks` of a group already checked (records and error texts)."""
    return tuple(dist.get_process_group_ranks(group))


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def describe(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None,
    label: str = "",
    detail: str = "",
) -> str:
    """``all_reduce on group ranks [0, 1] (8 × float32) for 'label' [detail]``: what an
    error says about a collective (op, the group's global ranks, the payload, the caller's
    label naming the group's role, and the caller's detail)."""
    payload = "" if tensor is None else f" ({tensor.numel()} × {dtype_name(tensor.dtype)})"
    text = f"{op} on group ranks {list(ranks_of(group))}{payload}"
    if label:
        text += f" for '{label}'"
    if detail:
        text += f" [{detail}]"
    return text


def text_of(description: Description) -> str:
    """The text of a :data:`Description`."""
    if isinstance(description, str):
        return description
    if isinstance(description, tuple):
        return describe(*description)
    return description()


def failed(description: Description, err: BaseException) -> CollectiveError:
    """The error a failed collective raises: ``<description> failed: <backend error>``
    (raise it ``from err``)."""
    return CollectiveError(f"{text_of(description)} failed: {err}")


def record(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None,
    *,
    reduce_op: ReduceOp | None,
    async_op: bool,
    coalesced: bool = False,
    label: str = "",
    compiled: bool = False,
) -> None:
    """Append a :class:`CollectiveRecord` to every open recorder."""
    if not _REGISTRY.active:
        return
    numel = 0 if tensor is None else tensor.numel()
    _emit(
        CollectiveRecord(
            op=op,
            reduce_op=None if reduce_op is None else reduce_op.value,
            group_ranks=ranks_of(group),
            dtype=None if tensor is None else tensor.dtype,
            numel=numel,
            bytes=0 if tensor is None else numel * tensor.element_size(),
            async_op=async_op,
            coalesced=coalesced,
            label=label,
            compiled=compiled,
        )
    )


_T = TypeVar("_T")


def by_dtype(items: Sequence[_T], key: Callable[[_T], Hashable]) -> list[list[_T]]:
    """``items`` in batches of one ``key`` (a dtype, or a dtype and a device), the batches in
    order of first appearance and the items in order: what one collective may carry (gloo
    batches and flat buffers take one dtype), the same on every rank that passes the same
    list. The one home of mc's per-dtype batching
    (:class:`~mc_groups.comm.communicator.Communicator` and
    :func:`~mc_groups.comm.collectives.all_reduce_flat`)."""
    batches: dict[Hashable, list[_T]] = {}
    for item in items:
        batches.setdefault(key(item), []).append(item)
    return list(batches.values())


# -- argument checks ------------------------------------------------------------------------


def check_options(
    async_op: object, label: object, detail: object = "", *, group: dist.ProcessGroup
) -> None:
    """A collective's common options, and on a one-rank group the schedule-check switch
    (larger groups read it before issuing): a one-rank group short-circuits after this, and
    the same call is judged the same on any group."""
    check_flag("async_op", async_op)
    if not isinstance(label, str):
        check_str("label", label)
    if not isinstance(detail, str):
        check_str("detail", detail)
    if group.size() == 1:
        schedule_check_enabled()  # a switch that is neither on nor off is an error everywhere


def check_contiguous(name: str, value: object) -> torch.Tensor:
    """A contiguous tensor."""
    tensor = check_tensor(name, value)
    if not tensor.is_contiguous():
        raise InputValueError(
            f"{name} (shape {tuple(tensor.shape)}) must be contiguous; call .contiguous()"
        )
    return tensor


def check_pair(out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    """Output and input of one dtype on one device."""
    if out.dtype != inp.dtype:
        raise InputValueError(
            f"{op}: output dtype {out.dtype} differs from input dtype {inp.dtype}"
        )
    if out.device != inp.device:
        raise InputValueError(f"{op}: output device {out.device} differs from input {inp.device}")


def check_op(op: object) -> ReduceOp:
    """A :class:`ReduceOp`, or torch's ``torch.distributed.ReduceOp`` SUM/AVG/MAX/MIN (what
    Megatron-Core's callers pass) as the mc member of the same meaning."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, dist.ReduceOp.RedOpType):
        for mine, theirs in TORCH_OPS.items():
            if op == theirs:
                return mine
    raise InputTypeError(
        f"op={op!r} must be a mc_groups.ReduceOp or torch.distributed.ReduceOp (SUM, AVG, "
        "MAX or MIN)"
    )


def check_reduce_scatter(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    """``input`` holds ``size`` outputs."""
    _check_flat_pair("reduce_scatter", output, input, ("input", "output"), size)


def check_all_gather(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    """``output`` holds ``size`` inputs."""
    _check_flat_pair("all_gather", output, input, ("output", "input"), size)


def _check_flat_pair(
    op: str, output: torch.Tensor, input: torch.Tensor, whole_part: tuple[str, str], size: int
) -> None:
    """Both contiguous, alike in dtype and device, and the whole (``whole_part[0]``, one
    of the two) ``size`` times the part."""
    check_contiguous("output", output)
    check_contiguous("input", input)
    check_pair(output, input, op)
    tensors = {"output": output, "input": input}
    whole, part = whole_part
    if tensors[whole].numel() != tensors[part].numel() * size:
        raise InputValueError(
            f"{op}: {whole}.numel()={tensors[whole].numel()} must equal "
            f"{part}.numel()={tensors[part].numel()} × group size {size}"
        )


def copy_unless_alias(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output ← input`` unless both are the same memory (a one-rank collective)."""
    same = output.data_ptr() == input.data_ptr() and output.numel() == input.numel()
    if not same:
        output.view(-1).copy_(input.view(-1))


def kind_text(op: str, reduce_op: ReduceOp | None) -> str:
    """``reduce_scatter(sum)``, or ``all_gather`` for ops without a reduction."""
    return op if reduce_op is None else f"{op}({reduce_op.value})"


def check_group_rank(value: object, arg: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{arg}={value!r} must be an int group rank in [0, {size})")
    if not 0 <= value < size:
        raise InputValueError(f"{arg}={value!r} must be a group rank in [0, {size})")
    return value


def check_splits(
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


def check_peer(group: dist.ProcessGroup, peer: object, arg: str) -> None:
    size, me = group.size(), group.rank()
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise InputTypeError(f"{arg}={peer!r} must be an int: another group rank in [0, {size})")
    if not 0 <= peer < size or peer == me:
        raise InputValueError(f"{arg}={peer!r} must be another group rank in [0, {size}), not {me}")


def check_accumulate_dtype(value: object) -> torch.dtype | None:
    """None or a floating-point dtype."""
    return check_float_dtype("accumulate_dtype", value, allow_none=True)


def check_received(input: torch.Tensor, received: object) -> None:
    """``received`` is None or a contiguous tensor of ``input``'s numel, dtype and device;
    checked on every group (a one-rank group uses none, but the same call must be judged
    the same at any group size)."""
    if received is None:
        return
    if not isinstance(received, torch.Tensor):
        raise InputTypeError(
            f"received={received!r} must be None or a torch.Tensor of {input.numel()} × "
            f"{dtype_name(input.dtype)} on {input.device} (the input's size)"
        )
    if (
        received.numel() != input.numel()
        or received.dtype != input.dtype
        or received.device != input.device
        or not received.is_contiguous()
    ):
        shown = f"{received.numel()} × {dtype_name(received.dtype)} on {received.device}"
        raise InputValueError(
            f"received={shown} must be a contiguous tensor of {input.numel()} × "
            f"{dtype_name(input.dtype)} on {input.device} (the input's size)"
        )


def check_device(device: object) -> None:
    if device is None or isinstance(device, torch.device):
        return
    if not isinstance(device, str | int) or isinstance(device, bool):
        raise InputTypeError(f"device={device!r} must be None, a torch.device or a device string")
    try:
        torch.device(device)
    except RuntimeError as err:
        raise InputValueError(f"device={device!r} is not a device: {err}") from None


# -- the per-collective check behind a debug switch ----------------------------------------

SCHEDULE_CHECK_ENV = "MC_CHECK_COLLECTIVE_SCHEDULE"
"""Environment variable that turns the per-collective check on (``1``/``true``/``yes``/
``on``); read at every collective, so it can be set after import."""

_ENV_KEY = os.fsencode(SCHEDULE_CHECK_ENV)
_ENVIRON_BYTES: dict[bytes, bytes] | None = (
    getattr(os.environ, "_data", None)
    if os.name == "posix" and type(getattr(os.environ, "_data", None)) is dict
    else None
)
"""The byte mapping behind POSIX CPython's ``os.environ`` (the same dict for the process's
life: every write through ``os.environ`` updates it in place), read, never written, by
:func:`schedule_check_enabled`: an unset variable is one dict lookup per collective, where
``os.environ.get`` raises and catches a ``KeyError`` (~0.7 µs); None elsewhere."""

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def schedule_check_enabled() -> bool:
    """Whether every collective is checked now (reads ``MC_CHECK_COLLECTIVE_SCHEDULE``).

    Raises ``ValueError`` for a value that is neither on nor off, so a typo does not
    silently disable the check.
    """
    if _ENVIRON_BYTES is not None:
        raw = _ENVIRON_BYTES.get(_ENV_KEY)
        if raw is None:
            return False  # unset, the usual case
        value = os.fsdecode(raw)
    else:
        value = os.environ.get(SCHEDULE_CHECK_ENV, "")
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise InputValueError(
        f"{SCHEDULE_CHECK_ENV}={value!r} is not a switch: use 1/true/yes/on to check "
        "collective schedules, 0/false/no/off (or unset it) not to"
    )


@contextmanager
def check_collective_schedule(enabled: bool = True) -> Iterator[None]:
    """Check (or, with ``enabled=False``, do not check) every collective in the block.

    Sets ``MC_CHECK_COLLECTIVE_SCHEDULE`` for the block and restores the previous value on
    exit: the switch lives in the process environment, not in module state. Every rank of
    a group must be in the same mode (a checking rank waits for its peers' fingerprints).
    """
    check_flag("enabled", enabled)
    previous = os.environ.get(SCHEDULE_CHECK_ENV)
    os.environ[SCHEDULE_CHECK_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(SCHEDULE_CHECK_ENV, None)
        else:
            os.environ[SCHEDULE_CHECK_ENV] = previous


def check_schedule(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None,
    *,
    reduce_op: ReduceOp | None = None,
    label: str = "",
    detail: str = "",
    payload: str | None = None,
) -> None:
    """The per-collective check behind ``MC_CHECK_COLLECTIVE_SCHEDULE`` (a
    :func:`~mc_groups.cross_check` whose point is the collective, see
    :mod:`mc_groups.comm.cross_rank`); a no-op unless enabled. ``payload`` overrides the
    compared ``numel × dtype`` text."""
    if not schedule_check_enabled():
        return
    if payload is None:
        payload = "nothing" if tensor is None else f"{tensor.numel()} × {dtype_name(tensor.dtype)}"
    cross_check(
        group,
        planned_text(kind_text(op, reduce_op), payload, label, detail),
        shown="" if tensor is None else f", shape {tuple(tensor.shape)}",
        device=key_device(group, tensor),
    )


def planned_text(kind: str, payload: str, label: str, detail: str) -> str:
    """``all_reduce(sum) 'label' of 8 × float32 [detail]``: a collective as the schedule
    check compares it (the shape is shown apart: the ranks of an uneven all-to-all differ
    there)."""
    text = f"{kind} '{label}'" if label else kind
    text += f" of {payload}"
    return f"{text} [{detail}]" if detail else text


# ------------------------------------------------------------ the collectives

Allocate = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]
"""``allocate(role, numel, dtype, device)``: a flat temporary for ``role`` (``"received"``:
the all-to-all's receive buffer; ``"sum"``: the accumulation buffer). Its contents are
overwritten before they are read."""


def fresh(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new temporary per request (an :data:`Allocate`)."""
    del role
    return torch.empty(numel, dtype=dtype, device=device)


def _given(received: torch.Tensor | None) -> Allocate:
    """The caller's ``received`` as the receive buffer (when given), fresh otherwise."""
    if received is None:
        return fresh

    def allocate(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return received.view(-1) if role == "received" else fresh(role, numel, dtype, device)

    return allocate


def is_gloo(group: dist.ProcessGroup) -> bool:
    """The group runs on gloo (which takes the all-to-all algorithms above)."""
    return bool(dist.get_backend(group) == "gloo")


# -- the one route ---------------------------------------------------------------------------


def _issue(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None,
    call: Callable[[], Any],
    *,
    async_op: bool,
    label: str,
    detail: str = "",
    reduce_op: ReduceOp | None = None,
    coalesced: bool = False,
    checked_as: str | None = "",
    payload: str | None = None,
    shown_as: str = "",
    finish: Callable[[], None] | None = None,
) -> CollectiveHandle:
    """Issue one collective: the schedule check (when on; ``checked_as`` names the op it
    compares, ``op`` by default, None: not checked; not inside a coalesced batch, which is
    checked as a whole), the record (``op``), ``call()``, its failure named (as
    ``shown_as``, ``op`` by default), its work on a handle that runs ``finish`` (the local
    step of an emulated collective) once the work completed. Synchronous calls outside a
    batch return a completed handle; inside one (``coalesced``) the handle holds the work
    for the batch to wait on."""
    if not coalesced and checked_as is not None and schedule_check_enabled():
        check_schedule(
            checked_as or op,
            group,
            tensor,
            reduce_op=reduce_op,
            label=label,
            detail=detail,
            payload=payload,
        )
    if _REGISTRY.active:
        record(
            op,
            group,
            tensor,
            reduce_op=reduce_op,
            async_op=async_op,
            coalesced=coalesced,
            label=label,
        )
    about: Planned = (shown_as or op, group, tensor, label, detail)
    try:
        work = call()
    except RuntimeError as err:
        raise failed(about, err) from err
    pending = async_op or coalesced  # a batch waits for its collectives itself
    if finish is None:
        if not pending or work is None:
            return DONE
        return CollectiveHandle.of_work(work, about)
    if not pending:
        finish()
        return DONE
    return CollectiveHandle([work], about, [finish])


def _issue_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    label: str,
    detail: str = "",
    coalesced: bool = False,
) -> CollectiveHandle:
    """``tensor ← op over ranks``, arguments known good (a contiguous tensor, a live group
    of more than one rank, a checked op)."""
    wire_async = async_op or (coalesced and is_gloo(group))  # gloo: each on its own
    return _issue(
        "all_reduce",
        group,
        tensor,
        lambda: dist.all_reduce(tensor, op=TORCH_OPS[op], group=group, async_op=wire_async),
        async_op=async_op,
        label=label,
        detail=detail,
        reduce_op=op,
        coalesced=coalesced,
    )


def _issue_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    label: str,
    detail: str = "",
    accumulate_dtype: torch.dtype | None = None,
    allocate: Allocate = fresh,
    coalesced: bool = False,
) -> CollectiveHandle:
    """Group rank r keeps slice r of ``op over ranks of input`` in ``output``, arguments
    known good (the pair checked, a live group of more than one rank). The backend's own
    reduce-scatter, or (gloo, or ``accumulate_dtype`` given) the all-to-all algorithm of
    the module notes; with ``accumulate_dtype`` it is recorded, checked and named as the
    ``all_to_all`` it communicates with."""
    if accumulate_dtype is None and not is_gloo(group):
        return _issue(
            "reduce_scatter",
            group,
            input,
            lambda: reduce_scatter_flat(
                output, input, op=TORCH_OPS[op], group=group, async_op=async_op
            ),
            async_op=async_op,
            label=label,
            detail=detail,
            reduce_op=op,
            coalesced=coalesced,
        )
    accumulate = accumulate_dtype
    if accumulate is None:
        kind, reduce_op = "reduce_scatter", op
        accumulate = (
            output.dtype if output.dtype in (torch.float32, torch.float64) else torch.float32
        )
    else:
        kind, reduce_op = "all_to_all", None
    received = allocate("received", input.numel(), input.dtype, input.device)
    needs_sum = op in (ReduceOp.SUM, ReduceOp.AVG) and output.dtype != accumulate
    summed = allocate("sum", output.numel(), accumulate, output.device) if needs_sum else None
    wire_async = async_op or coalesced  # gloo's batches issue each collective on its own

    def finish() -> None:
        _reduce_rows(received.view(group.size(), -1), op, output.view(-1), summed)

    return _issue(
        kind,
        group,
        input,
        lambda: dist.all_to_all_single(received, input.view(-1), group=group, async_op=wire_async),
        async_op=async_op,
        label=label,
        detail=detail,
        reduce_op=reduce_op,
        coalesced=coalesced,
        finish=finish,
    )


def _reduce_rows(
    rows: torch.Tensor, op: ReduceOp, out: torch.Tensor, summed: torch.Tensor | None
) -> None:
    """``out ← op over dim 0 of rows`` (one row per rank, in group-rank order): SUM/AVG in
    ``summed``'s dtype, rounded once into ``out`` (straight into ``out`` when ``summed`` is
    None); MAX/MIN are exact in any dtype."""
    if op is ReduceOp.MAX:
        torch.amax(rows, dim=0, out=out)
        return
    if op is ReduceOp.MIN:
        torch.amin(rows, dim=0, out=out)
        return
    total = out if summed is None else summed
    torch.sum(rows, dim=0, dtype=total.dtype, out=total)
    if op is ReduceOp.AVG:
        total.div_(rows.shape[0])
    if summed is not None:
        out.copy_(total)


def _issue_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
    label: str,
    detail: str = "",
    coalesced: bool = False,
) -> CollectiveHandle:
    """Every rank's ``input`` into ``output`` in group-rank order, arguments known good
    (the pair checked, a live group of more than one rank). On gloo the all-to-all of the
    repeated input (module notes), read before any write (``input`` may be a view of
    ``output``)."""
    if is_gloo(group):
        repeated = input.reshape(1, -1).expand(group.size(), -1).contiguous()
        wire_async = async_op or coalesced  # gloo's batches issue each collective on its own

        def call() -> Any:
            flat = output.view(-1)
            return dist.all_to_all_single(flat, repeated.view(-1), group=group, async_op=wire_async)

    else:

        def call() -> Any:
            return all_gather_flat(output, input, group=group, async_op=async_op)

    return _issue(
        "all_gather",
        group,
        input,
        call,
        async_op=async_op,
        label=label,
        detail=detail,
        coalesced=coalesced,
    )


# -- the public collectives ---------------------------------------------------------------


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
      for narrower dtypes; recorded as a ``reduce_scatter`` (module notes).
    - ``accumulate_dtype`` (e.g. ``torch.float32``): on every backend, an all-to-all in the
      input's dtype, then ``output = dtype(op_s acc(x_s^r))``, rounded once from the sum
      taken in ``accumulate_dtype`` (Megatron's fp32-accumulating reduce-scatter: a bf16
      ring rounds after every addition). Recorded, checked and named in errors as the
      ``all_to_all`` it communicates with.
    - ``received``: the all-to-all's receive buffer (``input``'s numel, dtype and device),
      used when the reduce-scatter runs as an all-to-all; None: a fresh one per call.
      Callers repeating the collective use a :class:`~mc_groups.comm.communicator.Communicator`,
      which keeps
      its buffers.
    """
    check_group("group", group)
    op = check_op(op)
    check_options(async_op, label, detail, group=group)
    size = group.size()
    check_reduce_scatter(output, input, size)
    accumulate = check_accumulate_dtype(accumulate_dtype)
    check_received(input, received)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    return _issue_reduce_scatter(
        output, input, group, op, async_op, label, detail, accumulate, _given(received)
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
    runs as an all-to-all of the repeated input; recorded as one ``all_gather`` either way.
    """
    check_group("group", group)
    check_options(async_op, label, detail, group=group)
    size = group.size()
    check_all_gather(output, input, size)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    return _issue_all_gather(output, input, group, async_op, label, detail)


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
    check_group_rank(group_src, "group_src", size)
    if size == 1:
        return DONE
    return _issue(
        "broadcast",
        group,
        tensor,
        lambda: dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op),
        async_op=async_op,
        label=label,
        detail=detail,
        checked_as=f"broadcast from group rank {group_src}",
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
    check_splits(output, input, output_split_sizes, input_split_sizes, size)
    if size == 1:
        copy_unless_alias(output, input)
        return DONE
    uneven = output_split_sizes is not None or input_split_sizes is not None
    out_splits = None if output_split_sizes is None else list(output_split_sizes)
    in_splits = None if input_split_sizes is None else list(input_split_sizes)
    return _issue(
        "all_to_all",
        group,
        input,
        lambda: dist.all_to_all_single(
            output, input, out_splits, in_splits, group=group, async_op=async_op
        ),
        async_op=async_op,
        label=label,
        detail=detail,
        payload=f"uneven splits × {dtype_name(input.dtype)}" if uneven else None,
    )


def send(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_dst: int, label: str = ""
) -> None:
    """Point-to-point send of ``tensor`` to group rank ``group_dst`` (blocking; not
    schedule-checked: the group's other ranks take no part)."""
    _p2p("send", tensor, group, group_dst, label)


def recv(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, group_src: int, label: str = ""
) -> None:
    """Point-to-point receive into ``tensor`` from group rank ``group_src`` (blocking; not
    schedule-checked)."""
    _p2p("recv", tensor, group, group_src, label)


def _p2p(
    op: Literal["send", "recv"],
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    peer: int,
    label: str,
) -> None:
    """The one route of :func:`send` and :func:`recv`: checked, then issued blocking."""
    send = op == "send"
    check_group("group", group)
    check_contiguous("tensor", tensor)
    check_options(False, label, group=group)
    check_peer(group, peer, "group_dst" if send else "group_src")
    call: Callable[[], object] = (
        partial(dist.send, tensor, group=group, group_dst=peer)
        if send
        else partial(dist.recv, tensor, group=group, group_src=peer)
    )
    shown = f"send to group rank {peer}" if send else f"recv from group rank {peer}"
    _issue(op, group, tensor, call, async_op=False, label=label, checked_as=None, shown_as=shown)


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


def barrier(group: dist.ProcessGroup, *, label: str = "") -> None:
    """Block until every rank of ``group`` reached this call (bounded by the group timeout)."""
    check_group("group", group)
    check_options(False, label, group=group)
    if group.size() == 1:
        return
    _issue("barrier", group, None, lambda: dist.barrier(group=group), async_op=False, label=label)


def all_gather_objects(obj: object, group: dist.ProcessGroup, *, label: str = "") -> list[object]:
    """Every rank's picklable ``obj``, in group-rank order."""
    check_group("group", group)
    check_options(False, label, group=group)
    size = group.size()
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    _issue(
        "all_gather_object",
        group,
        None,
        lambda: dist.all_gather_object(out, obj, group=group),
        async_op=False,
        label=label,
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
    order of first appearance (``by_dtype``). A lone contiguous
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
