"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_random.py``.

Upstream's tracker holds CUDA generator states; mc's :class:`mc_tp_layers.RNGStatesTracker`
holds the states of one device's generator, here the CPU's (the backend-independent part:
a stream seeded with s is the generator state ``manual_seed(s)`` gives, and forking swaps
states in and out). Expectations are fresh ``torch.Generator`` objects seeded by hand.

``test_model_parallel_cuda_manual_seed`` (the process tracker holds
``model-parallel-rng`` after seeding) is held by
``test_random.py::test_seeding_registers_the_default_tracker``.

Activation checkpointing (``checkpoint``, ``CheckpointWithoutOutput``) is held by
``test_activation_checkpoint.py`` (parity with the plain run, dropout included) and
``test_mapping_functions.py`` (``distribute_saved_activations`` on two ranks); the
tracker's constructor and ``set_states`` of a non-tensor value by ``test_random.py``.

Not covered (mc offers no such API): the CUDA-graph-safe tracker
(``use_cudagraphable_rng``, refused with ``NotImplementedError``) and
``convert_cuda_rng_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mc_tp_layers.random import CudaRNGStatesTracker


def _seeded_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def test_cuda_rng_states_tracker() -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_random.py::test_cuda_rng_states_tracker``.

    ``set_states`` then ``get_states`` gives back the state set; ``reset`` leaves no stream
    (``get_states() == {}``); a stream added with seed s holds the state ``manual_seed(s)``
    gives (upstream compares with ``torch.cuda.manual_seed(s)``'s state); calling ``fork``
    without entering the context changes nothing. The refusals of a reused seed or name
    are held by ``test_random.py::test_states_round_trip_and_errors``. Upstream's test
    stores the int 1234 (Megatron checks no value); mc carries such a value too
    (``test_random.py::test_set_states_carries_values_that_are_not_tensors``).
    """
    tracker = CudaRNGStatesTracker(device="cpu")
    state = _seeded_state(1234)
    tracker.set_states({"state1": state})
    assert torch.equal(tracker.get_states()["state1"], state)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("state2", 1111)
    tracker.fork("state2")  # a context manager that is never entered: no effect
    assert list(tracker.get_states()) == ["state2"]
    assert torch.equal(tracker.get_states()["state2"], _seeded_state(1111))


def _fork_pattern(nested: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    tracker = CudaRNGStatesTracker(device="cpu")
    tracker.add("state1", 1234)
    tracker.add("state2", 5678)
    one: list[torch.Tensor] = []
    two: list[torch.Tensor] = []
    draw: Callable[[], torch.Tensor] = lambda: torch.randn(10)  # noqa: E731
    if nested:
        with tracker.fork("state1"):
            one.append(draw())
            with tracker.fork("state2"):
                two.append(draw())
                with tracker.fork("state1"):
                    one.append(draw())
                two.append(draw())
            one.append(draw())
    else:
        with tracker.fork("state1"):
            one.extend(draw() for _ in range(3))
        with tracker.fork("state2"):
            two.extend(draw() for _ in range(2))
    return one, two, tracker.get_states()


def test_double_fork_cuda_rng_states_tracker() -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_random.py::test_double_fork_cuda_rng_states_tracker``
    (the ``use_cudagraphable_rng=False`` case; the graph-safe tracker is not offered).

    Forking state1, then state2 inside it, then state1 again inside that, draws the same
    numbers from each stream as two plain forks, and leaves both streams in the same final
    states. The draws alone are also held by ``test_random.py::
    test_nested_forks_keep_each_stream_one_sequence``; the final states are held here.
    """  # noqa: E501
    one_nested, two_nested, states_nested = _fork_pattern(nested=True)
    one_plain, two_plain, states_plain = _fork_pattern(nested=False)
    for a, b in zip(one_nested + two_nested, one_plain + two_plain, strict=True):
        assert torch.equal(a, b)
    stream1 = torch.Generator().manual_seed(1234)
    expected = [torch.randn(10, generator=stream1) for _ in range(3)]
    assert torch.equal(torch.cat(one_plain), torch.cat(expected))  # the stream is seed 1234
    for name in ("state1", "state2"):
        assert torch.equal(states_nested[name], states_plain[name])
