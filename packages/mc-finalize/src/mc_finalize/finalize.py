"""``finalize_model_grads``: after the last backward of a global batch, before the optimizer.

Everything is validated first, once (model list, config, groups, ``num_tokens``, embedding
weights, chunks already finalized this iteration), so bad input fails on every rank before
the first collective and before any chunk's ``finish_grad_sync``. Then the steps run on
the checked inputs: each Megatron-named step is a wrapper that checks its own arguments
over a core, and this function calls the cores. In order::

     1. ``finish_grad_sync(force_all_reduce)`` on every chunk       data-parallel reduction
        (none for a module under FSDP2's ``fully_shard``: reduced in backward)
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
    11. with calculate_per_token_loss: num_tokens broadcast from the last pp rank, SUM over
        dp_cp (dp_cp_gtp_remat when gtp_remat is active: those peers see different tokens), in
        float64, then every chunk's ``scale_gradients(1 / max(num_tokens, 1))``
    12. every chunk that has it: ``mark_grads_finalized()``

``num_tokens`` is given exactly when ``config.calculate_per_token_loss`` (as Megatron's
schedules pass it); its type, shape, dtype and device are checked on each rank. Its value
can differ between ranks (it counts this rank's tokens), so a value check on one rank alone
would let that rank raise while its peers wait in the next collective. Instead a missing,
NaN, ±inf or negative count enters the token reduction as NaN (device ops, no host sync),
the sum read back for the scaling is NaN on every rank, and every rank raises the same
``ValueError`` before scaling (the grads were reduced, not scaled: redo the iteration).

Finalizing twice would reduce and scale the grads twice: a chunk that says its grads were
already finalized (``grads_finalized``, as ``mc_ddp.DistributedDataParallel`` does until
its next ``zero_grad_buffer()``) is refused before anything runs, and each chunk's
``mark_grads_finalized()`` (when it has one) is called at the end. Hand-made chunks without
the two attributes are not protected. The same chunk twice in ``model`` is refused.

A chunk under FSDP2 (``fully_shard``) is taken as it is (``mc_finalize._fsdp2``): its
marks come back from the record ``mc_tp_layers.parallelize`` left on its modules, its
config is the one ``parallelize`` recorded when ``model[0].config`` is its library's, its
DTensor grads are reduced over ``tp`` shard by shard (every TP peer holds the same
data-parallel shard: no gather).

Groups come from ``pg_collection`` (or the registered default collection). Needed always:
``tp``. Needed when their step runs: ``pp`` (steps 2, 3, 6, 7 with a multi-rank group, 11),
``dp_cp`` (9, 11; ``dp_cp_gtp_remat`` for both under gtp_remat), ``tp_dp_cp`` (8),
``gtp_remat`` / ``expt_gtp_remat`` when the config's ``gtp_remat_size`` /
``expert_gtp_remat_size`` > 1. ``embd`` / ``pos_embd`` may be None (ranks that hold no
embedding copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._fsdp2 import check_chunk as check_fsdp2_chunk
from mc_finalize._fsdp2 import is_fsdp2
from mc_finalize._inputs import (
    FINALIZE_METHODS,
    _as_chunks,
    _check_force,
    _check_methods,
    _check_num_tokens,
    _config_of,
)
from mc_finalize._settings import _read_settings, _Settings
from mc_finalize.embedding_grads import _reduce_embedding_grad, _stage_embedding_weight
from mc_finalize.gtp_grads import _reduce_replicated_grads
from mc_finalize.pipeline_grads import (
    _CONDITIONAL_EMBEDDERS,
    _FLEXTRON_ROUTERS,
    _reduce_replicated_over_pp,
)
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_finalize.router_state import (
    _reset_temporary_tensors,
    _update_expert_bias,
    _update_qb_beta,
)
from mc_finalize.tp_grads import _check_tp_marks, _reduce_non_tensor_parallel_grads
from mc_groups.argcheck import check_flag
from mc_groups.errors import InputValueError

__all__ = ["finalize_model_grads"]


def finalize_model_grads(
    model: Sequence[ModelChunk | torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: mg.ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
    *,
    peer_checks: bool = True,
) -> None:
    """All-reduce every grad that still differs between ranks, then normalise by tokens.

    Reduces grads across data-parallel replicas, layer-norm and other non-tensor-parallel
    grads across tp, replicated grads across gtp_remat, replicated and tied-embedding grads
    across pipeline stages, updates the routers' balancing biases, and with ``num_tokens``
    (this rank's non-padded token count; only the last pipeline stage's value is used and it
    is summed in place over every rank that sees different data) divides every grad by the
    global count. The module docstring lists the steps, their groups and when each runs.

    Args:
        model: this rank's model chunks (one per virtual pipeline stage), in order: DDP
            wrappers (:class:`ModelChunk`), or modules under FSDP2's ``fully_shard`` as they
            are (see the module notes).
        num_tokens: one-element int32/int64/float32/float64 tensor on the model's device,
            given exactly when ``config.calculate_per_token_loss`` (see the module notes).
        pg_collection: the groups; None uses ``mc_groups.get_default_collection()``.
        force_all_reduce: passed to every chunk's ``finish_grad_sync`` (None reads as False).
        peer_checks: end the checks in one status exchange over the world, so a check
            failing on one rank is an error on every rank (:func:`mc_groups.fail_together`;
            one more synchronisation per step). False skips it: every rank still checks,
            but a check failing on one rank only raises there and its peers wait in their
            next collective until the group's timeout (mc addition; keyword only).
    """
    check_flag("peer_checks", peer_checks)
    # A check failing on one rank stops every rank of the world here (one exchange).
    with mg.fail_together(None, "finalize_model_grads") if peer_checks else nullcontext():
        chunks = _as_chunks(model, FINALIZE_METHODS)
        config = cast(FinalizeConfig, _config_of(chunks))
        settings = _read_settings(config, whole=True)
        per_token = settings.calculate_per_token_loss
        if per_token:
            _check_methods(chunks, ("scale_gradients",))
        force = _check_force(force_all_reduce)
        collection = mg.collection_or_default(pg_collection, "finalize_model_grads")
        groups = _plan_groups(collection, settings, per_token)
        _check_num_tokens(num_tokens, chunks, per_token)
        word = _stage_embedding_weight(chunks, settings, groups.embd, groups.pp, word=True)
        position = _stage_embedding_weight(chunks, settings, groups.pos_embd, groups.pp, word=False)
        _check_not_finalized(chunks)
        for index, chunk in enumerate(chunks):
            if is_fsdp2(chunk):  # marks back from parallelize's record, mesh checked
                check_fsdp2_chunk(index, cast(torch.nn.Module, chunk), groups.tp)
        if mg.group_size(groups.tp) > 1:
            _check_tp_marks(chunks)
    _run_steps(chunks, settings, groups, force, word, position)
    if per_token:
        _scale_by_num_tokens(chunks, num_tokens, groups.pp, groups.data)
    for chunk in chunks:
        mark = getattr(chunk, "mark_grads_finalized", None)
        if callable(mark):
            mark()


@dataclass(frozen=True)
class _Groups:
    """The groups of one call, planned before any collective (None: the collection lacks
    it and no active step needs it). ``data`` is ``dp_cp`` or ``dp_cp_gtp_remat``."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup | None
    embd: dist.ProcessGroup | None
    pos_embd: dist.ProcessGroup | None
    data: dist.ProcessGroup | None
    tp_dp_cp: dist.ProcessGroup | None
    gtp_remat: dist.ProcessGroup | None
    expt_gtp_remat: dist.ProcessGroup | None


def _multi(group: dist.ProcessGroup | None) -> bool:
    return group is not None and mg.group_size(group) > 1


def _plan_groups(
    collection: mg.ProcessGroupCollection, settings: _Settings, has_tokens: bool
) -> _Groups:
    """Every group the active steps need, or a MissingGroupError naming the step."""

    def need(name: str, when: bool, why: str) -> dist.ProcessGroup | None:
        group: dist.ProcessGroup | None = getattr(collection, name)
        if when:
            group = collection.require(name, f"finalize_model_grads ({why})")
        return group

    embd, pos_embd = collection.embd, collection.pos_embd
    pp_steps = [
        (settings.has_cond_embedder, "conditional-embedder grads, config.has_cond_embedder"),
        (settings.flextron, "router grads, config.flextron"),
        (_multi(embd), "shared word-embedding grads: first/last stage"),
        (_multi(pos_embd), "position-embedding grads: first/last stage"),
        (has_tokens, "num_tokens (calculate_per_token_loss): broadcast from the last stage"),
    ]
    pp_why = "; ".join(why for when, why in pp_steps if when)
    tp = collection.require("tp", "finalize_model_grads (non-tensor-parallel grads over tp)")
    groups = _Groups(
        tp=tp,
        pp=need("pp", bool(pp_why), pp_why),
        embd=embd,
        pos_embd=pos_embd,
        data=need(
            _data_field(collection, settings),
            settings.quantile_balancing or has_tokens,
            "; ".join(
                why
                for when, why in (
                    (settings.quantile_balancing, "quantile balancing, qb_beta averaged"),
                    (has_tokens, "num_tokens summed"),
                )
                if when
            ),
        ),
        tp_dp_cp=need(
            "tp_dp_cp",
            settings.moe_router_enable_expert_bias,
            "router expert bias, config.moe_router_enable_expert_bias",
        ),
        gtp_remat=need("gtp_remat", settings.gtp_remat_size > 1, "config.gtp_remat_size > 1"),
        expt_gtp_remat=need(
            "expt_gtp_remat",
            settings.expert_gtp_remat_size > 1,
            "config.expert_gtp_remat_size > 1",
        ),
    )
    _check_gtp_sizes(groups, settings)
    return groups


def _data_field(collection: mg.ProcessGroupCollection, settings: _Settings) -> str:
    """The group of every rank that sees different data: ``dp_cp``, or ``dp_cp_gtp_remat``
    under gtp_remat, whose peers see different tokens too (Megatron-Core's
    ``dp_cp_gtp_remat or dp_cp``). num_tokens is summed and qb_beta averaged over it."""
    gtp_active = settings.gtp_remat_size > 1 or _multi(collection.gtp_remat)
    return "dp_cp_gtp_remat" if gtp_active else "dp_cp"


def _check_gtp_sizes(groups: _Groups, settings: _Settings) -> None:
    for name, group, size in (
        ("gtp_remat", groups.gtp_remat, settings.gtp_remat_size),
        ("expt_gtp_remat", groups.expt_gtp_remat, settings.expert_gtp_remat_size),
    ):
        if size > 1 and group is not None and mg.group_size(group) != size:
            raise InputValueError(
                f"pg_collection.{name} has {mg.group_size(group)} ranks but the config says "
                f"{size}; build the collection with the config's sizes"
            )


def _run_steps(
    chunks: Sequence[ModelChunk],
    settings: _Settings,
    groups: _Groups,
    force: bool,
    word: torch.nn.Parameter | None,
    position: torch.nn.Parameter | None,
) -> None:
    """Steps 1 to 10 of the module docstring, on inputs checked once by the caller: the
    cores of the Megatron-named steps (each step's public function checks its own
    arguments, then calls the same core)."""
    for chunk in chunks:
        if not is_fsdp2(chunk):  # FSDP2 reduce-scattered in backward
            chunk.finish_grad_sync(force_all_reduce=force)
    _reduce_replicated_over_pp(_CONDITIONAL_EMBEDDERS, chunks, settings, groups.pp)
    _reduce_replicated_over_pp(_FLEXTRON_ROUTERS, chunks, settings, groups.pp)
    _reduce_non_tensor_parallel_grads(chunks, settings, groups.tp)
    _reduce_replicated_grads(
        chunks, groups.gtp_remat, groups.expt_gtp_remat, settings.calculate_per_token_loss
    )
    _reduce_embedding_grad(word, groups.embd)
    _reduce_embedding_grad(position, groups.pos_embd)
    if settings.moe_router_enable_expert_bias and groups.tp_dp_cp is not None:
        _update_expert_bias(chunks, settings.moe_router_bias_update_rate, groups.tp_dp_cp)
    if settings.quantile_balancing and groups.data is not None:
        _update_qb_beta(chunks, settings.quantile_balancing_ema, groups.data)
    _reset_temporary_tensors(chunks, settings)


def _check_not_finalized(chunks: Sequence[ModelChunk]) -> None:
    for index, chunk in enumerate(chunks):
        if getattr(chunk, "grads_finalized", False) is True:
            raise RuntimeError(
                f"finalize_model_grads: model[{index}]'s gradients were already finalized this "
                "iteration (finalize_model_grads ran on it); finalizing twice would reduce and "
                "scale them twice. Call zero_grad_buffer() and run the next iteration's "
                "backward first"
            )


def _scale_by_num_tokens(
    chunks: Sequence[ModelChunk],
    num_tokens: torch.Tensor | None,
    pp: dist.ProcessGroup | None,
    data: dist.ProcessGroup | None,
) -> None:
    """``num_tokens ← Σ_data (last stage's count)``; grads ← grads / max(num_tokens, 1)."""
    if pp is None or data is None:
        raise mg.MissingGroupError("num_tokens needs the pp and dp_cp groups (checked earlier)")
    total = _reduce_num_tokens(chunks, num_tokens, pp, data)
    if num_tokens is not None:
        num_tokens.copy_(torch.tensor(total, dtype=torch.float64))  # the global count, in place
    scaling = 1.0 / max(total, 1.0)
    for chunk in chunks:
        chunk.scale_gradients(scaling)


def _reduce_num_tokens(
    chunks: Sequence[ModelChunk],
    num_tokens: torch.Tensor | None,
    pp: dist.ProcessGroup,
    data: dist.ProcessGroup,
) -> float:
    """The global token count, the same on every rank, or the same ``ValueError`` on every
    rank when any count was missing, NaN, ±inf or negative (it travels as NaN: float64 holds
    every int32/int64 count below 2**53 exactly; no host sync before the one ``item()``)."""
    if num_tokens is None:
        param = next(iter(chunks[0].parameters()), None)
        device = torch.device("cpu") if param is None else param.device
        count = torch.full((), math.nan, dtype=torch.float64, device=device)
    else:
        count = num_tokens.detach().reshape(()).to(torch.float64)
        bad = ~torch.isfinite(count) | (count < 0)
        count = torch.where(bad, torch.full_like(count, math.nan), count)
    count = count.reshape(1).contiguous()
    mg.broadcast(count, pp, group_src=mg.group_size(pp) - 1, label="num_tokens")
    mg.all_reduce(count, data, op=mg.ReduceOp.SUM, label="num_tokens")
    total = float(count.item())
    if not math.isfinite(total):
        given = "None" if num_tokens is None else f"{num_tokens.reshape(-1)[0].item()!r}"
        raise InputValueError(
            f"finalize_model_grads: num_tokens summed over the data-parallel ranks "
            f"{list(mg.group_ranks(data))} is not a count: it was missing (None), NaN, ±inf or "
            f"negative on at least one rank (this rank passed {given}; with pipeline "
            "parallelism the last stage's count is the one used). The grads were reduced but "
            "not scaled: fix the count and redo the iteration from zero_grad_buffer()"
        )
    return total
