"""Shared pieces of the composition parity tests (``test_parity_gtp.py``,
``test_parity_experts.py``, ``test_parity_cp.py``): the layout, loading full weights into
mc's sharded params and gathering them back, one training loop (mc layers + DDP +
``finalize_model_grads`` + SGD), the 1-process reference and the comparisons.

The global batch of a step is ``UNITS`` = 4 equal micro-batch units ``[s, b, H]``; a layout
with D data shards (ranks that see different data) gives data shard d the units
``d·M … d·M + M − 1`` as its M = 4 / D micro-batches, so every layout of a composition
trains on the same global batch and compares against one reference run.

Loss (per token t: ``ℓ_t = mean_h (y_t,h − target_t,h)²``), as Megatron-Core's schedule
normalises it (``pipeline_parallel/schedules.py``, ``forward_step_calc_loss``):

- default: each rank's micro-batch loss is the mean of ``ℓ`` over its own tokens, divided
  by the number of micro-batches; DDP divides by |dp_cp| and sums. Every unit has the same
  token count, so the reference is the plain mean of ``ℓ`` over the global batch.
- ``calculate_per_token_loss``: each rank's loss is ``Σ mask·ℓ`` over its tokens (no
  division), its unmasked token count goes to ``finalize_model_grads(num_tokens=…)``, which
  sums it over the data ranks and divides every grad by it. The mask (fixed per step) gives
  the ranks different token counts, so a mean of per-rank means would not match: the
  reference is ``Σ mask·ℓ / Σ mask`` over the global batch.

SGD (lr 0.1, momentum 0.9, ``foreach=False`` on both sides): its update is linear in the
gradient, so a wrong scale or a missing contribution moves the weights (see ``_common.py``).

Clipping (a layout with ``clip``): mc's ``ShardedOptimizer(max_grad_norm=clip,
norm_type=...)`` against ``torch.nn.utils.clip_grad_norm_`` of the unsharded model before
the same SGD step; every step's norm compared (``NORM_RTOL``), and the reference must clip
at every step (a norm above ``clip``), so a norm off by a factor moves the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ShardedOptimizer,
    ensure_params_ready,
)
from mc_finalize import finalize_model_grads
from mc_tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

STEPS = 5
RECORDED_STEP = 2  # DDP learned the hook order in step 0
UNITS = 4  # micro-batch units per global batch
LR, MOMENTUM = 0.1, 0.9
LOSS_RTOL = 1e-5  # the bound, per step
WEIGHT_ATOL = 1e-6  # the bound, final weights (gloo, fp32)
GRAD_RTOL = 1e-5  # step-0 grads, relative to each tensor's largest magnitude (diagnostic)
MIN_MOVE = 100 * WEIGHT_ATOL  # every reference tensor must move at least this much
NORM_RTOL = 1e-5  # the bound on the global grad norm

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """A parallel layout of ``world`` ranks (sizes as ``initialize_model_parallel`` takes
    them; ``etp=None`` reads as ``tp``) and the loss normalisation."""

    world: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    gtp: int = 1
    egtp: int = 1  # expert_gtp_remat_size (mc's layers shard experts by config.gtp_remat_size)
    per_token_loss: bool = False
    dist_opt: bool = False  # DDP's use_distributed_optimizer (grads reduce-scattered)
    clip: float | None = None  # ShardedOptimizer(max_grad_norm=clip)
    norm_type: float = 2.0

    def describe(self) -> str:
        """E.g. ``world=4 tp=2 etp=1 per-token``."""
        parts = [f"world={self.world}"]
        for name in ("tp", "cp", "ep", "gtp", "egtp"):
            if getattr(self, name) > 1:
                parts.append(f"{name}={getattr(self, name)}")
        if self.etp is not None:
            parts.append(f"etp={self.etp}")
        parts.append("per-token" if self.per_token_loss else "mean")
        if self.dist_opt:
            parts.append("dist-opt")
        if self.clip is not None:
            parts.append(f"clip={self.clip}@{self.norm_type:g}")
        return " ".join(parts)

    def config(self, *, sequence_parallel: bool = False) -> mg.ModelParallelConfig:
        """The layers' and DDP's config (CPU initialisation: weights are loaded after)."""
        return mg.ModelParallelConfig(
            tensor_model_parallel_size=self.tp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            gtp_remat_size=self.gtp,
            sequence_parallel=sequence_parallel,
            use_cpu_initialization=True,
            calculate_per_token_loss=self.per_token_loss,
        )


@contextmanager
def collection(layout: Layout) -> Iterator[mg.ProcessGroupCollection]:
    """The layout's groups, destroyed on exit even when the body raises."""
    assert dist.get_world_size() == layout.world, (dist.get_world_size(), layout)
    pgc = mg.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        gtp_remat_size=layout.gtp,
        expert_gtp_remat_size=layout.egtp,
    )
    try:
        yield pgc
    finally:
        mg.destroy_model_parallel(pgc)


def ddp_config(layout: Layout) -> DistributedDataParallelConfig:
    """Overlapped grad reduction in buckets of >= 64 elements (several per buffer); with
    ``dist_opt``, grads reduce-scattered into shards and params all-gathered after the
    step."""
    return DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=64, use_distributed_optimizer=layout.dist_opt
    )


def group_ranks(pgc: mg.ProcessGroupCollection, *names: str) -> dict[str, tuple[int, ...]]:
    """The global ranks of this rank's group of each name (empty when absent)."""
    out: dict[str, tuple[int, ...]] = {}
    for name in names:
        group = getattr(pgc, name)
        out[name] = () if group is None else mg.group_ranks(group)
    return out


# ----------------------------------------------------------------------------- weights


def tp_group_of(module: torch.nn.Module) -> dict[str, dist.ProcessGroup]:
    """``{param name: the TP group of the layer owning it}`` (mc layers only)."""
    out: dict[str, dist.ProcessGroup] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            for name, _ in sub.named_parameters(recurse=False):
                out[f"{prefix}.{name}" if prefix else name] = sub.tp_group
    return out


def local_part(
    param: torch.Tensor, full: torch.Tensor, tp: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's part of ``full``: its TP chunk along ``partition_dim`` (stride 1), then
    its gtp_remat rows of that chunk, zero-padded to the shard size."""
    part = full
    if tp is not None and getattr(param, "tensor_model_parallel", False):
        dim = int(param.partition_dim)  # type: ignore[attr-defined]
        part = part.chunk(mg.group_size(tp), dim)[mg.group_rank(tp)]
    if getattr(param, "is_gtp_weight_remat", False):
        rows = param.shape[0]
        pad = int(param.pad_length)  # type: ignore[attr-defined]
        rank = mg.group_rank(param.group)  # type: ignore[attr-defined]
        part = torch.nn.functional.pad(part, (0, 0, 0, pad))[rank * rows : (rank + 1) * rows]
    return part


def no_init(weight: torch.Tensor) -> None:
    """An ``init_method`` that leaves the weight alone: :func:`load_weights` fills it."""


def tp_mlp(
    config: mg.ModelParallelConfig,
    pgc: mg.ProcessGroupCollection,
    hidden: int,
    ffn: int,
    *,
    is_expert: bool = False,
) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    """``fc1`` (Column ``hidden → ffn``) and ``fc2`` (Row ``ffn → hidden``, its input already
    split), both with a bias: the MLP of every composition model (weights loaded later)."""
    fc1 = ColumnParallelLinear(
        hidden,
        ffn,
        config=config,
        init_method=no_init,
        bias=True,
        is_expert=is_expert,
        pg_collection=pgc,
    )
    fc2 = RowParallelLinear(
        ffn,
        hidden,
        config=config,
        init_method=no_init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        is_expert=is_expert,
        pg_collection=pgc,
    )
    return fc1, fc2


def random_batch(
    seed: int, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``shape`` (``[units, s, b, h]``) and a per-token-loss mask
    ``[units, s, b]``, drawn from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    target = torch.randn(shape, generator=g)
    return x, target, make_mask(g, shape[:3])


def load_weights(module: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's part of each ``full[name]`` into ``module``'s param ``name``."""
    groups = tp_group_of(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(local_part(param, full[name], groups.get(name)))


def _gather_dim(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, label: str
) -> torch.Tensor:
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * mg.group_size(group), *moved.shape[1:]))
    mg.all_gather(out, moved, group, label=label)
    return out.movedim(0, dim)


def full_tensor(
    param: torch.Tensor, local: torch.Tensor, tp: dist.ProcessGroup | None
) -> torch.Tensor:
    """The inverse of :func:`local_part` for ``local`` (the param or its grad): all-gather
    the gtp_remat rows (padding dropped), then the TP chunks. Collective over both."""
    out = local.detach()
    if getattr(param, "is_gtp_weight_remat", False):
        rows = int(param.gtp_unsharded_shape[0])  # type: ignore[attr-defined]
        out = _gather_dim(out, 0, param.group, "test: gather gtp_remat rows")[:rows]  # type: ignore[attr-defined]
    if tp is not None and getattr(param, "tensor_model_parallel", False):
        out = _gather_dim(out, int(param.partition_dim), tp, "test: gather tp")  # type: ignore[attr-defined]
    return out.float().clone()


def full_state(
    module: torch.nn.Module, rename: Callable[[str], str], *, grads: bool = False
) -> Weights:
    """Every param (or its ``main_grad``) as the full tensor, under its global name."""
    groups = tp_group_of(module)
    out: Weights = {}
    for name, param in module.named_parameters():
        local = param.main_grad if grads else param  # type: ignore[attr-defined]
        out[rename(name)] = full_tensor(param, local, groups.get(name))
    return out


def buffer_placement(
    ddp: DistributedDataParallel[Any], rename: Callable[[str], str]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{global param name: ("dense" | "expert", ranks of its bucket group's collective
    group)}``: which DDP buffer each param landed in and where that buffer is reduced."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for kind, bucket_groups in (
        ("dense", ddp.bucket_groups),
        ("expert", ddp.expert_parallel_bucket_groups),
    ):
        for bucket_group in bucket_groups:
            ranks = mg.group_ranks(bucket_group.collective_group)
            for param in bucket_group.params:
                out[rename(ddp.param_to_name[param])] = (kind, ranks)
    return out


# ---------------------------------------------------------------------------- training


class Rec(NamedTuple):
    """A picklable summary of one recorded collective."""

    op: str
    reduce_op: str | None
    group_ranks: tuple[int, ...]
    label: str
    numel: int


def summarize(log: list[mg.CollectiveRecord]) -> list[Rec]:
    """The fields of each record the tests look at."""
    return [Rec(r.op, r.reduce_op, r.group_ranks, r.label, r.numel) for r in log]


# (step, micro-batch index, micro-batch count) -> (loss to backward, unmasked local tokens)
MicroLoss = Callable[[int, int, int], tuple[torch.Tensor, int]]


@dataclass
class RankRun:
    """What one rank reports (picklable)."""

    losses: list[float]
    weights: Weights
    grads: Weights  # step 0, after finalize_model_grads, before the optimizer step
    records: list[Rec]
    placement: dict[str, tuple[str, tuple[int, ...]]]
    groups: dict[str, tuple[int, ...]]
    local_numel: dict[str, int] = field(default_factory=dict)  # global name -> this rank's numel
    norms: list[float | None] = field(default_factory=list)  # StepResult.grad_norm per step


def train(
    ddp: DistributedDataParallel[Any],
    pgc: mg.ProcessGroupCollection,
    layout: Layout,
    micro_loss: MicroLoss,
    microbatches: int,
    rename: Callable[[str], str] = str,
    group_names: tuple[str, ...] = (),
) -> RankRun:
    """STEPS SGD steps: per step, ``microbatches`` forward/backward passes (all but the last
    under ``no_sync``), ``finalize_model_grads`` (with this rank's token count under
    per-token loss), the optimizer step. Step ``RECORDED_STEP``'s collectives are recorded
    (the loss logging is outside the recording)."""
    optimizer = ShardedOptimizer(
        torch.optim.SGD(list(ddp.parameters()), lr=LR, momentum=MOMENTUM, foreach=False),
        ddp,
        max_grad_norm=layout.clip,
        norm_type=layout.norm_type,
        pg_collection=pgc,
    )
    norms: list[float | None] = []
    data = pgc.require("dp_cp_gtp_remat", "the test's loss logging")
    losses: list[float] = []
    grads: Weights = {}
    records: list[Rec] = []
    for step in range(STEPS):
        recording: AbstractContextManager[list[mg.CollectiveRecord] | None] = (
            mg.record_collectives() if step == RECORDED_STEP else nullcontext()
        )
        with recording as log:
            ddp.zero_grad_buffer()
            total = torch.zeros(())
            tokens = 0
            for m in range(microbatches):
                last = m == microbatches - 1
                with nullcontext() if last else ddp.no_sync():
                    loss, count = micro_loss(step, m, microbatches)
                    loss.backward()  # type: ignore[no-untyped-call]
                total += loss.detach()
                tokens += count
            num_tokens = torch.tensor(tokens, dtype=torch.int64) if layout.per_token_loss else None
            finalize_model_grads([ddp], num_tokens=num_tokens, pg_collection=pgc)
        if log is not None:
            records = summarize(log)
        if step == 0 and not layout.dist_opt:  # (dist-opt: only this rank's shard is reduced)
            grads = full_state(ddp.module, rename, grads=True)
        result = optimizer.step()
        assert not result.skipped, result
        norms.append(result.grad_norm)
        losses.append(_logged_loss(total, tokens, data, layout.per_token_loss))
    ensure_params_ready(list(ddp.module.parameters()))
    return RankRun(
        losses=losses,
        weights=full_state(ddp.module, rename),
        grads=grads,
        records=records,
        placement=buffer_placement(ddp, rename),
        groups=group_ranks(pgc, "tp", "cp", "dp", "dp_cp", "dp_cp_gtp_remat", *group_names),
        local_numel={rename(n): p.numel() for n, p in ddp.module.named_parameters()},
        norms=norms,
    )


def _logged_loss(
    total: torch.Tensor, tokens: int, data: dist.ProcessGroup, per_token: bool
) -> float:
    """The global batch's loss from this rank's part: the mean over the data ranks of their
    micro-batch means, or the summed per-token losses over the summed token count."""
    if per_token:
        both = torch.stack([total.double(), torch.tensor(float(tokens), dtype=torch.float64)])
        mg.all_reduce(both, data, op=mg.ReduceOp.SUM, label="test: loss")
        return float(both[0] / both[1])
    mean = total.double().clone()
    mg.all_reduce(mean, data, op=mg.ReduceOp.AVG, label="test: loss")
    return float(mean)


def token_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``ℓ_t = mean_h (y − target)²`` for every token (all dims but the last)."""
    return ((y - target) ** 2).mean(dim=-1)


def normalised(
    per_token: torch.Tensor, mask: torch.Tensor, microbatches: int, layout: Layout
) -> tuple[torch.Tensor, int]:
    """A rank's micro-batch loss as Megatron's schedule normalises it (module notes)."""
    if layout.per_token_loss:
        return (per_token * mask).sum(), int(mask.sum())
    return per_token.mean() / microbatches, per_token.numel()


def make_mask(generator: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A 0/1 loss mask keeping ~70% of the tokens (fp32)."""
    return (torch.rand(shape, generator=generator) < 0.7).float()


# --------------------------------------------------------------------------- reference


class Reference(NamedTuple):
    """The 1-process run: loss of each step, step-0 grads, final weights (and, clipped,
    each step's norm before clipping)."""

    losses: list[float]
    grads: Weights
    weights: Weights
    initial: Weights
    norms: tuple[float, ...] = ()


def reference_run(
    initial: Weights,
    loss_of: Callable[[Weights, int], torch.Tensor],
    clip: float | None = None,
    norm_type: float = 2.0,
) -> Reference:
    """Plain PyTorch on one process: ``loss_of(params, step)`` over the whole global batch,
    one backward, ``torch.nn.utils.clip_grad_norm_`` when ``clip``, SGD with the same
    hyper-parameters."""
    params = {k: v.clone().requires_grad_(True) for k, v in initial.items()}
    optimizer = torch.optim.SGD(list(params.values()), lr=LR, momentum=MOMENTUM, foreach=False)
    losses: list[float] = []
    grads: Weights = {}
    norms: list[float] = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(params, step)
        loss.backward()  # type: ignore[no-untyped-call]
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), clip, norm_type)
            norms.append(float(norm))
        optimizer.step()
        losses.append(float(loss.detach()))
    weights = {k: p.detach().clone() for k, p in params.items()}
    return Reference(losses, grads, weights, initial, tuple(norms))


def reference_loss(
    per_token: torch.Tensor, mask: torch.Tensor, per_token_loss: bool
) -> torch.Tensor:
    """The global batch's loss (module notes)."""
    if per_token_loss:
        return (per_token * mask).sum() / mask.sum()
    return per_token.mean()


# -------------------------------------------------------------------------- comparison


class Measured(NamedTuple):
    """The largest differences of one layout against the reference."""

    loss_rel: float
    weight_abs: float
    weight_name: str
    grad_rel: float
    grad_name: str
    norm_rel: float = -1.0


def merge(per_rank: list[Weights], what: str) -> Weights:
    """One full tensor per name from every rank's copies, which must be bit-identical
    (replicas get the same reduced grads and the same update)."""
    merged: Weights = {}
    for rank, tensors in enumerate(per_rank):
        for name, value in tensors.items():
            if name not in merged:
                merged[name] = value
                continue
            same = torch.equal(merged[name], value)
            diff = float((merged[name] - value).abs().max())
            assert same, f"{what} {name}: rank {rank}'s copy differs by {diff:.3g}"
    return merged


def _grad_diff(grads: Weights, ref: Weights) -> tuple[float, str, str]:
    worst, name, note = -1.0, "", ""
    for key, value in grads.items():
        scale = float(ref[key].abs().max())
        diff = float((value - ref[key]).abs().max()) / scale
        if diff > worst:
            ratio = float(value.norm() / ref[key].norm())
            worst, name, note = diff, key, f"‖grad‖/‖ref‖ = {ratio:.4f}"
    return worst, name, note


def compare(layout: Layout, per_rank: list[RankRun], ref: Reference) -> Measured:
    """Loss per step ≤ LOSS_RTOL relative, step-0 grads ≤ GRAD_RTOL of each tensor's
    largest magnitude, final weights ≤ WEIGHT_ATOL; every copy on every rank identical."""
    label = layout.describe()
    for name, final in ref.weights.items():
        move = float((final - ref.initial[name]).abs().max())
        assert move >= MIN_MOVE, f"reference {name} moved only {move:.3g}"
    losses = per_rank[0].losses
    for rank, run in enumerate(per_rank):
        assert run.losses == losses, (label, rank, run.losses, losses)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses, strict=True))
    grads = merge([r.grads for r in per_rank], f"{label}: step-0 grad")
    grad_rel, grad_name, note = -1.0, "(not compared)", ""
    if not layout.dist_opt:
        assert sorted(grads) == sorted(ref.grads), sorted(set(grads) ^ set(ref.grads))
        grad_rel, grad_name, note = _grad_diff(grads, ref.grads)
    weights = merge([r.weights for r in per_rank], f"{label}: final weight")
    weight_abs, weight_name = -1.0, ""
    for key, value in weights.items():
        diff = float((value - ref.weights[key]).abs().max())
        if diff > weight_abs:
            weight_abs, weight_name = diff, key
    norm_rel = _compare_norms(layout, per_rank, ref)
    measured = Measured(loss_rel, weight_abs, weight_name, grad_rel, grad_name, norm_rel)
    print(f"[{label}] measured: {measured}")
    assert grad_rel <= GRAD_RTOL, (label, "step-0 grad", grad_name, grad_rel, note)
    assert loss_rel <= LOSS_RTOL, (label, losses, ref.losses)
    assert weight_abs <= WEIGHT_ATOL, (label, weight_name, weight_abs)
    return measured


def _compare_norms(layout: Layout, per_rank: list[RankRun], ref: Reference) -> float:
    """Every rank reports the same norm per step; the reference clipped at every step; the
    largest relative difference (-1 without clipping)."""
    label = layout.describe()
    norms = per_rank[0].norms
    for rank, run in enumerate(per_rank):
        assert run.norms == norms, (label, rank, run.norms, norms)
    if layout.clip is None:
        assert all(n is None for n in norms), (label, norms)
        return -1.0
    assert all(n > layout.clip for n in ref.norms), (label, "clip inactive", ref.norms)
    rel = max(abs(float(a or 0.0) - b) / b for a, b in zip(norms, ref.norms, strict=True))
    assert rel <= NORM_RTOL, (label, norms, ref.norms)
    return rel


def grad_reductions(records: list[Rec]) -> set[tuple[str, str | None, tuple[int, ...], str]]:
    """``{(op, reduce_op, group ranks, label without the bucket number)}`` of the recorded
    training collectives (the test's own gathers excluded)."""
    out = set()
    for r in records:
        if r.label.startswith("test:"):
            continue
        label = r.label.rsplit(" bucket group ", 1)[0] if "bucket group" in r.label else r.label
        out.add((r.op, r.reduce_op, r.group_ranks, label))
    return out


def numel_by(
    records: list[Rec], op: str, label_prefix: str, group: tuple[int, ...] | None = None
) -> int:
    """Elements this rank sent in the recorded ``op`` collectives whose label starts with
    ``label_prefix`` (on ``group`` only, if given): the full input of a reduce-scatter, the
    shard of an all-gather."""
    return sum(
        r.numel
        for r in records
        if r.op == op and r.label.startswith(label_prefix) and group in (None, r.group_ranks)
    )


Reduction = tuple[str, str | None, tuple[int, ...], str]


def buffer_reduction(
    run: RankRun, layout: Layout, kind: str, group: tuple[int, ...], params: int, where: str
) -> Reduction:
    """The recorded reduction of DDP's ``kind`` buffer over ``group`` (more than one rank):
    an all-reduce (SUM after the 1/|dp_cp| pre-scale, or unscaled under per-token loss) of
    exactly ``params`` elements, or with the distributed optimizer a reduce-scatter of them
    padded to a multiple of the group size. Returns the record's key."""
    op = "reduce_scatter" if layout.dist_opt else "all_reduce"
    sent = numel_by(run.records, op, f"grad reduce {kind}", group)
    if layout.dist_opt:
        assert sent >= params, (where, kind, sent, params)
        assert sent % len(group) == 0, (where, kind, sent, group)
    else:
        assert sent == params, (where, kind, sent, params)
    return (op, "sum", group, f"grad reduce {kind}")
