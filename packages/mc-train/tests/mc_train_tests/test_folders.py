"""Checkpoint folders without a world (files written by hand, no DCP): publishing writes a
manifest of every file's size and SHA-256 and renames atomically, verification catches a
truncated, missing or altered file and names the rank that wrote it, ``find_checkpoint``
picks the newest intact checkpoint (passing over and naming damaged and incomplete ones),
refuses one saved by another run, and retention keeps the newest K. Exact comparisons:
file contents and names, no tolerance."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mc_train.checkpoint import COMPLETE, ResumeError, RunState, find_checkpoint
from mc_train.checkpoint._folders import (
    Damaged,
    checkpoint_dir,
    partial_dir,
    prune,
    publish,
    remove_partial,
    verify,
)

RUN = {"model": {"hidden": 32}, "lr": 0.1}


def _save(folder: Path, step: int, run: dict[str, object] = RUN) -> Path:
    """A checkpoint of ``step`` as the ranks leave it before publishing: two ranks' shards
    and RNG files, then published by "rank 0"."""
    tmp = partial_dir(folder, step)
    (tmp / "rng").mkdir(parents=True)
    for rank in range(2):
        (tmp / f"__{rank}_0.distcp").write_bytes(bytes([rank, step]) * 100)
        (tmp / "rng" / f"rank-{rank:05d}.pt").write_bytes(b"rng" * (rank + 1))
    (tmp / ".metadata").write_bytes(b"meta")
    state = RunState(step, dict(run), {"losses": [1.0] * step}, {"tp": 1}, 2)
    publish(tmp, checkpoint_dir(folder, step), state)
    return checkpoint_dir(folder, step)


def test_publish_writes_a_manifest_and_renames(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    manifest = json.loads((path / COMPLETE).read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in files if f != COMPLETE]
    for rel, meta in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    state = verify(path)
    assert (state.step, state.state, state.world_size) == (3, {"losses": [1.0] * 3}, 2)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate", "__1_0.distcp differs from what was written: 10 bytes now (truncated"),
        ("remove", "rng/rank-00001.pt is missing (written by rank 1;"),
        (
            "flip",
            "__0_0.distcp differs from what was written: same size, other content "
            "(written by rank 0;",
        ),
    ],
)
def test_verify_names_the_damaged_file_and_its_writer(
    tmp_path: Path, damage: str, needle: str
) -> None:
    path = _save(tmp_path, 2)
    if damage == "truncate":
        (path / "__1_0.distcp").write_bytes(b"x" * 10)
    elif damage == "remove":
        (path / "rng" / "rank-00001.pt").unlink()
    else:
        data = bytearray((path / "__0_0.distcp").read_bytes())
        data[7] ^= 0x04
        (path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(Damaged) as err:
        verify(path)
    assert needle in str(err.value)
    with pytest.raises(ResumeError) as by_path:
        find_checkpoint(path, run=RUN)
    assert f"checkpoint {path} is corrupted: {needle}" in str(by_path.value)


def test_auto_takes_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    newest = _save(tmp_path, 6)
    (newest / "__1_0.distcp").write_bytes(b"")
    incomplete = _save(tmp_path, 8)
    (incomplete / COMPLETE).unlink()
    partial_dir(tmp_path, 10).mkdir()
    found = find_checkpoint("auto", tmp_path, run=RUN)
    assert (found.path, found.step) == (tmp_path / "step-00000004", 4)
    assert found.ignored == (".step-00000010.partial", "step-00000008")
    (damage,) = found.damaged
    assert damage.startswith("step-00000006: __1_0.distcp differs from what was written: 0 b")
    assert find_checkpoint("auto", tmp_path / "empty", run=RUN).path is None
    assert remove_partial(tmp_path) == [".step-00000010.partial"]
    assert (tmp_path / "step-00000008").is_dir()  # a step-N is never removed as a leftover


def test_a_checkpoint_of_another_run_or_no_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 2)
    other = {"model": {"hidden": 48}, "lr": 0.1}
    with pytest.raises(ResumeError, match=r"model.hidden: 32 there, 48 here"):
        find_checkpoint(path, run=other)
    with pytest.raises(ResumeError, match="no such checkpoint folder"):
        find_checkpoint(tmp_path / "nope")
    with pytest.raises(ResumeError, match="is a folder of checkpoints; pass one of them"):
        find_checkpoint(tmp_path)
    with pytest.raises(ResumeError, match="looks for the newest checkpoint in the checkpoint"):
        find_checkpoint("auto")
    (path / "trainer.json").write_text('{"format": 1, "step": 2}')
    with pytest.raises(ResumeError, match=r"is corrupted: trainer\.json differs"):
        find_checkpoint(path)


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    assert prune(tmp_path, 2, checkpoint_dir(tmp_path, 4)) == ["step-00000002", "step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    # the checkpoint just published stays, even when older ones have higher steps
    assert prune(tmp_path, 1, checkpoint_dir(tmp_path, 3)) == ["step-00000004"]


def test_run_state_round_trips_exactly() -> None:
    state = RunState(5, {"a": 1}, {"losses": [0.1, 1 / 3]}, {"tp": 2}, 4)
    assert RunState.from_json(state.to_json()) == state
    with pytest.raises(ValueError, match=r"not a format-2 trainer\.json"):
        RunState.from_json('{"format": 1}')
