"""Router support (``mc_moe.router``): the global-batch load-balancing loss against
``transformers``' own ``load_balancing_loss_func`` on the whole batch, and the expert-bias
wiring of DeepSeek-V3's router.

The loss: 2 gloo ranks, each with its own router logits for 2 layers (and a padding mask in
a second case); every rank's value must equal ``transformers``' function on the logits of
both ranks concatenated (the one-process batch), and each rank's gradient in its logits
must be ``|dp| = 2`` times the one-process gradient of its rows (DDP then averages the two
ranks' contributions to the parameters: each counted once). 1e-6 (float32).

The bias: counting the routed tokens of a training forward (with gradients), not of an eval
forward or one under ``no_grad``; ``expert_bias`` is the router's own
``e_score_correction_bias`` tensor; a model without such a router is an error naming
``config.moe_router_enable_expert_bias``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.hf_moe import build_model
from mc_groups.testing import RankPools
from mc_moe.router import enable_expert_bias, global_load_balancing_loss, routers_with_bias

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

E, K, ROWS = 4, 2, (5, 7)


def _logits(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(ROWS[rank], E, generator=g) for _ in range(2)]


def _masks(rank: int) -> torch.Tensor:
    return (torch.arange(ROWS[rank]) % 3 != 0).to(torch.int64)


def _global_loss(masked: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import mc_groups as mg

    torch.set_num_threads(1)
    rank = dist.get_rank()
    logits = [x.requires_grad_(True) for x in _logits(rank)]
    world = dist.group.WORLD
    assert world is not None
    mask = _masks(rank) if masked else None
    with mg.record_collectives() as log:
        loss = global_load_balancing_loss(logits, E, K, world, 2.0, mask)
    grads = torch.autograd.grad(loss, logits)
    return {
        "loss": float(loss),
        "grads": [g.clone() for g in grads],
        "ops": [(r.op, r.numel) for r in log],
    }


def test_global_loss_is_transformers_loss_of_the_whole_batch(rank_pools: RankPools) -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    for masked in (False, True):
        outcomes = rank_pools.get(2).run(_global_loss, masked)
        per_rank = [[x.requires_grad_(True) for x in _logits(r)] for r in range(2)]
        layers = tuple(torch.cat([per_rank[0][i], per_rank[1][i]]) for i in range(2))
        mask = torch.cat([_masks(0), _masks(1)]).view(1, -1) if masked else None
        ref = load_balancing_loss_func(layers, E, K, mask)  # type: ignore[arg-type]
        assert isinstance(ref, torch.Tensor)
        ref.backward()  # type: ignore[no-untyped-call]
        for rank, outcome in enumerate(outcomes):
            assert outcome["ops"] == [("all_reduce", 2 * E + 1)]
            assert abs(outcome["loss"] - ref.item()) <= 1e-6, (masked, outcome["loss"], ref)
            for got, want in zip(outcome["grads"], per_rank[rank], strict=True):
                assert want.grad is not None
                torch.testing.assert_close(got, 2.0 * want.grad, rtol=0, atol=1e-6)


def test_expert_bias_counts_training_forwards_only() -> None:
    model: Any = build_model("deepseek_v3")
    enable_expert_bias(model)
    names = [name for name, _ in routers_with_bias(model)]
    assert names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    gate: Any = model.get_submodule(names[0])
    assert gate.expert_bias is gate.e_score_correction_bias
    saved = model.state_dict()  # the model's own names only
    assert not [k for k in saved if k.endswith(("local_tokens_per_expert", "expert_bias"))]
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids)
    counts = gate.local_tokens_per_expert.clone()
    assert counts.dtype == torch.float32
    assert float(counts.sum()) == 2 * 8 * K  # every token routed to K experts
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)
    assert torch.equal(gate.local_tokens_per_expert, counts)


def test_expert_bias_flag_needs_a_router_with_a_bias() -> None:
    with pytest.raises(ValueError, match=r"moe_router_enable_expert_bias=True but .*Mixtral"):
        enable_expert_bias(build_model("mixtral"))
