"""The layers on CUDA with NCCL: device init from the CUDA tracker, parity with a CPU
``nn.Linear``, main_grad fusion (apex kernel when importable), and TP = 2 with sequence
parallelism when two devices are visible.

Skipped with the reason when the devices are missing. fp32 tolerance 1e-5 relative to
scale (``_helpers``): cuBLAS fp32 GEMMs (TF32 is off by default) differ from CPU GEMMs
only in summation order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, gpu_skip_reason
from mc_tp_layers import _gemm
from mc_tp_layers_tests._helpers import assert_close, chunk, config, ops, randn, row_parallel, world

S, B, K, N = 4, 2, 8, 16
_ONE = gpu_skip_reason(1)
_TWO = gpu_skip_reason(2)
pytestmark = pytest.mark.gpu


def _init(t: torch.Tensor) -> None:
    torch.nn.init.normal_(t, std=0.5)


def _single_device(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(1)
    try:
        cuda = torch.device("cuda", torch.cuda.current_device())
        tracker = tpl.model_parallel_cuda_manual_seed(7, pg_collection=pgc, device=cuda)
        cfg = config(1, use_cpu_initialization=False, gradient_accumulation_fusion=True)
        col = tpl.ColumnParallelLinear(
            K, N, config=cfg, init_method=_init, pg_collection=pgc, rng_tracker=tracker
        )
        assert col.weight is not None
        assert col.bias is not None
        initial = col.weight.detach().cpu()
        col.weight.main_grad = torch.zeros(N, K, device=cuda)  # type: ignore[attr-defined]
        x = d["x"].to(cuda).requires_grad_()
        y, _ = col(x)
        y.backward(d["dy"].to(cuda))
        torch.cuda.synchronize()
        return {
            "device": str(col.weight.device),
            "initial": initial,
            "y": y.detach().cpu(),
            "dx": x.grad.cpu() if x.grad is not None else None,
            "main_grad": col.weight.main_grad.cpu(),  # type: ignore[attr-defined]
            "db": col.bias.grad.cpu() if col.bias.grad is not None else None,
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.skipif(_ONE is not None, reason=_ONE or "")
def test_single_device_init_and_fusion(rank_pools: RankPools) -> None:
    d = {"x": randn(S, B, K, seed=1), "dy": randn(S, B, N, seed=2)}
    (out,) = rank_pools.get(1, "nccl").run(_single_device, d)
    assert out["device"].startswith("cuda")
    expected = torch.empty(N, K, device="cuda")
    with torch.random.fork_rng(devices=[0]):
        torch.cuda.manual_seed(7 + 2718)  # model-parallel-rng of TP rank 0
        _init(expected)
    assert torch.equal(out["initial"], expected.cpu())
    w = out["initial"].clone().requires_grad_()
    x = d["x"].clone().requires_grad_()
    y = x.matmul(w.t())
    y.backward(d["dy"])  # type: ignore[no-untyped-call]
    assert x.grad is not None
    assert w.grad is not None
    assert_close(out["y"], y.detach(), "cuda output")
    assert_close(out["dx"], x.grad, "cuda dX")
    assert_close(out["main_grad"], w.grad, "cuda main_grad")
    assert_close(out["db"], d["dy"].sum(dim=(0, 1)), "cuda db")


def _two_devices(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        cfg = config(2, sequence_parallel=True)
        col = tpl.ColumnParallelLinear(K, N, config=cfg, init_method=_init, pg_collection=pgc)
        row = row_parallel(N, K, cfg, _init, pg_collection=pgc)
        assert col.weight is not None
        with torch.no_grad():
            col.weight.copy_(chunk(d["w1"], 2, r, 0))
            row.weight.copy_(chunk(d["w2"], 2, r, 1))
        col.cuda()
        row.cuda()
        x = chunk(d["x"], 2, r, 0).cuda().requires_grad_()
        with mg.record_collectives() as log:
            h, _ = col(x)
            y, _ = row(torch.nn.functional.gelu(h))
            y.backward(chunk(d["dy"], 2, r, 0).cuda())
        torch.cuda.synchronize()
        assert col.weight.grad is not None
        assert x.grad is not None
        return {
            "y": y.detach().cpu(),
            "dx": x.grad.cpu(),
            "dw1": col.weight.grad.cpu(),
            "ops": ops(log),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.skipif(_TWO is not None, reason=_TWO or "")
def test_two_devices_sequence_parallel_block(rank_pools: RankPools) -> None:
    d = {
        "x": randn(S, B, K, seed=1),
        "w1": randn(N, K, seed=2),
        "w2": randn(K, N, seed=3),
        "dy": randn(S, B, K, seed=4),
    }
    x = d["x"].clone().requires_grad_()
    w1 = d["w1"].clone().requires_grad_()
    y = torch.nn.functional.gelu(x.matmul(w1.t())).matmul(d["w2"].t())
    y.backward(d["dy"])  # type: ignore[no-untyped-call]
    assert x.grad is not None
    assert w1.grad is not None
    results = rank_pools.get(2, "nccl").run(_two_devices, d)
    assert_close(torch.cat([o["y"] for o in results]), y.detach(), "block output")
    assert_close(torch.cat([o["dx"] for o in results]), x.grad, "block dX")
    assert_close(torch.cat([o["dw1"] for o in results]), w1.grad, "fc1 dW")
    for o in results:
        assert o["ops"] == [
            "all_gather",
            "reduce_scatter",
            "all_gather",
            "all_gather",
            "reduce_scatter",
        ]


def _te_skip_reason() -> str | None:
    if _ONE is not None:
        return _ONE
    if not _gemm._te_gemm_available:
        return "needs transformer-engine (optional extra, GPU only), not importable here"
    return None


_TE = _te_skip_reason()


@pytest.mark.skipif(_TE is not None, reason=_TE or "")
def test_output_dtype_through_transformer_engine() -> None:
    """On CUDA with TE importable, ``output_dtype`` runs TE's ``general_gemm``; it must match
    the exact torch path (bf16 operands, fp32 accumulation) up to summation order."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    x = randn(S, B, K, seed=11).bfloat16().to(cuda)
    w = randn(N, K, seed=12).bfloat16().to(cuda)
    bias = randn(N, seed=13).bfloat16().to(cuda)
    y = _gemm._linear_forward(x, w, bias, torch.float32)
    assert y.dtype == torch.float32
    assert y.shape == (S, B, N)
    reference = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert_close(y.cpu(), reference.cpu(), "TE general_gemm against the torch path")
