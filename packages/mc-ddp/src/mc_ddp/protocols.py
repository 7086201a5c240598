"""What :class:`~mc_ddp.DistributedDataParallel` reads from the transformer config.

Structural (``typing.Protocol``): Megatron's ``TransformerConfig``, mc-groups'
``ModelParallelConfig`` or any object with these attributes qualifies. Optional attributes
read with a default: ``cuda_graph_impl`` (``"none"``; ``"transformer_engine"`` keeps
``grad_added_to_main_grad`` across ``zero_grad_buffer``, as Megatron does).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["TransformerConfigLike"]


class TransformerConfigLike(Protocol):
    """The config attribute DDP needs.

    ``calculate_per_token_loss``: losses are summed per token and normalised later by the
    global token count, so DDP must not average gradients over data-parallel ranks
    (gradient scaling factor 1 instead of 1/dp).
    """

    @property
    def calculate_per_token_loss(self) -> bool:
        """Gradients are un-normalised sums (no 1/dp averaging in DDP)."""
        ...
