"""Grads of params that are not split by tensor parallelism but see split data.

Over the tp group of size T (only when T > 1), for every param with ``requires_grad``
and a grad (``main_grad`` if present, else ``grad``):

    AVG  params marked ``average_gradients_across_tp_domain``:  g ← (1/T) Σ_tp g
         (each TP rank computed a full, redundant grad; averaging keeps them equal)
    SUM  params marked ``sequence_parallel`` when ``config.sequence_parallel``, params
         named ``*q_layernorm*`` / ``*k_layernorm*`` when ``config.qk_layernorm``, and
         params marked ``sum_gradients_across_tp_domain`` always (mc's mark):
         g ← Σ_tp g  (each rank saw only its sequence slice, or only its heads)

Schedule: the SUM grads are flattened into one buffer per dtype and all-reduced, then the
AVG grads likewise (two reduce ops, never mixed in one batch). The AVG mark wins over
``sequence_parallel`` when a param carries both (Megatron's order).

``sum_gradients_across_tp_domain`` is for a replicated param whose grad is a partial sum over
tp *without* sequence parallelism, e.g. a norm weight shared by all heads applied after a
column-parallel layer (each rank holds its own heads' part; Megatron-LM #7452 row 11): the
``sequence_parallel`` mark is summed only under ``config.sequence_parallel`` (Megatron's
meaning, kept), ``average_gradients_across_tp_domain`` averages. It is refused (before any
collective) together with the AVG mark, or on a TP shard (``tensor_model_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._flat import _allreduce_views
from mc_finalize._inputs import _as_chunks, _require_group
from mc_finalize._settings import _read_settings, _Settings
from mc_finalize.grad_access import _grad_view, _GradView
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_groups import param_attrs
from mc_groups.errors import InputValueError

_LABEL = "non-tensor-parallel grads"


def _allreduce_non_tensor_model_parallel_grads(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """All-reduce layer-norm grads (sequence parallelism, q/k layer norm) and the grads of
    params with ``average_gradients_across_tp_domain=True`` across tensor-parallel ranks.

    ``tp_group=None`` reads the default collection's ``tp``.
    """
    chunks = _as_chunks(model)
    settings = _read_settings(config)
    tp = _require_group(tp_group, "tp_group", "tp", "_allreduce_non_tensor_model_parallel_grads")
    _check_tp_marks(chunks)
    _reduce_non_tensor_parallel_grads(chunks, settings, tp)


def _check_tp_marks(chunks: Sequence[ModelChunk]) -> None:
    """``sum_gradients_across_tp_domain`` neither with the AVG mark nor on a TP shard."""
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if not param_attrs.sums_grad_across_tp(param):
                continue
            if param_attrs.averages_grad_across_tp(param):
                raise InputValueError(
                    f"model[{index}] param '{name}' is marked both sum_gradients_across_tp_domain "
                    "(its grad is a partial sum over tp: SUM) and "
                    "average_gradients_across_tp_domain (a full grad on every tp rank: AVG); "
                    "keep the one that says how its grad was computed"
                )
            if param_attrs.is_tensor_model_parallel(param):
                raise InputValueError(
                    f"model[{index}] param '{name}' is a tensor-parallel shard "
                    "(tensor_model_parallel=True) marked sum_gradients_across_tp_domain: a "
                    "shard's grad is its own, not a partial sum of a replicated param's; drop "
                    "the mark"
                )


def _reduce_non_tensor_parallel_grads(
    chunks: Sequence[ModelChunk], settings: _Settings, tp: dist.ProcessGroup
) -> None:
    """The core of :func:`_allreduce_non_tensor_model_parallel_grads` on checked inputs."""
    if mg.group_size(tp) <= 1:
        return
    sums, avgs = _split_by_reduction(chunks, settings, tp)
    _allreduce_views(sums, tp, mg.ReduceOp.SUM, _LABEL)
    _allreduce_views(avgs, tp, mg.ReduceOp.AVG, _LABEL)


# Megatron keeps the old name as an alias for legacy callers.
_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


def _split_by_reduction(
    chunks: Sequence[ModelChunk], settings: _Settings, tp: dist.ProcessGroup
) -> tuple[list[_GradView], list[_GradView]]:
    sums: list[_GradView] = []
    avgs: list[_GradView] = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if param_attrs.averages_grad_across_tp(param):
                target = avgs
            elif _summed_over_tp(name, param, settings):
                target = sums
            else:
                continue
            view = _grad_view(param, tp)
            if view is not None:
                target.append(view)
    return sums, avgs


def _summed_over_tp(name: str, param: torch.nn.Parameter, settings: _Settings) -> bool:
    if param_attrs.sums_grad_across_tp(param):
        return True
    if settings.sequence_parallel and param_attrs.is_sequence_parallel_param(param):
        return True
    return settings.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
