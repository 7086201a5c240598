"""A tiny Llama-3 laid out as torchtitan 0.3.0 lays out its own (module names, tree and
state-dict behaviour), for tests and examples that cannot import torchtitan.

torchtitan 0.3.0 imports on CPU with torch 2.13, but only with ``triton`` installed (its
expert-parallel kernels module, imported by the decoder, imports it unconditionally: about
1 GB installed), ``tyro``, ``docstring_parser`` and ``spmd_types``; mc's test environment does
not carry that, so this module rebuilds the structure instead (written from the layout, not
copied). What matches torchtitan's ``Llama3Model``:

- ``tok_embeddings``: an ``nn.Embedding`` subclass with a ``tp_group`` attribute whose
  ``forward`` is a plain lookup while it has none;
- ``layers``: an ``nn.ModuleDict`` ``"0"``, ``"1"``, … of blocks holding ``attention``
  (``qkv_linear`` with fused ``wqkv`` or separate ``wq`` / ``wk`` / ``wv``, ``wo``, ``rope``
  with its complex ``cache`` buffer, ``inner_attention``), ``feed_forward`` (``w1``, ``w2``,
  ``w3``: SwiGLU), ``attention_norm`` and ``ffn_norm`` (``nn.RMSNorm``);
- ``norm``, ``lm_head``; the forward ``model(tokens, positions=None, attention_masks=None)``
  returning the logits;
- the fused ``wqkv`` rows grouped per key/value head (each group's query heads, its key
  head, its value head), and its state-dict hooks: saving splits ``wqkv`` into ``wq`` /
  ``wk`` / ``wv``, loading merges them back, so a checkpoint has the unfused names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BATCH", "SEQ", "VOCAB", "TitanLlama", "build_model", "global_batch"]

SEQ, BATCH, VOCAB = 16, 4, 64
DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 32, 4, 2, 64, 2


class Embedding(nn.Embedding):
    """torchtitan's embedding: a plain lookup until its own parallelization sets
    ``tp_group`` (mc converts it to ``VocabParallelEmbedding`` instead)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp_group: object = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            raise NotImplementedError("torchtitan's own vocabulary parallelism is not rebuilt")
        return F.embedding(input, self.weight)


class RoPE(nn.Module):
    """Rotary embedding from a complex cache buffer ``cache`` of ``[max_seq, head_dim/2]``."""

    def __init__(self, head_dim: int, max_seq: int = SEQ, theta: float = 10000.0) -> None:
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), freqs)
        self.cache: torch.Tensor
        self.register_buffer(
            "cache", torch.polar(torch.ones_like(angles), angles), persistent=False
        )

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        turned = pairs * self.cache[: x.shape[1]].view(1, x.shape[1], 1, -1)
        return torch.view_as_real(turned).flatten(-2).type_as(x)

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotate(xq), self._rotate(xk)


class ScaledDotProductAttention(nn.Module):
    """Causal attention over ``[b, s, heads, head_dim]`` inputs."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_masks: object = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


class QKVLinear(nn.Module):
    """Separate ``wq``, ``wk``, ``wv``; each output viewed as local heads (``-1``: TP may
    have split them)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(DIM, HEADS * head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        return q, k, v


class FusedQKVLinear(nn.Module):
    """One ``wqkv`` whose rows hold, per key/value head, its ``heads_per_kv`` query heads,
    then its key head, then its value head; saved as ``wq`` / ``wk`` / ``wv``."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.heads_per_kv = HEADS // KV_HEADS
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(DIM, KV_HEADS * self.r_dim * head_dim, bias=False)
        self.register_state_dict_post_hook(self._split_on_save)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(self._merge_on_load)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        groups = self.wqkv(x).view(b, s, -1, self.r_dim, self.head_dim)
        q, k, v = torch.split(groups, [self.heads_per_kv, 1, 1], dim=3)
        return tuple(t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))  # type: ignore[return-value]

    @staticmethod
    def _split_on_save(
        module: FusedQKVLinear, state: dict[str, torch.Tensor], prefix: str, _meta: object
    ) -> None:
        fused = state.pop(f"{prefix}wqkv.weight")
        hd, hpk = module.head_dim, module.heads_per_kv
        grouped = fused.reshape(-1, hpk + 2, hd, fused.shape[-1])
        state[f"{prefix}wq.weight"] = grouped[:, :hpk].reshape(-1, fused.shape[-1]).contiguous()
        state[f"{prefix}wk.weight"] = grouped[:, hpk].reshape(-1, fused.shape[-1]).contiguous()
        state[f"{prefix}wv.weight"] = grouped[:, hpk + 1].reshape(-1, fused.shape[-1]).contiguous()

    @staticmethod
    def _merge_on_load(
        module: FusedQKVLinear, state: dict[str, torch.Tensor], prefix: str, *_: object
    ) -> None:
        keys = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
        if not all(k in state for k in keys):
            return
        wq, wk, wv = (state.pop(k) for k in keys)
        hd, width = module.head_dim, wq.shape[-1]
        groups = wk.shape[0] // hd
        parts = (wq.reshape(groups, -1, hd, width), wk.reshape(groups, 1, hd, width))
        merged = torch.cat([*parts, wv.reshape(groups, 1, hd, width)], dim=1)
        state[f"{prefix}wqkv.weight"] = merged.reshape(-1, width)


class GQAttention(nn.Module):
    """Grouped-query attention: ``qkv_linear``, ``rope``, ``inner_attention``, ``wo``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        head_dim = DIM // HEADS
        self.rope = RoPE(head_dim)
        self.qkv_linear: nn.Module = FusedQKVLinear(head_dim) if fused else QKVLinear(head_dim)
        self.wo = nn.Linear(HEADS * head_dim, DIM, bias=False)
        self.inner_attention = ScaledDotProductAttention()

    def forward(
        self, x: torch.Tensor, attention_masks: object, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.qkv_linear(x)
        q, k = self.rope(q, k, positions)
        out = self.inner_attention(q, k, v, attention_masks=attention_masks, enable_gqa=True)
        projected: torch.Tensor = self.wo(out.contiguous().flatten(2))
        return projected


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.attention = GQAttention(fused)
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)

    def forward(
        self, x: torch.Tensor, attention_masks: object, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), attention_masks, positions)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class TitanLlama(nn.Module):
    """The decoder: ``tok_embeddings``, ``layers`` (``nn.ModuleDict``), ``norm``,
    ``lm_head``; returns the logits ``[b, s, vocab]``."""

    def __init__(self, fused: bool = True, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(fused) for i in range(layers)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: object = None,
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions)
        logits: torch.Tensor = self.lm_head(self.norm(h))
        return logits


def build_model(fused: bool = True, seed: int = 0) -> TitanLlama:
    """The tiny model, seeded (the same weights on every rank)."""
    torch.manual_seed(seed)
    return TitanLlama(fused)


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ + 1]`` token ids of ``step`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
