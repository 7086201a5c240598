"""The demo trainer's run: agree on a checkpoint, build the trainer, train, save, report.

Checkpoints go through :class:`mc_train.checkpoint.Checkpointer` (docs/checkpoint.md): the
ranks agree on what ``--resume`` names before anything is built or printed (a bad checkpoint is one
``ResumeError`` on every rank), the trainer's chunks and optimizer are loaded at this run's
layout, and ``--save-dir`` receives ``step-N`` every ``--save-every`` steps and after the
last, holding the loss history (``trainer.json``'s state) so ``metrics.json`` of a resumed
run starts at step 1. The demo's fault hooks (:mod:`examples.gpt.faults`) strike around the
saves for the restart tests and ``scripts/chaos.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import faults
from examples.gpt.cli import SEED, DemoRun, device_for
from examples.gpt.pipeline import PipelineTrainer
from examples.gpt.pipeline_demo import pipeline_trainer
from examples.gpt.report import DemoResult, Progress, header, parity, summary, write_outputs
from examples.gpt.train import Trainer, parallelize, train_step
from examples.gpt.weights import init_full_weights
from mc_train.checkpoint import Checkpointer, Found, Resumed, ResumeError, find_checkpoint

__all__ = ["run"]


def _find(demo: DemoRun, pgc: mg.ProcessGroupCollection) -> Found:
    """What every rank resumes from (collective): ``ResumeError`` on every rank when the
    checkpoint cannot be resumed, before anything is built or written."""
    if demo.resume is None:
        return Found(None, 0)
    world = pgc.require("world", "resume")
    found = find_checkpoint(demo.resume, demo.save_dir, run=demo.run_settings(), group=world)
    if found.step > demo.steps:
        raise ResumeError(
            f"checkpoint {found.path} is at step {found.step}, past --steps {demo.steps}; "
            f"pass --steps >= {found.step}"
        )
    return found


def _trainer(
    demo: DemoRun, pgc: mg.ProcessGroupCollection, full: dict[str, torch.Tensor], device: Any
) -> tuple[Trainer | PipelineTrainer, Callable[[torch.Tensor], float]]:
    """This rank's trainer and its step: :mod:`examples.gpt.pipeline_demo` under ``--pp``."""
    if demo.layout.pp > 1:
        return pipeline_trainer(
            *(demo.model, demo.layout, demo.optimizer, pgc, full, device),
            schedule=demo.schedule,
            global_batch=demo.global_batch,
        )
    trainer = parallelize(demo.model, demo.layout, demo.optimizer, pgc, full, device)
    return trainer, lambda tokens: train_step(trainer, tokens)


def _checkpointer(
    demo: DemoRun, trainer: Trainer | PipelineTrainer, pgc: mg.ProcessGroupCollection
) -> Checkpointer:
    chunks = trainer.chunks if isinstance(trainer, PipelineTrainer) else [trainer.model]
    return Checkpointer(
        demo.save_dir,
        chunks,
        trainer.optimizer,
        pg_collection=pgc,
        interval=demo.save_every,
        run=demo.run_settings(),
    )


def _losses(resumed: Resumed) -> list[float]:
    """The loss history of the checkpoint (``trainer.json``'s state)."""
    losses = resumed.state.get("losses")
    if resumed.path is None:
        return []
    if not isinstance(losses, list) or len(losses) != resumed.step:
        raise ResumeError(
            f"checkpoint {resumed.path} holds no loss history of its {resumed.step} steps "
            "(trainer.json: state.losses); it was not saved by this trainer"
        )
    return [float(x) for x in losses]


def _start(resumed: Resumed, out: TextIO) -> list[float]:
    """The losses so far, after rank 0 said what was passed over and what was resumed."""
    if dist.get_rank() == 0:
        for name in sorted({*resumed.ignored, *resumed.removed}):
            gone = " (removed: an interrupted save)" if name in resumed.removed else ""
            out.write(f"ignored {name}: incomplete, never loaded{gone}\n")
        for damage in resumed.damaged:  # kept on disk for a look; a later save replaces it
            out.write(f"ignored {damage}; falling back to an older checkpoint\n")
        if resumed.path is not None:
            out.write(f"resumed from {resumed.path} at step {resumed.step}\n")
    return _losses(resumed)


def _train(demo: DemoRun, pgc: mg.ProcessGroupCollection, out: TextIO, found: Found) -> DemoResult:
    full = init_full_weights(demo.model, SEED)
    trainer, train = _trainer(demo, pgc, full, device_for(demo.backend))
    ckpt = _checkpointer(demo, trainer, pgc)
    resumed = ckpt.load(found)
    losses = _start(resumed, out)
    first, rank = len(losses), dist.get_rank()
    faults.note_start(rank, first, resumed.damaged)
    progress = Progress(demo.steps, out)
    tokens_per_step = demo.global_batch * demo.model.seq_length
    saved: list[str] = []
    norms: list[float] = []
    start = time.perf_counter()
    for step in range(first, demo.steps):
        losses.append(train(demo.batch(step)))
        norm = None if trainer.last_step is None else trainer.last_step.grad_norm
        if norm is not None:
            norms.append(norm)
        elapsed = time.perf_counter() - start
        if rank == 0:
            speed = tokens_per_step * (step + 1 - first) / elapsed
            progress.update(step, losses[-1], speed, norm)
        faults.after_step(rank, step + 1)
        if demo.save_dir is not None:
            hook = faults.during_save(rank, step + 1)  # the restart tests' and chaos runs'
            last = step + 1 == demo.steps
            folder = ckpt.save(step + 1, state={"losses": losses}, last=last, after_write=hook)
            if folder is not None:
                faults.after_save(rank, step + 1, folder)
                saved.append(str(folder))
    seconds = time.perf_counter() - start
    trained = demo.steps - first
    result = DemoResult(losses, tokens_per_step * trained / seconds if trained else 0.0, seconds)
    result.resumed_from = None if resumed.path is None else str(resumed.path)
    result.resumed_step, result.checkpoints = first, saved
    result.grad_norms = norms if first == 0 else []  # a resumed run's norms start mid-way
    return result


def run(demo: DemoRun, out: TextIO = sys.stdout) -> DemoResult:
    """Train on the already initialised world; rank 0 reports to ``out`` and writes the
    outputs. Collective: every rank calls it.

    With ``demo.resume``, the ranks first agree on the checkpoint (``ResumeError`` on every
    rank, before anything is built or written, when it cannot be resumed); the losses of
    the result then start at step 1 (the checkpoint's history), and training at its step.
    """
    pgc = demo.layout.initialize_groups()
    peer_lost = False
    try:
        found = _find(demo, pgc)
        header(demo, pgc, out)
        result = _train(demo, pgc, out, found)
    except mg.CollectiveError:
        peer_lost = True  # dead or hung: destroy's world barrier would wait for it again
        raise
    finally:
        if not peer_lost:
            mg.destroy_model_parallel(pgc)
    # After the last collective: the other ranks do not wait (within --timeout) for the
    # parity run and the plot.
    if dist.get_rank() == 0:
        parity(demo, result)
        folder = write_outputs(demo, result)
        result.output = str(folder)
        summary(demo, result, folder, out)
    return result
