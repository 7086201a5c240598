"""The run-time side of compiled collectives: the custom op ``mc_groups::collective``.

:mod:`mc_groups.comm.traceable` calls :func:`tap` right before each functional collective it
traces. Dynamo writes the call into the graph as ``torch.ops.mc_groups.collective``;
the op is registered as an *ordered side effect* (AOTAutograd threads an effect token
through it: it is never dead code and keeps program order among mc's collectives), so
Inductor's generated code calls it, in Python, every time the graph runs. There it does
what the eager path does before issuing a collective: the opt-in schedule check and a
:class:`~mc_groups.CollectiveRecord` (``compiled=True``) for every open recorder. While
tracing (fake tensors) it does nothing.

The op is defined once per process, when :mod:`mc_groups.comm.traceable` is first imported
(a ``torch.library.Library`` registration: torch's operator registry holds it, the
module keeps the handle alive). A torch without effect registration (a private torch
API in 2.13, ``torch.library._register_effectful_op``) gets no tap: compiled code then
records nothing and skips the schedule check, which the docs state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mc_groups.comm._common import ReduceOp, check_schedule, record

__all__: list[str] = []

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


def tap(
    input: torch.Tensor,
    op: str,
    reduce_op: ReduceOp | None,
    group: dist.ProcessGroup,
    async_op: bool,
    label: str,
) -> None:
    """While tracing: put the op into the graph before the collective on ``input``."""
    if _TAPPED:
        reduce = "" if reduce_op is None else reduce_op.value
        torch.ops.mc_groups.collective(input, op, reduce, group.group_name, async_op, label)
