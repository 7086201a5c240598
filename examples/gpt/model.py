r"""A small GPT built only from mc parts, with Megatron-Core's parameter names.

::

    tokens [b, s]
      │ VocabParallelEmbedding (rows split over TP)  + position embedding
      ▼
    x [s, b, h]          ([s/tp, b, h] under sequence parallelism: the "SP region")
      │ × num_layers:  x += proj(attention(qkv(LN(x))))      qkv: Column, proj: Row
      │                x += fc2(gelu(fc1(LN(x))))             fc1: Column, fc2: Row
      ▼ final LN
    logits [s, b, V/tp] = x · Eᵀ   (Column LM head, weight = the embedding table E: tied)
      │ vocab_parallel_cross_entropy
      ▼ mean over tokens

Tensor parallelism (tp ranks) splits the heads (the fused QKV weight is laid out head by
head, ``[heads, 3, head_dim]`` rows, so rank r's contiguous rows are whole heads; with
grouped-query attention group by group, ``[groups, heads/groups + 2, head_dim]``), the MLP
columns and the vocabulary. Context parallelism (``cp`` ranks, used by the dry run) gives
each CP rank ``s/cp`` consecutive positions; attention all-gathers keys and values over
``cp``. Under sequence parallelism the word embedding is
reduce-scattered along the sequence and each rank adds the position rows of its own slice;
layer norms and the position table then see only ``s/tp`` rows, so their params are marked
``sequence_parallel`` and ``finalize_model_grads`` sums their grads over TP (as it does for
the Row layers' biases, which mc-tp-layers marks).

Pipeline stages (the pipeline tests): ``pre_process`` stages hold the embedding,
``post_process`` stages the final LN and the LM head; a last stage without the embedding
holds its own copy of E (``output_layer.weight``, marked ``shared_embedding``) whose grad
``finalize_model_grads`` sums with the first stage's over the ``embd`` group
(``share_embeddings_and_output_weights`` / ``shared_embedding_or_output_weight()`` are
Megatron's names, which finalize reads). With virtual pipeline chunks
(``mp.virtual_pipeline_model_parallel_size``) each chunk is a ``GPT`` built with its
``vp_stage``: only chunk 0 of the first stage embeds, only the last chunk of the last stage
computes the loss, as in Megatron-Core's ``GPTModel(vp_stage=...)``.

No attention biases: the key bias has an exactly zero gradient (softmax is invariant to a
shift of all scores of a query), so Adam turns its rounding noise into updates that differ
between any two runs; leaving it out keeps parity comparisons about real numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import mc_groups as mg
import mc_tp_layers as tpl
from examples.gpt.config import GPTConfig
from mc_groups.param_attrs import mark_sequence_parallel, record_marks
from mc_tp_layers.mappings import gather_from_sequence_parallel_region

__all__ = ["GPT", "LayerNorm", "TransformerLayer"]

_LN_EPS = 1e-5


def _no_init(_weight: torch.Tensor) -> None:
    """Layers are built with ``perform_initialization=False``; weights are loaded after."""


def _output(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output of a Column/Row layer (its second result, the bias, is None here)."""
    out: torch.Tensor = layer(x)[0]
    return out


class LayerNorm(nn.Module):
    """``F.layer_norm`` over the last dim with a weight and bias marked ``sequence_parallel``
    when the rows it sees are this rank's slice of the sequence."""

    def __init__(
        self, size: int, *, sequence_parallel: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
        for param in (self.weight, self.bias):
            mark_sequence_parallel(param, sequence_parallel)
        # kept by name on the module, as mc's layers keep theirs: mc's readers put the marks
        # back on the params that hold the names after FSDP2's fully_shard replaced them
        record_marks(self)

    @classmethod
    def for_model(
        cls, cfg: GPTConfig, mp: mg.ModelParallelConfig, device: torch.device
    ) -> LayerNorm:
        """A layer norm over the hidden size, in the params dtype, marked when SP is on."""
        return cls(
            cfg.hidden_size,
            sequence_parallel=mp.sequence_parallel,
            dtype=mp.params_dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / √(var + 1e-5) · weight + bias`` per row."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, _LN_EPS)


class _Build(NamedTuple):
    """What every part of the model is built from: sizes, layer config, groups, device."""

    cfg: GPTConfig
    mp: mg.ModelParallelConfig
    pgc: mg.ProcessGroupCollection
    device: torch.device

    def column(
        self, n_in: int, n_out: int, *, bias: bool, own_weight: bool = True, stride: int = 1
    ) -> tpl.ColumnParallelLinear:
        """``[.., n_in] → [.., n_out / tp]``: the weight's output rows split over TP (with
        ``stride`` s, rank r holds row block r of each of the s equal parts).

        Without ``own_weight`` the layer allocates no weight: forward gets ``weight=``.
        """
        return tpl.ColumnParallelLinear(
            n_in,
            n_out,
            config=self.mp,
            init_method=_no_init,
            bias=bias,
            stride=stride,
            skip_weight_param_allocation=not own_weight,
            pg_collection=self.pgc,
            device=self.device,
        )

    def row(self, n_in: int, n_out: int) -> tpl.RowParallelLinear:
        """``[.., n_in / tp] → [.., n_out]`` summed over TP (reduce-scattered under SP), + bias."""
        return tpl.RowParallelLinear(
            n_in,
            n_out,
            config=self.mp,
            init_method=_no_init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=self.pgc,
            device=self.device,
        )

    def layer_norm(self) -> LayerNorm:
        """A layer norm over the hidden size (see :meth:`LayerNorm.for_model`)."""
        return LayerNorm.for_model(self.cfg, self.mp, self.device)


class _SelfAttention(nn.Module):
    """Causal self-attention over this rank's heads (Column QKV, Row output projection).

    The QKV rows are laid out query group by query group (``[groups, heads/groups + 2,
    head_dim]``: the group's query heads, its key head, its value head; ``[heads, 3,
    head_dim]`` without grouping), so TP rank r's contiguous rows are whole groups. Under
    context parallelism (``cp`` > 1) this rank's queries are positions ``[c·s/cp,
    (c+1)·s/cp)`` of CP rank c; the keys and values of every position are all-gathered over
    ``cp`` (their grads reduce-scattered back), and the causal mask is shifted by ``c·s/cp``.
    """

    def __init__(self, build: _Build) -> None:
        super().__init__()
        cfg = build.cfg
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        tp = build.pgc.require("tp", "GPT attention")
        self.local_heads = cfg.num_heads // mg.group_size(tp)
        self.local_groups = cfg.query_groups // mg.group_size(tp)
        self.cp_group = build.pgc.cp
        self.linear_qkv = build.column(h, cfg.qkv_size, bias=False)
        self.linear_proj = build.row(h, h)

    def _cp(self) -> tuple[int, int]:
        """(this rank's CP rank, CP size); (0, 1) without a cp group."""
        if self.cp_group is None:
            return 0, 1
        return mg.group_rank(self.cp_group), mg.group_size(self.cp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h] → [s(/tp), b, h]``: QKV gathers the sequence, proj scatters it."""
        qkv = _output(self.linear_qkv, x)
        s, b = qkv.shape[0], qkv.shape[1]
        if self.local_groups == self.local_heads and self._cp()[1] == 1:
            shape = (s, b, self.local_heads, 3, self.head_dim)
            q, k, v = qkv.view(shape).permute(3, 1, 2, 0, 4).unbind()
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            context = self._grouped(qkv.view(s, b, self.local_groups, -1, self.head_dim))
        return _output(self.linear_proj, context.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _grouped(self, qkv: torch.Tensor) -> torch.Tensor:
        """Grouped-query and/or context-parallel attention of ``[s, b, groups, per + 2,
        d]``; returns ``[b, heads, s, d]``."""
        s, b, per = qkv.shape[0], qkv.shape[1], qkv.shape[3] - 2
        q = qkv[:, :, :, :per].reshape(s, b, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]  # [s, b, groups, d]
        cp_rank, cp_size = self._cp()
        if cp_size > 1:
            k = gather_from_sequence_parallel_region(k.contiguous(), group=self.cp_group)
            v = gather_from_sequence_parallel_region(v.contiguous(), group=self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or groups, s, d]
        if cp_size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=per > 1)
        rows = torch.arange(s, device=q.device) + cp_rank * s
        visible = torch.arange(s * cp_size, device=q.device) <= rows.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=per > 1)


class _MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with fc1 split by columns and fc2 by rows; with
    ``gated_mlp`` (SwiGLU) ``fc2(silu(gate) · up)``, where fc1 holds ``[gate; up]`` (2·F
    rows, partition stride 2: TP rank r holds ``[gate_r; up_r]``, as Megatron-Core's
    ``linear_fc1`` under ``--swiglu``)."""

    def __init__(self, build: _Build) -> None:
        super().__init__()
        cfg = build.cfg
        h, ffn, self.gated = cfg.hidden_size, cfg.ffn_size, cfg.gated_mlp
        stride = 2 if self.gated else 1
        self.linear_fc1 = build.column(h, stride * ffn, bias=True, stride=stride)
        self.linear_fc2 = build.row(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h] → [s(/tp), b, h]``."""
        hidden = _output(self.linear_fc1, x)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            return _output(self.linear_fc2, F.silu(gate) * up)
        return _output(self.linear_fc2, F.gelu(hidden))


class TransformerLayer(nn.Module):
    """Pre-LN block: ``x += attn(LN(x)); x += mlp(LN(x))`` (residuals in the SP region)."""

    def __init__(
        self,
        cfg: GPTConfig,
        mp: mg.ModelParallelConfig,
        pgc: mg.ProcessGroupCollection,
        device: torch.device,
    ) -> None:
        super().__init__()
        build = _Build(cfg, mp, pgc, device)
        self.input_layernorm = build.layer_norm()
        self.self_attention = _SelfAttention(build)
        self.pre_mlp_layernorm = build.layer_norm()
        self.mlp = _MLP(build)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        attention: torch.Tensor = self.self_attention(self.input_layernorm(x))
        x = x + attention
        mlp: torch.Tensor = self.mlp(self.pre_mlp_layernorm(x))
        return x + mlp


class _Decoder(nn.Module):
    """The blocks of this stage (keyed by global index) and, on the last stage, the final LN."""

    def __init__(self, build: _Build, indices: Iterable[int], *, final_norm: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TransformerLayer(*build) for i in indices})
        self.final_layernorm = build.layer_norm() if final_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every block in order, then the final LN when this stage has it."""
        for layer in self.layers.values():
            x = layer(x)
        return x if self.final_layernorm is None else self.final_layernorm(x)


class _Embedding(nn.Module):
    """Word embedding (vocabulary split over TP) plus a learned position embedding."""

    def __init__(self, build: _Build) -> None:
        super().__init__()
        cfg, mp, pgc, device = build
        tp = pgc.require("tp", "GPT embedding")
        self.sequence_parallel = mp.sequence_parallel
        self.tp_rank, self.tp_size = mg.group_rank(tp), mg.group_size(tp)
        self.cp_rank = 0 if pgc.cp is None else mg.group_rank(pgc.cp)
        self.word_embeddings = tpl.VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            init_method=_no_init,
            reduce_scatter_embeddings=mp.sequence_parallel,
            config=mp,
            pg_collection=pgc,
            device=device,
        )
        self.position_embeddings = nn.Embedding(
            cfg.seq_length, cfg.hidden_size, dtype=mp.params_dtype, device=device
        )
        # Under SP each rank adds only its own rows of the table: a partial grad over TP.
        mark_sequence_parallel(self.position_embeddings.weight, mp.sequence_parallel)
        record_marks(self.position_embeddings)  # as LayerNorm's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` ids → ``[s, b, h]`` (``[s/tp, b, h]``, rank r's rows, under SP).

        Under context parallelism ``tokens`` are CP rank c's ``s`` positions, which start at
        ``c·s`` of the full sequence."""
        s = tokens.shape[1]
        if self.sequence_parallel:
            words: torch.Tensor = self.word_embeddings(tokens)  # reduce-scattered: [s/tp, b, h]
            rows = s // self.tp_size
            start = self.cp_rank * s + self.tp_rank * rows
        else:
            words = self.word_embeddings(tokens).transpose(0, 1)  # all-reduced: [s, b, h]
            rows, start = s, self.cp_rank * s
        positions: torch.Tensor = self.position_embeddings(
            torch.arange(start, start + rows, device=tokens.device)
        )
        return (words + positions.unsqueeze(1)).contiguous()


class GPT(nn.Module):
    """The GPT of the module notes, or one pipeline stage of it.

    Args:
        cfg: model sizes.
        mp: the layers' config (TP size, sequence parallelism, params dtype, ...).
        pgc: groups (``tp`` is read; ``pp`` tells the stage when ``pre_process`` /
            ``post_process`` are left to default).
        device: where the params live.
        layers: global indices of the blocks this stage holds (default: all).
        pre_process: this stage embeds the tokens (default: first pipeline stage, and
            with ``vp_stage`` its chunk 0 only).
        post_process: this stage computes the loss (default: last pipeline stage, and
            with ``vp_stage`` its last chunk only,
            ``vp_stage == mp.virtual_pipeline_model_parallel_size − 1``).
        vp_stage: this chunk's index among the stage's virtual chunks (needs
            ``mp.virtual_pipeline_model_parallel_size``), or None without virtual chunks.

    ``forward(tokens, labels, hidden_states=None, per_token_loss=False)``: a
    ``pre_process`` stage embeds ``tokens``, any other stage starts from ``hidden_states``
    (``[s(/tp), b, h]``); a ``post_process`` stage returns the mean cross-entropy of
    predicting ``labels`` (``[b, s]``), or with ``per_token_loss`` each token's
    cross-entropy (``[b, s]``, Megatron's GPTModel output, to be masked and summed by the
    loss function); any other stage its output hidden states.
    """

    share_embeddings_and_output_weights = True

    def __init__(
        self,
        cfg: GPTConfig,
        mp: mg.ModelParallelConfig,
        pgc: mg.ProcessGroupCollection,
        device: torch.device | str = "cpu",
        *,
        layers: Iterable[int] | None = None,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.cfg, self.pg_collection, self.vp_stage = cfg, pgc, vp_stage
        vp_size = mp.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = mg.is_pipeline_first_stage(pgc, vp_stage, vp_size)
        if post_process is None:
            post_process = mg.is_pipeline_last_stage(pgc, vp_stage, vp_size)
        self.pre_process, self.post_process = pre_process, post_process
        indices = range(cfg.num_layers) if layers is None else list(layers)
        self.tp_group = pgc.require("tp", "GPT")
        build = _Build(cfg, mp, pgc, device)
        if self.pre_process:
            self.embedding = _Embedding(build)
        self.decoder = _Decoder(build, indices, final_norm=self.post_process)
        if self.post_process:
            # logits stay split over the vocabulary; a stage with the embedding passes E.
            # The table is not gtp_remat-sharded (VocabParallelEmbedding never is), so the
            # LM head that reads it (or its copy on the last stage) runs without gtp_remat.
            head = (
                build._replace(mp=mp.replace(gtp_remat_size=1)) if mp.gtp_remat_size > 1 else build
            )
            self.output_layer = head.column(
                cfg.hidden_size, cfg.vocab_size, bias=False, own_weight=not self.pre_process
            )
        self._mark_shared_embedding(pipeline_stages=mp.pipeline_model_parallel_size)

    def _mark_shared_embedding(self, pipeline_stages: int) -> None:
        weight = self.shared_embedding_or_output_weight()
        if weight is None:
            return
        if pipeline_stages == 1:
            # Megatron's setting for a weight used twice on one stage: the LM head's dummy
            # wgrad (gradient-accumulation fusion) is zeros, so the hook still adds the
            # embedding's own grad into main_grad.
            weight.zero_out_wgrad = True  # type: ignore[attr-defined]
        else:
            weight.shared_embedding = True  # type: ignore[attr-defined]

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The tied table E on this stage: the embedding's, or the last stage's copy."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(
        self,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None,
        hidden_states: torch.Tensor | None = None,
        per_token_loss: bool = False,
    ) -> torch.Tensor:
        """The stage's output: the mean loss or (``per_token_loss``) the ``[b, s]`` per-token
        losses on the last stage, hidden states elsewhere (see class). With ``labels=None``
        the last stage returns its logits, ``[s, b, V/tp]`` (split over the vocabulary),
        for a loss computed outside the model (a pipeline schedule's ``loss_fn``)."""
        x: torch.Tensor = self.decoder(self._stage_input(tokens, hidden_states))
        if not self.post_process:
            return x
        if labels is None:
            return self._logits(x)
        losses = self._token_losses(x, labels)  # [s, b]
        return losses.transpose(0, 1) if per_token_loss else losses.mean()

    def _stage_input(
        self, tokens: torch.Tensor | None, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        if self.pre_process:
            if tokens is None:
                raise ValueError(
                    "tokens=None on the pipeline stage with the embedding: pass the [b, s] "
                    "token ids"
                )
            embedded: torch.Tensor = self.embedding(tokens)
            return embedded
        if hidden is None:
            raise ValueError(
                "hidden_states=None on a pipeline stage without the embedding: pass the "
                "previous stage's output (shape [s, b, h], or [s/tp, b, h] under SP)"
            )
        return hidden

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, V/tp]``: the LM head (the SP input is gathered first)."""
        weight = self.embedding.word_embeddings.weight if self.pre_process else None
        logits: torch.Tensor = self.output_layer(x, weight=weight)[0]
        return logits

    def _token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[s, b]`` cross-entropy of each token (the same on every TP rank)."""
        logits = self._logits(x)
        losses: torch.Tensor = tpl.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1), tp_group=self.tp_group, vocab_size=self.cfg.vocab_size
        )
        return losses
