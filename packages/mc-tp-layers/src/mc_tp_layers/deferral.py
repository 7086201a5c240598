"""Embedding (LM-head) weight-gradient deferral: compute the held wgrads later.

With ``config.defer_embedding_wgrad_compute`` the output layer (a
:class:`~mc_tp_layers.ColumnParallelLinear` on the last pipeline stage) appends its
input to ``embedding_activation_buffer`` in forward and, in backward, its output
gradient to ``grad_output_buffer`` instead of running the wgrad GEMM (at most
``wgrad_deferral_limit`` micro-batches; 0 = all). The pipeline schedule then calls
:func:`drain_embedding_wgrad_compute` once, where the GEMMs can overlap other work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_tp_layers import _comm
from mc_tp_layers._config import TensorParallelConfig
from mc_tp_layers._gemm import accumulate_wgrad
from mc_tp_layers._groups import resolve_tp_group

__all__ = ["drain_embedding_wgrad_compute"]

_Gather = tuple[torch.Tensor, mg.CollectiveHandle | None]


def _check(
    activations: list[torch.Tensor], grads: list[torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    if len(activations) != len(grads):
        raise ValueError(
            f"embedding_activation_buffer holds {len(activations)} tensors but "
            f"grad_output_buffer holds {len(grads)}; both must hold one per deferred "
            "micro-batch (drain after every deferred backward ran)"
        )
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(
            "drain_embedding_wgrad_compute adds into weight.main_grad, which this weight "
            f"(shape {tuple(weight.shape)}) lacks; wrap the model in a DDP that allocates it"
        )
    return main_grad


def drain_embedding_wgrad_compute(
    config: TensorParallelConfig,
    embedding_activation_buffer: list[torch.Tensor],
    grad_output_buffer: list[torch.Tensor],
    weight: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """Add every deferred ``dW = dYᵢᵀ · Xᵢ`` into ``weight.main_grad`` and empty both buffers.

    Pairs are taken in order (activation i with gradient i). Under
    ``config.sequence_parallel`` each ``Xᵢ`` is this rank's rows and is all-gathered along
    dim 0 over ``tp_group`` first; the gather of pair i+1 is issued before the GEMM of
    pair i so the two overlap. ``tp_group`` None reads the default collection's ``tp``.
    """
    main_grad = _check(embedding_activation_buffer, grad_output_buffer, weight)
    if not embedding_activation_buffer:
        return
    group = resolve_tp_group(tp_group, None, what="drain_embedding_wgrad_compute")
    gather = bool(config.sequence_parallel) and group.size() > 1
    pending: _Gather | None = _start_gather(embedding_activation_buffer.pop(0), group, gather)
    while pending is not None:
        total_input, handle = pending
        upcoming = embedding_activation_buffer.pop(0) if embedding_activation_buffer else None
        pending = None if upcoming is None else _start_gather(upcoming, group, gather)
        if handle is not None:
            handle.wait()
        grad_output = grad_output_buffer.pop(0)
        accumulate_wgrad(
            main_grad,
            grad_output.reshape(-1, grad_output.shape[-1]),
            total_input.reshape(-1, total_input.shape[-1]),
        )


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup, gather: bool) -> _Gather:
    if not gather:
        return x, None
    return _comm.gather_first_dim(x, group, async_op=True)
