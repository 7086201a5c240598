"""Context parallelism end to end: a per-token model whose sequence is split over the ``cp``
ranks, trained with mc's DDP, ``finalize_model_grads`` and SGD for 5 steps, against the same
model trained by plain PyTorch on one process over the same global batch.

The model, per token at position ``p`` (``S = 8``, ``H = 8``, ``F = 12``)::

    h = x + pos[p];  y = h + fc2(gelu(fc1(ln(h))))     pos: a learned [S, H] table

No token looks at another, so no attention is needed to test what CP asks of mc: that each
rank's grads (of its own sequence chunks) are reduced over ``dp_cp`` with the right scale.
Attention's CP communication (ring / all-to-all of K and V) is out of mc's scope: mc has no
CP attention. The split is Megatron's load-balanced one: the sequence in 2·cp chunks, cp
rank r holding chunks r and 2·cp − 1 − r (``core/utils.py``,
``_get_batch_on_this_cp_rank_per_sequence_balancing``), so each rank's ``pos`` rows are
not contiguous and a wrong position mapping fails the comparison.

Loss normalisation (``_compositions.py``): by default each rank's micro-batch loss is the
mean over its own tokens (Megatron's ``forward_step_calc_loss`` with a 3-tuple loss: local
sum / local token count, no CP factor) and DDP divides by |dp_cp| = dp·cp, so equal chunks
give the mean over the whole sequence; with ``calculate_per_token_loss`` each rank sums
``mask·ℓ`` (a mask giving the ranks different counts) and ``finalize_model_grads`` sums
``num_tokens`` over dp_cp and divides.

Layouts (each with and without per-token loss): CP = 2 on 2 ranks (dp_cp = the cp group),
CP = 2 × DP = 2 on 4 (dp_cp = all four); and CP = 2 × DP = 2 with the distributed optimizer
(the buffer reduce-scattered over dp_cp; no step-0 grad check). Step 2's collectives are
recorded: every param in DDP's dense buffer, reduced over dp_cp (exactly every param's
elements; padded to the shard count with the distributed optimizer), ``num_tokens`` over
dp_cp, nothing else.

Tolerances as in ``test_parity_gtp.py`` (fp32, gloo): loss per step ≤ 1e-5 relative;
final weights ≤ 1e-6 absolute while every reference tensor moves ≥ 1e-4; step-0 grads ≤ 1e-5
of each tensor's largest magnitude; every copy on every rank bit-identical. Measured (this
machine, at 41c0ec0): loss ≤ 1.4e-7 relative, final weights ≤ 1.2e-7, step-0 grads ≤ 2.1e-7
of each tensor's largest magnitude, in every layout (``pytest -s`` prints them).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
from integration_tests._compositions import (
    UNITS,
    Layout,
    RankRun,
    Reference,
    buffer_reduction,
    collection,
    compare,
    ddp_config,
    grad_reductions,
    load_weights,
    normalised,
    random_batch,
    reference_loss,
    reference_run,
    token_loss,
    tp_mlp,
    train,
)
from mc_ddp import DistributedDataParallel
from mc_groups.testing import RankPools

S, B, H, FFN = 8, 2, 8, 12


class PerTokenModel(torch.nn.Module):
    """The module docstring's model."""

    def __init__(self, config: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.zeros(S, H))
        self.ln = torch.nn.LayerNorm(H)
        self.fc1, self.fc2 = tp_mlp(config, pgc, H, FFN)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s, B, H]`` holding the tokens at ``positions`` ``[s]``."""
        h = x + self.pos[positions][:, None, :]
        hidden, _ = self.fc1(self.ln(h))
        y, _ = self.fc2(F.gelu(hidden))
        out: torch.Tensor = h + y
        return out


def cp_positions(cp_rank: int, cp: int) -> torch.Tensor:
    """The sequence positions cp rank ``cp_rank`` holds: chunks r and 2·cp − 1 − r of 2·cp."""
    chunks = torch.arange(S).view(2 * cp, S // (2 * cp))
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])


@cache
def initial() -> dict[str, torch.Tensor]:
    """The full initial weights (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(31)
    return {
        "pos": 0.3 * torch.randn(S, H, generator=g),
        "ln.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "ln.bias": 0.1 * torch.randn(H, generator=g),
        "fc1.weight": 0.4 * torch.randn(FFN, H, generator=g),
        "fc1.bias": 0.1 * torch.randn(FFN, generator=g),
        "fc2.weight": 0.3 * torch.randn(H, FFN, generator=g),
        "fc2.bias": 0.1 * torch.randn(H, generator=g),
    }


@cache
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: inputs and targets ``[UNITS, S, B, H]``, the
    per-token-loss mask ``[UNITS, S, B]``."""
    return random_batch(300 + step, (UNITS, S, B, H))


def _reference_forward(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x + w["pos"][:, None, :]
    hidden = F.linear(F.layer_norm(h, (H,), w["ln.weight"], w["ln.bias"]), w["fc1.weight"])
    return h + F.linear(F.gelu(hidden + w["fc1.bias"]), w["fc2.weight"], w["fc2.bias"])


@cache
def reference(per_token_loss: bool) -> Reference:
    """One process, the whole global batch (every sequence whole) of each step."""

    def loss_of(w: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        x, target, mask = batch(step)
        return reference_loss(token_loss(_reference_forward(w, x), target), mask, per_token_loss)

    return reference_run(dict(initial()), loss_of)


def train_cp(layout: Layout) -> RankRun:
    """Runs on every rank: the layout's groups, the model loaded with ``initial()``, DDP,
    5 steps on this rank's sequence chunks of its data shard's units."""
    with collection(layout) as pgc:
        config = layout.config()
        module = PerTokenModel(config, pgc)
        load_weights(module, initial())
        ddp = DistributedDataParallel(config, ddp_config(layout), module, pg_collection=pgc)
        dp, cp = pgc.require("dp", "test"), pgc.require("cp", "test")
        shard, shards = mg.group_rank(dp), mg.group_size(dp)
        positions = cp_positions(mg.group_rank(cp), mg.group_size(cp))

        def micro_loss(step: int, m: int, count: int) -> tuple[torch.Tensor, int]:
            x, target, mask = batch(step)
            unit = shard * count + m
            y = ddp(x[unit, positions], positions)
            per_token = token_loss(y, target[unit, positions])
            return normalised(per_token, mask[unit, positions], count, layout)

        return train(ddp, pgc, layout, micro_loss, UNITS // shards)


def _check_groups(layout: Layout, per_rank: list[RankRun]) -> None:
    """Every param in the dense buffer, reduced over dp_cp; nothing else communicates."""
    for rank, run in enumerate(per_rank):
        g = run.groups
        where = f"{layout.describe()} rank {rank}"
        assert len(g["cp"]) == layout.cp, (where, g)
        assert len(g["dp_cp"]) == layout.world, (where, g)
        assert set(run.placement) == set(initial()), (where, run.placement)
        for name, (kind, ranks) in run.placement.items():
            assert (kind, ranks) == ("dense", g["dp_cp"]), (where, name, kind, ranks)
        total = sum(run.local_numel.values())
        required = {buffer_reduction(run, layout, "dense", g["dp_cp"], total, where)}
        if layout.per_token_loss:
            required.add(("all_reduce", "sum", g["dp_cp"], "num_tokens"))
        found = grad_reductions(run.records)
        assert found == required, (where, "missing", required - found, "extra", found - required)


LAYOUTS = [
    Layout(2, cp=2),
    Layout(2, cp=2, per_token_loss=True),
    Layout(4, cp=2),
    Layout(4, cp=2, per_token_loss=True),
    Layout(4, cp=2, dist_opt=True),
]


@pytest.mark.parametrize(
    "layout", [pytest.param(x, id=x.describe().replace(" ", "-")) for x in LAYOUTS]
)
def test_context_parallel_matches_one_process(rank_pools: RankPools, layout: Layout) -> None:
    per_rank = rank_pools.get(layout.world).run(train_cp, layout)
    _check_groups(layout, per_rank)
    compare(layout, per_rank, reference(layout.per_token_loss))
