"""Agreement at construction (``mc_tp_layers.agreement``): TP peers that build a layer
differently fail on every rank, at that layer's construction, with the same error naming
the layer, the field and the ranks.

Each disagreement case runs on 2 gloo ranks whose layers differ in one setting; each rank
would feed an input its own layer accepts, so that without the check the first forward
would abort inside gloo, hang, or run on with wrong numbers (the settings the issue lists:
Column ``input_size``, Row ``output_size`` at equal numel, ``num_embeddings``, a bias on
one rank, a flag, and a layer more on one rank before a layer both build). The build runs
under a 30 s deadline; each rank measures its own time to the error, which must stay under
5 s, and no collective was issued. Agreeing ranks: one exchange of one digest per layer at
its construction and none in any forward, not recorded by ``record_collectives`` (so
counts do not change), and the outputs equal those of the twin layers built alike (exact:
same GEMMs). Layers on a group of one rank and layers built under ``torch.device("meta")``
are covered too.

The vocabulary-parallel cross-entropy checks its per-call arguments itself: a vocabulary
slice, a target, a label smoothing that differ are named on every rank (CPU), after the
MAX all-reduce and before the second collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.comm import cross_rank
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers_tests._helpers import config, randn, world

DEADLINE_S = 30.0
WITHIN_S = 5.0
Z = torch.nn.init.zeros_


def _column(pgc: mg.ProcessGroupCollection, k: int, n: int, **kw: Any) -> tpl.ColumnParallelLinear:
    return tpl.ColumnParallelLinear(
        k, n, config=config(2), init_method=torch.nn.init.ones_, pg_collection=pgc, **kw
    )


def _row(
    pgc: mg.ProcessGroupCollection, k: int, n: int, bias: bool = False, **kw: Any
) -> tpl.RowParallelLinear:
    kw.setdefault("input_is_parallel", True)
    kw.setdefault("skip_bias_add", False)
    return tpl.RowParallelLinear(
        k,
        n,
        config=config(2),
        init_method=torch.nn.init.ones_,
        bias=bias,
        pg_collection=pgc,
        **kw,
    )


def _embedding(pgc: mg.ProcessGroupCollection, vocab: int) -> tpl.VocabParallelEmbedding:
    return tpl.VocabParallelEmbedding(
        vocab, 4, init_method=torch.nn.init.ones_, config=config(2), pg_collection=pgc
    )


# case: rank -> (the module it builds, the input it feeds)
_Build = Callable[[mg.ProcessGroupCollection, int], tuple[torch.nn.Module, torch.Tensor]]


def _column_input_size(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    k = 8 if rank == 0 else 6
    return _column(pgc, k, 4), torch.ones(2, 1, k)


def _row_output_equal_numel(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    # rank 0: [4 tokens, n=4]; rank 1: [2 tokens, n=8]: the all-reduce moves 16 floats on both
    n, tokens = (4, 4) if rank == 0 else (8, 2)
    return _row(pgc, 8, n), torch.ones(tokens, 4)


def _vocab(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    return _embedding(pgc, 8 if rank == 0 else 12), torch.zeros(2, 3, dtype=torch.long)


def _row_bias(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    return _row(pgc, 8, 4, bias=rank == 1), torch.ones(2, 4)


def _gather_output(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    return _column(pgc, 8, 4, gather_output=rank == 0), torch.ones(2, 8)


def _extra_layer(pgc: mg.ProcessGroupCollection, rank: int) -> tuple[Any, torch.Tensor]:
    # rank 1 builds a Column more before the Row both build: its Column meets rank 0's Row
    layers: list[torch.nn.Module] = [_column(pgc, 8, 4)]
    layers += [_column(pgc, 8, 4)] if rank == 1 else []
    layers.append(_row(pgc, 4, 8))
    return torch.nn.ModuleList(layers), torch.ones(2, 8)


CASES: dict[str, tuple[_Build, tuple[str, ...]]] = {
    "column input_size": (
        _column_input_size,
        ("ColumnParallelLinear: input_size = 8 on rank(s) [0], 6 on rank(s) [1]",),
    ),
    "row output_size at equal numel": (
        _row_output_equal_numel,
        ("RowParallelLinear: output_size = 4 on rank(s) [0], 8 on rank(s) [1]",),
    ),
    "num_embeddings": (
        _vocab,
        ("VocabParallelEmbedding: num_embeddings = 8 on rank(s) [0], 12 on rank(s) [1]",),
    ),
    "row bias on one rank": (
        _row_bias,
        ("RowParallelLinear: bias = False on rank(s) [0], True on rank(s) [1]",),
    ),
    "gather_output": (
        _gather_output,
        ("ColumnParallelLinear: gather_output = True on rank(s) [0], False on rank(s) [1]",),
    ),
    "a layer more on one rank": (
        _extra_layer,
        (
            "class = RowParallelLinear on rank(s) [0], ColumnParallelLinear on rank(s) [1] "
            "(the ranks built different layers at this point",
        ),
    ),
}


def _forward(module: torch.nn.Module, x: torch.Tensor) -> object:
    first = module[0] if isinstance(module, torch.nn.ModuleList) else module
    return first(x)


def _disagree(case: str) -> dict[str, Any]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        started = time.monotonic()
        with mg.record_collectives() as log:
            try:
                module, x = CASES[case][0](pgc, rank)
                error = "no error"
            except tpl.TensorParallelAgreementError as err:
                error = str(err)
            if error == "no error":  # without the check: the first forward
                _forward(module, x)
        return {"error": error, "seconds": time.monotonic() - started, "log": len(log)}
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_built_differently_fail_alike_naming_field_layer_and_ranks(
    rank_pools: RankPools, case: str
) -> None:
    outs = rank_pools.get(2).run_with_deadline(DEADLINE_S, _disagree, case)
    assert outs[0]["error"] == outs[1]["error"]  # the same message on every rank
    message = outs[0]["error"]
    assert message.startswith(
        "tensor-parallel group ranks [0, 1] built their layers differently (compared as each "
        "layer was built"
    )
    for part in CASES[case][1]:
        assert part in message, f"{part!r} not in {message!r}"
    for out in outs:
        assert out["seconds"] < WITHIN_S
        assert out["log"] == 0  # nothing of the layers' own schedule was issued


def _agree() -> dict[str, Any]:
    pgc = world(2)
    spy = mock.patch.object(mg, "cross_check", wraps=cross_rank.cross_check)
    try:
        with spy as calls, mg.record_collectives() as built:
            torch.manual_seed(0)
            cfg = config(2)
            init = torch.nn.init.normal_
            up = tpl.ColumnParallelLinear(8, 16, config=cfg, init_method=init, pg_collection=pgc)
            down = _row(pgc, 16, 8, bias=True)
            after_two = calls.call_count
            torch.manual_seed(0)
            twin_up = tpl.ColumnParallelLinear(
                8, 16, config=cfg, init_method=init, pg_collection=pgc
            )
            twin_down = _row(pgc, 16, 8, bias=True)
            after_build = calls.call_count
            x = randn(3, 2, 8, seed=4)
            with mg.record_collectives() as first:
                y = down(up(x)[0])[0]
            with mg.record_collectives() as second:
                y2 = down(up(x)[0])[0]
            y_twin = twin_down(twin_up(x)[0])[0]
            total = calls.call_count
        return {
            "after_two": after_two,
            "after_build": after_build,
            "exchanges_total": total,
            "built": [r.op for r in built if r.op != "all_reduce"],
            "first": [r.op for r in first],
            "second": [r.op for r in second],
            "equal": torch.equal(y, y2) and torch.equal(y, y_twin),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_agreeing_ranks_exchange_one_digest_per_layer_when_built_and_nothing_in_forwards(
    rank_pools: RankPools,
) -> None:
    for out in rank_pools.get(2).run(_agree):
        assert out["after_two"] == 2  # one exchange per layer, in its constructor
        assert out["after_build"] == 4
        assert out["exchanges_total"] == 4  # none in any forward (first or later)
        assert out["built"] == []  # the exchanges are not recorded as collectives
        assert out["first"] == out["second"] == ["all_reduce"]  # the Row all-reduce only
        assert out["equal"]


def _one_rank_group() -> list[str]:
    pgc = world(1)
    try:
        with mg.record_collectives(status_exchanges=True) as log:
            tpl.ColumnParallelLinear(
                4, 8, config=config(1), init_method=torch.nn.init.ones_, pg_collection=pgc
            )
        return [r.op for r in log]
    finally:
        mg.destroy_model_parallel(pgc)


def test_one_rank_groups_compare_nothing(rank_pools: RankPools) -> None:
    assert rank_pools.get(2).run(_one_rank_group) == [[], []]


def _meta_build() -> dict[str, Any]:
    """Built under ``torch.device("meta")`` (as FSDP2 / torchtitan initialise): the digest
    is made where the group's backend needs it, not on the default (meta) device."""
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        cfg = config(2, perform_initialization=False)
        out: dict[str, Any] = {}
        with torch.device("meta"), mg.record_collectives(status_exchanges=True) as log:
            tpl.ColumnParallelLinear(8, 4, config=cfg, init_method=Z, pg_collection=pgc)
            try:
                tpl.RowParallelLinear(
                    8,
                    4 if rank == 0 else 8,
                    config=cfg,
                    init_method=Z,
                    bias=False,
                    input_is_parallel=True,
                    skip_bias_add=False,
                    pg_collection=pgc,
                )
                out["error"] = "no error"
            except tpl.TensorParallelAgreementError as err:
                out["error"] = str(err)
        out["log"] = [(r.op, r.label) for r in log]
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_layers_built_on_the_meta_device_compare_alike(rank_pools: RankPools) -> None:
    outs = rank_pools.get(2).run_with_deadline(DEADLINE_S, _meta_build)
    assert outs[0]["error"] == outs[1]["error"]
    assert "RowParallelLinear: output_size = 4 on rank(s) [0], 8 on rank(s) [1]" in outs[0]["error"]
    for out in outs:
        assert out["log"] == [("status_exchange", "tensor-parallel layer construction")] * 2


def _peer_busy_elsewhere() -> dict[str, str]:
    """Rank 0 builds a layer (its exchange) while rank 1 runs an all-reduce: with the
    schedule check on, both raise the schedule check's error, which says what each was
    about to run (the agreement code passes it through)."""
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        with mg.check_collective_schedule():
            try:
                if rank == 0:
                    _column(pgc, 4, 8)
                else:
                    mg.all_reduce(torch.ones(3), pgc.require("tp", "test"), label="elsewhere")
                return {"kind": "no error", "message": ""}
            except mg.CollectiveScheduleError as err:
                return {"kind": error_kind(err), "message": str(err)}
    finally:
        mg.destroy_model_parallel(pgc)


def test_a_peer_running_another_collective_gets_the_schedule_error(rank_pools: RankPools) -> None:
    outs = rank_pools.get(2).run_with_deadline(DEADLINE_S, _peer_busy_elsewhere)
    assert [o["kind"] for o in outs] == ["CollectiveScheduleError"] * 2
    assert outs[0]["message"] == outs[1]["message"]
    # rank 0 is at its layer's construction exchange
    assert "rank(s) [0]: tensor-parallel layer construction" in outs[0]["message"]
    assert "rank(s) [1]: all_reduce(sum) 'elsewhere' of 3 × float32" in outs[0]["message"]


# -- vocab_parallel_cross_entropy: per-call arguments ----------------------------------------


def _ce_disagree(what: str) -> dict[str, Any]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        vocab = 5 if what == "slice" and rank == 1 else 4
        logits = torch.zeros(3, vocab)
        target = torch.tensor([1, 2, 3 if what == "target" and rank == 1 else 0])
        smoothing = 0.1 if what == "smoothing" and rank == 1 else 0.0
        started = time.monotonic()
        with mg.record_collectives() as log:
            try:
                tpl.vocab_parallel_cross_entropy(logits, target, smoothing, tp_group=pgc.tp)
                error = "no error"
            except tpl.TensorParallelAgreementError as err:
                error = str(err)
        return {
            "error": error,
            "seconds": time.monotonic() - started,
            "log": [r.label for r in log],
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(
    ("what", "fragment"),
    [
        ("slice", "vocab_parallel_logits.shape[-1]: 4 on rank(s) [0], 5 on rank(s) [1]"),
        ("target", "target: [3] [1, 2, 0] on rank(s) [0], [3] [1, 2, 3] on rank(s) [1]"),
        ("smoothing", "label_smoothing: 0.0 on rank(s) [0], 0.1 on rank(s) [1]"),
    ],
)
def test_cross_entropy_arguments_that_differ_are_named_on_every_rank(
    rank_pools: RankPools, what: str, fragment: str
) -> None:
    outs = rank_pools.get(2).run_with_deadline(DEADLINE_S, _ce_disagree, what)
    assert outs[0]["error"] == outs[1]["error"]
    assert outs[0]["error"].startswith(
        "vocab_parallel_cross_entropy: tensor-parallel group ranks [0, 1] called it with "
        "different arguments"
    )
    assert fragment in outs[0]["error"]
    for out in outs:
        assert out["seconds"] < WITHIN_S
        # the MAX all-reduce carried the check; the sums were never reduced
        assert out["log"] == ["tp cross-entropy max", "tp cross-entropy agreement"]
