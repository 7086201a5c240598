"""The device side of the target and id range checks (one GPU; skipped without one).

On CUDA, ``vocab_parallel_cross_entropy`` and ``VocabParallelEmbedding`` check their
indices with an asynchronous device assert, so that no step waits for the device:

- in range, a forward and backward of both under ``torch.cuda.set_sync_debug_mode("error")``
  (torch raises on any synchronising call) runs through, with the numbers of
  ``F.cross_entropy`` / ``F.embedding``;
- out of range, the call returns at once (nothing raised on the host) and the assert fires
  at the next synchronisation, as a device-side assert. That ends the process's CUDA
  context, so it runs in a subprocess of its own (a one-rank gloo world from a file store).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, gpu_skip_reason
from mc_tp_layers_tests._helpers import assert_close, backward, config, randn, world

_REASON = gpu_skip_reason(1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

V, H = 8, 4


def _without_sync() -> dict[str, torch.Tensor]:
    pgc = world(1)
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        logits = randn(3, V, seed=1).to(device).requires_grad_()
        target = torch.tensor([0, -100, 7], device=device)
        table = randn(V, H, seed=2)
        emb = tpl.VocabParallelEmbedding(
            V,
            H,
            init_method=lambda t: t.copy_(table),
            config=config(1),
            pg_collection=pgc,
            device=device,
        )
        ids = torch.tensor([[0, V - 1]], device=device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = tpl.vocab_parallel_cross_entropy(
                logits, target, 0.1, tp_group=pgc.tp, ignore_index=-100
            )
            backward(loss, torch.ones_like(loss))
            embedded = emb(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert logits.grad is not None
        return {
            "loss": loss.detach().cpu(),
            "grad": logits.grad.cpu(),
            "embedded": embedded.detach().cpu(),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_in_range_indices_cost_no_host_synchronisation(rank_pools: RankPools) -> None:
    (out,) = rank_pools.get(1).run(_without_sync)
    full = randn(3, V, seed=1).requires_grad_()
    ref = F.cross_entropy(full, torch.tensor([0, -100, 7]), reduction="none", label_smoothing=0.1)
    backward(ref, torch.ones_like(ref))
    assert full.grad is not None
    assert_close(out["loss"], ref, "loss")
    assert_close(out["grad"], full.grad, "logit grads")
    table = randn(V, H, seed=2)
    assert torch.equal(out["embedded"], F.embedding(torch.tensor([[0, V - 1]]), table))


_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import mc_groups as mg
import mc_tp_layers as tpl

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
pgc = mg.initialize_model_parallel(tensor_model_parallel_size=1)
logits = torch.zeros(2, 8, device="cuda")
if sys.argv[2] == "target":
    tpl.vocab_parallel_cross_entropy(logits, torch.tensor([1, 8], device="cuda"), tp_group=pgc.tp)
else:
    emb = tpl.VocabParallelEmbedding(
        8, 4, init_method=torch.nn.init.ones_, config=mg.ModelParallelConfig(
            use_cpu_initialization=True), pg_collection=pgc, device="cuda"
    )
    emb(torch.tensor([[0, -1]], device="cuda"))
print("queued without a host error", flush=True)
torch.cuda.synchronize()
print("no device assert", flush=True)
"""


@pytest.mark.parametrize("what", ["target", "id"])
def test_out_of_range_indices_trip_the_device_assert(tmp_path: Path, what: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "store"), what],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "queued without a host error" in run.stdout, run.stderr
    assert "no device assert" not in run.stdout
    assert run.returncode != 0
    assert "device-side assert" in run.stderr or "Assertion" in run.stderr, run.stderr[-2000:]
