"""Device helpers are no-ops on CPU (the GPU branch is exercised where CUDA exists)."""

from __future__ import annotations

import pytest
import torch

from mc_groups import device


def test_cpu_streams_are_null() -> None:
    s = device.current_stream(torch.device("cpu"))
    side = device.side_stream("cpu")
    assert isinstance(s, device.NullStream)
    assert isinstance(side, device.NullStream)
    s.wait_stream(side)  # ordering on CPU needs nothing
    with device.stream_scope(side):
        assert torch.ones(2).sum().item() == 2.0


def test_cpu_sync_and_cache_are_no_ops() -> None:
    device.synchronize("cpu")
    device.empty_cache(torch.device("cpu"))
    device.synchronize(None)


def test_graph_capture_is_false_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: capture state depends on the current stream")
    assert device.is_graph_capturing() is False
