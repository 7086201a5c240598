"""What finalize_model_grads needs from a model chunk and from its config.

Both are structural (``typing.Protocol``): mc-ddp's ``DistributedDataParallel``, Megatron's
own DDP wrapper, or a hand-made ``nn.Module`` all qualify, and so does Megatron's
``TransformerConfig`` or mc-groups' ``ModelParallelConfig``.

Only the attributes every config has are declared here. Everything else a step reads is
optional and defaults the way Megatron-Core defaults it (see :mod:`mc_finalize._settings`):
``qk_layernorm=False``, ``has_cond_embedder=False``, ``flextron=False``,
``moe_router_enable_expert_bias=False``, ``moe_router_bias_update_rate=1e-3``,
``moe_router_load_balancing_type="aux_loss"``, ``moe_router_quantile_balancing_ema=0.0``,
``mtp_num_layers=None``, ``gtp_remat_size=1``, ``expert_gtp_remat_size=1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = ["FinalizeConfig", "ModelChunk"]


class FinalizeConfig(Protocol):
    """The config attributes every step may read without a default.

    ``sequence_parallel``: layer-norm-like params marked ``sequence_parallel`` saw only
    this rank's slice of the sequence, so their grads are partial sums over tp.
    ``calculate_per_token_loss``: losses are summed per token and divided by the global
    token count at the end of finalize (changes the gtp_remat reduction from AVG to SUM).
    """

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism is on."""
        ...

    @property
    def calculate_per_token_loss(self) -> bool:
        """Grads are un-normalised sums, divided by ``num_tokens`` in finalize."""
        ...


class ModelChunk(Protocol):
    """One pipeline (or virtual-pipeline) chunk of the model held by this rank.

    ``finish_grad_sync`` completes the data-parallel reduction of the chunk's grads
    (``force_all_reduce=True`` all-reduces even under the distributed optimizer);
    ``scale_gradients`` multiplies every grad of the chunk by ``scaling_factor``.
    Grads are read from ``param.main_grad`` when the attribute exists, else ``param.grad``.
    Steps that look for routers also call ``modules()`` when the chunk has it.
    """

    @property
    def config(self) -> FinalizeConfig:
        """The chunk's config (finalize reads ``model[0].config``)."""
        ...

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Finish the data-parallel grad reduction of this chunk."""
        ...

    def scale_gradients(self, scaling_factor: float) -> None:
        """``grad ← scaling_factor · grad`` for every grad of this chunk."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``(name, param)`` pairs; names must match across pipeline ranks and chunks."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter of the chunk, each once."""
        ...
