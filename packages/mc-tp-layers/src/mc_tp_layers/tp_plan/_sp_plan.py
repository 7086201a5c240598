r"""``sequence_parallel_plan``: a decoder's tensor-parallel plan plus the entries that run
it with sequence parallelism, read from the model's module tree (no forward, no
communication, the model untouched).

What it reads (``P``: the ``nn.ModuleList`` or ``nn.ModuleDict`` of decoder layers, found
as the one container whose layers hold the base plan's ``colwise`` / ``rowwise`` layers, or
``layers=``):

1. Each layer's children. A child holding converted layers is a *block* (attention, MLP):
   it gets ``sequence_gather`` (its input all-gathered along the sequence on entry; its
   ``rowwise`` output layer reduce-scatters it back). A child with parameters and no plan
   entry must be a norm (class name with ``Norm``, only 1-D parameters): it runs on this
   rank's part of the sequence and gets ``sequence_parallel`` (its grads summed over TP by
   ``finalize_model_grads``). Parameter-free children (dropout) are left alone.
2. ``P.0`` gets ``sequence_scatter``: the embeddings (and ``transformers``' positions and
   masks, derived from their length) stay whole; the residual stream is split from there.
3. The ancestors' children registered after ``P`` (``model.norm``, ``lm_head``): norms get
   ``sequence_parallel``; ``colwise`` layers of the plan (the LM head) get
   ``sequence_gather``. At least one such head is needed (else the hidden states would
   leave the model split).
4. A block whose projections the base plan gathers (``colwise_gather_output`` +
   ``rowwise_split_input``) only for norms over their whole width (OLMo-2's
   ``q_norm`` / ``k_norm``: a norm inside the block as wide as a gathered sibling
   projection) keeps its heads split instead (``split_qk_norms``): ``colwise`` /
   ``rowwise`` projections and ``colwise_rmsnorm`` norms (one all-reduce of ``[b, s, 1]``
   each way per norm instead of gathering ``[b, s, n]``). A block gathered for another
   reason (Phi-3's fused ``qkv_proj`` sliced by global sizes) keeps the base plan's styles:
   each rank then runs that block's attention whole.

The base plan is ``model.tp_plan`` (``transformers``' own) or, for a model without one
laid out as torchtitan's Llama-3 (``tok_embeddings``, ``layers`` of blocks with
``attention`` / ``feed_forward``, ``lm_head``; :func:`_torchtitan_base`), torchtitan's own
tensor-parallel plan for it.

Anything else it cannot read is an error naming what it looked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from fnmatch import fnmatchcase

import torch

from mc_groups.argcheck import check_flag, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.tp_plan._convert import _match, _Target
from mc_tp_layers.tp_plan._sp_blocks import (
    check_sequence_local,
    mla_entries,
    sequence_local_block,
)
from mc_tp_layers.tp_plan._styles import (
    Colwise,
    ColwiseRMSNorm,
    Plan,
    Rowwise,
    SequenceGather,
    SequenceParallelNorm,
    SequenceScatter,
    Style,
    VocabEmbedding,
    name_of,
)

__all__ = ["sequence_parallel_plan"]

_SEQUENCE = (SequenceGather, SequenceScatter, SequenceParallelNorm)
_HOW = "write the sequence-parallel entries by hand (docs/parallelize.md)"

PlanValue = str | Style | tuple[str | Style, ...]


def sequence_parallel_plan(
    model: torch.nn.Module,
    base: Plan | None = None,
    *,
    layers: str | None = None,
    split_qk_norms: bool = True,
    sequence_local: Collection[str] = (),
) -> dict[str, PlanValue]:
    """The full plan that runs ``model`` tensor-parallel with sequence parallelism.

    ``parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)``
    is one call for a ``transformers`` Llama, Qwen2, Qwen3, Mistral, Phi-3, OLMo-2, Gemma
    or Gemma-3, a torchtitan-laid-out Llama-3 (fused ``wqkv`` or separate ``wq`` / ``wk`` /
    ``wv``; tested), or any decoder whose layers are an ``nn.ModuleList`` /
    ``nn.ModuleDict`` of blocks (attention, MLP) and norms. The same plan serves
    ``config.sequence_parallel=False``: the entries then make each block share one
    all-reduce of its input grad (Megatron's ``f``).

    Args:
        model: the model, before ``parallelize`` (on any device, ``meta`` included).
        base: the tensor-parallel plan to extend (patterns → styles, as ``parallelize``
            takes); default ``model.tp_plan`` (``transformers``' own), or torchtitan's plan
            for a model laid out as its Llama-3 (module notes). It must not hold sequence
            styles already.
        layers: the qualified name of the ``nn.ModuleList`` / ``nn.ModuleDict`` of decoder
            layers (e.g. ``"model.layers"``); default: the one container whose layers hold
            the base plan's layers.
        split_qk_norms: keep the heads split in a block that the base plan gathers only for
            full-width norms (OLMo-2), with ``colwise_rmsnorm`` on the norms; ``False``
            keeps the base plan's styles there.
        sequence_local: names of modules that run on this rank's part of the sequence and
            exchange their tokens themselves (a MoE layer's experts modules, which
            ``mc_moe.sequence_parallel_plan`` passes): the layer child holding them runs
            split, its router gets ``sequence_parallel`` and its plan blocks (shared
            experts) ``sequence_gather`` (``mc_tp_layers.tp_plan._sp_blocks``).

    Multi-head latent attention (DeepSeek-V3's, whose ``tp_plan`` names none of its layers)
    is split by heads as Megatron-Core splits it (``_sp_blocks``).

    Returns:
        A new plan holding the base entries (rewritten only by ``split_qk_norms``) and the
        sequence entries, with ``P.*.name`` patterns where every layer gets the same entry.

    Collectives of the returned plan per step (W = TP size, ``[b, s, h]`` activations):
    per block, forward one all-gather of ``[b, s/W, h]`` on entry and one reduce-scatter
    of ``[b, s, h]`` at its ``rowwise`` output, backward the same two the other way; the
    scatter at ``P.0`` all-gathers its grad once; the LM head gathers like a block (a model
    without a head, such as a bare ``LlamaModel``, gathers its final norm's output
    instead: ``SequenceParallelNorm(gather_output=True)``, one all-gather forward, none
    backward; hidden states it returns from inside the layers stay split). A
    block run whole (Phi-3) adds, per ``colwise_gather_output`` layer, a forward
    all-gather of its output's last dim and, per ``rowwise_split_input`` layer, a backward
    all-gather of its input grad's last dim; a ``colwise_rmsnorm`` adds one all-reduce of
    ``[b, s, 1]`` each way. docs/parallelize.md counts them per architecture.

    Raises:
        InputTypeError, InputValueError: an argument of the wrong type, a base plan that
            matches nothing or holds sequence styles, or a structure it cannot read
            (no or several layer lists, a layer child that is neither a block nor a norm,
            a block without a ``rowwise`` output layer or with parameters outside the plan
            in its split part, neither a ``colwise`` head nor a norm after the layers),
            naming what it looked for.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type_name(model)}")
    plan: dict[object, object] = dict(_base(model, base))
    check_flag("split_qk_norms", split_qk_norms)
    local = check_sequence_local(model, sequence_local)
    plan.update(mla_entries(model, lambda n: any(_hits(n, p) for p in plan)))
    targets = _match(model, plan)
    for target in targets:
        if any(isinstance(s, _SEQUENCE) for s in target.styles):
            raise InputValueError(
                f"base plan entry {target.label()} is a sequence style already; pass the "
                "tensor-parallel plan without sequence entries (sequence_parallel_plan "
                "derives them)"
            )
    entries = {t.name: list(t.styles) for t in targets}
    list_name = _layer_list(model, targets, layers)
    for index, layer in enumerate(model.get_submodule(list_name).children()):
        _layer(f"{list_name}.{index}", layer, targets, entries, split_qk_norms, local)
    first = model.get_submodule(f"{list_name}.0")
    entries[f"{list_name}.0"] = [SequenceScatter(_first_arg(first))]
    _after_layers(model, list_name, targets, entries)
    return _compress(model, list_name, entries)


def _base(model: torch.nn.Module, base: object) -> Mapping[object, object]:
    if base is None:
        base = getattr(model, "tp_plan", None) or _torchtitan_base(model)
        if not isinstance(base, Mapping) or not base:
            raise InputValueError(
                f"{type_name(model)} has no tp_plan (transformers models carry model.tp_plan) "
                "and is not laid out as torchtitan's Llama-3 (tok_embeddings, layers, lm_head); "
                "pass base= the tensor-parallel plan to extend"
            )
    if not isinstance(base, Mapping) or not base:
        raise InputTypeError(
            f"base must be a non-empty mapping of module-name patterns to styles, got {base!r}"
        )
    return base


_COLWISE_LEAVES = ("wq", "wk", "wv", "wqkv", "w1", "w3")
_ROWWISE_LEAVES = ("wo", "w2")


def _torchtitan_base(model: torch.nn.Module) -> dict[str, str] | None:
    """torchtitan's Llama-3 tensor-parallel plan, in ``parallelize``'s style names, for a
    model laid out as torchtitan 0.3.0's (``tok_embeddings``; ``layers`` whose blocks hold
    ``attention`` and ``feed_forward``; ``lm_head``), else None. Its linear leaves by
    torchtitan's names: ``wq`` / ``wk`` / ``wv`` / ``wqkv`` and ``w1`` / ``w3`` colwise,
    ``wo`` / ``w2`` rowwise (its ``ColwiseParallel`` / ``RowwiseParallel``). The fused
    ``wqkv`` is a plain ``colwise``, not ``packed_colwise``: torchtitan lays its rows out per
    key/value head (each group's query heads, then its key, then its value), so a rank's
    contiguous rows are whole groups."""
    children = dict(model.named_children())
    layers = children.get("layers")
    if not isinstance(layers, (torch.nn.ModuleList, torch.nn.ModuleDict)) or not len(layers):
        return None
    if not all(isinstance(children.get(n), torch.nn.Module) for n in ("tok_embeddings", "lm_head")):
        return None
    first = next(iter(layers.children()))
    if not hasattr(first, "attention") or not any(
        hasattr(block, n) for block in layers.children() for n in ("feed_forward", "moe")
    ):
        return None
    plan = {"tok_embeddings": "embedding_rowwise"}
    for block in layers.children():  # dense blocks and MoE blocks (their shared experts)
        for name, module in block.named_modules():
            leaf = name.rpartition(".")[2]
            if isinstance(module, torch.nn.Linear) and leaf in _COLWISE_LEAVES + _ROWWISE_LEAVES:
                plan[f"layers.*.{name}"] = "colwise" if leaf in _COLWISE_LEAVES else "rowwise"
    plan["lm_head"] = "colwise_gather_output"
    return plan


def _layer_list(model: torch.nn.Module, targets: list[_Target], layers: object) -> str:
    lists: list[str] = [
        n
        for n, m in model.named_modules()
        if n and isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
    ]
    if layers is not None:
        if not isinstance(layers, str):
            raise InputTypeError(f"layers must be a str (a module name), got {type_name(layers)}")
        if layers not in lists:
            raise InputValueError(
                f"layers={layers!r} is not an nn.ModuleList or nn.ModuleDict of "
                f"{type_name(model)}; its containers: {lists}"
            )
        return layers
    holding = [n for n in lists if any(t.name.startswith(n + ".") for t in targets)]
    outer = [n for n in holding if not any(n.startswith(o + ".") for o in holding)]
    if len(outer) == 1:
        return outer[0]
    found = f"found {outer}" if outer else f"found none (its containers: {lists})"
    raise InputValueError(
        f"sequence_parallel_plan cannot read {type_name(model)}: it looks for one "
        f"nn.ModuleList or nn.ModuleDict of decoder layers holding the plan's colwise/rowwise "
        f"layers (such as 'model.layers'), {found}; pass layers='<that container>' or {_HOW}"
    )


def _hits(name: str, pattern: object) -> bool:
    return isinstance(pattern, str) and fnmatchcase(name, pattern)


def _inside(name: str, targets: list[_Target]) -> list[_Target]:
    return [t for t in targets if t.name == name or t.name.startswith(name + ".")]


def _is_norm(module: torch.nn.Module) -> bool:
    params = list(module.parameters())
    return "norm" in type(module).__name__.lower() and all(p.dim() == 1 for p in params)


def _layer(
    name: str,
    layer: torch.nn.Module,
    targets: list[_Target],
    entries: dict[str, list[Style]],
    split_qk_norms: bool,
    local: tuple[str, ...] = (),
) -> None:
    if list(layer.parameters(recurse=False)):
        raise InputValueError(
            f"{name} ({type_name(layer)}) holds parameters of its own; sequence_parallel_plan "
            f"reads layers whose parameters sit in blocks and norms; {_HOW}"
        )
    blocks = 0
    for child_name, child in layer.named_children():
        full = f"{name}.{child_name}"
        inside = _inside(full, targets)
        held = [n for n in local if n.startswith(full + ".")]
        if held:
            sequence_local_block(
                full,
                child,
                held,
                lambda n: bool(_inside(n, targets)),
                lambda n, m: _block(n, m, _inside(n, targets), entries, split_qk_norms),
                entries,
            )
            blocks += 1
            continue
        if any(t.name == full for t in inside):
            raise InputValueError(
                f"{full} is converted by the plan itself; sequence_parallel_plan reads layers "
                f"whose converted layers sit inside blocks (attention, MLP); {_HOW}"
            )
        if inside:
            _block(full, child, inside, entries, split_qk_norms)
            blocks += 1
        elif list(child.parameters()):
            _norm(full, child, "a layer's child")
            entries[full] = [SequenceParallelNorm()]
    if not blocks:
        raise InputValueError(
            f"{name} ({type_name(layer)}) holds no plan entry: sequence_parallel_plan cannot "
            f"tell how it mixes the sequence; {_HOW}"
        )


def _norm(name: str, module: torch.nn.Module, where: str) -> None:
    if not _is_norm(module):
        raise InputValueError(
            f"{name} ({type_name(module)}) is {where} with parameters but neither a block of "
            "the plan (attention, MLP) nor a norm (a class named *Norm* with 1-D parameters): "
            f"sequence_parallel_plan cannot tell whether it works token by token; {_HOW}"
        )


def _block(
    name: str,
    block: torch.nn.Module,
    inside: list[_Target],
    entries: dict[str, list[Style]],
    split_qk_norms: bool,
) -> None:
    styles = [t.replacing() for t in inside]
    if any(isinstance(s, VocabEmbedding) for s in styles) or not any(
        isinstance(s, Rowwise) for s in styles
    ):
        raise InputValueError(
            f"{name} ({type_name(block)}) holds {[t.label() for t in inside]} but no rowwise "
            "output layer (or an embedding): sequence_parallel_plan reads blocks that leave "
            f"through a rowwise layer, which reduce-scatters the sequence back; {_HOW}"
        )
    converted = {t.name for t in inside}
    loose = [
        (n, m)
        for n, m in _named(block, name)
        if list(m.parameters(recurse=False))
        and not any(n == c or n.startswith(c + ".") for c in converted)
    ]
    split_heads = any(isinstance(s, Colwise) and not s.gather_output for s in styles)
    if loose and split_heads:
        raise InputValueError(
            f"{[n for n, _ in loose]} in {name} hold parameters outside the plan while the "
            "block keeps its heads split: each rank's grad would cover only its heads; give "
            "them 'replicated_with_grad_allreduce' in the base plan (their grads summed over "
            "TP, as transformers plans Qwen3's per-head norms), gather the block's "
            f"projections (colwise_gather_output), or {_HOW}"
        )
    entries[name] = [SequenceGather(_first_arg(block))]
    if loose and split_qk_norms and _full_width_norms(inside, loose):
        for target in inside:
            style = target.replacing()
            plain = Colwise() if isinstance(style, Colwise) else Rowwise()
            entries[target.name] = [plain]
        for norm_name, _ in loose:
            entries[norm_name] = [ColwiseRMSNorm()]


def _named(block: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Module]]:
    return [(f"{name}.{n}" if n else name, m) for n, m in block.named_modules()]


def _full_width_norms(inside: list[_Target], loose: list[tuple[str, torch.nn.Module]]) -> bool:
    """OLMo-2's pattern: the block is gathered whole (only ``colwise_gather_output`` of one
    part and ``rowwise_split_input``) and every loose module is a norm as wide as a
    gathered sibling projection."""
    gathered: dict[str, set[int]] = {}
    for target in inside:
        style = target.replacing()
        if isinstance(style, Colwise) and style.gather_output and style.parts == 1:
            width = getattr(target.module, "out_features", None)
            parent = target.name.rpartition(".")[0]
            gathered.setdefault(parent, set()).add(int(width) if width is not None else -1)
        elif not (isinstance(style, Rowwise) and style.split_input):
            return False
    for norm_name, norm in loose:
        weight = dict(norm.named_parameters(recurse=False)).get("weight")
        if not _is_norm(norm) or weight is None:
            return False
        if weight.numel() not in gathered.get(norm_name.rpartition(".")[0], set()):
            return False
    return True


def _after_layers(
    model: torch.nn.Module,
    list_name: str,
    targets: list[_Target],
    entries: dict[str, list[Style]],
) -> None:
    heads, norms = 0, []
    for full, child in _registered_after(model, list_name):
        inside = _inside(full, targets)
        if inside:
            for target in inside:
                if not isinstance(target.replacing(), Colwise):
                    raise InputValueError(
                        f"{target.label()} comes after {list_name}: sequence_parallel_plan "
                        f"reads only norms and colwise heads there; {_HOW}"
                    )
                # the hook sits on the converted layer, called positionally
                entries[target.name] = [SequenceGather(), *target.styles]
                heads += 1
        elif _is_norm(child):
            entries[full] = [SequenceParallelNorm()]
            norms.append(full)
        elif list(child.parameters()):
            raise InputValueError(
                f"{full} ({type_name(child)}) is registered after {list_name} with parameters, "
                "no plan entry and no norm: the hidden states would reach it split along the "
                "sequence; if it is the LM head, give it 'colwise_gather_output' (or 'colwise') "
                f"in the base plan, else {_HOW}"
            )
    if heads:
        return
    if not norms:
        raise InputValueError(
            f"sequence_parallel_plan found neither a colwise layer of the plan (such as "
            f"lm_head) nor a final norm registered after {list_name}: the hidden states "
            f"would leave the model split along the sequence; add the head to the base plan "
            f"('colwise_gather_output') or {_HOW}"
        )
    # a model without a head (a bare decoder): its hidden states leave whole after the
    # last norm, gathered along the sequence there
    entries[norms[-1]] = [SequenceParallelNorm(gather_output=True)]


def _registered_after(model: torch.nn.Module, list_name: str) -> list[tuple[str, torch.nn.Module]]:
    """The children of ``list_name``'s ancestors registered after the branch holding it."""
    out: list[tuple[str, torch.nn.Module]] = []
    prefix, module = "", model
    for part in list_name.split("."):
        children = list(module.named_children())
        at = [n for n, _ in children].index(part)
        out += [(f"{prefix}{n}", c) for n, c in children[at + 1 :]]
        prefix, module = f"{prefix}{part}.", module.get_submodule(part)
    return out


def _first_arg(module: torch.nn.Module) -> str:
    """The name of ``module.forward``'s first positional parameter (how a caller passes the
    hidden states by keyword: ``self_attn(hidden_states=...)``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return "hidden_states"
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return next((str(p.name) for p in params if p.kind in kinds), "hidden_states")


def _compress(
    model: torch.nn.Module, list_name: str, entries: dict[str, list[Style]]
) -> dict[str, PlanValue]:
    """``entries`` (module → styles) as a plan: ``P.*.rest`` where that pattern matches
    exactly the modules that share those styles, else each name."""
    names = [n for n, _ in model.named_modules() if n]
    order = {n: i for i, n in enumerate(names)}
    head = list_name + "."
    groups: dict[tuple[str, tuple[Style, ...]], list[str]] = {}
    ordered: dict[str, tuple[Style, ...]] = {n: tuple(s) for n, s in entries.items()}
    for name, own in ordered.items():
        index, _, rest = name.removeprefix(head).partition(".")
        if name.startswith(head) and index.isdigit() and rest:
            groups.setdefault((rest, own), []).append(name)
    plan: dict[str, tuple[int, PlanValue]] = {}
    grouped: set[str] = set()
    for (rest, shared), members in groups.items():
        pattern = f"{list_name}.*.{rest}"
        if {n for n in names if fnmatchcase(n, pattern)} == set(members):
            plan[pattern] = (min(order[m] for m in members), _value(shared))
            grouped.update(members)
    for name, own in ordered.items():
        if name not in grouped:
            plan[name] = (order[name], _value(own))
    return {k: v for k, (_, v) in sorted(plan.items(), key=lambda item: item[1][0])}


def _value(styles: tuple[Style, ...]) -> PlanValue:
    ordered = sorted(styles, key=lambda s: not isinstance(s, _SEQUENCE))
    items = [name_of(s) or s for s in ordered]
    return items[0] if len(items) == 1 else tuple(items)
