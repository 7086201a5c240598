"""Saving and resuming training of the GPT with ``torch.distributed.checkpoint`` (DCP), at
the same or another layout.

One flat state dict, written by every rank together::

    model.<param name>               the mc layers' sharded_state_dict(): TP-split weights as
                                     DTensors over the TP group (full shape in the file);
                                     other params (layer norms, position table) as tensors
    optimizer.<param name>.<state>   ShardedOptimizer.sharded_state_dict(): fp32 masters,
                                     AdamW's exp_avg / exp_avg_sq as pieces of full-shaped
                                     tensors (the flat slices this rank steps), step
    optimizer.param_groups.<i>.<hp>  the hyperparameters

Both halves are stored at full-parameter shape, so DCP reshards them to whatever TP size,
DP size, bucket size and optimizer sharding loads them.

Pipeline stages (:class:`~examples.gpt.pipeline.PipelineTrainer`) write the params of their
chunks under the same names (blocks keep their global index), so a checkpoint does not
record the pipeline layout either: saved at TP=2 × PP=2, it resumes at TP=1 × PP=1 × DP=4
and back. The last stage's copy of the tied table (``output_layer.weight``, equal to the
first stage's after every step) is not written: two stages writing one key in different
slices (their distributed-optimizer shards differ) would overlap in DCP's plan; it is
loaded from the table's key (``embedding.word_embeddings.weight``), model and optimizer
state alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import mc_tp_layers as tpl
from examples.gpt.pipeline import PipelineTrainer
from examples.gpt.train import Trainer
from examples.gpt.weights import WORD_EMBEDDING
from mc_ddp import ensure_params_ready

__all__ = ["load_checkpoint", "model_sharded_state_dict", "save_checkpoint"]

_TP_LAYERS = (tpl.ColumnParallelLinear, tpl.RowParallelLinear, tpl.VocabParallelEmbedding)


def model_sharded_state_dict(model: nn.Module, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """``{prefix + param name: DTensor or tensor}``: views of ``model``'s params (the mc
    layers' own ``sharded_state_dict``, plain tensors for every other module's params).
    No communication."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        own = f"{prefix}{name}." if name else prefix
        if isinstance(module, _TP_LAYERS):
            out.update(module.sharded_state_dict(prefix=own))
        else:
            for pname, param in module.named_parameters(recurse=False):
                out[own + pname] = param.detach()
    return out


_TIED_COPY = "model.output_layer.weight"


def _modules(trainer: Trainer | PipelineTrainer) -> list[nn.Module]:
    if isinstance(trainer, PipelineTrainer):
        return [chunk.module for chunk in trainer.chunks]
    return [trainer.model.module]


def _state(trainer: Trainer | PipelineTrainer, *, is_loading: bool) -> dict[str, Any]:
    model_sd: dict[str, torch.Tensor] = {}
    for module in _modules(trainer):
        # An overlapped param all-gather may still be due (save: the params must be whole)
        # or in flight (load: it would overwrite what the load writes).
        ensure_params_ready(list(module.parameters()))
        model_sd |= model_sharded_state_dict(module)
    tied = model_sd.pop(_TIED_COPY, None)
    if tied is not None and is_loading:
        model_sd["model." + WORD_EMBEDDING] = tied
    elif tied is not None:
        # The optimizer finds every param it steps by key; its state of the copy is dropped.
        full = {**model_sd, _TIED_COPY: tied}
        state = trainer.optimizer.sharded_state_dict(full, is_loading=False)
        copy = f"optimizer.{_TIED_COPY}."
        return {**model_sd, **{k: v for k, v in state.items() if not k.startswith(copy)}}
    return {**model_sd, **trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_checkpoint(trainer: Trainer | PipelineTrainer, path: str) -> None:
    """Write the model and optimizer state of every rank to the folder ``path`` (collective
    over the world, through DCP's own coordination)."""
    dcp_save(_state(trainer, is_loading=False), checkpoint_id=path)


def load_checkpoint(trainer: Trainer | PipelineTrainer, path: str) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` at any layout into ``trainer``
    (collective over the world): params and optimizer state in place, then the masters
    are written into the params and, with the distributed optimizer, all-gathered."""
    state = _state(trainer, is_loading=True)
    dcp_load(state, checkpoint_id=path)
    trainer.optimizer.load_sharded_state_dict(state)
