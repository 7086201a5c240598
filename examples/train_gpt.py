"""The mc demo trainer: a small GPT learns the opening of *Alice in Wonderland* on CPU ranks.

Run it with ``hatch run demo`` (``torchrun --standalone --nproc-per-node 4 -m
examples.train_gpt``): 4 gloo ranks, TP=2 × DP=2, sequence parallelism, the distributed
optimizer, grad reduction overlapped with backward and the param all-gather with forward.
Rank 0 shows a progress bar (step, loss, tokens/s), then the final loss, the throughput, a
parity line (the first steps against the same GPT trained by plain PyTorch on one process)
and the folder holding ``loss.png`` and ``metrics.json``.

Flags change the layout (``--tp``, ``--dp``, ``--pp`` with ``--schedule`` and ``--vpp``,
``--[no-]sequence-parallel``, ``--[no-]distributed-optimizer``), the run (``--steps``,
``--output``, ...) and the model (``--hidden-size``, ...); an impossible layout is reported
before any rank communicates. Pipeline parallelism: docs/pipeline.md.

On GPUs: ``torchrun --nproc-per-node N -m examples.train_gpt --backend nccl --tp T --dp D``
(T × D = N): each rank trains on ``cuda:LOCAL_RANK`` over NCCL; the parity reference still
runs on rank 0's CPU. gloo (CPU) stays the default. On several nodes: one ``torchrun
--nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` per node
(docs/multi_node.md); the trainer only reads the world torchrun built.

Checkpoints (:mod:`examples.gpt.resume`): ``--save-dir DIR --save-every N`` publishes
``DIR/step-…`` every N steps and after the last one (model, optimizer state, step, every
loss so far, RNG states); ``--resume auto`` continues from the newest complete one in
``--save-dir`` (or starts fresh), ``--resume PATH`` from that one, at this run's layout.
Under ``torchrun --max-restarts K … --resume auto`` a run that lost a rank restarts from its
last complete checkpoint, and its ``metrics.json`` equals an uninterrupted run's (no extra
environment: every attempt joins in a key space of its own, :mod:`mc_groups.elastic`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import (
    GPTConfig,
    OptimizerConfig,
    ParallelLayout,
    Trainer,
    corpus,
    faults,
    full_shapes,
    global_batch,
    init_full_weights,
    parallelize,
    train_reference,
    train_step,
)
from examples.gpt import resume as ckpt
from examples.gpt.pipeline import PipelineTrainer
from examples.gpt.pipeline_demo import add_pipeline_flags, check_pipeline_flags, pipeline_trainer

__all__ = [
    "BACKENDS",
    "DemoResult",
    "DemoRun",
    "device_for",
    "main",
    "parse_args",
    "plan",
    "run",
]

_SEED = 1234
BACKENDS = ("gloo", "nccl")
"""The demo's process-group backends: gloo on CPU ranks, NCCL on one CUDA device per rank."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's flags (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="hatch run demo", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="gloo",
        help="gloo: CPU ranks (default); nccl: one CUDA device per rank, cuda:LOCAL_RANK",
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    add_pipeline_flags(p)
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split activations along the sequence over TP (default on)",
    )
    p.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard grads, optimizer state and the param all-gather over DP (default on)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile each transformer block with torch.compile(fullgraph=True) (Inductor)",
    )
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (default 500)")
    p.add_argument("--output", default="out/demo", help="folder for loss.png, metrics.json")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--microbatches", type=int, default=2, help="per DP rank and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument(
        "--parity-steps", type=int, default=20, help="steps compared with 1 process (0: skip)"
    )
    p.add_argument(
        "--save-dir",
        metavar="DIR",
        help="publish checkpoints here as DIR/step-NNNNNNNN (after the last step, and every "
        "--save-every steps); on a file system every node sees",
    )
    p.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="also save after every N steps (needs --save-dir)",
    )
    p.add_argument(
        "--resume",
        metavar="{auto,PATH}",
        help="auto: continue from the newest complete checkpoint in --save-dir (start fresh "
        "when there is none); PATH: from that checkpoint folder. Any TP × DP layout resumes",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="the process groups' timeout: how long a rank waits for a hung peer before "
        "failing (default 120)",
    )
    p.add_argument(
        "--preflight",
        type=int,
        metavar="WORLD_SIZE",
        help="only check the flags for this many ranks and exit (hatch run demo does this "
        "before starting torchrun, so a bad flag is one message, not a failure per rank)",
    )
    return p.parse_args(argv)


@dataclass(frozen=True)
class DemoRun:
    """A validated demo configuration."""

    model: GPTConfig
    layout: ParallelLayout
    optimizer: OptimizerConfig
    steps: int
    global_batch: int
    parity_steps: int
    output: Path
    backend: str = "gloo"
    save_dir: Path | None = None
    save_every: int | None = None
    resume: str | None = None
    schedule: str = "1f1b"

    def run_settings(self) -> dict[str, Any]:
        """What a checkpoint's run shares with every run that continues it (the layout is
        free): the model, the optimizer, the batch and the data stream."""
        return {
            "model": asdict(self.model),
            "optimizer": asdict(self.optimizer),
            "global_batch": self.global_batch,
            "data_seed": _SEED,
        }

    def saves_after(self, step: int) -> bool:
        """Whether a checkpoint is published after ``step`` (1-based) steps."""
        if self.save_dir is None:
            return False
        return step == self.steps or (self.save_every is not None and step % self.save_every == 0)


def plan(args: argparse.Namespace, world_size: int) -> DemoRun:
    """Check the flags against ``world_size`` (no communication); ``ValueError`` names the
    flag, its value and the fix."""
    for flag in ("steps", "global_batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.parity_steps < 0:
        raise ValueError(f"--parity-steps={args.parity_steps} must be >= 0")
    if getattr(args, "timeout", 120.0) <= 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0 seconds")
    if args.tp < 1 or args.dp < 1:
        raise ValueError(f"--tp={args.tp} and --dp={args.dp} must both be >= 1")
    pp = getattr(args, "pp", 1)
    if args.tp * args.dp * pp != world_size:
        product = f"--tp {args.tp} × --dp {args.dp}" + (f" × --pp {pp}" if pp != 1 else "")
        raise ValueError(
            f"{product} = {args.tp * args.dp * pp}, but the demo runs on "
            f"{world_size} ranks (torchrun's --nnodes × --nproc-per-node); choose --tp and "
            f"--dp whose product is {world_size}, e.g. --tp {world_size} --dp 1"
        )
    if args.sequence_parallel and args.tp == 1:
        raise ValueError(
            "--sequence-parallel needs --tp > 1 (it splits activations over the TP ranks); "
            "pass --no-sequence-parallel with --tp 1"
        )
    model = GPTConfig(
        vocab_size=64,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        seq_length=args.seq_length,
    )
    layout = ParallelLayout(
        tp=args.tp,
        dp=args.dp,
        pp=pp,
        vpp=getattr(args, "vpp", None),
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        microbatches=args.microbatches,
        compile_blocks=getattr(args, "compile", False),
    )
    schedule = check_pipeline_flags(args, model, layout)
    layout.check(model, world_size, args.global_batch)
    opt = OptimizerConfig(name="adamw", lr=args.lr)
    parity = min(args.parity_steps, args.steps)
    backend = getattr(args, "backend", "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"--backend={backend!r} must be one of {', '.join(BACKENDS)}")
    save_dir, save_every, resume = _checkpoint_flags(args)
    return DemoRun(
        model,
        layout,
        opt,
        args.steps,
        args.global_batch,
        parity,
        Path(args.output),
        backend,
        save_dir,
        save_every,
        resume,
        schedule,
    )


def _checkpoint_flags(args: argparse.Namespace) -> tuple[Path | None, int | None, str | None]:
    save_dir = getattr(args, "save_dir", None)
    save_every = getattr(args, "save_every", None)
    resume = getattr(args, "resume", None)
    if save_every is not None and save_every < 1:
        raise ValueError(f"--save-every={save_every} must be >= 1")
    if save_every is not None and save_dir is None:
        raise ValueError("--save-every needs --save-dir DIR: the folder to save into")
    if resume == "":
        raise ValueError("--resume needs 'auto' or the path of a checkpoint folder")
    if resume == "auto" and save_dir is None:
        raise ValueError(
            "--resume auto looks for the newest checkpoint in --save-dir: pass --save-dir DIR"
        )
    return (None if save_dir is None else Path(save_dir)), save_every, resume


def device_for(backend: str) -> torch.device:
    """Where this rank trains: its CUDA device (set from ``LOCAL_RANK``) under NCCL, else
    the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class DemoResult:
    """What a demo run measured (rank 0's view; other ranks get the losses only)."""

    losses: list[float]
    tokens_per_s: float
    seconds: float
    parity_max_rel_diff: float | None = None
    reference_losses: list[float] = field(default_factory=list)
    output: str = ""
    resumed_from: str | None = None
    resumed_step: int = 0
    checkpoints: list[str] = field(default_factory=list)


class _Progress:
    """Progress of rank 0: on a terminal, one line that updates in place (tqdm's bar with
    the loss and tokens/s); piped, or where tqdm is not installed (a bare GPU machine), a
    plain line every tenth of the run, so logs stay short."""

    def __init__(self, total: int, out: TextIO, width: int = 30) -> None:
        self.total, self.out, self.width = total, out, width
        self.every = max(1, total // 10)
        self.bar = _terminal_bar(total, out) if out.isatty() else None

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Show step ``step`` (0-based) of ``total``."""
        done = step + 1
        if self.bar is not None:
            postfix = f"loss {loss:6.3f}  {tokens_per_s:8,.0f} tokens/s"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(done - self.bar.n)
            if done == self.total:
                self.bar.close()
            return
        if done % self.every == 0 or done in (1, self.total):
            filled = self.width * done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.out.write(
                f"step {done:>5}/{self.total} [{bar}] loss {loss:6.3f}  "
                f"{tokens_per_s:8,.0f} tokens/s\n"
            )


def _terminal_bar(total: int, out: TextIO) -> Any:
    """tqdm's bar on ``out``, or None without tqdm (then the plain lines are used)."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    return tqdm(total=total, file=out, unit="step", dynamic_ncols=True, leave=True)


def _header(demo: DemoRun, pgc: mg.ProcessGroupCollection, out: TextIO) -> None:
    world = pgc.require("world", "demo")
    mine = {
        "tp": mg.group_ranks(pgc.require("tp", "demo")),
        "dp": mg.group_ranks(pgc.require("dp", "demo")),
        "pp": mg.group_ranks(pgc.require("pp", "demo")),
    }
    table = mg.all_gather_objects(mine, world, label="demo groups")
    if dist.get_rank() != 0:
        return
    m = demo.model
    params = sum(torch.Size(s).numel() for s in full_shapes(m).values())
    out.write(
        f"mc demo: GPT with {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"vocab {m.vocab_size}, sequence {m.seq_length} ({params:,} params) on "
        f"{_ranks(demo, mg.group_size(world))}\n"
        f"layout:  {demo.layout.describe()}{_schedule_note(demo)}\n"
        f"groups:  "
        + "  ".join(f"r{r}: {_groups_of(t, demo.layout.pp)}" for r, t in enumerate(table))
        + "\n"
        f"data:    {corpus().numel():,} characters of Alice's Adventures in Wonderland; "
        f"{demo.global_batch} sequences × {m.seq_length} tokens a step, "
        f"{demo.layout.microbatches} micro-batches per DP rank; AdamW lr {demo.optimizer.lr}\n"
    )


def _schedule_note(demo: DemoRun) -> str:
    """``; 1f1b schedule (torch.distributed.pipelining)`` under pipeline parallelism."""
    if demo.layout.pp == 1:
        return ""
    return f"; {demo.schedule} schedule (torch.distributed.pipelining)"


def _groups_of(groups: object, pp: int) -> str:
    """``tp[0, 1] dp[0, 2]`` (``pp[...]`` too under pipeline parallelism)."""
    assert isinstance(groups, dict)  # the rank's own ``mine`` above
    shown = "tp dp pp" if pp > 1 else "tp dp"
    return " ".join(f"{role}{list(groups[role])}" for role in shown.split())


def _ranks(demo: DemoRun, world_size: int) -> str:
    """``4 gloo ranks`` / ``2 nccl ranks (NVIDIA H200)``: what the header says ran where."""
    if demo.backend != "nccl":
        return f"{world_size} {demo.backend} ranks"
    return f"{world_size} nccl ranks ({torch.cuda.get_device_name(device_for(demo.backend))})"


def _batch(demo: DemoRun, step: int) -> torch.Tensor:
    return global_batch(step, demo.global_batch, demo.model.seq_length, seed=_SEED)


def _resume_verdict(demo: DemoRun, pgc: mg.ProcessGroupCollection) -> ckpt.Verdict:
    """What every rank resumes from (collective): ``ResumeError`` on every rank when the
    checkpoint cannot be resumed, before anything is built or written."""
    if demo.resume is None:
        return ckpt.Verdict(None, 0, (), None)
    mine = ckpt.inspect(demo.resume, demo.save_dir, demo.run_settings(), demo.steps)
    return ckpt.agree(mine, pgc.require("world", "resume"))


def _start(
    demo: DemoRun, trainer: Trainer | PipelineTrainer, verdict: ckpt.Verdict, out: TextIO
) -> list[float]:
    """The losses so far: none, or the checkpoint's after loading it into ``trainer``."""
    if dist.get_rank() == 0:
        removed = [] if demo.save_dir is None else ckpt.remove_partial(demo.save_dir)
        for name in sorted({*verdict.ignored, *removed}):
            gone = " (removed: an interrupted save)" if name in removed else ""
            out.write(f"ignored {name}: incomplete, never loaded{gone}\n")
        for damage in verdict.damaged:  # kept on disk for a look; a later save replaces it
            out.write(f"ignored {damage}; falling back to an older checkpoint\n")
    if verdict.path is None:
        return []
    state = ckpt.load_run(trainer, verdict)
    if dist.get_rank() == 0:
        out.write(f"resumed from {verdict.path} at step {state.step}\n")
    return list(state.losses)


def _save(
    demo: DemoRun, save_dir: Path, trainer: Trainer | PipelineTrainer, losses: list[float]
) -> str:
    """Publish the checkpoint after ``len(losses)`` steps (collective)."""
    state = ckpt.RunState(
        step=len(losses),
        losses=list(losses),
        run=json.loads(json.dumps(demo.run_settings())),
        layout=_layout_json(demo),
        world_size=dist.get_world_size(),
    )
    rank = dist.get_rank()
    hook = faults.during_save(rank, state.step)  # the restart tests' and chaos runs' faults
    folder = ckpt.save_run(trainer, save_dir, state, after_write=hook)
    faults.after_save(rank, state.step, folder)
    return str(folder)


def _trainer(
    demo: DemoRun, pgc: mg.ProcessGroupCollection, full: dict[str, torch.Tensor], device: Any
) -> tuple[Trainer | PipelineTrainer, Callable[[torch.Tensor], float]]:
    """This rank's trainer and its step: :mod:`examples.gpt.pipeline_demo` under ``--pp``."""
    if demo.layout.pp > 1:
        return pipeline_trainer(
            *(demo.model, demo.layout, demo.optimizer, pgc, full, device),
            schedule=demo.schedule,
            global_batch=demo.global_batch,
        )
    trainer = parallelize(demo.model, demo.layout, demo.optimizer, pgc, full, device)
    return trainer, lambda tokens: train_step(trainer, tokens)


def _train(
    demo: DemoRun, pgc: mg.ProcessGroupCollection, out: TextIO, verdict: ckpt.Verdict
) -> DemoResult:
    full = init_full_weights(demo.model, _SEED)
    device = device_for(demo.backend)
    trainer, train = _trainer(demo, pgc, full, device)
    losses = _start(demo, trainer, verdict, out)
    first = len(losses)
    faults.note_start(dist.get_rank(), first, verdict.damaged)
    progress = _Progress(demo.steps, out)
    tokens_per_step = demo.global_batch * demo.model.seq_length
    saved: list[str] = []
    start = time.perf_counter()
    for step in range(first, demo.steps):
        losses.append(train(_batch(demo, step)))
        elapsed = time.perf_counter() - start
        if dist.get_rank() == 0:
            progress.update(step, losses[-1], tokens_per_step * (step + 1 - first) / elapsed)
        faults.after_step(dist.get_rank(), step + 1)
        if demo.save_dir is not None and demo.saves_after(step + 1):
            saved.append(_save(demo, demo.save_dir, trainer, losses))
    seconds = time.perf_counter() - start
    trained = demo.steps - first
    result = DemoResult(losses, tokens_per_step * trained / seconds if trained else 0.0, seconds)
    result.resumed_from, result.resumed_step, result.checkpoints = verdict.path, first, saved
    return result


def _parity(demo: DemoRun, result: DemoResult) -> None:
    """Rank 0 trains the plain-PyTorch GPT on one process for the first steps."""
    if demo.parity_steps == 0:
        return
    full = init_full_weights(demo.model, _SEED)
    ref = train_reference(
        full, demo.model, demo.optimizer, lambda s: _batch(demo, s), demo.parity_steps
    )
    result.reference_losses = ref.losses
    result.parity_max_rel_diff = max(
        abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses, strict=False)
    )


def _layout_json(demo: DemoRun) -> dict[str, object]:
    return {**asdict(demo.layout), "params_dtype": str(demo.layout.params_dtype)}


def _write_outputs(demo: DemoRun, result: DemoResult) -> Path:
    folder = demo.output.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {
        "model": asdict(demo.model),
        "layout": _layout_json(demo),
        "optimizer": asdict(demo.optimizer),
        "steps": demo.steps,
        "global_batch": demo.global_batch,
        "world_size": dist.get_world_size(),
        "backend": demo.backend,
        "losses": result.losses,
        "final_loss": result.losses[-1],
        "tokens_per_s": result.tokens_per_s,
        "train_seconds": result.seconds,
        "parity_steps": demo.parity_steps,
        "reference_losses": result.reference_losses,
        "parity_max_rel_diff": result.parity_max_rel_diff,
        "resumed_from": result.resumed_from,
        "resumed_step": result.resumed_step,
        "checkpoints": result.checkpoints,
    }
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    _plot(demo, result, folder / "loss.png")
    return folder


def _plot(demo: DemoRun, result: DemoResult, path: Path) -> None:
    # Imported here: only rank 0 draws, and the backend must be chosen before pyplot loads.
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=110)
    mc_label = f"mc, {dist.get_world_size()} ranks"
    ax.plot(range(1, len(result.losses) + 1), result.losses, lw=1.4, label=mc_label)
    ref = result.reference_losses
    if ref:
        # The first steps twice, magnified: the parallel run on top of the 1-process one.
        zoom = ax.inset_axes((0.5, 0.5, 0.46, 0.36))
        zoom.plot(range(1, len(ref) + 1), result.losses[: len(ref)], lw=1.4)
        zoom.plot(range(1, len(ref) + 1), ref, "o", ms=3.5, mfc="none", color="black")
        zoom.set_title(f"steps 1-{len(ref)}", fontsize=8)
        zoom.tick_params(labelsize=7)
        zoom.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.plot([], [], "o", ms=3.5, mfc="none", color="black", label="PyTorch, 1 process")
    layout = demo.layout.describe().replace(", overlapped", ",\noverlapped")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / character)")
    ax.set_title(f"mc: a GPT learns Alice in Wonderland ({layout})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _summary(demo: DemoRun, result: DemoResult, folder: Path, out: TextIO) -> None:
    out.write(
        f"final loss {result.losses[-1]:.3f} after {demo.steps} steps (first "
        f"{result.losses[0]:.3f}); {result.tokens_per_s:,.0f} tokens/s "
        f"({result.seconds:.1f} s of training)\n"
    )
    if result.parity_max_rel_diff is not None:
        out.write(
            f"parity: steps 1-{demo.parity_steps} against the same GPT in plain PyTorch on 1 "
            f"process: max relative loss difference {result.parity_max_rel_diff:.1e}\n"
        )
    if result.checkpoints:
        out.write(
            f"saved {len(result.checkpoints)} checkpoint(s) to {demo.save_dir} (last: "
            f"{Path(result.checkpoints[-1]).name})\n"
        )
    out.write(f"wrote loss.png and metrics.json to {folder}\n")


def run(demo: DemoRun, out: TextIO = sys.stdout) -> DemoResult:
    """Train on the already initialised world; rank 0 reports to ``out`` and writes the
    outputs. Collective: every rank calls it.

    With ``demo.resume``, the ranks first agree on the checkpoint (``ResumeError`` on every
    rank, before anything is built or written, when it cannot be resumed); the losses of
    the result then start at step 1 (the checkpoint's history), and training at its step.
    """
    pgc = demo.layout.initialize_groups()
    peer_lost = False
    try:
        verdict = _resume_verdict(demo, pgc)
        _header(demo, pgc, out)
        result = _train(demo, pgc, out, verdict)
    except mg.CollectiveError:
        peer_lost = True  # dead or hung: destroy's world barrier would wait for it again
        raise
    finally:
        if not peer_lost:
            mg.destroy_model_parallel(pgc)
    # After the last collective: the other ranks do not wait (within --timeout) for the
    # parity run and the plot.
    if dist.get_rank() == 0:
        _parity(demo, result)
        folder = _write_outputs(demo, result)
        result.output = str(folder)
        _summary(demo, result, folder, out)
    return result


def _checked(args: argparse.Namespace, world_size: int, rank: int) -> DemoRun | None:
    """The plan, or None after rank 0 printed why the flags cannot work."""
    try:
        return plan(args, world_size)
    except ValueError as err:
        if rank == 0:  # every rank finds the same error; one report is enough
            print(f"train_gpt: error: {err}", file=sys.stderr)
        return None


def _local_cuda_device(rank: int) -> torch.device | None:
    """``cuda:LOCAL_RANK``, made current; None after printing why there is none."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local < count:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        return device
    print(
        f"train_gpt: error: rank {rank}: --backend nccl needs a CUDA device per rank on each "
        f"node, but LOCAL_RANK={local} and {count} device(s) are visible; start at most "
        f"{count} ranks per node (torchrun --nproc-per-node) or use --backend gloo",
        file=sys.stderr,
    )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun: validate, join the world (gloo, or NCCL on
    ``cuda:LOCAL_RANK``), train, report (or, with ``--preflight N``, only validate for N
    ranks)."""
    args = parse_args(argv)
    if args.preflight is not None:
        return 0 if _checked(args, args.preflight, rank=0) else 2
    if "WORLD_SIZE" not in os.environ:
        print("train_gpt: run under torchrun, e.g. `hatch run demo`", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    demo = _checked(args, int(os.environ["WORLD_SIZE"]), rank)
    if demo is None:
        return 2
    device = _local_cuda_device(rank) if demo.backend == "nccl" else None
    if demo.backend == "nccl" and device is None:
        return 2
    torch.set_num_threads(1)
    # A key space of this attempt's own in torchrun's store: restarts work with the store
    # shared (torch's default) too (mc_groups.elastic).
    timeout = timedelta(seconds=args.timeout)
    mg.elastic.init_process_group(demo.backend, timeout=timeout, device_id=device)
    try:
        run(demo)
    except ckpt.ResumeError as err:
        if rank == 0:  # every rank raised the same error
            print(f"train_gpt: error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
