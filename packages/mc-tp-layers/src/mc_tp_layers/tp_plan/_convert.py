"""``parallelize``: check the whole plan, then convert (see the package notes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from mc_groups import ProcessGroupCollection, param_attrs
from mc_groups.argcheck import check_int, type_name
from mc_groups.config import record_config
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers._config import check_layer_config
from mc_tp_layers.tp_plan import _sequence
from mc_tp_layers.tp_plan._layers import ColwiseLinear, RowwiseLinear, Setup, VocabEmbedding
from mc_tp_layers.tp_plan._norm import ColwiseRMSNormLayer, check_rmsnorm
from mc_tp_layers.tp_plan._overrides import check_plain_linear, embedding_scale
from mc_tp_layers.tp_plan._styles import (
    REPLACING,
    Colwise,
    ColwiseRMSNorm,
    Plan,
    ReplicatedWithGradAllReduce,
    Rowwise,
    SequenceGather,
    SequenceParallelNorm,
    SequenceScatter,
    Style,
    describe,
    resolve,
)
from mc_tp_layers.tp_plan._styles import VocabEmbedding as VocabEmbeddingStyle
from mc_tp_layers.utils import _resolve_tp_group

__all__ = ["parallelize"]


@dataclass(frozen=True)
class _Target:
    """One module the plan names, with its styles."""

    name: str
    module: torch.nn.Module
    pattern: str
    styles: tuple[Style, ...]

    def replacing(self) -> Style | None:
        for style in self.styles:
            if isinstance(style, REPLACING):
                return style
        return None

    def label(self) -> str:
        return f"{self.name} (plan[{self.pattern!r}] = {[describe(s) for s in self.styles]})"


def parallelize(
    module: torch.nn.Module,
    plan: Plan,
    *,
    config: object,
    pg_collection: ProcessGroupCollection,
    sequence_dim: int = 1,
) -> torch.nn.Module:
    """Replace the submodules ``plan`` names with mc's tensor-parallel layers, in place.

    Args:
        module: any ``nn.Module`` (a ``transformers`` model, torchtitan's, your own), on
            CPU, a device, or ``meta``.
        plan: fnmatch pattern over qualified module names → a style name (``colwise``,
            ``rowwise``, ``colwise_gather_output``/``colwise_rep``,
            ``rowwise_split_input``/``rowwise_rep``, ``packed_colwise``,
            ``embedding_rowwise``, ``colwise_rmsnorm``, ``replicated_with_grad_allreduce``,
            ``sequence_parallel``,
            ``sequence_gather``, ``sequence_scatter``), a style object, or a tuple of them.
            A ``transformers`` model's ``model.tp_plan`` can be passed as it is;
            :func:`~mc_tp_layers.tp_plan.sequence_parallel_plan` adds the sequence-parallel
            entries to it.
        config: the layers' config (:class:`mc_groups.TransformerConfigLike`, e.g.
            :class:`mc_groups.ModelParallelConfig`); ``config.sequence_parallel`` switches
            the sequence styles on.
        pg_collection: the groups; the layers split over ``pg_collection.tp``.
        sequence_dim: where activations keep the sequence: 1 for ``[b, s, h]``
            (``transformers``), 0 for ``[s, b, h]`` (Megatron).

    Returns:
        ``module``, converted in place.

    Each rank keeps its shard of every converted weight (column bias split, row bias whole;
    no re-initialisation). Converted modules keep their state-dict names and return a plain
    tensor. Collectives per converted layer and step, W = TP size::

        ====================  =================================  =================================
        style                 forward                            backward
        ====================  =================================  =================================
        colwise               —                                  all-reduce dX (none in a block)
        colwise_gather_output all-gather of the last dim         (as colwise)
        rowwise               all-reduce Y (SP: reduce-scatter)  — (SP: all-gather dY)
        rowwise_split_input   (as rowwise)                       all-gather dX (last dim), and
                                                                 (as rowwise)
        embedding_rowwise     all-reduce of the embeddings       —
        colwise_rmsnorm       all-reduce of Σx² ([..., 1], fp32) all-reduce of its grad
        replicated_with_      —                                  — (tagged: finalize_model_grads
        grad_allreduce                                           sums the grads over tp)
        sequence_gather       SP: all-gather of the input (seq)  SP: reduce-scatter of its grad,
                              (a block's entry)                  else all-reduce of it
        sequence_scatter      —                                  all-gather of its grad
        ====================  =================================  =================================

    The marks of every parameter and ``config`` are recorded on the modules
    (:func:`mc_groups.param_attrs.record_marks`, :func:`mc_groups.config.record_config`):
    a ``fully_shard`` applied afterwards replaces the parameters, and mc's readers
    (``finalize_model_grads``, ``clip_grad_norm``, :func:`full_state_dict`) put the marks
    back from there.

    Every check runs before any module changes: a pattern matching nothing, a module matched
    twice, an unknown style, a style on the wrong kind of module, sizes or attention heads
    (a parent's ``head_dim``) not divisible by W, a tied weight the plan splits differently
    are ``ValueError``/``TypeError`` naming the module, the style and the fix. The only
    communication is each converted layer's construction, where its TP peers compare how
    they built it (one 8-byte exchange per layer, :mod:`mc_tp_layers.agreement`).
    """
    setup, targets = _check(module, plan, config, pg_collection, sequence_dim)
    converted: dict[int, torch.nn.Parameter] = {}
    for target in targets:
        _apply(module, target, setup, converted, _in_block(target, targets))
    # Kept on the modules, where FSDP2's fully_shard (which replaces every parameter)
    # cannot drop them: the params' marks by name, and the config for finalize_model_grads.
    param_attrs.record_marks(module)
    record_config(module, config)
    return module


def _check(
    module: object,
    plan: object,
    config: object,
    pg_collection: object,
    sequence_dim: object,
) -> tuple[Setup, list[_Target]]:
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    if not isinstance(plan, Mapping) or not plan:
        raise InputTypeError(
            f"plan must be a non-empty mapping of module-name patterns to styles, got {plan!r}"
        )
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise InputTypeError(
            "pg_collection must be a mc_groups.ProcessGroupCollection (its tp group splits the "
            f"layers), got {type_name(pg_collection)}"
        )
    cfg = check_layer_config(config)
    dim = check_int("sequence_dim", sequence_dim, minimum=0)
    if dim > 1:
        raise InputValueError(
            f"sequence_dim={dim}: activations keep the sequence in dim 0 ([s, b, h]) or 1 "
            "([b, s, h]); pass 0 or 1"
        )
    if int(getattr(cfg, "gtp_remat_size", 1)) > 1:
        raise InputValueError(
            "parallelize does not shard weights over gtp_remat; use config.gtp_remat_size=1"
        )
    tp_group = _resolve_tp_group(None, pg_collection, what="parallelize")
    world = int(tp_group.size())
    setup = Setup(cfg, pg_collection, tp_group, bool(cfg.sequence_parallel) and world > 1, dim)
    targets = _match(module, plan)
    for target in targets:
        _check_target(module, target, world)
        if setup.sequence_parallel and not _in_block(target, targets):
            _check_not_colwise(target)
            _check_split_input(target)
    _check_ties(module, targets)
    return setup, targets


def _in_block(target: _Target, targets: list[_Target]) -> bool:
    """A ``sequence_gather`` entry on ``target`` or on a module that contains it."""
    for other in targets:
        inside = other.name == target.name or target.name.startswith(other.name + ".")
        if inside and any(isinstance(s, SequenceGather) for s in other.styles):
            return True
    return False


def _check_not_colwise(target: _Target) -> None:
    if isinstance(target.replacing(), Colwise):
        parent = target.name.rpartition(".")[0]
        where = f"{parent!r}: 'sequence_gather' (the block that calls it) or " if parent else ""
        raise InputValueError(
            f"{target.label()}: under sequence parallelism a colwise layer needs its input "
            f"gathered along the sequence; add {where}{target.name!r}: ('sequence_gather', "
            f"{describe(target.replacing())!r}) to the plan"  # type: ignore[arg-type]
        )


def _check_split_input(target: _Target) -> None:
    style = target.replacing()
    if isinstance(style, Rowwise) and style.split_input:
        parent = target.name.rpartition(".")[0] or "<the module that calls it>"
        raise InputValueError(
            f"{target.label()}: under sequence parallelism rowwise_split_input needs its input "
            "to hold the whole sequence; add 'sequence_gather' on the block that calls it "
            f"({parent!r}), or use 'rowwise' after a 'colwise' layer"
        )


def _match(module: torch.nn.Module, plan: Mapping[object, object]) -> list[_Target]:
    names = [name for name, _ in module.named_modules() if name]
    modules = dict(module.named_modules())
    owner: dict[str, str] = {}
    targets: list[_Target] = []
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise InputTypeError(f"plan key {pattern!r} must be a str (an fnmatch pattern)")
        styles = resolve(pattern, value)
        hits = [name for name in names if fnmatchcase(name, pattern)]
        if not hits:
            leaf = pattern.rpartition(".")[2]
            near = [n for n in names if n.rpartition(".")[2] == leaf][:3]
            hint = f" (modules named like it: {near})" if near else ""
            raise InputValueError(
                f"plan[{pattern!r}] = {value!r} matches no module of {type_name(module)}"
                f"{hint}; patterns are fnmatch over qualified names such as "
                f"{names[:2]}: fix the pattern or drop the entry"
            )
        for name in hits:
            if name in owner:
                raise InputValueError(
                    f"{name} is matched by plan[{owner[name]!r}] and plan[{pattern!r}]; give "
                    "it one entry (a tuple of styles applies several)"
                )
            owner[name] = pattern
            targets.append(_Target(name, modules[name], pattern, styles))
    return targets


def _check_target(root: torch.nn.Module, target: _Target, world: int) -> None:
    style = target.replacing()
    mod = target.module
    if isinstance(style, (Colwise, Rowwise)):
        if not isinstance(mod, torch.nn.Linear):
            hint = (
                "; use 'embedding_rowwise' for an nn.Embedding"
                if isinstance(mod, torch.nn.Embedding)
                else ""
            )
            raise InputTypeError(
                f"{target.label()}: {describe(style)} converts an nn.Linear but this is a "
                f"{type_name(mod)}{hint}; point the pattern at the linear layers"
            )
        check_plain_linear(target.label(), mod)
        if isinstance(style, Colwise):
            _check_split(root, target, mod.out_features, "out_features", world, style.parts)
        else:
            _check_split(root, target, mod.in_features, "in_features", world, 1)
    elif isinstance(style, ColwiseRMSNorm):
        check_rmsnorm(target.label(), mod, world)
    elif isinstance(style, VocabEmbeddingStyle):
        if not isinstance(mod, torch.nn.Embedding):
            raise InputTypeError(
                f"{target.label()}: embedding_rowwise converts an nn.Embedding but this is a "
                f"{type_name(mod)}; use 'colwise'/'rowwise' for an nn.Linear"
            )
        embedding_scale(target.label(), mod)
        if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse:
            raise InputValueError(
                f"{target.label()}: max_norm, scale_grad_by_freq and sparse are not offered by "
                "VocabParallelEmbedding; build the embedding without them"
            )
        if mod.num_embeddings % world:
            raise InputValueError(
                f"{target.label()}: num_embeddings={mod.num_embeddings} is not divisible by the "
                f"TP size {world}; pad the vocabulary to a multiple of it (transformers: "
                f"model.resize_token_embeddings(n, pad_to_multiple_of={world}))"
            )


def _check_split(
    root: torch.nn.Module, target: _Target, size: int, what: str, world: int, parts: int
) -> None:
    style = describe(target.replacing())  # type: ignore[arg-type]
    if size % (world * parts):
        packed = f" in {parts} packed blocks" if parts > 1 else ""
        raise InputValueError(
            f"{target.label()}: {what}={size}{packed} is not divisible by the TP size {world}"
            f"{' × ' + str(parts) if parts > 1 else ''}; choose a TP size that divides it, or "
            f"keep the module replicated (drop the {style!r} entry)"
        )
    parent_name = target.name.rpartition(".")[0]
    parent = root.get_submodule(parent_name) if parent_name else root
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and size % head_dim == 0:
        heads = size // head_dim // parts
        if heads % world:
            raise InputValueError(
                f"{target.label()}: {what}={size} holds {heads} heads of head_dim={head_dim} "
                f"({parent_name or 'the root'}.head_dim), not divisible by the TP size {world}; "
                "choose a TP size that divides the number of (key/value) heads"
            )


def _layout(target: _Target | None) -> tuple[str, int] | None:
    style = None if target is None else target.replacing()
    if isinstance(style, Colwise):
        return ("rows", style.parts)
    if isinstance(style, (VocabEmbeddingStyle, ColwiseRMSNorm)):
        return ("rows", 1)
    if isinstance(style, Rowwise):
        return ("columns", 1)
    return None


def _has_padding_row(target: _Target) -> bool:
    mod = target.module
    return isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None


def _check_ties(root: torch.nn.Module, targets: list[_Target]) -> None:
    by_name = {t.name: t for t in targets}
    holders: dict[int, list[str]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        weight = dict(mod.named_parameters(recurse=False)).get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(name)
    for names in holders.values():
        embedding = [by_name[n] for n in names if n in by_name and _has_padding_row(by_name[n])]
        if len(names) > 1 and embedding:
            raise InputValueError(
                f"{embedding[0].label()}: its weight is tied to {names} and it has padding_idx="
                f"{getattr(embedding[0].module, 'padding_idx', None)}: nn.Embedding gives that "
                "row no gradient from the embedding but the tied layers do, which mc does not "
                "split yet; set the embedding's padding_idx = None (the row then trains like "
                "the others) or untie the weights"
            )
        layouts = {name: _layout(by_name.get(name)) for name in names}
        if len(set(layouts.values())) > 1:
            shown = {
                n: ("replicated" if v is None else f"split by {v[0]}") for n, v in layouts.items()
            }
            raise InputValueError(
                f"the weight tied between {names} would be split differently: {shown}; give "
                "every holder the same split (e.g. 'embedding_rowwise' on the embedding and "
                "'colwise' or 'colwise_gather_output' on the LM head), or untie the weights"
            )


def _apply(
    root: torch.nn.Module,
    target: _Target,
    setup: Setup,
    converted: dict[int, torch.nn.Parameter],
    in_block: bool,
) -> None:
    mod = target.module
    style = target.replacing()
    if style is not None:
        source_weight = dict(mod.named_parameters(recurse=False)).get("weight")
        new = _build(mod, style, setup, target.name, in_block)
        if source_weight is not None:
            if id(source_weight) in converted:  # a tied weight stays tied
                if isinstance(new, VocabEmbedding):
                    new.share_weight(converted[id(source_weight)])
                else:
                    new.weight = converted[id(source_weight)]
            else:
                assert isinstance(new.weight, torch.nn.Parameter)
                converted[id(source_weight)] = new.weight
        parent_name, _, leaf = target.name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, new)
        mod = new
    for extra in target.styles:
        _attach(mod, extra, setup, target.name)


def _build(
    mod: torch.nn.Module, style: Style, setup: Setup, name: str, in_block: bool
) -> torch.nn.Module:
    if isinstance(style, Colwise):
        assert isinstance(mod, torch.nn.Linear)  # checked before any change
        return ColwiseLinear(mod, style, setup, name, in_block)
    if isinstance(style, Rowwise):
        assert isinstance(mod, torch.nn.Linear)
        return RowwiseLinear(mod, style, setup, name)
    if isinstance(style, ColwiseRMSNorm):
        return ColwiseRMSNormLayer(mod, setup, name)
    assert isinstance(mod, torch.nn.Embedding)
    return VocabEmbedding(mod, setup, name, embedding_scale(name, mod))


def _attach(mod: torch.nn.Module, style: Style, setup: Setup, name: str) -> None:
    group, dim, sp = setup.tp_group, setup.sequence_dim, setup.sequence_parallel
    if isinstance(style, SequenceGather):
        hook = _sequence.input_hook(name, style.kwarg, lambda x: _sequence.enter(x, group, dim, sp))
        mod.register_forward_pre_hook(hook, with_kwargs=True)
    elif isinstance(style, ReplicatedWithGradAllReduce):
        # Summed over tp by finalize_model_grads once per step (with or without SP), as
        # Megatron sums its q/k layernorms; not a hook per backward, which would reduce once
        # per micro-batch and put a collective outside the compiled graph.
        for param in mod.parameters():
            param_attrs.mark_sum_gradients_across_tp_domain(param, True)
    elif not sp:
        return
    elif isinstance(style, SequenceParallelNorm):
        for param in mod.parameters():
            param_attrs.mark_sequence_parallel(param, True)
        if style.gather_output:
            mod.register_forward_hook(
                _sequence.output_hook(name, lambda x: _sequence.leave(x, group, dim))
            )
    elif isinstance(style, SequenceScatter):
        hook = _sequence.input_hook(name, style.kwarg, lambda x: _sequence.scatter(x, group, dim))
        mod.register_forward_pre_hook(hook, with_kwargs=True)
