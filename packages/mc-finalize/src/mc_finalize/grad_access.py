"""Where a param's grad lives, and DTensor grads as plain tensors around a collective.

A grad is ``param.main_grad`` when the param has that attribute (the DDP buffer view,
possibly fp32) and ``param.grad`` otherwise.

A DTensor grad (torch FSDP2) is unsharded before a finalize collective and resharded after:

    _unshard_if_dtensor:  local shards ──all_gather per Shard mesh dim──▶ full tensor
    _reshard_if_dtensor:  full tensor ──keep this rank's torch.chunk slice──▶ DTensor

The unshard gathers through mc-groups' collective layer (:mod:`mc_groups.dtensors`: one
``all_gather`` per mesh dimension that shards, innermost mesh dimension first, uneven
``torch.chunk`` shards padded to the largest shard and trimmed after), so the recorder sees
it; the reshard communicates nothing: every rank already holds the reduced full tensor and
keeps its own slice.
``Replicate`` placements need no gather; ``Partial`` placements are rejected (a grad with
pending reductions is not a finished grad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mc_finalize._fsdp2 import local_reduction
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import check_tensor, type_name
from mc_groups.errors import InputTypeError

_GATHER_LABEL = "unshard DTensor grad"


def _get_main_grad_attr(param: torch.nn.Parameter) -> str:
    """``"main_grad"`` when ``param`` has that attribute, else ``"grad"``."""
    check_tensor("param", param)
    return param_attrs.MAIN_GRAD if param_attrs.has_main_grad(param) else "grad"


def _is_dtensor(tensor: object) -> bool:
    """No DTensor exists before ``torch.distributed.tensor`` is imported, so only then can
    a grad be one (a dict lookup per grad; torch builds without DTensor never load it)."""
    return dtensors.is_dtensor(tensor)


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (gathered over its mesh); any other tensor unchanged.

    Attributes set on the DTensor object (``vars(tensor)``) are copied to the result.
    Raises ``TypeError`` for a ``Partial`` placement, before any collective.
    """
    check_tensor("tensor", tensor)
    if not _is_dtensor(tensor):
        return tensor
    full = dtensors.full_tensor(tensor, _GATHER_LABEL)
    _copy_attributes(tensor, full)
    return full


def _reshard_if_dtensor(
    tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor
) -> torch.Tensor:
    """``tensor_to_shard`` split like ``reference_tensor`` when that is a DTensor.

    Otherwise returns ``reference_tensor`` itself (a plain grad was reduced in place). The
    new DTensor has the reference's mesh, placements, global shape and stride, and its
    attributes; this rank keeps its ``torch.chunk`` slice (no communication).
    """
    check_tensor("tensor_to_shard", tensor_to_shard)
    check_tensor("reference_tensor", reference_tensor)
    if not _is_dtensor(reference_tensor):
        return reference_tensor
    with torch.no_grad():
        sharded = dtensors.distribute_like(tensor_to_shard, reference_tensor)
    _copy_attributes(reference_tensor, sharded)
    return sharded


def _copy_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    for key, value in vars(source).items():
        setattr(target, key, value)


@dataclass
class _GradView:
    """A param's grad as a plain full tensor to reduce, and how to put it back.

    For a plain grad ``full`` is the grad itself (reduced in place); for a DTensor grad it is
    the unsharded copy, and :meth:`commit` stores the resharded result on the param.
    """

    param: torch.nn.Parameter
    attr: str
    original: torch.Tensor
    full: torch.Tensor
    local: bool = False

    def commit(self) -> None:
        """Write the reduced grad back to ``param.<attr>`` (resharded when it was a DTensor
        gathered whole; a DTensor reduced shard by shard was reduced in place)."""
        if self.full is not self.original and not self.local:
            setattr(self.param, self.attr, _reshard_if_dtensor(self.full, self.original))


def _grad_view(
    param: torch.nn.Parameter, group: torch.distributed.ProcessGroup | None = None
) -> _GradView | None:
    """The param's grad (``main_grad`` or ``grad``), unsharded; ``None`` when it has none.
    An FSDP2 grad whose mesh meets ``group`` (the group it is reduced over next) only at
    this rank is viewed as its local shard instead: every peer holds the same shard."""
    attr = _get_main_grad_attr(param)
    original = getattr(param, attr)
    if original is None:
        return None
    if not isinstance(original, torch.Tensor):
        raise InputTypeError(
            f"param.{attr} is {type_name(original)}, expected a torch.Tensor or None"
        )
    if group is not None and local_reduction(original, group):
        return _GradView(param, attr, original, original.to_local(), local=True)  # type: ignore[attr-defined]
    return _GradView(param, attr, original, _unshard_if_dtensor(original))
