"""The hooks DDP leaves on the wrapped module. Each holds its DDP weakly: the module must not
keep a discarded wrapper (and its buffers) alive, and a collected wrapper's hooks do nothing,
so a re-wrapped module is driven by its new wrapper only."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from mc_groups.device import is_graph_capturing

Param = torch.nn.Parameter


class _GradReadyOwner(Protocol):
    def _on_grad_ready(self, param: Param) -> None: ...


class _ParamSyncOwner(Protocol):
    def _on_module_forward(self, module: torch.nn.Module) -> None: ...


class BackwardPostHook:
    """Runs after ``param``'s gradient accumulated (``param.grad`` is set): hands the param to
    its DDP, which moves the grad into ``main_grad`` and marks it ready. No-op under CUDA-graph
    capture and once the DDP is gone."""

    def __init__(self, ddp: _GradReadyOwner, param: Param) -> None:
        self._ddp: weakref.ref[_GradReadyOwner] = weakref.ref(ddp)
        self._param = param

    def __call__(self, *unused: Any) -> None:
        ddp = self._ddp()
        if ddp is None or is_graph_capturing():
            return
        ddp._on_grad_ready(self._param)


class ForwardPreHook:
    """Runs before a submodule's forward: its DDP waits for the all-gather of the module's
    params (dispatching it and chaining the next one as configured)."""

    def __init__(self, ddp: _ParamSyncOwner) -> None:
        self._ddp: weakref.ref[_ParamSyncOwner] = weakref.ref(ddp)

    def __call__(self, module: torch.nn.Module, *unused: Any) -> None:
        ddp = self._ddp()
        if ddp is None or is_graph_capturing():
            return
        ddp._on_module_forward(module)
