r"""The 1-process reference: the same GPT written directly in plain PyTorch.

No mc code runs here: the forward is written batch-first (``[B, s, h]``, where the mc model
is sequence-first), attention is spelled out (scores, causal mask, softmax) instead of
``scaled_dot_product_attention``, the loss is ``F.cross_entropy`` over the full vocabulary
and the optimizer is ``torch.optim.AdamW`` on the full tensors. It sees the whole global
batch at once (no micro-batches, no data-parallel split)::

    loss(W, tokens) = mean over B·s tokens of CE(x · Eᵀ, next token),
    x = LN_f(blocks(E[tokens] + P[:s]))

so the parallel run's per-step loss, ``(1/dp) Σ_dp (1/m) Σ_microbatch mean CE``, is the same
number when micro-batches hold equal token counts. With a loss mask ``M`` (1 = the token
counts) the reference takes the mean over the unmasked tokens of the whole batch,
``Σ M·CE / Σ M``: what a per-token-loss run (``calculate_per_token_loss``, grads divided by
the global token count) computes whatever the micro-batches' counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from examples.gpt.config import GPTConfig, OptimizerConfig
from examples.gpt.weights import WORD_EMBEDDING

__all__ = ["ReferenceRun", "reference_grads", "reference_loss", "train_reference"]

Weights = Mapping[str, torch.Tensor]


def _layer_norm(x: torch.Tensor, w: Weights, prefix: str) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w[prefix + ".weight"] + w[prefix + ".bias"]


def _qkv(x: torch.Tensor, w: Weights, p: str, cfg: GPTConfig) -> list[torch.Tensor]:
    """Queries, keys and values, each ``[B, heads, s, d]`` (grouped keys and values repeated
    for each query head of their group)."""
    batch, s, _ = x.shape
    if cfg.query_groups == cfg.num_heads:
        qkv = (x @ w[p + "linear_qkv.weight"].T).view(batch, s, cfg.num_heads, 3, cfg.head_dim)
        return list(qkv.permute(3, 0, 2, 1, 4).unbind(0))
    per = cfg.num_heads // cfg.query_groups  # query heads per key/value head
    rows = (x @ w[p + "linear_qkv.weight"].T).view(batch, s, cfg.query_groups, per + 2, -1)
    q = rows[:, :, :, :per].reshape(batch, s, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k, v = (rows[:, :, :, i].repeat_interleave(per, dim=2).transpose(1, 2) for i in (per, per + 1))
    return [q, k, v]


def _attention(x: torch.Tensor, w: Weights, p: str, cfg: GPTConfig) -> torch.Tensor:
    batch, s, _ = x.shape
    q, k, v = _qkv(x, w, p, cfg)
    scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    context = (probs @ v).transpose(1, 2).reshape(batch, s, cfg.hidden_size)
    return context @ w[p + "linear_proj.weight"].T + w[p + "linear_proj.bias"]


def _mlp(x: torch.Tensor, w: Weights, p: str, cfg: GPTConfig) -> torch.Tensor:
    hidden = x @ w[p + "linear_fc1.weight"].T + w[p + "linear_fc1.bias"]
    if cfg.gated_mlp:  # fc1's rows: the gate's F, then the up projection's F
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    return hidden @ w[p + "linear_fc2.weight"].T + w[p + "linear_fc2.bias"]


def reference_loss(
    w: Weights, cfg: GPTConfig, tokens: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy of the GPT with weights ``w`` on ``tokens``
    (``[B, s + 1]``: inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``); with
    ``loss_mask`` (``[B, s]``, 1 where the target counts) ``Σ mask·CE / Σ mask``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    s = inputs.shape[1]
    x = w[WORD_EMBEDDING][inputs] + w["embedding.position_embeddings.weight"][:s]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        x = x + _attention(_layer_norm(x, w, p + "input_layernorm"), w, p + "self_attention.", cfg)
        x = x + _mlp(_layer_norm(x, w, p + "pre_mlp_layernorm"), w, p + "mlp.", cfg)
    x = _layer_norm(x, w, "decoder.final_layernorm")
    logits = x @ w[WORD_EMBEDDING].T
    if loss_mask is None:
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    losses = F.cross_entropy(
        logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), reduction="none"
    )
    mask = loss_mask.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum()


def reference_grads(
    full: Weights, cfg: GPTConfig, tokens: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and the gradient of every weight at ``full`` on ``tokens`` (masked mean
    with ``loss_mask``, see :func:`reference_loss`)."""
    params = {k: v.detach().clone().requires_grad_() for k, v in full.items()}
    loss = reference_loss(params, cfg, tokens, loss_mask)
    torch.autograd.backward(loss)
    return float(loss.detach()), {k: p.grad for k, p in params.items() if p.grad is not None}


@dataclass
class ReferenceRun:
    """What :func:`train_reference` returns: the loss before each step, the final weights
    and, with ``clip_grad``, each step's global grad norm before clipping."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)


def train_reference(
    full: Weights,
    cfg: GPTConfig,
    opt: OptimizerConfig,
    batch: Callable[[int], torch.Tensor],
    steps: int,
    loss_mask: Callable[[int], torch.Tensor] | None = None,
) -> ReferenceRun:
    """Train the plain-PyTorch GPT from ``full`` for ``steps`` steps of ``opt`` on
    ``batch(step)`` (the whole global batch, ``[B, s + 1]`` tokens) in fp32 on CPU; with
    ``loss_mask``, step ``t``'s loss is the mean over the tokens ``loss_mask(t)`` keeps."""
    params = {k: v.detach().to(torch.float32).clone().requires_grad_() for k, v in full.items()}
    optimizer = opt.build(list(params.values()))
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        mask = None if loss_mask is None else loss_mask(step).cpu()
        loss = reference_loss(params, cfg, batch(step).cpu(), mask)
        torch.autograd.backward(loss)
        if opt.clip_grad is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), opt.clip_grad)
            norms.append(float(norm))
        optimizer.step()
        losses.append(float(loss.detach()))
    return ReferenceRun(losses, {k: p.detach().clone() for k, p in params.items()}, norms)
