"""The guarded optimizer step on 2 gloo ranks (DP = 2): fp16 loss scaling against one
process's ``torch.amp.GradScaler`` run, a NaN or inf on one rank only, bad input, and the
collectives a training step issues with and without the guard.

- **fp16**: an fp16 MLP, mc (``grad_reduce_in_fp32``, ``DynamicGradScaler``, clipping at
  ``CLIP``) against one process holding the same fp16 model with fp32 master copies and
  torch's ``GradScaler`` (``scale(loss).backward()``, grads copied to the masters,
  ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``). The scales are chosen so the
  decisions have a wide margin (2**40 overflows fp16 by ~1e6×, 2**10 leaves ~1e2× room):
  the same steps are skipped (0 and 3) and the same scales used, exactly; losses and norms
  agree to fp16 rounding (each DP rank's fp16 grads are half-batch grads summed in fp32,
  the reference's full-batch fp16 grads: bounds ``FP16_RTOL``, ``FP16_WEIGHT_RTOL``).
  Measured: losses 1.1e-4, norms 4.1e-5, weights 9.6e-4 (one fp16 ulp) relative.
- **one rank's NaN or inf**: injected into rank 1's ``main_grad`` after
  ``finalize_model_grads``, where the L2 norm does not count it (rank 0 holds the counted
  copy without the distributed optimizer), or where the inf norm's MAX on gloo would drop
  it (rank 1 holds the counted shard with it): the step is skipped on both ranks and no
  param moves; ``error_if_nonfinite=True`` raises on both; under a scaler the scale backs
  off on both.
- **bad input**: a clear error before any collective (0 recorded, status exchanges
  included); a precondition failing on one rank only: that rank raises its own error, the
  other :class:`mc_groups.PeerCheckError`, through the norm's all-reduce (no status
  exchange).
- **collectives per step** (``record_collectives(status_exchanges=True)`` around a whole
  step: forward, backward, finalize, step): see ``test_guard_adds_no_collective``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mc_groups as mg
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DynamicGradScaler,
    ShardedOptimizer,
)
from mc_finalize import finalize_model_grads
from mc_groups.errors import InputStateError
from mc_groups.testing import RankPools, error_kind

IN, HIDDEN, OUT = 8, 16, 4
ROWS = 8  # global batch rows; DP rank r takes rows [4r, 4r + 4)
LR, MOMENTUM = 0.1, 0.9
CLIP = 0.5
FP16_STEPS = 6
FP16_RTOL = 2e-3  # losses and norms
FP16_WEIGHT_RTOL = 4e-3  # 4 fp16 ulps (2**-10 each) of each tensor's largest magnitude
SCALER: dict[str, Any] = {
    "initial_scale": 2.0**40,
    "backoff_factor": 2.0**-30,
    "growth_factor": 2.0**30,
    "growth_interval": 2,
}


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(44)
    return {
        "0.weight": 0.4 * torch.randn(HIDDEN, IN, generator=g),
        "0.bias": 0.1 * torch.randn(HIDDEN, generator=g),
        "2.weight": 0.3 * torch.randn(OUT, HIDDEN, generator=g),
        "2.bias": 0.1 * torch.randn(OUT, generator=g),
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def mlp(dtype: torch.dtype) -> torch.nn.Sequential:
    net = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    net.load_state_dict(initial())
    return net.to(dtype)


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = net(x.to(next(net.parameters()).dtype))
    return F.mse_loss(out.float(), y)


def _ddp(
    pgc: mg.ProcessGroupCollection, dtype: torch.dtype, dist_opt: bool = False
) -> DistributedDataParallel[Any]:
    cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt, bucket_size=64
    )
    return DistributedDataParallel(mg.ModelParallelConfig(), cfg, mlp(dtype), pg_collection=pgc)


def _sgd(ddp: DistributedDataParallel[Any]) -> torch.optim.SGD:
    return torch.optim.SGD(list(ddp.parameters()), lr=LR, momentum=MOMENTUM, foreach=False)


def _backward(ddp: DistributedDataParallel[Any], opt: ShardedOptimizer, step: int) -> float:
    x, y = batch(step)
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    ddp.zero_grad_buffer()
    loss = loss_of(ddp, x[rows], y[rows])
    opt.scale_loss(loss).backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


# ------------------------------------------------------------------------------- fp16


def train_fp16() -> dict[str, list[Any]]:
    pgc = mg.initialize_model_parallel()
    try:
        ddp = _ddp(pgc, torch.float16)
        opt = ShardedOptimizer(
            _sgd(ddp),
            ddp,
            max_grad_norm=CLIP,
            grad_scaler=DynamicGradScaler(**SCALER),
            pg_collection=pgc,
        )
        out: dict[str, list[Any]] = {"losses": [], "skipped": [], "scales": [], "norms": []}
        for step in range(FP16_STEPS):
            loss = torch.tensor(_backward(ddp, opt, step), dtype=torch.float64)
            finalize_model_grads([ddp], pg_collection=pgc)
            result = opt.step()
            mg.all_reduce(loss, pgc.require("dp", "test"), op=mg.ReduceOp.AVG, label="test: loss")
            out["losses"].append(float(loss))
            out["skipped"].append(result.skipped)
            out["scales"].append(result.loss_scale)
            out["norms"].append(result.grad_norm)
        out["weights"] = [p.detach().float().clone() for p in ddp.module.parameters()]
        out["saved"] = [opt.state_dict()["grad_scaler"]]
        # the DCP state dict carries the scaler too: edit it, load it back
        sd = opt.sharded_state_dict(dict(ddp.module.named_parameters()), is_loading=True)
        out["saved"].append(sd["optimizer.grad_scaler.scale"])
        sd["optimizer.grad_scaler.scale"] = 32.0
        opt.load_sharded_state_dict(sd)
        out["saved"].append(opt.get_loss_scale())
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def reference_fp16() -> dict[str, list[Any]]:
    """One process: the fp16 model, fp32 masters, torch's GradScaler."""
    model = mlp(torch.float16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=LR, momentum=MOMENTUM, foreach=False)
    s = SCALER
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=s["initial_scale"],
        growth_factor=s["growth_factor"],
        backoff_factor=s["backoff_factor"],
        growth_interval=int(s["growth_interval"]),
    )
    out: dict[str, list[Any]] = {"losses": [], "skipped": [], "scales": [], "norms": []}
    for step in range(FP16_STEPS):
        model.zero_grad()
        x, y = batch(step)
        loss = loss_of(model, x, y)
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        for master, param in zip(masters, model.parameters(), strict=True):
            assert param.grad is not None
            master.grad = param.grad.float()
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(masters, CLIP)
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for master, param in zip(masters, model.parameters(), strict=True):
                param.copy_(master)
        out["losses"].append(float(loss.detach()))
        out["skipped"].append(scaler.get_scale() < scale)
        out["scales"].append(scale)
        out["norms"].append(float(norm))
    out["weights"] = [p.detach().float().clone() for p in model.parameters()]
    return out


def test_fp16_loss_scaling_matches_torch_grad_scaler(rank_pools: RankPools) -> None:
    ref = reference_fp16()
    runs = rank_pools.get(2).run(train_fp16)
    mc = runs[0]
    for key in ("losses", "skipped", "scales", "norms"):
        assert str(runs[1][key]) == str(mc[key]), key  # every rank reports the same (NaN too)
    assert mc["skipped"] == ref["skipped"] == [True, False, False, True, False, False]
    assert mc["scales"] == ref["scales"]
    final = SCALER["initial_scale"]  # grown back after steps 4 and 5
    assert mc["saved"] == [
        {"scale": final, "growth_tracker": 0, "hysteresis_tracker": 1},
        final,  # the DCP state dict carries it
        32.0,  # and loads it back
    ]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(mc["losses"], ref["losses"], strict=True))
    pairs = [(a, b) for a, b, s in zip(mc["norms"], ref["norms"], mc["skipped"], strict=True)]
    norm_rel = max(abs(a - b) / b for (a, b), s in zip(pairs, mc["skipped"], strict=True) if not s)
    weight_rel = max(
        float((a - b).abs().max() / b.abs().max())
        for a, b in zip(mc["weights"], ref["weights"], strict=True)
    )
    print(f"[fp16] loss {loss_rel:.3g}, norm {norm_rel:.3g}, weights {weight_rel:.3g} relative")
    assert all(n > CLIP for n, s in zip(ref["norms"], ref["skipped"], strict=True) if not s)
    assert loss_rel < FP16_RTOL
    assert norm_rel < FP16_RTOL
    assert weight_rel < FP16_WEIGHT_RTOL


# --------------------------------------------------------------- one rank's NaN or inf


def _poisoned_step(case: str) -> dict[str, Any]:
    """One step with ``case``'s guard, a NaN (or inf) in rank 1's main_grad only."""
    dist_opt = case == "inf_norm"
    pgc = mg.initialize_model_parallel()
    try:
        ddp = _ddp(pgc, torch.float32, dist_opt=dist_opt)
        cases: dict[str, dict[str, Any]] = {
            "l2": {"max_grad_norm": CLIP},
            "inf_norm": {"max_grad_norm": CLIP, "norm_type": "inf"},
            "raise": {"max_grad_norm": CLIP, "error_if_nonfinite": True},
            "scaler": {"grad_scaler": DynamicGradScaler(initial_scale=8.0)},
        }
        kwargs = cases[case]
        opt = ShardedOptimizer(_sgd(ddp), ddp, pg_collection=pgc, **kwargs)
        before = [p.detach().clone() for p in ddp.parameters()]
        _backward(ddp, opt, 0)
        finalize_model_grads([ddp], pg_collection=pgc)
        if dist.get_rank() == 1:
            # rank 1's first owned slice (its own shard under the distributed optimizer)
            piece = opt.owned_slices[0]
            grad = piece.param.main_grad.view(-1)  # type: ignore[attr-defined]
            grad[piece.start] = math.inf if case == "scaler" else math.nan
        out: dict[str, Any] = {}
        try:
            result = opt.step()
            out["result"] = (result.skipped, result.found_inf, result.grad_norm)
        except FloatingPointError as err:
            out["error"] = str(err)
        out["moved"] = any(
            not torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True)
        )
        out["scale"] = opt.get_loss_scale()
        return out
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("case", ["l2", "inf_norm", "raise", "scaler"])
def test_a_nan_on_one_rank_stops_the_step_on_every_rank(rank_pools: RankPools, case: str) -> None:
    runs = rank_pools.get(2).run(_poisoned_step, case)
    for out in runs:
        assert not out["moved"], out
        if case == "raise":
            assert "a grad holds inf or NaN" in out["error"], out
            continue
        skipped, found_inf, norm = out["result"]
        assert skipped, out
        assert found_inf, out
        if case == "scaler":
            assert norm is None, out
            assert out["scale"] == 4.0, out
        elif case == "inf_norm":
            assert math.isnan(norm), out  # the NaN came through gloo's MAX
        else:
            assert math.isfinite(norm), out  # rank 1's copy is not counted: f caught it


# ---------------------------------------------------------------------------- bad input


def _bad_inputs() -> dict[str, str]:
    pgc = mg.initialize_model_parallel()
    found: dict[str, str] = {}
    try:
        ddp = _ddp(pgc, torch.float32)
        bf16 = _ddp(pgc, torch.bfloat16)
        cases: dict[str, Callable[[], object]] = {
            "max_norm_zero": lambda: ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm=0.0),
            "max_norm_negative": lambda: ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm=-1.0),
            "max_norm_nan": lambda: ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm=math.nan),
            "max_norm_str": lambda: ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm="1"),  # type: ignore[arg-type]
            "norm_type_fro": lambda: ShardedOptimizer(_sgd(ddp), ddp, norm_type="fro"),
            "norm_type_half": lambda: ShardedOptimizer(_sgd(ddp), ddp, norm_type=0.5),
            "scaler_bf16": lambda: ShardedOptimizer(
                _sgd(bf16), bf16, grad_scaler=DynamicGradScaler()
            ),
            "scaler_torch": lambda: ShardedOptimizer(
                _sgd(ddp),
                ddp,
                grad_scaler=torch.amp.GradScaler("cpu"),  # type: ignore[arg-type]
            ),
            "scaler_backoff": lambda: DynamicGradScaler(backoff_factor=1.5),
        }
        opt = ShardedOptimizer(_sgd(ddp), ddp, pg_collection=pgc)
        _backward(ddp, opt, 0)
        ddp.finish_grad_sync()
        cases["clip_zero"] = lambda: opt.clip_grad_norm(0.0)
        cases["clip_norm_type"] = lambda: opt.clip_grad_norm(1.0, norm_type=-2)
        with mg.record_collectives(status_exchanges=True) as log:
            for name, call in cases.items():
                try:
                    call()
                except (TypeError, ValueError, RuntimeError) as err:
                    found[name] = f"{error_kind(err)}: {err}"
        found["collectives"] = str(len(log))
        return found
    finally:
        mg.destroy_model_parallel(pgc)


BAD = {
    "max_norm_zero": "ValueError: max_grad_norm=0.0 must be a finite number > 0",
    "max_norm_negative": "ValueError: max_grad_norm=-1.0 must be a finite number > 0",
    "max_norm_nan": "ValueError: max_grad_norm=nan must be a finite number > 0",
    "max_norm_str": "TypeError: max_grad_norm='1' must be a number > 0",
    "norm_type_fro": "TypeError: norm_type='fro' must be a number",
    "norm_type_half": "ValueError: norm_type=0.5 is not a norm",
    "scaler_bf16": "ValueError: grad_scaler was given but param '0.weight' is bfloat16",
    "scaler_torch": "TypeError: grad_scaler=torch.amp.grad_scaler.GradScaler must be",
    "scaler_backoff": "ValueError: backoff_factor=1.5 must be in (0, 1)",
    "clip_zero": "ValueError: max_norm=0.0 must be a finite number > 0",
    "clip_norm_type": "ValueError: norm_type=-2 is not a norm",
}


def test_bad_input_is_a_clear_error_before_any_collective(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_bad_inputs):
        assert found.pop("collectives") == "0"
        assert sorted(found) == sorted(BAD)
        for name, want in BAD.items():
            assert found[name].startswith(want), (name, found[name])


def _one_rank_misuse() -> dict[str, Any]:
    """Rank 1 steps with its grads offloaded, rank 0 is ready; then both clip twice."""
    pgc = mg.initialize_model_parallel()
    try:
        ddp = _ddp(pgc, torch.float32)
        opt = ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm=CLIP, pg_collection=pgc)
        before = [p.detach().clone() for p in ddp.parameters()]
        _backward(ddp, opt, 0)
        ddp.finish_grad_sync()
        if dist.get_rank() == 1:
            ddp.offload_grad_buffers()
        out: dict[str, Any] = {}
        with mg.record_collectives(status_exchanges=True) as log:
            try:
                opt.step()
            except (ValueError, RuntimeError) as err:
                out["step"] = f"{error_kind(err)}: {err}"
        out["ops"] = sorted(r.op for r in log)
        out["moved"] = any(
            not torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True)
        )
        if dist.get_rank() == 1:
            ddp.restore_grad_buffers()
        _backward(ddp, opt, 1)
        ddp.finish_grad_sync()
        out["norm"] = opt.clip_grad_norm(1.0)
        try:
            opt.clip_grad_norm(1.0)
        except InputStateError as err:
            out["twice"] = f"{error_kind(err)}: {err}"
        out["stepped"] = not opt.step().skipped
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_one_ranks_misuse_is_every_ranks_error_without_an_exchange(
    rank_pools: RankPools,
) -> None:
    first, second = rank_pools.get(2).run(_one_rank_misuse)
    assert first["step"].startswith("PeerCheckError: ShardedOptimizer.step failed its checks")
    assert "rank 1: RuntimeError: step(): " in first["step"]
    assert second["step"].startswith("RuntimeError: step(): "), second["step"]
    assert "offload" in second["step"]
    for out in (first, second):
        # the norm's all-reduce carried the status (the failures' messages then travel
        # unrecorded, as fail_together's); no status exchange
        assert out["ops"] == ["all_reduce"], out
        assert not out["moved"]
        assert out["twice"].startswith("RuntimeError: ShardedOptimizer.clip_grad_norm: ")
        assert out["stepped"]
        assert out["norm"] > 0
    assert first["norm"] == second["norm"]


# ----------------------------------------------------------------- collectives per step


def _step_collectives(clip: bool, peer_checks: bool) -> list[tuple[str, str]]:
    pgc = mg.initialize_model_parallel()
    try:
        ddp = _ddp(pgc, torch.float32, dist_opt=True)
        opt = ShardedOptimizer(
            _sgd(ddp),
            ddp,
            max_grad_norm=CLIP if clip else None,
            peer_checks=peer_checks,
            pg_collection=pgc,
        )
        for step in range(3):
            with (
                mg.record_collectives(status_exchanges=True) if step == 2 else nullcontext() as log
            ):
                _backward(ddp, opt, step)
                finalize_model_grads([ddp], pg_collection=pgc, peer_checks=peer_checks)
                opt.step()
        assert log is not None
        return [(r.op, r.label.split(" bucket group")[0]) for r in log]
    finally:
        mg.destroy_model_parallel(pgc)


def test_guard_adds_no_collective(rank_pools: RankPools) -> None:
    """A whole step (DP = 2, distributed optimizer): the unguarded step pays two status
    exchanges (finalize's and the step's); the guarded one carries the step's in its norm
    all-reduce; ``peer_checks=False`` drops the rest."""
    pool = rank_pools.get(2)
    runs = {
        (clip, checks): pool.run(_step_collectives, clip, checks)[0]
        for clip in (False, True)
        for checks in (True, False)
    }
    exchanges = {k: sum(op == "status_exchange" for op, _ in v) for k, v in runs.items()}
    norms = {k: v.count(("all_reduce", "grad norm and step status")) for k, v in runs.items()}
    print("[collectives per step]", {k: len(v) for k, v in runs.items()}, exchanges)
    assert exchanges == {(False, True): 2, (False, False): 0, (True, True): 1, (True, False): 0}
    assert norms == {(False, True): 0, (False, False): 0, (True, True): 1, (True, False): 1}
    data = [x for x in runs[(False, False)] if x[0] != "status_exchange"]
    # the guarded step = the unchecked step + its one norm all-reduce, nothing else
    assert sorted(runs[(True, False)]) == sorted(
        [*data, ("all_reduce", "grad norm and step status")]
    )
    assert sorted(runs[(False, True)]) == sorted(
        [
            *data,
            ("status_exchange", "finalize_model_grads"),
            ("status_exchange", "ShardedOptimizer.step"),
        ]
    )


def _default_step_records(clip: bool) -> list[tuple[str, tuple[int, ...], str, int]]:
    """What ``opt.step()`` alone issues at the third step, default arguments (distributed
    optimizer, no overlap: the step gathers the params itself)."""
    pgc = mg.initialize_model_parallel()
    try:
        ddp = _ddp(pgc, torch.float32, dist_opt=True)
        clip_at = CLIP if clip else None
        opt = ShardedOptimizer(_sgd(ddp), ddp, max_grad_norm=clip_at, pg_collection=pgc)
        for step in range(3):
            _backward(ddp, opt, step)
            finalize_model_grads([ddp], pg_collection=pgc)
            with mg.record_collectives(status_exchanges=True) as log:
                opt.step()
        return [(r.op, r.group_ranks, str(r.dtype), r.numel) for r in log]
    finally:
        mg.destroy_model_parallel(pgc)


def test_default_step_issues_megatrons_collectives(rank_pools: RankPools) -> None:
    """``ShardedOptimizer.step()`` with default arguments issues what Megatron's
    ``DistributedOptimizer.step()`` does and nothing else: no status exchange, no host
    sync of its own; the param all-gather per bucket, plus one all-reduce of the grad norm
    when it clips.

    Layout by hand (fp32, DP = 2, no ``overlap_grad_reduce``: one bucket; params start at
    multiples of 64, the bucket ends at a multiple of lcm(2, 128) = 128, backprop order):
    2.bias [0, 4), 2.weight [64, 128), 0.bias [128, 144), 0.weight [192, 320), end 384.
    Each rank gathers its half: 192 elements. The norm's all-reduce carries [Σ‖g‖², status,
    overflow] in fp64."""
    pool = rank_pools.get(2)
    gathers = [("all_gather", (0, 1), "torch.float32", 192)]
    norm = ("all_reduce", (0, 1), "torch.float64", 3)
    assert pool.run(_default_step_records, False) == [gathers, gathers]
    assert pool.run(_default_step_records, True) == [[norm, *gathers], [norm, *gathers]]
