"""What ``test_check.py`` hands the layout check: model builders, plans, hooks and finalize
functions, at module level so that the ranks import them by name (as a user's would be)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import mc_groups as mg
from examples import hf_3d
from mc_groups import param_attrs
from mc_moe.state import expert_params
from mc_tp_layers import sequence_parallel_plan
from mc_train import StageInfo


class _Block(nn.Module):
    """``x + down(relu(up(norm(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class TinyLM(nn.Module):
    """A plain-PyTorch language model (no ``transformers``: its ranks start in a second):
    embedding, two MLP blocks, a final norm and a head tied to the embedding."""

    tp_plan: dict[str, str] = {  # noqa: RUF012 (read-only, as transformers' class plans)
        "embed": "embedding_rowwise",
        "layers.*.up": "colwise",
        "layers.*.down": "rowwise",
        "head": "colwise_gather_output",
    }

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([_Block(width) for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def tiny() -> nn.Module:
    """:class:`TinyLM`, seeded."""
    torch.manual_seed(0)
    return TinyLM()


def tiny_plan_without_down(model: nn.Module) -> dict[str, Any]:
    """:class:`TinyLM`'s plan without ``down``: ``up`` splits its output, which the whole
    ``down`` then reads as if whole."""
    return {k: v for k, v in TinyLM.tp_plan.items() if not k.endswith("down")}


def llama() -> nn.Module:
    """The HF 3D example's Llama (4 blocks, tied embeddings)."""
    return hf_3d.build_model()


def qwen2() -> nn.Module:
    """A tiny ``transformers`` Qwen2 (q/k/v biases, untied head), seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(1)
    return Qwen2ForCausalLM(config)


def demo_gpt(config: mg.ModelParallelConfig, pg_collection: mg.ProcessGroupCollection) -> nn.Module:
    """The demo's GPT, built from mc's layers for the layout (Megatron style), loaded with
    the demo's seeded one-process weights."""
    from examples.gpt.config import GPTConfig
    from examples.gpt.model import GPT
    from examples.gpt.weights import init_full_weights, load_full_weights

    cfg = GPTConfig(num_query_groups=2)
    model = GPT(cfg, config, pg_collection)
    load_full_weights(model, init_full_weights(cfg, seed=0), pg_collection.require("tp", "GPT"))
    return model


def gpt_forward(module: nn.Module, x: torch.Tensor, stage: StageInfo) -> torch.Tensor:
    """The GPT's calling convention: tokens into the first stage, hidden states into the
    others; the last returns its logits (``[s, b, V/TP]``)."""
    out: torch.Tensor = module(x, None) if stage.is_first else module(None, None, x)
    return out


def sp_plan_without_norms(model: nn.Module) -> dict[str, Any]:
    """The SP plan with the norms' ``sequence_parallel`` entries left out (a hand-written
    plan that forgot them)."""
    return {k: v for k, v in sequence_parallel_plan(model).items() if v != "sequence_parallel"}


def skip_finalize(chunks: Any, num_tokens: Any = None, pg_collection: Any = None) -> None:
    """A loop that forgets ``finalize_model_grads``."""


def ddp_sync_only(chunks: Any, num_tokens: Any = None, pg_collection: Any = None) -> None:
    """A loop that waits for DDP's grad reduction (``finish_grad_sync``) and forgets the rest
    of ``finalize_model_grads`` (tied embeddings, sequence-parallel grads)."""
    for chunk in chunks:
        chunk.finish_grad_sync()


def mark_final_norm_summed(chunk: nn.Module, stage: StageInfo) -> None:
    """An ``after_parallelize`` hook: the final norm marked as a partial sum over TP, though
    without SP every TP rank computes its whole gradient."""
    for name, param in chunk.named_parameters():
        if name == "model.norm.weight":
            param_attrs.mark_sum_gradients_across_tp_domain(param)


def mixtral() -> nn.Module:
    """The tiny Mixtral of ``examples/hf_moe.py`` (4 experts, top-2, every layer MoE)."""
    from examples.hf_moe import build_model

    return build_model("mixtral")


def untag_experts(chunk: nn.Module, stage: StageInfo) -> None:
    """An ``after_parallelize`` hook: the expert params lose their ``allreduce=False`` tag
    (what a hand-rolled expert split forgets)."""
    for _, param, _ in expert_params(chunk):
        param_attrs.mark_allreduce(param, True)


def strip_marks(chunk: nn.Module, stage: StageInfo) -> None:
    """An ``after_parallelize`` hook: every param loses its Python attributes, mc's marks
    included (what ``fully_shard`` did to them before mc recorded the marks: pytorch
    #136929)."""
    for param in chunk.parameters():
        vars(param).clear()
