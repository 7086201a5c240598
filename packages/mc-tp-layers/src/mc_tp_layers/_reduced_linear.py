r"""A row-parallel layer's linear and the reduction of its output as one autograd node.

``RowParallelLinear`` computes ``Y = reduce(X·Wᵀ)``: the SUM all-reduce over the TP group,
or under sequence parallelism the SUM reduce-scatter along dim 0. Megatron-Core applies
two autograd Functions for it (the linear function, then ``_ReduceFromModelParallelRegion``
or ``_ReduceScatterToSequenceParallelRegion``); every Python Function costs an ``apply``
in forward and a Python node in backward (~10 µs of host time together on this CPU, about
5 % of a small TP block's step: ``benchmarks/host_cost.py --part tp-host``). The layer's
steady-state forward (its arguments checked by an earlier forward, see
``ParallelLinear._steady_state``) applies this one node instead::

    forward:   P  = X·Wᵀ        (the linear function's forward: saves X and W)
               Y  = all-reduce(P), in place     | reduce-scatter(P) along dim 0 (SP)
    backward:  dP = dY                          | all-gather(dY) along dim 0 (SP)
               then the linear function's backward on dP (dgrad GEMM, wgrad GEMM or
               main_grad accumulation; no dgrad reduction: a row layer's input is split)

The same collectives in the same order, with the same labels, as the two Functions: the
values, gradients and recorded schedule do not depend on which path a forward took.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mc_tp_layers import _comm
from mc_tp_layers.linear import LinearWithGradAccumulationAndAsyncCommunication as _Linear

__all__: list[str] = []


class _LinearThenReduce(torch.autograd.Function):
    """``reduce(X·Wᵀ)`` as one node (see the module notes); no bias (added after). Applied
    by the row layer's steady-state forward on arguments a checked forward of the same
    layer passed, without wgrad deferral or a gtp_remat shard."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        gradient_accumulation_fusion: bool,
        tp_group: dist.ProcessGroup,
        scatter: bool,
    ) -> torch.Tensor:
        """``P = X·Wᵀ`` (nothing else holds it), then its reduction over ``tp_group``
        (reduce-scatter along dim 0 when ``scatter``, else all-reduce in place)."""
        partial = _Linear.forward(
            ctx,
            input,
            weight,
            bias=None,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            grad_output_buffer=None,
            wgrad_deferral_limit=0,
            tp_group=tp_group,
            gtp_remat_size=1,
            output_dtype=None,
        )
        ctx.scatter = scatter
        if scatter:
            return _comm.reduce_scatter_first_dim(partial, tp_group)
        return _comm.all_reduce(partial, tp_group, inplace=True)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``dP`` (``dY``, or ``dY`` all-gathered along dim 0), then the linear backward."""
        if ctx.scatter:
            grad_output = _comm.gather_first_dim(grad_output, ctx.opts.tp_group)
        grads = _Linear.backward(ctx, grad_output)
        return grads[0], grads[1], None, None, None
