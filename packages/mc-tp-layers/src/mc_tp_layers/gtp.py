"""gtp_remat: a linear weight's dim 0 sharded over the gtp_remat group (ZeRO-3 on the weight).

With ``gtp_remat_size = G > 1`` each rank keeps ``s = ceil(d0 / G)`` rows of its
(TP-local) weight of ``d0`` rows: the weight is padded with ``pad_length = G·s - d0`` zero
rows at the end of dim 0 and rank g of the gtp_remat group keeps rows ``[g·s, (g+1)·s)``::

    TP-local weight [d0, k]  --pad-->  [G·s, k]  --split dim 0-->  rank g: [s, k]

Before each GEMM (forward, and again in backward: the full weight is rematerialised, not
kept) the shards are all-gathered and the padding dropped; the full weight gradient is
padded, pre-scaled and reduce-scattered (SUM) over the group, and rank g keeps its rows::

    dW_g = Σ_{j ∈ gtp_remat} c · dW_j[rows of g]      c = 1/G, or 1 under per-token loss

gtp_remat ranks see different data, like data-parallel ranks. Every param replicated over
the axis (biases, layer norms) is averaged over it in ``finalize_model_grads``, and DDP
divides by the replicate (dp·cp) size; with ``c = 1/G`` the sharded weights get the same
mean over all (dp·cp × gtp_remat) ranks (Megatron-Core's ``_prescale_wgrads_for_mean_rs``).
Under ``calculate_per_token_loss`` nothing is averaged (DDP does not scale, finalize
divides by the global token count, which counts every gtp_remat rank's tokens), so the
axis is summed: ``c = 1``. The factor is fixed when the shard is made
(``shard_weight_for_gtp(..., calculate_per_token_loss=)``) and kept on it as
``gtp_wgrad_scale``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_group, check_int, check_tensor
from mc_groups.errors import InputValueError

__all__ = [
    "gather_gtp_weight",
    "gtp_local_rows",
    "gtp_remat_shard_dim0",
    "reduce_scatter_gtp_grad",
    "shard_weight_for_gtp",
]


def gtp_remat_shard_dim0(dim0: int, gtp_remat_size: int) -> tuple[int, int]:
    """``(shard rows s, pad_length)`` for ``dim0`` rows over ``gtp_remat_size`` ranks."""
    check_int("dim0", dim0, minimum=0)
    check_int("gtp_remat_size", gtp_remat_size)
    shard = -(-dim0 // gtp_remat_size)
    return shard, shard * gtp_remat_size - dim0


def gtp_local_rows(tp_local: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``tp_local`` over ``size`` gtp_remat ranks: ``tp_local``
    padded with zero rows to ``size · s`` rows, rows ``[rank·s, (rank+1)·s)`` (a view when
    no padding is needed; see the module notes)."""
    rows, pad = gtp_remat_shard_dim0(tp_local.shape[0], size)
    padded = torch.nn.functional.pad(tp_local, (0, 0, 0, pad)) if pad else tp_local
    return padded[rank * rows : (rank + 1) * rows]


def shard_weight_for_gtp(
    weight: torch.nn.Parameter,
    group: dist.ProcessGroup,
    *,
    calculate_per_token_loss: bool = False,
) -> torch.nn.Parameter:
    """A new parameter holding this rank's rows of ``weight`` (padded), tagged for GTP.

    The shard carries ``is_gtp_weight_remat``, ``group``, ``gtp_remat_size``,
    ``pad_length``, ``gtp_unsharded_shape``, ``gtp_wgrad_scale`` (``1/G``, or 1 with
    ``calculate_per_token_loss``: see the module notes) and ``weight``'s TP attributes.
    The layers pass their ``config.calculate_per_token_loss``.
    """
    check_flag("calculate_per_token_loss", calculate_per_token_loss)
    check_tensor("weight", weight)
    if weight.dim() < 1:
        raise InputValueError(f"weight has shape {tuple(weight.shape)}; gtp_remat shards dim 0")
    if param_attrs.is_gtp_weight_remat(weight):
        raise InputValueError(
            "weight is already a gtp_remat shard (is_gtp_weight_remat); shard the "
            "TP-local weight once"
        )
    check_group("group", group)
    size, rank = int(group.size()), int(group.rank())
    pad = gtp_remat_shard_dim0(weight.shape[0], size)[1]
    shard = torch.nn.Parameter(
        gtp_local_rows(weight.detach(), rank, size).clone(), requires_grad=weight.requires_grad
    )
    param_attrs.copy_tensor_model_parallel_attributes(shard, weight)
    for name in (param_attrs.ALLREDUCE, param_attrs.SEQUENCE_PARALLEL):
        if hasattr(weight, name):
            setattr(shard, name, getattr(weight, name))
    scale = 1.0 if calculate_per_token_loss else 1.0 / size
    param_attrs.mark_gtp_weight_remat(shard, group, pad, tuple(weight.shape), scale)
    return shard


def _gtp_shard(shard: torch.Tensor) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    """The shard's gtp_remat group and the TP-local shape it was cut from."""
    check_tensor("shard", shard)
    group = param_attrs.gtp_group_of(shard)
    shape = param_attrs.gtp_unsharded_shape_of(shard)
    if not isinstance(group, dist.ProcessGroup) or shape is None:
        raise InputValueError(
            "gtp_remat_size > 1 needs a weight sharded by shard_weight_for_gtp (it carries "
            "`group` and `gtp_unsharded_shape`); this weight has shape "
            f"{tuple(shard.shape)} and no GTP attributes"
        )
    return group, shape


def _gtp_group(shard: torch.Tensor) -> dist.ProcessGroup:
    return _gtp_shard(shard)[0]


def unsharded_shape(shard: torch.Tensor) -> tuple[int, ...]:
    """The TP-local shape the GTP shard was cut from."""
    return _gtp_shard(shard)[1]


def gather_gtp_weight(shard: torch.Tensor) -> torch.Tensor:
    """All-gather the gtp_remat shards of a weight; drop the padding rows."""
    group = _gtp_group(shard)
    full_rows = unsharded_shape(shard)[0]
    padded = shard.new_empty((shard.shape[0] * int(group.size()), *shard.shape[1:]))
    mg.all_gather(padded, shard.detach().contiguous(), group, label="gtp_remat weight all-gather")
    return padded[:full_rows]


def reduce_scatter_gtp_grad(full_grad: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``Σ_gtp_remat c · full_grad`` (TP-local shape), this rank's rows; ``c`` is the shard's
    ``gtp_wgrad_scale`` (``1/G`` by default: the mean over the axis; see the module notes).
    ``full_grad`` itself is left unchanged."""
    group = _gtp_group(shard)
    check_tensor("full_grad", full_grad)
    if tuple(full_grad.shape) != unsharded_shape(shard):
        raise InputValueError(
            f"full_grad has shape {tuple(full_grad.shape)} but the shard was cut from "
            f"{list(unsharded_shape(shard))}; pass the gradient of the whole TP-local weight"
        )
    scale = param_attrs.gtp_wgrad_scale_of(shard, 1.0 / int(group.size()))
    pad = shard.shape[0] * int(group.size()) - full_grad.shape[0]
    if pad:
        padded = torch.nn.functional.pad(full_grad, (0, 0, 0, pad)).mul_(scale)
    else:
        padded = full_grad * scale if scale != 1.0 else full_grad
    out = full_grad.new_empty((shard.shape[0], *full_grad.shape[1:]))
    mg.reduce_scatter(out, padded.contiguous(), group, label="gtp_remat wgrad reduce-scatter")
    return out
