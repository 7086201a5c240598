"""mc-buffers: Megatron-Core's contiguous param/grad buffers and their bucket layouts.

Memory and layout only; nothing here communicates (``mc_ddp`` does, over these buffers).

- :class:`BufferKey`, :func:`group_params_for_buffers`: one buffer per
  (param dtype, grad dtype, expert-parallel) key.
- :func:`pad_to_divisor`, :func:`pad_param_start`, :func:`pad_bucket_end`,
  :func:`bucket_end_divisor`: the distributed optimizer's padding arithmetic.
- :class:`PerBufferParamLayout`, :class:`FullParamLayout` and the pure layout functions
  :func:`compute_default_per_buffer_param_layout`,
  :func:`compute_distributed_optimizer_param_layout`, :func:`compute_full_param_layout`.
- :class:`ParamAndGradBuffer` (``grad_data``, ``param_data``, ``param.main_grad`` views,
  ``buckets``, ``reset``, ``scale_gradients``, ``offload_to_cpu`` / ``reload_from_cpu``),
  :class:`ParamAndGradBucket` (with per-shard views), :func:`shard_buffer`,
  :func:`build_param_and_grad_buffers` (one buffer per key).
- :func:`as_full_param_layout`, :func:`as_per_buffer_param_layout`: a layout Megatron-Core
  computed (any object with the same fields) adopted as mc's.
- :class:`OffloadedView`: what ``param.main_grad`` is while its buffer is offloaded
  (every operation on it raises, naming the param and ``reload_from_cpu`` /
  ``restore_grad_buffers``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mc_buffers.adopt import (
    BufferKeyLike,
    FullParamLayoutLike,
    PerBufferParamLayoutLike,
    as_full_param_layout,
    as_per_buffer_param_layout,
)
from mc_buffers.bucket import ParamAndGradBucket, ShardParamSlice, shard_buffer
from mc_buffers.buffer import ParamAndGradBuffer
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.keys import BufferKey, group_params_for_buffers, is_expert_parallel_param
from mc_buffers.layout import (
    FullParamLayout,
    PerBufferParamLayout,
    compute_default_per_buffer_param_layout,
    compute_distributed_optimizer_param_layout,
    compute_full_param_layout,
)
from mc_buffers.offloaded import OffloadedView
from mc_buffers.padding import (
    PARAM_START_ALIGNMENT,
    bucket_end_divisor,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)

try:  # one source of the version: the distribution's pyproject.toml
    __version__ = version("mc-buffers")
except PackageNotFoundError:  # a checkout on sys.path, not installed (scripts/gpu_check.py)
    __version__ = "0+unknown"

__all__ = [
    "PARAM_START_ALIGNMENT",
    "BufferKey",
    "BufferKeyLike",
    "FullParamLayout",
    "FullParamLayoutLike",
    "OffloadedView",
    "ParamAndGradBucket",
    "ParamAndGradBuffer",
    "PerBufferParamLayout",
    "PerBufferParamLayoutLike",
    "ShardParamSlice",
    "as_full_param_layout",
    "as_per_buffer_param_layout",
    "bucket_end_divisor",
    "build_param_and_grad_buffers",
    "compute_default_per_buffer_param_layout",
    "compute_distributed_optimizer_param_layout",
    "compute_full_param_layout",
    "group_params_for_buffers",
    "is_expert_parallel_param",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
    "shard_buffer",
]
