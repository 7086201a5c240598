"""mc-ddp: Megatron-Core's DistributedDataParallel over mc-buffers, through mc-groups.

- :class:`DistributedDataParallelConfig`: the validated DDP knobs (Megatron's names).
- :class:`DistributedDataParallel`: contiguous grad buffers, bucketed grad reduction
  (all-reduce, or reduce-scatter into this rank's shard with the distributed optimizer)
  overlapped with backward, ``no_sync``, param all-gather overlapped with forward.
- :func:`partition_buckets`: which buckets share a group; the per-group state machine
  (``start_grad_sync`` / ``finish_grad_sync`` / ``start_param_sync`` / ``finish_param_sync``)
  is :class:`~mc_ddp.bucket_group.ParamAndGradBucketGroup`.
- :class:`ShardedOptimizer`: any torch optimizer on fp32 masters of this rank's shard; its
  ``sharded_state_dict`` stores the state as
  :class:`~mc_ddp.checkpoint_pieces.CheckpointPieces` of full-param-shaped tensors, so
  ``torch.distributed.checkpoint`` reshards it across TP / DP layouts. Global grad-norm
  clipping (``max_grad_norm=``, ``clip_grad_norm``; the rule in :mod:`mc_ddp.grad_norm`),
  fp16 loss scaling
  (:class:`DynamicGradScaler`) and skipped steps, reported by ``step()`` as a
  :class:`StepResult`.
- :class:`TorchFullyShardedDataParallel`, :class:`TorchFullyShardedDataParallelConfig`:
  PyTorch's FSDP2 (``fully_shard``) over a tensor-parallel model, mc's param marks kept;
  :func:`clip_grad_norm`: the global grad norm, clipping and fp16 overflow agreement for
  grads in ``param.grad`` (FSDP2's DTensors, torchtitan's layout);
  :func:`optimizer_sharded_state_dict`, :func:`load_optimizer_sharded_state_dict`: a
  ``torch.optim`` optimizer over FSDP2's params checkpointed in ``ShardedOptimizer``'s keys
  (one checkpoint loads on either side, at any layout).
- :func:`ensure_params_ready`, :data:`PARAM_READY_CALLBACK_ATTR`: publish params on demand.
- :func:`reduce_scatter_with_fp32_accumulation`: all-to-all + local fp32 sum.
- :class:`NonFiniteGradError`: a bucket held NaN or Inf before its collective (the checks
  run before a collective: :mod:`mc_ddp.grad_checks`).
- :class:`DataParallelAgreementError`: ranks of a reduction group that built their DDP
  differently (compared once, at construction; every rank raises it).
"""

from __future__ import annotations

from mc_ddp._agreement import DataParallelAgreementError
from mc_ddp.bucket_group import partition_buckets
from mc_ddp.clip_grads import clip_grad_norm
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_ddp.fp32_reduce_scatter import reduce_scatter_with_fp32_accumulation
from mc_ddp.grad_checks import NonFiniteGradError
from mc_ddp.grad_scaler import DynamicGradScaler
from mc_ddp.hooks import PARAM_READY_CALLBACK_ATTR, ensure_params_ready
from mc_ddp.sharded_optimizer import ShardedOptimizer, StepResult
from mc_ddp.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from mc_ddp.torch_optimizer_state import (
    load_optimizer_sharded_state_dict,
    optimizer_sharded_state_dict,
)
from mc_groups import package_version

__version__ = package_version("mc-ddp")

__all__ = [
    "PARAM_READY_CALLBACK_ATTR",
    "DataParallelAgreementError",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DynamicGradScaler",
    "NonFiniteGradError",
    "ShardedOptimizer",
    "StepResult",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "clip_grad_norm",
    "ensure_params_ready",
    "load_optimizer_sharded_state_dict",
    "optimizer_sharded_state_dict",
    "partition_buckets",
    "reduce_scatter_with_fp32_accumulation",
]
