"""Step 5: replicated grads over the gtp_remat / expert gtp_remat group, AVG or SUM.

Localizes the param selection (gtp_remat-sharded params skipped, dense vs expert by the
``allreduce`` mark), the group each kind uses, the reduce op chosen by
``calculate_per_token_loss``, and the no-op when the groups are absent or of size 1. Grads
are ``2**rank``; pair means are exact in fp32, so results are compared exactly.

Layout: 4 ranks, gtp_remat = 2 × dp = 2 (dense rank = gtp_rank + 2·dp_rank: gtp_remat
groups {0, 1}, {2, 3}) and expert ep = 2 × expert gtp_remat = 2 (expert rank = ep_rank +
2·egtp_rank: expt_gtp_remat groups {0, 2}, {1, 3}). Different pairs for the two kinds show
that each kind used its own group.
"""

from __future__ import annotations

from typing import Any

import mc_groups as mg
from mc_finalize import _allreduce_replicated_grads_over_gtp_remat_group
from mc_finalize_tests._helpers import Chunk, add_param, first, layout, rank, records
from mc_groups.testing import RankPools

LAYOUT = {"gtp_remat_size": 2, "expert_model_parallel_size": 2, "expert_gtp_remat_size": 2}
LABEL = "replicated grads over gtp_remat"


def _chunk() -> Chunk:
    r = rank()
    chunk = Chunk(None)
    add_param(chunk, "dense.weight", 2**r)
    add_param(chunk, "dense_sharded.weight", 2**r, is_gtp_weight_remat=True)
    add_param(chunk, "expert.weight", 2**r, allreduce=False)
    add_param(chunk, "expert_sharded.weight", 2**r, allreduce=False, is_gtp_weight_remat=True)
    add_param(chunk, "frozen.weight", 2**r, requires_grad=False)
    return chunk


def _gtp_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(**LAYOUT) as pgc:
        for per_token in (False, True):
            chunk = _chunk()
            with mg.record_collectives() as log:
                _allreduce_replicated_grads_over_gtp_remat_group(
                    [chunk], pgc.gtp_remat, pgc.expt_gtp_remat, calculate_per_token_loss=per_token
                )
            values = {n: first(p) for n, p in chunk.named_parameters()}
            out[str(per_token)] = {"values": values, "log": records(log)}
    with layout() as pgc:  # gtp_remat groups of one rank
        chunk = _chunk()
        with mg.record_collectives() as log:
            _allreduce_replicated_grads_over_gtp_remat_group(
                [chunk], pgc.gtp_remat, pgc.expt_gtp_remat
            )
            _allreduce_replicated_grads_over_gtp_remat_group([chunk], None, None, True)
        out["inactive"] = {"values": [first(p) for p in chunk.parameters()], "log": len(log)}
    return out


def test_gtp2_avg_and_per_token_sum(rank_pools: RankPools) -> None:
    for r, out in enumerate(rank_pools.get(4).run(_gtp_cases)):
        own = float(2**r)
        dense_pair = (r & ~1, r | 1)
        expert_pair = (r % 2, r % 2 + 2)
        dense_sum = float(sum(2**p for p in dense_pair))
        expert_sum = float(sum(2**p for p in expert_pair))
        for per_token, scale, op in (("False", 0.5, "avg"), ("True", 1.0, "sum")):
            case = out[per_token]
            assert case["values"] == {
                "dense.weight": dense_sum * scale,
                "dense_sharded.weight": own,
                "expert.weight": expert_sum * scale,
                "expert_sharded.weight": own,
                "frozen.weight": own,
            }
            assert case["log"] == [
                ("all_reduce", op, dense_pair, "float32", 3, LABEL),
                ("all_reduce", op, expert_pair, "float32", 3, LABEL),
            ]
        assert out["inactive"] == {"values": [own] * 5, "log": 0}
