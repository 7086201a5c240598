r"""``clip_grad_norm``: global grad-norm clipping and fp16 overflow agreement for models whose
grads live in ``param.grad`` (FSDP2's sharded DTensor grads, plain grads), over every
parallel group: the FSDP2 / torchtitan counterpart of
:meth:`mc_ddp.ShardedOptimizer.clip_grad_norm` (mc DDP's ``main_grad`` buffers).

Each element of the whole model's gradient is counted exactly once in the world
(:mod:`mc_ddp.grad_norm`'s rule)::

    axis            a rank counts its local grad when
    ──────────────  ─────────────────────────────────────────────────────────────────────
    data (FSDP2)    a DTensor grad: at coordinate 0 of every mesh dim it is Replicate
                    over (a Shard dim holds disjoint pieces: every rank counts its own);
                    a plain grad: replicated over dp_cp (torch DDP's), counted on rank 0
    tp, gtp_remat,  counts_in_grad_norm(param, ranks): TP shards on every tp rank, TP
    embd, pp        replicas (norms, row biases) on tp rank 0, the tied embedding on the
                    first embd rank, pipeline-replicated params on pp rank 0

Then, as :class:`~mc_ddp.ShardedOptimizer`'s guarded step (:mod:`mc_ddp._step_guard`)::

    local   n_r = Σ_{counted} ‖g‖_p^p (fp32, in float64)   f_r = any local grad inf/NaN
    reduce  one all_reduce over the world of [n_r, status_r, f_r] (SUM; MAX for p = ∞)
    decide  ‖g‖ = n^{1/p} / S (S: the loss scale); f > 0 or ‖g‖ not finite → skip
            else every local grad ← g · (1/S) · min(1, max_norm / (‖g‖ + 1e-6))
    scaler  grad_scaler.update(f > 0) (back off after an overflow, grow after clean steps)

so the norm equals ``torch.nn.utils.clip_grad_norm_`` of one process on the same global
batch, and every rank gets the same norm and the same skip decision. Call it after
``finalize_model_grads`` (the tensor-parallel partial sums must be reduced first) and step
the optimizer unless ``result.skipped``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import _step_guard as guarded
from mc_ddp._optimizer_checks import check_max_norm
from mc_ddp._step_guard import StepResult
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_ddp.grad_norm import GradNormRanks, check_norm_type, counts_in_grad_norm
from mc_ddp.grad_scaler import DynamicGradScaler
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import check_flag, type_name
from mc_groups.collection import collection_or_default
from mc_groups.comm.cross_rank import CarriedStatus
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["clip_grad_norm"]

_WHERE = "clip_grad_norm"


@torch.no_grad()
def clip_grad_norm(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    max_norm: float,
    norm_type: float | str = 2.0,
    *,
    grad_scaler: DynamicGradScaler | None = None,
    error_if_nonfinite: bool = False,
    pg_collection: mg.ProcessGroupCollection | None = None,
) -> StepResult:
    """Clip this iteration's grads of ``model`` (this rank's chunks) to the global norm
    ``max_norm`` and agree the step on every rank (module notes).

    Args:
        model: this rank's model chunks (FSDP2 modules, a
            :class:`~mc_ddp.TorchFullyShardedDataParallel`, plain modules), or one.
        max_norm: the largest global grad norm (> 0, finite).
        norm_type: the norm's order (2.0, another p >= 1, ``float('inf')`` or ``"inf"``).
        grad_scaler: fp16 loss scaling (:class:`~mc_ddp.DynamicGradScaler`): the grads are
            unscaled by ``1/S`` with the clip, an overflow on any rank skips the step on
            every rank, and the scaler is updated with the agreed flag.
        error_if_nonfinite: without a scaler, raise ``FloatingPointError`` on every rank
            when the norm is not finite (else the step is skipped).
        pg_collection: the groups the rule reads ranks from (``tp``, ``embd``, ``pp``,
            ``dp_cp``, …); None: the registered default collection.

    Returns:
        :class:`~mc_ddp.StepResult`: ``grad_norm`` (before clipping, unscaled), ``skipped``
        (step the optimizer only when False), ``loss_scale``, ``found_inf``.

    Collective: one all-reduce over the world (a failed check on any rank travels in it:
    every rank raises). Refused: grads in mc DDP's ``main_grad`` (use
    ``ShardedOptimizer(max_grad_norm=...)``), a scaler over bf16 grads (bf16 needs none).
    """
    chunks = _as_modules(model)
    guard = guarded.Guard(
        check_max_norm(max_norm, "max_norm"),
        check_norm_type(norm_type),
        _check_scaler(grad_scaler),
        check_flag("error_if_nonfinite", error_if_nonfinite),
    )
    collection = collection_or_default(pg_collection, _WHERE)
    status = CarriedStatus(_WHERE)
    grads: list[torch.Tensor] = []
    counted: list[bool] = []
    with status.checks():
        grads, counted = _local_grads(chunks, collection, guard.scaler is not None)
    if not status.passed:
        grads, counted = [], []
    wide = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads]
    device = next(iter(chunks[0].parameters()), torch.empty(0)).device
    outcome = guarded.reduce_step_values(guard, wide, counted, status, device)
    if guard.error_if_nonfinite and guard.scaler is None and outcome.skipped:
        raise FloatingPointError(
            f"{_WHERE}: a grad holds inf or NaN (global grad norm {outcome.grad_norm}); every "
            "rank raises and no grad changed. Pass error_if_nonfinite=False to skip such steps"
        )
    guarded.apply(guard, outcome, grads)
    if guard.scaler is not None:
        guard.scaler.update(outcome.found_inf)
    return outcome


def _as_modules(model: object) -> list[torch.nn.Module]:
    chunks = [model] if isinstance(model, torch.nn.Module) else model
    if not isinstance(chunks, Sequence) or isinstance(chunks, str) or not chunks:
        raise InputTypeError(
            f"model must be a torch.nn.Module or a non-empty list of them (this rank's "
            f"chunks), got {type_name(model)}"
        )
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise InputTypeError(f"model[{index}] is a {type_name(chunk)}, not a torch.nn.Module")
        if isinstance(chunk, DistributedDataParallel):
            raise InputTypeError(
                f"model[{index}] is an mc_ddp.DistributedDataParallel: its grads live in "
                "main_grad buffers; clip with ShardedOptimizer(max_grad_norm=...) or its "
                "clip_grad_norm()"
            )
    return list(chunks)


def _check_scaler(scaler: object) -> DynamicGradScaler | None:
    if scaler is None or isinstance(scaler, DynamicGradScaler):
        return scaler
    raise InputTypeError(
        f"grad_scaler={type_name(scaler)} must be an mc_ddp.DynamicGradScaler (or None): its "
        "overflow flag is agreed across the ranks"
    )


def _local_grads(
    chunks: list[torch.nn.Module], collection: mg.ProcessGroupCollection, scaled: bool
) -> tuple[list[torch.Tensor], list[bool]]:
    """This rank's local grad tensors and, per grad, whether this rank counts it."""
    ranks = GradNormRanks.of(collection)
    data = collection.dp_cp
    grads: list[torch.Tensor] = []
    counted: list[bool] = []
    for index, chunk in enumerate(chunks):
        param_attrs.restore_marks(chunk)  # after fully_shard replaced the params
        for name, param in chunk.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            if param_attrs.has_main_grad(param):
                raise InputValueError(
                    f"model[{index}] param '{name}' keeps its grad in main_grad (mc DDP's "
                    "buffers); clip with ShardedOptimizer(max_grad_norm=...)"
                )
            if scaled and grad.dtype == torch.bfloat16:
                raise InputValueError(
                    f"model[{index}] param '{name}' has a bf16 grad: bf16 has fp32's exponent "
                    "range and needs no loss scaler; pass grad_scaler=None"
                )
            local, on_data = _local_piece(grad, data)
            grads.append(local)
            model_axes = counts_in_grad_norm(param, ranks, first_chunk=index == 0)
            counted.append(on_data and model_axes)
    return grads, counted


def _local_piece(grad: torch.Tensor, data: dist.ProcessGroup | None) -> tuple[torch.Tensor, bool]:
    """The local tensor of ``grad`` and whether this rank counts it on the data axis."""
    if dtensors.is_dtensor(grad):
        return dtensors.first_replica_local(grad)
    return grad, data is None or mg.group_rank(data) == 0
