"""scripts/run_all.py (``hatch run all``) fails when any step fails and bounds its waits.

Localizes the runner's own logic on stand-in steps (tiny Python commands, no suite): every
step runs even after one failed, a failing background step fails the whole run, a
background step that overruns the bound is killed and reported, and the summary names
every step once. Exact exit codes and summary lines.
"""

from __future__ import annotations

import sys
import time

import pytest

from integration_tests._scripts import load_script

run_all = load_script("run_all")
PY = sys.executable


def _cmd(code: str) -> list[str]:
    return [PY, "-c", code]


def _summary(out: str) -> list[str]:
    return out.split("--- summary ---\n", 1)[1].splitlines()


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(run_all, "FIRST", [("first", _cmd("pass"))])
    monkeypatch.setattr(run_all, "TESTS", _cmd("import sys; sys.exit(len(sys.argv) - 1)"))
    return monkeypatch


def test_all_steps_ok_is_exit_zero(
    stand_ins: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_ins.setattr(run_all, "BACKGROUND", [("bg", _cmd("print('from the background')"))])
    assert run_all.main([]) == 0
    out = capsys.readouterr().out
    assert "from the background" in out
    assert [line.split()[0] for line in _summary(out)] == ["first", "tests:", "bg"]
    assert run_all.main(["one-pytest-arg"]) == 1  # pytest's arguments reach the suite
    assert "FAILED (exit 1)" in _summary(capsys.readouterr().out)[1]


def test_a_failing_step_fails_the_run_and_the_others_still_run(
    stand_ins: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    background = [("bad", _cmd("raise SystemExit(3)")), ("after", _cmd("print('ran')"))]
    stand_ins.setattr(run_all, "BACKGROUND", background)
    assert run_all.main([]) == 1
    out = capsys.readouterr().out
    summary = _summary(out)
    assert summary[1].split()[:3] == ["tests:", "pytest", "ok"]
    assert "FAILED (exit 3)" in summary[2]
    assert summary[3].split()[:2] == ["after", "ok"]
    assert "ran" in out


def test_a_background_step_over_the_bound_is_killed_and_fails(
    stand_ins: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_ins.setattr(run_all, "BACKGROUND_BOUND_S", 1.0)
    stand_ins.setattr(run_all, "BACKGROUND", [("slow", _cmd("import time; time.sleep(30)"))])
    started = time.monotonic()
    assert run_all.main([]) == 1
    assert time.monotonic() - started < 15
    out = capsys.readouterr().out
    assert "killed: over the 1 s bound" in out
    assert "FAILED (exit -9)" in _summary(out)[2]
