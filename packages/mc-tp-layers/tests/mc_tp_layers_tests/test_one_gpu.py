"""The one-GPU tier of mc-tp-layers: what a single CUDA device can prove, each case run on
CPU too (same function, same independent reference), so the test logic is exercised on
every machine and only the ``cuda`` variants need the GPU.

NCCL refuses two ranks on one device, so: TP = 1 over NCCL (world of one: the layers'
CUDA GEMMs and autograd, no collective runs), and TP = 2 as two gloo ranks sharing
``cuda:0`` (gloo all-reduces CUDA tensors through host memory: the real collectives of
the non-sequence-parallel block and of the vocab-parallel cross-entropy on CUDA tensors;
sequence parallelism needs gloo's all-gather / point-to-point on CUDA tensors, which
gloo does not do, so it stays with the two-GPU tests of ``test_cuda.py``).

Localizes:
- bf16 params with ``gradient_accumulation_fusion``: the weight gradient accumulates into
  an fp32 ``main_grad`` on CUDA (apex's kernel when built, else torch's mixed-dtype GEMM),
  with DDP's ``grad_added_to_main_grad`` protocol; ``output_dtype=float32`` from bf16
  (Transformer Engine's ``general_gemm`` when installed, else the torch path);
- wgrad deferral and its drain on the device;
- the RNG tracker's CUDA generator states (streams, nesting, checkpoint/replay);
- the two wgrad GEMMs (fresh and accumulating) against fp64.

Tolerances: fp32 results (``main_grad``, fp32 outputs) within 1e-5 relative to scale
(``_helpers``: fp32 accumulation in another order); a bf16 accumulation of ``main_grad``
would be off by ~1e-2. bf16 results (Y, dX, bias grads: one rounding of an fp32 sum)
within one bf16 step at the tensor's scale (2^-7 · max|expected|).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, gpu_skip_reason
from mc_tp_layers import _gemm
from mc_tp_layers.linear import drain_embedding_wgrad_compute
from mc_tp_layers.random import get_data_parallel_rng_tracker_name
from mc_tp_layers_tests._helpers import (
    assert_close,
    backward,
    chunk,
    config,
    main_grad,
    ops,
    randn,
    row_parallel,
    world,
)

S, B, K, N = 4, 2, 32, 64
MAIN_GRAD_START = 0.25  # not a bf16 sum of the products: a bf16 accumulator would show
BF16_STEP = 2.0**-7
_REASON = gpu_skip_reason(1)


def devices() -> list[Any]:
    """``cpu`` always; ``cuda`` marked ``gpu`` and skipped with the reason without one."""
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param(
            "cuda",
            id="cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")],
        ),
    ]


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend(kind: str) -> str:
    """One rank per device: NCCL on CUDA, gloo on CPU."""
    return "nccl" if kind == "cuda" else "gloo"


def _close_bf16(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within one bf16 step at ``expected``'s scale."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        rtol=BF16_STEP,
        atol=BF16_STEP * scale,
        msg=lambda m: f"{what}: {m}",
    )


# -- bf16 params, main_grad fusion and output_dtype (TP = 1) ---------------------------------


def _bf16_data() -> dict[str, torch.Tensor]:
    return {
        "x": randn(S, B, K, seed=1).bfloat16(),
        "w1": randn(N, K, seed=2).bfloat16(),
        "b1": randn(N, seed=3).bfloat16(),
        "h": randn(S, B, N, seed=4).bfloat16(),
        "w2": randn(K, N, seed=5).bfloat16(),
        "b2": randn(K, seed=6).bfloat16(),
        "dy_col": randn(S, B, N, seed=7).bfloat16(),
        "dy_row": randn(S, B, K, seed=8).bfloat16(),
        "dy_wide": randn(S, B, N, seed=9),
    }


def _fused(layer: tpl.ColumnParallelLinear | tpl.RowParallelLinear, w: torch.Tensor) -> None:
    """Load ``w`` and attach what mc DDP attaches: an fp32 ``main_grad`` and the flag."""
    assert layer.weight is not None
    with torch.no_grad():
        layer.weight.copy_(w)
    start = torch.full(w.shape, MAIN_GRAD_START, dtype=torch.float32, device=w.device)
    layer.weight.main_grad = start  # type: ignore[attr-defined]
    layer.weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]


def _run(
    layer: tpl.ColumnParallelLinear | tpl.RowParallelLinear, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    backward(y, dy)
    assert layer.weight is not None
    assert layer.bias is not None
    assert x.grad is not None
    return {
        "device": str(layer.weight.device),
        "y": y.detach().cpu(),
        "dx": x.grad.cpu(),
        "main_grad": main_grad(layer.weight).cpu(),
        "db": None if layer.bias.grad is None else layer.bias.grad.cpu(),
        "flag": getattr(layer.weight, "grad_added_to_main_grad", None),
        "dummy_grad": layer.weight.grad is not None,
    }


def _bf16_layers(kind: str, d: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Runs on the rank: a Column, a Row and an fp32-output Column layer, bf16 params."""
    device = _device(kind)
    d = {k: v.to(device) for k, v in d.items()}
    pgc = world(1)
    try:
        cfg = config(1, params_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
        zeros = torch.nn.init.zeros_
        col = tpl.ColumnParallelLinear(
            K, N, config=cfg, init_method=zeros, pg_collection=pgc, device=device
        )
        wide = tpl.ColumnParallelLinear(
            K,
            N,
            config=cfg,
            init_method=zeros,
            output_dtype=torch.float32,
            pg_collection=pgc,
            device=device,
        )
        row = row_parallel(N, K, cfg, zeros, pg_collection=pgc, device=device)
        for layer, w, b in (
            (col, d["w1"], d["b1"]),
            (wide, d["w1"], d["b1"]),
            (row, d["w2"], d["b2"]),
        ):
            _fused(layer, w)
            assert layer.bias is not None
            with torch.no_grad():
                layer.bias.copy_(b)
        return {
            "col": _run(col, d["x"], d["dy_col"]),
            "wide": _run(wide, d["x"], d["dy_wide"]),
            "row": _run(row, d["h"], d["dy_row"]),
            "backends": tpl.backends(),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def _flat64(t: torch.Tensor) -> torch.Tensor:
    return t.double().reshape(-1, t.shape[-1])


def _check_layer(
    out: dict[str, Any],
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    dy: torch.Tensor,
    kind: str,
    fp32_output: bool = False,
) -> None:
    x64, w64, dy64 = x.double(), w.double(), dy.bfloat16().double()
    y_ref = x64 @ w64.t() + b.double()
    if fp32_output:
        assert out["y"].dtype == torch.float32
        assert_close(out["y"], y_ref.float(), "fp32 output of bf16 operands")
    else:
        assert out["y"].dtype == torch.bfloat16
        _close_bf16(out["y"], y_ref, "Y")
    assert out["dx"].dtype == torch.bfloat16
    _close_bf16(out["dx"], dy64 @ w64, "dX")
    assert out["main_grad"].dtype == torch.float32
    wgrad = _flat64(dy64).t() @ _flat64(x64)
    assert_close(out["main_grad"], (MAIN_GRAD_START + wgrad).float(), "fp32 main_grad")
    assert out["db"] is not None
    _close_bf16(out["db"], _flat64(dy64).sum(0), "bias grad")
    assert out["flag"] is True  # the layer told DDP the grad is already in main_grad
    assert out["dummy_grad"]  # ... and gave autograd a dummy, so DDP's hook runs
    assert out["device"].startswith(kind)


@pytest.mark.parametrize("kind", devices())
def test_bf16_params_fuse_wgrad_into_fp32_main_grad(rank_pools: RankPools, kind: str) -> None:
    d = _bf16_data()
    (out,) = rank_pools.get(1, _backend(kind)).run(_bf16_layers, kind, d)
    _check_layer(out["col"], d["x"], d["w1"], d["b1"], d["dy_col"], kind)
    _check_layer(out["row"], d["h"], d["w2"], d["b2"], d["dy_row"], kind)
    _check_layer(out["wide"], d["x"], d["w1"], d["b1"], d["dy_wide"], kind, fp32_output=True)


# -- wgrad deferral on the device (TP = 1, fp32) -----------------------------------------------


def _deferral(kind: str, limit: int, xs: list[torch.Tensor], dy: torch.Tensor) -> dict[str, Any]:
    device = _device(kind)
    pgc = world(1)
    try:
        acts: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        cfg = config(
            1,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            wgrad_deferral_limit=limit,
        )
        layer = tpl.ColumnParallelLinear(
            K,
            N,
            config=cfg,
            init_method=torch.nn.init.ones_,
            bias=False,
            embedding_activation_buffer=acts,
            grad_output_buffer=grads,
            pg_collection=pgc,
            device=device,
        )
        assert layer.weight is not None
        layer.weight.main_grad = torch.zeros(layer.weight.shape, device=device)  # type: ignore[attr-defined]
        after_each = []
        for x in xs:
            y, _ = layer(x.to(device))
            backward(y, dy.to(device))
            after_each.append(main_grad(layer.weight).detach().cpu().clone())
        held = (len(acts), len(grads))
        with mg.record_collectives() as log:
            drain_embedding_wgrad_compute(cfg, acts, grads, layer.weight, pgc.tp)
        return {
            "after_each": after_each,
            "held": held,
            "final": main_grad(layer.weight).cpu(),
            "empty": (len(acts), len(grads)),
            "drain": ops(log),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("kind", devices())
@pytest.mark.parametrize("limit", [0, 2])
def test_wgrad_deferral_and_drain_on_device(rank_pools: RankPools, kind: str, limit: int) -> None:
    xs = [randn(S, B, K, seed=10 + i) for i in range(3)]
    dy = randn(S, B, N, seed=20)
    dws = [dy.reshape(-1, N).t() @ x.reshape(-1, K) for x in xs]
    deferred = 3 if limit == 0 else limit
    (out,) = rank_pools.get(1, _backend(kind)).run(_deferral, kind, limit, xs, dy)
    for i, grad in enumerate(out["after_each"]):
        expected = sum((dws[j] for j in range(deferred, i + 1)), torch.zeros_like(dws[0]))
        assert_close(grad, expected, f"main_grad after micro-batch {i}")
    assert out["held"] == (deferred, deferred)
    assert out["empty"] == (0, 0)
    assert_close(out["final"], dws[0] + dws[1] + dws[2], "main_grad after drain")
    assert out["drain"] == []  # TP = 1: nothing to gather


# -- TP = 2 on one device: two gloo ranks sharing it ------------------------------------------


def _tp2_block(kind: str, d: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Column(K→N) → GELU → Row(N→K), no sequence parallelism, on ``kind``."""
    device = _device(kind)
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        cfg = config(2)
        zeros = torch.nn.init.zeros_
        col = tpl.ColumnParallelLinear(
            K, N, config=cfg, init_method=zeros, pg_collection=pgc, device=device
        )
        row = row_parallel(N, K, cfg, zeros, pg_collection=pgc, device=device)
        assert col.weight is not None
        with torch.no_grad():
            col.weight.copy_(chunk(d["w1"], 2, r, 0))
            row.weight.copy_(chunk(d["w2"], 2, r, 1))
        x = d["x"].to(device).requires_grad_()
        with mg.record_collectives() as log:
            h, _ = col(x)
            y, _ = row(F.gelu(h))
            backward(y, d["dy"].to(device))
        assert x.grad is not None
        assert col.weight.grad is not None
        assert row.weight.grad is not None
        return {
            "device": str(y.device),
            "y": y.detach().cpu(),
            "dx": x.grad.cpu(),
            "dw1": col.weight.grad.cpu(),
            "dw2": row.weight.grad.cpu(),
            "ops": ops(log),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("kind", devices())
def test_tp2_block_on_one_device(rank_pools: RankPools, kind: str) -> None:
    d = {
        "x": randn(S, B, K, seed=1),
        "w1": randn(N, K, seed=2),
        "w2": randn(K, N, seed=3),
        "dy": randn(S, B, K, seed=4),
    }
    x = d["x"].clone().requires_grad_()
    w1 = d["w1"].clone().requires_grad_()
    w2 = d["w2"].clone().requires_grad_()
    y = F.gelu(x.matmul(w1.t())).matmul(w2.t())
    backward(y, d["dy"])
    assert x.grad is not None
    assert w1.grad is not None
    assert w2.grad is not None
    results = rank_pools.get(2, "gloo").run(_tp2_block, kind, d)
    for o in results:
        assert o["device"].startswith(kind)
        assert_close(o["y"], y.detach(), "block output (reduced over TP)")
        assert_close(o["dx"], x.grad, "block dX (dgrad all-reduced over TP)")
        # forward: Row's all-reduce; backward: Column's dgrad all-reduce
        assert o["ops"] == ["all_reduce", "all_reduce"]
    assert_close(torch.cat([o["dw1"] for o in results], 0), w1.grad, "fc1 dW")
    assert_close(torch.cat([o["dw2"] for o in results], 1), w2.grad, "fc2 dW")


# -- vocab-parallel cross-entropy on the device -----------------------------------------------

V = 16


def _ce(kind: str, logits: torch.Tensor, target: torch.Tensor, dl: torch.Tensor) -> dict[str, Any]:
    device = _device(kind)
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        r = pgc.require("tp", "test").rank()
        mine = chunk(logits, w, r, -1).to(device).requires_grad_()
        with mg.record_collectives() as log:
            loss = tpl.vocab_parallel_cross_entropy(mine, target.to(device), 0.1, tp_group=pgc.tp)
        backward(loss, dl.to(device))
        assert mine.grad is not None
        return {
            "device": str(loss.device),
            "loss": loss.detach().cpu(),
            "grad": mine.grad.cpu(),
            "ops": [(e.op, e.reduce_op) for e in log],
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("kind", devices())
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_cross_entropy_on_device(rank_pools: RankPools, kind: str, tp: int) -> None:
    """TP = 1 over one rank of the device's backend; TP = 2 as two gloo ranks on it."""
    logits = 3 * randn(S, B, V, seed=1)
    target = torch.tensor([[0, 15], [3, 8], [7, 9], [12, 1]])
    dl = randn(S, B, seed=2)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        full.reshape(-1, V), target.reshape(-1), reduction="none", label_smoothing=0.1
    ).reshape(S, B)
    backward(ref, dl)
    assert full.grad is not None
    backend = _backend(kind) if tp == 1 else "gloo"
    results = rank_pools.get(tp, backend).run(_ce, kind, logits, target, dl)
    for res in results:
        assert res["device"].startswith(kind)
        assert_close(res["loss"], ref, "per-token loss")
        assert res["ops"] == ([("all_reduce", "max"), ("all_reduce", "sum")] if tp > 1 else [])
    assert_close(torch.cat([res["grad"] for res in results], dim=-1), full.grad, "logit grads")


# -- the RNG tracker's generator states --------------------------------------------------------


def _draw(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(64, device=device, generator=generator)


@pytest.mark.parametrize("kind", devices())
def test_rng_tracker_streams_on_device(kind: str) -> None:
    """Streams on the device's own generator: each fork draws the sequence of a fresh
    generator seeded as Megatron seeds that stream; nesting resumes the outer stream where
    it stopped; outside, the default generator continues from ``seed``; a checkpoint of the
    states replays the same draws. On CUDA the CPU generator is left alone."""
    device = _device(kind)
    cpu_state = torch.get_rng_state()
    tracker = tpl.model_parallel_cuda_manual_seed(
        123, tp_rank=1, ep_rank=0, etp_rank=0, device=device, set_default=False
    )
    assert tracker.device == device
    mp = torch.Generator(device=device).manual_seed(123 + 2718 + 1)
    dp = torch.Generator(device=device).manual_seed(123)
    default = torch.Generator(device=device).manual_seed(123)
    with tracker.fork():
        first = _draw(device)
    outside = _draw(device)
    with tracker.fork(get_data_parallel_rng_tracker_name()):
        with tracker.fork():
            nested = _draw(device)
        after_nested = _draw(device)
    states = tracker.get_states()
    with tracker.fork():
        replayed = _draw(device)
    tracker.set_states(states)
    with tracker.fork():
        again = _draw(device)
    assert torch.equal(first, _draw(device, mp))
    assert torch.equal(nested, _draw(device, mp))  # the same stream, continued
    assert torch.equal(outside, _draw(device, default))
    assert torch.equal(after_nested, _draw(device, dp))
    assert torch.equal(replayed, again)
    assert torch.equal(replayed, _draw(device, mp))
    if kind == "cuda":
        assert torch.equal(torch.get_rng_state(), cpu_state)


# -- the wgrad GEMMs against fp64 --------------------------------------------------------------


_MODES_UP_TO = {"none": ["none"], "mm": ["none", "mm"], "addmm": ["none", "mm", "addmm"]}


@pytest.mark.parametrize("kind", devices())
def test_wgrad_gemms_accumulate_in_fp32(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``main_grad += dYᵀ·X`` and ``out ← dYᵀ·X`` for bf16 operands into fp32 (the paths of
    ``gradient_accumulation_fusion`` without apex), twice into the same ``main_grad``, by
    every mixed-dtype GEMM this torch has on the device (in-place ``addmm``, ``mm`` then an
    add) and by widened operands (CPU has only those)."""
    device = _device(kind)
    rows = 256
    dy = randn(rows, N, seed=31).bfloat16().to(device)
    x = randn(rows, K, seed=32).bfloat16().to(device)
    product = dy.double().t() @ x.double()
    available = _gemm._mixed_gemm(device)
    if kind == "cpu":
        assert available == "none"  # CUDA-only kernels
    for mode in _MODES_UP_TO[available]:
        if kind == "cuda":
            monkeypatch.setattr(_gemm, "_mixed_gemm", lambda _device, mode=mode: mode)
        acc = torch.full((N, K), MAIN_GRAD_START, dtype=torch.float32, device=device)
        _gemm.accumulate_wgrad(acc, dy, x)
        _gemm.accumulate_wgrad(acc, dy, x)
        expected = (MAIN_GRAD_START + 2 * product).float()
        assert_close(acc.cpu(), expected, f"accumulated main_grad ({mode})")
        out = torch.empty(N, K, dtype=torch.float32, device=device)
        assert _gemm._wgrad_gemm(out, dy, x) is out
        assert_close(out.cpu(), product.float(), f"fresh fp32 wgrad ({mode})")
