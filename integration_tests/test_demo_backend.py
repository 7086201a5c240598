"""The demo trainer's ``--backend``: gloo (default, CPU ranks) or NCCL (one CUDA device per
rank, ``cuda:LOCAL_RANK``), as GPU users launch it: ``torchrun --nproc-per-node N -m
examples.train_gpt --backend nccl``.

Localizes the flag (parsed, validated, accepted by ``--preflight``), the refusal before any
process group exists when a rank has no device, and a shortened demo on one rank of each
backend (``cuda`` marked ``gpu``): the header names the backend, the first steps match the
1-process PyTorch run within the parity tests' 1e-5 relative loss bound, and
``metrics.json`` records the backend. ``test_demo.py`` covers the default 4-rank gloo demo.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

from examples import train_gpt
from mc_groups.testing import RankPools, gpu_skip_reason

_REASON = gpu_skip_reason(1)
_NO_PLOT = (
    None
    if importlib.util.find_spec("matplotlib") is not None
    else "the demo draws loss.png with matplotlib, which is not importable here"
)
_SMALL = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8"]
_ONE_RANK = ["--tp", "1", "--dp", "1", "--no-sequence-parallel"]


def test_backend_flag_defaults_to_gloo_and_takes_nccl() -> None:
    assert train_gpt.parse_args([]).backend == "gloo"
    assert train_gpt.plan(train_gpt.parse_args([]), 4).backend == "gloo"
    args = train_gpt.parse_args(["--backend", "nccl"])
    assert train_gpt.plan(args, 4).backend == "nccl"


def test_bad_backend_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse_args(["--backend", "mpi"])
    assert exit_info.value.code == 2
    assert "argument --backend: invalid choice: 'mpi'" in capsys.readouterr().err


def test_preflight_accepts_nccl() -> None:
    assert train_gpt.main(["--preflight", "4", "--backend", "nccl"]) == 0
    assert train_gpt.main(["--preflight", "4", "--backend", "nccl", "--tp", "3"]) == 2


def test_nccl_without_a_device_for_the_rank_stops_before_joining(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "999"}.items():
        monkeypatch.setenv(name, value)
    assert train_gpt.main(["--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "rank 3: --backend nccl needs a CUDA device per rank" in err
    assert "LOCAL_RANK=999" in err


def run_one_rank_demo(backend: str, output: str) -> dict[str, Any]:
    """Runs on the rank: the demo's ``run`` on a world of one, as ``main`` sets it up."""
    argv = [*_SMALL, *_ONE_RANK, "--steps", "4", "--parity-steps", "3", "--output", output]
    demo = train_gpt.plan(train_gpt.parse_args([*argv, "--backend", backend]), 1)
    out = io.StringIO()
    result = train_gpt.run(demo, out)
    device = str(train_gpt.device_for(backend))
    return {"printed": out.getvalue(), "parity": result.parity_max_rel_diff, "device": device}


@pytest.mark.skipif(_NO_PLOT is not None, reason=_NO_PLOT or "")
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", id="gloo"),
        pytest.param(
            "nccl",
            id="nccl",
            marks=[pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")],
        ),
    ],
)
def test_one_rank_demo_on_each_backend(rank_pools: RankPools, tmp_path: Path, backend: str) -> None:
    (out,) = rank_pools.get(1, backend).run(run_one_rank_demo, backend, str(tmp_path / "demo"))
    assert out["device"].startswith("cuda" if backend == "nccl" else "cpu")
    assert f"on 1 {backend} ranks" in out["printed"], out["printed"]
    assert out["parity"] is not None
    assert out["parity"] <= 1e-5
    metrics = json.loads((tmp_path / "demo" / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["backend"] == backend
    assert len(metrics["losses"]) == 4
