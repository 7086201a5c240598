r"""Two kinds of layer child ``sequence_parallel_plan`` reads beyond attention, MLP and norms.

**Multi-head latent attention** (DeepSeek-V2/V3's MLA, whose ``tp_plan`` names none of its
layers): the heads are split as Megatron-Core splits them. Entries added for an attention
module that has ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``
(and ``q_proj``, or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``) when the base plan
names none of them::

    q_proj, q_b_proj, kv_b_proj      colwise (heads split; the latent input is computed in
                                     the block, so block_input=False)
    o_proj                           rowwise
    q_a_proj, q_a_layernorm,         replicated_with_grad_allreduce (the latent down
    kv_a_proj_with_mqa,              projections and their norms run whole on every rank;
    kv_a_layernorm                   each rank's grad covers its heads: summed over TP)

The block gets ``sequence_gather`` like any attention: its entry all-gathers the sequence,
and its backward sums the input grads of every path, latent ones included.

**Sequence-local blocks** (MoE layers): a layer child holding modules named in
``sequence_local`` (the experts modules, which exchange their tokens themselves) runs on
this rank's part of the sequence. Its other children: plan blocks (shared experts) get
``sequence_gather``; any other child with parameters (the router, a per-token gate) gets
``sequence_parallel`` (its grads are partial sums over TP, summed by
``finalize_model_grads``, as Megatron tags its router); the named modules get nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputValueError
from mc_tp_layers.tp_plan._styles import (
    Colwise,
    ReplicatedWithGradAllReduce,
    Rowwise,
    SequenceParallelNorm,
    Style,
)

__all__: list[str] = []

_KV = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_LATENT_Q = ("q_a_proj", "q_a_layernorm", "q_b_proj")


def _is_mla(module: torch.nn.Module) -> bool:
    children = dict(module.named_children())
    has_q = "q_proj" in children or all(n in children for n in _LATENT_Q)
    return has_q and all(n in children for n in _KV)


def mla_entries(model: torch.nn.Module, covered: Callable[[str], bool]) -> dict[str, Style]:
    """The entries that split every MLA attention of ``model`` by heads (module notes), for
    those whose layers no base entry names (``covered(name)``)."""
    out: dict[str, Style] = {}
    for name, module in model.named_modules():
        if not name or not _is_mla(module):
            continue
        children = dict(module.named_children())
        if any(covered(f"{name}.{child}") for child in children):
            continue
        if "q_proj" in children:
            out[f"{name}.q_proj"] = Colwise()
        else:
            out[f"{name}.q_b_proj"] = Colwise(block_input=False)
            for child in ("q_a_proj", "q_a_layernorm"):
                out[f"{name}.{child}"] = ReplicatedWithGradAllReduce()
        out[f"{name}.kv_b_proj"] = Colwise(block_input=False)
        out[f"{name}.o_proj"] = Rowwise()
        for child in ("kv_a_proj_with_mqa", "kv_a_layernorm"):
            out[f"{name}.{child}"] = ReplicatedWithGradAllReduce()
    return out


def sequence_local_block(
    name: str,
    block: torch.nn.Module,
    local: Collection[str],
    inside: Callable[[str], bool],
    gather: Callable[[str, torch.nn.Module], None],
    entries: dict[str, list[Style]],
) -> None:
    """The entries of a layer child ``name`` holding the sequence-local modules ``local``
    (module notes): ``gather(child_name, child)`` for each child with plan entries
    (``inside``), ``sequence_parallel`` for each other child with parameters."""
    if list(block.parameters(recurse=False)):
        raise InputValueError(
            f"{name} ({type_name(block)}) holds parameters of its own beside its "
            "sequence-local modules; sequence_parallel_plan tags children (the router), not "
            "the block's own parameters"
        )
    for child_name, child in block.named_children():
        full = f"{name}.{child_name}"
        if full in local:
            continue
        if any(n.startswith(full + ".") for n in local):
            raise InputValueError(
                f"{full} ({type_name(child)}) holds sequence-local modules one level deeper "
                "than sequence_parallel_plan reads: name modules that are direct children of "
                "a layer's child (the MoE block's experts)"
            )
        if inside(full):
            gather(full, child)
        elif list(child.parameters()):
            entries[full] = [SequenceParallelNorm()]


def check_sequence_local(model: torch.nn.Module, names: object) -> tuple[str, ...]:
    """``names`` as a tuple of module names of ``model``, or an error naming the value."""
    if isinstance(names, str) or not isinstance(names, Collection):
        raise InputValueError(
            f"sequence_local={names!r} must be a collection of module names (the MoE "
            "experts modules, e.g. ['model.layers.0.mlp.experts'])"
        )
    modules: Mapping[str, torch.nn.Module] = dict(model.named_modules())
    out = []
    for name in names:
        if not isinstance(name, str) or name not in modules or not name:
            raise InputValueError(
                f"sequence_local holds {name!r}, not a module name of {type_name(model)}"
            )
        out.append(name)
    return tuple(out)
