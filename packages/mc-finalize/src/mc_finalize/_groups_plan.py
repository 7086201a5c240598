"""Which group each finalize step uses, resolved and checked before any collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

import mc_groups as mg
from mc_finalize._settings import _Settings


@dataclass(frozen=True)
class _Groups:
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
            raise ValueError(
                f"pg_collection.{name} has {mg.group_size(group)} ranks but the config says "
                f"{size}; build the collection with the config's sizes"
            )
