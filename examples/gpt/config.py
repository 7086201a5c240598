"""What the small GPT is and how it is split: the one place that declares both.

``GPTConfig`` holds the sizes of the model, ``ParallelLayout`` every parallelism choice
(TP × DP × PP sizes, virtual pipeline chunks, sequence parallelism, the distributed optimizer
and its instances, overlap, dtypes, per-token loss, micro-batches, buckets) and
``OptimizerConfig`` the AdamW hyperparameters shared by the parallel run and the 1-process
reference. ``ParallelLayout.check`` validates a layout
against a model and a world size before anything is built or communicated, so an
impossible layout is a ``ValueError`` that names the setting, its value and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

import mc_groups as mg
from mc_ddp import DistributedDataParallelConfig

__all__ = ["COMPILE_BACKENDS", "GPTConfig", "OptimizerConfig", "ParallelLayout"]

COMPILE_BACKENDS = ("inductor", "aot_eager")
"""``torch.compile`` backends :attr:`ParallelLayout.compile_backend` takes."""


_FIELDS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "gtp_remat_size": "gtp_remat",
}
"""Megatron's names of the sizes (``initialize_model_parallel``, ``validate_sizes``,
``ModelParallelConfig``) → :class:`ParallelLayout`'s fields."""
_LAYOUT_NAMES = re.compile(r"\b(" + "|".join(_FIELDS) + r")\b")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the GPT (a decoder-only transformer with a tied LM head).

    Attributes:
        vocab_size: V, tokens in the vocabulary (the embedding has V rows).
        hidden_size: h, the width of the residual stream.
        num_heads: attention heads; each has ``h / num_heads`` channels.
        num_layers: transformer blocks.
        seq_length: s, tokens per sequence (and rows of the position embedding).
        ffn_hidden_size: width of the MLP (``4·h`` when None).
        init_std: std of the normal initialisation of matrices and embeddings; the two
            projections that write into the residual stream use ``init_std / √(2·layers)``
            (GPT-2's scaling).
        num_query_groups: grouped-query attention: the heads share this many key/value
            heads (``num_heads`` must be a multiple); None is one per head (multi-head
            attention). The fused QKV weight holds ``(num_heads + 2·groups)·head_dim`` rows,
            laid out group by group as Megatron-Core does: each group's query heads, then
            its key head, then its value head.
        gated_mlp: SwiGLU MLP (Megatron's ``--swiglu``): fc1 makes ``2·F`` channels, a gate
            and an up projection, and the block computes ``fc2(silu(gate) · up)``.
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    seq_length: int = 16
    ffn_hidden_size: int | None = None
    init_std: float = 0.02
    num_query_groups: int | None = None
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_layers", "seq_length"):
            _positive(name, getattr(self, name))
        if self.ffn_hidden_size is not None:
            _positive("ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "every head needs the same number of channels"
            )
        if not self.init_std > 0:
            raise ValueError(f"init_std={self.init_std} must be > 0")
        if self.num_query_groups is not None:
            _positive("num_query_groups", self.num_query_groups)
            if self.num_heads % self.num_query_groups:
                raise ValueError(
                    f"num_heads={self.num_heads} is not divisible by num_query_groups="
                    f"{self.num_query_groups}; every key/value head serves the same number "
                    "of query heads"
                )

    @property
    def ffn_size(self) -> int:
        """The MLP width (``ffn_hidden_size`` or ``4·hidden_size``)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads (``num_query_groups``, or ``num_heads`` without grouping)."""
        return self.num_query_groups or self.num_heads

    @property
    def fc1_size(self) -> int:
        """Rows of fc1's weight: ``2·F`` with the gated MLP, else ``F``."""
        return (2 if self.gated_mlp else 1) * self.ffn_size

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: ``(num_heads + 2·query_groups)·head_dim``."""
        return (self.num_heads + 2 * self.query_groups) * self.head_dim


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer of the parallel run and of the reference (``foreach=False`` on both
    sides, so both apply the same elementwise update).

    ``name="adamw"`` (the demo): ``torch.optim.AdamW(lr, betas, eps, weight_decay)``.
    ``name="sgd"`` (the parity tests): ``torch.optim.SGD(lr, momentum)``. SGD's update is
    linear in the gradient, so a wrong gradient scale (a missing 1/dp, a doubled sum) shows
    in the weights; Adam's update is invariant to it, and turns the rounding noise of
    near-zero gradients into visible updates. ``clip_grad``: the global grad norm is clipped
    to it before each step (``ShardedOptimizer(max_grad_norm=)`` in the parallel run,
    ``torch.nn.utils.clip_grad_norm_`` in the reference); None: no clipping.
    """

    name: str = "adamw"
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.9
    clip_grad: float | None = None

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"name={self.name!r} must be 'adamw' or 'sgd'")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip_grad={self.clip_grad} must be > 0 (None: no clipping)")

    def build(self, params: list[torch.Tensor] | list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, foreach=False)
        return torch.optim.AdamW(
            params,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            foreach=False,
        )


@dataclass(frozen=True)
class ParallelLayout:
    """How the GPT is split over ranks and trained (all parallel choices in one place).

    Attributes:
        tp: tensor-parallel size: heads, MLP columns and the vocabulary are split over it.
        dp: data-parallel size: each DP rank trains on ``global_batch / dp`` sequences.
        pp: pipeline stages (1 for the trainer; 2 in the pipeline test).
        vpp: virtual pipeline chunks per stage (Megatron's
            ``virtual_pipeline_model_parallel_size``), or None. Interleaved placement: chunk
            ``v`` of stage ``p`` is global chunk ``c = v·pp + p`` and holds blocks
            ``[c·L/(pp·vpp), (c+1)·L/(pp·vpp))``; the embedding is in chunk 0 (stage 0,
            ``v = 0``), the final LN and LM head in chunk ``pp·vpp − 1`` (last stage, last
            ``v``). Each chunk is its own model, wrapped in its own DDP.
        sequence_parallel: outside the TP region, activations hold ``s / tp`` rows.
        distributed_optimizer: reduce-scatter grads into this rank's shard, step the shard,
            all-gather the params (else: all-reduce grads, every rank steps every param).
        num_distributed_optimizer_instances: k optimizer instances: grads are reduce-scattered
            inside each instance's ``dp/k`` ranks, then each shard is all-reduced over the k
            instances (needs the distributed optimizer; k must divide dp).
        reduce_scatter_with_fp32_accumulation: the grad reduce-scatter moves grads in their
            own dtype and sums them in fp32, rounding once (distributed optimizer, one
            instance).
        overlap: overlap the grad reduction with backward and (distributed optimizer) the
            param all-gather with the next forward.
        params_dtype: dtype of the model params (fp32 masters live in the optimizer).
        grad_reduce_in_fp32: fp32 ``main_grad`` buffers and reductions.
        gradient_accumulation_fusion: weight grads accumulate straight into ``main_grad``.
        calculate_per_token_loss: the loss of a step is summed over (unmasked) tokens and
            the grads are divided by the global token count in ``finalize_model_grads``
            (``num_tokens``); DDP then sums over DP instead of averaging.
        microbatches: forward/backward passes per step and DP rank.
        bucket_size: elements per DDP bucket (small, so the small model has several; None:
            mc DDP's default, ``max(40M, 1M·dp)``).
        cp: context-parallel size: each CP rank holds ``s / cp`` consecutive positions of
            every sequence; attention all-gathers keys and values over the ``cp`` group
            (reduce-scatters their grads) and DDP reduces grads over ``dp × cp``.
        gtp_remat: ``gtp_remat_size`` of the layers (Column/Row weights sharded over this
            axis and all-gathered before each GEMM); a data axis for everything else.
        ep, etp: expert-parallel and expert-tensor-parallel sizes (``etp`` None: ``tp``).
            They shape the expert groups only: the GPT is dense, so no param is
            expert-parallel and nothing moves on those groups.
        compile_blocks: each transformer block's forward runs compiled
            (``torch.compile(block.forward, fullgraph=True)``; parameter names
            unchanged); the embedding, final LN and LM head stay eager.
        compile_backend: ``torch.compile``'s backend for ``compile_blocks``: one of
            :data:`COMPILE_BACKENDS` (``inductor``, generated code; ``aot_eager``, the
            same Dynamo and AOTAutograd graphs run by eager kernels, as torchtitan's
            ``compile.backend`` allows).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    reduce_scatter_with_fp32_accumulation: bool = False
    overlap: bool = True
    params_dtype: torch.dtype = torch.float32
    grad_reduce_in_fp32: bool = False
    gradient_accumulation_fusion: bool = False
    calculate_per_token_loss: bool = False
    microbatches: int = 2
    bucket_size: int | None = 8192
    cp: int = 1
    gtp_remat: int = 1
    ep: int = 1
    etp: int | None = None
    compile_blocks: bool = False
    compile_backend: str = "inductor"

    @property
    def world_size(self) -> int:
        """``tp · gtp_remat · cp · dp · pp``: the ranks this layout needs."""
        return self.tp * self.gtp_remat * self.cp * self.dp * self.pp

    def check(self, model: GPTConfig, world_size: int, global_batch: int) -> None:
        """Raise ``ValueError`` when this layout cannot split ``model`` over ``world_size``
        ranks with ``global_batch`` sequences per step (checked before any collective).

        The parallel sizes themselves (each an int >= 1 within the world, ``vpp`` only with
        ``pp > 1``, the expert layout tiling the world, the optimizer instances) are
        :func:`mc_groups.validate_sizes`' checks, its messages naming this layout's fields;
        what is checked here is the demo's: the sizes' product is the world, the model and
        the batch split over them."""
        for name in ("dp", "microbatches"):
            _positive(name, getattr(self, name))
        _positive("global_batch", global_batch)
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(
                f"compile_backend={self.compile_backend!r} must be one of "
                f"{', '.join(COMPILE_BACKENDS)}"
            )
        self._check_instances()  # the demo's rule (k divides dp), before mc's (k divides dp·cp)
        self._validate_sizes(world_size)
        if self.world_size != world_size:
            raise ValueError(
                f"{self._product()} = {self.world_size}, but the world has {world_size} "
                f"ranks; choose sizes whose product is {world_size}"
            )
        self._check_tp_split(model)
        self._check_context_split(model)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True needs tp > 1: sequence parallelism splits activations "
                "over the tensor-parallel ranks; raise tp or turn sequence parallelism off"
            )
        if model.num_layers % self.pp:
            raise ValueError(
                f"num_layers={model.num_layers} is not divisible by pp={self.pp}; every stage "
                "holds the same number of layers"
            )
        self._check_virtual_chunks(model)
        per_microbatch = self.dp * self.microbatches
        if global_batch % per_microbatch:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by dp × microbatches = "
                f"{self.dp} × {self.microbatches} = {per_microbatch}; each micro-batch of "
                "each DP rank holds the same number of sequences"
            )

    def _validate_sizes(self, world_size: int) -> None:
        """:func:`mc_groups.validate_sizes` of this layout, Megatron's argument names in its
        messages replaced by the fields here (``tensor_model_parallel_size`` → ``tp``)."""
        try:
            mg.validate_sizes(world_size, **self.group_sizes())
        except (TypeError, ValueError) as err:
            message = _LAYOUT_NAMES.sub(lambda m: _FIELDS[m[0]], str(err))
            raise type(err)(message) from None

    def _check_virtual_chunks(self, model: GPTConfig) -> None:
        if self.vpp is None:
            return
        chunks = self.pp * self.vpp
        if model.num_layers % chunks:
            raise ValueError(
                f"num_layers={model.num_layers} is not divisible by pp × vpp = {self.pp} × "
                f"{self.vpp} = {chunks}; every virtual chunk holds the same number of layers"
            )

    def _check_instances(self) -> None:
        k = _positive(
            "num_distributed_optimizer_instances", self.num_distributed_optimizer_instances
        )
        if self.dp % k:
            raise ValueError(
                f"num_distributed_optimizer_instances={k} does not divide dp={self.dp}; each "
                "instance shards the optimizer over dp / k ranks"
            )

    def _product(self) -> str:
        """``tp × dp × pp = 2 × 2 × 1`` (with cp and gtp_remat when they are not 1)."""
        names = ["tp", "gtp_remat", "cp", "dp", "pp"]
        shown = [n for n in names if n in ("tp", "dp", "pp") or getattr(self, n) != 1]
        values = " × ".join(str(getattr(self, n)) for n in shown)
        return f"{' × '.join(shown)} = {values}"

    def _check_context_split(self, model: GPTConfig) -> None:
        if model.seq_length % self.cp:
            raise ValueError(
                f"seq_length={model.seq_length} is not divisible by cp={self.cp}; context "
                "parallelism gives every CP rank the same number of positions"
            )
        local = model.seq_length // self.cp
        if self.sequence_parallel and local % self.tp:
            raise ValueError(
                f"seq_length / cp = {model.seq_length} / {self.cp} = {local} is not divisible "
                f"by tp={self.tp}; sequence parallelism splits each CP rank's positions over "
                "the TP ranks"
            )

    def _check_tp_split(self, model: GPTConfig) -> None:
        splits = {
            "hidden_size": model.hidden_size,
            "num_heads": model.num_heads,
            "num_query_groups": model.query_groups,
            "vocab_size": model.vocab_size,
            "ffn_hidden_size": model.ffn_size,
        }
        if self.sequence_parallel and self.cp == 1:
            splits["seq_length"] = model.seq_length
        for name, value in splits.items():
            if value % self.tp:
                raise ValueError(
                    f"{name}={value} is not divisible by tp={self.tp}; tensor parallelism "
                    f"splits it evenly over the TP ranks: choose a {name} that is a multiple "
                    f"of {self.tp} or a tp that divides {value}"
                )

    def initialize_groups(self) -> mg.ProcessGroupCollection:
        """Every process group of this layout (collective: every rank calls it, after
        ``torch.distributed.init_process_group``); destroy with
        ``mc_groups.destroy_model_parallel``."""
        return mg.initialize_model_parallel(**self.group_sizes())

    def group_sizes(self) -> dict[str, Any]:
        """This layout's sizes under Megatron's argument names, as
        ``initialize_model_parallel`` and ``validate_sizes`` take them."""
        sizes = {name: getattr(self, field) for name, field in _FIELDS.items()}
        sizes["num_distributed_optimizer_instances"] = self.num_distributed_optimizer_instances
        return sizes

    def model_parallel_config(self) -> mg.ModelParallelConfig:
        """The config the mc layers read (weights are loaded, so no initialisation runs)."""
        sizes = {name: getattr(self, field) for name, field in _FIELDS.items()}
        return mg.ModelParallelConfig(
            **sizes,
            sequence_parallel=self.sequence_parallel,
            params_dtype=self.params_dtype,
            use_cpu_initialization=True,
            perform_initialization=False,
            bf16=self.params_dtype == torch.bfloat16,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            calculate_per_token_loss=self.calculate_per_token_loss,
        )

    def ddp_config(self) -> DistributedDataParallelConfig:
        """The mc DDP settings of this layout."""
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
            overlap_grad_reduce=self.overlap,
            overlap_param_gather=self.overlap and self.distributed_optimizer,
            use_distributed_optimizer=self.distributed_optimizer,
            num_distributed_optimizer_instances=self.num_distributed_optimizer_instances,
            reduce_scatter_with_fp32_accumulation=self.reduce_scatter_with_fp32_accumulation,
            bucket_size=self.bucket_size,
        )

    def describe(self) -> str:
        """One line, e.g. ``TP=2 × DP=2, sequence parallel, distributed optimizer, ...``."""
        sizes = [("TP", self.tp), ("GTP", self.gtp_remat), ("CP", self.cp), ("DP", self.dp)]
        sizes.append(("PP", self.pp))
        shown = [f"{n}={v}" for n, v in sizes if n in ("TP", "DP") or v > 1]
        parts = [" × ".join(shown)]
        if self.ep > 1 or self.etp is not None:
            parts.append(f"expert groups EP={self.ep} × ETP={self.etp or self.tp}")
        if self.vpp is not None:
            parts.append(f"{self.vpp} virtual chunks per stage")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        parts.append("distributed optimizer" if self.distributed_optimizer else "all-reduce")
        if self.num_distributed_optimizer_instances > 1:
            parts.append(f"{self.num_distributed_optimizer_instances} optimizer instances")
        if self.reduce_scatter_with_fp32_accumulation:
            parts.append("fp32-accumulating reduce-scatter")
        if self.calculate_per_token_loss:
            parts.append("per-token loss")
        if self.overlap:
            gather = " and param gather" if self.distributed_optimizer else ""
            parts.append(f"overlapped grad reduce{gather}")
        parts.append(str(self.params_dtype).removeprefix("torch.") + " params")
        if self.compile_blocks:
            parts.append(f"blocks compiled ({self.compile_backend})")
        return ", ".join(parts)
