"""Grads of params that are not split by tensor parallelism but see split data.

Over the tp group of size T (only when T > 1), for every param with ``requires_grad``
and a grad (``main_grad`` if present, else ``grad``):

    AVG  params marked ``average_gradients_across_tp_domain``:  g ← (1/T) Σ_tp g
         (each TP rank computed a full, redundant grad; averaging keeps them equal)
    SUM  params marked ``sequence_parallel`` when ``config.sequence_parallel``, and params
         named ``*q_layernorm*`` / ``*k_layernorm*`` when ``config.qk_layernorm``:
         g ← Σ_tp g  (each rank saw only its sequence slice, or only its heads)

Schedule: the SUM grads are flattened into one buffer per dtype and all-reduced, then the
AVG grads likewise (two reduce ops, never mixed in one batch). The AVG mark wins when a
param carries both marks.
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
    _reduce_non_tensor_parallel_grads(chunks, settings, tp)


def _reduce_non_tensor_parallel_grads(
    chunks: Sequence[ModelChunk], settings: _Settings, tp: dist.ProcessGroup
) -> None:
    """The core of :func:`_allreduce_non_tensor_model_parallel_grads` on checked inputs."""
    if mg.group_size(tp) <= 1:
        return
    sums, avgs = _split_by_reduction(chunks, settings)
    _allreduce_views(sums, tp, mg.ReduceOp.SUM, _LABEL)
    _allreduce_views(avgs, tp, mg.ReduceOp.AVG, _LABEL)


# Megatron keeps the old name as an alias for legacy callers.
_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


def _split_by_reduction(
    chunks: Sequence[ModelChunk], settings: _Settings
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
            view = _grad_view(param)
            if view is not None:
                target.append(view)
    return sums, avgs


def _summed_over_tp(name: str, param: torch.nn.Parameter, settings: _Settings) -> bool:
    if settings.sequence_parallel and param_attrs.is_sequence_parallel_param(param):
        return True
    return settings.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
