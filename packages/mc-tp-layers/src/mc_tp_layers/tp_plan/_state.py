"""Back to one piece: the full, original-named state dict of a parallelized model, and
loading one into it (each rank keeps its shard)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError
from mc_tp_layers.tp_plan._layers import ConvertedModule

__all__ = ["full_state_dict", "load_full_state_dict"]


def _converted(module: torch.nn.Module) -> list[tuple[str, ConvertedModule]]:
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    return [
        (f"{name}." if name else "", sub)
        for name, sub in module.named_modules()
        if isinstance(sub, ConvertedModule)
    ]


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every converted tensor gathered whole, on every rank.

    The keys and shapes are those of the unconverted model, so the result loads into it
    (``load_state_dict``, then ``save_pretrained``). Collectives: one all-gather over the TP
    group per split tensor (column weights and biases, row weights, embedding tables), in
    module order, on every rank (call it on all TP ranks). Under mc DDP with
    ``overlap_param_gather`` the last step's parameters arrive with the next forward: call
    ``mc_ddp.ensure_params_ready(model.parameters())`` first.
    """
    converted = _converted(module)
    state = module.state_dict()
    with torch.no_grad():
        for prefix, sub in converted:
            for pname, param in sub.named_parameters(recurse=False):
                state[prefix + pname] = sub.unshard(pname, param.detach())
    return state


def load_full_state_dict(
    module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load an unconverted model's state dict into a parallelized one: each converted
    tensor gets this rank's shard (no communication). This is how a model parallelized on
    the meta device gets its weights (``module.to_empty(device=...)`` first).

    ``strict`` as in ``torch.nn.Module.load_state_dict`` (missing/unexpected keys and shape
    mismatches raise there).
    """
    converted = _converted(module)
    if not isinstance(state_dict, Mapping):
        raise InputTypeError(f"state_dict must be a mapping, got {type_name(state_dict)}")
    local = dict(state_dict)
    for prefix, sub in converted:
        for pname, _ in sub.named_parameters(recurse=False):
            key = prefix + pname
            if key in local:
                local[key] = sub.shard(pname, local[key])
    module.load_state_dict(local, strict=strict)
