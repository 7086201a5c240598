r"""Sharded state dicts for ``torch.distributed.checkpoint`` (DCP).

A layer's ``sharded_state_dict()`` maps each parameter name to a tensor DCP can save from
and load into in place:

- a tensor-parallel shard (``tensor_model_parallel``) becomes a ``DTensor`` on a 1-D
  device mesh over the TP group, sharded along ``partition_dim``; a checkpoint written at
  one TP size loads at any other (DCP reads the overlapping chunks);
- a strided shard (``partition_stride`` k > 1, e.g. a fused QKV weight) is stored as its
  ``[.., k, d/k, ..]`` view sharded along the second of the two: rank r holds blocks
  ``r, r + W, …`` of ``d``, which is exactly column r of that view, so the checkpoint
  layout does not depend on W (it depends on k, which belongs to the model);
- a replicated parameter stays a plain tensor (DCP writes one copy and reads it
  everywhere).

The DTensors are views of the parameters: ``dcp.load`` writes straight into them::

    sd = layer.sharded_state_dict(prefix="fc1.")
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)      # at TP = 2
    ...
    torch.distributed.checkpoint.load(other.sharded_state_dict(prefix="fc1."),
                                      checkpoint_id=path)            # at TP = 1 or 4

DCP coordinates its ranks itself (over the default group unless given one), outside
mc_groups' recorder. GTP (gtp_remat) shards and Megatron's ``sharded_offsets`` are not
supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["sharded_state_dict_of", "tp_sharded_tensor"]


def _strided_view(t: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    shape = list(t.shape)
    return t.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1 :])


def tp_sharded_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup, partition_dim: int, stride: int = 1
) -> torch.Tensor:
    """``tensor`` (this rank's TP shard) as a DTensor sharded along ``partition_dim``.

    With ``stride`` k > 1 the DTensor is the ``[.., k, d/k, ..]`` view (see the module
    notes). A group of one rank holds the whole tensor: it is returned as a plain tensor
    (in the same strided view).
    """
    local = tensor.detach()
    dim = partition_dim % local.dim()
    if stride > 1:
        local, dim = _strided_view(local, dim, stride), dim + 1
    if tp_group.size() == 1:
        return local
    shape = list(local.shape)
    shape[dim] *= int(tp_group.size())
    global_shape = torch.Size(shape)
    mesh = DeviceMesh.from_group(tp_group, local.device.type)
    return DTensor.from_local(
        local,
        mesh,
        [Shard(dim)],
        run_check=False,
        shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )


def _checked(module: torch.nn.Module, sharded_offsets: Any, metadata: Any) -> None:
    del metadata  # Megatron's metadata only selects its own checkpoint formats
    if tuple(sharded_offsets):
        raise NotImplementedError(
            f"sharded_offsets={sharded_offsets!r}: mc's DCP state dicts key every tensor by "
            "its name only; prepend no offsets (give stacked layers distinct prefixes)"
        )
    for name, param in module.named_parameters(recurse=False):
        if getattr(param, "is_gtp_weight_remat", False):
            raise NotImplementedError(
                f"{type(module).__name__}.{name} is a gtp_remat shard; sharded_state_dict "
                "supports gtp_remat_size=1 only"
            )


def sharded_state_dict_of(
    module: torch.nn.Module,
    tp_group: dist.ProcessGroup,
    prefix: str = "",
    sharded_offsets: tuple[tuple[int, int, int], ...] = (),
    metadata: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """``{prefix + name: DTensor or tensor}`` for ``module``'s own parameters (see notes)."""
    _checked(module, sharded_offsets, metadata)
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(recurse=False):
        if getattr(param, "tensor_model_parallel", False):
            out[prefix + name] = tp_sharded_tensor(
                param,
                tp_group,
                int(param.partition_dim),  # type: ignore[attr-defined]
                int(param.partition_stride),  # type: ignore[attr-defined]
            )
        else:
            out[prefix + name] = param.detach()
    return out
