"""A tiny ``transformers`` Llama built from a config (no hub), its data and its one-process
reference: the model the library tests train, which is not the demo's GPT.

The reference trains the whole model on the whole global batch with ``transformers``' own
loss (``model(input_ids, labels=...).loss``: the mean cross-entropy of the next token over
the counted positions), so the pipeline's loss reduction is checked against an independent
implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VOCAB, SEQ, BATCH = 64, 16, 8
IGNORE = -100


def build(*, tie: bool = False, layers: int = 4, seed: int = 0) -> PreTrainedModel:
    """A 4-block ``LlamaForCausalLM`` (hidden 32, 4 heads, 2 KV heads), the same weights for
    the same seed on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def labels(step: int, *, padded: bool) -> torch.Tensor:
    """``transformers``' labels of ``step`` (the ids; with ``padded``, the last
    ``row mod 5`` positions of each row ignored: uneven counts per row)."""
    ids = batch(step).clone()
    if padded:
        for row in range(BATCH):
            if row % 5:
                ids[row, SEQ - row % 5 :] = IGNORE
    return ids


def targets(label: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``transformers`` labels (shifted by one, the last ignored)."""
    out = torch.full_like(label, IGNORE)
    out[:, :-1] = label[:, 1:]
    return out


@dataclass
class Reference:
    """Per-step losses and the final weights (state-dict names) of the one-process run."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def reference(
    *,
    tie: bool = False,
    steps: int = 3,
    padded: bool = False,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> Reference:
    """One process, plain PyTorch: the whole global batch per step."""
    model = build(tie=tie)
    make = optimizer or (lambda params: torch.optim.SGD(params, lr=0.5))
    opt = make(model.parameters())
    losses = []
    for step in range(steps):
        loss = model(input_ids=batch(step), labels=labels(step, padded=padded)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return Reference(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
