"""What one rank holds and moves per step, read off mc's own objects after a recorded step.

Nothing here is estimated: the param and grad bytes are the sizes of the DDP buffers mc
allocated (on the meta device in a dry run, so they cost no memory), the buckets are the
buffers' buckets, the optimizer state is what ``ShardedOptimizer`` and AdamW hold after a
step, and the collectives are ``mc_groups.record_collectives()``'s records. The closed-form
formula these numbers obey is in ``docs/dry_run.md`` (and checked against them by
``integration_tests/test_dry_run.py``).

Memory terms (bytes, this rank, every model chunk):

- ``param_buffer``: the distributed optimizer's flat param buffers (the params are views
  into them), padding included; 0 without the distributed optimizer, where ``params``
  (the params' own tensors) hold the weights instead.
- ``grad_buffer``: the flat ``main_grad`` buffers, padding included.
- ``master_params``: fp32 copies of the param elements this rank steps (0 for fp32 params,
  whose master is the param itself).
- ``adam_moments``: AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, one each per stepped
  element).
- ``master_grads``: fp32 copies of the stepped elements' grads (0 when grads are fp32: the
  master's grad is then a view of the grad buffer).
- ``step_counters``: AdamW's ``step``, one fp32 scalar per stepped param slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import mc_groups as mg
from examples.dry_run.activations import ActivationInfo
from examples.dry_run.step import PhaseRecord, StageModel
from mc_buffers import ParamAndGradBuffer

__all__ = [
    "BucketInfo",
    "ChunkInfo",
    "CollectiveInfo",
    "MemoryInfo",
    "ParamInfo",
    "RankReport",
    "describe_rank",
    "group_names",
]

PHASES = ("forward", "backward", "finalize", "optimizer")

# Which name a group gets when several roles share it (e.g. dp, dp_cp and intra_dp_cp
# without context parallelism): the most specific first.
_NAME_ORDER = (
    "tp",
    "cp",
    "pp",
    "embd",
    "pos_embd",
    "dp",
    "dp_cp",
    "intra_dp_cp",
    "inter_dist_opt",
    "gtp_remat",
    "dp_cp_gtp_remat",
    "tp_cp",
    "mp",
    "tp_dp_cp",
)


def _dtype(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def group_names(pgc: mg.ProcessGroupCollection) -> dict[tuple[int, ...], str]:
    """Each of this rank's groups (by its global ranks) and the role name it is shown
    under (see ``_NAME_ORDER``; other roles in collection order)."""
    ranks = {name: tuple(mg.group_ranks(group)) for name, group in pgc.items()}
    order = [n for n in _NAME_ORDER if n in ranks] + [n for n in ranks if n not in _NAME_ORDER]
    names: dict[tuple[int, ...], str] = {}
    for name in order:
        names.setdefault(ranks[name], name)
    return names


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of this rank's model chunk."""

    chunk: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int


@dataclass(frozen=True)
class BucketInfo:
    """One bucket of a DDP buffer (``numel`` includes its padding; each DP rank's shard is
    ``numel / dp`` elements)."""

    chunk: int
    buffer: str
    index: int
    params: int
    numel: int
    numel_unpadded: int
    shard_numel: int
    grad_bytes: int
    param_bytes: int
    group: str


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes this rank holds for its params, grads and optimizer (see the module notes)."""

    param_elements: int
    params: int
    param_buffer: int
    grad_buffer: int
    master_params: int
    adam_moments: int
    master_grads: int
    step_counters: int
    stepped_elements: int

    @property
    def total(self) -> int:
        """Every byte above once: the param buffer replaces the params when there is one."""
        weights = self.param_buffer if self.param_buffer else self.params
        optimizer = self.master_params + self.adam_moments + self.master_grads
        return weights + self.grad_buffer + optimizer + self.step_counters


@dataclass(frozen=True)
class CollectiveInfo:
    """One collective of the recorded step, as this rank issued it."""

    phase: str
    op: str
    reduce_op: str | None
    group: str
    group_size: int
    dtype: str
    numel: int
    bytes: int
    async_op: bool
    coalesced: bool
    label: str


@dataclass(frozen=True)
class ChunkInfo:
    """One model chunk of this rank (one per virtual pipeline stage): its blocks (global
    indices, first and last) and whether it holds the embedding and the final norm with
    the LM head."""

    blocks: tuple[int, int]
    embedding: bool
    output_layer: bool

    def describe(self) -> str:
        """E.g. ``embedding + blocks 0-9``."""
        first, last = self.blocks
        parts = ["embedding"] if self.embedding else []
        parts.append(f"blocks {first}-{last}" if last > first else f"block {first}")
        if self.output_layer:
            parts.append("final norm + LM head")
        return " + ".join(parts)


@dataclass
class RankReport:
    """Everything the dry run says about one rank (``groups``: every role of its
    ``ProcessGroupCollection`` and the global ranks of its group)."""

    rank: int
    stage: int
    coordinates: dict[str, int]
    chunks: list[ChunkInfo]
    groups: dict[str, list[int]]
    memory: MemoryInfo
    params: list[ParamInfo] = field(default_factory=list)
    buckets: list[BucketInfo] = field(default_factory=list)
    collectives: list[CollectiveInfo] = field(default_factory=list)
    activations: ActivationInfo | None = None

    @property
    def total_with_activations(self) -> int:
        """Params, grads, optimizer state and the activations' peak (bytes)."""
        peak = 0 if self.activations is None else self.activations.peak
        return self.memory.total + peak

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (memory with its total; activations with the per-micro-batch
        sum and the peak; every list in full)."""
        out = asdict(self)
        out["memory"]["total"] = self.memory.total
        if self.activations is not None:
            out["activations"]["per_microbatch"] = self.activations.per_microbatch
            out["activations"]["peak"] = self.activations.peak
            out["memory"]["total_with_activations"] = self.total_with_activations
        out["collective_totals"] = [asdict(t) for t in collective_totals(self.collectives)]
        return out


@dataclass(frozen=True)
class CollectiveTotal:
    """Collectives of one kind in the step: how many, and the bytes this rank sends."""

    phase: str
    op: str
    group: str
    group_size: int
    dtype: str
    numel: int
    count: int
    bytes: int


def collective_totals(collectives: Iterable[CollectiveInfo]) -> list[CollectiveTotal]:
    """The collectives grouped by (phase, op, group, dtype, numel), in first-issue order."""
    seen: dict[tuple[str, str, str, str, int], list[CollectiveInfo]] = {}
    for c in collectives:
        seen.setdefault((c.phase, c.op, c.group, c.dtype, c.numel), []).append(c)
    return [
        CollectiveTotal(
            k[0], k[1], k[2], v[0].group_size, k[3], k[4], len(v), sum(c.bytes for c in v)
        )
        for k, v in seen.items()
    ]


def _buffers(stage: StageModel) -> Iterable[tuple[int, ParamAndGradBuffer]]:
    for i, chunk in enumerate(stage.chunks):
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            yield i, buffer


def _memory(stage: StageModel) -> MemoryInfo:
    params = [p for chunk in stage.chunks for p in chunk.module.parameters()]
    param_buffer = grad_buffer = 0
    for _, buffer in _buffers(stage):
        grad_buffer += buffer.grad_data.numel() * buffer.grad_data.element_size()
        if buffer.param_data is not None:
            param_buffer += buffer.param_data.numel() * buffer.param_data.element_size()
    masters = moments = master_grads = steps = stepped = 0
    for slot in stage.optimizer.owned_slices:
        n = slot.end - slot.start
        stepped += n
        if not slot.aliased:
            masters += n * slot.master.element_size()
        if slot.param.main_grad.dtype != torch.float32:  # type: ignore[attr-defined]
            master_grads += n * 4  # step() copies the grad slice to fp32
        state = stage.optimizer.optimizer.state.get(slot.master, {})
        for key in ("exp_avg", "exp_avg_sq"):
            moments += state[key].numel() * state[key].element_size() if key in state else 0
        if "step" in state:
            steps += state["step"].numel() * state["step"].element_size()
    return MemoryInfo(
        param_elements=sum(p.numel() for p in params),
        params=sum(p.numel() * p.element_size() for p in params),
        param_buffer=param_buffer,
        grad_buffer=grad_buffer,
        master_params=masters,
        adam_moments=moments,
        master_grads=master_grads,
        step_counters=steps,
        stepped_elements=stepped,
    )


def _buckets(stage: StageModel) -> list[BucketInfo]:
    # DDP reduces dense buckets over intra_dp_cp: dp × cp ranks (one optimizer instance).
    reduce_group = "dp" if stage.spec.layout.cp == 1 else "dp_cp"
    out = []
    for i, chunk in enumerate(stage.chunks):
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            shards = group.shard.size if chunk.ddp_config.use_distributed_optimizer else 1
            for bucket in group.buckets:
                numel = bucket.grad_data.numel()
                param = bucket.param_data
                out.append(
                    BucketInfo(
                        chunk=i,
                        buffer=f"{_dtype(_param_dtype(bucket))} params / "
                        f"{_dtype(bucket.grad_data.dtype)} grads",
                        index=bucket.bucket_id,
                        params=len(bucket.params_list),
                        numel=numel,
                        numel_unpadded=bucket.numel_unpadded,
                        shard_numel=numel // shards,
                        grad_bytes=numel * bucket.grad_data.element_size(),
                        param_bytes=0 if param is None else numel * param.element_size(),
                        group=reduce_group,
                    )
                )
    return out


def _param_dtype(bucket: Any) -> torch.dtype:
    """The dtype of a bucket's params."""
    return bucket.params_list[0].dtype  # type: ignore[no-any-return]


def _collectives(
    records: list[PhaseRecord], names: dict[tuple[int, ...], str]
) -> list[CollectiveInfo]:
    return [
        CollectiveInfo(
            phase=pr.phase,
            op=r.op,
            reduce_op=r.reduce_op,
            group=names.get(r.group_ranks, "?"),
            group_size=len(r.group_ranks),
            dtype=_dtype(r.dtype),
            numel=r.numel,
            bytes=r.bytes,
            async_op=r.async_op,
            coalesced=r.coalesced,
            label=r.label,
        )
        for pr in records
        for r in [pr.record]
    ]


def describe_rank(
    stage: StageModel, records: list[PhaseRecord], activations: ActivationInfo | None = None
) -> RankReport:
    """The report of this rank after ``records`` (one recorded step) ran on ``stage``
    (``activations``: what :mod:`examples.dry_run.activations` measured)."""
    pgc = stage.pgc
    names = group_names(pgc)
    coordinates = {
        role: mg.group_rank(group)
        for role in ("tp", "cp", "dp", "pp", "gtp_remat", "ep")
        for group in [pgc.require(role, "dry run report")]
    }
    params = [
        ParamInfo(i, name, tuple(p.shape), _dtype(p.dtype), p.numel())
        for i, chunk in enumerate(stage.chunks)
        for name, p in chunk.module.named_parameters()
    ]
    chunks = [
        ChunkInfo((r.start, r.stop - 1), bool(m.pre_process), bool(m.post_process))
        for r, chunk in zip(stage.layers(), stage.chunks, strict=True)
        for m in [chunk.module]
    ]
    return RankReport(
        rank=torch.distributed.get_rank(),
        stage=stage.stage,
        coordinates=coordinates,
        chunks=chunks,
        groups={name: list(mg.group_ranks(group)) for name, group in pgc.items()},
        memory=_memory(stage),
        params=params,
        buckets=_buckets(stage),
        collectives=_collectives(records, names),
        activations=activations,
    )
