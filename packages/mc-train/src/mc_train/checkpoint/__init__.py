r"""Resumable checkpoints for any model whose params carry mc's attributes (mc's layers,
``parallelize``\ d models, plain replicated modules), at any TP × PP × DP layout.

::

    ckpt = Checkpointer("ckpt", pipe.chunks, optimizer, pg_collection=pgc,
                        interval=50, keep=3, run={"model": ..., "lr": ...})
    start = ckpt.load("auto").step                 # 0 when there is nothing to resume
    for step in range(start, steps):
        ...                                        # train step ``step + 1``
        ckpt.save(step + 1, state={"losses": losses}, last=step + 1 == steps)

A checkpoint folder holds one folder per checkpoint::

    step-00000020/               published, hence complete
        .metadata, __R_0.distcp      model and optimizer, every rank's part (DCP)
        rng/rank-00000.pt ...        each rank's RNG states (Python, torch CPU, its CUDA
                                     device, a tracker's streams)
        trainer.json                 RunState: step, run settings, your state, layout
        COMPLETE                     written last: size and SHA-256 of every other file
    .step-00000030.partial/      being written, or left by a crash: never loaded

**Saving** step N (:meth:`Checkpointer.save`, collective over the world): rank 0 empties
``.step-N.partial``; every rank writes its DCP part and its RNG file there; the ranks agree
that all of them finished (a rank that failed stops the others with
:class:`CheckpointWriteError`; one that died leaves them failing in this collective), so
nothing is published unless every part is on disk; rank 0 writes ``trainer.json`` and
``COMPLETE`` (each fsynced), renames the folder to ``step-N`` (atomic within one file
system), fsyncs the parent and deletes the published checkpoints beyond the newest ``keep``;
the ranks agree it is published. A ``step-N`` folder is complete whenever a crash comes, and
``COMPLETE`` also catches files truncated or changed later.

**Resuming** (:func:`find_checkpoint`, then :meth:`Checkpointer.load`): every rank inspects
the folder on its own (``"auto"``: the newest ``step-N`` with its ``COMPLETE`` whose files
all still match it, passing over and naming damaged ones; a path: that checkpoint, an error
naming the damaged file and the rank that wrote it), checks the run's settings against
``trainer.json``, and the ranks exchange their verdicts, so every rank gets the same answer
(this checkpoint, none, or one :class:`ResumeError`) before anything is loaded. Then rank 0
removes leftovers of interrupted saves, the model and optimizer state load through DCP at
this run's layout, and each rank's RNG states are restored when the world size is the saved
one (rank r gets rank r's).

**The state dict** (:func:`save_state`, :func:`load_state`)::

    model.<param name>               a tensor-parallel param as a DTensor over its TP group
                                     (full shape in the file), any other as a plain tensor;
                                     under FSDP2 a DTensor over (tp, dp)
                                     (:func:`model_sharded_state_dict`)
    optimizer.<param name>.<state>   ShardedOptimizer.sharded_state_dict(): fp32 masters and
                                     the optimizer's state as pieces of full-shaped tensors
                                     (under FSDP2, the torch optimizer's own state in the
                                     same keys: mc_ddp.optimizer_sharded_state_dict)
    optimizer.param_groups.<i>.<hp>  the hyperparameters

Both halves are stored at full-parameter shape under the whole model's parameter names
(:func:`mc_train.split_model` keeps them; a Megatron-style stage names its blocks by global
index), so DCP reshards them to whatever TP size, DP size, bucket size, optimizer sharding,
pipeline split and data-parallel wrapper (mc DDP with ``ShardedOptimizer``, or FSDP2 with a
``torch.optim`` optimizer over its params) loads them. One weight, one key: a weight held
twice on a rank (a tied embedding on one stage) is written once, under its first name; a
weight copied across pipeline stages (both copies marked ``shared_embedding``) is written by
the first stage only, under its name there, since two stages writing one key in different
slices (their distributed-optimizer shards differ) would overlap in DCP's plan; the other
copies load from that key, model and optimizer state alike (the ranks learn the name once:
one all-gather of the marked names over ``pp``).
"""

from __future__ import annotations

from mc_train.checkpoint._checkpointer import Checkpointer, CheckpointWriteError, Resumed
from mc_train.checkpoint._folders import COMPLETE
from mc_train.checkpoint._resume import (
    Found,
    ResumeError,
    agree_on_checkpoint,
    find_checkpoint,
    inspect_checkpoint,
)
from mc_train.checkpoint._rng import RNGTracker
from mc_train.checkpoint._run_state import STATE_FILE, RunState
from mc_train.checkpoint._state import load_state, model_sharded_state_dict, save_state

__all__ = [
    "COMPLETE",
    "STATE_FILE",
    "CheckpointWriteError",
    "Checkpointer",
    "Found",
    "RNGTracker",
    "ResumeError",
    "Resumed",
    "RunState",
    "agree_on_checkpoint",
    "find_checkpoint",
    "inspect_checkpoint",
    "load_state",
    "model_sharded_state_dict",
    "save_state",
]
