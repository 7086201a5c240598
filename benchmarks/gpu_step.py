"""One-GPU training step: an MLP stack in mc (TP layers + mc DDP) against plain torch DDP.

Model: 8 blocks of ``ColumnParallelLinear(h → 4h) → GELU → RowParallelLinear(4h → h)``
(h = 4096: 1.07 G params), bf16 params. mc: ``gradient_accumulation_fusion`` adds each
weight gradient into an fp32 ``main_grad`` (``grad_reduce_in_fp32``; apex's kernel when
built, else torch's mixed-dtype GEMM), wrapped in mc ``DistributedDataParallel`` with
overlapped grad reduction (dp = 1). torch: the same blocks as ``nn.Linear`` / ``nn.GELU``
with the same weights, wrapped in ``torch.nn.parallel.DistributedDataParallel`` (world 1,
bf16 grads in bucket views). One step = zero the grads, 4 micro-batches of 8 × 1024
tokens (forward, ``mean(y²)`` in fp32, backward; all but the last inside ``no_sync``), the
gradient synchronisation. No optimizer: mc's fp32 masters against torch's bf16 params
would compare optimizers, not the data-parallel machinery.

Timing: the variants alternate (torch then mc, then mc then torch, ...) for ``--repeats``
rounds after ``--warmup`` untimed steps each, every step between two
``torch.cuda.synchronize()``; reported: min / median / max seconds, model TFLOP/s
(6 · tokens · matmul params per step) and ``mc / torch`` of the medians. Target: mc ≤
1.03 × torch (what mc's hooks, buffers and fp32 accumulation may cost). Sanity checks in
the same run: the first micro-batch's loss of both models agrees to bf16 precision and
mc's fp32 ``main_grad`` agrees with torch's bf16 grad of the first layer.

``--cpu-dry-run``: the same code on CPU (gloo, world 1) with tiny sizes, so CI proves the
script works without a GPU; its times mean nothing. From the repository root::

    python -m benchmarks.gpu_step [--json PATH] [--repeats N] [--warmup N] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as a file: import the repository's packages by name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mc_groups as mg
import mc_tp_layers as tpl
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig
from mc_tp_layers import _gemm

__all__ = ["Sizes", "flops_per_step", "main", "run", "spread"]

TARGET = 1.03
REFERENCE = "torch DDP"
MC = "mc DDP"


@dataclass(frozen=True)
class Sizes:
    """The benchmark's shapes: blocks of h → 4h → h, micro-batches of ``batch × seq``."""

    hidden: int = 4096
    blocks: int = 8
    microbatches: int = 4
    batch: int = 8
    seq: int = 1024

    @property
    def tokens_per_step(self) -> int:
        """Tokens over all micro-batches of one step."""
        return self.microbatches * self.batch * self.seq

    @property
    def matmul_params(self) -> int:
        """Weights of the GEMMs (biases excluded): two h × 4h matrices per block."""
        return self.blocks * 2 * self.hidden * 4 * self.hidden


GPU_SIZES = Sizes()
DRY_RUN_SIZES = Sizes(hidden=32, blocks=2, microbatches=2, batch=2, seq=8)


def flops_per_step(sizes: Sizes) -> float:
    """Model FLOPs of one step: 2 per multiply-add forward, twice that backward (dX and dW;
    the input requires grad, so the first layer computes its dX too)."""
    return 6.0 * sizes.tokens_per_step * sizes.matmul_params


def spread(seconds: Sequence[float]) -> dict[str, float]:
    """``min``, ``median`` and ``max`` of the timed steps."""
    if not seconds:
        raise ValueError("no timed steps")
    return {"min": min(seconds), "median": statistics.median(seconds), "max": max(seconds)}


# -- the two models ------------------------------------------------------------------------------


class MCStack(nn.Module):
    """``blocks`` × (Column h → 4h, GELU, Row 4h → h) of mc's TP layers at TP = 1."""

    def __init__(
        self,
        sizes: Sizes,
        cfg: mg.ModelParallelConfig,
        pgc: mg.ProcessGroupCollection,
        device: torch.device,
    ) -> None:
        super().__init__()
        h = sizes.hidden
        init = nn.init.zeros_  # unused: perform_initialization=False, weights are copied in
        self.up = nn.ModuleList(
            tpl.ColumnParallelLinear(
                h, 4 * h, config=cfg, init_method=init, pg_collection=pgc, device=device
            )
            for _ in range(sizes.blocks)
        )
        self.down = nn.ModuleList(
            tpl.RowParallelLinear(
                4 * h,
                h,
                config=cfg,
                init_method=init,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
                pg_collection=pgc,
                device=device,
            )
            for _ in range(sizes.blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stack on ``[s, b, h]``."""
        for up, down in zip(self.up, self.down, strict=True):
            hidden, _ = up(x)
            x = down(F.gelu(hidden))[0]
        return x


def _torch_stack(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    h = sizes.hidden
    layers: list[nn.Module] = []
    for _ in range(sizes.blocks):
        layers += [
            nn.Linear(h, 4 * h, device=device, dtype=dtype),
            nn.GELU(),
            nn.Linear(4 * h, h, device=device, dtype=dtype),
        ]
    return nn.Sequential(*layers)


@torch.no_grad()
def _copy_weights(src: nn.Sequential, dst: MCStack) -> None:
    linears = [m for m in src if isinstance(m, nn.Linear)]
    targets = [layer for pair in zip(dst.up, dst.down, strict=True) for layer in pair]
    for a, b in zip(linears, targets, strict=True):
        assert isinstance(b, tpl.ColumnParallelLinear | tpl.RowParallelLinear)
        assert b.weight is not None
        assert b.bias is not None
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)


def _mc_model(
    sizes: Sizes, pgc: mg.ProcessGroupCollection, device: torch.device, reference: nn.Sequential
) -> DistributedDataParallel[mg.ModelParallelConfig]:
    cfg = mg.ModelParallelConfig(
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=True,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
    )
    stack = MCStack(sizes, cfg, pgc, device)
    _copy_weights(reference, stack)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    return DistributedDataParallel(cfg, ddp_cfg, stack, pg_collection=pgc)


# -- steps ---------------------------------------------------------------------------------------

Step = Callable[[], float]


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean()


def _mc_step(model: DistributedDataParallel[Any], batches: Sequence[torch.Tensor]) -> Step:
    def step() -> float:
        model.zero_grad_buffer()
        losses = []
        for i, x in enumerate(batches):
            with nullcontext() if i == len(batches) - 1 else model.no_sync():
                loss = _loss(model(x))
                loss.backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
        model.finish_grad_sync()
        return float(losses[0])  # read after the step: no sync inside it

    return step


def _torch_step(
    model: nn.parallel.DistributedDataParallel, batches: Sequence[torch.Tensor]
) -> Step:
    def step() -> float:
        model.zero_grad(set_to_none=False)
        losses = []
        for i, x in enumerate(batches):
            with nullcontext() if i == len(batches) - 1 else model.no_sync():
                loss = _loss(model(x))
                loss.backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
        return float(losses[0])

    return step


def _timed(step: Step, device: torch.device) -> tuple[float, float]:
    """(seconds, the step's first loss) with the device drained before and after."""
    mg.device.synchronize(device)
    started = time.perf_counter()
    loss = step()
    mg.device.synchronize(device)
    return time.perf_counter() - started, loss


def _interleaved(
    steps: dict[str, Step], device: torch.device, warmup: int, repeats: int
) -> dict[str, list[float]]:
    for step in steps.values():
        for _ in range(warmup):
            _timed(step, device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(_timed(steps[name], device)[0])
    return times


def _first_layer_grads(
    mc: DistributedDataParallel[Any], ref: nn.parallel.DistributedDataParallel
) -> float:
    """max |mc main_grad − torch grad| / max |torch grad| of the first weight."""
    stack, plain = mc.module, ref.module
    assert isinstance(stack, MCStack)
    assert isinstance(plain, nn.Sequential)
    first, twin = stack.up[0], plain[0]
    assert isinstance(first, tpl.ColumnParallelLinear)
    assert isinstance(twin, nn.Linear)
    mine = first.weight.main_grad.float()  # type: ignore[union-attr]
    theirs = twin.weight.grad
    assert theirs is not None
    return float((mine - theirs.float()).abs().max() / theirs.float().abs().max())


# -- the run -------------------------------------------------------------------------------------


def _init_world(device: torch.device, store_dir: str) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(str(Path(store_dir) / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend,
        store=store,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=device if device.type == "cuda" else None,
    )


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


def run(dry_run: bool, warmup: int, repeats: int) -> dict[str, Any]:
    """Build both models, time them interleaved, return the results (see the module notes)."""
    if repeats < 3:
        raise ValueError(f"repeats={repeats} must be >= 3 (min / median / max)")
    sizes = DRY_RUN_SIZES if dry_run else GPU_SIZES
    if dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --cpu-dry-run to check the script on CPU")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="mc-gpu-step-") as store_dir:
        _init_world(device, store_dir)
        try:
            return _measure(sizes, device, warmup, repeats, dry_run)
        finally:
            dist.destroy_process_group()


def _measure(
    sizes: Sizes, device: torch.device, warmup: int, repeats: int, dry_run: bool
) -> dict[str, Any]:
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        reference = _torch_stack(sizes, device, torch.bfloat16)
        mc = _mc_model(sizes, pgc, device, reference)
        plain = nn.parallel.DistributedDataParallel(reference, gradient_as_bucket_view=True)
        gen = torch.Generator(device="cpu").manual_seed(1)
        batches = [
            torch.randn(sizes.seq, sizes.batch, sizes.hidden, generator=gen)
            .to(device=device, dtype=torch.bfloat16)
            .requires_grad_()
            for _ in range(sizes.microbatches)
        ]
        steps = {REFERENCE: _torch_step(plain, batches), MC: _mc_step(mc, batches)}
        losses = {name: step() for name, step in steps.items()}
        grad_diff = _first_layer_grads(mc, plain)
        times = _interleaved(steps, device, warmup, repeats)
    finally:
        mg.destroy_model_parallel(pgc)
    return _report(sizes, device, times, losses, grad_diff, warmup, repeats, dry_run)


def _report(
    sizes: Sizes,
    device: torch.device,
    times: dict[str, list[float]],
    losses: dict[str, float],
    grad_diff: float,
    warmup: int,
    repeats: int,
    dry_run: bool,
) -> dict[str, Any]:
    flops = flops_per_step(sizes)
    spreads = {name: spread(t) for name, t in times.items()}
    variants = {
        name: {
            **spreads[name],
            "seconds": t,
            "tflops_median": flops / spreads[name]["median"] / 1e12,
        }
        for name, t in times.items()
    }
    ratio = spreads[MC]["median"] / spreads[REFERENCE]["median"]
    loss_diff = abs(losses[MC] - losses[REFERENCE]) / abs(losses[REFERENCE])
    checks = {
        "first_loss_rel_diff": loss_diff,
        "first_loss_agrees": loss_diff <= 2.0**-6,  # bf16 forward, summed in another order
        "first_layer_grad_rel_diff": grad_diff,
        "first_layer_grad_agrees": grad_diff <= 2.0**-4,  # torch's grad is bf16-accumulated
    }
    return {
        "dry_run": dry_run,
        "device": _describe_device(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "sizes": asdict(sizes),
        "tokens_per_step": sizes.tokens_per_step,
        "flops_per_step": flops,
        "warmup": warmup,
        "repeats": repeats,
        "variants": variants,
        "ratio_mc_to_torch_median": ratio,
        "ratio_mc_to_torch_min": spreads[MC]["min"] / spreads[REFERENCE]["min"],
        "target": TARGET,
        "target_met": ratio <= TARGET,
        "checks": checks,
        "mc_tp_layers_backends": tpl.backends(),
        # which torch GEMM adds bf16 wgrads into fp32 main_grad without apex (see _gemm)
        "mixed_dtype_gemm": _gemm._mixed_gemm(device),
    }


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| variant | min (s) | median (s) | max (s) | TFLOP/s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in result["variants"].items():
        lines.append(
            f"| {name} | {v['min']:.4f} | {v['median']:.4f} | {v['max']:.4f} | "
            f"{v['tflops_median']:.1f} |"
        )
    lines.append(
        f"mc / torch (median): {result['ratio_mc_to_torch_median']:.3f} "
        f"(target ≤ {result['target']}: {'met' if result['target_met'] else 'MISSED'})"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``--json``, ``--repeats``, ``--warmup``, ``--cpu-dry-run``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--repeats", type=int, help="timed steps per variant (default 8; dry run 3)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant (default 2; dry run 1)")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU (gloo)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table, write the JSON; exit 1 when a sanity check fails (a missed
    speed target is reported, not an error: the numbers are what this run measured)."""
    args = parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (3 if args.cpu_dry_run else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu_dry_run else 2)
    result = run(args.cpu_dry_run, warmup, repeats)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    sizes = result["sizes"]
    print(
        f"{result['device']}, torch {result['torch']}: {sizes['blocks']} blocks, "
        f"h={sizes['hidden']}, {sizes['microbatches']} micro-batches of {sizes['batch']} × "
        f"{sizes['seq']} tokens, bf16"
    )
    print(table(result))
    checks = result["checks"]
    return 0 if checks["first_loss_agrees"] and checks["first_layer_grad_agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
