"""The buffer on a CUDA device: allocation follows the params, offload keeps a pinned CPU
copy and reload restores it (non-blocking copies ordered on the current stream).

Skipped with the reason when no CUDA device is visible. Exact comparisons: values are
copied, never computed.
"""

from __future__ import annotations

import pytest
import torch

from mc_buffers import ParamAndGradBuffer
from mc_buffers_tests._params import linears
from mc_groups.testing import gpu_skip_reason

_REASON = gpu_skip_reason(1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_cuda_buffer_offload_round_trip() -> None:
    ps = [torch.nn.Parameter(p.detach().cuda()) for p in linears(3, width=33)]
    values = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(
        ps, bucket_size=1000, use_distributed_optimizer=True, data_parallel_size=8
    )
    assert buf.param_data is not None
    assert buf.grad_data.device == ps[0].device == buf.param_data.device
    before = torch.cuda.memory_allocated()
    buf.offload_to_cpu()
    assert torch.cuda.memory_allocated() < before  # both storages went back to the allocator
    assert buf.param_data_cpu is not None
    assert buf.param_data_cpu.is_pinned()
    buf.reload_from_cpu()
    torch.cuda.synchronize()
    for p, v in zip(ps, values, strict=True):
        assert torch.equal(p.detach(), v)
    assert torch.count_nonzero(buf.grad_data).item() == 0
