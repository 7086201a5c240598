"""What the demo trainer shows and writes: the header, the progress bar (with the global
grad norm before clipping), the parity run against one process (losses and grad norms),
``metrics.json``, ``loss.png`` and the closing summary (rank 0)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt.cli import SEED, DemoRun, device_for
from examples.gpt.data import corpus
from examples.gpt.reference import train_reference
from examples.gpt.weights import full_shapes, init_full_weights

__all__ = ["DemoResult", "Progress", "header", "parity", "summary", "write_outputs"]


@dataclass
class DemoResult:
    """What a demo run measured (rank 0's view; other ranks get the losses only)."""

    losses: list[float]
    tokens_per_s: float
    seconds: float
    parity_max_rel_diff: float | None = None
    reference_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping, from the start
    parity_max_rel_norm_diff: float | None = None
    output: str = ""
    resumed_from: str | None = None
    resumed_step: int = 0
    checkpoints: list[str] = field(default_factory=list)


class Progress:
    """Progress of rank 0: on a terminal, one line that updates in place (tqdm's bar with
    the loss and tokens/s); piped, or where tqdm is not installed (a bare GPU machine), a
    plain line every tenth of the run, so logs stay short."""

    def __init__(self, total: int, out: TextIO, width: int = 30) -> None:
        self.total, self.out, self.width = total, out, width
        self.every = max(1, total // 10)
        self.bar = _terminal_bar(total, out) if out.isatty() else None

    def update(
        self, step: int, loss: float, tokens_per_s: float, grad_norm: float | None = None
    ) -> None:
        """Show step ``step`` (0-based) of ``total`` (``grad_norm``: the global grad norm
        before clipping)."""
        done = step + 1
        norm = "" if grad_norm is None else f"  grad norm {grad_norm:6.3f}"
        if self.bar is not None:
            postfix = f"loss {loss:6.3f}{norm}  {tokens_per_s:8,.0f} tokens/s"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(done - self.bar.n)
            if done == self.total:
                self.bar.close()
            return
        if done % self.every == 0 or done in (1, self.total):
            filled = self.width * done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.out.write(
                f"step {done:>5}/{self.total} [{bar}] loss {loss:6.3f}{norm}  "
                f"{tokens_per_s:8,.0f} tokens/s\n"
            )


def _terminal_bar(total: int, out: TextIO) -> Any:
    """tqdm's bar on ``out``, or None without tqdm (then the plain lines are used)."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    return tqdm(total=total, file=out, unit="step", dynamic_ncols=True, leave=True)


def header(demo: DemoRun, pgc: mg.ProcessGroupCollection, out: TextIO) -> None:
    """Rank 0 prints the model, layout, groups and data (collective: every rank's groups)."""
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
    for note in demo.notes:
        out.write(note + "\n")
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
        f"{demo.layout.microbatches} micro-batches per DP rank; AdamW lr {demo.optimizer.lr}"
        f"{_clip_note(demo)}\n"
    )


def _clip_note(demo: DemoRun) -> str:
    """``, grad norm clipped to 1`` (nothing without clipping)."""
    clip = demo.optimizer.clip_grad
    return "" if clip is None else f", grad norm clipped to {clip:g}"


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


def parity(demo: DemoRun, result: DemoResult) -> None:
    """Rank 0 trains the plain-PyTorch GPT on one process for the first steps."""
    if demo.parity_steps == 0:
        return
    full = init_full_weights(demo.model, SEED)
    ref = train_reference(full, demo.model, demo.optimizer, demo.batch, demo.parity_steps)
    result.reference_losses = ref.losses
    result.parity_max_rel_diff = max(
        abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses, strict=False)
    )
    if result.grad_norms and ref.grad_norms:
        result.parity_max_rel_norm_diff = max(
            abs(a - b) / abs(b) for a, b in zip(result.grad_norms, ref.grad_norms, strict=False)
        )


def write_outputs(demo: DemoRun, result: DemoResult) -> Path:
    """``metrics.json`` and ``loss.png`` in the output folder (rank 0); returns the folder."""
    folder = demo.output.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {
        "model": asdict(demo.model),
        "layout": demo.layout_json(),
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
        "grad_norms": result.grad_norms,
        "parity_max_rel_norm_diff": result.parity_max_rel_norm_diff,
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


def summary(demo: DemoRun, result: DemoResult, folder: Path, out: TextIO) -> None:
    """The closing lines: final loss, throughput, parity, checkpoints, outputs."""
    out.write(
        f"final loss {result.losses[-1]:.3f} after {demo.steps} steps (first "
        f"{result.losses[0]:.3f}); {result.tokens_per_s:,.0f} tokens/s "
        f"({result.seconds:.1f} s of training)\n"
    )
    if result.parity_max_rel_diff is not None:
        out.write(
            f"parity: steps 1-{demo.parity_steps} against the same GPT in plain PyTorch on 1 "
            f"process: max relative loss difference {result.parity_max_rel_diff:.1e}"
            + (
                ""
                if result.parity_max_rel_norm_diff is None
                else f", grad norm {result.parity_max_rel_norm_diff:.1e}"
            )
            + "\n"
        )
    if result.checkpoints:
        out.write(
            f"saved {len(result.checkpoints)} checkpoint(s) to {demo.save_dir} (last: "
            f"{Path(result.checkpoints[-1]).name})\n"
        )
    out.write(f"wrote loss.png and metrics.json to {folder}\n")
