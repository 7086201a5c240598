"""Subclasses of ``nn.Linear`` / ``nn.Embedding`` whose ``forward`` does more than the base
class: ``parallelize`` replaces the module with mc's layer, which would silently drop that
extra step, so each is either understood or refused.

Understood: a scaled word embedding (Gemma's ``GemmaTextScaledWordEmbedding``: the lookup
times ``embed_scale`` cast to the table's dtype). Its scale is read from the float
``scalar_embed_scale`` or the one-element ``embed_scale`` and, when the table is not on
``meta``, checked against the module's own output on a few ids (no communication). An
embedding without a scale whose ``forward`` is a plain lookup (torchtitan's ``Embedding``
before its own parallelization: ``F.embedding`` of the whole table) is checked the same
way, with scale 1: its output on the first ids must equal the table's rows exactly (on
``meta`` there is nothing to compare, and it is refused).
"""

from __future__ import annotations

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError

__all__: list[str] = []


def check_plain_linear(label: str, module: torch.nn.Linear) -> None:
    """Refuse an ``nn.Linear`` subclass that overrides ``forward``."""
    if type(module).forward is not torch.nn.Linear.forward:
        raise InputTypeError(
            f"{label}: {type_name(module)} overrides nn.Linear.forward, which mc's "
            "tensor-parallel linear layer would replace (its extra step would be lost); keep "
            "the module replicated (drop the entry)"
        )


def embedding_scale(label: str, module: torch.nn.Embedding) -> float | None:
    """``None`` for a plain ``nn.Embedding``; the scale of a scaled word embedding; else an
    error naming the module."""
    if type(module).forward is torch.nn.Embedding.forward:
        return None
    scale = _read_scale(module)
    plain = scale is None and module.weight.device.type != "meta"
    if plain and _scaled_lookup_matches(module, 1.0):  # its forward is a plain lookup
        return None
    if scale is None or not _scaled_lookup_matches(module, scale):
        raise InputTypeError(
            f"{label}: {type_name(module)} overrides nn.Embedding.forward, and mc understands "
            "only a scaled lookup (a float scalar_embed_scale or a one-element embed_scale "
            "multiplying the rows) or a plain lookup (checked on its first ids, off the meta "
            "device), which this is not; keep the module replicated (drop the entry)"
        )
    return scale


def _read_scale(module: torch.nn.Module) -> float | None:
    scalar = getattr(module, "scalar_embed_scale", None)
    if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
        return float(scalar)
    tensor = getattr(module, "embed_scale", None)
    if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and tensor.device.type != "meta":
        return float(tensor.item())
    return None


def _scaled_lookup_matches(module: torch.nn.Embedding, scale: float) -> bool:
    weight = module.weight
    if weight.device.type == "meta":
        return True  # nothing to compare on meta: the scale attribute is the evidence
    ids = torch.arange(min(8, module.num_embeddings), device=weight.device)
    with torch.no_grad():
        got = module(ids)
        want = torch.nn.functional.embedding(ids, weight) * torch.tensor(scale).to(weight.dtype)
    return isinstance(got, torch.Tensor) and torch.allclose(got, want, rtol=1e-6, atol=0.0)
