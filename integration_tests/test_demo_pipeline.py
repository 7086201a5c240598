"""The demo trainer with pipeline parallelism (``--pp``, ``--vpp``, ``--schedule``), as a
user runs it: 4 gloo ranks, PP=2 × DP=2 with 2 virtual chunks per stage and the
interleaved schedule, the tests' small model with 4 layers, 4 steps of which 3 are
compared with the 1-process reference (the parity line must stay under the parity tests'
1e-5 relative bound; measured 1.1e-7; with the demo's clipping at 1.0 the grad norms too,
which count the tied table once over the two stages). Then checkpoints across pipeline
layouts: a run at TP=2 × PP=2 saves after step 3 of 6, and that checkpoint is continued at
TP=1 × PP=1 × DP=4; a TP=1 × DP=4 checkpoint of step 3 is continued at TP=2 × PP=2; both
continuations match the uninterrupted TP=2 × PP=2 run within 1e-5 relative per step (the
saved losses exactly).
Last, the layouts ``--preflight`` must refuse before torchrun starts, each with the flag and
the fix in the message.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from examples import train_gpt
from integration_tests._common import max_rel_loss_diff
from integration_tests.test_demo import run_demo_with
from mc_groups.testing import RankPools

SMALL = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8"]


def run_demo(output: str) -> dict[str, Any]:
    """Runs on every rank: the demo's ``run`` on the pool's world of 4."""
    argv = [*SMALL, "--num-layers", "4", "--steps", "4", "--parity-steps", "3"]
    argv += ["--tp", "1", "--dp", "2", "--pp", "2", "--vpp", "2", "--no-sequence-parallel"]
    return run_demo_with(argv, output)


def test_demo_trains_an_interleaved_pipeline(rank_pools: RankPools, tmp_path: Path) -> None:
    per_rank = rank_pools.get(4).run(run_demo, str(tmp_path / "demo"))
    printed = per_rank[0]["printed"]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)  # broadcast over pp
    for needle in (
        "layout:  TP=1 × DP=2 × PP=2, 2 virtual chunks per stage, distributed optimizer",
        "; interleaved schedule (torch.distributed.pipelining)",
        "groups:  r0: tp[0] dp[0, 1] pp[0, 2]  r1: tp[1] dp[0, 1] pp[1, 3]",
        "step     4/4 [",
        "parity: steps 1-3 against the same GPT in plain PyTorch on 1 process",
    ):
        assert needle in printed, (needle, printed)
    parity = per_rank[0]["parity"]
    assert parity is not None
    assert parity <= 1e-5
    # the demo clips at 1.0: the norm over 2 stages × 2 chunks (tied table counted once)
    norm_parity = per_rank[0]["norm_parity"]
    assert norm_parity is not None
    assert norm_parity <= 1e-5
    assert min(per_rank[0]["norms"][:3]) > 1.0


PIPELINE = ["--tp", "2", "--dp", "1", "--pp", "2"]
NO_PIPELINE = ["--tp", "1", "--dp", "4", "--no-sequence-parallel"]


def run_resumable(argv: list[str]) -> list[float]:
    """Runs on every rank: the demo (6 steps, no parity run) with ``argv``."""
    flags = [*SMALL, "--steps", "6", "--parity-steps", "0", *argv]
    return train_gpt.run(train_gpt.plan(train_gpt.parse_args(flags), 4), io.StringIO()).losses


def test_checkpoints_resume_across_pipeline_layouts(rank_pools: RankPools, tmp_path: Path) -> None:
    pool = rank_pools.get(4)

    def demo(*argv: str | Path) -> list[float]:
        losses: list[float] = pool.run(run_resumable, [str(a) for a in argv])[0]
        return losses

    out: list[str | Path] = ["--output", tmp_path / "out"]
    ref = demo(*PIPELINE, "--save-dir", tmp_path / "pp", "--save-every", "3", *out)
    flat = demo(*NO_PIPELINE, "--resume", tmp_path / "pp" / "step-00000003", *out)
    layout = json.loads((tmp_path / "out" / "metrics.json").read_text())["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"]) == (1, 1, 4)
    assert flat[:3] == ref[:3]
    assert max_rel_loss_diff(flat[3:], ref[3:]) <= 1e-5
    first = demo(*NO_PIPELINE, "--steps", "3", "--save-dir", tmp_path / "flat", *out)
    assert max_rel_loss_diff(first, ref[:3]) <= 1e-5
    back = demo(*PIPELINE, "--resume", tmp_path / "flat" / "step-00000003", *out)
    assert back[:3] == first
    rel = max_rel_loss_diff(back[3:], ref[3:])
    assert rel <= 1e-5
    print(f"resumed across pipeline layouts: {max_rel_loss_diff(flat[3:], ref[3:]):.1e}, {rel:.1e}")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--pp", "2"], "--tp 2 × --dp 2 × --pp 2 = 8, but the demo runs on 4 ranks"),
        (
            ["--tp", "1", "--pp", "2", "--no-sequence-parallel", "--num-layers", "3"],
            "num_layers=3 is not divisible by pp × vpp = 2",
        ),
        (
            ["--tp", "1", "--pp", "4", "--dp", "1", "--no-sequence-parallel", "--num-layers", "4"],
            "microbatches=2 < pp=4: the 1f1b schedule fills every stage with a micro-batch",
        ),
        (
            [
                "--tp",
                "1",
                "--pp",
                "2",
                "--vpp",
                "2",
                "--schedule",
                "1f1b",
                "--no-sequence-parallel",
            ],
            "pass --schedule interleaved with --vpp",
        ),
        (
            ["--tp", "1", "--pp", "2", "--vpp", "2", "--no-sequence-parallel", "--num-layers", "2"],
            "num_layers=2 is not divisible by pp × vpp = 4",
        ),
        (["--vpp", "2"], "--vpp/--schedule (got vpp=2, schedule=None) need --pp > 1"),
    ],
)
def test_impossible_pipeline_layouts_are_refused_before_torchrun(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_gpt.main(["--preflight", "4", *SMALL, *flags]) == 2
    assert fragment in capsys.readouterr().err
    ok = ["--tp", "1", "--pp", "2", "--no-sequence-parallel", "--schedule", "gpipe"]
    assert train_gpt.main(["--preflight", "4", *SMALL, *ok]) == 0
