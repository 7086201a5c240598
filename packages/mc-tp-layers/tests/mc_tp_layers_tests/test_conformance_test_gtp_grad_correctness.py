"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_gtp_grad_correctness.py``.

Held elsewhere:

- ``test_gtp2_dp2_grad_matches_dp4_baseline`` (with and without per-token loss): the
  layer's part, the shard gradient as the mean over gtp_remat (the sum under
  ``calculate_per_token_loss``), by ``test_linear_functions.py::
  test_gtp_remat_shards_the_weight_rows``; gtp_remat = 2 × DP = 2 through mc's DDP and
  ``finalize_model_grads`` against one process over the same 4 micro-batches by
  ``integration_tests/test_parity_gtp.py::test_gtp_remat_matches_one_process``.

Not covered: the gtp_remat reduce-scatter with fp32 accumulation (and its bypass at size
2; mc offers no such option), the distributed-optimizer grad-norm comparisons and
``--ddp-reduce-scatter-with-fp32-accumulation`` (Megatron's optimizer and DDP, outside
these layers), the MoE grad-norm run (no MoE layer in mc).
"""  # noqa: E501

from __future__ import annotations

import mc_groups as mg
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import world


def _grad_stats_groups() -> dict[str, tuple[int, ...]]:
    out = {}
    layouts = {
        "dense": {"gtp_remat_size": 2},
        "moe": {"gtp_remat_size": 2, "expert_model_parallel_size": 2, "expert_gtp_remat_size": 2},
    }
    for name, kw in layouts.items():
        pgc = world(1, **kw)
        try:
            out[name] = mg.group_ranks(pgc.require("intra_dist_opt", "test"))
        finally:
            mg.destroy_model_parallel(pgc)
    return out


def test_distopt_gradstats_group_spans_world(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_grad_correctness.py::
    TestGTPGradCorrectness::test_distopt_gradstats_group_spans_world``.

    The distributed optimizer's grad-statistics group (``intra_dist_opt``) spans the whole
    world of 4 both for dense gtp_remat = 2 and for the MoE layout EP = 2, expert
    gtp_remat = 2, gtp_remat = 2: gtp_remat-sharded params are counted on every rank.
    """
    for res in rank_pools.get(4).run(_grad_stats_groups):
        assert res == {"dense": (0, 1, 2, 3), "moe": (0, 1, 2, 3)}
