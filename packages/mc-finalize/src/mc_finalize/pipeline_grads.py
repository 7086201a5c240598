"""Params replicated on every pipeline stage: conditional embedders and Flextron routers.

Such a param has one copy per (virtual) pipeline chunk, each with the grad of the part of
the model it fed. Keeping the copies equal needs their total:

    g ← Σ_{pp ranks} Σ_{local chunks} g_chunk        (every copy, same name)

Schedule per step: the local chunks' grads are summed by parameter name into the first
chunk's grad; those sums are flattened (one buffer per dtype) and all-reduced (SUM) over
the pp group; the result is copied back to every other local chunk. No collective when the
pp group has one rank, when the config switch is off, or when no param is marked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

import mc_groups as mg
from mc_finalize._flat import _allreduce_views
from mc_finalize._inputs import _as_chunks, _require_group
from mc_finalize._settings import _read_settings, _Settings
from mc_finalize.grad_access import _grad_view, _GradView
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_groups import param_attrs
from mc_groups.argcheck import check_optional_group


@dataclass(frozen=True)
class _ReplicatedOverPP:
    """One kind of param replicated on every stage: the step's name, the config switch that
    turns it on, the param mark and the collective's label."""

    what: str
    enabled: Callable[[_Settings], bool]
    marker: str
    label: str


_CONDITIONAL_EMBEDDERS = _ReplicatedOverPP(
    "_allreduce_conditional_embedding_grads",
    lambda settings: settings.has_cond_embedder,
    param_attrs.PIPELINE_PARALLEL,
    "conditional embedding grads",
)
_FLEXTRON_ROUTERS = _ReplicatedOverPP(
    "_allreduce_router_grads",
    lambda settings: settings.flextron,
    param_attrs.FLEXTRON_ROUTER_PP_SYNC,
    "router grads",
)


def _allreduce_conditional_embedding_grads(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """All-reduce conditional-embedder grads (params marked ``pipeline_parallel``) over pp.

    Runs when ``config.has_cond_embedder`` (default False) and pp > 1. For models that
    replicate their conditional embedders (timestep, FPS, label embedders of diffusion
    models) on every pipeline and virtual-pipeline stage. ``pp_group=None`` reads the
    default collection's ``pp``.
    """
    _check_and_reduce(_CONDITIONAL_EMBEDDERS, model, config, pp_group)


def _allreduce_router_grads(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """All-reduce Flextron router grads (params marked ``flextron_router_pp_sync``) over pp.

    Runs when ``config.flextron`` (default False) and pp > 1, so routers replicated on every
    stage stay in sync. ``pp_group=None`` reads the default collection's ``pp``.
    """
    _check_and_reduce(_FLEXTRON_ROUTERS, model, config, pp_group)


def _check_and_reduce(
    kind: _ReplicatedOverPP,
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """The public steps: check their arguments, resolve pp only when the step is on."""
    chunks = _as_chunks(model)
    check_optional_group("pp_group", pp_group, what=kind.what)
    settings = _read_settings(config)
    if kind.enabled(settings):
        pp = _require_group(pp_group, "pp_group", "pp", kind.what)
        _reduce_replicated_over_pp(kind, chunks, settings, pp)


def _reduce_replicated_over_pp(
    kind: _ReplicatedOverPP,
    chunks: Sequence[ModelChunk],
    settings: _Settings,
    pp: dist.ProcessGroup | None,
) -> None:
    """The core of both steps on checked inputs (``pp`` is resolved whenever the step is
    on)."""
    if kind.enabled(settings) and pp is not None:
        _allreduce_marked_over_pp(chunks, pp, kind.marker, kind.label)


def _allreduce_marked_over_pp(
    chunks: Sequence[ModelChunk], pp: dist.ProcessGroup, marker: str, label: str
) -> None:
    if mg.group_size(pp) <= 1:
        return
    copies = _marked_grads_by_name(chunks, marker)
    if not copies:
        return
    for views in copies.values():
        for other in views[1:]:
            views[0].full.add_(other.full)
    _allreduce_views([views[0] for views in copies.values()], pp, mg.ReduceOp.SUM, label)
    for views in copies.values():
        for other in views[1:]:
            other.full.copy_(views[0].full)
            other.commit()


def _marked_grads_by_name(chunks: Sequence[ModelChunk], marker: str) -> dict[str, list[_GradView]]:
    copies: dict[str, list[_GradView]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not (param.requires_grad and getattr(param, marker, False)):
                continue
            view = _grad_view(param)
            if view is not None:
                copies.setdefault(name, []).append(view)
    return copies
