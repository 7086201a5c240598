"""``ParamAndGradBuffer``: the contiguous grad (and param) memory of one :class:`BufferKey`,
and its buckets (``ParamAndGradBucket``: one bucket's params and its views into the buffer,
plus the per-shard arithmetic a data-parallel rank needs for reduce-scatter / all-gather),
as Megatron-Core's ``param_and_grad_buffer.py`` holds both.

Memory only: nothing here communicates. ``mc_ddp`` drives the buffer and its buckets.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from mc_buffers._buffer_args import (
    BufferArgs,
    Scale,
    check_buffer_args,
    check_scale,
    check_scaling_factor,
    megatron_form,
)
from mc_buffers._caller_layout import check_layout
from mc_buffers._param_checks import BUFFER_VIEW_ATTR, Param, buffer_slot, describe
from mc_buffers.adopt import PerBufferParamLayoutLike
from mc_buffers.layout import (
    PerBufferParamLayout,
    compute_default_per_buffer_param_layout,
    compute_distributed_optimizer_param_layout,
)
from mc_buffers.offloaded import OffloadedView
from mc_groups.argcheck import check_flag, check_int, check_tensor, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_groups.param_attrs import (
    MAIN_GRAD,
    MAIN_GRAD_COPY,
    drop_main_grad_copy,
    has_main_grad_copy,
    set_main_grad,
    set_main_grad_copy,
)

__all__ = ["ParamAndGradBucket", "ParamAndGradBuffer", "ShardParamSlice", "shard_buffer"]


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


# Attribute names set on each param (Megatron's); kept in constants because the param
# object is the user's and these are its documented extension points.
_WIDE_DTYPES = (torch.float32, torch.float64)


class ParamAndGradBuffer:
    """Params of one dtype/grad-dtype/expert key in one contiguous buffer, split in buckets.

    Layout (``param_layout`` or, when None, computed from the params): params in reverse
    order, ``param_index_map[p] = (start, end, bucket_id)``; see :mod:`mc_buffers.layout`.

    Memory, all allocated on the params' device:
        - ``grad_data``: ``zeros(numel, grad_dtype)``; each ``param.main_grad`` is the view
          ``grad_data[start:end].view(param.shape)``, so writing ``main_grad`` writes the
          buffer and a collective on a bucket's ``grad_data`` reduces every grad in it.
        - ``param_data`` (distributed optimizer only, else None): ``zeros(numel,
          param_dtype)``; each param's values are copied in and ``param.data`` re-pointed to
          ``param_data[start:end].view(param.shape)``, so an all-gather into a bucket's
          ``param_data`` updates the model's params.
        - fp32 local accumulation: a param whose name matches one of
          ``param_name_patterns_for_fp32_local_accumulation`` (fnmatch; ``"all"`` matches
          every param) gets ``main_grad`` = a separate fp32 zeros tensor and
          ``main_grad_copy_in_grad_buffer`` = its view in ``grad_data``. Skipped when
          ``grad_dtype`` is already fp32/fp64 (``main_grad`` accumulates in fp32 anyway).

    What DDP uses: ``buckets`` (each a :class:`ParamAndGradBucket`:
    ``params_list``, ``params``, ``param_data``, ``grad_data``, ``offset``,
    ``numel_unpadded``, ``bucket_id``, ``param_to_index``, ``params_with_extra_main_grads``,
    ``grad_shard(rank, dp)`` / ``param_shard(rank, dp)`` / ``shard_param_slices``),
    ``param_to_bucket``, ``param_index_map``, ``bucket_indices``, ``numel``,
    ``numel_unpadded``, ``grad_data``, ``param_data``, ``extra_main_grads``,
    ``data_parallel_world_size``, ``gradient_scaling_factor``, :meth:`reset`,
    :meth:`scale_gradients`, :meth:`offload_to_cpu`, :meth:`reload_from_cpu`.

    Megatron-Core main's keywords are accepted too (its ``_ParamAndGradBuffer``):
    ``ddp_config`` (any object with Megatron's fields: ``use_distributed_optimizer``,
    ``pad_buckets_for_high_nccl_busbw`` and ``param_name_patterns_for_fp32_local_accumulation``
    are read from it), ``params_with_names`` (``(param, name)`` pairs, instead of
    ``params``), ``data_parallel_group`` (its ``size()`` is the shard count; kept as the
    buffer's field), ``nccl_ub`` (False: mc allocates no NCCL user buffers) and
    ``pg_collection`` (Megatron reads logging groups from it; ignored). A setting given
    both ways must agree.

    Params must require grad, appear once, share one device and ``param_dtype``, have
    elements, and own their memory (a param that is a view into a larger tensor is
    rejected in both modes, so switching ``use_distributed_optimizer`` never changes which
    models are accepted; a param already re-pointed into another buffer's ``param_data``
    is accepted, which lets DDP re-wrap a module).
    """

    def __init__(
        self,
        params: Iterable[Param] | None = None,
        *,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        bucket_size: int | None = None,
        use_distributed_optimizer: bool = False,
        data_parallel_size: int = 1,
        pad_buckets_for_high_nccl_busbw: bool = False,
        param_layout: PerBufferParamLayout | PerBufferParamLayoutLike | None = None,
        param_to_name: Mapping[Param, str] | None = None,
        param_name_patterns_for_fp32_local_accumulation: Sequence[str] = (),
        param_indices: Sequence[int] | None = None,
        gradient_scaling_factor: float = 1.0,
        ddp_config: object | None = None,
        params_with_names: Sequence[tuple[Param, str]] | None = None,
        data_parallel_group: object | None = None,
        nccl_ub: bool = False,
        pg_collection: object | None = None,
    ) -> None:
        given = megatron_form(
            params,
            ddp_config=ddp_config,
            params_with_names=params_with_names,
            data_parallel_group=data_parallel_group,
            nccl_ub=nccl_ub,
            use_distributed_optimizer=use_distributed_optimizer,
            data_parallel_size=data_parallel_size,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
            param_to_name=param_to_name,
            patterns=param_name_patterns_for_fp32_local_accumulation,
        )
        del pg_collection  # Megatron's buffer reads logging groups from it; this one logs nothing
        args = check_buffer_args(
            given.params,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            bucket_size=bucket_size,
            use_distributed_optimizer=given.use_distributed_optimizer,
            data_parallel_size=given.data_parallel_size,
            pad_buckets_for_high_nccl_busbw=given.pad_buckets_for_high_nccl_busbw,
            param_to_name=given.param_to_name,
            patterns=given.patterns,
            param_indices=param_indices,
            gradient_scaling_factor=gradient_scaling_factor,
        )
        layout = _resolve_layout(args, param_layout)
        self.params: list[Param] = args.params
        self.param_dtype = args.param_dtype
        self.grad_dtype = args.grad_dtype
        self.use_distributed_optimizer = args.use_distributed_optimizer
        self.data_parallel_world_size = args.data_parallel_size
        self.gradient_scaling_factor = args.gradient_scaling_factor
        self.param_layout = layout
        # What the DDP that owns the buffer sets (the buffer itself never communicates):
        # the group it reduces (and shards) the buffer over, and its config. Megatron's
        # DistributedOptimizer reads both (its partition_buckets builds bucket groups
        # from them).
        self.data_parallel_group: object | None = data_parallel_group
        self.ddp_config: object | None = ddp_config
        self.param_index_map = layout.param_index_map
        self.bucket_indices = layout.bucket_indices
        self.param_indices = _param_indices(args, layout)
        self.numel = layout.numel
        self.numel_unpadded = layout.numel_unpadded
        self._names = args.names
        self._allocate(args)
        self.extra_main_grads: list[torch.Tensor] = []
        self._main_grad_views: dict[Param, dict[str, torch.Tensor]] = {}
        self.buckets: list[ParamAndGradBucket] = []
        self.param_to_bucket: dict[Param, ParamAndGradBucket] = {}
        self._map_params(args.patterns)
        self._make_buckets()
        self.param_data_cpu: torch.Tensor | None = None
        self._grad_nbytes: list[int] = []
        self._param_nbytes = 0
        self._offloaded_views: dict[Param, dict[str, tuple[torch.Tensor, OffloadedView]]] = {}

    # -- construction -----------------------------------------------------------------

    def _allocate(self, args: BufferArgs) -> None:
        device = args.params[0].device
        self._grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        self._param_data: torch.Tensor | None = None
        if self.use_distributed_optimizer:
            self._param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)

    @property
    def grad_data(self) -> torch.Tensor:
        """The flat grad buffer; an :class:`~mc_buffers.OffloadedView` while offloaded."""
        if self.is_grad_data_offloaded:
            return OffloadedView(self._grad_data, f"grad_data of {self!r}")
        return self._grad_data

    @property
    def param_data(self) -> torch.Tensor | None:
        """The flat param buffer (distributed optimizer, else None); an
        :class:`~mc_buffers.OffloadedView` while offloaded."""
        if self._param_data is not None and self.is_param_data_offloaded:
            return OffloadedView(self._param_data, f"param_data of {self!r}")
        return self._param_data

    def _view(self, flat: torch.Tensor, param: Param) -> torch.Tensor:
        start, end, _ = self.param_index_map[param]
        return flat[start:end].view(param.shape)

    @torch.no_grad()
    def _map_params(self, patterns: tuple[str, ...]) -> None:
        for param in self.params:
            if self._param_data is not None:
                new_data = self._view(self._param_data, param)
                new_data.copy_(param.data)
                param.data = new_data
                setattr(param, BUFFER_VIEW_ATTR, buffer_slot(param))
            main_grad = self._view(self._grad_data, param)
            views = {}
            if self._promotes(param, patterns):
                set_main_grad_copy(param, main_grad)
                views[MAIN_GRAD_COPY] = main_grad
                main_grad = torch.zeros_like(main_grad, dtype=torch.float32)
                self.extra_main_grads.append(main_grad)
            else:
                drop_main_grad_copy(param)  # left by an earlier buffer
            set_main_grad(param, main_grad)
            views[MAIN_GRAD] = main_grad
            self._main_grad_views[param] = views

    def _promotes(self, param: Param, patterns: tuple[str, ...]) -> bool:
        if self.grad_dtype in _WIDE_DTYPES:
            return False
        name = self._names.get(param)
        return any(p == "all" or (name is not None and fnmatch.fnmatch(name, p)) for p in patterns)

    def _members_by_bucket(self) -> list[list[Param]]:
        members: list[list[Param]] = [[] for _ in self.bucket_indices]
        for param in sorted(self.params, key=lambda p: self.param_index_map[p][0]):
            members[self.param_index_map[param][2]].append(param)
        return members

    def _make_buckets(self) -> None:
        by_bucket = self._members_by_bucket()
        for bucket_id, (start, end) in enumerate(self.bucket_indices):
            members = by_bucket[bucket_id]
            bucket = ParamAndGradBucket(
                params=members,
                param_data=None if self._param_data is None else self._param_data[start:end],
                grad_data=self._grad_data[start:end],
                offset=start,
                numel_unpadded=self.param_layout.per_bucket_numel_unpadded[bucket_id],
                gradient_scaling_factor=self.gradient_scaling_factor,
                bucket_id=bucket_id,
                param_index_map=self.param_index_map,
                params_with_extra_main_grads=[p for p in members if has_main_grad_copy(p)],
            )
            self.buckets.append(bucket)
            self.param_to_bucket.update(dict.fromkeys(members, bucket))

    # -- gradients --------------------------------------------------------------------

    @property
    def is_grad_data_offloaded(self) -> bool:
        """True between :meth:`offload_to_cpu` (grads) and :meth:`reload_from_cpu`."""
        return bool(self._grad_nbytes)

    @property
    def is_param_data_offloaded(self) -> bool:
        """True between :meth:`offload_to_cpu` (params) and :meth:`reload_from_cpu`."""
        return self._param_nbytes > 0

    def _require_resident_grads(self, what: str) -> None:
        if self.is_grad_data_offloaded:
            raise RuntimeError(
                f"{what}: the grad buffer is offloaded (its storage is freed); call "
                "reload_from_cpu() first"
            )

    @torch.no_grad()
    def reset(self) -> None:
        """Zero ``grad_data`` and every separate fp32 ``main_grad``."""
        self._require_resident_grads("reset()")
        self._grad_data.zero_()
        for grad in self.extra_main_grads:
            grad.zero_()

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: Scale) -> None:
        """``grad_data *= scaling_factor`` and the same for each separate fp32 ``main_grad``.

        ``scaling_factor`` is a float or a one-element tensor (kept on device, no sync).
        """
        factor = check_scale(scaling_factor, "scaling_factor")
        self._require_resident_grads("scale_gradients()")
        self._grad_data.mul_(factor)
        for grad in self.extra_main_grads:
            grad.mul_(factor)

    # -- offload ----------------------------------------------------------------------

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [self._grad_data, *self.extra_main_grads]

    @torch.no_grad()
    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """Release device memory; views (bucket views, ``param.data``) stay valid objects
        but must not be read until :meth:`reload_from_cpu`.

        Grads: each storage is resized to 0 bytes (nothing is copied; they come back
        zeroed), and each param's ``main_grad`` (and ``main_grad_copy_in_grad_buffer``) is
        swapped for an :class:`~mc_buffers.OffloadedView` on which every operation
        raises (a write into the freed view would corrupt memory or crash the process);
        :meth:`reload_from_cpu` puts the original views back. Params (distributed
        optimizer only): ``param_data`` is first copied to ``param_data_cpu`` (pinned on
        CUDA), then its storage is resized to 0. Offloading what is already offloaded does
        nothing.
        """
        grads = check_flag("move_grads", move_grads)
        params = check_flag("move_params", move_params)
        if grads and not self.is_grad_data_offloaded:
            self._grad_nbytes = [t.untyped_storage().nbytes() for t in self._grad_tensors()]
            self._swap_in_sentinels()
            for t in self._grad_tensors():
                t.untyped_storage().resize_(0)
        if params and self._param_data is not None and not self.is_param_data_offloaded:
            self._offload_params()

    def _swap_in_sentinels(self) -> None:
        for param, views in self._main_grad_views.items():
            swapped = {}
            for attr, view in views.items():
                if getattr(param, attr, None) is view:  # not re-pointed since (DDP re-wrap)
                    sentinel = OffloadedView(view, f"{attr} of {describe(param, self._names)}")
                    setattr(param, attr, sentinel)
                    swapped[attr] = (view, sentinel)
            self._offloaded_views[param] = swapped

    def _swap_out_sentinels(self) -> None:
        for param, swapped in self._offloaded_views.items():
            for attr, (view, sentinel) in swapped.items():
                if getattr(param, attr, None) is sentinel:
                    setattr(param, attr, view)
        self._offloaded_views = {}

    def _offload_params(self) -> None:
        assert self._param_data is not None  # guarded by the caller
        on_cuda = self._param_data.device.type == "cuda"
        if self.param_data_cpu is None:
            self.param_data_cpu = torch.empty(
                self._param_data.shape, dtype=self.param_dtype, pin_memory=on_cuda
            )
        self.param_data_cpu.copy_(self._param_data, non_blocking=on_cuda)
        self._param_nbytes = self._param_data.untyped_storage().nbytes()
        self._param_data.untyped_storage().resize_(0)

    @torch.no_grad()
    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """Re-allocate what :meth:`offload_to_cpu` released: params get their values back
        from ``param_data_cpu``; grads (and separate fp32 ``main_grad`` s) come back zeroed,
        and each param's ``main_grad`` is its original view again. Reloading what is
        resident does nothing."""
        params = check_flag("move_params", move_params)
        grads = check_flag("move_grads", move_grads)
        if params and self.is_param_data_offloaded:
            self._reload_params()
        if grads and self.is_grad_data_offloaded:
            for t, nbytes in zip(self._grad_tensors(), self._grad_nbytes, strict=True):
                t.untyped_storage().resize_(nbytes)
                t.zero_()
            self._grad_nbytes = []
            self._swap_out_sentinels()

    def _reload_params(self) -> None:
        assert self._param_data is not None  # offloaded implies both exist
        assert self.param_data_cpu is not None
        self._param_data.untyped_storage().resize_(self._param_nbytes)
        on_cuda = self._param_data.device.type == "cuda"
        self._param_data.copy_(self.param_data_cpu, non_blocking=on_cuda)
        self._param_nbytes = 0

    @property
    def num_optimizer_shards(self) -> int | None:
        """Shards every bucket splits into (the layout's; None without the distributed
        optimizer): must equal the size of ``data_parallel_group``."""
        return self.param_layout.num_optimizer_shards

    def __repr__(self) -> str:
        return (
            f"ParamAndGradBuffer(params={len(self.params)}, param_dtype={self.param_dtype}, "
            f"grad_dtype={self.grad_dtype}, numel={self.numel}, "
            f"numel_unpadded={self.numel_unpadded}, buckets={len(self.buckets)}, "
            f"use_distributed_optimizer={self.use_distributed_optimizer})"
        )


def _resolve_layout(args: BufferArgs, given: object) -> PerBufferParamLayout:
    if given is not None:
        shards = args.data_parallel_size if args.use_distributed_optimizer else None
        return check_layout(given, args.params, args.names, shards)
    if args.use_distributed_optimizer:
        return compute_distributed_optimizer_param_layout(
            args.params,
            args.bucket_size,
            args.data_parallel_size,
            args.pad_buckets_for_high_nccl_busbw,
        )
    return compute_default_per_buffer_param_layout(args.params, args.bucket_size)


def _param_indices(args: BufferArgs, layout: PerBufferParamLayout) -> list[int]:
    if args.param_indices is not None:
        return args.param_indices
    if len(layout.param_indices) == len(args.params):
        return list(layout.param_indices)
    return list(range(len(args.params)))
