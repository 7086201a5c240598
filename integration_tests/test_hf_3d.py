"""``examples/hf_3d.py``: a ``transformers`` Llama (4 blocks, tied embeddings) trained at
TP × PP × DP with sequence parallelism through mc's public API, against the same model
trained by one process on the whole global batch (``hf_3d.reference``: ``transformers``' own
loss, ``torch.nn.utils.clip_grad_norm_`` at 1.0, ``torch.optim.SGD`` with momentum), and
resumed across layouts. The example clips with ``ShardedOptimizer(max_grad_norm=1.0)``;
the norm is above 1 from step 2 on, so clipping acts.

The grid is the cheapest that covers every named layout and both 1F1B and interleaved with
SP on, on the session's pools (the example's ``train`` called in the ranks, 4 steps each):

- 2 ranks: PP=2, 1F1B (8 micro-batches of one sequence).
- 4 ranks: TP=2 × PP=2, interleaved 1F1B (2 chunks per rank, one block each), SP,
  checkpoints every 2 steps; then ``step-00000004`` damaged and ``--resume auto`` at
  TP=1 × DP=4 (PP=1: ``build_pipeline``'s one-stage 1F1B, 2 micro-batches per DP rank):
  it falls back to step 2, trains steps 3 and 4 and publishes step 4 again.
- 8 ranks: TP=2 × PP=2 × DP=2, 1F1B, SP, distributed optimizer.
- torchrun, 2 ranks: ``-m examples.hf_3d --pp 2 --schedule gpipe --json``, the command line
  end to end (the TP=1 note printed once, the JSON's losses, grad norms and one-process
  ones).

Tolerances (fp32, gloo): loss and grad norm per step within 1e-5 relative, final weights
within 1e-6 absolute of one process (every tensor of the reference moves by at least 100×
that in 4 steps); the resumed losses and grad norms within 1e-6 relative of the
uninterrupted run (a resume without the momentum buffers moves step 4's loss by 1.4e-2:
checked below on one process).

Collectives, per step from step 2 on (step 1 also infers the stage shapes), on every rank:
``M`` activations sent and received (or their grads) across every boundary next to one of
its chunks; exactly one ``embedding grads`` all-reduce over the first and last stage (the
tied table's two copies); with DP, each bucket group's grad reduce-scatter and param
all-gather once, the reductions before finalize's embedding all-reduce and, on the last
stage, before its last activation-grad send (overlapped with the schedule). Sequence
parallelism, derived per micro-batch from the plan (``docs/parallelize.md``): each block's
attention and MLP all-gather the sequence on entry and reduce-scatter on exit, both ways
(4 all-gathers and 4 reduce-scatters per block); the first stage's embedding all-reduces
over TP (vocabulary-parallel) and scatters the sequence (its backward all-gathers); the
last stage's LM head gathers the sequence (backward: a reduce-scatter) and the vocabulary;
finalize sums the norms' grads over TP once per step. Clipping adds one all-reduce over the
world per step (the norm and the step's checks).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import mc_groups as mg
from examples import hf_3d
from integration_tests import _prefetch
from mc_groups.testing import RankPools
from mc_train.checkpoint import inspect_checkpoint

pytest.importorskip("transformers", reason="the example trains a transformers Llama")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
Record = tuple[str, tuple[int, ...], str]


def _train(argv: list[str]) -> dict[str, Any]:
    """Runs on every rank: the example's ``train`` with these flags, its collectives split
    per step (each step ends with the loss's broadcast over pp)."""
    torch.set_num_threads(1)
    args = hf_3d.parse_args(
        [*argv, "--steps", str(STEPS)], world=torch.distributed.get_world_size()
    )
    with mg.record_collectives() as log:
        run = hf_3d.train(args)
    steps: list[list[Record]] = [[]]
    for rec in log:
        steps[-1].append((rec.op, rec.group_ranks, rec.label))
        if rec.op == "broadcast" and rec.label == "loss for logging":
            steps.append([])
    r, tp, pp, dp = torch.distributed.get_rank(), args.tp, args.pp, args.dp
    t, d, p = r % tp, r // tp % dp, r // (tp * dp)  # mc's order: TP fastest, then DP, then PP
    return {
        "stage": p,
        "tp_ranks": tuple(tp * (d + dp * p) + i for i in range(tp)),
        "dp_ranks": tuple(t + tp * (i + dp * p) for i in range(dp)),
        "pp_ranks": tuple(t + tp * (d + dp * i) for i in range(pp)),
        "first_of_tp_dp": t == d == 0,
        "losses": run.losses,
        "grad_norms": run.grad_norms,
        "steps": steps[1:STEPS],  # steps 2..4
        "weights": run.weights,
        "resumed": None if run.resumed is None else (run.resumed.step, run.resumed.damaged),
    }


def train_grid(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """Runs on every rank: each command line in turn."""
    return [_train(argv) for argv in argvs]


def _flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _check_collectives(argv: list[str], out: dict[str, Any]) -> None:
    tp, pp, dp = (int(_flag(argv, f, "1")) for f in ("--tp", "--pp", "--dp"))
    v = hf_3d.CHUNKS[_flag(argv, "--schedule", "1f1b")]
    m, stages, p = hf_3d.BATCH // dp, pp * v, out["stage"]
    chunks = [c * pp + p for c in range(v)]
    boundaries = sum((c > 0) + (c < stages - 1) for c in chunks)
    first, last = int(0 in chunks), int(stages - 1 in chunks)
    blocks = hf_3d.LAYERS // stages * v  # on this rank
    tp_ranks, pp_ranks, dp_ranks = out["tp_ranks"], out["pp_ranks"], out["dp_ranks"]
    for log in out["steps"]:
        count = Counter(log)
        p2p = [r for r in log if r[2] in ("activation", "activation grad")]
        assert [r[0] for r in p2p].count("send") == m * boundaries, log
        assert [r[0] for r in p2p].count("recv") == m * boundaries, log
        assert {r[1] for r in p2p} == {pp_ranks}
        embd = ("all_reduce", pp_ranks, "embedding grads")
        assert count[embd] == 1, log
        # clipping: the whole model's norm (and the step's checks) in one world all-reduce
        assert count["all_reduce", tuple(range(tp * pp * dp)), "grad norm and step status"] == 1
        if tp > 1:  # sequence parallelism (module notes)
            assert count["all_gather", tp_ranks, "tp gather dim 0"] == m * (
                4 * blocks + first + last
            )
            assert count["reduce_scatter", tp_ranks, "tp reduce-scatter dim 0"] == m * (
                4 * blocks + last
            )
            assert count["all_reduce", tp_ranks, "tp all-reduce"] == m * first
            assert count["all_gather", tp_ranks, "tp gather last dim"] == m * last
            assert count["all_reduce", tp_ranks, "non-tensor-parallel grads"] == 1
        if dp == 1:
            continue
        grads = [i for i, r in enumerate(log) if r[1] == dp_ranks and r[2].startswith("grad")]
        groups = Counter(log[i][2].removeprefix("grad reduce ") for i in grads)
        gathers = Counter(
            r[2].removeprefix("param gather ")
            for r in log
            if r[1] == dp_ranks and r[2].startswith("param gather")
        )
        assert groups, log
        assert set(groups.values()) == {1}, groups  # each bucket group reduced once
        assert gathers == groups, (gathers, groups)
        assert max(grads) < log.index(embd), log
        if last:
            last_send = max(i for i, r in enumerate(log) if r[0] == "send")
            assert max(grads) < last_send, log


def _rel(values: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, ref, strict=True))


def _check_parity(
    argv: list[str], outs: list[dict[str, Any]], ref: hf_3d.Run
) -> tuple[float, float, float]:
    """Every rank's losses and grad norms within 1e-5 relative of one process, the merged
    weights within 1e-6: (loss, norm, weights) differences."""
    rel = max(_rel(out["losses"], ref.losses) for out in outs)
    assert rel <= 1e-5, (argv, rel)
    norm = max(_rel(out["grad_norms"], ref.grad_norms) for out in outs)
    assert norm <= 1e-5, (argv, norm)
    merged: dict[str, torch.Tensor] = {}
    for out in outs:
        if out["first_of_tp_dp"]:
            merged |= out["weights"]
    assert set(merged) == set(ref.weights), set(merged) ^ set(ref.weights)
    diff = max(float((merged[k] - w).abs().max()) for k, w in ref.weights.items())
    assert diff <= 1e-6, (argv, diff)
    return rel, norm, diff


@pytest.fixture(scope="module")
def ref() -> hf_3d.Run:
    """The one-process run (4 steps): every tensor moves by at least 100x the bound, and
    clipping at 1.0 acts (steps 2-4 have a norm above it)."""
    run = hf_3d.reference(STEPS)
    start = hf_3d.build_model().state_dict()
    assert min(float((w - start[k]).abs().max()) for k, w in run.weights.items()) >= 1e-4
    assert min(run.grad_norms[1:]) > hf_3d.CLIP, run.grad_norms
    return run


@pytest.mark.parametrize(
    ("world", "argv"),
    [
        (2, ["--pp", "2"]),
        (8, ["--tp", "2", "--pp", "2", "--dp", "2"]),
    ],
    ids=["PP2-1f1b", "TP2xPP2xDP2-1f1b"],
)
def test_layout_matches_one_process(
    rank_pools: RankPools, ref: hf_3d.Run, world: int, argv: list[str]
) -> None:
    outs = [rank[0] for rank in rank_pools.get(world).run(train_grid, [argv])]
    rel, norm, diff = _check_parity(argv, outs, ref)
    for out in outs:
        _check_collectives(argv, out)
    print(f"{' '.join(argv)}: loss {rel:.2e}, grad norm {norm:.2e}, weights {diff:.2e}")


def test_resume_across_layouts_past_a_damaged_checkpoint(
    rank_pools: RankPools, ref: hf_3d.Run, tmp_path: Path
) -> None:
    """Saved at TP=2 × PP=2 (interleaved, SP), resumed at TP=1 × DP=4 past a damaged
    newest checkpoint."""
    pool = rank_pools.get(4)
    saving = ["--tp", "2", "--pp", "2", "--schedule", "interleaved", "--save-dir", str(tmp_path)]
    outs = [rank[0] for rank in pool.run(train_grid, [[*saving, "--save-every", "2"]])]
    rel, norm, diff = _check_parity(saving, outs, ref)
    for out in outs:
        _check_collectives(saving, out)
    print(f"TP2xPP2 interleaved: loss {rel:.2e}, grad norm {norm:.2e}, weights {diff:.2e}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]
    part = sorted((tmp_path / "step-00000004").glob("*.distcp"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte altered after publication
    part.write_bytes(bytes(data))

    resuming = ["--dp", "4", "--save-dir", str(tmp_path), "--resume", "auto"]
    resumed = [rank[0] for rank in pool.run(train_grid, [resuming])]
    for out in resumed:
        step, damaged = out["resumed"]
        assert step == 2, out["resumed"]
        assert len(damaged) == 1, damaged
        assert damaged[0].startswith("step-00000004"), damaged
        assert out["losses"][:2] == outs[0]["losses"][:2]  # the checkpoint's history
        assert out["grad_norms"][:2] == outs[0]["grad_norms"][:2]
    uninterrupted = outs[0]["losses"][2:]
    again = max(_rel(out["losses"][2:], uninterrupted) for out in resumed)
    assert again <= 1e-6, again
    again_norm = max(_rel(out["grad_norms"][2:], outs[0]["grad_norms"][2:]) for out in resumed)
    assert again_norm <= 1e-6, again_norm
    _, _, diff = _check_parity(resuming, resumed, ref)
    # Resumed without the momentum buffers, step 4 would move beyond the bound (one process):
    # the check above can fail.
    model = hf_3d.build_model()
    opt = hf_3d.sgd(model.parameters())
    for step in range(STEPS):
        if step == 2:
            opt = hf_3d.sgd(model.parameters())  # restarted without optimizer state
        ids = hf_3d.global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hf_3d.CLIP)
        opt.step()
    cold = abs(loss.item() - uninterrupted[-1]) / uninterrupted[-1]
    assert cold > 100 * 1e-6, cold
    print(
        f"resumed at TP1xDP4 from step 2: loss {again:.2e}, grad norm {again_norm:.2e} of the "
        f"uninterrupted run, weights {diff:.2e} (cold optimizer: {cold:.1e})"
    )
    run = {"model": "examples.hf_3d", "lr": hf_3d.LR, "momentum": hf_3d.MOMENTUM, "clip": 1.0}
    republished = inspect_checkpoint("auto", tmp_path, run)  # step 4, saved again, intact
    assert (republished.step, republished.damaged) == (4, ()), republished


def _torchrun(folder: Path) -> subprocess.CompletedProcess[str]:
    """``torchrun -m examples.hf_3d --pp 2 --schedule gpipe --json folder/run.json``."""
    out = folder / "run.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv = [
        "-m",
        "examples.hf_3d",
        "--pp",
        "2",
        "--schedule",
        "gpipe",
        "--steps",
        str(STEPS),
        "--json",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return subprocess.run(
        [*cmd, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )


# Started in the background when the session has collected this module (a torchrun job of
# three processes importing torch and transformers): integration_tests/_prefetch.py.
PREFETCH = {"torchrun": _torchrun}


def test_torchrun_command_line(
    ref: hf_3d.Run, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``torchrun -m examples.hf_3d --pp 2 --schedule gpipe --json``: the note on TP=1 once,
    the JSON's losses and grad norms within 1e-5 of one process and its reference equal to
    it."""
    folder, done = _prefetch.take(request, "torchrun", tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count(hf_3d.SP_OFF) == 1, done.stdout
    result = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    assert result["layout"] == {"tp": 1, "pp": 2, "dp": 1, "schedule": "gpipe"}
    assert result["reference"] == ref.losses
    assert result["reference_grad_norms"] == ref.grad_norms
    assert _rel(result["losses"], ref.losses) <= 1e-5, result
    assert _rel(result["grad_norms"], ref.grad_norms) <= 1e-5, result


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        (["--tp", "3"], None, "--tp 3 must divide the model's 4 KV heads"),
        (["--dp", "3"], None, "--dp 3 must divide the global batch of 8 sequences"),
        (["--pp", "4", "--schedule", "interleaved"], None, "more stages than 4 blocks"),
        (["--tp", "2", "--pp", "2"], 8, "is not the 8 ranks started"),
        (["--schedule", "interleaved"], None, "schedule='interleaved' needs pp >= 2"),
        (["--pp", "4", "--dp", "4"], None, "microbatches=2 < pp=4"),
        (["--resume", "auto"], None, "--resume auto and --save-every need --save-dir"),
    ],
)
def test_command_line_refuses_layouts_it_cannot_run(
    argv: list[str], world: int | None, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        hf_3d.parse_args(argv, world)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_docs_show_train_verbatim() -> None:
    """docs/hf_3d.md walks through the example's ``train`` as it is."""
    page = (ROOT / "docs" / "hf_3d.md").read_text(encoding="utf-8")
    assert inspect.getsource(hf_3d.train).rstrip() in page, "docs/hf_3d.md lost train's code"
