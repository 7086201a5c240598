"""Impossible layouts and bad inputs fail early, with messages that name the setting, its
value and the fix.

Localizes the checks of the integration pieces: ``GPTConfig`` and ``ParallelLayout.check``
(pure, no processes), the demo's flag validation (``plan``, and ``main`` returning 2 before
any process group exists), and, on 2 gloo ranks, weight loading and a pipeline stage called
without its input, each raising before any collective (the recorder's log stays empty).
No tolerances: these are exact checks.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples import train_gpt
from examples.gpt import GPT, GPTConfig, ParallelLayout, init_full_weights, load_full_weights
from integration_tests._common import CFG, full_weights
from mc_groups.testing import RankPools, error_kind


@pytest.mark.parametrize(
    ("layout", "world", "batch", "needles"),
    [
        (ParallelLayout(tp=2, dp=1), 4, 8, ["tp × dp × pp = 2 × 1 × 1 = 2", "4 ranks"]),
        (ParallelLayout(tp=3, dp=1), 3, 8, ["hidden_size=32", "tp=3", "multiple of 3"]),
        (ParallelLayout(tp=8, dp=1), 8, 8, ["num_heads=4", "tp=8"]),
        (ParallelLayout(tp=1, dp=1, sequence_parallel=True), 1, 8, ["needs tp > 1"]),
        (ParallelLayout(tp=1, dp=1, pp=4), 4, 8, ["num_layers=2", "pp=4"]),
        (ParallelLayout(tp=1, dp=2, microbatches=3), 2, 8, ["global_batch=8", "2 × 3 = 6"]),
        (ParallelLayout(tp=0, dp=2), 2, 8, ["tp=0 must be >= 1"]),
        (ParallelLayout(dp=2, vpp=2), 2, 8, ["vpp=2 needs pp > 1"]),
        (ParallelLayout(pp=2, vpp=2), 2, 8, ["num_layers=2", "pp × vpp = 2 × 2 = 4"]),
        (
            ParallelLayout(dp=4, distributed_optimizer=True, num_distributed_optimizer_instances=3),
            4,
            8,
            ["num_distributed_optimizer_instances=3 does not divide dp=4"],
        ),
    ],
)
def test_layout_check_names_the_setting(
    layout: ParallelLayout, world: int, batch: int, needles: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        layout.check(CFG, world, batch)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_sequence_parallel_needs_a_divisible_sequence() -> None:
    odd = dataclasses.replace(CFG, seq_length=15)
    with pytest.raises(ValueError, match=r"seq_length=15 is not divisible by tp=2"):
        ParallelLayout(tp=2, dp=1, sequence_parallel=True).check(odd, 2, 8)
    ParallelLayout(tp=2, dp=1).check(odd, 2, 8)  # without SP the sequence is not split


def test_model_config_rejects_uneven_heads() -> None:
    with pytest.raises(ValueError, match=r"hidden_size=30 is not divisible by num_heads=4"):
        GPTConfig(hidden_size=30)
    with pytest.raises(TypeError, match=r"num_layers=2.0 must be an int"):
        GPTConfig(num_layers=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "world", "needles"),
    [
        (["--tp", "3", "--dp", "2"], 4, ["--tp 3 × --dp 2 = 6", "the demo runs on 4 ranks"]),
        (["--tp", "8", "--dp", "1", "--hidden-size", "36"], 8, ["hidden_size=36", "tp=8"]),
        (["--hidden-size", "66"], 4, ["hidden_size=66 is not divisible by num_heads=4"]),
        (["--steps", "0"], 4, ["--steps=0 must be >= 1"]),
        (["--global-batch", "6"], 4, ["global_batch=6", "2 × 2 = 4"]),
    ],
)
def test_demo_flags_are_checked_before_launch(
    argv: list[str], world: int, needles: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        train_gpt.plan(train_gpt.parse_args(argv), world)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_tp1_turns_the_default_sequence_parallelism_off_with_a_note() -> None:
    """Megatron's behaviour: at TP=1 sequence parallelism is off, said once (the run prints
    the note first); an explicit --no-sequence-parallel needs no note."""
    run = train_gpt.plan(train_gpt.parse_args(["--tp", "1", "--dp", "4"]), 4)
    assert not run.layout.sequence_parallel
    assert run.notes == (
        "note: --tp 1: sequence parallelism is off (it splits activations "
        "over the TP ranks; Megatron turns it off at TP=1 too)",
    )
    quiet = train_gpt.plan(train_gpt.parse_args(["--tp", "1", "--no-sequence-parallel"]), 2)
    assert (quiet.layout.sequence_parallel, quiet.notes) == (False, ())
    assert train_gpt.plan(train_gpt.parse_args([]), 4).layout.sequence_parallel


def test_demo_main_reports_and_exits_2_without_joining_a_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert train_gpt.main(["--tp", "3"]) == 2
    assert "train_gpt: error: --tp 3 × --dp 2 = 6" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet: one report is enough
    assert train_gpt.main(["--tp", "3"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("WORLD_SIZE")
    assert train_gpt.main([]) == 2
    assert "run under torchrun" in capsys.readouterr().err
    # The check hatch runs before torchrun: the same message once, and 0 for good flags.
    assert train_gpt.main(["--preflight", "4", "--tp", "3"]) == 2
    assert capsys.readouterr().err.startswith("train_gpt: error: --tp 3 × --dp 2 = 6")
    assert train_gpt.main(["--preflight", "4"]) == 0
    assert capsys.readouterr() == ("", "")
    assert not dist.is_initialized()


def _expect_error(call: Any, kind: type[Exception], needle: str) -> str:
    with mg.record_collectives() as log, pytest.raises(kind, match=re.escape(needle)) as err:
        call()
    assert not log, log  # raised before any collective
    return error_kind(err.value)


def bad_inputs() -> list[str]:
    """Runs on 2 ranks (TP=2, then PP=2)."""
    seen = []
    layout = ParallelLayout(tp=2, dp=1)
    pgc = mg.initialize_model_parallel(2)
    try:
        model = GPT(CFG, layout.model_parallel_config(), pgc)
        missing = dict(full_weights())
        del missing["decoder.layers.1.mlp.linear_fc2.bias"]
        wider = init_full_weights(dataclasses.replace(CFG, hidden_size=64), 0)
        tp = pgc.require("tp", "test")
        seen.append(
            _expect_error(
                lambda: load_full_weights(model, missing, tp),
                ValueError,
                "no 'decoder.layers.1.mlp.linear_fc2.bias'",
            )
        )
        seen.append(
            _expect_error(
                lambda: load_full_weights(model, wider, tp),
                ValueError,
                "embedding.word_embeddings.weight: rank",
            )
        )
    finally:
        mg.destroy_model_parallel(pgc)
    pipeline = ParallelLayout(pp=2)
    pgc = mg.initialize_model_parallel(1, 2)
    try:
        stage = GPT(CFG, pipeline.model_parallel_config(), pgc, layers=[dist.get_rank()])
        tokens = torch.zeros(2, CFG.seq_length, dtype=torch.int64)
        if not stage.pre_process:
            seen.append(
                _expect_error(
                    lambda: stage(tokens, tokens),
                    ValueError,
                    "hidden_states=None on a pipeline stage without",
                )
            )
    finally:
        mg.destroy_model_parallel(pgc)
    return seen


def test_bad_inputs_raise_before_any_collective(rank_pools: RankPools) -> None:
    assert rank_pools.get(2).run(bad_inputs) == [
        ["ValueError", "ValueError"],
        ["ValueError", "ValueError", "ValueError"],
    ]
