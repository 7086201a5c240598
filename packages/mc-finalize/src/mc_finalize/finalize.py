"""``finalize_model_grads``: after the last backward of a global batch, before the optimizer.

Everything is validated first (model list, config, groups, ``num_tokens``, embedding
weights), so bad input fails on every rank before the first collective and before any
chunk's ``finish_grad_sync``. Then, in order:

 1. ``finish_grad_sync(force_all_reduce)`` on every chunk       data-parallel reduction
 2. conditional-embedder grads      SUM over pp          (has_cond_embedder, pp > 1)
 3. Flextron router grads           SUM over pp          (flextron, pp > 1)
 4. non-tensor-parallel grads       SUM / AVG over tp    (tp > 1)
 5. replicated grads                AVG (SUM per-token) over gtp_remat / expt_gtp_remat (> 1)
 6. shared word-embedding grad      SUM over embd        (first and last stage)
 7. position-embedding grad         SUM over pos_embd    (member ranks, group > 1)
 8. router expert bias              SUM of tokens over tp_dp_cp (moe_router_enable_expert_bias)
 9. router qb_beta                  AVG over dp_cp (dp_cp_gtp_remat under gtp_remat)
                                                         (quantile_balancing)
10. reset_model_temporary_tensors                        (no communication)
11. with num_tokens: broadcast from the last pp rank, SUM over dp_cp (dp_cp_gtp_remat when
    gtp_remat is active: those peers see different tokens), then every chunk's
    ``scale_gradients(1 / max(num_tokens, 1))``

Groups come from ``pg_collection`` (or the registered default collection). Needed always:
``tp``. Needed when their step runs: ``pp`` (steps 2, 3, 6, 7 with a multi-rank group, 11),
``dp_cp`` (9, 11; ``dp_cp_gtp_remat`` for both under gtp_remat), ``tp_dp_cp`` (8),
``gtp_remat`` / ``expt_gtp_remat`` when the config's ``gtp_remat_size`` /
``expert_gtp_remat_size`` > 1. ``embd`` / ``pos_embd`` may be None (ranks that hold no
embedding copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._groups_plan import _collection, _Groups, _plan_groups
from mc_finalize._inputs import _as_chunks, _check_force, _check_num_tokens, _config_of
from mc_finalize._settings import _read_settings
from mc_finalize.embedding_grads import (
    _allreduce_embedding_grad,
    _allreduce_position_embedding_grads,
    _embedding_weight,
    _get_position_embedding_weight,
    _get_shared_word_embedding_weight,
)
from mc_finalize.gtp_grads import _allreduce_replicated_grads_over_gtp_remat_group
from mc_finalize.pipeline_grads import (
    _allreduce_conditional_embedding_grads,
    _allreduce_router_grads,
)
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_finalize.router_state import (
    _update_router_expert_bias,
    _update_router_qb_beta,
    reset_model_temporary_tensors,
)
from mc_finalize.tp_grads import _allreduce_non_tensor_model_parallel_grads

__all__ = ["finalize_model_grads"]


def finalize_model_grads(
    model: Sequence[ModelChunk],
    num_tokens: torch.Tensor | None = None,
    pg_collection: mg.ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> None:
    """All-reduce every grad that still differs between ranks, then normalise by tokens.

    Reduces grads across data-parallel replicas, layer-norm and other non-tensor-parallel
    grads across tp, replicated grads across gtp_remat, replicated and tied-embedding grads
    across pipeline stages, updates the routers' balancing biases, and with ``num_tokens``
    (this rank's non-padded token count; only the last pipeline stage's value is used and it
    is summed in place over every rank that sees different data) divides every grad by the
    global count. The module docstring lists the steps, their groups and when each runs.

    Args:
        model: this rank's model chunks (one per virtual pipeline stage), in order.
        num_tokens: one-element int32/int64/float32/float64 tensor on the model's device.
        pg_collection: the groups; None uses ``mc_groups.get_default_collection()``.
        force_all_reduce: passed to every chunk's ``finish_grad_sync``.
    """
    chunks = _as_chunks(model, need_scale=num_tokens is not None)
    config = cast(FinalizeConfig, _config_of(chunks))
    settings = _read_settings(config)
    force = _check_force(force_all_reduce)
    groups = _plan_groups(_collection(pg_collection), settings, num_tokens is not None)
    if num_tokens is not None:
        _check_num_tokens(num_tokens, chunks)
    _check_embedding_weights(chunks, config, groups)

    for chunk in chunks:
        chunk.finish_grad_sync(force_all_reduce=force)
    _allreduce_conditional_embedding_grads(chunks, config, groups.pp)
    _allreduce_router_grads(chunks, config, groups.pp)
    _allreduce_non_tensor_model_parallel_grads(chunks, config, groups.tp)
    _allreduce_replicated_grads_over_gtp_remat_group(
        chunks, groups.gtp_remat, groups.expt_gtp_remat, settings.calculate_per_token_loss
    )
    _allreduce_embedding_grad(
        chunks, groups.embd, groups.pp, _word_embedding_getter(config), config=config
    )
    _allreduce_position_embedding_grads(chunks, config, groups.pos_embd, groups.pp)
    if settings.moe_router_enable_expert_bias:
        _update_router_expert_bias(chunks, config, groups.tp_dp_cp)
    if settings.quantile_balancing:
        _update_router_qb_beta(chunks, config, groups.data)
    reset_model_temporary_tensors(config, chunks)
    if num_tokens is not None:
        _scale_by_num_tokens(chunks, num_tokens, groups.pp, groups.data)


def _word_embedding_getter(config: FinalizeConfig) -> partial[torch.nn.Parameter | None]:
    return partial(_get_shared_word_embedding_weight, config=config)


def _check_embedding_weights(
    chunks: Sequence[ModelChunk], config: FinalizeConfig, groups: _Groups
) -> None:
    # Looking the weights up now turns a missing weight into an error before any collective.
    _embedding_weight(chunks, groups.embd, groups.pp, _word_embedding_getter(config), config)
    _embedding_weight(chunks, groups.pos_embd, groups.pp, _get_position_embedding_weight, config)


def _scale_by_num_tokens(
    chunks: Sequence[ModelChunk],
    num_tokens: torch.Tensor,
    pp: dist.ProcessGroup | None,
    data: dist.ProcessGroup | None,
) -> None:
    """``num_tokens ← Σ_data (last stage's count)``; grads ← grads / max(num_tokens, 1)."""
    if pp is None or data is None:
        raise mg.MissingGroupError("num_tokens needs the pp and dp_cp groups (checked earlier)")
    mg.broadcast(num_tokens, pp, group_src=mg.group_size(pp) - 1, label="num_tokens")
    mg.all_reduce(num_tokens, data, op=mg.ReduceOp.SUM, label="num_tokens")
    scaling = 1.0 / max(float(num_tokens.item()), 1.0)
    for chunk in chunks:
        chunk.scale_gradients(scaling)
