"""What a dry run simulates: the model, the layout, the batch, and the checks that refuse an
impossible combination before any process group exists.

:class:`DryRunSpec` is built from the command line (:func:`examples.dry_run.cli.parse_spec`)
or directly by tests. :meth:`DryRunSpec.check` raises ``ValueError`` naming the flags, their
values and the fix (the command line turns it into exit status 2), in the order a reader
would check them by hand: the world, the dense layout, the expert layout, the pipeline
split, then the model's splits over TP and CP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from examples.gpt import GPTConfig, ParallelLayout
from mc_groups.rank_generator import MAX_WORLD_SIZE

__all__ = ["DTYPES", "DryRunSpec", "llama70b"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
"""``--params-dtype`` choices."""


def llama70b() -> GPTConfig:
    """The 70B-shaped GPT of the issue (Llama-3-70B's sizes): 80 layers, hidden 8192, FFN
    28672 (SwiGLU), 64 heads in 8 query groups, vocabulary 128256, sequence 8192; with
    its tied table, 69.6 billion params."""
    return GPTConfig(
        vocab_size=128256,
        hidden_size=8192,
        num_heads=64,
        num_layers=80,
        seq_length=8192,
        ffn_hidden_size=28672,
        num_query_groups=8,
        gated_mlp=True,
    )


@dataclass(frozen=True)
class DryRunSpec:
    """One dry run: ``model`` split by ``layout`` over ``world_size`` ranks.

    Attributes:
        model: the GPT's sizes.
        layout: every parallel choice; ``layout.dp`` must be ``world_size / (tp ·
            gtp_remat · cp · pp)`` (:meth:`create` derives it), ``layout.microbatches`` is
            the number of micro-batches a step runs.
        world_size: ranks of the simulated world.
        micro_batch_size: sequences per micro-batch and data-parallel rank.
        schedule: the pipeline schedule whose micro-batches in flight the activation
            memory counts (``1f1b``, ``gpipe``, ``interleaved``; None: interleaved with
            ``vpp``, else 1f1b). The dry run's own step runs no schedule.
    """

    model: GPTConfig
    layout: ParallelLayout
    world_size: int
    micro_batch_size: int = 1
    schedule: str | None = None

    @classmethod
    def create(cls, model: GPTConfig, world_size: int, **layout: object) -> DryRunSpec:
        """A spec whose ``layout.dp`` is derived from ``world_size`` (``layout`` holds the
        other :class:`ParallelLayout` fields; ``micro_batch_size`` is taken out of it).
        Raises ``ValueError`` when the sizes do not divide the world (see :meth:`check`)."""
        micro = layout.pop("micro_batch_size", 1)
        schedule = layout.pop("schedule", None)
        base = replace(ParallelLayout(), **layout)  # type: ignore[arg-type]
        _check_world(world_size, base)
        dp = world_size // (base.tp * base.gtp_remat * base.cp * base.pp)
        spec = cls(model, replace(base, dp=dp), world_size, micro, schedule)  # type: ignore[arg-type]
        spec.check()
        return spec

    @property
    def dp(self) -> int:
        """Data-parallel size (ranks with the same model shard and different data)."""
        return self.layout.dp

    @property
    def pipeline_schedule(self) -> str:
        """``schedule``, or its default: interleaved with ``vpp``, else 1f1b."""
        if self.schedule is not None:
            return self.schedule
        return "interleaved" if self.layout.vpp is not None else "1f1b"

    @property
    def local_seq_length(self) -> int:
        """Positions of a sequence on one CP rank (``s / cp``)."""
        return self.model.seq_length // self.layout.cp

    @property
    def global_batch(self) -> int:
        """Sequences per step over the whole world: ``micro_batch_size × microbatches ×
        dp × gtp_remat`` (gtp_remat is a data axis too)."""
        lay = self.layout
        return self.micro_batch_size * lay.microbatches * lay.dp * lay.gtp_remat

    def check(self) -> None:
        """Raise ``ValueError`` (or ``TypeError``) naming the flag when this spec is not a
        valid layout of ``model`` over ``world_size`` ranks; nothing is communicated."""
        lay, cfg = self.layout, self.model
        _check_world(self.world_size, lay)
        if self.world_size != lay.world_size:
            raise ValueError(
                f"--world-size {self.world_size} != tp × gtp_remat × cp × dp × pp = "
                f"{lay.world_size}"
            )
        etp = lay.tp if lay.etp is None else lay.etp
        if self.world_size % (etp * lay.ep * lay.pp):
            raise ValueError(
                f"--world-size {self.world_size} is not divisible by --etp {etp} × --ep "
                f"{lay.ep} × --pp {lay.pp} = {etp * lay.ep * lay.pp}; the expert layout must "
                "tile the world too: choose --ep/--etp whose product with --pp divides it"
            )
        _check_pipeline(cfg, lay)
        _check_schedule(self.schedule, lay)
        _check_tensor_split(cfg, lay)
        if self.micro_batch_size < 1 or lay.microbatches < 1:
            raise ValueError(
                f"--micro-batch-size {self.micro_batch_size} and --num-microbatches "
                f"{lay.microbatches} must both be >= 1"
            )
        if lay.bucket_size is not None and lay.bucket_size < 1:
            raise ValueError(f"--bucket-size {lay.bucket_size} must be >= 1")
        lay.check(cfg, self.world_size, self.global_batch)  # with mc_groups.validate_sizes


def _check_world(world_size: int, lay: ParallelLayout) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"--world-size {world_size!r} must be an int")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"--world-size {world_size} must be in [1, {MAX_WORLD_SIZE}]")
    for flag, value in (
        ("--tp", lay.tp),
        ("--pp", lay.pp),
        ("--cp", lay.cp),
        ("--ep", lay.ep),
        ("--gtp-remat", lay.gtp_remat),
    ):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    for flag, optional in (("--etp", lay.etp), ("--vpp", lay.vpp)):
        if optional is not None and optional < 1:
            raise ValueError(f"{flag} {optional} must be >= 1 (or left out)")
    model_parallel = lay.tp * lay.gtp_remat * lay.cp * lay.pp
    if world_size % model_parallel:
        raise ValueError(
            f"--world-size {world_size} is not divisible by --tp {lay.tp} × --gtp-remat "
            f"{lay.gtp_remat} × --cp {lay.cp} × --pp {lay.pp} = {model_parallel}; the "
            "data-parallel size is the world divided by that product: choose sizes whose "
            f"product divides {world_size}"
        )


def _check_pipeline(cfg: GPTConfig, lay: ParallelLayout) -> None:
    if lay.vpp is not None and lay.pp == 1:
        raise ValueError(
            f"--vpp {lay.vpp} needs --pp > 1: virtual chunks interleave pipeline stages"
        )
    chunks = lay.pp * (lay.vpp or 1)
    if cfg.num_layers % chunks:
        shown = f"--pp {lay.pp}" + (f" × --vpp {lay.vpp}" if lay.vpp else "")
        raise ValueError(
            f"--num-layers {cfg.num_layers} is not divisible by {shown} = {chunks}; every "
            "pipeline chunk holds the same number of layers"
        )


def _check_schedule(schedule: str | None, lay: ParallelLayout) -> None:
    if schedule is None:
        return
    if schedule not in ("1f1b", "gpipe", "interleaved"):
        raise ValueError(f"--schedule {schedule!r} must be one of 1f1b, gpipe, interleaved")
    if (schedule == "interleaved") != (lay.vpp is not None):
        raise ValueError(
            f"--schedule {schedule} with --vpp {lay.vpp}: the interleaved schedule runs "
            "--vpp chunks per stage, the others one; pass both or neither"
        )


def _check_tensor_split(cfg: GPTConfig, lay: ParallelLayout) -> None:
    splits = [
        ("--num-heads", cfg.num_heads),
        ("--num-query-groups", cfg.query_groups),
        ("--hidden-size", cfg.hidden_size),
        ("--ffn-hidden-size", cfg.ffn_size),
        ("--vocab-size", cfg.vocab_size),
    ]
    for flag, value in splits:
        if value % lay.tp:
            raise ValueError(
                f"{flag} {value} is not divisible by --tp {lay.tp}; tensor parallelism splits "
                f"it evenly over the TP ranks: choose a multiple of {lay.tp} or a --tp that "
                f"divides {value}"
            )
    if cfg.seq_length % lay.cp:
        raise ValueError(
            f"--seq-length {cfg.seq_length} is not divisible by --cp {lay.cp}; every CP rank "
            "holds the same number of positions"
        )
    if lay.sequence_parallel and lay.tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1; pass --no-sequence-parallel")
    local = cfg.seq_length // lay.cp
    if lay.sequence_parallel and local % lay.tp:
        raise ValueError(
            f"--seq-length {cfg.seq_length} / --cp {lay.cp} = {local} positions per CP rank "
            f"are not divisible by --tp {lay.tp} (sequence parallelism splits them over TP)"
        )
