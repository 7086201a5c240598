"""Activation checkpointing with RNG replay (``mc_tp_layers.random.checkpoint`` and
``CheckpointWithoutOutput``), in one process.

The reference is the same function run without checkpointing from the same generator
states: dropout in the default generator and in a tracker stream must draw the same masks
in the recompute, so outputs and gradients are equal bit for bit (``torch.equal``: the
same operations on the same values in the same order), and the generators end where the
plain run leaves them. The TP split of the saved input (``distribute_saved_activations``)
is checked on two ranks in ``test_mapping_functions.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mc_tp_layers as tpl
from mc_groups.testing import gpu_skip_reason
from mc_tp_layers.random import checkpoint, clear_cuda_rng_tracker
from mc_tp_layers_tests._helpers import backward, grad

_CUDA = gpu_skip_reason(1)
_DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(_CUDA is not None, reason=_CUDA or "")]
    ),
]


def _tracker(device: str) -> tpl.RNGStatesTracker:
    return tpl.model_parallel_cuda_manual_seed(
        31, tp_rank=1, ep_rank=0, etp_rank=0, device=device, set_default=False
    )


def _block(tracker: tpl.RNGStatesTracker, w: torch.Tensor) -> Callable[..., Any]:
    """Dropout from the default generator, then from the tracker's model-parallel stream
    (Megatron's attention dropout), returning a tuple and taking a non-tensor scale."""

    def run(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.dropout(x @ w, 0.5)
        with tracker.fork():
            h = torch.nn.functional.dropout(torch.tanh(h), 0.5)
        return h * scale, h.sum(dim=-1)

    return run


def _generators(device: str, tracker: tpl.RNGStatesTracker) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device == "cuda":
        states.append(torch.cuda.get_rng_state())
    return states + [s for _, s in sorted(tracker.get_states().items())]


def _run(device: str, checkpointed: bool) -> dict[str, Any]:
    tracker = _tracker(device)
    if device == "cuda":
        torch.cuda.manual_seed(5)
    torch.manual_seed(5)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(8, 8, device=device, generator=gen).requires_grad_()
    x = torch.randn(6, 8, device=device, generator=gen).requires_grad_()
    run = _block(tracker, w)
    if checkpointed:
        y, s = checkpoint(run, False, x, 3.0, rng_tracker=tracker)
    else:
        y, s = run(x, 3.0)
    backward(y.sum() + (s * s).sum(), torch.ones((), device=device))
    return {
        "y": y.detach(),
        "dx": grad(x),
        "dw": grad(w),
        "rng": _generators(device, tracker),
        "graph": type(y.grad_fn).__name__,
    }


@pytest.mark.parametrize("device", _DEVICES)
def test_checkpoint_equals_the_plain_run_bit_for_bit(device: str) -> None:
    plain, ckpt = _run(device, False), _run(device, True)
    assert "_CheckpointFunction" in ckpt["graph"]
    for key in ("y", "dx", "dw"):
        assert torch.equal(plain[key], ckpt[key]), key
    # the dropout really drew (some zeros), and both runs drew the same masks
    assert 0 < int((ckpt["y"] == 0).sum()) < ckpt["y"].numel()
    # the recompute replays and then restores: every generator ends where the plain
    # run's ends (the training run's random stream is not shifted by checkpointing)
    assert len(plain["rng"]) == len(ckpt["rng"])
    for a, b in zip(plain["rng"], ckpt["rng"], strict=True):
        assert torch.equal(a, b)


def test_checkpoint_uses_the_default_tracker_and_megatrons_none_flag() -> None:
    """Megatron's call ``checkpoint(fn, None, *args)`` (None: keep the inputs whole) with
    the tracker that ``model_parallel_cuda_manual_seed`` registered."""
    clear_cuda_rng_tracker()
    try:
        tracker = tpl.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
        x = torch.ones(16, requires_grad=True)

        def drop(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            with tracker.fork():
                return torch.nn.functional.dropout(a + b, 0.5)

        saved = tracker.get_states()
        out = checkpoint(drop, None, x, torch.ones(16) * 2)
        tracker.set_states(saved)  # the plain run draws the same mask
        with tracker.fork():
            mask = torch.nn.functional.dropout(torch.ones(16), 0.5) != 0
        assert torch.equal(out, torch.where(mask, torch.full((16,), 6.0), torch.zeros(16)))
        backward(out.sum(), torch.ones(()))
        assert torch.equal(grad(x), mask.float() * 2.0)
    finally:
        clear_cuda_rng_tracker()


def test_checkpoint_without_output_frees_and_recomputes() -> None:
    """The output's storage is empty between forward and backward; a consumer that saved
    views of it (``tensor_split``) reads the recomputed values; grads equal the plain run."""
    tracker = _tracker("cpu")
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 2, 8, generator=gen)
    w0 = torch.randn(6, 8, generator=gen)

    def act(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(torch.nn.functional.gelu(x), 0.25)

    def consume(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        top, bottom = torch.tensor_split(h.reshape(-1, 8), 2)
        return torch.cat([top @ w.t(), bottom @ w.t()]) * 2.0

    states = tracker.get_states()
    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y1 = consume(act(x1), w1)
    backward(y1, torch.ones_like(y1))

    tracker.set_states(states)
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    keeper = tpl.CheckpointWithoutOutput(rng_tracker=tracker)
    h = keeper.checkpoint(act, x2)
    y2 = consume(h, w2)
    keeper.discard_output_and_register_recompute(y2)
    assert h.untyped_storage().nbytes() == 0
    backward(y2, torch.ones_like(y2))
    assert torch.equal(y1, y2)
    assert torch.equal(grad(x1), grad(x2))
    assert torch.equal(grad(w1), grad(w2))


def test_checkpoint_without_output_recomputes_in_its_backward_without_a_hook() -> None:
    """``hook_tensor`` that needs no grad registers nothing: the checkpoint's own backward
    recomputes (Megatron's would fail there)."""
    x = torch.linspace(-1, 1, 8, requires_grad=True)
    keeper = tpl.CheckpointWithoutOutput()
    total = keeper.checkpoint(torch.sin, x).sum()  # the last forward use of the output
    keeper.discard_output_and_register_recompute(torch.zeros(1))
    backward(total, torch.ones(()))
    assert torch.equal(grad(x), torch.cos(x.detach()))


def test_bad_input_is_a_clear_error() -> None:
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(TypeError, match="function=3 must be callable"):
        checkpoint(3, False, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="distribute_saved_activations=1 must be a bool"):
        checkpoint(torch.sin, 1, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rng_tracker='t' must be an RNG tracker"):
        checkpoint(torch.sin, False, x, rng_tracker="t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"args\[0\] \(shape \(2,\)\) is a view"):
        checkpoint(torch.sin, True, x[:2])
    with pytest.raises(NotImplementedError, match="fp8=True"):
        tpl.CheckpointWithoutOutput(fp8=True)
    with pytest.raises(RuntimeError, match="before checkpoint"):
        tpl.CheckpointWithoutOutput().discard_output_and_register_recompute(x)
    y = checkpoint(torch.sin, False, x)
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad\(\)"):
        torch.autograd.grad(y.sum(), x)
