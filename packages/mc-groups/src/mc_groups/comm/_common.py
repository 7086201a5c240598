"""What every collective of the layer shares: the reduce ops, the handle, group queries,
per-dtype batching (``by_dtype``), argument checks, descriptions (for errors), the record,
the torch-version names of the flat collectives, and the debug switch of the
per-collective check. No collective is
issued here (see :mod:`mc_groups.comm.collectives`)."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mc_groups.argcheck import (
    check_flag,
    check_float_dtype,
    check_group,
    check_real,
    check_str,
    check_tensor,
)
from mc_groups.comm.cross_rank import cross_check, key_device
from mc_groups.comm.recorder import _REGISTRY, CollectiveRecord, _emit
from mc_groups.errors import CollectiveError, InputTypeError, InputValueError

__all__ = [
    "SCHEDULE_CHECK_ENV",
    "CollectiveHandle",
    "ReduceOp",
    "check_collective_schedule",
    "group_rank",
    "group_ranks",
    "group_size",
    "schedule_check_enabled",
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
