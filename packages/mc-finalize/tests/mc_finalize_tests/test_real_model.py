"""The whole pipeline on a real TP = 2 × DP = 2 model (mc-tp-layers + mc-ddp) against one
process.

Localizes the composition DDP + finalize on real layers: a sequence-parallel block (layer
norm → ColumnParallelLinear → GELU → RowParallelLinear) wrapped in
``mc_ddp.DistributedDataParallel``; after backward, ``finalize_model_grads`` must leave every
rank with its slice of the gradient of the mean over DP replicas of the full-sequence loss,
computed here by a single-process model with the same weights. The layer-norm grads are the
case that needs finalize: each TP rank saw half the sequence (step 4 sums them).

Skipped while mc_ddp has no ``DistributedDataParallel`` (being written in parallel); the
calls follow Megatron-Core's signatures, which mc-ddp and mc-tp-layers keep. Tolerance:
fp32 sums in a different order (gathered sequence, DP average) — rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_ddp
import mc_groups as mg
from mc_finalize import finalize_model_grads
from mc_finalize_tests._helpers import layout
from mc_groups.testing import RankPools

pytestmark = pytest.mark.skipif(
    getattr(mc_ddp, "DistributedDataParallel", None) is None,
    reason="needs mc_ddp.DistributedDataParallel",
)

SEQ, BATCH, HIDDEN, FFN = 4, 2, 8, 16


def _init(weight: torch.Tensor) -> None:
    """Deterministic full (master) weight, the same on every rank and in the reference."""
    generator = torch.Generator().manual_seed(weight.numel())
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)


def _batch(dp_rank: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(100 + dp_rank))


class _Block(torch.nn.Module):
    def __init__(self, config: Any, tp_group: Any) -> None:
        super().__init__()
        import mc_tp_layers as tl

        self.ln = torch.nn.LayerNorm(HIDDEN)
        for param in self.ln.parameters():
            param.sequence_parallel = True  # type: ignore[attr-defined]
        self.fc1 = tl.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=_init, bias=False, tp_group=tp_group
        )
        self.fc2 = tl.RowParallelLinear(
            FFN,
            HIDDEN,
            config=config,
            init_method=_init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(self.ln(x))
        out, _ = self.fc2(F.gelu(hidden))
        return out  # type: ignore[no-any-return]


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    assert grad is not None
    return grad.detach().clone()


def _tp2_dp2_step() -> dict[str, torch.Tensor]:
    ddp_cls: Any = mc_ddp.DistributedDataParallel
    ddp_config_cls: Any = mc_ddp.DistributedDataParallelConfig
    with layout(tensor_model_parallel_size=2) as pgc:
        assert pgc.tp is not None
        assert pgc.dp is not None
        config = mg.ModelParallelConfig(
            tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True
        )
        block = _Block(config, pgc.tp)
        model = ddp_cls(config, ddp_config_cls(), block, pg_collection=pgc)
        tp_rank, half = pgc.tp.rank(), SEQ // 2
        x = _batch(pgc.dp.rank())[tp_rank * half : (tp_rank + 1) * half]
        (model(x) ** 2).sum().backward()
        finalize_model_grads([model], pg_collection=pgc)
        return {
            "ln.weight": _grad(block.ln.weight),
            "ln.bias": _grad(block.ln.get_parameter("bias")),
            "fc1": _grad(block.fc1.get_parameter("weight")),
            "fc2": _grad(block.fc2.get_parameter("weight")),
        }


def _reference() -> dict[str, torch.Tensor]:
    """One process, full weights, loss = mean over the two DP batches of Σ output²."""
    ln = torch.nn.LayerNorm(HIDDEN)
    w1, w2 = torch.empty(FFN, HIDDEN), torch.empty(HIDDEN, FFN)
    _init(w1)
    _init(w2)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    loss = sum((F.linear(F.gelu(F.linear(ln(_batch(d)), w1)), w2) ** 2).sum() for d in range(2)) / 2
    assert isinstance(loss, torch.Tensor)
    torch.autograd.backward(loss)
    grads = {"ln.weight": ln.weight.grad, "ln.bias": ln.bias.grad, "fc1": w1.grad, "fc2": w2.grad}
    return {k: v.detach() for k, v in grads.items() if v is not None}


def test_tp2_dp2_block_matches_single_process(rank_pools: RankPools) -> None:
    reference = _reference()
    for r, grads in enumerate(rank_pools.get(4).run(_tp2_dp2_step)):
        tp_rank = r % 2  # rank = tp + 2·dp
        rows = slice(tp_rank * FFN // 2, (tp_rank + 1) * FFN // 2)
        expected = {
            "ln.weight": reference["ln.weight"],
            "ln.bias": reference["ln.bias"],
            "fc1": reference["fc1"][rows],  # column parallel: output rows split
            "fc2": reference["fc2"][:, rows],  # row parallel: input columns split
        }
        for name, value in expected.items():
            torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-6, msg=name)
