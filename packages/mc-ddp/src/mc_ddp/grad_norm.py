r"""The global gradient norm of a model split over every parallel group: which rank counts
which piece of the gradient, and the one reduction that adds them up.

The whole (unsharded) model's gradient is a set of distinct pieces; each piece may sit on
several ranks (copies). The norm must count every piece exactly once::

    ‖g‖_p = ( Σ_{pieces q} ‖g_q‖_p^p )^{1/p}          ‖g‖_∞ = max_q ‖g_q‖_∞

A rank counts a piece when it is the **first copy** of it: at coordinate 0 of every axis the
piece is replicated over (its rank in that axis's group is 0). Then each piece is counted by
exactly one rank in the world, and one reduction over the world (SUM of ``Σ ‖g_q‖_p^p`` over
the counted pieces, or MAX for ``p = ∞``) gives the norm on every rank. The axes, read from
the param's attributes (:mod:`mc_groups.param_attrs`) and this rank's groups::

    axis             a piece is distinct across it when            else replicated: counted at
    ───────────────  ────────────────────────────────────────────  ──────────────────────────
    data (DDP)       distributed optimizer: this rank's shard      inter_dist_opt rank 0
                     (the buckets' equal slices, disjoint)         (several optimizer instances)
                     no distributed optimizer: never               the bucket group's reduction
                                                                   group rank 0 (dp_cp, or
                                                                   expt_dp for expert params)
    tp / expt_tp     tensor_model_parallel=True (a TP shard)       tp rank 0 (dense) or
                                                                   expt_tp rank 0 (expert:
                                                                   allreduce=False; ETP ≠ TP)
    gtp_remat        is_gtp_weight_remat=True (a gtp_remat shard)  gtp_remat / expt_gtp_remat
                                                                   rank 0
    pipeline: tied   —                                             shared_embedding=True:
    word embedding                                                 embd rank 0 (the first
                                                                   stage); Megatron's
                                                                   shared=True: never
    pipeline: marked —                                             pipeline_parallel /
    replicas                                                       flextron_router_pp_sync:
                                                                   pp rank 0, first chunk
    ep, pp, cp       always distinct (other experts, other         —
                     layers) or already in dp_cp (cp)

So a layer norm or a row-parallel bias (replicated over tp, summed by
``finalize_model_grads`` when it holds a partial sum) counts once, not tp times; a TP shard
counts on every tp rank and once over dp; an expert weight at ETP ≠ TP counts over its own
expert groups, not the dense tp; the tied embedding counts on the first stage only (mc
marks both copies ``shared_embedding``, so Megatron's ``param_is_not_shared`` alone would
count it twice). The copies all hold the same values after ``finalize_model_grads``, so any
one of them would do; the first is Megatron's choice (``param_is_not_tensor_parallel_duplicate``,
``param_is_not_gtp_duplicate``). Clipping then scales **every** copy by the same factor.

Collective schedule: none here; :class:`~mc_ddp.ShardedOptimizer` issues the one reduction
(see its docs), with its checks' status riding along as one more element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp._optimizer_state import OwnedSlice
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_groups import param_attrs
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "GradNormRanks",
    "check_norm_type",
    "counted_slices",
    "counts_in_grad_norm",
    "counts_on_data_axis",
]


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else mg.group_rank(group)


class GradNormRanks(NamedTuple):
    """This rank's coordinate on every axis that can replicate a model-parallel piece of
    the gradient (0 where the group is absent: nothing to deduplicate)."""

    tp: int
    expt_tp: int
    gtp_remat: int
    expt_gtp_remat: int
    embd: int
    pp: int

    @classmethod
    def of(cls, pg_collection: mg.ProcessGroupCollection) -> GradNormRanks:
        """The ranks from a collection's ``tp``, ``expt_tp`` (falls back to ``tp``: an
        expert layer without an expert group is split like a dense one), ``gtp_remat``,
        ``expt_gtp_remat``, ``embd`` and ``pp`` groups."""
        tp = _rank(pg_collection.tp)
        expt_tp = tp if pg_collection.expt_tp is None else _rank(pg_collection.expt_tp)
        return cls(
            tp=tp,
            expt_tp=expt_tp,
            gtp_remat=_rank(pg_collection.gtp_remat),
            expt_gtp_remat=_rank(pg_collection.expt_gtp_remat),
            embd=_rank(pg_collection.embd),
            pp=_rank(pg_collection.pp),
        )


def counts_in_grad_norm(
    param: torch.Tensor, ranks: GradNormRanks, *, first_chunk: bool = True
) -> bool:
    """True when this rank counts ``param``'s (model-parallel) piece in the global norm: it
    is the first copy on every model-parallel axis it is replicated over (module table).
    The data-parallel axis is the caller's (the optimizer knows its shards).

    Args:
        param: a param with mc's / Megatron-Core's attributes (absent ones read as a plain
            replicated dense param).
        ranks: this rank's coordinates (:meth:`GradNormRanks.of`).
        first_chunk: ``param`` belongs to this rank's first model chunk (params replicated
            on every pipeline chunk count there only).
    """
    expert = param_attrs.is_expert_param(param)
    tp, gtp = (ranks.expt_tp, ranks.expt_gtp_remat) if expert else (ranks.tp, ranks.gtp_remat)
    duplicate = (
        param_attrs.is_shared_duplicate(param)
        or (not param_attrs.is_tensor_model_parallel(param) and tp != 0)
        or (not param_attrs.is_gtp_weight_remat(param) and gtp != 0)
        or (param_attrs.is_shared_embedding(param) and ranks.embd != 0)
        or (param_attrs.is_replicated_over_pp(param) and (ranks.pp != 0 or not first_chunk))
    )
    return not duplicate


def counts_on_data_axis(bucket_group: ParamAndGradBucketGroup) -> bool:
    """True when this rank counts the slices it steps of ``bucket_group``'s params on the
    data-parallel axis: with the distributed optimizer its shard is its own (then only the
    first optimizer instance counts), without it every rank of the reduction group holds
    the same all-reduced grads and only its rank 0 counts."""
    inter = bucket_group.inter_distributed_optimizer_instance_group
    if inter is not None and mg.group_rank(inter) != 0:
        return False
    if bucket_group.ddp_config.use_distributed_optimizer:
        return True
    return mg.group_rank(bucket_group.collective_group) == 0


def counted_slices(
    chunks: Sequence[DistributedDataParallel],
    slices: Sequence[OwnedSlice],
    pg_collection: mg.ProcessGroupCollection,
) -> list[bool]:
    """Per owned slice (of a param of ``chunks``): this rank counts it in the global norm
    (the data axis by its bucket group, the model-parallel axes by the param)."""
    ranks = GradNormRanks.of(pg_collection)
    where: dict[torch.nn.Parameter, tuple[bool, bool]] = {}
    for index, chunk in enumerate(chunks):
        for param, group in chunk.param_to_bucket_group.items():
            where[param] = (index == 0, counts_on_data_axis(group))
    out = []
    for piece in slices:
        first_chunk, on_data_axis = where[piece.param]
        out.append(
            on_data_axis and counts_in_grad_norm(piece.param, ranks, first_chunk=first_chunk)
        )
    return out


def check_norm_type(norm_type: object, what: str = "norm_type") -> float:
    """``norm_type`` as a float: a finite p ≥ 1 or ``inf`` (also the string ``"inf"``)."""
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        return float("inf")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise InputTypeError(
            f"{what}={norm_type!r} must be a number: 2.0 (the L2 norm), another p >= 1, or "
            "float('inf') (the largest magnitude)"
        )
    value = float(norm_type)
    if not (value >= 1.0):  # also NaN
        raise InputValueError(
            f"{what}={norm_type!r} is not a norm: use 2.0 (the L2 norm), another p >= 1, or "
            "float('inf') (the largest magnitude)"
        )
    return value
