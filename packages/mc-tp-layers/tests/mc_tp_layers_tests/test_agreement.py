"""Agreement at construction (``mc_tp_layers.agreement``): TP peers built differently fail
on every rank, at once, with the same error naming the layer, the field and the ranks.

Each disagreement case runs on 2 gloo ranks whose layers differ in one setting and feeds
each rank an input its own layer accepts, so that without the check the first forward
would abort inside gloo, hang, or run on with wrong numbers (the settings the issue lists:
Column ``input_size``, Row ``output_size`` at equal numel, ``num_embeddings``, a bias on
one rank, a flag). The call runs under a 30 s deadline; each rank measures its own time to
the error, which must stay under 5 s. Agreeing ranks: the exchange is one digest per group
per batch of new layers, not recorded by ``record_collectives`` (so counts do not change)
and the outputs equal those of layers that were never compared (exact: same GEMMs).

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
    layers = [_column(pgc, 8, 4)] + ([_column(pgc, 8, 4)] if rank == 1 else [])
    return torch.nn.ModuleList(layers), torch.ones(2, 8)


CASES: dict[str, tuple[_Build, tuple[str, ...]]] = {
    "column input_size": (
        _column_input_size,
        ("layer #1 (ColumnParallelLinear)", "input_size = 8 on rank(s) [0], 6 on rank(s) [1]"),
    ),
    "row output_size at equal numel": (
        _row_output_equal_numel,
        ("layer #1 (RowParallelLinear)", "output_size = 4 on rank(s) [0], 8 on rank(s) [1]"),
    ),
    "num_embeddings": (
        _vocab,
        (
            "layer #1 (VocabParallelEmbedding)",
            "num_embeddings = 8 on rank(s) [0], 12 on rank(s) [1]",
        ),
    ),
    "row bias on one rank": (
        _row_bias,
        ("bias = False on rank(s) [0], True on rank(s) [1]",),
    ),
    "gather_output": (
        _gather_output,
        ("gather_output = True on rank(s) [0], False on rank(s) [1]",),
    ),
    "a layer more on one rank": (
        _extra_layer,
        ("number of layers built on this group: 1 on rank(s) [0], 2 on rank(s) [1]",),
    ),
}


def _forward(module: torch.nn.Module, x: torch.Tensor) -> object:
    first = module[0] if isinstance(module, torch.nn.ModuleList) else module
    return first(x)


def _disagree(case: str) -> dict[str, Any]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        module, x = CASES[case][0](pgc, rank)
        started = time.monotonic()
        with mg.record_collectives() as log:
            try:
                _forward(module, x)
                error = "no error"
            except tpl.TensorParallelAgreementError as err:
                error = str(err)
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
    assert message.startswith("tensor-parallel group ranks [0, 1] built their layers differently")
    for part in CASES[case][1]:
        assert part in message, f"{part!r} not in {message!r}"
    for out in outs:
        assert out["seconds"] < WITHIN_S
        assert out["log"] == 0  # nothing of the layer's own schedule was issued


def _agree() -> dict[str, Any]:
    pgc = world(2)
    spy = mock.patch.object(mg, "cross_check", wraps=cross_rank.cross_check)
    try:
        with spy as calls:
            torch.manual_seed(0)
            cfg = config(2)
            init = torch.nn.init.normal_
            up = tpl.ColumnParallelLinear(8, 16, config=cfg, init_method=init, pg_collection=pgc)
            down = _row(pgc, 16, 8, bias=True)
            torch.manual_seed(0)
            twin_up = tpl.ColumnParallelLinear(
                8, 16, config=cfg, init_method=init, pg_collection=pgc
            )
            twin_down = _row(pgc, 16, 8, bias=True)
            ledger = up._tp_agreement.ledger
            pending_before = 0 if ledger is None else len(ledger.pending)
            x = randn(3, 2, 8, seed=4)
            with mg.record_collectives() as first:
                y = down(up(x)[0])[0]
            after_first = calls.call_count
            with mg.record_collectives() as second:
                y2 = down(up(x)[0])[0]
            # the twins were compared in the same batch: their first forward exchanges nothing
            y_twin = twin_down(twin_up(x)[0])[0]
            total = calls.call_count
        return {
            "pending_before": pending_before,
            "exchanges_first": after_first,
            "exchanges_total": total,
            "first": [r.op for r in first],
            "second": [r.op for r in second],
            "equal": torch.equal(y, y2) and torch.equal(y, y_twin),
            "checked": all(m._tp_agreement.checked for m in (up, down, twin_up, twin_down)),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_agreeing_ranks_exchange_one_digest_per_batch_and_nothing_per_step(
    rank_pools: RankPools,
) -> None:
    for out in rank_pools.get(2).run(_agree):
        assert out["pending_before"] == 4  # every layer built on the group, none compared yet
        assert out["exchanges_first"] == 1  # one exchange for all four, at the first forward
        assert out["exchanges_total"] == 1  # none later, none for the twins
        assert out["first"] == out["second"] == ["all_reduce"]  # the Row all-reduce only
        assert out["equal"]
        assert out["checked"]


def _explicit_check() -> dict[str, Any]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        model = torch.nn.Sequential()
        model.add_module("embed", _embedding(pgc, 8))
        model.add_module("head", _column(pgc, 4, 8 if rank == 0 else 16))
        lone = _column(pgc, 4, 8)  # built on the group too, not part of the model
        try:
            tpl.check_tp_agreement(model)
            error = "no error"
        except tpl.TensorParallelAgreementError as err:
            error = str(err)
        return {"error": error, "lone_pending": not lone._tp_agreement.checked}
    finally:
        mg.destroy_model_parallel(pgc)


def test_check_tp_agreement_names_layers_by_their_path(rank_pools: RankPools) -> None:
    outs = rank_pools.get(2).run_with_deadline(DEADLINE_S, _explicit_check)
    assert outs[0]["error"] == outs[1]["error"]
    assert (
        "layer #2 (ColumnParallelLinear 'head'): output_size = 8 on rank(s) [0], 16 on rank(s) [1]"
        in outs[0]["error"]
    )
    assert all(out["lone_pending"] for out in outs)  # a failed comparison settles nothing


def _explicit_then_forward() -> dict[str, Any]:
    pgc = world(2)
    try:
        model = torch.nn.Sequential(_column(pgc, 4, 8), _column(pgc, 4, 8, gather_output=True))
        compared = tpl.check_tp_agreement([model])
        again = tpl.check_tp_agreement(model)
        with mg.record_collectives() as log:
            out = model[1](model[0](torch.ones(2, 4))[0])[0]
        return {
            "compared": compared,
            "again": again,
            "log": [r.op for r in log],
            "shape": tuple(out.shape),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_check_tp_agreement_compares_once(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_explicit_then_forward):
        assert (out["compared"], out["again"]) == (2, 0)
        assert out["log"] == ["all_gather"]
        assert out["shape"] == (2, 8)


def test_check_tp_agreement_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"model\[0\]='fc1' must be a torch.nn.Module"):
        tpl.check_tp_agreement(["fc1"])  # type: ignore[list-item]


def _one_rank_group() -> bool:
    pgc = world(1)
    try:
        layer = tpl.ColumnParallelLinear(
            4, 8, config=config(1), init_method=torch.nn.init.ones_, pg_collection=pgc
        )
        return layer._tp_agreement.checked and layer._tp_agreement.ledger is None
    finally:
        mg.destroy_model_parallel(pgc)


def test_one_rank_groups_compare_nothing(rank_pools: RankPools) -> None:
    assert rank_pools.get(2).run(_one_rank_group) == [True, True]


def _peer_busy_elsewhere() -> dict[str, str]:
    """Rank 0's first forward compares layers while rank 1 runs an all-reduce: with the
    schedule check on, both raise the schedule check's error, which says what each was
    about to run (the agreement code passes it through)."""
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        layer = _column(pgc, 4, 8)
        with mg.check_collective_schedule():
            try:
                if rank == 0:
                    layer(torch.ones(2, 4))
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
    # rank 0 is at its first forward's status exchange (mc_groups.fail_together)
    assert "rank(s) [0]: ColumnParallelLinear's first forward" in outs[0]["message"]
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
