"""The README's example: a tensor-parallel MLP trained with mc DDP on TP=2 × DP=2.

Run it with ``torchrun --standalone --nproc-per-node 4 -m examples.quickstart``;
``integration_tests/test_quickstart.py`` runs ``train`` on 4 gloo ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
from mc_finalize import finalize_model_grads
from mc_tp_layers import ColumnParallelLinear, RowParallelLinear


# --8<-- [start:readme]
class MLP(torch.nn.Module):
    """h → 4h split by columns over tp, GELU, 4h → h split by rows (one all-reduce)."""

    def __init__(self, h: int, cfg: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection):
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.up = ColumnParallelLinear(h, 4 * h, config=cfg, init_method=init, pg_collection=pgc)
        self.down = RowParallelLinear(
            4 * h,
            h,
            config=cfg,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.up(x)  # [s, b, 4h / tp]: no communication in forward
        out: torch.Tensor = self.down(F.gelu(hidden))[0]  # all-reduce over tp
        return out


def train(steps: int = 5, h: int = 32) -> list[float]:
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)  # dp = world / 2
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    torch.manual_seed(0)  # CPU init builds the full weights: the same on every rank
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    model = DistributedDataParallel(cfg, ddp_cfg, MLP(h, cfg, pgc), pg_collection=pgc)
    opt = ShardedOptimizer(  # clips the whole model's grad norm (over tp and dp) to 1.0
        torch.optim.AdamW(model.parameters(), lr=1e-2), model, max_grad_norm=1.0, pg_collection=pgc
    )
    torch.manual_seed(1 + pgc.require("dp", "data").rank())  # each DP rank: its own batch
    x = torch.randn(8, 4, h)  # [sequence, batch, hidden]
    losses = []
    for _ in range(steps):
        model.zero_grad_buffer()
        loss = (model(x) - x).pow(2).mean()  # learn the identity
        loss.backward()
        finalize_model_grads([model], pg_collection=pgc)  # DP reduction (+ TP-shared grads)
        opt.step()  # clip (.grad_norm: the norm before), step this rank's shard, all-gather
        losses.append(loss.item())
    mg.destroy_model_parallel(pgc)
    return losses


# --8<-- [end:readme]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} losses: {[round(v, 4) for v in train()]}")
    dist.destroy_process_group()
