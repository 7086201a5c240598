"""``finalize_model_grads``: after the last backward of a global batch, before the optimizer
step; each of its steps under Megatron-Core's name, in Megatron's order
(``megatron/core/distributed/finalize_model_grads.py``).

The steps of one call (T: the group's size; ``data``: ``dp_cp``, or ``dp_cp_gtp_remat``
under gtp_remat, every rank that sees different data)::

     1. every chunk's finish_grad_sync(force_all_reduce)   DDP's groups   always
     2. conditional-embedder grads    SUM          pp          has_cond_embedder, pp > 1
     3. Flextron router grads         SUM          pp          flextron, pp > 1
     4. non-tensor-parallel grads     SUM, AVG     tp          tp > 1
     5. replicated grads              AVG (SUM)    gtp_remat, expt_gtp_remat   size > 1
     6. shared word-embedding grad    SUM          embd        first and last stage, T > 1
     7. position-embedding grad       SUM          pos_embd    member ranks, T > 1
     8. router expert bias            SUM tokens   tp_dp_cp    moe_router_enable_expert_bias
     9. router qb_beta                AVG          data        quantile_balancing
    10. reset_model_temporary_tensors              (none)
    11. num_tokens                    broadcast    pp (from the last rank)   per-token loss
                                      SUM          data        then scale_gradients(1/max(n, 1))
    12. every chunk's mark_grads_finalized()       (none)

A grad is ``param.main_grad`` when the param has that attribute, else ``param.grad``; the
grads of one step and dtype travel as one flat all-reduce. What the steps compute:

- 2, 3: params on every (virtual) pipeline stage marked ``pipeline_parallel`` (conditional
  embedders) or ``flextron_router_pp_sync``: ``g ← Σ_pp Σ_local chunks g`` per name.
- 4: ``g ← (1/T) Σ_tp g`` for params marked ``average_gradients_across_tp_domain`` (a full
  grad on each tp rank; this mark wins, as in Megatron); ``g ← Σ_tp g`` for params marked
  ``sequence_parallel`` under ``config.sequence_parallel``, named ``*q_layernorm*`` /
  ``*k_layernorm*`` under ``config.qk_layernorm``, or marked
  ``sum_gradients_across_tp_domain`` (mc's: a partial sum over tp without sequence
  parallelism, Megatron-LM #7452 row 11). Only ``sequence_parallel`` with the config's off is
  an error (Megatron would leave the grad unreduced without a word).
- 5: DDP reduced only the replicate axis of replicate × gtp_remat; params not
  gtp_remat-sharded need ``g ← AVG_gtp g`` (grads independent of how the ranks split), or
  ``Σ_gtp`` under per-token loss (step 11 counts the gtp_remat peers' tokens). Dense params
  over ``gtp_remat``, expert params (``allreduce=False``) over ``expt_gtp_remat``.
- 6, 7: a weight on two stages (tied input/output embedding; encoder and decoder position
  embeddings): ``g ← Σ g``. It is in ``model[0]`` on the first stage, ``model[-1]`` on the
  last, and on a middle stage in ``model[-1]`` with MTP layers; a model without
  ``share_embeddings_and_output_weights`` marks it ``shared_embedding``.
- 8: training-mode routers with ``expert_bias`` and ``local_tokens_per_expert`` (bias not
  frozen): ``t ← Σ local_tokens_per_expert`` (stacked: one all-reduce),
  ``bias ← bias + rate · sign(mean_e(t) − t)`` (aux-loss-free balancing, arXiv:2408.15664).
- 9: training-mode routers with ``qb_beta``, ``qb_beta_accum``, ``qb_beta_count``:
  ``q ← AVG (accum / max(count, 1))``, ``b ← ema · qb_beta + (1 − ema) · q``,
  ``qb_beta ← b − mean_e(b)``.
- 10: ``local_tokens_per_expert`` (with expert bias), ``qb_beta_accum`` / ``qb_beta_count``
  zeroed, ``reset_global_aux_loss_tracker()`` called (global aux loss); eval mode included.

**Checks.** Before step 1, on each rank, without communicating: the model list, the groups
of the steps that run (checked where they enter, then trusted), ``num_tokens`` (one count,
an exact dtype, the model's device), the embedding weights, the routers' state, no chunk
finalized twice, with tp > 1 the params' marks; ``model[0]`` keeps its config's checked
settings until the config object or one of those fields changes. A missing, NaN, ±inf or
negative ``num_tokens`` travels through the token reduction as NaN: every rank raises the
same ``ValueError`` (the step's one device-to-host read). Another check failing on one rank
only raises there, its peers waiting in their next collective until the group's timeout,
unless ``peer_checks=True`` (:func:`mc_groups.fail_together`: one world exchange and, on
GPUs, one device synchronisation per step more than Megatron's; off by default).

**FSDP2 chunks** (a module under ``fully_shard`` with no ``finish_grad_sync``, torchtitan's
way) skip step 1 (FSDP2 reduced in backward); :mod:`mc_finalize._fsdp2` restores their marks
and checks their meshes before any collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, TypeGuard, cast

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize import _fsdp2
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import check_flag, check_optional_group, check_tensor, type_name
from mc_groups.collection import MissingGroupError, collection_or_default
from mc_groups.comm.collectives import all_reduce_flat
from mc_groups.config import TransformerConfigLike, check_config, config_value, recorded_config
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["ModelChunk", "finalize_model_grads", "reset_model_temporary_tensors"]

Param = torch.nn.Parameter
Group = dist.ProcessGroup
WeightGetter = Callable[[object], Param | None]


class ModelChunk(Protocol):
    """One (virtual) pipeline chunk on this rank: mc-ddp's or Megatron's DDP wrapper, or any
    module with these methods (``scale_gradients`` only with per-token loss); routers are
    found through ``modules()`` when the chunk has it."""

    @property
    def config(self) -> TransformerConfigLike:
        """The chunk's config (finalize reads ``model[0].config``)."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Finish the data-parallel grad reduction of this chunk."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """``grad ← scaling_factor · grad`` for every grad of this chunk."""

    def named_parameters(self) -> Iterator[tuple[str, Param]]:
        """``(name, param)`` pairs; names match across pipeline ranks and chunks."""

    def parameters(self) -> Iterator[Param]:
        """Every parameter of the chunk, each once."""


# ------------------------------------------------------------------ grads, DTensor grads


def _get_main_grad_attr(param: Param) -> str:
    """``"main_grad"`` when ``param`` has that attribute, else ``"grad"``."""
    check_tensor("param", param)
    return param_attrs.MAIN_GRAD if param_attrs.has_main_grad(param) else "grad"


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (:func:`mc_groups.dtensors.full_tensor`: recorded, a
    ``Partial`` placement refused) with its attributes; any other tensor unchanged."""
    check_tensor("tensor", tensor)
    if not dtensors.is_dtensor(tensor):
        return tensor
    full = dtensors.full_tensor(tensor, "unshard DTensor grad")
    vars(full).update(vars(tensor))
    return full


def _reshard_if_dtensor(
    tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor
) -> torch.Tensor:
    """``tensor_to_shard`` split like the DTensor ``reference_tensor`` (this rank's
    ``torch.chunk`` slice, no communication), else ``reference_tensor`` (reduced in place)."""
    check_tensor("tensor_to_shard", tensor_to_shard)
    check_tensor("reference_tensor", reference_tensor)
    if not dtensors.is_dtensor(reference_tensor):
        return reference_tensor
    with torch.no_grad():
        sharded = dtensors.distribute_like(tensor_to_shard, reference_tensor)
    vars(sharded).update(vars(reference_tensor))
    return sharded


# (param, grad attribute, the DTensor grad to reshard like or None, the plain tensor reduced)
_GradView = tuple[Param, str, torch.Tensor | None, torch.Tensor]


def _grad_views(params: Sequence[Param], shard_group: Group | None = None) -> list[_GradView]:
    """The grads (``main_grad`` or ``grad``) of the params that have one, unsharded, or as
    the local shard when ``shard_group``'s peers hold the same one (``_fsdp2``)."""
    views: list[_GradView] = []
    for param in params:
        attr = _get_main_grad_attr(param)
        grad = getattr(param, attr)
        if grad is None:
            continue
        if not dtensors.is_dtensor(grad):
            views.append((param, attr, None, grad))
        elif shard_group is not None and _fsdp2.local_reduction(grad, shard_group):
            views.append((param, attr, None, grad.to_local()))
        else:
            views.append((param, attr, grad, _unshard_if_dtensor(grad)))
    return views


def _commit(views: Sequence[_GradView]) -> None:
    """Store each reduced grad back on its param (resharded when it was unsharded)."""
    for param, attr, like, full in views:
        if like is not None:
            setattr(param, attr, _reshard_if_dtensor(full, like))


def _allreduce_grads(
    params: Sequence[Param], group: Group | None, op: mg.ReduceOp, label: str, shards: bool = False
) -> None:
    """``g ← op over group of g`` for every param's grad: one flat all-reduce per dtype
    (Megatron's flatten / unflatten), nothing on one rank; ``shards``: see ``_grad_views``."""
    if _multi(group) and (views := _grad_views(params, group if shards else None)):
        all_reduce_flat([full for *_, full in views], group, op=op, label=label)
        _commit(views)


# ------------------------------------------------------------------ arguments


class _Settings(NamedTuple):
    """The config fields the steps read, checked, Megatron's default where a config lacks
    one (:func:`mc_groups.config.config_value`)."""

    sequence_parallel: bool
    calculate_per_token_loss: bool
    qk_layernorm: bool
    mtp_num_layers: int | None
    has_cond_embedder: bool
    flextron: bool
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_router_load_balancing_type: tuple[str, ...]
    moe_router_quantile_balancing_ema: float
    gtp_remat_size: int
    expert_gtp_remat_size: int

    @classmethod
    def of(cls, config: object, what: str, *, per_token: bool = False) -> _Settings:
        """``finalize_model_grads`` needs ``calculate_per_token_loss`` too, which Megatron's
        ``ModelParallelConfig`` lacks (the steps alone read its default)."""
        required = ("sequence_parallel", "calculate_per_token_loss")[: 2 if per_token else 1]
        checked = check_config(config, what, required=required)
        return cls(*(config_value(checked, name) for name in cls._fields))

    @classmethod
    def kept(cls, chunk: object, config: object) -> _Settings:
        """Checked once per config: ``model[0]`` keeps them, read again only when the config
        object or one of the fields changed (a chunk without ``__dict__``: every call)."""
        raw = tuple(getattr(config, name, _ABSENT) for name in cls._fields)
        kept = getattr(chunk, "__dict__", {}).get(_SETTINGS)
        if isinstance(kept, tuple) and kept[0] is config and kept[1] == raw:
            return cast(_Settings, kept[2])
        settings = cls.of(config, "finalize_model_grads", per_token=True)
        if hasattr(chunk, "__dict__"):
            vars(chunk)[_SETTINGS] = (config, raw, settings)
        return settings

    @property
    def has_mtp(self) -> bool:
        return (self.mtp_num_layers or 0) > 0

    def balancing(self, kind: str) -> bool:
        return kind in self.moe_router_load_balancing_type


_SETTINGS = "_mc_finalize_settings"  # model[0]'s (config, its raw fields, _Settings)
_ABSENT = object()


def _as_chunks(
    model: object, methods: Sequence[str] = ("named_parameters", "parameters")
) -> list[ModelChunk]:
    """``model`` as a non-empty list of distinct chunks that each have ``methods``."""
    if isinstance(model, torch.nn.Module) or not isinstance(model, list | tuple):
        raise InputTypeError(
            f"model must be a list of model chunks (one per virtual pipeline stage), got "
            f"{type_name(model)}; pass [model] for a single chunk"
        )
    if not model:
        raise InputValueError("model=[] holds no model chunk; pass the chunks this rank owns")
    for index, chunk in enumerate(model):
        missing = [m for m in methods if not callable(getattr(chunk, m, None))]
        if "finish_grad_sync" in missing and dtensors.is_fsdp_module(chunk):
            missing.remove("finish_grad_sync")  # FSDP2 reduced its grads in backward
        if missing:
            raise InputTypeError(
                f"model[{index}] ({type_name(chunk)}) lacks {missing}; pass a DDP-wrapped "
                "module, a module under FSDP2's fully_shard, or an object with those methods"
            )
        first = next(i for i, other in enumerate(model) if other is chunk)
        if first != index:
            raise InputValueError(
                f"model[{index}] is the same object as model[{first}]: pass each chunk once "
                "(its grads would be reduced and scaled twice)"
            )
    return list(model)


def _group(
    group: Group | None, arg: str, field: str, what: str, *, required: bool = True
) -> Group | None:
    """``group`` (argument ``arg``), else field ``field`` of the registered default
    collection (None there: a MissingGroupError when ``required``)."""
    if check_optional_group(arg, group, what=what) is not None:
        return group
    pgc = collection_or_default(None, what, explicit=f"{arg}=pg_collection.{field}")
    return pgc.require(field, what) if required else cast("Group | None", getattr(pgc, field))


def _fsdp2_chunk(chunk: object) -> bool:
    """A chunk without ``finish_grad_sync``: one under ``fully_shard`` (``_as_chunks``)."""
    return not callable(getattr(chunk, "finish_grad_sync", None))


def _multi(group: Group | None) -> TypeGuard[Group]:
    """``group`` has a peer (a group checked where it entered: argument or collection)."""
    return group is not None and group.size() > 1


def _modules(chunk: object) -> Iterator[object]:
    """Every submodule of the chunk (nothing when the chunk has no ``modules()``)."""
    modules = getattr(chunk, "modules", None)
    if callable(modules):
        yield from modules()


# ------------------------------------------------------------------ the steps, in Megatron's order


def _allreduce_conditional_embedding_grads(
    model: Sequence[ModelChunk], config: TransformerConfigLike, pp_group: Group | None = None
) -> None:
    """Step 2 alone, over pp (None: the default collection's)."""
    what = "_allreduce_conditional_embedding_grads"
    mark, label = param_attrs.PIPELINE_PARALLEL, "conditional embedding grads"
    _replicated_step(model, config, pp_group, what, "has_cond_embedder", mark, label)


def _replicated_step(
    model: object, config: object, pp_group: object, what: str, switch: str, mark: str, label: str
) -> None:
    """Steps 2 and 3 alone: check their arguments, then reduce when the switch is on."""
    chunks = _as_chunks(model)
    pp = check_optional_group("pp_group", pp_group, what=what)
    if getattr(_Settings.of(config, what), switch):
        _reduce_over_pp(_by_name(chunks, mark), _group(pp, "pp_group", "pp", what), label)


def _by_name(chunks: Sequence[ModelChunk], mark: str) -> list[list[Param]]:
    """The params marked ``mark`` that require grad, grouped by name (one per chunk)."""
    copies: dict[str, list[Param]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad and getattr(param, mark, False):
                copies.setdefault(name, []).append(param)
    return list(copies.values())


def _reduce_over_pp(copies: list[list[Param]], pp: Group | None, label: str) -> None:
    """``g ← Σ_pp Σ_local g`` for every copy: the local copies summed into the first, the
    firsts all-reduced, the result copied back to the other local copies."""
    if not _multi(pp) or not (by_name := [local for local in map(_grad_views, copies) if local]):
        return
    firsts = [local[0][3] for local in by_name]
    for first, local in zip(firsts, by_name, strict=True):
        for *_, other in local[1:]:
            first.add_(other)
    all_reduce_flat(firsts, pp, op=mg.ReduceOp.SUM, label=label)
    for first, local in zip(firsts, by_name, strict=True):
        for *_, other in local[1:]:
            other.copy_(first)
        _commit(local)


def _get_shared_word_embedding_weight(
    model_module: object, config: TransformerConfigLike
) -> Param | None:
    """The word-embedding / output weight shared across stages: a Megatron language model's
    ``shared_embedding_or_output_weight()``, else the first param marked ``shared_embedding``."""
    has_mtp = _Settings.of(config, "_get_shared_word_embedding_weight").has_mtp
    return _shared_weight(model_module, has_mtp)


def _shared_weight(model_module: object, has_mtp: bool) -> Param | None:
    if not hasattr(model_module, "share_embeddings_and_output_weights"):
        parameters = getattr(model_module, "parameters", None)
        if not callable(parameters):
            raise InputTypeError(
                f"model_module={model_module!r} must be the wrapped model (with parameters())"
            )
        return next((p for p in parameters() if param_attrs.is_shared_embedding(p)), None)
    if not (model_module.share_embeddings_and_output_weights or has_mtp):
        return None
    weight: Param | None = model_module.shared_embedding_or_output_weight()  # type: ignore[attr-defined]
    return weight


def _get_position_embedding_weight(model_module: object) -> Param:
    """``model_module.position_embeddings.weight``; a ValueError when it has none."""
    weight = getattr(getattr(model_module, "position_embeddings", None), "weight", None)
    if not isinstance(weight, Param):
        raise InputValueError(
            f"{type_name(model_module)} has no position_embeddings.weight but is in a "
            "position-embedding group; give it position_embeddings or leave pos_embd unset"
        )
    return weight


def _allreduce_word_embedding_grads(
    model: Sequence[ModelChunk],
    config: TransformerConfigLike,
    embd_group: Group | None = None,
    pp_group: Group | None = None,
) -> None:
    """Step 6 alone: the shared word-embedding grad over the first and last stage. Both
    groups None: the default collection's (``embd`` None: this rank holds no copy)."""
    what = "_allreduce_word_embedding_grads"
    has_mtp = _Settings.of(config, what).has_mtp  # checked also where nothing is reduced
    if embd_group is None and pp_group is None:
        embd_group = _group(None, "embd_group", "embd", what, required=False)
        pp_group = _group(None, "pp_group", "pp", what, required=False)
    getter = partial(_shared_weight, has_mtp=has_mtp)  # the config checked once, above
    _allreduce_embedding_grad(model, embd_group, pp_group, getter, config=config)


def _allreduce_embedding_grad(
    model: Sequence[ModelChunk],
    embd_group: Group | None,
    pp_group: Group | None,
    weight_getter: WeightGetter,
    skip_if_none: bool = True,
    config: TransformerConfigLike | None = None,
) -> None:
    """SUM the grad of ``weight_getter(model_module)`` over ``embd_group`` (steps 6, 7: the
    module notes say which chunk); a getter's None skips with ``skip_if_none`` (else a
    ValueError), a frozen weight skips, a None or 1-rank group does nothing."""
    what = "_allreduce_embedding_grad"
    check_optional_group("embd_group", embd_group, what=what)
    check_optional_group("pp_group", pp_group, what=what)
    if not callable(weight_getter):
        raise InputTypeError(f"weight_getter={weight_getter!r} must be callable (module → weight)")
    check_flag("skip_if_none", skip_if_none)
    has_mtp = config is not None and _Settings.of(config, what).has_mtp
    chunks = _as_chunks(model)
    weight = _embedding_weight(chunks, embd_group, pp_group, weight_getter, has_mtp, skip_if_none)
    _allreduce_grads(weight, embd_group, mg.ReduceOp.SUM, "embedding grads")


def _embedding_weight(
    chunks: Sequence[ModelChunk],
    group: Group | None,
    pp_group: Group | None,
    weight_getter: WeightGetter,
    has_mtp: bool,
    skip_if_none: bool,
) -> list[Param]:
    """The weight this rank reduces over ``group`` (none: nothing to do)."""
    if not _multi(group):
        return []
    if pp_group is None:
        raise MissingGroupError("an embedding group needs pp_group (pass pg_collection.pp)")
    stage, stages = mg.group_rank(pp_group), mg.group_size(pp_group)
    module: object = chunks[-1] if stage > 0 and (stage == stages - 1 or has_mtp) else chunks[0]
    inner = getattr(module, "module", None)  # DDP, Float16Module: the model is in .module
    while not hasattr(module, "pre_process") and inner is not None:
        module, inner = inner, getattr(inner, "module", None)
    weight = weight_getter(module)
    if weight is None and not skip_if_none:
        raise InputValueError(
            "weight_getter returned None on a member of an embedding group; every member must "
            "hold the weight (or pass skip_if_none=True)"
        )
    return [] if weight is None else [weight]


def _allreduce_position_embedding_grads(
    model: Sequence[ModelChunk],
    config: TransformerConfigLike,
    pos_emb_group: Group | None,
    pp_group: Group | None,
) -> None:
    """Step 7 alone (a member without the weight: a ValueError; a None group: no copy here)."""
    what = "_allreduce_position_embedding_grads"
    _Settings.of(config, what)
    check_optional_group("pos_emb_group", pos_emb_group, what=what)
    weight = _get_position_embedding_weight
    _allreduce_embedding_grad(model, pos_emb_group, pp_group, weight, skip_if_none=False)


def _allreduce_router_grads(
    model: Sequence[ModelChunk], config: TransformerConfigLike, pp_group: Group | None = None
) -> None:
    """Step 3 alone, over pp (None: the default collection's)."""
    what, mark = "_allreduce_router_grads", param_attrs.FLEXTRON_ROUTER_PP_SYNC
    _replicated_step(model, config, pp_group, what, "flextron", mark, "router grads")


def reset_model_temporary_tensors(
    config: TransformerConfigLike, model: Sequence[ModelChunk]
) -> None:
    """Step 10: reset every module's per-global-batch accumulators (no communication)."""
    _reset(_as_chunks(model), _Settings.of(config, "reset_model_temporary_tensors"))


def _reset(chunks: Sequence[ModelChunk], settings: _Settings) -> None:
    expert_bias = settings.moe_router_enable_expert_bias
    global_aux_loss = settings.balancing("global_aux_loss")
    for chunk in chunks:
        for module in _modules(chunk):
            if expert_bias and _has(module, "local_tokens_per_expert"):
                _tensor(module, "local_tokens_per_expert").zero_()
            reset = getattr(module, "reset_global_aux_loss_tracker", None)
            if global_aux_loss and callable(reset):
                reset()
            if _has(module, "qb_beta_accum"):
                _tensor(module, "qb_beta_accum").zero_()
                count = getattr(module, "qb_beta_count", None)
                if isinstance(count, torch.Tensor):
                    count.zero_()


def _update_router_expert_bias(
    model: Sequence[ModelChunk], config: TransformerConfigLike, tp_dp_cp_group: Group | None = None
) -> None:
    """Step 8 alone: expert biases from the tokens per expert over TP×DP×CP (None: the
    default collection's ``tp_dp_cp``); the counters are left for the reset."""
    what, setting = "_update_router_expert_bias", "moe_router_bias_update_rate"
    chunks, rate, group = _router_step(model, config, setting, tp_dp_cp_group, "tp_dp_cp", what)
    _update_expert_bias(_bias_routers(chunks), rate, group)


def _router_step(
    model: object, config: object, setting: str, group: Group | None, field: str, what: str
) -> tuple[list[ModelChunk], float, Group]:
    """Steps 8 and 9 alone: the chunks, the config's ``setting`` and the group (argument
    ``<field>_group``, else the default collection's ``field``), checked."""
    chunks = _as_chunks(model)
    value = getattr(_Settings.of(config, what), setting)
    return chunks, value, cast(Group, _group(group, f"{field}_group", field, what))


def _bias_routers(chunks: Sequence[ModelChunk]) -> list[object]:
    """The training routers whose expert bias moves (not ``frozen_expert_bias``)."""
    return _routers(chunks, "local_tokens_per_expert", "expert_bias", frozen="frozen_expert_bias")


def _update_expert_bias(routers: Sequence[object], rate: float, group: Group) -> None:
    if not routers:
        return  # hybrid models: dense layers only on this stage
    with torch.no_grad():
        tokens = torch.stack([_tensor(m, "local_tokens_per_expert") for m in routers])
        mg.all_reduce(tokens, group, op=mg.ReduceOp.SUM, label="router expert bias")
        counts = tokens.to(torch.float64)  # only the sign matters: large counts compare exactly
        steps = torch.sign(counts.mean(-1, keepdim=True) - counts) * rate
        for router, step in zip(routers, steps, strict=True):
            bias = _tensor(router, "expert_bias")
            bias.add_(step.to(bias.dtype))


def _update_router_qb_beta(
    model: Sequence[ModelChunk], config: TransformerConfigLike, dp_cp_group: Group | None = None
) -> None:
    """Step 9 alone: the quantile-balancing bias over DP×CP (None: the default collection's
    ``dp_cp``; finalize passes ``dp_cp_gtp_remat`` under gtp_remat); accumulators left."""
    what, setting = "_update_router_qb_beta", "moe_router_quantile_balancing_ema"
    chunks, ema, group = _router_step(model, config, setting, dp_cp_group, "dp_cp", what)
    _update_qb_beta(_quantile_routers(chunks), ema, group)


def _quantile_routers(chunks: Sequence[ModelChunk]) -> list[object]:
    return _routers(chunks, "qb_beta_accum", "qb_beta", "qb_beta_count")


def _update_qb_beta(routers: Sequence[object], ema: float, group: Group) -> None:
    if not routers:
        return
    with torch.no_grad():
        quantiles = []
        for router in routers:
            accum, count = _tensor(router, "qb_beta_accum"), _tensor(router, "qb_beta_count")
            quantiles.append(accum / count.clamp(min=1).to(accum.dtype))
        stacked = torch.stack(quantiles)
        mg.all_reduce(stacked, group, op=mg.ReduceOp.AVG, label="router qb_beta")
        for router, quantile in zip(routers, stacked, strict=True):
            beta = _tensor(router, "qb_beta")
            blended = ema * beta + (1.0 - ema) * quantile
            beta.copy_(blended - blended.mean(dim=-1, keepdim=True))


def _has(module: object, name: str) -> bool:
    # Hash routers define the attributes as None: they own no balancing state.
    return getattr(module, name, None) is not None


def _tensor(module: object, name: str) -> torch.Tensor:
    return check_tensor(f"{type_name(module)}.{name}", getattr(module, name))


def _routers(
    chunks: Sequence[ModelChunk], counts: str, bias: str, *more: str, frozen: str = ""
) -> list[object]:
    """The training-mode routers holding ``counts``, ``bias`` and ``more`` (``frozen`` not
    set), checked: each ``counts`` of its ``bias``'s shape and of one shape for all (one entry
    per expert; reduced stacked), a floating-point ``bias`` (an integer one rounds updates away)."""
    found: list[object] = []
    first: tuple[int, ...] | None = None
    names = (counts, bias, *more)
    for module in (m for chunk in chunks for m in _modules(chunk)):
        if not getattr(module, "training", True) or not all(_has(module, n) for n in names):
            continue
        if frozen and getattr(module, frozen, False):
            continue
        count, value, *_ = (_tensor(module, n) for n in names)
        name, first = type(module).__name__, first or tuple(count.shape)
        if count.shape != value.shape or tuple(count.shape) != first:
            raise InputValueError(
                f"{name}.{counts} has shape {tuple(count.shape)} but {name}.{bias} has "
                f"{tuple(value.shape)} (the first router's {counts}: {first}); every router "
                "needs one entry per expert in both, and the same number of experts"
            )
        if not value.is_floating_point():
            raise InputTypeError(f"{name}.{bias} has dtype {value.dtype}; make it floating-point")
        found.append(module)
    return found


def _allreduce_non_tensor_model_parallel_grads(
    model: Sequence[ModelChunk], config: TransformerConfigLike, tp_group: Group | None = None
) -> None:
    """Step 4 alone, over tp (None: the default collection's)."""
    what = "_allreduce_non_tensor_model_parallel_grads"
    chunks = _as_chunks(model)
    settings = _Settings.of(config, what)
    tp = _group(tp_group, "tp_group", "tp", what)
    sums, avgs = _tp_params(chunks, settings) if _multi(tp) else ([], [])
    _allreduce_grads(sums, tp, mg.ReduceOp.SUM, _TP_LABEL, shards=True)
    _allreduce_grads(avgs, tp, mg.ReduceOp.AVG, _TP_LABEL, shards=True)


_TP_LABEL = "non-tensor-parallel grads"

# Megatron keeps the old name as an alias for legacy callers.
_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


def _tp_params(
    chunks: Sequence[ModelChunk], settings: _Settings
) -> tuple[list[Param], list[Param]]:
    """The params whose grads step 4 sums and averages over tp, their marks checked (the
    SUM mark neither with the AVG mark nor on a TP shard; module notes for the rest)."""
    sequence_parallel, qk_layernorm = settings.sequence_parallel, settings.qk_layernorm
    sums: list[Param] = []
    avgs: list[Param] = []
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            summed = param_attrs.sums_grad_across_tp(param)
            averaged = param_attrs.averages_grad_across_tp(param)
            where = f"model[{index}] param '{name}'"
            if summed and averaged:
                raise InputValueError(
                    f"{where} is marked both sum_gradients_across_tp_domain and average_"
                    "gradients_across_tp_domain; keep the one that says how its grad was computed"
                )
            if summed and param_attrs.is_tensor_model_parallel(param):
                raise InputValueError(
                    f"{where} is a tensor-parallel shard marked sum_gradients_across_tp_domain "
                    "(a shard's grad is its own, not a partial sum); drop the mark"
                )
            if not param.requires_grad:
                continue
            marked_sp = param_attrs.is_sequence_parallel_param(param)
            if averaged:
                avgs.append(param)
            elif (
                summed
                or (sequence_parallel and marked_sp)
                or (qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
            ):
                sums.append(param)
            elif marked_sp:
                raise InputValueError(
                    f"{where} is marked sequence_parallel=True but config.sequence_parallel is "
                    "False: its grad would stay unreduced. A partial sum over tp without SP? "
                    "mc_groups.param_attrs.mark_sum_gradients_across_tp_domain(param); else "
                    "mark_sequence_parallel(param, False) or turn sequence parallelism on"
                )
    return sums, avgs


def _allreduce_replicated_grads_over_gtp_remat_group(
    model: Sequence[ModelChunk],
    gtp_remat_group: Group | None,
    egtp_remat_group: Group | None,
    calculate_per_token_loss: bool = False,
) -> None:
    """Step 5: dense params over ``gtp_remat_group``, expert params over
    ``egtp_remat_group`` (None or one rank: nothing)."""
    what = "_allreduce_replicated_grads_over_gtp_remat_group"
    chunks = _as_chunks(model)
    check_optional_group("gtp_remat_group", gtp_remat_group, what=what)
    check_optional_group("egtp_remat_group", egtp_remat_group, what=what)
    per_token = check_flag("calculate_per_token_loss", calculate_per_token_loss)
    _reduce_replicated(chunks, gtp_remat_group, egtp_remat_group, per_token)


def _reduce_replicated(
    chunks: Sequence[ModelChunk], gtp: Group | None, egtp: Group | None, per_token: bool
) -> None:
    for group, expert in ((gtp, False), (egtp, True)):
        params = [
            param
            for chunk in (chunks if _multi(group) else [])
            for param in chunk.parameters()
            if param.requires_grad
            and not param_attrs.is_gtp_weight_remat(param)
            and param_attrs.is_expert_param(param) == expert
        ]
        op = mg.ReduceOp.SUM if per_token else mg.ReduceOp.AVG
        _allreduce_grads(params, group, op, "replicated grads over gtp_remat")


# ------------------------------------------------------------------ finalize_model_grads


def finalize_model_grads(
    model: Sequence[ModelChunk | torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: mg.ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
    *,
    peer_checks: bool = False,
) -> None:
    """All-reduce every grad that still differs between ranks, then normalise by tokens
    (the steps of the module notes; every input checked before the first).

    Args:
        model: this rank's model chunks (one per virtual pipeline stage), in order: DDP
            wrappers (:class:`ModelChunk`) or modules under FSDP2's ``fully_shard``.
        num_tokens: this rank's non-padded token count, exactly with
            ``config.calculate_per_token_loss`` (the last stage's is used, the global count
            written back): one int32/int64/float32/float64 element on the model's device.
        pg_collection: the groups; None: ``mc_groups.get_default_collection()``.
        force_all_reduce: passed to every chunk's ``finish_grad_sync`` (None reads False).
        peer_checks: end the checks in one status exchange over the world (module notes;
            mc's, keyword only).
    """
    what = "finalize_model_grads"
    flag: object = peer_checks  # callers may pass anything; argcheck only to raise
    if flag is not True and flag is not False:
        check_flag("peer_checks", flag)
    # A check failing on one rank stops every rank of the world here (one exchange).
    with mg.fail_together(None, what) if peer_checks else nullcontext():
        chunks = _as_chunks(model, ("finish_grad_sync", "named_parameters", "parameters"))
        settings = _Settings.kept(chunks[0], _config_of(chunks[0]))
        per_token = settings.calculate_per_token_loss
        if per_token:
            _as_chunks(chunks, ("scale_gradients",))
        force: object = force_all_reduce
        if force is not True and force is not False and force is not None:
            check_flag("force_all_reduce", force)
        groups = _Groups.plan(collection_or_default(pg_collection, what), settings)
        _check_chunks(chunks, groups.tp, groups.expt_dp)
        _check_num_tokens(num_tokens, chunks, per_token)
        shared = partial(_shared_weight, has_mtp=settings.has_mtp)
        word = _embedding_weight(chunks, groups.embd, groups.pp, shared, settings.has_mtp, True)
        at = _get_position_embedding_weight
        position = _embedding_weight(chunks, groups.pos_embd, groups.pp, at, False, False)
        pp_steps = _multi(groups.pp)
        cond = settings.has_cond_embedder and pp_steps
        embedders = _by_name(chunks, param_attrs.PIPELINE_PARALLEL) if cond else []
        flextron = settings.flextron and pp_steps
        routers = _by_name(chunks, param_attrs.FLEXTRON_ROUTER_PP_SYNC) if flextron else []
        tp_sums, tp_avgs = _tp_params(chunks, settings) if _multi(groups.tp) else ([], [])
        biased = _bias_routers(chunks) if settings.moe_router_enable_expert_bias else []
        quantile = _quantile_routers(chunks) if settings.balancing("quantile_balancing") else []
    # 1. the data-parallel reduction of every chunk (DDP's buckets; FSDP2 reduced in backward)
    for chunk in chunks:
        if not _fsdp2_chunk(chunk):
            chunk.finish_grad_sync(force_all_reduce=force is True)
    # 2, 3. params replicated on every pipeline stage: SUM over pp
    _reduce_over_pp(embedders, groups.pp, "conditional embedding grads")
    _reduce_over_pp(routers, groups.pp, "router grads")
    # 4. params not split by tp whose grads saw split data: SUM, then AVG over tp
    _allreduce_grads(tp_sums, groups.tp, mg.ReduceOp.SUM, _TP_LABEL, shards=True)
    _allreduce_grads(tp_avgs, groups.tp, mg.ReduceOp.AVG, _TP_LABEL, shards=True)
    # 5. the gtp_remat axis of params not gtp_remat-sharded
    _reduce_replicated(chunks, groups.gtp_remat, groups.expt_gtp_remat, per_token)
    # 6, 7. embedding weights held on two pipeline stages: SUM over embd / pos_embd
    _allreduce_grads(word, groups.embd, mg.ReduceOp.SUM, "embedding grads")
    _allreduce_grads(position, groups.pos_embd, mg.ReduceOp.SUM, "embedding grads")
    # 8, 9. the routers' balancing state
    if biased and groups.tp_dp_cp is not None:
        _update_expert_bias(biased, settings.moe_router_bias_update_rate, groups.tp_dp_cp)
    if quantile and groups.data is not None:
        _update_qb_beta(quantile, settings.moe_router_quantile_balancing_ema, groups.data)
    # 10. the per-batch counters
    _reset(chunks, settings)
    # 11. per-token loss: every grad ÷ the global token count
    if per_token:
        assert groups.pp is not None
        assert groups.data is not None
        _scale_by_num_tokens(chunks, num_tokens, groups.pp, groups.data)
    # 12. a chunk that tracks it refuses a second finalize until its next zero_grad_buffer()
    for chunk in chunks:
        mark = getattr(chunk, "mark_grads_finalized", None)
        if callable(mark):
            mark()


def _config_of(chunk: ModelChunk) -> object:
    """``model[0].config`` when it is mc's or Megatron's (it has ``sequence_parallel``),
    else the config ``mc_tp_layers.parallelize`` recorded on the model (a ``transformers``
    or torchtitan model's ``.config`` is its library's)."""
    config = getattr(chunk, "config", None)
    if config is None or not hasattr(config, "sequence_parallel"):
        config = recorded_config(chunk) or config
    if config is None:
        raise InputTypeError(
            f"model[0] ({type_name(chunk)}) has no config; give it .config, or build it with "
            "mc_tp_layers.parallelize (which records one)"
        )
    return config


def _check_chunks(chunks: Sequence[ModelChunk], tp: Group, expt_dp: Group | None) -> None:
    """FSDP2 chunks get their marks back; a chunk whose grads were finalized (mc's DDP until
    its next ``zero_grad_buffer()``) would have them reduced and scaled twice."""
    for index, chunk in enumerate(chunks):
        if _fsdp2_chunk(chunk):  # marks back from parallelize's record, mesh checked
            _fsdp2.check_chunk(index, cast(torch.nn.Module, chunk), tp, expt_dp)
        if getattr(chunk, "grads_finalized", False) is True:
            raise RuntimeError(
                f"finalize_model_grads: model[{index}]'s gradients were already finalized this "
                "iteration (a second finalize would reduce and scale them twice); call "
                "zero_grad_buffer() and run the next backward first"
            )


@dataclass(frozen=True)
class _Groups:
    """The groups of one call; None: the collection lacks it and no step that runs needs it
    (``data``: ``dp_cp``, or ``dp_cp_gtp_remat`` under gtp_remat)."""

    tp: Group
    pp: Group | None
    embd: Group | None
    pos_embd: Group | None
    data: Group | None
    tp_dp_cp: Group | None
    gtp_remat: Group | None
    expt_gtp_remat: Group | None
    expt_dp: Group | None  # where FSDP2 chunks' expert params must be sharded

    @classmethod
    def plan(cls, pgc: mg.ProcessGroupCollection, settings: _Settings) -> _Groups:
        """Every group a step that runs needs, or a MissingGroupError naming the steps."""
        per_token = settings.calculate_per_token_loss
        gtp, egtp = settings.gtp_remat_size, settings.expert_gtp_remat_size
        embeddings = _multi(pgc.embd) or _multi(pgc.pos_embd)
        needs = {  # group: (does a step that needs it run, which)
            "pp": (
                (settings.has_cond_embedder, "conditional-embedder grads"),
                (settings.flextron, "Flextron router grads"),
                (embeddings, "embedding grads of the first/last stage"),
                (per_token, "num_tokens broadcast from the last stage"),
            ),
            "data": (
                (settings.balancing("quantile_balancing"), "qb_beta"),
                (per_token, "num_tokens"),
            ),
            "tp_dp_cp": ((settings.moe_router_enable_expert_bias, "router expert bias"),),
            "gtp_remat": ((gtp > 1, "config.gtp_remat_size > 1"),),
            "expt_gtp_remat": ((egtp > 1, "config.expert_gtp_remat_size > 1"),),
        }
        data = "dp_cp_gtp_remat" if gtp > 1 or _multi(pgc.gtp_remat) else "dp_cp"
        found: dict[str, Group | None] = {}
        for name, steps in needs.items():
            field, why = data if name == "data" else name, "; ".join(s for on, s in steps if on)
            found[name] = (
                pgc.require(field, f"finalize_model_grads ({why})") if why else getattr(pgc, field)
            )
        for name, size in (("gtp_remat", gtp), ("expt_gtp_remat", egtp)):
            if size > 1 and (group := found[name]) is not None and group.size() != size:
                raise InputValueError(
                    f"pg_collection.{name} has {group.size()} ranks but the config says "
                    f"{size}; build the collection with the config's sizes"
                )
        tp = pgc.require("tp", "finalize_model_grads (non-tensor-parallel grads over tp)")
        return cls(tp=tp, embd=pgc.embd, pos_embd=pgc.pos_embd, expt_dp=pgc.expt_dp, **found)


# Half-precision counts are exact only up to 2048 (fp16) / 256 (bf16) tokens.
_TOKEN_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _check_num_tokens(num_tokens: object, chunks: Sequence[ModelChunk], per_token: bool) -> None:
    """What one rank can check alone (a missing count may be missing on one rank only: it
    travels through the token reduction instead)."""
    if num_tokens is None:
        return
    if not per_token:
        raise InputValueError(
            "num_tokens was given but config.calculate_per_token_loss=False (DDP averaged the "
            "grads already); pass it only with calculate_per_token_loss=True"
        )
    if not isinstance(num_tokens, torch.Tensor):
        raise InputTypeError(
            f"num_tokens must be a torch.Tensor, got {type_name(num_tokens)}; "
            "e.g. torch.tensor(n, dtype=torch.int64)"
        )
    if num_tokens.dim() > 1 or num_tokens.numel() != 1:
        raise InputValueError(
            f"num_tokens has shape {tuple(num_tokens.shape)}; sum the micro-batches' counts "
            "into one (shape () or (1,))"
        )
    if num_tokens.dtype not in _TOKEN_DTYPES:
        raise InputTypeError(
            f"num_tokens has dtype {num_tokens.dtype}, which cannot hold counts exactly; use "
            "torch.int64 (or int32, float32, float64)"
        )
    param = next(iter(chunks[0].parameters()), None)
    if param is not None and num_tokens.device != param.device:
        raise InputValueError(
            f"num_tokens is on {num_tokens.device} but the model is on {param.device}; "
            "pass num_tokens.to(device)"
        )


def _scale_by_num_tokens(
    chunks: Sequence[ModelChunk], num_tokens: torch.Tensor | None, pp: Group, data: Group
) -> None:
    """Step 11: ``n ← Σ_data (the last stage's count)`` in float64 (exact below 2**53), every
    grad ÷ max(n, 1); a bad count on any rank travels as NaN (module notes)."""
    if num_tokens is None:
        param = next(iter(chunks[0].parameters()), None)
        device = torch.device("cpu") if param is None else param.device
        count = torch.full((1,), math.nan, dtype=torch.float64, device=device)
    else:
        count = num_tokens.detach().reshape(1).to(torch.float64)
        count = torch.where(torch.isfinite(count) & (count >= 0), count, math.nan)
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
    if num_tokens is not None:
        num_tokens.copy_(count.reshape(num_tokens.shape))  # the global count, in place
    for chunk in chunks:
        chunk.scale_gradients(1.0 / max(total, 1.0))
