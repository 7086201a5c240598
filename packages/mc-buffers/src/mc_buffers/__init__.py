"""mc-buffers: Megatron-Core's contiguous param/grad buffers and their bucket layouts.

Memory and layout only; nothing here communicates (``mc_ddp`` does, over these buffers).

- :class:`BufferKey`, :func:`group_params_for_buffers`: one buffer per
  (param dtype, grad dtype, expert-parallel) key.
- :func:`pad_to_divisor`, :func:`pad_param_start`, :func:`pad_bucket_end`,
  :func:`bucket_end_divisor`: the distributed optimizer's padding arithmetic.
- :class:`PerBufferParamLayout`, :class:`FullParamLayout` and
  :func:`compute_default_per_buffer_param_layout` (the pure layout functions, the
  distributed optimizer's and the full layout included, are in :mod:`mc_buffers.layout`).
- :class:`ParamAndGradBuffer` (``grad_data``, ``param_data``, ``param.main_grad`` views,
  ``buckets``, ``reset``, ``scale_gradients``, ``offload_to_cpu`` / ``reload_from_cpu``),
  its buckets (:class:`~mc_buffers.buffer.ParamAndGradBucket`, with per-shard views),
  :func:`shard_buffer`; one buffer per key: :mod:`mc_buffers.build`.
- A layout Megatron-Core computed (any object with the same fields) is adopted as mc's by
  :mod:`mc_buffers.adopt`.
- :class:`OffloadedView`: what ``param.main_grad`` is while its buffer is offloaded
  (every operation on it raises, naming the param and ``reload_from_cpu`` /
  ``restore_grad_buffers``).
"""

from __future__ import annotations

from mc_buffers.buffer import ParamAndGradBuffer, shard_buffer
from mc_buffers.keys import BufferKey, group_params_for_buffers
from mc_buffers.layout import (
    FullParamLayout,
    PerBufferParamLayout,
    compute_default_per_buffer_param_layout,
)
from mc_buffers.offloaded import OffloadedView
from mc_buffers.padding import (
    bucket_end_divisor,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)
from mc_groups import package_version

__version__ = package_version("mc-buffers")

__all__ = [
    "BufferKey",
    "FullParamLayout",
    "OffloadedView",
    "ParamAndGradBuffer",
    "PerBufferParamLayout",
    "bucket_end_divisor",
    "compute_default_per_buffer_param_layout",
    "group_params_for_buffers",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
    "shard_buffer",
]
