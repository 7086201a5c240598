"""Steps 8–10: router expert-bias update, quantile-balancing qb_beta update, counter reset.

Localizes the math of each update against numbers derived by hand (token counts, rates and
EMA weights are chosen so every intermediate is a binary fraction, hence exact comparisons),
the single stacked collective per update on its group, the eval-mode skip, routers without
state (hash routers), and the accumulator resets.
"""

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
from mc_finalize import (
    _update_router_expert_bias,
    _update_router_qb_beta,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from mc_finalize_tests._helpers import Cfg, Chunk, layout, rank, records
from mc_groups.testing import RankPools


class BiasRouter(torch.nn.Module):
    def __init__(self, tokens: list[float], bias: list[float]) -> None:
        super().__init__()
        self.register_buffer("local_tokens_per_expert", torch.tensor(tokens))
        self.register_buffer("expert_bias", torch.tensor(bias))


class HashRouter(torch.nn.Module):
    """Hash routers own no balancing state: the attributes exist and are None."""

    def __init__(self) -> None:
        super().__init__()
        self.expert_bias = None
        self.local_tokens_per_expert = None
        self.qb_beta_accum = None


class QuantileRouter(torch.nn.Module):
    def __init__(self, beta: list[float], accum: list[float], count: int) -> None:
        super().__init__()
        self.register_buffer("qb_beta", torch.tensor(beta))
        self.register_buffer("qb_beta_accum", torch.tensor(accum))
        self.register_buffer("qb_beta_count", torch.tensor(count, dtype=torch.long))


def _state(chunk: Chunk) -> dict[str, list[float]]:
    return {n: [float(v) for v in b.reshape(-1)] for n, b in chunk.named_buffers()}


def _bias_chunk(cfg: Cfg) -> Chunk:
    r = rank()
    chunk = Chunk(cfg)
    chunk.a = BiasRouter([float(r), 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    chunk.b = BiasRouter([1.0, 1.0, 1.0, 1.0], [0.5, -0.5, 0.0, 1.0])
    chunk.frozen = BiasRouter([9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    chunk.frozen.eval()
    chunk.pinned = BiasRouter([0.0, 7.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])
    chunk.pinned.frozen_expert_bias = True  # type: ignore[assignment]
    chunk.hashed = HashRouter()
    return chunk


def _expert_bias() -> dict[str, Any]:
    cfg = Cfg(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)
    with layout(tensor_model_parallel_size=2) as pgc:
        chunk = _bias_chunk(cfg)
        with mg.record_collectives() as log:
            _update_router_expert_bias([chunk], cfg, pgc.tp_dp_cp)
        return {"state": _state(chunk), "log": records(log)}


def test_expert_bias_from_known_token_counts(rank_pools: RankPools) -> None:
    # Router a over 4 ranks: tokens Σ_r [r, 0, 2, 1] = [6, 0, 8, 4], mean 4.5,
    # sign(mean − t) = [−1, +1, −1, +1] → bias ±0.25. Router b: Σ = [4, 4, 4, 4] = mean,
    # sign 0 → bias unchanged. The eval-mode router keeps bias and counts, and so does the
    # router with frozen_expert_bias=True (Megatron-Core's _update_router_expert_bias skips
    # it): it is left out of the stacked all-reduce (2 routers × 4 experts = 8 elements).
    for r, out in enumerate(rank_pools.get(4).run(_expert_bias)):
        state = out["state"]
        assert state["a.expert_bias"] == [-0.25, 0.25, -0.25, 0.25]
        assert state["b.expert_bias"] == [0.5, -0.5, 0.0, 1.0]
        # the update reduces a stacked copy: local counts stay until the reset (Megatron)
        assert state["a.local_tokens_per_expert"] == [float(r), 0.0, 2.0, 1.0]
        assert state["b.local_tokens_per_expert"] == [1.0] * 4
        assert state["frozen.expert_bias"] == [0.0] * 4
        assert state["frozen.local_tokens_per_expert"] == [9.0, 0.0, 0.0, 0.0]
        assert state["pinned.expert_bias"] == [1.0] * 4
        assert state["pinned.local_tokens_per_expert"] == [0.0, 7.0, 0.0, 0.0]
        assert out["log"] == [
            ("all_reduce", "sum", (0, 1, 2, 3), "float32", 8, "router expert bias")
        ], f"rank {r}"


def _qb_chunk() -> Chunk:
    r = rank()
    chunk = Chunk(None)
    accum, count = ([4.0, 2.0, 0.0], 2) if r == 0 else ([0.0, 6.0, 3.0], 3)
    chunk.seen = QuantileRouter([1.0, -1.0, 0.0], accum, count)
    chunk.unseen = QuantileRouter([3.0, 0.0, 0.0], [0.0, 0.0, 0.0], 0)
    chunk.frozen = QuantileRouter([1.0, 2.0, 3.0], [5.0, 5.0, 5.0], 1)
    chunk.frozen.eval()
    chunk.hashed = HashRouter()
    return chunk


def _qb_beta() -> dict[str, Any]:
    cfg = Cfg(moe_router_load_balancing_type="quantile_balancing")
    cfg.moe_router_quantile_balancing_ema = 0.25
    with layout() as pgc:  # dp_cp = both ranks
        chunk = _qb_chunk()
        with mg.record_collectives() as log:
            _update_router_qb_beta([chunk], cfg, pgc.dp_cp)
        return {"state": _state(chunk), "log": records(log)}


def test_qb_beta_average_ema_recentre(rank_pools: RankPools) -> None:
    # seen: accum/count is [2, 1, 0] on rank 0 and [0, 2, 1] on rank 1; AVG = [1, 1.5, 0.5].
    # ema 0.25: 0.25·[1, −1, 0] + 0.75·[1, 1.5, 0.5] = [1, 0.875, 0.375], mean 0.75
    # → [0.25, 0.125, −0.375]. unseen: count 0 → quantile 0 → 0.25·[3, 0, 0] = [0.75, 0, 0],
    # mean 0.25 → [0.5, −0.25, −0.25]. frozen (eval) keeps beta and accumulators.
    for r, out in enumerate(rank_pools.get(2).run(_qb_beta)):
        state = out["state"]
        assert state["seen.qb_beta"] == [0.25, 0.125, -0.375]
        assert state["unseen.qb_beta"] == [0.5, -0.25, -0.25]
        # accumulators stay until reset_model_temporary_tensors (Megatron)
        assert state["seen.qb_beta_accum"] == ([4.0, 2.0, 0.0] if r == 0 else [0.0, 6.0, 3.0])
        assert state["seen.qb_beta_count"] == [2.0 if r == 0 else 3.0]
        assert state["frozen.qb_beta"] == [1.0, 2.0, 3.0]
        assert state["frozen.qb_beta_accum"] == [5.0] * 3
        assert state["frozen.qb_beta_count"] == [1.0]
        assert out["log"] == [("all_reduce", "avg", (0, 1), "float32", 6, "router qb_beta")]


class AuxLossModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset_global_aux_loss_tracker(self) -> None:
        self.resets += 1


def test_reset_model_temporary_tensors_without_processes() -> None:
    def model() -> tuple[Chunk, AuxLossModule]:
        chunk = Chunk(None)
        chunk.bias = BiasRouter([3.0, 1.0], [0.5, 0.5])
        chunk.quantile = QuantileRouter([1.0, -1.0], [2.0, 2.0], 4)
        chunk.quantile.eval()  # eval modules are reset too
        chunk.aux = aux = AuxLossModule()
        chunk.hashed = HashRouter()
        return chunk, aux

    untouched, untouched_aux = model()
    with mg.record_collectives() as log:
        reset_model_temporary_tensors(Cfg(), [untouched])
    assert _state(untouched)["bias.local_tokens_per_expert"] == [3.0, 1.0]
    # qb accumulators are zeroed whatever the load-balancing type (Megatron-Core's
    # reset_model_temporary_tensors tests `qb_beta_accum is not None` only)
    assert _state(untouched)["quantile.qb_beta_accum"] == [0.0, 0.0]
    assert untouched_aux.resets == 0

    everything, everything_aux = model()
    cfg = Cfg(
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["global_aux_loss", "quantile_balancing"],
    )
    with mg.record_collectives() as log:
        reset_model_temporary_tensors(cfg, [everything])
    state = _state(everything)
    assert state["bias.local_tokens_per_expert"] == [0.0, 0.0]
    assert state["bias.expert_bias"] == [0.5, 0.5]
    assert (state["quantile.qb_beta_accum"], state["quantile.qb_beta_count"]) == ([0.0] * 2, [0.0])
    assert state["quantile.qb_beta"] == [1.0, -1.0]
    assert everything_aux.resets == 1
    assert log == []


def _finalize_with_the_switches_off() -> dict[str, Any]:
    with layout(tensor_model_parallel_size=2) as pgc:  # tp_dp_cp and dp_cp exist
        chunk = _bias_chunk(Cfg())  # expert bias off, load balancing "aux_loss"
        chunk.quantile = QuantileRouter([1.0, -1.0], [4.0, 0.0], 2)
        with mg.record_collectives(status_exchanges=True) as log:
            finalize_model_grads([chunk], pg_collection=pgc)
        return {"state": _state(chunk), "log": records(log)}


def test_finalize_leaves_routers_alone_when_their_switch_is_off(rank_pools: RankPools) -> None:
    """Megatron's ``finalize_model_grads`` updates expert biases only under
    ``moe_router_enable_expert_bias`` and qb_beta only under quantile balancing, even when
    the collection holds their groups; the reset still zeroes the qb accumulators of every
    module (Megatron zeroes them whatever the type) but not the token counts. No collective."""
    for r, out in enumerate(rank_pools.get(2).run(_finalize_with_the_switches_off)):
        state = out["state"]
        assert state["a.expert_bias"] == [0.0] * 4
        assert state["a.local_tokens_per_expert"] == [float(r), 0.0, 2.0, 1.0]
        assert state["b.expert_bias"] == [0.5, -0.5, 0.0, 1.0]
        assert state["quantile.qb_beta"] == [1.0, -1.0]
        assert state["quantile.qb_beta_accum"] == [0.0, 0.0]
        assert state["quantile.qb_beta_count"] == [0.0]
        assert out["log"] == []
