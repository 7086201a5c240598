r"""Where a tensor-parallel layer's parameters live, how they are allocated and how they
are initialised.

**Placement and allocation**: the explicit ``device=``, else CPU under
``use_cpu_initialization`` (as Megatron), else the current CUDA device for an NCCL group
(CPU for gloo); an allocation that fails (absurd sizes, a device out of memory) is a
``RuntimeError`` naming the layer, its sizes, the shape and the bytes asked for.

**CPU initialisation** (:func:`_initialize_affine_weight_cpu`) builds the full fp32
master weight ``[output_size, input_size]`` with the CPU generator on every rank and keeps
this rank's part, so a TP=N model equals the TP=1 model sliced. With ``stride`` k the
partition dim is cut into ``W·k`` blocks of ``per_partition_size / k`` and rank r keeps
blocks ``r, r + W, …, r + (k-1)·W`` (concatenated), e.g. W=2, k=2::

    master rows: [ b0 | b1 | b2 | b3 ]      rank 0: [b0 | b2]   rank 1: [b1 | b3]

(the layout of fused weights such as QKV or gated MLPs, whose parts must each be split).

**Device initialisation** (:func:`_initialize_affine_weight_gpu`) runs ``init_method`` on
the local shard directly, on its own device, inside ``rng_tracker.fork()``: the
``model-parallel-rng`` stream (seed + 2718 + tp_rank) or, for experts, the
``expert-parallel-rng`` stream. No master weight exists; shards differ from a TP=1 run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_float_dtype, check_int, check_tensor
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.gtp import gtp_local_rows
from mc_tp_layers.random import (
    RNGStatesTracker,
    _check_device_name,
    _default_tracker,
    get_expert_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
)
from mc_tp_layers.shards import split_full
from mc_tp_layers.utils import _resolve_tp_group

__all__ = ["_initialize_affine_weight_cpu", "_initialize_affine_weight_gpu"]

InitMethod = Callable[[torch.Tensor], object]


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: InitMethod,
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
    *,
    rng_tracker: RNGStatesTracker | None = None,
) -> None:
    """Set ``weight``'s TP attributes and run ``init_method(weight)`` in the tracker's stream.

    The stream is ``model-parallel-rng`` (``expert-parallel-rng`` when ``is_expert``) of
    ``rng_tracker`` (None: the default registered by ``model_parallel_cuda_manual_seed``, as
    Megatron reads its global tracker), whose device must be ``weight``'s device type.
    Every argument is checked before the weight is tagged or drawn.
    """
    w = check_tensor("weight", weight)
    _check_init(init_method)
    param_attrs.check_partition_dim(partition_dim, w.dim())
    check_int("stride", stride)
    check_flag("is_expert", is_expert)
    if rng_tracker is not None and not isinstance(rng_tracker, RNGStatesTracker):
        raise InputTypeError(
            f"rng_tracker={rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker or None"
        )
    if rng_tracker is None:
        rng_tracker = _default_tracker()
    if rng_tracker is None:
        raise InputValueError(
            "device initialisation (config.use_cpu_initialization=False) needs an RNG "
            "tracker: call mc_tp_layers.model_parallel_cuda_manual_seed(seed, "
            "pg_collection=...) first (it registers the default) or pass rng_tracker=; "
            "or set config.use_cpu_initialization=True, or config.perform_initialization=False"
        )
    if rng_tracker.device.type != weight.device.type:
        raise InputValueError(
            f"rng_tracker drives {rng_tracker.device} but the weight is on {weight.device}; "
            "build the tracker for the weight's device"
        )
    param_attrs.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if is_expert:
        stream = get_expert_parallel_rng_tracker_name()
    else:
        stream = get_model_parallel_rng_tracker_name()
    with rng_tracker.fork(stream), torch.no_grad():
        init_method(weight)


def _allocate_master(output_size: int, input_size: int) -> torch.Tensor:
    try:
        return torch.empty(output_size, input_size, dtype=torch.float32)
    except RuntimeError as err:
        gib = output_size * input_size * 4 / 2**30
        raise RuntimeError(
            f"CPU initialisation cannot allocate the [{output_size}, {input_size}] fp32 "
            f"master weight ({gib:,.1f} GiB; output_size={output_size}, "
            f"input_size={input_size}): {str(err).splitlines()[0][:160]}; check the sizes, "
            "or initialise on the device (use_cpu_initialization=False)"
        ) from None


def _check_init(init_method: object) -> InitMethod:
    """``init_method`` when callable, else a ``TypeError``."""
    if not callable(init_method):
        raise InputTypeError(f"init_method={init_method!r} must be callable (tensor -> None)")
    return init_method


def _check_cpu_init(
    weight: object,
    sizes: tuple[object, object, object],
    partition_dim: object,
    init_method: object,
    stride: object,
    flags: tuple[object, object],
    params_dtype: object,
    placement: tuple[object, object],
) -> tuple[int, int]:
    """The arguments of :func:`_initialize_affine_weight_cpu`; returns ``(rank, world)``."""
    check_tensor("weight", weight)
    full = (check_int("output_size", sizes[0]), check_int("input_size", sizes[1]))
    per_partition = check_int("per_partition_size", sizes[2])
    dim = param_attrs.check_partition_dim(partition_dim, 2)
    _check_init(init_method)
    if per_partition % check_int("stride", stride):
        raise InputValueError(
            f"per_partition_size={per_partition} is not divisible by stride={stride}; "
            "each rank's part must hold stride equal blocks"
        )
    check_flag("return_master_weight", flags[0])
    check_flag("skip_set_tensor_parallel_attributes", flags[1])
    check_float_dtype("params_dtype", params_dtype)
    rank, world = placement
    if rank is None or world is None:
        group = _resolve_tp_group(None, None, what="_initialize_affine_weight_cpu")
        rank, world = int(group.rank()), int(group.size())
    world = check_int("world_size", world)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world:
        raise InputValueError(f"rank={rank} must be < world_size={world}")
    if per_partition * world != full[dim]:
        raise InputValueError(
            f"per_partition_size={per_partition} × world_size={world} must equal the master "
            f"weight's partition dim {dim} of [{full[0]}, {full[1]}] ({full[dim]})"
        )
    return rank, world


def _gtp_rows(part: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``part`` cut down to this rank's gtp_remat rows when ``weight`` is a GTP shard."""
    group = param_attrs.gtp_group_of(weight)
    if not param_attrs.is_gtp_weight_remat(weight) or group is None:
        return part
    return gtp_local_rows(part, int(group.rank()), int(group.size()))


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
    world_size: int | None = None,
    skip_set_tensor_parallel_attributes: bool = False,
) -> torch.Tensor | None:
    """Build the full master weight on CPU and copy this rank's part into ``weight``.

    ``init_method`` fills an fp32 ``[output_size, input_size]`` tensor with the CPU
    generator (identical on every rank seeded alike); it is cast to ``params_dtype``, split
    along ``partition_dim`` into blocks of ``per_partition_size / stride`` and rank r keeps
    blocks ``r::world_size`` (see the module docstring). A GTP shard
    (``is_gtp_weight_remat``) is further cut to its gtp_remat rows, so the values match a
    run without GTP. ``rank``/``world_size`` default to the default collection's TP group.
    Returns the master weight (in ``params_dtype``) when ``return_master_weight``. Every
    argument is checked before the weight is tagged or written.
    """
    rank, world_size = _check_cpu_init(
        weight,
        (output_size, input_size, per_partition_size),
        partition_dim,
        init_method,
        stride,
        (return_master_weight, skip_set_tensor_parallel_attributes),
        params_dtype,
        (rank, world_size),
    )
    master = _allocate_master(output_size, input_size)
    with torch.no_grad():
        init_method(master)
    master = master.to(dtype=params_dtype)
    part = _gtp_rows(split_full(master, partition_dim, rank, world_size, stride), weight)
    if tuple(part.shape) != tuple(weight.shape):
        raise InputValueError(
            f"weight has shape {tuple(weight.shape)} but rank {rank}'s part of the "
            f"[{output_size}, {input_size}] master weight has shape {tuple(part.shape)}"
        )
    if not skip_set_tensor_parallel_attributes:
        param_attrs.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    with torch.no_grad():
        weight.data.copy_(part)
    return master if return_master_weight else None


class WeightInit:
    """How one layer initialises its weight (the arguments both init paths share)."""

    def __init__(
        self,
        config: TransformerConfigLike,
        init_method: InitMethod,
        rng_tracker: RNGStatesTracker | None,
        group: dist.ProcessGroup,
    ) -> None:
        # rng_tracker=None: the default registered by model_parallel_cuda_manual_seed, if any.
        tracker = _default_tracker() if rng_tracker is None else rng_tracker
        self.config, self.init_method, self.rng_tracker = config, init_method, tracker
        self.rank, self.world = int(group.rank()), int(group.size())

    def run(
        self,
        weight: torch.Tensor,
        full_shape: tuple[int, int],
        partition_dim: int,
        stride: int,
        *,
        is_expert: bool = False,
        keep_master: bool = False,
    ) -> torch.Tensor | None:
        """Set TP attributes; initialise when ``perform_initialization``; maybe the master."""
        param_attrs.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        if not self.config.perform_initialization:
            return None
        if self.config.use_cpu_initialization:
            return _initialize_affine_weight_cpu(
                weight,
                full_shape[0],
                full_shape[1],
                weight.shape[partition_dim],
                partition_dim,
                self.init_method,
                stride,
                keep_master,
                params_dtype=self.config.params_dtype,
                rank=self.rank,
                world_size=self.world,
                skip_set_tensor_parallel_attributes=True,
            )
        _initialize_affine_weight_gpu(
            weight,
            self.init_method,
            partition_dim,
            stride,
            is_expert,
            rng_tracker=self.rng_tracker,
        )
        return None

    def check_tracker(self) -> None:
        """Fail at construction, not mid-init, when device init has no tracker."""
        cfg = self.config
        if cfg.perform_initialization and not cfg.use_cpu_initialization:
            if self.rng_tracker is None:
                raise InputValueError(
                    "config.use_cpu_initialization=False initialises on the device and needs "
                    "an RNG tracker: call mc_tp_layers.model_parallel_cuda_manual_seed(seed, "
                    "pg_collection=...) first (it registers the default) or pass its result "
                    "as rng_tracker=; or set use_cpu_initialization=True or "
                    "perform_initialization=False"
                )
            if not isinstance(self.rng_tracker, RNGStatesTracker):
                raise InputTypeError(
                    f"rng_tracker={self.rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker"
                )


# -- where a layer's parameters live, and their allocation ------------------------------


def _check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None); a wrong type is a ``TypeError``,
    a string torch cannot parse a ``ValueError``."""
    return None if device is None else _check_device_name(device)


def _check_tracker(rng_tracker: object) -> RNGStatesTracker | None:
    """``rng_tracker`` when it is an :class:`RNGStatesTracker` or None (checked whether or
    not this layer initialises on the device)."""
    if rng_tracker is not None and not isinstance(rng_tracker, RNGStatesTracker):
        raise InputTypeError(
            f"rng_tracker={rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker or None"
        )
    return rng_tracker


def _layer_device(
    device: torch.device | None, config: TransformerConfigLike, group: dist.ProcessGroup
) -> torch.device:
    """The explicit ``device``, else the default for the config and group."""
    if device is not None:
        return device
    return _default_device(config.use_cpu_initialization, group)


def _new_parameter(
    shape: tuple[int, ...], config: TransformerConfigLike, device: torch.device, what: str
) -> torch.nn.Parameter:
    """An uninitialised ``config.params_dtype`` parameter on ``device``.

    ``what`` names the layer and its sizes (``ColumnParallelLinear(input_size=..,
    output_size=..)``) for the error when the allocation fails (absurd sizes, a device out
    of memory): a ``RuntimeError`` naming them, the shape and the bytes asked for.
    """
    data = _allocate(shape, config.params_dtype, device, what)
    return torch.nn.Parameter(data)


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, what: str
) -> torch.Tensor:
    """``torch.empty(shape)``, or a ``RuntimeError`` naming ``what`` when it fails."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        numel = 1
        for size in shape:
            numel *= size
        gib = numel * dtype.itemsize / 2**30
        first_line = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        raise RuntimeError(
            f"{what} cannot allocate a {list(shape)} {dtype} tensor ({gib:,.1f} GiB) on "
            f"{device}: {first_line}; check the sizes (or the TP size that splits them)"
        ) from None


def _default_device(use_cpu_initialization: bool, group: dist.ProcessGroup) -> torch.device:
    """Where a layer allocates its parameters when the caller names no device.

    CPU initialisation keeps weights on CPU (as Megatron does); otherwise the current CUDA
    device when the group communicates through NCCL, else CPU (gloo worlds).
    """
    if use_cpu_initialization:
        return torch.device("cpu")
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
