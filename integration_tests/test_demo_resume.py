"""The demo trainer's checkpoints (``--save-dir``, ``--save-every``, ``--resume``) on the
session's 4-rank pool, with the tests' small GPT (hidden 32, sequence 16, AdamW as the
demo trains).

Localizes :mod:`mc_train.checkpoint` (``Checkpointer``, ``find_checkpoint``) in the demo's
use of it (``examples.gpt.loop``): what a checkpoint folder holds, continuing from it, and
refusing what cannot be continued. The independent
reference is the same demo run for 8 steps without stopping.

Checks and tolerances:
- same layout (TP=2 × DP=2, sequence parallel, distributed optimizer): a run stopped after
  5 steps and resumed (``auto``), and one resumed from its step-3 checkpoint by path, have
  the 8 losses of the reference exactly (``==`` on floats: the same reductions in the same
  order from the same bytes), in ``metrics.json`` too.
- other layouts (TP=1 × DP=4 and TP=4 × DP=1, from the TP=2 × DP=2 step-3 checkpoint): the
  3 saved losses exactly, steps 4-8 within 1e-5 relative (the parity tests' bound: the
  other layout sums the same fp32 terms in another order; measured in the docstring of
  ``test_resume_at_other_layouts``).
- controls, so the comparison above could fail: resuming without the optimizer state, or
  with the data stream restarted at step 0, changes the losses after the checkpoint by far
  more than 1e-5. RNG states are checked directly (restored to the saved bytes), since the
  demo draws no random numbers while training and its losses cannot show them.
- bad input (a missing folder, a checkpoint of another model, a corrupted, a truncated,
  an incomplete one, a folder of checkpoints, one past ``--steps``): every rank raises the
  same ``ResumeError`` before printing or building anything, and no file is written or
  removed.
- damage after publication (a shard truncated, an RNG file missing, a bit flipped in a
  shard): ``--resume auto`` passes over the damaged newest checkpoint, naming the file, how
  it differs and the rank that wrote it, and resumes from the older one with the
  reference's 8 losses exactly; by path it is an error naming the same.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import mc_groups as mg
from examples import train_gpt
from examples.gpt import final_weights, global_batch, init_full_weights, parallelize, train_step
from integration_tests._common import max_rel_loss_diff
from mc_groups.testing import RankPools
from mc_train.checkpoint import (
    Checkpointer,
    Found,
    ResumeError,
    RunState,
    agree_on_checkpoint,
    inspect_checkpoint,
    model_sharded_state_dict,
)

SMALL = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8", "--parity-steps", "0"]
STEPS, STOP, EVERY = 8, 5, 3
OTHER_LAYOUTS = {
    "TP=1 × DP=4": ["--tp", "1", "--dp", "4"],
    "TP=4 × DP=1": ["--tp", "4", "--dp", "1"],
}


def demo(argv: list[str]) -> dict[str, Any]:
    """Runs on every rank: the demo's own ``run``; a ``ResumeError`` is returned, not raised,
    so the test sees every rank's."""
    plan = train_gpt.plan(train_gpt.parse_args([*SMALL, *argv]), 4)
    out = io.StringIO()
    try:
        result = train_gpt.run(plan, out)
    except ResumeError as err:
        return {"printed": out.getvalue(), "error": str(err)}
    return {"printed": out.getvalue(), "losses": result.losses, "error": None}


def _run(pools: RankPools, *argv: str) -> list[dict[str, Any]]:
    return pools.get(4).run(demo, list(argv))


def _losses(folder: Path) -> list[float]:
    metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    losses: list[float] = metrics["losses"]
    return losses


@pytest.fixture(scope="module")
def saved(rank_pools: RankPools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference (8 steps, no stop) and a run stopped after 5 steps that saved steps 3
    and 5 into ``ckpt``."""
    root = tmp_path_factory.mktemp("resume")
    (ref,) = {
        tuple(r["losses"])
        for r in _run(rank_pools, "--steps", str(STEPS), "--output", str(root / "ref"))
    }
    save = ["--save-dir", str(root / "ckpt"), "--save-every", str(EVERY)]
    stopped = _run(rank_pools, *save, "--steps", str(STOP), "--output", str(root / "stopped"))
    assert stopped[0]["losses"] == list(ref[:STOP])
    assert (
        f"saved 2 checkpoint(s) to {root / 'ckpt'} (last: step-00000005)" in stopped[0]["printed"]
    )
    return {"root": root, "ref": list(ref), "ckpt": root / "ckpt"}


def test_checkpoint_folder_holds_every_part(saved: dict[str, Any]) -> None:
    names = sorted(p.name for p in saved["ckpt"].iterdir())
    assert names == ["step-00000003", "step-00000005"]  # nothing partial left behind
    folder = saved["ckpt"] / "step-00000003"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert {".metadata", "COMPLETE", "trainer.json"} <= set(files)
    assert [f for f in files if f.startswith("rng/")] == [f"rng/rank-{r:05d}.pt" for r in range(4)]
    assert len([f for f in files if f.endswith(".distcp")]) == 4
    manifest = json.loads((folder / "COMPLETE").read_text(encoding="utf-8"))
    assert sorted(manifest["files"]) == [f for f in files if f != "COMPLETE"]
    for rel, meta in manifest["files"].items():
        data = (folder / rel).read_bytes()
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    state = RunState.from_json((folder / "trainer.json").read_text(encoding="utf-8"))
    assert (state.step, state.world_size) == (3, 4)
    assert state.state["losses"] == saved["ref"][:3]
    assert state.layout == {"tp": 2, "pp": 1, "dp": 2, "cp": 1, "chunks": 1}
    assert state.run["model"]["hidden_size"] == 32


def test_resume_at_same_layout_is_bit_identical(
    rank_pools: RankPools, saved: dict[str, Any], tmp_path: Path
) -> None:
    ref, save_dir = saved["ref"], tmp_path / "ckpt"
    shutil.copytree(saved["ckpt"], save_dir)
    save = ["--save-dir", str(save_dir), "--save-every", str(EVERY), "--steps", str(STEPS)]

    auto = _run(rank_pools, *save, "--resume", "auto", "--output", str(tmp_path / "auto"))
    assert f"resumed from {save_dir / 'step-00000005'} at step 5" in auto[0]["printed"]
    assert all(r["losses"] == ref for r in auto), (auto[0]["losses"], ref)
    assert _losses(tmp_path / "auto") == ref  # steps 1-5 from the checkpoint, 6-8 trained

    # By path, from an older checkpoint: steps 6 and 8 are saved again (replaced).
    older = str(save_dir / "step-00000003")
    by_path = _run(rank_pools, *save, "--resume", older, "--output", str(tmp_path / "path"))
    assert f"resumed from {older} at step 3" in by_path[0]["printed"]
    assert by_path[0]["losses"] == ref
    assert _losses(tmp_path / "path") == ref
    names = sorted(p.name for p in save_dir.iterdir())
    assert names == [f"step-{s:08d}" for s in (3, 5, 6, 8)]
    last = RunState.from_json((save_dir / "step-00000008" / "trainer.json").read_text())
    assert last.state["losses"] == ref

    # A checkpoint at the last step: nothing left to train, the history is the result. A
    # newer step-N without its COMPLETE (copied by hand, say) is passed over, and kept.
    shutil.copytree(save_dir / "step-00000008", save_dir / "step-00000009")
    (save_dir / "step-00000009" / "COMPLETE").unlink()
    done = _run(rank_pools, *save, "--resume", "auto", "--output", str(tmp_path / "done"))
    assert done[0]["losses"] == ref
    assert f"resumed from {save_dir / 'step-00000008'} at step 8" in done[0]["printed"]
    assert "ignored step-00000009: incomplete, never loaded\n" in done[0]["printed"]
    assert (save_dir / "step-00000009").is_dir()


def test_resume_at_other_layouts(
    rank_pools: RankPools, saved: dict[str, Any], tmp_path: Path
) -> None:
    """Saved at TP=2 × DP=2 (SP, distributed optimizer), continued at TP=1 × DP=4 and
    TP=4 × DP=1 (printed with -s; measured here 0 and 1.2e-7 relative over steps 4-8)."""
    ref, path = saved["ref"], str(saved["ckpt"] / "step-00000003")
    for name, layout in OTHER_LAYOUTS.items():
        out = tmp_path / name.replace(" ", "")
        runs = _run(
            rank_pools, *layout, "--steps", str(STEPS), "--resume", path, "--output", str(out)
        )
        losses = runs[0]["losses"]
        assert f"resumed from {path} at step 3" in runs[0]["printed"]
        assert losses[:3] == ref[:3]
        rel = max_rel_loss_diff(losses[3:], ref[3:])
        print(f"resumed at {name}: steps 4-{STEPS} max relative loss difference {rel:.1e}")
        assert rel <= 1e-5, (name, losses, ref)
        assert _losses(out) == losses


def controls(path: str, stop: int, steps: int) -> dict[str, Any]:
    """Runs on every rank (TP=2 × DP=2): resumes that forget one part of the state, and the
    RNG states a proper resume restores."""
    plan = train_gpt.plan(train_gpt.parse_args(SMALL), 4)
    seed = int(plan.run_settings()["data_seed"])

    def batch(step: int) -> torch.Tensor:
        return global_batch(step, plan.global_batch, plan.model.seq_length, seed=seed)

    found = Found(Path(path), stop)
    pgc = mg.initialize_model_parallel(plan.layout.tp)
    try:
        cpu, full = torch.device("cpu"), init_full_weights(plan.model, seed)

        def fresh() -> Any:
            return parallelize(plan.model, plan.layout, plan.optimizer, pgc, full, cpu)

        def load(trainer: Any) -> None:
            Checkpointer(None, trainer.model, trainer.optimizer, pg_collection=pgc).load(found)

        # The data stream restarted: the right state, the batches of steps 1, 2, ...
        trainer = fresh()
        load(trainer)
        data_restarted = [train_step(trainer, batch(s)) for s in range(steps - stop)]
        # No optimizer state: the model's weights only, AdamW's moments and step from zero.
        trainer = fresh()
        weights = model_sharded_state_dict(trainer.model.module)
        dcp_load(weights, checkpoint_id=path)
        trainer.optimizer.reload_model_params()
        no_optimizer = [train_step(trainer, batch(s)) for s in range(stop, steps)]
        # RNG states: drawn from after the load here, so compare the bytes right after it.
        torch.manual_seed(999)
        trainer = fresh()
        load(trainer)
        rng_after_load = torch.get_rng_state()
        final_weights(trainer)  # the loaded model is usable: gathers over TP
    finally:
        mg.destroy_model_parallel(pgc)
    rank = dist.get_rank()
    saved_rng = torch.load(Path(path) / "rng" / f"rank-{rank:05d}.pt", weights_only=True)
    return {
        "data_restarted": data_restarted,
        "no_optimizer": no_optimizer,
        "rng_restored": torch.equal(rng_after_load, saved_rng["cpu"]),
    }


def test_forgetting_part_of_the_state_changes_the_losses(
    rank_pools: RankPools, saved: dict[str, Any]
) -> None:
    ref_tail = saved["ref"][3:]
    per_rank = rank_pools.get(4).run(controls, str(saved["ckpt"] / "step-00000003"), 3, STEPS)
    assert all(r["rng_restored"] for r in per_rank)
    for key in ("data_restarted", "no_optimizer"):
        rel = max_rel_loss_diff(per_rank[0][key], ref_tail)
        print(f"resume with {key.replace('_', ' ')}: max relative loss difference {rel:.1e}")
        assert rel > 1e-3, (key, per_rank[0][key], ref_tail)


def _damage(folder: Path, kind: str) -> str:
    """Damage a published checkpoint after the fact, as a disk or an operator might; the
    file it hit."""
    if kind == "truncated":
        shard = folder / "__2_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
        return "__2_0.distcp differs from what was written: 100 bytes now (truncated or grown)"
    if kind == "missing":
        (folder / "rng" / "rank-00001.pt").unlink()
        return "rng/rank-00001.pt is missing (written by rank 1;"
    data = bytearray((folder / "__3_0.distcp").read_bytes())
    data[-9] ^= 0x10  # one flipped bit in rank 3's shard
    (folder / "__3_0.distcp").write_bytes(bytes(data))
    return "__3_0.distcp differs from what was written: same size, other content (written by rank 3"


@pytest.mark.parametrize("kind", ["truncated", "missing", "altered"])
def test_auto_passes_over_a_damaged_checkpoint(
    saved: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    """``--resume auto`` takes the newest intact checkpoint and names the damaged newer one
    (this rank's verdict, no communication); the next test resumes from it on 4 ranks."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved["ckpt"], save_dir)
    hit = _damage(save_dir / "step-00000005", kind)
    run = train_gpt.plan(train_gpt.parse_args([*SMALL, "--steps", "8"]), 4).run_settings()
    found = inspect_checkpoint("auto", save_dir, run)
    assert (found.path, found.step) == (save_dir / "step-00000003", 3)
    assert len(found.damaged) == 1, found.damaged
    assert found.damaged[0].startswith("step-00000005: "), found.damaged
    assert hit in found.damaged[0], found.damaged
    # by path, the damaged one is an error naming the file and the rank that wrote it
    with pytest.raises(ResumeError) as by_path:
        inspect_checkpoint(str(save_dir / "step-00000005"), save_dir, run)
    assert f"checkpoint {save_dir / 'step-00000005'} is corrupted: {hit}" in str(by_path.value)


def test_resume_auto_after_damage_continues_bit_identically(
    rank_pools: RankPools, saved: dict[str, Any], tmp_path: Path
) -> None:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved["ckpt"], save_dir)
    _damage(save_dir / "step-00000005", "truncated")
    argv = ["--save-dir", str(save_dir), "--steps", str(STEPS), "--resume", "auto"]
    per_rank = _run(rank_pools, *argv, "--output", str(tmp_path / "out"))
    printed = per_rank[0]["printed"]
    assert "ignored step-00000005: __2_0.distcp differs from what was written" in printed
    assert "falling back to an older checkpoint" in printed
    assert f"resumed from {save_dir / 'step-00000003'} at step 3" in printed
    assert all(r["losses"] == saved["ref"] for r in per_rank)
    # the damaged checkpoint stays on disk for a look (a later save of step 5 replaces it)
    assert (save_dir / "step-00000005").is_dir()


def _tree(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with its content's hash: to show nothing was
    written, changed or removed."""
    if not folder.exists():
        return {}
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _bad_inputs(save_dir: Path, root: Path) -> list[tuple[str, list[str], list[str]]]:
    """(case, extra flags, fragments of the error) for each bad resume input, after
    preparing the broken checkpoints next to the good ones."""
    good = save_dir / "step-00000003"
    corrupted = root / "corrupted" / "step-00000003"
    shutil.copytree(good, corrupted)
    shard = corrupted / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in rank 1's tensor data
    shard.write_bytes(bytes(data))
    truncated = root / "truncated" / "step-00000003"
    shutil.copytree(good, truncated)
    (truncated / ".metadata").write_bytes((good / ".metadata").read_bytes()[:10])
    no_rng = root / "no_rng" / "step-00000003"
    shutil.copytree(good, no_rng)
    (no_rng / "rng" / "rank-00002.pt").unlink()
    partial = root / "crashed" / ".step-00000006.partial"
    shutil.copytree(good, partial)
    (partial / "COMPLETE").unlink()
    (partial / "trainer.json").unlink()
    return [
        ("missing folder", ["--resume", str(root / "nope")], ["no such checkpoint folder"]),
        (
            "another model",
            ["--hidden-size", "48", "--resume", str(good)],
            ["was saved by another run", "model.hidden_size: 32 there, 48 here"],
        ),
        (
            "corrupted",
            ["--resume", str(corrupted)],
            ["is corrupted: __1_0.distcp differs from what was written"],
        ),
        ("file missing", ["--resume", str(no_rng)], ["rng/rank-00002.pt is missing"]),
        (
            "truncated",
            ["--resume", str(truncated)],
            ["is corrupted: .metadata differs from what was written: 10 bytes now"],
        ),
        ("incomplete", ["--resume", str(partial)], ["is incomplete: it has no COMPLETE file"]),
        ("folder of checkpoints", ["--resume", str(save_dir)], ["is a folder of checkpoints"]),
        ("past --steps", ["--steps", "2", "--resume", str(good)], ["at step 3, past --steps 2"]),
    ]


def test_bad_resume_is_one_error_on_every_rank_and_writes_nothing(
    rank_pools: RankPools, saved: dict[str, Any], tmp_path: Path
) -> None:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved["ckpt"], save_dir)
    cases = _bad_inputs(save_dir, tmp_path)
    before = _tree(tmp_path)
    for case, flags, fragments in cases:
        out = tmp_path / "out"
        argv = ["--steps", str(STEPS), "--save-dir", str(save_dir), "--output", str(out)]
        per_rank = _run(rank_pools, *argv, *flags)
        errors = {r["error"] for r in per_rank}
        assert len(errors) == 1, (case, errors)  # every rank: the same verdict
        (error,) = errors
        assert error is not None, (case, per_rank[0]["printed"])
        for fragment in fragments:
            assert fragment in error, (case, fragment, error)
        assert all(r["printed"] == "" for r in per_rank), case  # before the header
        assert _tree(tmp_path) == before, case  # nothing written, changed or removed


def disagree() -> str:
    """Runs on every rank: ranks 0-1 and 2-3 see different checkpoints."""
    rank = dist.get_rank()
    mine = Found(Path(f"/ckpt/step-{rank // 2:08d}"), rank // 2)
    try:
        agree_on_checkpoint(mine, None, dist.group.WORLD)
    except ResumeError as err:
        return str(err)
    return "agreed"


def test_ranks_that_see_different_checkpoints_all_stop(rank_pools: RankPools) -> None:
    errors = set(rank_pools.get(4).run(disagree))
    assert len(errors) == 1
    (error,) = errors
    assert "the ranks see different checkpoints" in error
    assert "rank 2: /ckpt/step-00000001" in error


def one_rank_fails() -> tuple[str, float]:
    """Runs on every rank: only rank 2 finds the checkpoint unusable (say its node cannot
    read a file); the verdict exchange stops every rank at once."""
    rank = dist.get_rank()
    error = "checkpoint /ckpt/step-00000001: cannot read it (EIO)" if rank == 2 else None
    mine = None if error else Found(Path("/ckpt/step-00000001"), 1)
    start = time.monotonic()
    try:
        agree_on_checkpoint(mine, error, dist.group.WORLD)
    except ResumeError as err:
        return str(err), time.monotonic() - start
    return "agreed", time.monotonic() - start


def test_a_resume_check_failing_on_one_rank_stops_every_rank(rank_pools: RankPools) -> None:
    outs = rank_pools.get(4).run(one_rank_fails)
    assert {text for text, _ in outs} == {
        "rank 2: checkpoint /ckpt/step-00000001: cannot read it (EIO)"
    }
    assert all(seconds < 5.0 for _, seconds in outs)  # the bound; not a timeout


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--save-every", "5"], "--save-every needs --save-dir"),
        (["--save-dir", "d", "--save-every", "0"], "--save-every=0 must be >= 1"),
        (["--resume", "auto"], "--resume auto looks for the newest checkpoint in --save-dir"),
    ],
)
def test_checkpoint_flags_are_checked_before_torchrun(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_gpt.main(["--preflight", "4", *flags]) == 2
    assert fragment in capsys.readouterr().err
    assert train_gpt.main(["--preflight", "4", "--save-dir", "d", "--resume", "auto"]) == 0


def test_bad_resume_under_main_is_one_message_and_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``main`` as torchrun runs it, on a world of one joined by this process: the verdict
    comes before the header, the error is printed once and the status is 2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    argv = [*SMALL, "--tp", "1", "--dp", "1"]
    missing = tmp_path / "nope"
    assert train_gpt.main([*argv, "--resume", str(missing), "--output", str(tmp_path)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == f"train_gpt: error: checkpoint {missing}: no such checkpoint folder\n"
    assert not dist.is_initialized()
