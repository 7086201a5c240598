"""The demo trainer's command line: its flags, and the validated run they describe.

:func:`plan` checks every flag against the world size before any rank communicates (the
``--preflight`` pass of ``hatch run demo`` runs it before torchrun starts ranks), so an
impossible layout is one message naming the flag and the fix. ``--tp 1`` with the default
``--sequence-parallel`` turns sequence parallelism off, as Megatron does (one line in the
run's output says so).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from examples.gpt.config import COMPILE_BACKENDS, GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.data import global_batch
from examples.gpt.pipeline_demo import add_pipeline_flags, check_pipeline_flags

__all__ = ["BACKENDS", "SEED", "DemoRun", "device_for", "parse_args", "plan"]

SEED = 1234
"""The demo's seed: initial weights and the data stream."""
BACKENDS = ("gloo", "nccl")
"""The demo's process-group backends: gloo on CPU ranks, NCCL on one CUDA device per rank."""
SP_OFF_AT_TP1 = (
    "note: --tp 1: sequence parallelism is off (it splits activations over the TP ranks; "
    "Megatron turns it off at TP=1 too)"
)


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The demo's flags (see ``--help``)."""
    p = argparse.ArgumentParser(prog="hatch run demo", description=description)
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
        help="split activations along the sequence over TP (default on; off at --tp 1)",
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
        help="compile each transformer block with torch.compile(fullgraph=True)",
    )
    p.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile's backend for --compile (default inductor; aot_eager traces "
        "the same graphs, forward and backward, without generating code)",
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
        "--clip-grad",
        type=float,
        default=1.0,
        metavar="NORM",
        help="clip the whole model's grad norm (L2, over every rank) to NORM before each "
        "step (default 1.0; 0: no clipping)",
    )
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
        "when there is none); PATH: from that checkpoint folder. Any TP × DP × PP layout "
        "resumes",
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
    """A validated demo configuration (``notes``: lines the run prints first)."""

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
    notes: tuple[str, ...] = ()

    def run_settings(self) -> dict[str, Any]:
        """What a checkpoint's run shares with every run that continues it (the layout is
        free): the model, the optimizer, the batch and the data stream."""
        return {
            "model": asdict(self.model),
            "optimizer": asdict(self.optimizer),
            "global_batch": self.global_batch,
            "data_seed": SEED,
        }

    def batch(self, step: int) -> torch.Tensor:
        """The global batch of ``step`` (0-based), the same on every rank."""
        return global_batch(step, self.global_batch, self.model.seq_length, seed=SEED)

    def layout_json(self) -> dict[str, object]:
        """The layout as JSON values (``metrics.json``)."""
        return {**asdict(self.layout), "params_dtype": str(self.layout.params_dtype)}


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
    backend_flag = getattr(args, "compile_backend", "inductor")
    if backend_flag != "inductor" and not getattr(args, "compile", False):
        raise ValueError(f"--compile-backend {backend_flag} needs --compile (add it)")
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
    sequence_parallel = args.sequence_parallel and args.tp > 1
    notes = (SP_OFF_AT_TP1,) if args.sequence_parallel and args.tp == 1 else ()
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
        sequence_parallel=sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        microbatches=args.microbatches,
        compile_blocks=getattr(args, "compile", False),
        compile_backend=getattr(args, "compile_backend", "inductor"),
    )
    schedule = check_pipeline_flags(args, model, layout)
    layout.check(model, world_size, args.global_batch)
    backend = getattr(args, "backend", "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"--backend={backend!r} must be one of {', '.join(BACKENDS)}")
    save_dir, save_every, resume = _checkpoint_flags(args)
    return DemoRun(
        model,
        layout,
        OptimizerConfig(name="adamw", lr=args.lr, clip_grad=_clip_grad(args)),
        args.steps,
        args.global_batch,
        min(args.parity_steps, args.steps),
        Path(args.output),
        backend,
        save_dir,
        save_every,
        resume,
        schedule,
        notes,
    )


def _clip_grad(args: argparse.Namespace) -> float | None:
    """``--clip-grad`` as the optimizer's ``clip_grad`` (0: None, no clipping)."""
    clip = getattr(args, "clip_grad", 1.0)
    if not clip >= 0:
        raise ValueError(f"--clip-grad={clip} must be >= 0 (0: no clipping)")
    return float(clip) or None


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
