"""The demo trainer (README command 1) end to end on 4 gloo ranks, shortened: the default
layout (TP=2 × DP=2, sequence parallelism, distributed optimizer, overlap) with the tests'
small model for 6 steps, 3 of them compared with the 1-process reference.

Localizes what the user sees: the header (layout and groups), the progress lines, the
summary (final loss, tokens/s, the parity line, the output folder), and the files written
(a PNG and a JSON whose losses are the ones printed). The parity number must be below the
1e-5 relative loss bound of the parity tests (AdamW here, as in the demo; measured 0, equal
fp32 losses, over these 3 steps, and 5.9e-6 over the 20 steps of the default demo, where
Adam's normalised updates let fp32 rounding differences grow step by step). The demo clips
the global grad norm to 1.0 (``--clip-grad``): every progress line shows the norm, the
reference clips with ``torch.nn.utils.clip_grad_norm_``, and its norms must be above 1.0
(clipping active) and equal to mc's within 1e-5 relative.

With ``--compile`` (each block compiled, backend ``aot_eager``; 3 steps, all compared): the
same bound, and the two blocks share one graph.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from examples import train_gpt
from mc_groups.testing import RankPools

STEPS, PARITY_STEPS = 6, 3


def run_demo_with(argv: list[str], output: str) -> dict[str, Any]:
    """Runs on every rank: the demo's own ``run`` with ``argv`` on the pool's world of 4;
    what rank's printout, losses and parity line hold."""
    demo = train_gpt.plan(train_gpt.parse_args([*argv, "--output", output]), 4)
    out = io.StringIO()
    result = train_gpt.run(demo, out)
    return {
        "printed": out.getvalue(),
        "losses": result.losses,
        "parity": result.parity_max_rel_diff,
        "norm_parity": result.parity_max_rel_norm_diff,
        "norms": result.grad_norms,
    }


def run_demo(output: str) -> dict[str, Any]:
    """Runs on every rank: the demo's default layout."""
    argv = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8"]
    argv += ["--steps", str(STEPS), "--parity-steps", str(PARITY_STEPS)]
    return run_demo_with(argv, output)


def test_demo_trains_reports_and_writes_outputs(rank_pools: RankPools, tmp_path: Path) -> None:
    per_rank = rank_pools.get(4).run(run_demo, str(tmp_path / "demo"))
    printed = per_rank[0]["printed"]
    assert all(r["printed"] == "" for r in per_rank[1:])  # only rank 0 reports
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)  # DP-averaged loss
    for needle in (
        "on 4 gloo ranks",
        "layout:  TP=2 × DP=2, sequence parallel, distributed optimizer, overlapped grad "
        "reduce and param gather",
        "groups:  r0: tp[0, 1] dp[0, 2]  r1: tp[0, 1] dp[1, 3]",
        f"step     {STEPS}/{STEPS} [",
        "grad norm",
        "AdamW lr 0.003, grad norm clipped to 1",
        "tokens/s",
        f"parity: steps 1-{PARITY_STEPS} against the same GPT in plain PyTorch on 1 process",
        f"wrote loss.png and metrics.json to {tmp_path / 'demo'}",
    ):
        assert needle in printed, (needle, printed)
    parity = per_rank[0]["parity"]
    assert parity is not None
    assert parity <= 1e-5
    assert f"max relative loss difference {parity:.1e}" in printed
    norm_parity = per_rank[0]["norm_parity"]
    assert norm_parity is not None
    assert norm_parity <= 1e-5
    assert f", grad norm {norm_parity:.1e}" in printed
    assert len(per_rank[0]["norms"]) == STEPS
    assert all(r["norms"] == per_rank[0]["norms"] for r in per_rank)  # one norm, every rank
    metrics = json.loads((tmp_path / "demo" / "metrics.json").read_text())
    assert metrics["losses"] == per_rank[0]["losses"]
    assert len(metrics["reference_losses"]) == PARITY_STEPS
    assert metrics["grad_norms"] == per_rank[0]["norms"]
    assert metrics["optimizer"]["clip_grad"] == 1.0
    assert min(per_rank[0]["norms"][:PARITY_STEPS]) > 1.0  # the clipping was active
    assert metrics["layout"]["tp"] == 2
    assert metrics["world_size"] == 4
    assert metrics["tokens_per_s"] > 0
    png = (tmp_path / "demo" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000  # a drawn figure, not an empty canvas


def run_compiled_demo(output: str) -> dict[str, Any]:
    """Runs on every rank: the default layout with ``--compile`` (each block compiled with
    ``fullgraph=True``, backend ``aot_eager``), 3 steps, all compared; how many graphs
    Dynamo built."""
    import torch
    from torch._dynamo.utils import counters

    argv = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8"]
    argv += ["--steps", "3", "--parity-steps", "3", "--compile", "--compile-backend", "aot_eager"]
    counters.clear()
    try:
        result = run_demo_with(argv, output)
        result["graphs"] = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    return result


def test_demo_with_compiled_blocks_keeps_parity(rank_pools: RankPools, tmp_path: Path) -> None:
    """``--compile``: the demo's 2 blocks run compiled under mc DDP (TP=2 × DP=2, SP,
    distributed optimizer, overlap) and the parity check passes (the same 1e-5 bound).
    Backend ``aot_eager``: Dynamo and AOTAutograd trace the blocks' forward and backward
    (with the functional collectives) as Inductor receives them, without Inductor's C++
    code generation (about a minute per rank on 2 cores, whose FX cache the collectives
    bypass); Inductor's numerics of mc's layers are held in
    ``mc_tp_layers_tests/test_compile.py``."""
    per_rank = rank_pools.get(4).run(run_compiled_demo, str(tmp_path / "demo"))
    printed = per_rank[0]["printed"]
    assert "float32 params, blocks compiled (aot_eager)" in printed, printed
    assert all(r["graphs"] == 1 for r in per_rank)  # one graph, shared by both blocks
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    parity, norm_parity = per_rank[0]["parity"], per_rank[0]["norm_parity"]
    assert parity is not None
    assert parity <= 1e-5
    assert f"max relative loss difference {parity:.1e}" in printed
    assert norm_parity is not None
    assert norm_parity <= 1e-5
    metrics = json.loads((tmp_path / "demo" / "metrics.json").read_text())
    assert len(metrics["reference_losses"]) == 3
    assert metrics["layout"]["compile_blocks"] is True
    assert metrics["layout"]["compile_backend"] == "aot_eager"


def test_compile_backend_flag_needs_compile_and_a_known_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = train_gpt.parse_args(["--compile"])
    assert train_gpt.plan(args, 4).layout.compile_backend == "inductor"
    with pytest.raises(ValueError, match="--compile-backend aot_eager needs --compile"):
        train_gpt.plan(train_gpt.parse_args(["--compile-backend", "aot_eager"]), 4)
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--compile", "--compile-backend", "cudagraphs"])
    assert "invalid choice: 'cudagraphs'" in capsys.readouterr().err


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_is_one_updating_line_on_a_terminal_and_sparse_lines_when_piped() -> None:
    """On a terminal the bar (tqdm) rewrites one line (carriage returns, one newline at the
    end) and ends at 20/20; piped, a line at step 1 and every tenth of the run (2, 4, …)."""
    from examples.gpt.report import Progress

    terminal = _Terminal()
    progress = Progress(20, terminal)
    for step in range(20):
        progress.update(step, 2.0 - 0.01 * step, 1000.0)
    shown = terminal.getvalue()
    assert shown.count("\n") == 1
    assert shown.endswith("\n")
    assert "\r" in shown
    assert "20/20" in shown.splitlines()[-1].split("\r")[-1]
    piped = io.StringIO()
    progress = Progress(20, piped)
    for step in range(20):
        progress.update(step, 2.0, 1000.0)
    lines = piped.getvalue().splitlines()
    assert [line.split("/")[0].split()[-1] for line in lines] == [
        str(n) for n in (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20)
    ]
