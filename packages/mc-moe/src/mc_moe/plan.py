r"""``parallelize`` for mixture-of-experts models: the model's own ``tp_plan`` and
``ep_plan`` (``transformers``' style names), experts split over ``ep`` and ``expt_tp``, the
dense entries handed to :func:`mc_tp_layers.parallelize`.

Why here and not a style protocol in ``mc_tp_layers``: the dependency points
``mc_moe → mc_tp_layers``; the experts need the EP groups and the token dispatcher, which
live here; ``mc_tp_layers.parallelize`` stays the one route for dense layers, and this
function splits a plan in two and calls it. A user calls one function either way.

The plan entries it reads (the others are dense and go to ``mc_tp_layers.parallelize``)::

    entry                                style                   what mc does
    ───────────────────────────────────  ──────────────────────  ─────────────────────────────
    layers.*.mlp.experts                 ep_dispatch_experts     the experts module: split over
                                         (ep_plan)               ep, its forward dispatches the
                                         moe_tp_experts          tokens (mc_moe.experts); over
                                         (tp_plan)               expt_tp as well when Q > 1
    layers.*.mlp.experts.gate_up_proj    grouped_gemm (ep_plan)  parameters of such a module:
    layers.*.mlp.experts.down_proj       packed_colwise, colwise checked to belong to one (the
    (…_bias)                             rowwise (tp_plan)       module's layout decides the split)
    ep_router                            —                       refused (removed from
                                                                 transformers; route with the
                                                                 model's own router)

torchtitan's MoE models carry no plan of their own: name each block's experts module,
``ep_plan={"layers.*.moe.experts": "ep_dispatch_experts"}``; at TP > 1,
``sequence_parallel_plan(model, ep_plan=...)`` gives the dense plan (torchtitan's, from the
model's layout).

Sizes come from ``pg_collection``: P ranks in ``ep``, Q in ``expt_tp``. With P = 1 the
experts stay whole over ep; with Q = 1 whole over expt_tp; an ``ep_plan`` at P = 1 is no
error.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_int, type_name
from mc_groups.config import check_config, config_value, record_config
from mc_groups.errors import InputTypeError, InputValueError
from mc_moe.experts import ExpertWeights, read_experts, shard_experts
from mc_moe.router import enable_expert_bias, routers_with_bias, use_global_aux_loss
from mc_tp_layers import parallelize as parallelize_dense
from mc_tp_layers import sequence_parallel_plan as dense_sequence_parallel_plan

__all__ = ["MoEPlanWarning", "moe_entries", "parallelize", "sequence_parallel_plan"]

EXPERTS_STYLES = frozenset({"ep_dispatch_experts", "moe_tp_experts"})
PARAM_STYLES = frozenset({"grouped_gemm", "packed_colwise", "colwise", "rowwise"})
REMOVED_STYLES = frozenset({"ep_router"})


class MoEPlanWarning(UserWarning):
    """Dense plan entries matched no module because the layers they name are MoE layers
    (``transformers`` skips them the same way)."""


@dataclass(frozen=True)
class _Experts:
    name: str
    module: torch.nn.Module
    layout: ExpertWeights


def moe_entries(plan: Mapping[str, object], model: torch.nn.Module) -> dict[str, object]:
    """The entries of ``plan`` that name an experts module or one of its parameters (by
    style: ``ep_dispatch_experts`` / ``moe_tp_experts`` / ``grouped_gemm``, or a pattern
    that matches a parameter, not a module, of ``model``)."""
    modules = {n for n, _ in model.named_modules() if n}
    params = [n for n, _ in model.named_parameters()]
    out: dict[str, object] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise InputTypeError(f"plan key {pattern!r} must be a str (an fnmatch pattern)")
        names_param = not any(fnmatchcase(m, pattern) for m in modules) and any(
            fnmatchcase(p, pattern) for p in params
        )
        named = isinstance(value, str) and (value in EXPERTS_STYLES or value == "grouped_gemm")
        if named or names_param:
            out[pattern] = value
    return out


def parallelize(
    module: torch.nn.Module,
    plan: Mapping[str, object] | None,
    *,
    ep_plan: Mapping[str, object] | None = None,
    config: object,
    pg_collection: mg.ProcessGroupCollection,
    sequence_dim: int = 1,
    global_aux_loss: bool = True,
) -> torch.nn.Module:
    """Split a MoE model over ``tp``, ``ep`` and ``expt_tp``, in place; wire its routers.

    ``parallelize(model, model.tp_plan, ep_plan=model.ep_plan, config=cfg,
    pg_collection=pgc)``.

    Args:
        module: a model whose MoE layers hold ``transformers``' experts modules (3-D
            ``gate_up_proj`` / ``down_proj``; Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3,
            gpt-oss) or torchtitan's ``GroupedExperts`` (``w1`` / ``w2`` / ``w3``; its MoE
            module without ``expert_bias``), on CPU or a device.
        plan: the tensor-parallel plan (``model.tp_plan``): dense entries go to
            :func:`mc_tp_layers.parallelize`, expert entries split the experts over
            ``expt_tp``. ``None`` or ``{}``: no dense layer is split.
        ep_plan: the expert-parallel plan (``model.ep_plan``): its experts modules are split
            over ``ep``. Required when ``ep`` has more than one rank.
        config: the layers' config (``mc_groups.ModelParallelConfig``); under tensor
            parallelism MoE layers need ``config.sequence_parallel`` (as Megatron-Core:
            each TP rank routes its own part of the sequence).
        pg_collection: the groups (``tp``, ``ep``, ``expt_tp``, ``tp_ep``).
        sequence_dim: as :func:`mc_tp_layers.parallelize`.
        global_aux_loss: a model that adds ``transformers``' load-balancing loss
            (``router_aux_loss_coef``, with ``output_router_logits``) computes it on the
            global batch (:mod:`mc_moe.router`), so every layout trains what one process
            does; ``False`` keeps each rank's own (mc addition).

    With ``config.moe_router_enable_expert_bias`` (Megatron's field) every router with a
    per-expert ``e_score_correction_bias`` (DeepSeek-V3) gets Megatron's ``expert_bias`` /
    ``local_tokens_per_expert``, and ``mc_finalize.finalize_model_grads`` updates the bias
    once per global batch (:mod:`mc_moe.router`); a model without such a router is an error
    naming the flag.

    Every check runs before any module changes and before any collective: an unknown or
    removed style, an entry matching nothing (dense entries that match nothing in a model
    whose layers are MoE are skipped with one :class:`MoEPlanWarning`, as ``transformers``
    skips them), a number of experts the EP size does not divide, an expert width the
    expert-TP size does not divide, EP > 1 without an ``ep_plan``, TP > 1 without sequence
    parallelism, a pipeline stage (``pg_collection.pp`` of more than one rank) of a model
    configured to add its load-balancing loss (``config.output_router_logits`` with a
    nonzero ``router_aux_loss_coef``: no stage computes the model's loss, so the aux loss
    would be dropped without a word). Nothing here communicates; collectives per MoE layer
    and step are :mod:`mc_moe.dispatcher`'s.
    """
    dense, experts = _check(module, plan, ep_plan, config, pg_collection, sequence_dim)
    check_flag("global_aux_loss", global_aux_loss)
    _refuse_aux_loss_in_stage(module, experts, pg_collection)
    _refuse_titan_expert_bias(module, experts)
    expert_bias = bool(config_value(config, "moe_router_enable_expert_bias"))
    if expert_bias and not routers_with_bias(module):
        enable_expert_bias(module)  # raises, naming the flag, before anything changed
    aux_routers = _aux_routers(module, experts, pg_collection) if global_aux_loss else None
    if dense:
        parallelize_dense(
            module,
            dense,  # type: ignore[arg-type]  # values checked by mc_tp_layers.parallelize
            config=config,
            pg_collection=pg_collection,
            sequence_dim=sequence_dim,
        )
    tp_size = mg.group_size(pg_collection.require("tp", "parallelize"))
    for found in experts:
        shard_experts(found.module, found.layout, pg_collection, tp_size=tp_size)
    if expert_bias:
        enable_expert_bias(module)
    if aux_routers:
        use_global_aux_loss(module, aux_routers, pg_collection, sequence_dim)
    param_attrs.record_marks(module)  # readers after FSDP2's fully_shard find the marks
    record_config(module, config)
    return module


def _refuse_aux_loss_in_stage(
    module: torch.nn.Module, experts: list[_Experts], pgc: mg.ProcessGroupCollection
) -> None:
    """A pipeline stage runs its blocks on hidden states and returns hidden states (or
    logits): ``transformers`` adds ``router_aux_loss_coef · aux`` only where it computes the
    loss from ``labels``, which no stage does, and its ``aux`` would pool this stage's
    layers only. A model asking for that loss would train without it, silently."""
    if not experts or pgc.pp is None or mg.group_size(pgc.pp) == 1:
        return
    coef = getattr(module, "router_aux_loss_coef", 0.0)
    wants = bool(getattr(getattr(module, "config", None), "output_router_logits", False))
    if wants and isinstance(coef, (int, float)) and coef != 0:
        raise InputValueError(
            f"{type_name(module)} has config.output_router_logits=True (router_aux_loss_coef="
            f"{coef}) and pg_collection.pp has {mg.group_size(pgc.pp)} ranks: no pipeline stage "
            "computes transformers' load-balancing loss (a stage returns hidden states, the "
            "model adds the aux loss only to a loss it computes from labels), so it would be "
            "dropped silently. Set model.config.output_router_logits=False to train without "
            "it, or train at pipeline_model_parallel_size=1 (mc_moe then computes it on the "
            "global batch)"
        )


def _refuse_titan_expert_bias(module: torch.nn.Module, experts: list[_Experts]) -> None:
    """torchtitan's MoE module keeps its ``expert_bias`` (``load_balance_coeff`` set) moved
    by torchtitan's trainer, in an optimizer pre-hook mc does not run: under mc it would
    stay at its first value while the model routes by it, silently unbalanced."""
    for found in experts:
        parent_name = found.name.rpartition(".")[0]
        parent = module.get_submodule(parent_name) if parent_name else module
        if found.layout.grouped and getattr(parent, "expert_bias", None) is not None:
            raise InputValueError(
                f"{parent_name or type_name(module)}.expert_bias is set (load_balance_coeff="
                f"{getattr(parent, 'load_balance_coeff', None)!r}): torchtitan moves it in its "
                "trainer's optimizer pre-hook, which mc does not run, so it would never move; "
                "build the model with load_balance_coeff=None"
            )


def _aux_routers(
    module: torch.nn.Module, experts: list[_Experts], pgc: mg.ProcessGroupCollection
) -> list[torch.nn.Module] | None:
    """The router of each MoE layer when ``module`` adds ``transformers``' load-balancing
    loss (``router_aux_loss_coef``) and a one-stage pipeline computes it; else None. A
    router is the sibling of the experts module whose ``weight`` is ``[E, H]``."""
    if not experts or not hasattr(module, "router_aux_loss_coef"):
        return None
    if pgc.pp is not None and mg.group_size(pgc.pp) > 1:
        return None  # a pipeline stage does not compute the model's loss
    routers = []
    for found in experts:
        parent_name = found.name.rpartition(".")[0]
        parent = module.get_submodule(parent_name) if parent_name else module
        shape = (found.layout.num_experts, found.layout.hidden)
        near = [
            child
            for child in parent.children()
            if child is not found.module
            and isinstance(getattr(child, "weight", None), torch.Tensor)
            and tuple(getattr(child, "weight").shape) == shape  # noqa: B009
        ]
        if len(near) != 1:
            raise InputValueError(
                f"{parent_name} holds {len(near)} modules with a router weight of shape "
                f"{shape} beside {found.name}; the global-batch load-balancing loss reads the "
                "one router's logits: pass global_aux_loss=False"
            )
        routers.append(near[0])
    return routers


def _check(
    module: object,
    plan: object,
    ep_plan: object,
    config: object,
    pgc: object,
    sequence_dim: object,
) -> tuple[dict[str, object], list[_Experts]]:
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    if not isinstance(pgc, mg.ProcessGroupCollection):
        raise InputTypeError(
            "pg_collection must be a mc_groups.ProcessGroupCollection (its ep / expt_tp groups "
            f"split the experts), got {type_name(pgc)}"
        )
    check_int("sequence_dim", sequence_dim, minimum=0, maximum=1)
    check_config(config, "mc_moe.parallelize", required=("sequence_parallel",))
    tp_plan = _mapping("plan", plan)
    eps = _mapping("ep_plan", ep_plan)
    for name, entries in (("plan", tp_plan), ("ep_plan", eps)):
        for pattern, value in entries.items():
            if isinstance(value, str) and value in REMOVED_STYLES:
                raise InputValueError(
                    f"{name}[{pattern!r}] = {value!r}: transformers removed this style; the "
                    "model's own router routes the tokens. Drop the entry and split the experts "
                    "with 'ep_dispatch_experts' (ep_plan)"
                )
    tp_moe, ep_moe = moe_entries(tp_plan, module), moe_entries(eps, module)
    not_moe = {p: v for p, v in eps.items() if p not in ep_moe}
    if not_moe:
        raise InputValueError(
            f"ep_plan entries {not_moe} name no experts module or expert parameter; an "
            "ep_plan holds 'ep_dispatch_experts' (the experts module) and 'grouped_gemm' (its "
            "3-D parameters)"
        )
    ep_size = mg.group_size(pgc.require("ep", "parallelize (expert parallelism)"))
    etp_size = mg.group_size(pgc.require("expt_tp", "parallelize (expert parallelism)"))
    tp_size = mg.group_size(pgc.require("tp", "parallelize"))
    by_ep = _experts_of(module, ep_moe, "ep_plan")
    by_tp = _experts_of(module, tp_moe, "plan")
    if ep_size > 1 and not by_ep:
        raise InputValueError(
            f"pg_collection.ep has {ep_size} ranks but ep_plan={ep_plan!r} splits no experts "
            "module over it; pass ep_plan=model.ep_plan (transformers' expert plan), or build "
            "the groups with expert_model_parallel_size=1"
        )
    found = {**by_tp, **by_ep}
    experts = [_read(name, mod, ep_size, etp_size) for name, mod in found.items()]
    if experts and tp_size > 1 and not getattr(config, "sequence_parallel", False):
        raise InputValueError(
            f"{experts[0].name}: MoE layers under tensor parallelism (tp={tp_size}) need "
            "config.sequence_parallel=True (as Megatron-Core: each TP rank routes its part of the "
            "sequence) and the plan of mc_moe.sequence_parallel_plan(model)"
        )
    dense = {p: v for p, v in tp_plan.items() if p not in tp_moe}
    return _drop_unmatched(module, dense, bool(experts)), experts


def _mapping(name: str, plan: object) -> dict[str, object]:
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise InputTypeError(
            f"{name} must be a mapping of module-name patterns to styles (model.tp_plan / "
            f"model.ep_plan) or None, got {type_name(plan)}"
        )
    return dict(plan)


def _experts_of(
    module: torch.nn.Module, entries: Mapping[str, object], plan_name: str
) -> dict[str, torch.nn.Module]:
    """The experts modules ``entries`` name (a module entry, or the owner of a parameter
    entry), by name; an entry matching nothing or a style on the wrong kind is an error."""
    modules = dict(module.named_modules())
    params = [n for n, _ in module.named_parameters()]
    found: dict[str, torch.nn.Module] = {}
    for pattern, value in entries.items():
        if isinstance(value, str) and value in EXPERTS_STYLES:
            hits = [n for n in modules if n and fnmatchcase(n, pattern)]
            for name in hits:
                found[name] = modules[name]
        elif isinstance(value, str) and value in PARAM_STYLES:
            hits = [p for p in params if fnmatchcase(p, pattern)]
            for name in hits:
                owner = name.rpartition(".")[0]
                found.setdefault(owner, modules[owner])
        else:
            raise InputValueError(
                f"{plan_name}[{pattern!r}] = {value!r} names an expert parameter; expert "
                f"parameters take {sorted(PARAM_STYLES)} (the experts module: "
                f"{sorted(EXPERTS_STYLES)})"
            )
        if not hits:
            raise InputValueError(
                f"{plan_name}[{pattern!r}] = {value!r} matches nothing in {type_name(module)}; "
                "fix the pattern or drop the entry"
            )
    return found


def _read(name: str, mod: torch.nn.Module, ep: int, etp: int) -> _Experts:
    layout = read_experts(mod, name)
    if layout.num_experts % ep:
        raise InputValueError(
            f"{name}: {layout.num_experts} experts cannot be split over an EP group of {ep} "
            "ranks (whole experts per rank); choose expert_model_parallel_size dividing "
            f"{layout.num_experts}"
        )
    if layout.intermediate % etp:
        raise InputValueError(
            f"{name}: expert width {layout.intermediate} is not divisible by the expert TP "
            f"size {etp}; choose expert_tensor_parallel_size dividing it"
        )
    return _Experts(name, mod, layout)


def _drop_unmatched(
    module: torch.nn.Module, dense: dict[str, object], has_experts: bool
) -> dict[str, object]:
    """Dense entries matching no module are dropped with one warning in a MoE model (their
    layers are MoE layers); elsewhere ``mc_tp_layers.parallelize`` refuses them."""
    if not has_experts:
        return dense
    names = [n for n, _ in module.named_modules() if n]
    unmatched = [p for p in dense if not any(fnmatchcase(n, p) for n in names)]
    if unmatched:
        warnings.warn(
            f"plan entries {unmatched} match no module of {type_name(module)}: its layers are "
            "MoE layers; skipped, as transformers skips them",
            MoEPlanWarning,
            stacklevel=3,
        )
    return {p: v for p, v in dense.items() if p not in unmatched}


def sequence_parallel_plan(
    model: torch.nn.Module,
    base: Mapping[str, object] | None = None,
    *,
    ep_plan: Mapping[str, object] | None = None,
    layers: str | None = None,
    split_qk_norms: bool = True,
) -> dict[str, object]:
    """The plan that runs a MoE model tensor-parallel with sequence parallelism:
    ``parallelize(model, sequence_parallel_plan(model), ep_plan=model.ep_plan, config=cfg,
    pg_collection=pgc)`` with ``config.sequence_parallel=True``.

    The dense entries of ``base`` (default ``model.tp_plan``; entries matching nothing in a
    model whose layers are MoE dropped with one :class:`MoEPlanWarning`) go through
    :func:`mc_tp_layers.sequence_parallel_plan` with the experts modules (named by ``base``
    or ``ep_plan``, default ``model.ep_plan``) as ``sequence_local``: each MoE block runs on
    this rank's part of the sequence (as Megatron-Core's MoE layer under sequence
    parallelism), its router tagged ``sequence_parallel`` (grads summed over TP by
    ``finalize_model_grads``), its shared experts gathered like an MLP; attention and
    norms as in a dense decoder (DeepSeek-V3's latent attention split by heads). The expert
    entries of ``base`` are returned unchanged. No communication; the model is untouched.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type_name(model)}")
    _refuse_attention_sinks(model)
    own = base if base is not None else getattr(model, "tp_plan", None)
    tp_plan = _mapping("base", own)
    eps = _mapping("ep_plan", ep_plan if ep_plan is not None else getattr(model, "ep_plan", None))
    tp_moe = moe_entries(tp_plan, model)
    experts = {
        **_experts_of(model, tp_moe, "base"),
        **_experts_of(model, moe_entries(eps, model), "ep_plan"),
    }
    dense = {p: v for p, v in tp_plan.items() if p not in tp_moe}
    dense = _drop_unmatched(model, dense, bool(experts))
    plan: dict[str, object] = dict(
        dense_sequence_parallel_plan(
            model,
            dense if own is not None else None,  # type: ignore[arg-type]  # checked there
            layers=layers,
            split_qk_norms=split_qk_norms,
            sequence_local=sorted(experts),
        )
    )
    plan.update(tp_moe)
    return plan


def _refuse_attention_sinks(model: torch.nn.Module) -> None:
    """gpt-oss's attention holds one learned sink per head (``sinks``) and its ``tp_plan``
    keeps attention whole: splitting the heads would need that parameter split too."""
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            raise InputValueError(
                f"{name} ({tuple(param.shape)}) is one value per attention head of "
                f"{type_name(model)} (gpt-oss), whose tp_plan keeps attention whole: mc splits "
                "no per-head parameter, so this model runs at tensor-parallel size 1 (experts "
                "over ep and expt_tp, data parallelism): build the groups with "
                "tensor_model_parallel_size=1"
            )
