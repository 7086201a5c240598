"""Chunks under PyTorch's FSDP2 passed as they are (torchtitan's way: the user called
``fully_shard`` on a ``parallelize``\\ d model).

An FSDP2 module has no ``finish_grad_sync``: FSDP2 reduce-scattered its grads over the
data-parallel mesh in backward, so step 1 has nothing to do for it. Its parameters were
replaced by ``fully_shard`` and lost mc's marks: they are restored from the record
``parallelize`` (or mc's layers, at construction) left on the modules
(:func:`mc_groups.param_attrs.restore_marks`), and a tensor-parallel layer without a record
is an error before any collective (its grads would be reduced as if unmarked), and so is an
expert-parallel param (``allreduce=False``) whose mesh is not ``expt_dp`` (FSDP2 would have
averaged different experts; ``mc_ddp.TorchFullyShardedDataParallel`` puts them there).
Its own ``.config`` is its library's (``transformers``, torchtitan): mc's settings come
from the config ``parallelize`` recorded (:func:`mc_groups.config.recorded_config`). The
mesh of a dense param must not hold another tensor-parallel rank (the reduce-scatter would
have averaged different shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import type_name
from mc_groups.errors import InputStateError, InputValueError

__all__: list[str] = []


def check_chunk(
    index: int, chunk: torch.nn.Module, tp: dist.ProcessGroup, expt_dp: dist.ProcessGroup | None
) -> None:
    """Put the marks back and refuse what FSDP2 cannot reduce right (module notes)."""
    param_attrs.restore_marks(chunk)
    experts = set() if expt_dp is None else set(mg.group_ranks(expt_dp))
    for name, param in chunk.named_parameters():
        if not (param_attrs.is_expert_param(param) and dtensors.is_dtensor(param)):
            continue
        mesh = set(param.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
        if mesh != experts:
            raise InputValueError(
                f"finalize_model_grads: model[{index}]'s param {name} is an expert-parallel "
                f"param (allreduce=False) sharded by fully_shard over ranks {sorted(mesh)}, "
                f"not over the expert data-parallel group (expt_dp, {sorted(experts)}): "
                "FSDP2 averaged different experts; wrap with "
                "mc_ddp.TorchFullyShardedDataParallel (it shards expert params over expt_dp), "
                "or train MoE models under mc_ddp.DistributedDataParallel"
            )
    if mg.group_size(tp) <= 1:
        return
    tp_ranks = set(mg.group_ranks(tp))
    me = dist.get_rank()
    for name, module in chunk.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        if not any(dtensors.is_dtensor(p) for p in own):
            continue
        if isinstance(getattr(module, "tp_group", None), dist.ProcessGroup) and (
            param_attrs.MARK_RECORD not in module.__dict__
        ):
            raise InputStateError(
                f"finalize_model_grads: model[{index}] is under fully_shard, and "
                f"{name or 'its root'} ({type_name(module)}) is a tensor-parallel layer whose "
                "marks mc did not record: "
                "fully_shard replaced its params and their marks are gone; call "
                "mc_groups.param_attrs.record_marks(model) before fully_shard (parallelize does), "
                "or wrap with mc_ddp.TorchFullyShardedDataParallel"
            )
        for param in own:
            if param_attrs.is_expert_param(param):
                continue  # on expt_dp (checked above): its tensor-parallel group is expert tp
            mesh_ranks = set(param.device_mesh.mesh.flatten().tolist())
            if mesh_ranks & tp_ranks != {me}:
                raise InputValueError(
                    f"finalize_model_grads: model[{index}]'s params of {name or 'its root'} are "
                    f"sharded over ranks {sorted(mesh_ranks)}, which hold tensor-parallel peers "
                    f"{sorted((mesh_ranks & tp_ranks) - {me})} of rank {me}: FSDP2 averaged "
                    "grads of different shards; fully_shard over the data-parallel group "
                    "(DeviceMesh.from_group(pg_collection.dp_cp, ...))"
                )
            break  # one mesh per module group


def local_reduction(grad: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """A DTensor grad whose 1-D mesh meets ``group`` only at this rank: every peer of
    ``group`` holds the same slice of the grad (its own copy of the same data-parallel
    shard, the mesh built from mc's aligned data-parallel groups), so the local tensors
    are reduced as they are, with no gather around the collective."""
    if not dtensors.is_dtensor(grad):
        return False
    mesh = grad.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        return False
    return set(mesh.mesh.tolist()) & set(mg.group_ranks(group)) == {dist.get_rank()}
