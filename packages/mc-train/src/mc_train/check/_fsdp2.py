"""The layout's step under FSDP2 (``data_parallel="fsdp2"``): the model, converted by the
plan, in :class:`mc_ddp.TorchFullyShardedDataParallel` (PyTorch's ``fully_shard`` over the
DP group, mc's marks kept), one stage (``build_pipeline`` wraps stages in mc DDP only).

One step on this DP rank's rows, as :meth:`mc_train.Pipeline.forward_backward` does it::

    zero_grad_buffer()
    for each of M micro-batches (no_sync() on all but the last):
        loss_m = Σ_t ℓ_t / n_m / M        (per-token losses of the workload's loss)
        backward(loss_m)                  FSDP2 reduce-scatters grads over dp in the last
    finalize(chunks, pg_collection=...)   the TP sums (SP norms, row biases), tied weights
    loss = Σ_DP Σ_m loss_m / DP           one all-reduce over dp ("loss for logging")

The optimizer is ``torch.optim.SGD`` over the DTensor params (each rank steps its shard).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

import mc_groups as mg
from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from mc_train.loss import IGNORE_INDEX, TokenLoss
from mc_train.stages import StageForward, StageInfo

__all__ = ["Fsdp2Step"]


class Fsdp2Step:
    """What the check's loop needs of a pipeline (``chunks``, ``parameters()``,
    ``forward_backward``) for one FSDP2-wrapped stage (module notes)."""

    def __init__(
        self,
        model: nn.Module,
        config: mg.ModelParallelConfig,
        pg_collection: mg.ProcessGroupCollection,
        microbatches: int,
        loss_fn: TokenLoss,
        forward: StageForward,
        finalize: Callable[..., None],
    ) -> None:
        # torch 2.13 caches DTensor sharding propagation by mesh layout: a process that
        # built and destroyed groups before (a reused rank) would resolve a new FSDP2
        # param's mesh to a destroyed group. No public way to empty it.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # noqa: PLC0415

        _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
        self.chunk = TorchFullyShardedDataParallel(
            config, TorchFullyShardedDataParallelConfig(), model, pg_collection=pg_collection
        )
        self.chunks = [self.chunk]
        self.pg_collection = pg_collection
        self.microbatches = microbatches
        self._loss_fn, self._forward, self._finalize = loss_fn, forward, finalize

    def parameters(self) -> list[nn.Parameter]:
        """The wrapped model's params (DTensors sharded over dp)."""
        return list(self.chunk.parameters())

    def forward_backward(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """One step's micro-batches, backwards and finalize; the loss over DP."""
        self.chunk.zero_grad_buffer()
        m = self.microbatches
        total = torch.zeros((), dtype=torch.float32)
        pieces = zip(inputs.chunk(m), target.chunk(m), strict=True)
        for i, (x, t) in enumerate(pieces):
            with nullcontext() if i == m - 1 else self.chunk.no_sync():
                out = self._forward(self.chunk, x, StageInfo(0, 1, 0))
                count = (t != IGNORE_INDEX).sum().clamp(min=1)
                loss = self._loss_fn(out, t).sum() / count / m
                torch.autograd.backward(loss)
            total += loss.detach().float()
        self._finalize(self.chunks, num_tokens=None, pg_collection=self.pg_collection)
        dp = self.pg_collection.require("dp", "the check's FSDP2 step")
        mg.all_reduce(total, dp, label="loss for logging")
        return float(total) / mg.group_size(dp)
