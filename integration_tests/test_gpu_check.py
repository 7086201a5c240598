"""``scripts/gpu_check.py`` (the one-command GPU check) and ``benchmarks.gpu_step``, on CPU.

Localizes what the GPU machine cannot afford to find out: that the script runs end to end
from a checkout (``--cpu-dry-run``: the same code path, tiny sizes, gloo; about 10-15 s
here), loads mc's pytest plugin and collects the one-GPU tier (every ``cuda`` variant
skips here, with its reason), runs the benchmark, and writes the JSON report and the log;
plus its pieces: which test files form the tier, the JUnit parsing, the command, the
verdict, the "no pytest" path, and the benchmark's FLOP count and spread.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_step
from integration_tests import _prefetch
from integration_tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
ONE_GPU_FILES = {
    "packages/mc-groups/tests/mc_groups_tests/test_device_cuda.py",
    "packages/mc-buffers/tests/mc_buffers_tests/test_buffer_cuda.py",
    "packages/mc-ddp/tests/mc_ddp_tests/test_nccl.py",
    "packages/mc-ddp/tests/mc_ddp_tests/test_one_gpu.py",
    "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_cuda.py",
    "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_one_gpu.py",
    "integration_tests/test_one_gpu.py",
    "integration_tests/test_demo_backend.py",
}


gpu_check = load_script("gpu_check")


def _dry_run(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# Started in the background when the session has collected this module (about 20 s of
# four programs run one after the other): integration_tests/_prefetch.py.
PREFETCH = {"gpu_check dry run": _dry_run}


@pytest.fixture(scope="module")
def dry_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    out, done = _prefetch.take(request, "gpu_check dry run", tmp_path_factory.mktemp("gpu_check"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "[gpu_check" in done.stdout  # progress lines
    return out, json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))


def test_dry_run_reports_the_tier_and_the_benchmark(dry_run: tuple[Path, dict[str, Any]]) -> None:
    out, report = dry_run
    assert report["mode"] == "cpu-dry-run"
    assert report["ok"] is True
    tests = report["tests"]
    assert tests["ran"] is True
    assert set(tests["files"]) >= ONE_GPU_FILES
    assert tests["failed"] == tests["errors"] == tests["passed"] == 0
    assert tests["skipped"] >= 20  # every cuda variant was collected, then skipped here
    assert all("CUDA device" in reason for reason in tests["skip_reasons"])
    bench = report["benchmark"]
    assert bench["ran"] is True
    assert bench["exit_code"] == 0
    result = bench["result"]
    assert result["dry_run"] is True
    assert result["device"] == "cpu"
    sizes = gpu_step.DRY_RUN_SIZES
    tokens = sizes.microbatches * sizes.batch * sizes.seq
    assert result["flops_per_step"] == 6 * tokens * sizes.blocks * 8 * sizes.hidden**2
    for name in ("torch DDP", "mc DDP"):
        v = result["variants"][name]
        assert len(v["seconds"]) == result["repeats"] >= 3
        assert v["min"] <= v["median"] <= v["max"]
    assert result["checks"]["first_loss_agrees"]
    assert result["checks"]["first_layer_grad_agrees"]
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    assert f"one-GPU tier: pytest -m gpu over {len(tests['files'])} files" in log
    assert "| mc DDP |" in log  # the benchmark's table, passed through
    assert "OK: wrote" in log


def test_dry_run_reports_the_host_cost_parts(dry_run: tuple[Path, dict[str, Any]]) -> None:
    """Issue 30's host-cost parts ran (on CPU here, ``--device cuda`` on a GPU) and their
    tables are in the record: DDP per param against torch DDP, the TP block against
    DTensor (Megatron-Core is not importable in this environment)."""
    out, report = dry_run
    host = report["host_cost"]
    assert set(host) == {"ddp-host", "tp-host"}
    for part, entry in host.items():
        assert entry["ran"] is True, entry
        assert entry["exit_code"] == 0  # no Megatron here: only the torch target is judged
        assert entry["command"][entry["command"].index("--device") + 1] == "cpu"
        assert entry["result"]["part"] == part
        assert entry["result"]["device"] == "cpu"
    ddp_rows = [r for r in host["ddp-host"]["result"]["lines"] if r.startswith("| 100 |")]
    assert len(ddp_rows) == 1, host["ddp-host"]["result"]["lines"]
    tp_rows = [r for r in host["tp-host"]["result"]["lines"] if r.startswith(("| off", "| on"))]
    assert len(tp_rows) == 2
    assert all(row.split("|")[6].strip() != "—" for row in tp_rows)  # mc / DTensor shown
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    assert "host cost ddp-host:" in log
    assert "host cost tp-host:" in log


def test_host_cost_commands() -> None:
    gpu = gpu_check.host_cost_command("ddp-host", False, Path("/o/d.json"))
    assert gpu[1:] == [
        "-m", "benchmarks.host_cost", "--part", "ddp-host", "--rounds", "3",
        "--device", "cuda", "--json", "/o/d.json", "--sizes", "1000", "5000",
    ]  # fmt: skip
    dry = gpu_check.host_cost_command("tp-host", True, Path("/o/t.json"))
    assert dry[dry.index("--device") + 1] == "cpu"
    assert dry[-2:] == ["--steps", "2"]


def test_tier_is_every_file_that_marks_gpu_tests() -> None:
    files = {str(p.relative_to(ROOT)) for p in gpu_check.gpu_test_files(ROOT)}
    assert files >= ONE_GPU_FILES  # later files that mark gpu tests join the tier
    # the NCCL variants of the parity tests get their marks through a helper and need 2-4
    # GPUs: not part of the one-GPU tier (gpu.yml runs them)
    assert "integration_tests/test_parity.py" not in files


def test_command_loads_the_plugin_the_package_registers(tmp_path: Path) -> None:
    meta = tomllib.loads((ROOT / "packages/mc-groups/pyproject.toml").read_text("utf-8"))
    plugin = meta["project"]["entry-points"]["pytest11"]["mc_groups"]
    command = gpu_check.pytest_command([Path("a.py")], tmp_path / "r.xml", with_timeout=False)
    assert command[command.index("-p") + 1] == plugin
    assert command[command.index("-m", 3) + 1] == "gpu"
    assert f"--junitxml={tmp_path / 'r.xml'}" in command
    assert "pytest_timeout" not in command
    env = gpu_check.child_env(ROOT, disable_autoload=True)
    assert env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(ROOT)
    packages = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "src").is_dir())
    assert len(packages) >= 7
    assert sorted(Path(p).parent.name for p in paths[1 : 1 + len(packages)]) == packages


def test_junit_parsing(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        """<?xml version="1.0"?><testsuites><testsuite>
        <testcase classname="a.test_x" name="test_ok"/>
        <testcase classname="a.test_x" name="test_bad">
          <failure message="assert 1 == 2&#10;more"/></testcase>
        <testcase classname="a.test_x" name="test_err"><error message="fixture broke"/></testcase>
        <testcase classname="a.test_y" name="test_s1"><skipped message="needs 2 GPUs"/></testcase>
        <testcase classname="a.test_y" name="test_s2"><skipped message="needs 2 GPUs"/></testcase>
        </testsuite></testsuites>""",
        encoding="utf-8",
    )
    counts = gpu_check.parse_junit(xml)
    assert (counts.passed, counts.failed, counts.errors, counts.skipped) == (1, 1, 1, 2)
    assert counts.failures == [
        "a.test_x::test_bad: assert 1 == 2",
        "a.test_x::test_err: fixture broke",
    ]
    assert counts.skip_reasons == {"needs 2 GPUs": 2}


def test_without_pytest_the_tier_is_reported_not_run(tmp_path: Path) -> None:
    with (tmp_path / "log").open("w") as log:
        record = gpu_check.check_tests(
            tmp_path, 1.0, gpu_check.Reporter(log), find_spec=lambda name: None
        )
    assert record["ran"] is False
    assert "pytest is not importable" in record["reason"]
    assert "SKIPPING TESTS: pytest is not importable" in (tmp_path / "log").read_text()
    bench = {"ran": True, "exit_code": 0}
    assert not gpu_check.overall_ok(record, bench, dry_run=False)


@pytest.mark.parametrize(
    ("tests", "bench", "dry", "ok"),
    [
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 5},
            {"ran": True, "exit_code": 0},
            False,
            True,
        ),
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 0},
            {"ran": True, "exit_code": 0},
            False,
            False,
        ),
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 0},
            {"ran": True, "exit_code": 0},
            True,
            True,
        ),
        (
            {"ran": True, "failed": 1, "errors": 0, "passed": 5},
            {"ran": True, "exit_code": 0},
            False,
            False,
        ),
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 5, "timed_out": True},
            {"ran": True, "exit_code": 0},
            False,
            False,
        ),
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 5},
            {"ran": True, "exit_code": 1},
            False,
            False,
        ),
        (
            {"ran": True, "failed": 0, "errors": 0, "passed": 5},
            {"ran": False, "exit_code": None},
            False,
            False,
        ),
    ],
    ids=["gpu-ok", "gpu-nothing-passed", "dry-ok", "failure", "deadline", "bad-check", "no-bench"],
)
def test_verdict(tests: dict[str, Any], bench: dict[str, Any], dry: bool, ok: bool) -> None:
    assert gpu_check.overall_ok(tests, bench, dry) is ok


def test_verdict_needs_every_host_cost_part_finished() -> None:
    tests = {"ran": True, "failed": 0, "errors": 0, "passed": 5}
    bench = {"ran": True, "exit_code": 0}
    finished = {"ddp-host": {"ran": True}, "tp-host": {"ran": True}}
    assert gpu_check.overall_ok(tests, bench, False, finished) is True
    crashed = {"ddp-host": {"ran": True}, "tp-host": {"ran": False}}
    assert gpu_check.overall_ok(tests, bench, False, crashed) is False


def test_benchmark_arithmetic() -> None:
    sizes = gpu_step.GPU_SIZES
    assert (sizes.hidden, sizes.blocks, sizes.microbatches, sizes.batch, sizes.seq) == (
        4096,
        8,
        4,
        8,
        1024,
    )
    # 6 FLOPs per param per token; 2 GEMMs of 4096 x 16384 per block, 8 blocks, 32768 tokens
    assert gpu_step.flops_per_step(sizes) == 6 * 32768 * 8 * 2 * 4096 * 16384
    assert gpu_step.spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    with pytest.raises(ValueError, match="no timed steps"):
        gpu_step.spread([])
    with pytest.raises(ValueError, match="repeats=2 must be >= 3"):
        gpu_step.run(dry_run=True, warmup=0, repeats=2)
