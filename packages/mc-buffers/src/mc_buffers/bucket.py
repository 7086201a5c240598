"""``ParamAndGradBucket``: one bucket's params and its views into the buffer, plus the
per-shard arithmetic a data-parallel rank needs for reduce-scatter / all-gather."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from mc_buffers._buffer_args import check_scaling_factor
from mc_buffers._param_checks import Param
from mc_buffers.offloaded import OffloadedView
from mc_groups.argcheck import check_int, check_tensor, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["ParamAndGradBucket", "ShardParamSlice", "shard_buffer"]


def _check_shard(shard_index: object, num_shards: object, numel: int, what: str) -> int:
    n = check_int("num_shards", num_shards)
    shard_index = check_int("shard_index", shard_index, minimum=0)
    if shard_index >= n:
        raise InputValueError(f"shard_index={shard_index} must be in [0, num_shards={n})")
    if numel % n:
        raise InputValueError(
            f"{what} of {numel} elements does not split into num_shards={n} equal shards; "
            "build it with the distributed-optimizer layout at this data-parallel size"
        )
    return numel // n


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> list[torch.Tensor]:
    """Split the flat ``buffer`` into ``data_parallel_world_size`` equal contiguous views.

    View ``r`` is ``buffer[r·s : (r+1)·s]`` with ``s = numel / dp``: data-parallel rank
    ``r``'s shard, what a reduce-scatter writes on rank ``r`` and an all-gather reads there.
    """
    check_tensor("buffer", buffer)
    dp = check_int("data_parallel_world_size", data_parallel_world_size)
    if buffer.dim() != 1 or buffer.numel() % dp:
        raise InputValueError(
            f"buffer of shape {tuple(buffer.shape)} must be 1-D with a numel divisible by "
            f"data_parallel_world_size={dp}"
        )
    size = buffer.numel() // dp
    return [buffer[r * size : (r + 1) * size] for r in range(dp)]


class ShardParamSlice(NamedTuple):
    """The part of one param that falls inside one shard of a bucket.

    All ranges are ``[start, end)`` element offsets: ``param_range`` into
    ``param.view(-1)``, ``bucket_range`` into the bucket's views, ``shard_range`` into the
    shard (``bucket_range`` minus the shard start). The three have equal lengths.
    """

    param: Param
    param_range: tuple[int, int]
    bucket_range: tuple[int, int]
    shard_range: tuple[int, int]


def _bucket_params(params: object, bucket_id: int) -> list[Param]:
    if isinstance(params, (str, set, frozenset)) or not isinstance(params, Sequence):
        raise InputTypeError(
            f"bucket {bucket_id}: params must be a sequence of parameters in buffer order, got "
            f"{type_name(params)}"
        )
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise InputTypeError(
                f"bucket {bucket_id}: params[{i}] is a {type_name(p)}, not a param"
            )
    return list(params)


def _check_views(grad_data: object, param_data: object, bucket_id: int) -> None:
    grad = check_tensor("grad_data", grad_data)
    if grad.dim() != 1:
        raise InputValueError(
            f"bucket {bucket_id}: grad_data must be 1-D, got shape {tuple(grad.shape)}"
        )
    if param_data is not None:
        data = check_tensor("param_data", param_data)
        if data.shape != grad.shape:
            raise InputValueError(
                f"bucket {bucket_id}: param_data of shape {tuple(data.shape)} must match "
                f"grad_data's {tuple(grad.shape)}"
            )


def _check_index_map(
    params: list[Param], index_map: object, offset: int, numel: int, bucket_id: int
) -> None:
    if not isinstance(index_map, Mapping):
        raise InputTypeError(
            f"bucket {bucket_id}: param_index_map must map each param to (start, end, "
            f"bucket_id), got {type_name(index_map)}"
        )
    for i, p in enumerate(params):
        entry = index_map.get(p)
        if entry is None:
            raise InputValueError(
                f"bucket {bucket_id}: param_index_map has no entry for params[{i}]"
            )
        start, end = entry[0] - offset, entry[1] - offset
        if not 0 <= start <= end <= numel or end - start != p.numel():
            raise InputValueError(
                f"bucket {bucket_id}: params[{i}] (numel {p.numel()}) is mapped to [{entry[0]}, "
                f"{entry[1]}), not inside the bucket [{offset}, {offset + numel})"
            )


class ParamAndGradBucket:
    """A subset of a buffer's params whose gradients are reduced together.

    DDP drives the bucket through its attributes (Megatron's names) and the
    :attr:`param_data` / :attr:`grad_data` properties.

    Attributes:
        params_list: the params in buffer order (backprop order).
        params: the same params as a set, for membership tests.
        offset: element offset of the bucket in the buffer.
        numel_unpadded: elements up to the end of the last param (the rest is padding).
        gradient_scaling_factor: factor DDP applies before/within the reduction
            (e.g. 1/dp for an average); the buffer only stores it.
        bucket_id: index of the bucket in its buffer.
        param_to_index: param -> ``(start, end)`` offsets inside the bucket.
        params_with_extra_main_grads: params whose ``main_grad`` is a separate fp32 tensor;
            DDP copies ``main_grad`` into ``main_grad_copy_in_grad_buffer`` before the
            collective and back after it.
        layerwise_gather_list: Megatron's slot for its layer-wise optimizer's param gather
            (None; mc never fills it, a DDP's ``free_overlap_buffers`` clears it).
    """

    def __init__(
        self,
        params: Sequence[Param],
        param_data: torch.Tensor | None,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
        param_index_map: Mapping[Param, tuple[int, int, int]],
        params_with_extra_main_grads: Sequence[Param] = (),
    ) -> None:
        bucket_id = check_int("bucket_id", bucket_id, minimum=0)
        self.params_list: list[Param] = _bucket_params(params, bucket_id)
        self.params: set[Param] = set(self.params_list)
        if len(self.params) != len(self.params_list):
            raise InputValueError(f"bucket {bucket_id} lists a param twice")
        _check_views(grad_data, param_data, bucket_id)
        self._param_data = param_data
        self._grad_data = grad_data
        self.offset = check_int("offset", offset, minimum=0)
        self.numel_unpadded = check_int("numel_unpadded", numel_unpadded, minimum=0)
        if self.numel_unpadded > grad_data.numel():
            raise InputValueError(
                f"numel_unpadded={numel_unpadded} exceeds the bucket's {grad_data.numel()} "
                "elements (grad_data)"
            )
        self.gradient_scaling_factor = check_scaling_factor(
            gradient_scaling_factor, "gradient_scaling_factor"
        )
        self.bucket_id = bucket_id
        _check_index_map(self.params_list, param_index_map, offset, grad_data.numel(), bucket_id)
        self.param_to_index: dict[Param, tuple[int, int]] = {
            p: (param_index_map[p][0] - offset, param_index_map[p][1] - offset)
            for p in self.params_list
        }
        self.params_with_extra_main_grads: list[Param] = list(params_with_extra_main_grads)
        self.layerwise_gather_list: list[torch.Tensor] | None = None

    def set_layerwise_params_list(self, layerwise_params_list: Sequence[Sequence[Param]]) -> None:
        """Megatron's hook for its layer-wise optimizer's legacy path (no layout): per-rank
        param lists gathered by variable-size all-gathers. Not implemented in mc; that
        optimizer's layout path (``LayerWiseDistributedOptimizer.compute_full_param_layout``
        passed as DDP's ``full_param_layout`` with ``use_distributed_optimizer=True``) is.

        Raises:
            NotImplementedError: always, naming the layout path.
        """
        raise NotImplementedError(
            f"bucket {self.bucket_id}: set_layerwise_params_list() (Megatron's "
            "LayerWiseDistributedOptimizer without a param layout) is not implemented in mc; "
            "compute LayerWiseDistributedOptimizer.compute_full_param_layout(...) and pass it "
            "to DistributedDataParallel(full_param_layout=...) with "
            "use_distributed_optimizer=True"
        )

    @property
    def grad_data(self) -> torch.Tensor:
        """This bucket's view of the buffer's ``grad_data``, the tensor a DDP all-reduces, or
        reduce-scatters into ``grad_shard(rank, dp)``; an :class:`~mc_buffers.OffloadedView`
        (every op refused) while offloaded."""
        if self.is_grad_data_offloaded:
            return OffloadedView(self._grad_data, f"grad_data of bucket {self.bucket_id}")
        return self._grad_data

    @property
    def param_data(self) -> torch.Tensor | None:
        """This bucket's view of the buffer's ``param_data`` (distributed optimizer; or None); an
        :class:`~mc_buffers.OffloadedView` while offloaded."""
        if self._param_data is not None and self.is_param_data_offloaded:
            return OffloadedView(self._param_data, f"param_data of bucket {self.bucket_id}")
        return self._param_data

    @property
    def numel(self) -> int:
        """Elements of the bucket, padding included."""
        return self._grad_data.numel()

    @property
    def is_grad_data_offloaded(self) -> bool:
        """True while the buffer's grad storage is freed (``offload_to_cpu``): nothing may
        read or write ``grad_data`` until it is reloaded."""
        return self._grad_data.untyped_storage().nbytes() == 0

    @property
    def is_param_data_offloaded(self) -> bool:
        """True while the buffer's param storage is freed (distributed optimizer)."""
        data = self._param_data
        return data is not None and data.untyped_storage().nbytes() == 0

    def shard_range(self, shard_index: int, num_shards: int) -> tuple[int, int]:
        """``[start, end)`` of shard ``shard_index`` of ``num_shards`` equal shards, in
        bucket coordinates: ``(i·s, (i+1)·s)`` with ``s = numel / num_shards``."""
        size = _check_shard(shard_index, num_shards, self.numel, f"bucket {self.bucket_id}")
        return shard_index * size, (shard_index + 1) * size

    def grad_shard(self, shard_index: int, num_shards: int) -> torch.Tensor:
        """View of ``grad_data`` for shard ``shard_index`` (a reduce-scatter's output)."""
        start, end = self.shard_range(shard_index, num_shards)
        return self.grad_data[start:end]

    def param_shard(self, shard_index: int, num_shards: int) -> torch.Tensor:
        """View of ``param_data`` for shard ``shard_index`` (an all-gather's input)."""
        if self.param_data is None:
            raise InputValueError(
                f"bucket {self.bucket_id} has no param_data: only a buffer built with "
                "use_distributed_optimizer=True holds params"
            )
        start, end = self.shard_range(shard_index, num_shards)
        return self.param_data[start:end]

    def shard_param_slices(self, shard_index: int, num_shards: int) -> list[ShardParamSlice]:
        """The params (and the part of each) that shard ``shard_index`` owns, in bucket
        order: what a distributed optimizer steps on this data-parallel rank."""
        lo, hi = self.shard_range(shard_index, num_shards)
        out = []
        for p in self.params_list:
            start, end = self.param_to_index[p]
            a, b = max(start, lo), min(end, hi)
            if a < b:
                out.append(ShardParamSlice(p, (a - start, b - start), (a, b), (a - lo, b - lo)))
        return out

    def __repr__(self) -> str:
        return (
            f"ParamAndGradBucket(bucket_id={self.bucket_id}, params={len(self.params_list)}, "
            f"offset={self.offset}, numel={self.numel}, numel_unpadded={self.numel_unpadded})"
        )
