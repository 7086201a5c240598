"""The RNG tracker: named streams, fork nesting, and Megatron's seeds (single process).

Every expectation is a fresh ``torch.Generator`` seeded by hand: a stream must produce
exactly that generator's sequence however its draws are split across forks. Values are
compared with ``torch.equal`` (same generator, same draws).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_tp_layers as tpl
from mc_tp_layers.random import (
    CudaRNGStatesTracker,
    clear_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
    set_cuda_rng_tracker,
)


def _draws(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_fork_draws_the_stream_and_restores_the_default() -> None:
    tracker = tpl.RNGStatesTracker("cpu")
    tracker.add("a", 11)
    tracker.add("b", 22)
    torch.manual_seed(5)
    outside = [torch.rand(1)]
    with tracker.fork("a"):
        a1 = torch.rand(2)
    outside.append(torch.rand(1))
    with tracker.fork("a"):
        a2 = torch.rand(2)
    # the default generator is untouched by the forks; stream a continues across forks
    assert torch.equal(torch.cat(outside), _draws(5, 2))
    assert torch.equal(torch.cat([a1, a2]), _draws(11, 4))


def test_nested_forks_keep_each_stream_one_sequence() -> None:
    tracker = tpl.RNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 22)
    with tracker.fork("a"):
        a = [torch.rand(1)]
        with tracker.fork("b"):
            b = [torch.rand(1)]
            with tracker.fork("a"):  # A inside B inside A: continues A
                a.append(torch.rand(1))
                with tracker.fork("a"):  # the active stream again: no switch
                    a.append(torch.rand(1))
            b.append(torch.rand(1))
        a.append(torch.rand(1))
    assert torch.equal(torch.cat(a), _draws(11, 4))
    assert torch.equal(torch.cat(b), _draws(22, 2))


def test_states_round_trip_and_errors() -> None:
    tracker = tpl.RNGStatesTracker()
    tracker.add("a", 1)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="seed 1 already"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="'nope' was never added"), tracker.fork("nope"):
        pass
    tracker.reset()
    assert not tracker.is_initialized()


def test_model_parallel_seed_streams() -> None:
    tracker = tpl.model_parallel_cuda_manual_seed(
        100, tp_rank=3, ep_rank=2, etp_rank=1, device="cpu", set_default=False
    )
    expected = {
        get_data_parallel_rng_tracker_name(): 100,
        get_model_parallel_rng_tracker_name(): 100 + 2718 + 3,
        get_expert_parallel_rng_tracker_name(): 100 + 1024 + 100 * 2 + 1,
    }
    # the default generator is seeded with the data-parallel seed
    assert torch.equal(torch.rand(2), _draws(100, 2))
    for name, seed in expected.items():
        with tracker.fork(name):
            assert torch.equal(torch.rand(2), _draws(seed, 2)), name
    # Megatron's tracker class (isinstance checks on get_cuda_rng_tracker() hold)
    assert isinstance(tracker, CudaRNGStatesTracker)


def test_cuda_tracker_takes_megatrons_constructor() -> None:
    """``CudaRNGStatesTracker(use_cudagraphable_rng=False, is_inference_rng_tracker=False)``
    (megatron/core/tensor_parallel/random.py): the generator of the current CUDA device,
    CPU's without CUDA; the graph-safe variant is refused by name."""
    tracker = CudaRNGStatesTracker()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert tracker.device.type == expected
    assert isinstance(tracker, tpl.RNGStatesTracker)
    assert (tracker.use_cudagraphable_rng, tracker.is_inference_rng_tracker) == (False, False)
    assert CudaRNGStatesTracker(False, True).is_inference_rng_tracker
    cpu = CudaRNGStatesTracker(device="cpu")
    cpu.add("a", 11)
    with cpu.fork("a"):
        assert torch.equal(torch.rand(3), _draws(11, 3))
    with pytest.raises(NotImplementedError, match="use_cudagraphable_rng=True"):
        CudaRNGStatesTracker(use_cudagraphable_rng=True)
    with pytest.raises(TypeError, match="is_inference_rng_tracker"):
        CudaRNGStatesTracker(False, "yes")  # type: ignore[arg-type]


def test_set_states_carries_values_that_are_not_tensors() -> None:
    """Megatron's tracker stores any value (its test stores the int 1234; graph-safe and
    TE trackers hold ``torch.Generator`` objects): mc stores it and gives it back, refuses
    to fork it (a clear error naming the stream), and still checks tensors up front."""
    tracker = tpl.RNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.set_states({})
    assert tracker.is_initialized()  # as Megatron's: set once set_states() ran
    opaque = torch.Generator()
    tracker.set_states({"state1": 1234, "graph": opaque, "a": _state(7)})
    states = tracker.get_states()
    assert states["state1"] == 1234
    assert states["graph"] is opaque
    with tracker.fork("a"):
        assert torch.equal(torch.rand(2), _draws(7, 2))
    with pytest.raises(ValueError, match="stream 'state1' holds 1234"), tracker.fork("state1"):
        pass
    with pytest.raises(ValueError, match=r"states\['b'\] is torch.float32"):
        tracker.set_states({"b": torch.zeros(3)})
    assert tracker.get_states()["state1"] == 1234  # the refused call replaced nothing


def _state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def test_seeding_registers_the_default_tracker() -> None:
    """``model_parallel_cuda_manual_seed`` sets the process tracker, as Megatron's does
    (tests/unit_tests/tensor_parallel/test_random.py::test_model_parallel_cuda_manual_seed:
    ``get_cuda_rng_tracker().get_states()['model-parallel-rng']`` exists afterwards); the
    default is opt-out (``set_default=False``) and can be cleared; without one,
    ``get_cuda_rng_tracker()`` is a RuntimeError naming the fix."""
    clear_cuda_rng_tracker()
    try:
        with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"):
            tpl.get_cuda_rng_tracker()
        kept = tpl.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
        assert tpl.get_cuda_rng_tracker() is kept
        assert "model-parallel-rng" in tpl.get_cuda_rng_tracker().get_states()
        tpl.model_parallel_cuda_manual_seed(6, tp_rank=0, ep_rank=0, etp_rank=0, set_default=False)
        assert tpl.get_cuda_rng_tracker() is kept
        other = tpl.RNGStatesTracker()
        set_cuda_rng_tracker(other)
        assert tpl.get_cuda_rng_tracker() is other
        with pytest.raises(TypeError, match="RNGStatesTracker"):
            set_cuda_rng_tracker("tracker")  # type: ignore[arg-type]
    finally:
        clear_cuda_rng_tracker()


def test_megatron_signature_and_gtp_streams() -> None:
    """Megatron's positional order (seed, te_rng_tracker, inference_rng_tracker,
    use_cudagraphable_rng, tp_rank, ep_rank, etp_rank, gtp_remat_rank, egtp_remat_rank,
    force_reset_rng, gtp_remat_world_size, egtp_remat_world_size) and its gtp_remat seeds
    (megatron/core/tensor_parallel/random.py: tp seed + 65536·(1 + gtp rank); expert seed +
    32768 + 65536·(1 + egtp rank), added only when the axis spans > 1 rank)."""
    tracker = tpl.model_parallel_cuda_manual_seed(
        10, False, False, False, 1, 0, 1, 1, 0, True, 2, 2, device="cpu", set_default=False
    )
    tp_seed, expert_seed = 10 + 2718 + 1, 10 + 1024 + 1
    for name, seed in {
        "gtp-remat-rng": tp_seed + 65536 * 2,
        "egtp-remat-rng": expert_seed + 32768 + 65536,
    }.items():
        with tracker.fork(name):
            assert torch.equal(torch.rand(2), _draws(seed, 2)), name
    plain = tpl.model_parallel_cuda_manual_seed(10, tp_rank=0, set_default=False, ep_rank=0)
    assert sorted(plain.get_states()) == [
        "data-parallel-rng",
        "expert-parallel-rng",
        "model-parallel-rng",
    ]
    loose: Any = tpl.model_parallel_cuda_manual_seed
    for flag in ("te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng"):
        with pytest.raises(NotImplementedError, match=flag):
            loose(1, tp_rank=0, **{flag: True})
    with pytest.raises(TypeError, match="set_default"):
        tpl.model_parallel_cuda_manual_seed(1, tp_rank=0, set_default="no")  # type: ignore[arg-type]
