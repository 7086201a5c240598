"""A tiny mixture-of-experts decoder laid out as torchtitan 0.3.0 lays out its MoE models
(DeepSeek-V3, Llama-4, Qwen3 in ``torchtitan.models``), for tests and examples that cannot
import torchtitan (see :mod:`examples.titan_llama` for why). Written from the layout, not
copied. What matches torchtitan's ``torchtitan/models/moe/moe.py``:

- each block's ``moe`` module (in place of ``feed_forward``) holds ``router``
  (``TokenChoiceTopKRouter``: ``gate`` ``nn.Linear(dim, E)``, softmax scores in float32,
  top-k), ``reorderer`` (the (token, expert) rows sorted by expert, stable), ``experts``
  (``GroupedExperts``: ``w1`` ``[E, I, H]``, ``w2`` ``[E, H, I]``, ``w3`` ``[E, I, H]``,
  ``forward(x, num_tokens_per_expert)`` on rows already grouped by expert: each expert's
  SwiGLU ``w2(silu(w1 x) · w3 x)`` on its rows, torchtitan's for-loop path) and
  ``shared_experts`` (a SwiGLU ``FeedForward``), the routing scores applied to the rows
  before the experts (``score_before_experts``), the outputs summed back per token;
- the ``tokens_per_expert`` buffer (not saved) counting the routed tokens, and no
  ``expert_bias`` (``load_balance_coeff=None``: torchtitan updates that bias in its own
  optimizer hook, which mc does not run).

The model returns the logits ``[b, s, vocab]``; its loss is the mean next-token cross
entropy (no load-balancing loss: torchtitan's MoE models train without one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.titan_llama import DIM, SEQ, VOCAB, FeedForward, GQAttention, TitanLlama

__all__ = [
    "BATCH",
    "EXPERTS",
    "GroupedExperts",
    "MoE",
    "TitanMoE",
    "build_model",
    "global_batch",
    "reference",
]

BATCH, EXPERTS, TOP_K, EXPERT_HIDDEN, LAYERS = 8, 4, 2, 32, 2
LR, MOMENTUM = 0.5, 0.9


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights; ``forward(x, num_tokens_per_expert)`` takes the rows
    grouped by expert (expert 0's first) and returns their outputs in the same order."""

    def __init__(self, num_experts: int = EXPERTS, hidden: int = EXPERT_HIDDEN) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, DIM) * 0.2)
        self.w2 = nn.Parameter(torch.randn(num_experts, DIM, hidden) * 0.2)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, DIM) * 0.2)
        self.use_grouped_mm = False

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = [int(n) for n in num_tokens_per_expert.tolist()]
        outs = []
        for e, rows in enumerate(torch.split(x[: sum(counts)], counts, dim=0)):
            h = F.silu(rows @ self.w1[e].transpose(-2, -1)) * (rows @ self.w3[e].transpose(-2, -1))
            outs.append(h @ self.w2[e].transpose(-2, -1))
        return torch.cat(outs, dim=0)


class TokenChoiceTopKRouter(nn.Module):
    """Softmax scores of ``gate(x)`` in float32, each token's top-k experts; returns
    ``(top_scores [T, k], selected [T, k], tokens per expert [E])``."""

    def __init__(self, num_experts: int = EXPERTS, top_k: int = TOP_K) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts).float()
        return top_scores, selected, counts


class TokenReorderer(nn.Module):
    """The (token, expert) rows sorted by expert (stable): their scores, their tokens and
    the rows per expert."""

    def __init__(self, num_experts: int = EXPERTS, top_k: int = TOP_K) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(
        self, top_scores: torch.Tensor, selected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts).float()
        order = torch.argsort(selected.reshape(-1), stable=True)
        return top_scores.reshape(-1)[order], order // self.top_k, counts


class MoE(nn.Module):
    """Routed experts plus a shared expert: ``shared(x) + Σ_j s_tj · expert_{e_tj}(x_t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts()
        self.router = TokenChoiceTopKRouter()
        self.reorderer = TokenReorderer()
        self.shared_experts = FeedForward(EXPERT_HIDDEN)
        self.score_before_experts = True
        self.load_balance_coeff = None
        self.expert_bias = None
        self.tokens_per_expert: torch.Tensor
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)
        top_scores, selected, counts = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        scores, tokens, counts = self.reorderer(top_scores, selected)
        index = tokens.reshape(-1, 1).expand(-1, dim)
        routed = torch.gather(x, 0, index)
        routed = (routed.to(torch.float32) * scores.reshape(-1, 1)).to(x.dtype)
        shared: torch.Tensor = self.shared_experts(x)
        out = shared.scatter_add(0, index, self.experts(routed, counts))
        return out.reshape(bs, slen, dim)


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x)); out = h + moe(ffn_norm(h))``."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = GQAttention(fused=False)
        self.moe = MoE()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)

    def forward(
        self, x: torch.Tensor, attention_masks: object, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), attention_masks, positions)
        out: torch.Tensor = h + self.moe(self.ffn_norm(h))
        return out


class TitanMoE(TitanLlama):
    """:class:`examples.titan_llama.TitanLlama` (``tok_embeddings``, ``layers`` as an
    ``nn.ModuleDict``, ``norm``, ``lm_head``; returns the logits) with MoE blocks."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__(fused=False, layers=layers)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(layers)})


def build_model(seed: int = 0) -> TitanMoE:
    """The tiny model, seeded (the same weights on every rank)."""
    torch.manual_seed(seed)
    return TitanMoE()


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ + 1]`` token ids of ``step`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    generator = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy of ``ids`` (``[b, SEQ + 1]``)."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def reference(steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: SGD with momentum on the whole global batch; the losses
    and the final weights."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, global_batch(step))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
