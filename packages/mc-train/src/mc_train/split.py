r"""Cut a whole model into pipeline stages by module names, for any model.

As torchtitan's ``pipeline_module_split``: every stage is a deep copy of the model from which
the modules of the other stages are removed, so the stage keeps the model's class, its
``forward`` and its parameter names::

    LlamaForCausalLM                stage 0 of 2                  stage 1 of 2
      model.embed_tokens            model.embed_tokens            (passes its input on)
      model.layers.0 .. 3           model.layers.0, 1             model.layers.2, 3
      model.rotary_emb (no params)  model.rotary_emb              model.rotary_emb
      model.norm                    (passes its input on)         model.norm
      lm_head                       (passes its input on)         lm_head

``stages`` lists, per global stage, the qualified names of the modules it owns. A removed
element of a ``ModuleList`` / ``ModuleDict`` leaves the container (the kept blocks keep their
global index as their name: ``model.layers.2`` is still ``model.layers.2`` on stage 1, so
state dicts and checkpoints do not depend on the split); any other removed module is replaced
by a function returning its first argument, so a ``forward`` that calls ``self.norm(x)`` or
``self.lm_head(x)`` on a stage without them passes ``x`` through. Modules named by no stage
are kept on every stage; they must hold no parameters (a rotary embedding, a dropout), since
a parameter on several stages would be trained by each alone.

A weight shared by modules of different stages (tied input and output embeddings) is copied
into both; both copies are marked ``shared_embedding`` (:mod:`mc_groups.param_attrs`), so
``finalize_model_grads`` sums their grads over the ``embd`` group (first and last pipeline
stage) and :mod:`mc_train.checkpoint` writes the table once. Such a weight must sit on the
first and the last stage, the only two the ``embd`` group joins.

Global stage ``c`` runs on pipeline rank ``c mod P`` as its chunk ``c div P`` (Megatron's
and torchtitan's looped placement), so with ``S = V·P`` stages each rank builds ``V``
chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any, overload

from torch import nn

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_int, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "decoder_stages",
    "split_model",
    "stage_module",
    "stage_plan",
    "tied_parameter_names",
]

TIED_ATTR = "_mc_train_tied_parameters"
"""Attribute of a stage module: the names of its params that are copies of a weight tied
across stages (read by :func:`tied_parameter_names`)."""


def _passthrough(x: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for a module of another stage: returns its first argument."""
    return x


class _KeptLayers(nn.ModuleList):
    """A ``ModuleList`` holding some of the original blocks under their original indices
    (``"2"``, ``"3"``): indexed and sliced by position, named by global index."""

    def __init__(self, kept: dict[str, nn.Module]) -> None:
        super().__init__()
        for key, module in kept.items():
            self.add_module(key, module)

    @overload
    def __getitem__(self, idx: slice) -> nn.ModuleList: ...

    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:
        """Position ``idx`` among the kept blocks (a slice: a plain ``ModuleList``)."""
        blocks = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList([b for b in blocks[idx] if b is not None])
        block = blocks[idx]
        assert block is not None  # add_module never stores None here
        return block

    def __iter__(self) -> Iterator[nn.Module]:
        """The kept blocks in order."""
        return (b for b in self._modules.values() if b is not None)


def _check_stages(model: nn.Module, stages: object) -> list[list[str]]:
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise InputTypeError(
            f"stages must be a non-empty list of lists of module names (one list per "
            f"pipeline stage), got {stages!r:.80}"
        )
    names = dict(model.named_modules())
    out: list[list[str]] = []
    owner: dict[str, int] = {}
    for index, stage in enumerate(stages):
        if isinstance(stage, (str, bytes)) or not isinstance(stage, Sequence):
            raise InputTypeError(
                f"stages[{index}]={stage!r:.60} must be a list of module names, e.g. "
                "['model.embed_tokens', 'model.layers.0']"
            )
        if not stage:
            raise InputValueError(
                f"stages[{index}] is empty: the split would leave pipeline stage {index} "
                "without modules; give every stage at least one block, or use fewer stages"
            )
        for name in stage:
            if not isinstance(name, str) or name not in names or not name:
                near = [n for n in names if n and str(name) in n][:3]
                raise InputValueError(
                    f"stages[{index}] names {name!r}, which is not a submodule of "
                    f"{type_name(model)}" + (f" (names like it: {near})" if near else "")
                )
            if name in owner:
                raise InputValueError(
                    f"{name!r} is in stages[{owner[name]}] and stages[{index}]: every module "
                    "belongs to one stage"
                )
            owner[name] = index
        out.append(list(stage))
    for name, index in owner.items():
        for other, j in owner.items():
            if other != name and other.startswith(name + "."):
                raise InputValueError(
                    f"stages[{index}] names {name!r} and stages[{j}] names {other!r}, which is "
                    f"inside it; name the parts of {name!r} instead"
                )
    return out


def _unit_params(model: nn.Module, units: list[list[str]]) -> list[set[int]]:
    """Per stage, the ids of the params its modules hold (a tied weight: in both stages)."""
    held: list[set[int]] = []
    for stage in units:
        ids = {id(p) for name in stage for p in model.get_submodule(name).parameters()}
        held.append(ids)
    return held


def _check_coverage(model: nn.Module, held: list[set[int]]) -> None:
    owned = set().union(*held)
    for name, param in model.named_parameters():
        if id(param) not in owned:
            raise InputValueError(
                f"parameter {name!r} is in no stage's modules: it would be copied to every "
                "stage and trained by each alone; add its module to one stage"
            )


def _check_ties(model: nn.Module, held: list[set[int]]) -> None:
    last = len(held) - 1
    for name, param in model.named_parameters():
        where = [i for i, ids in enumerate(held) if id(param) in ids]
        if len(where) > 1 and where != [0, last]:
            raise InputValueError(
                f"parameter {name!r} is used by stages {where}: a weight shared across stages "
                f"must sit on the first and the last stage only ([0, {last}]), the two the "
                "embd group sums its grads over (tied input and output embeddings)"
            )


def _plan(model: object, stages: object) -> tuple[list[list[str]], list[set[int]]]:
    """The checked split: module names and parameter ids per stage."""
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type_name(model)}")
    units = _check_stages(model, stages)
    held = _unit_params(model, units)
    for index, ids in enumerate(held):
        if not ids:
            raise InputValueError(
                f"stages[{index}] = {units[index]} holds no parameters: the split would leave "
                f"pipeline stage {index} empty; give it at least one block"
            )
    _check_coverage(model, held)
    _check_ties(model, held)
    return units, held


def stage_module(model: nn.Module, stages: Sequence[Sequence[str]], index: int) -> nn.Module:
    """Global stage ``index`` of ``stages`` (module notes): a deep copy of ``model`` holding
    only that stage's modules. ``model`` is not changed; no communication."""
    units, held = _plan(model, stages)
    check_int("index", index, minimum=0)
    if index >= len(units):
        raise InputValueError(f"index={index} is not a stage of the {len(units)} in stages")
    return _build(model, units, held, index)


def _build(model: nn.Module, units: list[list[str]], held: list[set[int]], index: int) -> nn.Module:
    others: set[int] = set().union(*(ids for i, ids in enumerate(held) if i != index))
    tied = held[index] & others
    memo: dict[int, Any] = {}
    stage = copy.deepcopy(model, memo)
    _drop(stage, [name for i, names in enumerate(units) if i != index for name in names])
    copies = {id(memo[pid]) for pid in tied if pid in memo}
    tied_names = tuple(name for name, p in stage.named_parameters() if id(p) in copies)
    for name in tied_names:
        setattr(stage.get_parameter(name), param_attrs.SHARED_EMBEDDING, True)
    object.__setattr__(stage, TIED_ATTR, tied_names)
    return stage


def _drop(stage: nn.Module, dropped: list[str]) -> None:
    """Remove ``dropped`` from ``stage``: container elements leave their container, other
    modules become pass-throughs (module notes)."""
    by_container: dict[str, list[str]] = {}
    for name in dropped:
        parent, _, leaf = name.rpartition(".")
        container = stage.get_submodule(parent) if parent else stage
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            by_container.setdefault(parent, []).append(leaf)
        else:
            delattr(container, leaf)
            setattr(container, leaf, _passthrough)
    for parent, leaves in by_container.items():
        container = stage.get_submodule(parent)
        kept = {k: m for k, m in container._modules.items() if k not in leaves and m is not None}
        if isinstance(container, nn.ModuleDict):
            for leaf in leaves:
                del container[leaf]
            continue
        grand, _, leaf = parent.rpartition(".")
        owner = stage.get_submodule(grand) if grand else stage
        setattr(owner, leaf, _KeptLayers(kept))


def tied_parameter_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s params that are copies of a weight tied across stages, as
    :func:`stage_module` recorded them (empty for a module it did not build)."""
    names = getattr(module, TIED_ATTR, ())
    return tuple(names) if isinstance(names, tuple) else ()


def split_model(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    pg_collection: mg.ProcessGroupCollection,
) -> list[nn.Module]:
    """This rank's chunks of ``model`` cut into ``stages`` (module notes): global stages
    ``p, p + P, p + 2P, …`` for pipeline rank ``p`` of ``P`` (``pg_collection.pp``), in that
    order (the chunk order :func:`mc_train.build_pipeline` takes). ``len(stages)`` must be
    a multiple of ``P``. No communication; ``model`` is not changed."""
    if not isinstance(pg_collection, mg.ProcessGroupCollection):
        raise InputTypeError(
            f"pg_collection must be a mc_groups.ProcessGroupCollection, got "
            f"{type_name(pg_collection)}"
        )
    pp = pg_collection.require("pp", "split_model")
    size, rank = mg.group_size(pp), mg.group_rank(pp)
    units, held = _plan(model, stages)
    if len(units) % size:
        raise InputValueError(
            f"{len(units)} stages do not divide over the {size} pipeline ranks: give "
            f"a multiple of {size} (each rank runs stages p, p + {size}, ...)"
        )
    return [_build(model, units, held, c) for c in range(rank, len(units), size)]


def _container(model: nn.Module, layers: str | None) -> tuple[str, list[str]]:
    """The path of the blocks' container and the blocks' keys."""
    if layers is None:
        found = [
            (len(m), name)
            for name, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and any(True for _ in m.parameters())
        ]
        if not found:
            raise InputValueError(
                f"{type_name(model)} has no ModuleList or ModuleDict of blocks; pass "
                "layers='path.to.blocks' or list the stages' module names yourself"
            )
        layers = max(found)[1]
    container = model.get_submodule(layers) if layers else model
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise InputValueError(
            f"layers={layers!r} is a {type_name(container)}, not a ModuleList or ModuleDict"
        )
    return layers, list(container._modules)


def _around(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Modules with params registered before and after ``path``'s branch, at every level
    from the root down to ``path``'s parent."""
    before: list[str] = []
    after: list[list[str]] = []
    parts = path.split(".")
    node = model
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        seen = False
        later: list[str] = []
        for key, child in node._modules.items():
            if key == part:
                seen = True
            elif child is not None and any(True for _ in child.parameters()):
                (later if seen else before).append(f"{prefix}.{key}" if prefix else key)
        after.append(later)
        node = node.get_submodule(part)
    return before, [name for level in reversed(after) for name in level]


def decoder_stages(
    model: nn.Module, num_stages: int, *, layers: str | None = None
) -> list[list[str]]:
    """Module names per stage for a decoder (blocks in a ``ModuleList`` or ``ModuleDict``):
    the blocks in contiguous runs (the first ``L mod S`` stages one more), the modules with
    params registered before the blocks (embeddings) on stage 0, those after them (final
    norm, LM head) on the last stage; parameter-free modules (rotary embeddings) are named
    by no stage, so every stage keeps them.

    ``layers``: the blocks' container, e.g. ``"model.layers"`` (None: the container holding
    the most blocks with parameters). A ``ValueError`` when there are fewer blocks than
    stages (a stage would be empty)."""
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type_name(model)}")
    check_int("num_stages", num_stages, minimum=1)
    if layers is not None and not isinstance(layers, str):
        raise InputTypeError(f"layers={layers!r} must be a module path (str) or None")
    path, keys = _container(model, layers)
    if len(keys) < num_stages:
        raise InputValueError(
            f"{path} holds {len(keys)} blocks, fewer than num_stages={num_stages}: a stage "
            "would be empty; use at most as many stages as blocks"
        )
    before, after = _around(model, path) if path else ([], [])
    base, extra = divmod(len(keys), num_stages)
    out: list[list[str]] = []
    start = 0
    for stage in range(num_stages):
        count = base + (stage < extra)
        out.append([f"{path}.{k}" if path else k for k in keys[start : start + count]])
        start += count
    out[0] = before + out[0]
    out[-1] = out[-1] + after
    return out


def stage_plan(plan: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """The entries of a ``parallelize`` plan (fnmatch pattern → style) that match a module
    of this stage: a stage holds some of the model's modules, and ``parallelize`` refuses a
    pattern that matches none. No communication."""
    if not isinstance(plan, Mapping):
        raise InputTypeError(f"plan must be a mapping of patterns to styles, got {type_name(plan)}")
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    names = [name for name, _ in module.named_modules() if name]
    return {
        pattern: style
        for pattern, style in plan.items()
        if any(fnmatchcase(name, str(pattern)) for name in names)
    }
