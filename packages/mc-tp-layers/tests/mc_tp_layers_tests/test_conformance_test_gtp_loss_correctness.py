"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_gtp_loss_correctness.py``.

Upstream trains a two-layer TE transformer for 10 SGD steps with gtp_remat = 4 (world 4,
TP = 1, DP = 1, the same input on every rank) and compares the per-step losses with a run
without gtp_remat. Here the model is a column + row MLP of mc layers (GELU between) and
the baseline one process with the full weights; the losses and final weights must agree
to 1e-5 relative (``_helpers``: the sharded run only reorders fp32 sums).

Reading of an ambiguous point: upstream steps each gtp_remat shard by
``(lr / gtp_remat_size) · main_grad``, which matches a SUM over the axis (every peer's
identical gradient added 4 times); Megatron-Core itself pre-scales the wgrad by 1/G before
its SUM reduce-scatter (``_prescale_wgrads_for_mean_rs``), so the shard's gradient is the
mean and equals the single-process gradient here. Upstream's tolerance (5e-2 on losses
that move little at lr 0.01) cannot tell the two apart. mc follows Megatron-Core's mean:
every parameter, shard or not, is stepped by ``lr · grad`` and the trajectory matches the
baseline exactly. (A step of ``lr / 4 · grad`` on the shards would fail this test.)
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, backward, config, randn, row_parallel, world

G, H, FFN, STEPS, LR = 4, 8, 10, 4, 0.5


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda master: master.copy_(full)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y * y).mean()


def _train_gtp(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(1, gtp_remat_size=G)
    try:
        cfg = config(1, gtp_remat_size=G)
        col = tpl.ColumnParallelLinear(
            H, FFN, config=cfg, init_method=_copy_of(d["w1"]), pg_collection=pgc
        )
        row = row_parallel(FFN, H, cfg, _copy_of(d["w2"]), pg_collection=pgc)
        params = [*col.parameters(), *row.parameters()]
        losses = []
        for step in range(STEPS):
            h, _ = col(d["x"][step])
            y, _ = row(F.gelu(h))
            loss = _loss(y)
            backward(loss, torch.ones(()))
            losses.append(float(loss.detach()))
            with torch.no_grad():
                for p in params:
                    assert p.grad is not None
                    p.sub_(LR * p.grad)
                    p.grad = None
        assert col.weight is not None
        return {
            "losses": losses,
            "shards": [col.weight.detach(), row.weight.detach()],
            "pads": [
                getattr(col.weight, "pad_length", None),
                getattr(row.weight, "pad_length", None),
            ],
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_gtp_loss_trajectory_matches_baseline(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_loss_correctness.py::
    TestGTPLossCorrectness::test_gtp_loss_trajectory_matches_baseline``.

    gtp_remat = 4 over 4 ranks, the same micro-batch on every rank each step, 4 SGD steps
    (lr 0.5, large enough that the weights move by far more than the tolerance): every
    rank's losses equal the one-process losses, and the shards, put back together and
    stripped of padding, equal the one-process final weights. The column weight's 10 rows
    are padded to 12 (3 per rank), the row weight's 8 rows split evenly.
    """
    d = {
        "x": randn(STEPS, 6, H, seed=1),
        "w1": randn(FFN, H, seed=2) / 2,
        "w2": randn(H, FFN, seed=3) / 2,
    }
    w1, w2 = d["w1"].clone().requires_grad_(), d["w2"].clone().requires_grad_()
    b1, b2 = torch.zeros(FFN, requires_grad=True), torch.zeros(H, requires_grad=True)
    losses = []
    for step in range(STEPS):
        loss = _loss(F.linear(F.gelu(F.linear(d["x"][step], w1, b1)), w2, b2))
        backward(loss, torch.ones(()))
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for p in (w1, w2, b1, b2):
                assert p.grad is not None
                p.sub_(LR * p.grad)
                p.grad = None
    assert abs(losses[-1] - losses[0]) > 1e-2 * losses[0]  # the run moves
    results = rank_pools.get(G).run(_train_gtp, d)
    for res in results:
        assert_close(torch.tensor(res["losses"]), torch.tensor(losses), "per-step losses")
    assert [res["pads"] for res in results] == [[2, 0]] * G
    full1 = torch.cat([res["shards"][0] for res in results])[:FFN]
    full2 = torch.cat([res["shards"][1] for res in results])
    assert_close(full1, w1.detach(), "final column weight")
    assert_close(full2, w2.detach(), "final row weight")
    assert not torch.allclose(w1.detach(), d["w1"], atol=1e-3)  # the weights moved
