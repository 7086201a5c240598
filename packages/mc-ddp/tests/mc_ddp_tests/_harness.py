"""Shared pieces of the mc-ddp tests: a model-parallel scope, a small MLP, deterministic
batches and the single-process reference (same init, full batch, fp32 masters)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig

IN, HIDDEN, OUT = 8, 16, 4

# The recorder names the collective mc_groups was asked for (on gloo it runs as an all-to-all
# inside mc_groups, see mc_groups.reduce_scatter); an all-gather's record counts this rank's
# shard. Labels ("grad reduce …", "param gather …") name the bucket group.
SCATTER_OP, GATHER_OP = "reduce_scatter", "all_gather"
LOCAL_BATCH = 6  # per rank; divisible by 1 and 3 microbatches


@contextmanager
def model_parallel(**sizes: Any) -> Iterator[mg.ProcessGroupCollection]:
    """Groups for the test's world; destroyed on exit even when the test body raises."""
    pgc = mg.initialize_model_parallel(**sizes)
    try:
        yield pgc
    finally:
        mg.destroy_model_parallel(pgc)


def mlp(dtype: torch.dtype = torch.float32, seed: int = 1234) -> nn.Sequential:
    """Linear(8,16) → tanh → Linear(16,16) → tanh → Linear(16,4): 484 params, 6 tensors."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )
    return model.to(dtype)


def global_batch(step: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of every rank for ``step`` (rank r owns rows r·B .. (r+1)·B)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * LOCAL_BATCH, IN, generator=gen).to(dtype)
    y = torch.randn(world * LOCAL_BATCH, OUT, generator=gen)
    return x, y


def local_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over samples and outputs, computed in fp32."""
    return (out.float() - y).pow(2).mean()


def ddp_backward(
    ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor, microbatches: int
) -> None:
    """Forward/backward of this rank's batch in ``microbatches`` equal parts; all but the last
    inside ``no_sync``; each microbatch loss divided by the count, as Megatron's schedule does."""
    size = x.shape[0] // microbatches
    for m in range(microbatches):
        rows = slice(m * size, (m + 1) * size)
        loss = loss_fn(ddp(x[rows]), y[rows]) / microbatches
        if m < microbatches - 1:
            with ddp.no_sync():
                torch.autograd.backward(loss)
        else:
            torch.autograd.backward(loss)


class Reference:
    """One process, the full global batch: grads of the mean loss, then SGD (momentum 0.9)
    on fp32 masters written back in the model dtype (for fp32 models: plain SGD)."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = copy.deepcopy(model)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.masters, lr=lr, momentum=0.9)

    def grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """Gradients of the full-batch loss at the current params."""
        for p in self.params:
            p.grad = None
        torch.autograd.backward(loss_fn(self.model(x), y))
        return [p.grad.detach().clone() for p in self.params]  # type: ignore[union-attr]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """One SGD step on the masters; params ← masters (rounded to the model dtype)."""
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad.float()
        self.optimizer.step()
        for p, master in zip(self.params, self.masters, strict=True):
            p.copy_(master)


def owned_slices(ddp: DistributedDataParallel) -> dict[nn.Parameter, list[tuple[int, int]]]:
    """Per param, the flat ranges whose reduced grad this rank holds after finish_grad_sync:
    everything (all-reduce) or its shard of each bucket (distributed optimizer)."""
    out: dict[nn.Parameter, list[tuple[int, int]]] = {}
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        rank, size = group.shard.rank, group.shard.size
        if not ddp.ddp_config.use_distributed_optimizer:
            rank, size = 0, 1
        for bucket in group.buckets:
            for s in bucket.shard_param_slices(rank, size):
                out.setdefault(s.param, []).append(s.param_range)
    return out


def max_grad_error(
    ddp: DistributedDataParallel, ref_grads: list[torch.Tensor], relative: bool = False
) -> float:
    """Largest |main_grad − reference grad| over the ranges this rank owns; with
    ``relative``, each param's error is divided by its reference's largest magnitude."""
    owned = owned_slices(ddp)
    worst = 0.0
    for p, ref in zip(ddp.module.parameters(), ref_grads, strict=True):
        got = p.main_grad.detach().float().view(-1)  # type: ignore[attr-defined]
        want = ref.float().view(-1)
        scale = float(want.abs().max()) if relative else 1.0
        for a, b in owned.get(p, []):
            worst = max(worst, float((got[a:b] - want[a:b]).abs().max()) / scale)
    return worst


def max_param_error(model: nn.Module, ref: nn.Module, relative: bool = False) -> float:
    """Largest |param − reference param| (optionally per-tensor relative)."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        diff = float((p.detach().float() - q.detach().float()).abs().max())
        worst = max(worst, diff / float(q.detach().float().abs().max()) if relative else diff)
    return worst


def main_grad(param: torch.Tensor) -> torch.Tensor:
    """``param.main_grad`` (the DDP buffer view, or the fp32 local-accumulation tensor)."""
    grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
    return grad


def world_size() -> int:
    """Ranks in the default group."""
    return dist.get_world_size()


def ddp_config(**fields: object) -> DistributedDataParallelConfig:
    """A config with ``fields`` set (typed loosely for test tables)."""
    return DistributedDataParallelConfig(**fields)  # type: ignore[arg-type]
