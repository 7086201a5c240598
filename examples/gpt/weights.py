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

Both read the params' attributes through :mod:`mc_tp_layers.shards` (``local_shard``,
``gather_full``), the one place mc cuts and joins TP shards.

``output_layer.weight`` (the last stage's copy of the tied table in a pipeline) is loaded
from and gathered as ``embedding.word_embeddings.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from examples.gpt.config import GPTConfig
from mc_tp_layers.shards import gather_full, local_shard

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
    rank = mg.group_rank(tp_group)
    for name, param in _named(model):
        key = _full_name(name)
        if key not in full:
            raise ValueError(f"full weights have no {key!r} (for parameter {name!r})")
        source = full[key]
        part = local_shard(param, source, tp_group)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: rank {rank}'s part of the full {tuple(source.shape)} weight has shape "
                f"{tuple(part.shape)}, but the parameter has {tuple(param.shape)}"
            )
        param.copy_(part)


@torch.no_grad()
def gather_full_weights(model: nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The full weights of ``model`` (fp32 clones on CPU), keyed like :func:`full_shapes`.

    Collective over ``tp_group``: one all-gather per split parameter, in registration order
    (a gtp_remat shard first one over its gtp_remat group).
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in _named(model):
        value = gather_full(param, tp_group, label="gather weights")
        out[_full_name(name)] = value.to(device="cpu", dtype=torch.float32).clone()
    return out
