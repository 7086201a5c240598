"""One training step of a rank's GPT chunks, with its collectives recorded by phase.

The same code runs in the dry run (meta tensors, fake backend) and in a real run (CPU
tensors, gloo): that is what lets a test hold the dry run's collective list to the real
one. The plan of a step, on every rank:

1. ``zero_grad_buffer()`` on every chunk.
2. Per micro-batch, all forwards then all backwards (no 1F1B interleaving: the same
   collectives in another order). A rank holds the pipeline's global chunks
   ``c = v·pp + stage`` (``v < vpp``); chunk ``c > 0`` receives its input from stage
   ``c − 1`` and chunk ``c < last`` sends its output on (``pp`` group); the backward sends
   the input grads back. Micro-batches other than the last run inside every chunk's
   ``no_sync`` (grads reduced once, in the last).
3. ``finalize_model_grads`` over the chunks (DP reduction, SP grads over TP, tied
   embedding over ``embd``, ...).
4. ``ShardedOptimizer.step()`` (AdamW on the fp32 masters of this rank's shard; with
   overlapped param gathers the all-gathers run in the next step's forward pre-hooks).

:func:`record_step` runs the step inside ``mc_groups.record_collectives()`` and tags each
record with its phase: ``forward``, ``backward``, ``finalize`` or ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

import mc_groups as mg
from examples.dry_run.spec import DryRunSpec
from examples.gpt import GPT, load_full_weights, stage_layers
from mc_ddp import DistributedDataParallel, ShardedOptimizer
from mc_finalize import finalize_model_grads
from mc_groups.pipeline_stages import pipeline_rank, pipeline_size

__all__ = [
    "Chunks",
    "PhaseRecord",
    "StageModel",
    "build_stage",
    "forward_only",
    "record_step",
    "run_step",
]

Chunks = list[DistributedDataParallel[mg.ModelParallelConfig]]
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PhaseRecord:
    """A recorded collective and the phase of the step that issued it."""

    phase: str
    record: mg.CollectiveRecord


@dataclass
class StageModel:
    """This rank's part of the model: its chunks (one per virtual stage) in DDP, and the
    optimizer over all of them."""

    spec: DryRunSpec
    pgc: mg.ProcessGroupCollection
    chunks: Chunks
    optimizer: ShardedOptimizer
    device: torch.device

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return pipeline_rank(self.pgc)

    def layers(self) -> list[range]:
        """Global indices of the blocks of each chunk."""
        vpp = self.spec.layout.vpp
        return [
            stage_layers(self.spec.model, self.pgc, None if vpp is None else v, vpp)
            for v in range(vpp or 1)
        ]


def build_stage(
    spec: DryRunSpec,
    pgc: mg.ProcessGroupCollection,
    device: torch.device,
    full: dict[str, torch.Tensor] | None = None,
) -> StageModel:
    """This rank's GPT chunks on ``device`` (``meta``: no memory for weights), each wrapped
    in mc DDP (chunks after the first with one bucket, as Megatron's ``get_model``), and a
    ``ShardedOptimizer`` over AdamW. ``full``: weights to load (a real run); None leaves
    them uninitialised."""
    lay, mp = spec.layout, spec.layout.model_parallel_config()
    chunks: Chunks = []
    for v in range(lay.vpp or 1):
        vp_stage = None if lay.vpp is None else v
        layers = stage_layers(spec.model, pgc, vp_stage, lay.vpp)
        model = GPT(spec.model, mp, pgc, device, layers=layers, vp_stage=vp_stage)
        if full is not None:
            load_full_weights(model, full, pgc.require("tp", "build_stage"))
        chunks.append(
            DistributedDataParallel(
                mp, lay.ddp_config(), model, disable_bucketing=v > 0, pg_collection=pgc
            )
        )
    params = [p for chunk in chunks for p in chunk.parameters()]
    adamw = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    return StageModel(spec, pgc, chunks, ShardedOptimizer(adamw, chunks), device)


def _hidden_shape(spec: DryRunSpec) -> tuple[int, int, int]:
    """``[s/cp (/tp under SP), b, h]``: what one stage hands the next."""
    rows = spec.local_seq_length
    if spec.layout.sequence_parallel:
        rows //= spec.layout.tp
    return rows, spec.micro_batch_size, spec.model.hidden_size


class _Pipeline:
    """The point-to-point plumbing of one rank's chunks (see the module's step 2)."""

    def __init__(self, stage: StageModel) -> None:
        self.stage = stage
        self.pp = stage.pgc.require("pp", "dry run step")
        self.stages = pipeline_size(stage.pgc)
        self.me = stage.stage
        self.last = self.stages * len(stage.chunks) - 1
        self.mine = [c for c in range(self.last + 1) if c % self.stages == self.me]

    def _buffer(self) -> torch.Tensor:
        spec = self.stage.spec
        dtype = spec.layout.params_dtype
        return torch.empty(_hidden_shape(spec), dtype=dtype, device=self.stage.device)

    def forward(self, batch: Batch) -> dict[int, tuple[torch.Tensor | None, torch.Tensor]]:
        """Every chunk's forward in global order; returns ``{c: (input, output)}``."""
        tokens, labels = batch
        m = self.stage.spec.layout.microbatches
        done: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        for c in self.mine:
            hidden = None
            if c > 0:
                hidden = self._buffer()
                src = (self.me - 1) % self.stages
                mg.recv(hidden, self.pp, group_src=src, label=f"activation of chunk {c - 1}")
                hidden.requires_grad_()
            out = self.stage.chunks[c // self.stages](tokens, labels, hidden_states=hidden)
            if c == self.last:
                out = out / m
            else:
                dst = (self.me + 1) % self.stages
                mg.send(out.detach(), self.pp, group_dst=dst, label=f"activation of chunk {c}")
            done[c] = (hidden, out)
        return done

    def backward(self, done: dict[int, tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        """Every chunk's backward in reverse global order."""
        for c in reversed(self.mine):
            hidden, out = done[c]
            if c == self.last:
                torch.autograd.backward(out)
            else:
                grad = torch.empty_like(out)
                src = (self.me + 1) % self.stages
                mg.recv(grad, self.pp, group_src=src, label=f"grad of chunk {c}'s output")
                torch.autograd.backward(out, grad)
            if hidden is not None:
                assert hidden.grad is not None  # the chunk's input took part in its output
                dst = (self.me - 1) % self.stages
                label = f"grad of chunk {c - 1}'s output"
                mg.send(hidden.grad, self.pp, group_dst=dst, label=label)


def forward_only(stage: StageModel, batch: Batch) -> None:
    """The forwards of one micro-batch over the rank's chunks, activations sent on as in a
    step (every rank of the world must call it), the graph then dropped: what the
    activation measurement runs (:mod:`examples.dry_run.activations`)."""
    _Pipeline(stage).forward(batch)


def run_step(
    stage: StageModel,
    batches: list[Batch],
    phase: Callable[[str], AbstractContextManager[object]] | None = None,
) -> torch.Tensor | None:
    """One optimizer step over ``batches`` (one ``(tokens, labels)`` per micro-batch, this
    rank's ``[b, s/cp]`` slice), see the module notes. ``phase(name)`` returns a context
    entered around each phase (:func:`record_step` tags records with it). Returns this
    rank's loss of the step (the mean over its tokens; a 0-dim tensor) on the rank holding
    the last chunk, None elsewhere."""
    enter = phase or (lambda _name: nullcontext())
    for chunk in stage.chunks:
        chunk.zero_grad_buffer()
    pipeline = _Pipeline(stage)
    loss: torch.Tensor | None = None
    for i, batch in enumerate(batches):
        with ExitStack() as no_sync:
            if i < len(batches) - 1:
                for chunk in stage.chunks:
                    no_sync.enter_context(chunk.no_sync())
            with enter("forward"):
                done = pipeline.forward(batch)
            with enter("backward"):
                pipeline.backward(done)
        if pipeline.last in done:
            part = done[pipeline.last][1].detach()
            loss = part if loss is None else loss + part
    with enter("finalize"):
        finalize_model_grads(list(stage.chunks), pg_collection=stage.pgc)
    with enter("optimizer"):
        stage.optimizer.step()
    return loss


@contextmanager
def _tagged(name: str, into: list[PhaseRecord]) -> Iterator[None]:
    with mg.record_collectives() as log:
        yield
    into.extend(PhaseRecord(name, r) for r in log)


def record_step(stage: StageModel, batches: list[Batch]) -> list[PhaseRecord]:
    """:func:`run_step` with every collective recorded and tagged with its phase."""
    records: list[PhaseRecord] = []
    run_step(stage, batches, lambda name: _tagged(name, records))
    return records
