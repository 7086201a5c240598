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
from mc_groups.argcheck import check_flag, check_tensor, type_name
from mc_groups.comm import traceable
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import _comm
from mc_tp_layers._gemm import accumulate_wgrad
from mc_tp_layers._tp_groups import resolve_tp_group

__all__ = ["drain_embedding_wgrad_compute"]


def _check(
    config: object,
    activations: object,
    grads: object,
    weight: object,
    group: dist.ProcessGroup,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, bool]:
    """Every argument and every buffered pair, before anything is popped or communicated:
    a failing drain leaves both buffers as they were."""
    sequence_parallel = check_flag(
        "config.sequence_parallel", getattr(config, "sequence_parallel", None)
    )
    xs = _check_list("embedding_activation_buffer", activations)
    dys = _check_list("grad_output_buffer", grads)
    w = check_tensor("weight", weight)
    if len(xs) != len(dys):
        raise InputValueError(
            f"embedding_activation_buffer holds {len(xs)} tensors but "
            f"grad_output_buffer holds {len(dys)}; both must hold one per deferred "
            "micro-batch (drain after every deferred backward ran)"
        )
    main_grad = mg.param_attrs.main_grad_or_none(w)
    if not isinstance(main_grad, torch.Tensor):
        raise InputValueError(
            "drain_embedding_wgrad_compute adds into weight.main_grad, which this weight "
            f"(shape {tuple(w.shape)}) lacks; wrap the model in a DDP that allocates it"
        )
    if w.dim() != 2 or main_grad.shape != w.shape:
        raise InputValueError(
            f"weight has shape {tuple(w.shape)} and weight.main_grad {tuple(main_grad.shape)}; "
            "drain needs a 2-D weight [n, k] and a main_grad of its shape"
        )
    gather = sequence_parallel and group.size() > 1
    for index, (x, dy) in enumerate(zip(xs, dys, strict=True)):
        _check_pair(index, x, dy, w, int(group.size()) if sequence_parallel else 1)
    return xs, dys, main_grad, gather


def _check_list(name: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, list):
        raise InputTypeError(f"{name} must be a list, got {type_name(value)}")
    return value


def _check_pair(index: int, x: object, dy: object, w: torch.Tensor, rows_factor: int) -> None:
    """Pair ``index``: ``X [.., k]`` (this rank's rows under SP) and ``dY [.., n]`` with
    ``rows(X) · W == rows(dY)``, floating, on the weight's device."""
    x = check_tensor(f"embedding_activation_buffer[{index}]", x)
    dy = check_tensor(f"grad_output_buffer[{index}]", dy)
    n, k = w.shape
    for name, t, last in (("embedding_activation_buffer", x, k), ("grad_output_buffer", dy, n)):
        if t.dim() < 1 or t.shape[-1] != last or not t.dtype.is_floating_point:
            raise InputValueError(
                f"{name}[{index}] is {t.dtype} of shape {tuple(t.shape)}; it must be a "
                f"floating tensor [..., {last}] for a weight of shape {tuple(w.shape)}"
            )
        if t.device != w.device:
            raise InputValueError(f"{name}[{index}] is on {t.device} but the weight on {w.device}")
    rows_x, rows_dy = x.numel() // k * rows_factor, dy.numel() // n
    if rows_x != rows_dy:
        gathered = f" (× {rows_factor} ranks under sequence parallelism)" if rows_factor > 1 else ""
        raise InputValueError(
            f"pair {index}: the activation has {x.numel() // k} rows{gathered} but the output "
            f"gradient {rows_dy}; each pair must come from the same micro-batch"
        )


def drain_embedding_wgrad_compute(
    config: TransformerConfigLike,
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

    Every argument and every pair (types, shapes against the weight, devices, equal
    lengths) is checked before the first pair is taken: a drain that raises leaves both
    buffers untouched.
    """
    group = resolve_tp_group(tp_group, None, what="drain_embedding_wgrad_compute")
    activations, grads, main_grad, gather = _check(
        config, embedding_activation_buffer, grad_output_buffer, weight, group
    )
    if not activations:
        return
    pending: traceable.PendingTensor | None = _start_gather(activations.pop(0), group, gather)
    while pending is not None:
        current = pending
        upcoming = activations.pop(0) if activations else None
        pending = None if upcoming is None else _start_gather(upcoming, group, gather)
        total_input = current.wait()
        grad_output = grads.pop(0)
        accumulate_wgrad(
            main_grad,
            grad_output.reshape(-1, grad_output.shape[-1]),
            total_input.reshape(-1, total_input.shape[-1]),
        )


def _start_gather(
    x: torch.Tensor, group: dist.ProcessGroup, gather: bool
) -> traceable.PendingTensor:
    if not gather:
        return traceable.PendingTensor(x)
    return _comm.start_gather_first_dim(x, group)
