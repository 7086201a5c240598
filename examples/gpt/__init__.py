"""A small GPT built only from mc parts, how to train it on any TP × DP (× PP) layout, and
the plain-PyTorch 1-process reference it is compared with.

- :mod:`examples.gpt.config`: :class:`GPTConfig` (sizes), :class:`ParallelLayout` (every
  parallel choice, validated), :class:`OptimizerConfig`.
- :mod:`examples.gpt.model`: :class:`GPT` (VocabParallelEmbedding, Column/Row attention and
  MLP, sequence-parallel layer norms, tied LM head, vocab-parallel cross-entropy).
- :mod:`examples.gpt.weights`: full weights, loading a rank's part, gathering them back.
- :mod:`examples.gpt.train`: build, apply DDP, optimizer, train step.
- :mod:`examples.gpt.reference`: the same GPT in plain PyTorch on one process.
- :mod:`examples.gpt.data`: the embedded text and its deterministic batches.
- :mod:`examples.gpt.pipeline`: the GPT's chunks on :mod:`mc_train`'s pipeline (mc DDP,
  ``torch.distributed.pipelining``'s 1F1B, GPipe and interleaved 1F1B schedules);
  :mod:`examples.gpt.pipeline_demo`: the demo's ``--pp``/``--vpp``/``--schedule`` flags.
- The demo trainer (``examples/train_gpt.py``): :mod:`examples.gpt.cli` (flags),
  :mod:`examples.gpt.loop` (the run, checkpoints through :class:`mc_train.checkpoint.Checkpointer`),
  :mod:`examples.gpt.report` (what it prints and writes); :mod:`examples.gpt.faults` (the
  restart tests' fault injection).
"""

from __future__ import annotations

from examples.gpt.config import GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.data import corpus, decode, dp_rows, encode, global_batch
from examples.gpt.model import GPT
from examples.gpt.reference import ReferenceRun, reference_grads, reference_loss, train_reference
from examples.gpt.train import (
    Trainer,
    apply_ddp,
    build_model,
    build_optimizer,
    final_weights,
    parallelize,
    stage_layers,
    train_step,
)
from examples.gpt.weights import (
    WORD_EMBEDDING,
    full_shapes,
    gather_full_weights,
    init_full_weights,
    load_full_weights,
)

__all__ = [
    "GPT",
    "WORD_EMBEDDING",
    "GPTConfig",
    "OptimizerConfig",
    "ParallelLayout",
    "ReferenceRun",
    "Trainer",
    "apply_ddp",
    "build_model",
    "build_optimizer",
    "corpus",
    "decode",
    "dp_rows",
    "encode",
    "final_weights",
    "full_shapes",
    "gather_full_weights",
    "global_batch",
    "init_full_weights",
    "load_full_weights",
    "parallelize",
    "reference_grads",
    "reference_loss",
    "stage_layers",
    "train_reference",
    "train_step",
]
