"""What DDP leaves on the wrapped module and its params, and parameter readiness.

DDP registers (besides its backward hook per param, defined with DDP) a
:class:`ForwardPreHook` per submodule with ``overlap_param_gather`` (the forward waits for
its params' all-gather) and, on every param of a bucket group, a
:class:`_BucketParamReadyCallback`. Each holds its DDP (and bucket group) weakly: the
module and its params must not keep a discarded wrapper (and its buffers) alive, and a
collected wrapper's hooks do nothing, so a re-wrapped module is driven by its new wrapper
only. None runs under CUDA-graph capture (each asks its DDP, whose module holds the probe).

Parameter readiness, for consumers that read ``param.data`` before its module's pre-hook:
with ``overlap_param_gather`` a param's values arrive by an all-gather that the forward
pre-hook of its module waits for. A consumer reading the param earlier (a fused kernel
that reads the next layer's weight, a prefetcher) calls :func:`ensure_params_ready` first.
The contract is backend-agnostic: a backend stores a zero-argument callable on each param
under :data:`PARAM_READY_CALLBACK_ATTR`; DDP stores one :class:`_BucketParamReadyCallback`
per bucket group on every param of that group. Unmarked params need nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError

if TYPE_CHECKING:
    from mc_ddp.bucket_group import ParamAndGradBucketGroup

__all__ = ["PARAM_READY_CALLBACK_ATTR", "ensure_params_ready"]

Param = torch.nn.Parameter

PARAM_READY_CALLBACK_ATTR = "_mc_param_ready_callback"
"""Attribute under which a backend stores a param's zero-argument publish callback."""


def ensure_params_ready(params: Iterable[torch.Tensor]) -> None:
    """Make ``params`` readable: call each distinct callback found on them once, in the
    order of first appearance (params of one bucket group share one callback)."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise InputTypeError(
            "params must be an iterable of tensors (e.g. module.parameters()), got "
            f"{type_name(params)}"
        )
    seen: set[int] = set()
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise InputTypeError(f"params holds a {type_name(param)}; every item must be a tensor")
        callback: Callable[[], None] | None = getattr(param, PARAM_READY_CALLBACK_ATTR, None)
        if callback is None or id(callback) in seen:
            continue
        seen.add(id(callback))
        callback()


class _BucketParamReadyCallback:
    """Publishes one bucket group's parameters on demand.

    DDP's side of :func:`ensure_params_ready`: one instance is stored on every parameter of
    the group under :data:`PARAM_READY_CALLBACK_ATTR`. Calling it:

    - does nothing when the group's gather completed this iteration (idempotent; checked
      first, it is the common case), when the DDP or the group was collected (both are held
      weakly: the callback lives on params, which outlive a DDP on re-wrap), or while a CUDA
      graph is being captured: a captured collective would run again at every replay, so
      publication waits for a call outside capture (a capturing consumer publishes before
      it captures, or replays this call itself). The capture probe is the DDP module's
      ``is_graph_capturing`` (``mc_ddp.distributed_data_parallel.is_graph_capturing``,
      Megatron's place for it), read at each call so a test can patch it;
    - drains an in-flight gather; with the forward pre-hooks enabled it chains the next
      group's gather as a pre-hook would (not with ``align_param_gather`` or when the
      optimizer step owns the dispatch); with them disabled the caller owns the schedule,
      so it never chains;
    - STARTS an undispatched gather only while the pre-hooks are enabled (with them
      removed, a gather could land in a buffer the caller is using).
    """

    def __init__(self, ddp: Any, bucket_group: ParamAndGradBucketGroup) -> None:
        self._ddp: weakref.ref[Any] = weakref.ref(ddp)
        self._bucket_group: weakref.ref[ParamAndGradBucketGroup] = weakref.ref(bucket_group)

    def __call__(self) -> None:
        group = self._bucket_group()
        if group is None:
            return
        # the hot path: published this iteration (every microbatch after the first)
        if group.param_gather_dispatched and group.param_gather_handle is None:
            return
        ddp = self._ddp()
        if ddp is None or ddp._graph_capturing():
            return
        hooks_enabled = bool(ddp.remove_forward_pre_hook_handles)
        in_flight = group.param_gather_handle is not None
        if not hooks_enabled and not in_flight:
            return
        skip_next = (
            not hooks_enabled
            or ddp.ddp_config.align_param_gather
            or ddp.overlap_param_gather_with_optimizer_step
        )
        group.finish_param_sync(skip_next_bucket_dispatch=skip_next)


class _ParamSyncOwner(Protocol):
    def _on_module_forward(self, module: torch.nn.Module) -> None: ...
    def _graph_capturing(self) -> bool: ...


def runs_compiled(module: torch.nn.Module) -> bool:
    """``module``'s own hooks run outside a compiled graph that holds all of its forward:
    the wrapper ``torch.compile(m)`` returns (it keeps ``m`` as ``_orig_mod``), or a
    module whose ``forward`` was replaced by ``torch.compile(module.forward)`` (torch
    marks the compiled function with ``_torchdynamo_orig_callable``)."""
    if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
        return True
    forward = module.__dict__.get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


class ForwardPreHook:
    """Runs before a submodule's forward: its DDP waits for the all-gather of the module's
    params (dispatching it and chaining the next one as configured).

    Inside a compiled block (``torch.compile(block)``, or ``block.forward`` compiled) the
    hook is traced into the block's graph, where it does nothing: the block's own hook
    (outside the graph, see :func:`runs_compiled`) already waited for every param of it.
    """

    def __init__(self, ddp: _ParamSyncOwner) -> None:
        self._ddp: weakref.ref[_ParamSyncOwner] = weakref.ref(ddp)

    def __call__(self, module: torch.nn.Module, *unused: Any) -> None:
        if torch.compiler.is_compiling():
            return
        ddp = self._ddp()
        if ddp is None or ddp._graph_capturing():
            return
        ddp._on_module_forward(module)
