"""``python -m examples.dry_run``: the command line, the readable table and the JSON file.

Defaults describe the 70B-shaped GPT (:func:`~examples.dry_run.spec.llama70b`) with bf16
params, fp32 grads, sequence parallelism when ``--tp`` > 1, the distributed optimizer and
overlapped grad reduction and param gathers; only ``--world-size`` is required. E.g. the
4096-rank layout of docs/dry_run.md::

    python -m examples.dry_run --world-size 4096 --tp 8 --pp 8 --json out/dry_run.json

An impossible combination is one message and exit status 2 before anything is built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from examples.dry_run.activations import korthikanti_layer_bytes
from examples.dry_run.report import PHASES, RankReport, collective_totals
from examples.dry_run.run import dry_run, stage_ranks
from examples.dry_run.spec import DTYPES, DryRunSpec, llama70b
from examples.gpt import GPTConfig

__all__ = ["format_report", "main", "parse_args", "spec_from_args"]

_MODEL_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_heads": "num_heads",
    "num_query_groups": "num_query_groups",
    "vocab_size": "vocab_size",
    "seq_length": "seq_length",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The dry run's flags (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m examples.dry_run",
        description="What each rank of a GPT training run holds and moves per step, "
        "simulated in one process on torch's fake process-group backend and the meta "
        "device (no weights allocated, nothing communicated).",
    )
    p.add_argument("--world-size", type=int, required=True, help="ranks of the world")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0, help="the rank to simulate (default 0)")
    which.add_argument(
        "--all-stages", action="store_true", help="one rank per pipeline stage (TP/CP/DP rank 0)"
    )
    layout = p.add_argument_group("layout")
    for flag, what in (
        ("--tp", "tensor-parallel size"),
        ("--pp", "pipeline stages"),
        ("--cp", "context-parallel size"),
        ("--ep", "expert-parallel size (expert groups only: the GPT is dense)"),
        ("--gtp-remat", "gtp_remat size (Column/Row weights sharded over it)"),
    ):
        layout.add_argument(flag, type=int, default=1, help=f"{what} (default 1)")
    layout.add_argument("--vpp", type=int, help="virtual pipeline chunks per stage")
    layout.add_argument(
        "--schedule",
        choices=("1f1b", "gpipe", "interleaved"),
        help="pipeline schedule whose micro-batches in flight the activations count "
        "(default: interleaved with --vpp, else 1f1b)",
    )
    layout.add_argument("--etp", type=int, help="expert tensor-parallel size (default --tp)")
    model = p.add_argument_group("model (defaults: the 70B-shaped GPT)")
    default = llama70b()
    for name in _MODEL_FLAGS:
        model.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(default, name))
    model.add_argument(
        "--swiglu",
        action=argparse.BooleanOptionalAction,
        default=default.gated_mlp,
        help="gated MLP: fc1 makes 2·FFN channels, fc2(silu(gate)·up) (default on)",
    )
    batch = p.add_argument_group("batch and buffers")
    batch.add_argument("--micro-batch-size", type=int, default=1, help="sequences (default 1)")
    batch.add_argument(
        "--num-microbatches", type=int, default=1, help="micro-batches per step (default 1)"
    )
    batch.add_argument(
        "--bucket-size",
        type=int,
        help="elements per DDP bucket (default: mc DDP's max(40M, 1M·dp); stages after the "
        "first and virtual chunks after the first have one bucket)",
    )
    batch.add_argument("--params-dtype", choices=list(DTYPES), default="bf16")
    for flag, default_on, what in (
        ("--grad-reduce-in-fp32", True, "fp32 main_grad buffers and reductions"),
        ("--distributed-optimizer", True, "shard grads and optimizer state over DP"),
        ("--overlap", True, "overlap grad reduction with backward and param gathers"),
    ):
        batch.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=default_on,
            help=f"{what} (default {'on' if default_on else 'off'})",
        )
    batch.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split activations over TP along the sequence (default: on when --tp > 1)",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        metavar="GiB",
        help="say whether each rank's params, grads, optimizer state and peak activations "
        "fit in this much device memory",
    )
    p.add_argument("--json", metavar="PATH", help="write the full report here")
    return p.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> DryRunSpec:
    """The validated spec; ``ValueError``/``TypeError`` naming the flag otherwise."""
    sizes = {name: getattr(args, flag) for flag, name in _MODEL_FLAGS.items()}
    try:
        model = GPTConfig(**sizes, gated_mlp=args.swiglu)
    except (ValueError, TypeError) as err:
        raise ValueError(_as_flags(str(err))) from None
    sp = args.tp > 1 if args.sequence_parallel is None else args.sequence_parallel
    return DryRunSpec.create(
        model,
        args.world_size,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        gtp_remat=args.gtp_remat,
        sequence_parallel=sp,
        distributed_optimizer=args.distributed_optimizer,
        overlap=args.overlap,
        params_dtype=DTYPES[args.params_dtype],
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        microbatches=args.num_microbatches,
        bucket_size=args.bucket_size,
        micro_batch_size=args.micro_batch_size,
        schedule=args.schedule,
    )


def _as_flags(message: str) -> str:
    for name in _MODEL_FLAGS:
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
    return message


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def _headline(spec: DryRunSpec) -> list[str]:
    cfg, lay = spec.model, spec.layout
    params = sum(n for n in _full_param_count(cfg).values())
    groups = f"{cfg.num_heads} heads" + (
        f" in {cfg.query_groups} query groups" if cfg.query_groups != cfg.num_heads else ""
    )
    ffn = f"{cfg.ffn_size:,}" + (" (SwiGLU)" if cfg.gated_mlp else "")
    return [
        f"model:   GPT, {cfg.num_layers} layers, hidden {cfg.hidden_size:,}, FFN {ffn}, "
        f"{groups}, vocab {cfg.vocab_size:,}, sequence {cfg.seq_length:,} ({params:,} params)",
        f"layout:  {spec.world_size:,} ranks = {lay.describe()}",
        f"batch:   {lay.microbatches} micro-batch(es) of {spec.micro_batch_size} × "
        f"{spec.local_seq_length:,} tokens per rank and step",
    ]


def _full_param_count(cfg: GPTConfig) -> dict[str, int]:
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = 4 * h + cfg.qkv_size * h + h * h + h + (h + 1) * cfg.fc1_size + f * h + h
    return {
        "embeddings": cfg.vocab_size * h + cfg.seq_length * h,
        "layers": cfg.num_layers * per_layer,
        "final norm": 2 * h,
    }


def _rank_lines(spec: DryRunSpec, r: RankReport, device_gib: float | None = None) -> list[str]:
    coords = ", ".join(f"{k} {v}" for k, v in r.coordinates.items() if _axis_size(spec, k) > 1)
    held = "; ".join(c.describe() for c in r.chunks)
    shown = ("tp", "cp", "dp", "pp", "embd", "gtp_remat")
    groups = [_group(n, ranks) for n, ranks in r.groups.items() if n in shown and len(ranks) > 1]
    head = f"rank {r.rank:,}: pipeline stage {r.stage} ({held})"
    return [
        "",
        head + (f"; {coords}" if coords else ""),
        "  groups:  " + (", ".join(groups) or "none (every group has one rank)"),
        *_memory_lines(r),
        *_activation_lines(spec, r, device_gib),
        *_bucket_lines(r),
        *_collective_lines(r),
    ]


def _memory_lines(r: RankReport) -> list[str]:
    mem = r.memory
    rows = [
        ("params on this rank", f"{mem.param_elements:,}", mem.params),
        ("param buffer (distributed optimizer)", "", mem.param_buffer),
        ("grad buffer (main_grad)", "", mem.grad_buffer),
        ("fp32 master params", "", mem.master_params),
        ("Adam exp_avg + exp_avg_sq (fp32)", "", mem.adam_moments),
        ("fp32 grad copies for the optimizer", "", mem.master_grads),
        ("Adam step counters", "", mem.step_counters),
        ("total (params counted once)", "", mem.total),
    ]
    lines = ["", f"  {'memory':<38}{'elements':>16}{'bytes':>16}"]
    lines += [f"  {name:<38}{n:>16}{_size(nbytes):>16}" for name, n, nbytes in rows]
    lines.append(
        f"  (the optimizer steps {mem.stepped_elements:,} elements here: this rank's shard)"
    )
    return lines


def _activation_lines(spec: DryRunSpec, r: RankReport, device_gib: float | None) -> list[str]:
    act = r.activations
    if act is None:
        return []
    layers = sorted(act.per_layer)
    per_layer = {act.per_layer[i] for i in layers}
    each = f"{_size(per_layer.pop())} each" if len(per_layer) == 1 else "(see the JSON)"
    lay, cfg = spec.layout, spec.model
    formula = korthikanti_layer_bytes(
        spec.local_seq_length, spec.micro_batch_size, cfg.hidden_size, cfg.num_heads, lay.tp
    )
    rows = [
        (f"activations of one micro-batch, {len(layers)} block(s)", each),
        ("  Korthikanti et al. per block (SP, 16-bit)", _size(formula)),
        ("  embedding, final norm, LM head and loss", _size(act.other)),
        ("  one micro-batch on this rank", _size(act.per_microbatch)),
        (
            f"chunk-forwards in flight ({act.schedule}, {act.chunks} chunk(s)/stage)",
            str(act.in_flight),
        ),
        ("activations at the peak", _size(act.peak)),
        ("total with activations", _size(r.total_with_activations)),
    ]
    lines = [f"  {name:<54}{value:>16}" for name, value in rows]
    if device_gib is not None:
        need, have = r.total_with_activations, int(device_gib * 2**30)
        verdict = "fits" if need <= have else "does NOT fit"
        lines.append(
            f"  {verdict} in {device_gib:g} GiB of device memory ({_size(abs(have - need))} "
            f"{'to spare' if need <= have else 'short'}; before the allocator's "
            "fragmentation and workspaces)"
        )
    return ["", *lines]


def _bucket_lines(r: RankReport) -> list[str]:
    lines = [
        "",
        f"  {'bucket':<8}{'params':>7}{'elements':>15}{'unpadded':>15}{'shard/rank':>13}"
        f"{'grad bytes':>13}  reduced over",
    ]
    for b in r.buckets:
        lines.append(
            f"  {f'c{b.chunk} #{b.index}':<8}{b.params:>7}{b.numel:>15,}{b.numel_unpadded:>15,}"
            f"{b.shard_numel:>13,}{_size(b.grad_bytes):>13}  {b.group} ({b.buffer})"
        )
    return lines


def _collective_lines(r: RankReport) -> list[str]:
    lines = [
        "",
        f"  {'one step':<11}{'op':<16}{'group (size)':<15}{'dtype':<10}{'count':>6}"
        f"{'elements each':>15}{'bytes sent':>13}",
    ]
    totals = collective_totals(r.collectives)
    for phase in PHASES:
        for t in (t for t in totals if t.phase == phase):
            group = f"{t.group} ({t.group_size})"
            lines.append(
                f"  {phase:<11}{t.op:<16}{group:<15}{t.dtype:<10}{t.count:>6}"
                f"{t.numel:>15,}{_size(t.bytes):>13}"
            )
    total = sum(c.bytes for c in r.collectives)
    lines.append(f"  {len(r.collectives)} collectives, {_size(total)} sent by this rank per step")
    return lines


def _axis_size(spec: DryRunSpec, axis: str) -> int:
    """The size of ``axis`` (``tp``, ``cp``, ``dp``, ``pp``, ``gtp_remat``, ``ep``)."""
    value: int = getattr(spec.layout, axis)
    return value


def _group(name: str, ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return f"{name} {ranks}"
    step = ranks[1] - ranks[0]
    if ranks == list(range(ranks[0], ranks[0] + step * len(ranks), step)):
        return f"{name} [{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"
    return f"{name} ({len(ranks)} ranks)"


def format_report(
    spec: DryRunSpec,
    reports: list[RankReport],
    seconds: float,
    device_memory_gib: float | None = None,
) -> str:
    """The readable table of ``reports`` (with ``device_memory_gib``: whether each rank
    fits)."""
    lines = ["mc dry run (fake process group, meta device)", *_headline(spec)]
    for r in reports:
        lines += _rank_lines(spec, r, device_memory_gib)
    lines += ["", f"simulated in {seconds:.1f} s"]
    return "\n".join(lines)


def _settings(spec: DryRunSpec) -> dict[str, Any]:
    layout = asdict(spec.layout)
    layout["params_dtype"] = str(spec.layout.params_dtype).removeprefix("torch.")
    return {
        "world_size": spec.world_size,
        "micro_batch_size": spec.micro_batch_size,
        "model": asdict(spec.model),
        "layout": layout,
    }


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the dry run; 0 on success, 2 (with one message on stderr) for bad flags. The
    table goes to ``out`` (default: standard output)."""
    out = sys.stdout if out is None else out
    args = parse_args(argv)
    try:
        spec = spec_from_args(args)
        ranks = stage_ranks(spec) if args.all_stages else [args.rank]
        if args.device_memory is not None and not args.device_memory > 0:
            raise ValueError(f"--device-memory {args.device_memory} must be > 0 (GiB)")
        if not 0 <= ranks[0] < spec.world_size:
            raise ValueError(f"--rank {args.rank} must be in [0, {spec.world_size})")
    except (ValueError, TypeError) as err:
        print(f"dry_run: error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    timings: list[dict[str, float]] = [{} for _ in ranks]
    reports = [dry_run(spec, rank, t) for rank, t in zip(ranks, timings, strict=True)]
    seconds = time.perf_counter() - start
    print(format_report(spec, reports, seconds, args.device_memory), file=out)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "settings": _settings(spec),
            "seconds": seconds,
            "ranks": [{**r.to_json(), "timings": t} for r, t in zip(reports, timings, strict=True)],
        }
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}", file=out)
    return 0
