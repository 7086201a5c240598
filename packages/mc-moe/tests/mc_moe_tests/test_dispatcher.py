"""The token dispatcher (``mc_moe.dispatcher.TokenDispatcher``) on 2 and 4 gloo ranks against
the same computation on one process, with its collectives recorded.

Each rank routes its own tokens (different per rank) to E = 4 experts, top-2; expert e
computes ``x ↦ a_e · x + b_e · x²`` (a_e, b_e the same on every rank), split over expert TP
as Megatron's row-parallel output is: each etp peer returns ``1/Q`` of it and the
reduce-scatter sums them. The reference is the one-process weighted sum
``Σ_j w_tj · expert_{e_tj}(x_t)`` over this rank's tokens, with its gradients in the tokens
and the routing weights. Localizes: rows sent to the wrong rank or expert (a_e, b_e differ
per expert), chunks regrouped out of order with several local experts, the expert-TP gather
and reduce-scatter, the backward of every exchange.

Layouts: EP = 2 on 2 ranks (2 local experts each); EP = 2 × expert TP = 2 on 4 ranks;
EP = 4 on 4 ranks (1 local expert). Collectives of one forward, recorded: one all-gather of
E int64 counts over tp_ep, one all-to-all of each direction over ep of
``rows × H × 8`` bytes (float64 here), at Q > 1 one all-gather / reduce-scatter over
expt_tp. Exact to 1e-12 (float64). The split sizes are read on the host once per layer
forward (one ``tolist`` of every size: each read is a device synchronisation on a GPU).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

from mc_groups.testing import RankPools

E, K, H, T = 4, 2, 3, 6


def _expert_scales() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([0.25, 1.0, -0.5, 2.0])


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, index, weights


def _run(ep: int, etp: int) -> dict[str, Any]:
    import torch.distributed as dist

    import mc_groups as mg
    from mc_moe.dispatcher import TokenDispatcher

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    groups = {n: pgc.require(n, "test") for n in ("ep", "expt_tp", "tp_ep")}
    dispatcher = TokenDispatcher(E, groups["ep"], groups["expt_tp"], groups["tp_ep"])
    a, b = _expert_scales()
    first = dispatcher.first_local_expert

    def experts(rows: torch.Tensor, counts: Any) -> torch.Tensor:
        parts = torch.split(rows, list(counts))
        outs = [(a[first + e] * x + b[first + e] * x**2) / etp for e, x in enumerate(parts)]
        return torch.cat(outs)

    x, index, weights = _inputs(dist.get_rank())
    x.requires_grad_(True)
    weights.requires_grad_(True)
    with mg.record_collectives() as log:
        out = dispatcher(x, index, weights, experts)
    grads = torch.autograd.grad(out.square().sum(), (x, weights))
    ref = sum(
        weights[:, j, None] * (a[index[:, j], None] * x + b[index[:, j], None] * x**2)
        for j in range(K)
    )
    assert isinstance(ref, torch.Tensor)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, weights))
    err = max(
        float((out - ref).abs().max()),
        *(float((g - r).abs().max()) for g, r in zip(grads, ref_grads, strict=True)),
    )
    records = [(r.op, r.group_ranks, r.dtype, r.bytes) for r in log]
    ranks = {n: mg.group_ranks(g) for n, g in groups.items()}
    reads: list[int] = []  # the split sizes' host reads (each a device sync on a GPU)
    read = torch.Tensor.tolist

    def counted(tensor: torch.Tensor) -> Any:
        reads.append(tensor.numel())
        return read(tensor)

    with mock.patch.object(torch.Tensor, "tolist", counted):
        dispatcher._splits(torch.bincount(index.flatten(), minlength=E))
    mg.destroy_model_parallel(pgc)
    return {"err": err, "records": records, "ranks": ranks, "rows": T * K, "reads": reads}


def _check(outcome: dict[str, Any], ep: int, etp: int) -> None:
    assert outcome["err"] <= 1e-12, outcome["err"]
    # one read of every size the layer needs: P + P + Q + Q·P·L + L values
    local = E // ep
    assert outcome["reads"] == [2 * ep + etp + etp * ep * local + local], outcome["reads"]
    ranks, records = outcome["ranks"], outcome["records"]
    expected = [("all_gather", ranks["tp_ep"], torch.int64, E * 8)]
    expected.append(("all_to_all", ranks["ep"], torch.float64, outcome["rows"] * H * 8))
    got = [(op, g, d, n) for op, g, d, n in records]
    assert got[:2] == expected, got
    ops = [(op, g) for op, g, _, _ in got[2:]]
    if etp > 1:
        assert ops == [
            ("all_gather", ranks["expt_tp"]),
            ("reduce_scatter", ranks["expt_tp"]),
            ("all_to_all", ranks["ep"]),
        ]
    else:
        assert ops == [("all_to_all", ranks["ep"])]


def test_dispatch_matches_one_process(rank_pools: RankPools) -> None:
    for world, layouts in ((2, [(2, 1)]), (4, [(2, 2), (4, 1)])):
        for ep, etp in layouts:
            for outcome in rank_pools.get(world).run(_run, ep, etp):
                _check(outcome, ep, etp)
