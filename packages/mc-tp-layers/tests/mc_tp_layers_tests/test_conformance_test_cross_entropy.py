"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_cross_entropy.py``.

``test_language_module_unfused_loss_passes_tp_group`` concerns ``LanguageModule``, which mc
does not offer (not covered). The general agreement of ``vocab_parallel_cross_entropy``
with ``F.cross_entropy`` at TP = 1, 2, 4 is held by ``test_cross_entropy.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.collection import clear_default_collection, set_default_collection
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, chunk, world

# Upstream's expected losses (rounded to 4 decimals), targets 0, 2, ..., 30.
UPSTREAM_LOSSES = [10.2309, 8.2309, 6.2309, 4.2309] * 4


def _upstream_numbers() -> dict[str, Any]:
    pgc = world(2, set_default=True)
    try:
        # Each rank holds 64 vocabulary entries whose logits repeat 0..7, so the global
        # vocabulary (128 entries over TP = 2) holds 16 copies of 0..7 as upstream's
        # (32 per rank over TP = 4). Every target lies in TP rank 0's range.
        logits = torch.arange(8.0).repeat(16, 8)
        target = torch.arange(0, 32, 2)
        with mg.record_collectives() as log:
            loss = tpl.vocab_parallel_cross_entropy(logits, target)
        return {"loss": loss, "log": [(e.op, e.reduce_op, e.group_ranks) for e in log]}
    finally:
        mg.destroy_model_parallel(pgc)


def test_vocab_parallel_cross_entropy(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_cross_entropy.py::test_vocab_parallel_cross_entropy``.

    Upstream: TP = 4 of 8 ranks, the default TP group (no ``tp_group``), 16 copies of the
    logits 0..7 over the vocabulary, targets 0, 2, ..., 30, all owned by TP rank 0; the
    losses round to upstream's list. Here TP = 2 of 4 ranks with the default collection and
    each rank holding twice upstream's slice, so the global vocabulary is the same. By hand:
    ``loss(t) = log(16 · Σ_{k<8} e^k) - (t mod 8)``. Both TP groups compute the same losses
    independently, each reducing over its own ranks only.
    """  # noqa: E501
    log_z = math.log(16 * sum(math.exp(k) for k in range(8)))
    expected = torch.tensor([log_z - (t % 8) for t in range(0, 32, 2)])
    for r, res in enumerate(rank_pools.get(4).run(_upstream_numbers)):
        assert_close(res["loss"], expected, "per-token loss")
        assert torch.equal(torch.round(res["loss"]), torch.round(torch.tensor(UPSTREAM_LOSSES)))
        mates = (0, 1) if r < 2 else (2, 3)
        assert res["log"] == [("all_reduce", "max", mates), ("all_reduce", "sum", mates)]


def _explicit_group(logits: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    one = world(1)  # TP groups of one rank, deliberately not registered as default
    two = world(2)
    try:
        r = two.require("tp", "test").rank()
        # 1) No default collection exists: an explicit group alone suffices.
        with mg.record_collectives() as log_one:
            alone = tpl.vocab_parallel_cross_entropy(logits, target, tp_group=one.tp)
        # 2) A default with one-rank TP groups is registered; the explicit 2-rank group
        #    must still be the one used (with the default each rank would normalise over
        #    its own half of the vocabulary only).
        set_default_collection(one)
        with mg.record_collectives() as log_two:
            split = tpl.vocab_parallel_cross_entropy(
                chunk(logits, 2, r, -1), target, tp_group=two.tp
            )
        return {
            "alone": alone,
            "split": split,
            "log_one": len(log_one),
            "log_two": [e.group_ranks for e in log_two],
        }
    finally:
        clear_default_collection()
        mg.destroy_model_parallel(two)
        mg.destroy_model_parallel(one)


def test_vocab_parallel_cross_entropy_uses_explicit_tp_group(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_cross_entropy.py::test_vocab_parallel_cross_entropy_uses_explicit_tp_group``.

    Upstream hands a one-rank fake group and checks that the result equals
    ``F.cross_entropy`` and that every all-reduce names that group, with the global state
    never consulted. Here: with no default collection registered, an explicit one-rank
    group gives ``F.cross_entropy`` (mc communicates nothing on a one-rank group, where
    upstream issues three all-reduces on it); and with a one-rank default registered, an
    explicit two-rank group is the one reduced over (every collective names ranks 0, 1)
    and the losses are those of the whole vocabulary.
    """  # noqa: E501
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.5, -0.5, 1.0, 2.0]])
    target = torch.tensor([2, 0])
    expected = F.cross_entropy(logits, target, reduction="none")
    for res in rank_pools.get(2).run(_explicit_group, logits, target):
        assert_close(res["alone"], expected, "one-rank explicit group")
        assert res["log_one"] == 0
        assert_close(res["split"], expected, "two-rank explicit group")
        assert res["log_two"] == [(0, 1), (0, 1)]
