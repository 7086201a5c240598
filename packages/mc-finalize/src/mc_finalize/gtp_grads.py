"""Complete the gtp_remat axis for replicated (not gtp_remat-sharded) params.

With gtp_remat the data-parallel ranks are ``replicate × gtp_remat``; DDP reduces only
the replicate axis. A gtp_remat-sharded weight (``is_gtp_weight_remat=True``) finished the
gtp_remat axis inside its own wgrad reduce-scatter and is skipped here; every other param
holds one grad per gtp_remat peer, each from different data, and needs

    calculate_per_token_loss=False:  g ← AVG_gtp g   DDP already divided by the replicate
        size, so the mean over the gtp_remat peers gives the exact mean over
        replicate × gtp_remat: grad scale stays independent of how the ranks are split.
    calculate_per_token_loss=True:   g ← Σ_gtp g     DDP did not scale; finalize divides by
        the global token count, which counts the gtp_remat peers' tokens, so the axis must
        be summed like the data-parallel one (an AVG would shrink grads by 1/gtp_remat).

Dense params (``allreduce`` absent or True) reduce over ``gtp_remat_group``; expert params
(``allreduce=False``) over ``egtp_remat_group``. Each group gets one flat all-reduce per
dtype; a group that is None or has one rank is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._flat import _allreduce_views
from mc_finalize._inputs import _as_chunks
from mc_finalize.grad_access import _grad_view
from mc_finalize.protocols import ModelChunk
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_optional_group

_LABEL = "replicated grads over gtp_remat"


def _allreduce_replicated_grads_over_gtp_remat_group(
    model: Sequence[ModelChunk],
    gtp_remat_group: dist.ProcessGroup | None,
    egtp_remat_group: dist.ProcessGroup | None,
    calculate_per_token_loss: bool = False,
) -> None:
    """AVG (or SUM under ``calculate_per_token_loss``) replicated grads over gtp_remat.

    Dense replicated params reduce over ``gtp_remat_group``, expert ones over
    ``egtp_remat_group``; no-op for a group that is None or of size <= 1.
    """
    chunks = _as_chunks(model)
    what = "_allreduce_replicated_grads_over_gtp_remat_group"
    check_optional_group("gtp_remat_group", gtp_remat_group, what=what)
    check_optional_group("egtp_remat_group", egtp_remat_group, what=what)
    check_flag("calculate_per_token_loss", calculate_per_token_loss)
    _reduce_replicated_grads(chunks, gtp_remat_group, egtp_remat_group, calculate_per_token_loss)


def _reduce_replicated_grads(
    chunks: Sequence[ModelChunk],
    gtp_remat_group: dist.ProcessGroup | None,
    egtp_remat_group: dist.ProcessGroup | None,
    calculate_per_token_loss: bool,
) -> None:
    """The core of :func:`_allreduce_replicated_grads_over_gtp_remat_group` on checked
    inputs."""
    op = mg.ReduceOp.SUM if calculate_per_token_loss else mg.ReduceOp.AVG
    for group, expert in ((gtp_remat_group, False), (egtp_remat_group, True)):
        if group is None or mg.group_size(group) <= 1:
            continue
        params = _replicated_params(chunks, expert=expert)
        views = [v for v in map(_grad_view, params) if v is not None]
        _allreduce_views(views, group, op, _LABEL)


def _replicated_params(chunks: Sequence[ModelChunk], *, expert: bool) -> list[torch.nn.Parameter]:
    return [
        param
        for chunk in chunks
        for param in chunk.parameters()
        if param.requires_grad
        and not param_attrs.is_gtp_weight_remat(param)
        and param_attrs.is_expert_param(param) == expert
    ]
