r"""Full (1-process) weights of the GPT, and moving them into and out of a split model.

The full weights are a ``{name: tensor}`` dict with the GPT's parameter names, fp32 on CPU.
Both the parallel model and the 1-process reference start from the same dict, so they start
from the same numbers whatever the layout::

    full [n, k]  ──load_full_weights──▶  rank r's part: chunk r of tp equal chunks along
                                         param.partition_dim (params mc marks
                                         tensor_model_parallel; with partition_stride s,
                                         chunk r of each of s equal parts), the whole
                                         tensor otherwise;
                                         of a gtp_remat shard, its rows of that (padded)
    rank parts   ──gather_full_weights─▶ full [n, k]: one all-gather over TP per split param

``output_layer.weight`` (the last stage's copy of the tied table in a pipeline) is loaded
from and gathered as ``embedding.word_embeddings.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mc_groups as mg
from examples.gpt.config import GPTConfig

__all__ = [
    "WORD_EMBEDDING",
    "full_shapes",
    "gather_full_weights",
    "init_full_weights",
    "load_full_weights",
]

WORD_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT_WEIGHT = "output_layer.weight"


def full_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the 1-process GPT and its shape, in registration order."""
    h, f = cfg.hidden_size, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {
        WORD_EMBEDDING: (cfg.vocab_size, h),
        "embedding.position_embeddings.weight": (cfg.seq_length, h),
    }
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm.bias": (h,),
            p + "self_attention.linear_qkv.weight": (cfg.qkv_size, h),
            p + "self_attention.linear_proj.weight": (h, h),
            p + "self_attention.linear_proj.bias": (h,),
            p + "pre_mlp_layernorm.weight": (h,),
            p + "pre_mlp_layernorm.bias": (h,),
            p + "mlp.linear_fc1.weight": (cfg.fc1_size, h),
            p + "mlp.linear_fc1.bias": (cfg.fc1_size,),
            p + "mlp.linear_fc2.weight": (h, f),
            p + "mlp.linear_fc2.bias": (h,),
        }
    shapes |= {"decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,)}
    return shapes


def _init_value(
    name: str, shape: tuple[int, ...], cfg: GPTConfig, gen: torch.Generator
) -> torch.Tensor:
    if name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * cfg.num_layers)  # GPT-2: writes into the residual stream
    return torch.randn(shape, generator=gen) * std


def init_full_weights(cfg: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """The 1-process GPT's initial weights (fp32, CPU): N(0, init_std²) matrices and
    embeddings (residual-stream projections N(0, (init_std/√(2·layers))²)), layer norms
    weight 1 and bias 0, linear biases 0; drawn in :func:`full_shapes` order from a
    generator seeded with ``seed``, so every rank and the reference get the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return {name: _init_value(name, shape, cfg, gen) for name, shape in full_shapes(cfg).items()}


def _full_name(name: str) -> str:
    return WORD_EMBEDDING if name == _OUTPUT_WEIGHT else name


def _split(param: nn.Parameter) -> tuple[int, int] | None:
    """``(dim, stride)`` of ``param``'s split over TP, or None when it is whole on every
    rank. With stride s the full tensor is s equal parts along ``dim`` (a fused weight,
    e.g. the gated MLP's ``[gate; up]``) and rank r holds block r of each part, in order
    (Megatron's ``partition_stride``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    stride = int(getattr(param, "partition_stride", 1))
    return int(param.partition_dim), stride  # type: ignore[attr-defined]


def _tp_part(source: torch.Tensor, split: tuple[int, int], rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s part of ``source`` (see :func:`_split`)."""
    dim, stride = split
    blocks = source.chunk(stride * size, dim)  # part j's block r is blocks[j·size + r]
    return torch.cat(blocks[rank::size], dim) if stride > 1 else blocks[rank]


def _tp_full(parts: list[torch.Tensor], split: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`_tp_part`: the full tensor from every rank's part."""
    dim, stride = split
    pieces = [p.chunk(stride, dim) for p in parts]
    return torch.cat([piece[j] for j in range(stride) for piece in pieces], dim)


def _gtp_rows(param: nn.Parameter, part: torch.Tensor) -> torch.Tensor:
    """For a gtp_remat-sharded weight (``is_gtp_weight_remat``, mc-tp-layers'
    ``shard_weight_for_gtp``): this rank's rows of the TP part, zero-padded to the shard
    size; ``part`` itself for any other param."""
    if not getattr(param, "is_gtp_weight_remat", False):
        return part
    rows, pad = param.shape[0], int(param.pad_length)  # type: ignore[attr-defined]
    rank = mg.group_rank(param.group)  # type: ignore[attr-defined]
    return F.pad(part, (0, 0, 0, pad))[rank * rows : (rank + 1) * rows]


def _named(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    yield from model.named_parameters()


@torch.no_grad()
def load_full_weights(
    model: nn.Module, full: Mapping[str, torch.Tensor], tp_group: dist.ProcessGroup
) -> None:
    """Copy this rank's part of every full weight into ``model``'s params (cast to their
    dtype, moved to their device). Call before wrapping the model in DDP. No communication.

    Raises ``ValueError`` naming the parameter when ``full`` lacks it or its shape does not
    split into the param's shape over ``tp_group``.
    """
    rank, size = mg.group_rank(tp_group), mg.group_size(tp_group)
    for name, param in _named(model):
        key = _full_name(name)
        if key not in full:
            raise ValueError(f"full weights have no {key!r} (for parameter {name!r})")
        source = full[key]
        split = _split(param)
        part = source if split is None else _tp_part(source, split, rank, size)
        part = _gtp_rows(param, part)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: rank {rank}'s part of the full {tuple(source.shape)} weight has shape "
                f"{tuple(part.shape)}, but the parameter has {tuple(param.shape)}"
            )
        param.copy_(part)


@torch.no_grad()
def gather_full_weights(model: nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The full weights of ``model`` (fp32 clones on CPU), keyed like :func:`full_shapes`.

    Collective over ``tp_group``: one all-gather per split parameter, in registration order.
    """
    size = mg.group_size(tp_group)
    out: dict[str, torch.Tensor] = {}
    for name, param in _named(model):
        split = _split(param)
        value = param.detach()
        if split is not None and size > 1:
            gathered = torch.empty(size * value.numel(), dtype=value.dtype, device=value.device)
            mg.all_gather(gathered, value.contiguous().view(-1), tp_group, label="gather weights")
            value = _tp_full(list(gathered.view(size, *value.shape).unbind(0)), split)
        out[_full_name(name)] = value.to(device="cpu", dtype=torch.float32).clone()
    return out
