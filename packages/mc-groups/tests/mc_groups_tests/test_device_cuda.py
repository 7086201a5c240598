"""mc_groups.device on a CUDA device: the one module that touches streams, synchronisation,
the allocator's cache and graph capture (``test_device.py`` holds the CPU no-ops).

Localizes what the packages above rely on when they overlap work: a side stream is a real,
separate stream; ``stream_scope`` makes it current and restores the previous one; work
ordered with ``wait_stream`` sees the other stream's results; ``is_graph_capturing`` is
true exactly inside a capture (DDP's hooks and ``ensure_params_ready`` return early there).
Skipped with the reason when no CUDA device is visible. Exact comparisons (copies and
doublings of small integers).
"""

from __future__ import annotations

import pytest
import torch

from mc_groups import device as mg_device
from mc_groups.testing import gpu_skip_reason

_REASON = gpu_skip_reason(1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_side_stream_is_separate_and_scoped() -> None:
    cuda = _cuda()
    main = mg_device.current_stream(cuda)
    side = mg_device.side_stream(cuda)
    assert isinstance(main, torch.cuda.Stream)
    assert isinstance(side, torch.cuda.Stream)
    assert side != main
    with mg_device.stream_scope(side):
        assert torch.cuda.current_stream(cuda) == side
    assert torch.cuda.current_stream(cuda) == main


def test_wait_stream_orders_work_across_streams() -> None:
    cuda = _cuda()
    main, side = mg_device.current_stream(cuda), mg_device.side_stream(cuda)
    assert isinstance(main, torch.cuda.Stream)
    assert isinstance(side, torch.cuda.Stream)
    x = torch.arange(1 << 20, device=cuda, dtype=torch.float32)
    side.wait_stream(main)  # x is written on the main stream
    with mg_device.stream_scope(side):
        y = x * 2
    main.wait_stream(side)
    y.record_stream(main)
    mg_device.synchronize(cuda)
    assert torch.equal(y.cpu(), torch.arange(1 << 20, dtype=torch.float32) * 2)


def test_empty_cache_returns_freed_blocks() -> None:
    cuda = _cuda()
    block = torch.empty(64 << 20, dtype=torch.uint8, device=cuda)
    reserved = torch.cuda.memory_reserved(cuda)
    del block
    mg_device.empty_cache(cuda)
    assert torch.cuda.memory_reserved(cuda) <= reserved - (64 << 20)


def test_graph_capturing_is_true_only_inside_a_capture() -> None:
    cuda = _cuda()
    static = torch.ones(4, device=cuda)
    seen: list[bool] = []
    graph = torch.cuda.CUDAGraph()
    assert not mg_device.is_graph_capturing()
    with torch.cuda.graph(graph):
        seen.append(mg_device.is_graph_capturing())
        static.mul_(2)
    seen.append(mg_device.is_graph_capturing())
    graph.replay()
    mg_device.synchronize(cuda)
    assert seen == [True, False]
    assert static.cpu().tolist() == [2.0] * 4  # a capture records the kernel; the replay runs it
