"""Shared pieces of the reliability tests: AdamW (so optimizer state matters), short training
loops, and picklable snapshots of what each rank's ShardedOptimizer holds, with an
independent reassembly of the full-parameter optimizer state from them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

import mc_groups as mg
from examples.gpt import OptimizerConfig, Trainer, train_step
from integration_tests._common import batch

# AdamW, as the demo trains: its moments and step count are state a checkpoint must carry.
ADAMW = OptimizerConfig(name="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def train(trainer: Trainer, steps: Iterable[int]) -> list[float]:
    """One ``train_step`` per step index (its global batch); the losses."""
    return [train_step(trainer, batch(step)) for step in steps]


class SliceState(NamedTuple):
    """What a rank's optimizer holds for one param slice (all values copied)."""

    name: str
    tp_rank: int
    tp_size: int
    split_dim: int | None  # the dim the param is split along over TP (None: replicated)
    local_shape: tuple[int, ...]
    start: int
    end: int
    master: torch.Tensor
    state: dict[str, torch.Tensor]
    step: float


def slice_states(trainer: Trainer) -> list[SliceState]:
    """Every slice this rank's optimizer steps: its place and its AdamW state."""
    tp = trainer.pgc.require("tp", "slice_states")
    names = {p: n for n, p in trainer.model.module.named_parameters()}
    out = []
    for owned in trainer.optimizer.owned_slices:
        param, state = owned.param, trainer.optimizer.optimizer.state[owned.master]
        split = int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else None  # type: ignore[attr-defined]
        out.append(
            SliceState(
                name=names[param],
                tp_rank=mg.group_rank(tp),
                tp_size=mg.group_size(tp),
                split_dim=split,
                local_shape=tuple(param.shape),
                start=owned.start,
                end=owned.end,
                master=owned.master.detach().clone(),
                state={k: state[k].detach().clone() for k in STATE_KEYS},
                step=float(state["step"]),
            )
        )
    return out


def _local_flat(slices: list[SliceState], key: str) -> torch.Tensor:
    numel = math.prod(slices[0].local_shape)
    flat = torch.full((numel,), float("nan"))
    for s in slices:
        value = s.master if key == "master" else s.state[key]
        flat[s.start : s.end] = value
    assert not flat.isnan().any(), f"{slices[0].name}: the ranks' slices do not cover it"
    return flat.view(slices[0].local_shape)


def full_states(per_rank: Sequence[list[SliceState]]) -> dict[tuple[str, str], torch.Tensor]:
    """``{(param name, "master" | state key): full tensor}`` reassembled from every rank's
    slices: each TP rank's local tensor from its DP slices, then the TP parts concatenated
    along the split dim (replicated params: every TP rank must hold the same values)."""
    by_param: dict[str, dict[int, list[SliceState]]] = {}
    for rank_slices in per_rank:
        for s in rank_slices:
            by_param.setdefault(s.name, {}).setdefault(s.tp_rank, []).append(s)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, by_tp in by_param.items():
        first = next(iter(by_tp.values()))[0]
        assert sorted(by_tp) == list(range(first.tp_size)), (name, sorted(by_tp))
        for key in ("master", *STATE_KEYS):
            parts = [_local_flat(by_tp[r], key) for r in range(first.tp_size)]
            if first.split_dim is None:
                for part in parts[1:]:
                    assert torch.equal(part, parts[0]), (name, key, "TP replicas differ")
                out[name, key] = parts[0]
            else:
                out[name, key] = torch.cat(parts, dim=first.split_dim)
    return out


def expected_slice(full: torch.Tensor, s: SliceState) -> torch.Tensor:
    """The part of a full tensor a loading rank's slice ``s`` must hold."""
    local = full if s.split_dim is None else full.chunk(s.tp_size, s.split_dim)[s.tp_rank]
    return local.contiguous().view(-1)[s.start : s.end]
