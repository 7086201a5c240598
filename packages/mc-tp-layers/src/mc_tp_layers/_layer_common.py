"""Construction and forward checks shared by the three tensor-parallel layers."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_float_dtype, check_int, check_str, check_tensor
from mc_tp_layers._config import TensorParallelConfig
from mc_tp_layers._groups import default_device
from mc_tp_layers.attributes import set_tensor_model_parallel_attributes
from mc_tp_layers.initialization import (
    InitMethod,
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    check_init,
)
from mc_tp_layers.linear import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.random import RNGStatesTracker, _default_tracker, check_device_name

__all__: list[str] = []

_CONFIG_FIELDS = (
    "sequence_parallel",
    "params_dtype",
    "use_cpu_initialization",
    "perform_initialization",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit",
)
_CONFIG_FLAGS = (
    "sequence_parallel",
    "use_cpu_initialization",
    "perform_initialization",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
)
# Read with getattr and Megatron's defaults: (name, minimum, may be None).
_OPTIONAL_SIZES = (
    ("gtp_remat_size", 1, False),
    ("expert_model_parallel_size", 1, False),
    ("tensor_model_parallel_size", 1, False),
    ("expert_tensor_parallel_size", 1, True),
)


def check_config(config: object) -> TensorParallelConfig:
    """``config`` when it has every attribute the layers read, each of the right type.

    A config without an attribute, with a flag that is not a bool (``'no'`` would read as
    True), a size that is not an int, or a non-float ``params_dtype`` is a ``TypeError``
    naming ``config.<field>``; a negative size a ``ValueError``. Megatron's configs, and
    any object with these attributes, pass.
    """
    missing = [name for name in _CONFIG_FIELDS if not hasattr(config, name)]
    if missing:
        raise TypeError(
            f"config={type(config).__name__} lacks {missing}; pass a "
            "mc_groups.ModelParallelConfig (or any object with the attributes of "
            "mc_tp_layers.TensorParallelConfig)"
        )
    read: Any = config  # every field checked present above
    for name in _CONFIG_FLAGS:
        check_flag(f"config.{name}", getattr(read, name))
    if hasattr(read, "calculate_per_token_loss"):
        check_flag("config.calculate_per_token_loss", read.calculate_per_token_loss)
    check_float_dtype("config.params_dtype", read.params_dtype)
    check_int("config.wgrad_deferral_limit", read.wgrad_deferral_limit, minimum=0)
    for name, minimum, optional in _OPTIONAL_SIZES:
        value = getattr(config, name, None if optional else 1)
        if not (optional and value is None):
            check_int(f"config.{name}", value, minimum=minimum)
    return config  # type: ignore[return-value]


def gtp_remat_size(config: TensorParallelConfig) -> int:
    """``config.gtp_remat_size`` (1 when an older config lacks it)."""
    return check_int("config.gtp_remat_size", getattr(config, "gtp_remat_size", 1))


def expert_parallel(config: TensorParallelConfig) -> bool:
    """True when experts are split over more than one expert-parallel rank."""
    return int(getattr(config, "expert_model_parallel_size", 1)) > 1


def uses_expert_groups(config: TensorParallelConfig, is_expert: bool) -> bool:
    """Megatron-Core's ``use_expert_pgs``: an expert layer whose params are reduced over the
    expert data-parallel group (tagged ``allreduce=False``, kept in the expert buffer).

    True for ``is_expert`` when experts are split over EP ranks (``ep > 1``) or the expert
    TP size differs from the dense one (``etp != tp``, ``etp=None`` reading as ``tp``): then
    the expert-DP group differs from the dense dp_cp group, so the params cannot share the
    dense buffer. An expert layer with ``ep = 1`` and ``etp = tp`` is reduced like a dense
    one.
    """
    if not is_expert:
        return False
    tp = int(getattr(config, "tensor_model_parallel_size", 1))
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return expert_parallel(config) or (etp is not None and int(etp) != tp)


def sequence_parallel(config: TensorParallelConfig, world: int, what: str) -> bool:
    """``config.sequence_parallel``, switched off (with a warning) for a one-rank TP group."""
    if config.sequence_parallel and world == 1:
        warnings.warn(
            f"{what}: sequence_parallel=True with a tensor-parallel group of one rank; "
            "sequence parallelism is disabled for this layer",
            stacklevel=3,
        )
        return False
    return bool(config.sequence_parallel)


def check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None); a wrong type is a ``TypeError``,
    a string torch cannot parse a ``ValueError``."""
    return None if device is None else check_device_name(device)


def check_optional_str(name: str, value: object) -> str | None:
    """``value`` when it is a str or None, else a ``TypeError``."""
    return None if value is None else check_str(name, value)


def check_buffer(name: str, value: object) -> list[torch.Tensor] | None:
    """A list the layer appends to (embedding wgrad deferral), or None."""
    if value is not None and not isinstance(value, list):
        raise TypeError(f"{name} must be a list or None, got {type(value).__name__}")
    return value


def check_tracker(rng_tracker: object) -> RNGStatesTracker | None:
    """``rng_tracker`` when it is an :class:`RNGStatesTracker` or None (checked whether or
    not this layer initialises on the device)."""
    if rng_tracker is not None and not isinstance(rng_tracker, RNGStatesTracker):
        raise TypeError(
            f"rng_tracker={rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker or None"
        )
    return rng_tracker


def layer_device(
    device: torch.device | None, config: TensorParallelConfig, group: dist.ProcessGroup
) -> torch.device:
    """The explicit ``device``, else the default for the config and group."""
    if device is not None:
        return device
    return default_device(config.use_cpu_initialization, group)


def check_init_method(init_method: object) -> InitMethod:
    """``init_method`` when callable, else a ``TypeError``."""
    return check_init(init_method)


def new_parameter(
    shape: tuple[int, ...], config: TensorParallelConfig, device: torch.device, what: str
) -> torch.nn.Parameter:
    """An uninitialised ``config.params_dtype`` parameter on ``device``.

    ``what`` names the layer and its sizes (``ColumnParallelLinear(input_size=..,
    output_size=..)``) for the error when the allocation fails (absurd sizes, a device out
    of memory): a ``RuntimeError`` naming them, the shape and the bytes asked for.
    """
    data = allocate(shape, config.params_dtype, device, what)
    return torch.nn.Parameter(data)


def allocate(
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


class WeightInit:
    """How one layer initialises its weight (the arguments both init paths share)."""

    def __init__(
        self,
        config: TensorParallelConfig,
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
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
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
                raise ValueError(
                    "config.use_cpu_initialization=False initialises on the device and needs "
                    "an RNG tracker: call mc_tp_layers.model_parallel_cuda_manual_seed(seed, "
                    "pg_collection=...) first (it registers the default) or pass its result "
                    "as rng_tracker=; or set use_cpu_initialization=True or "
                    "perform_initialization=False"
                )
            if not isinstance(self.rng_tracker, RNGStatesTracker):
                raise TypeError(
                    f"rng_tracker={self.rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker"
                )


def zero_bias(bias: torch.Tensor, config: TensorParallelConfig) -> None:
    """Biases start at zero (when initialisation is performed)."""
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()


def check_input(input_: object, last: int, what: str) -> torch.Tensor:
    """A 2-D or 3-D floating-point tensor whose last dimension is ``last``.

    A non-tensor or integer tensor is a ``TypeError``, a wrong shape a ``ValueError``.
    """
    x = check_tensor("input_", input_)
    if not x.dtype.is_floating_point:
        raise TypeError(f"input_ holds {x.dtype}; {what} needs a floating-point input")
    if x.dim() not in (2, 3) or x.shape[-1] != last:
        raise ValueError(
            f"{what} expects input_ of shape [sequence, batch, {last}] (or [tokens, {last}]), "
            f"got {tuple(x.shape)}"
        )
    return x


def check_sequence(x: torch.Tensor, size: int) -> None:
    """Under SP the sequence (dim 0) must split evenly over the TP ranks."""
    if size > 1 and x.shape[0] % size:
        raise ValueError(
            f"input_ has shape {tuple(x.shape)}: under sequence_parallel its sequence length "
            f"{x.shape[0]} must be divisible by the tensor-parallel size {size}; pad the "
            "sequence"
        )


def default_extra_state(module: torch.nn.Module) -> None:
    """Let state dicts without ``_extra_state`` (saved before it existed) load strictly."""

    def hook(
        _module: torch.nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        *_args: Any,
    ) -> None:
        state_dict.setdefault(f"{prefix}_extra_state", None)

    module.register_load_state_dict_pre_hook(hook)  # type: ignore[no-untyped-call]


def tag_gtp_replica(param: torch.Tensor, gtp_group: dist.ProcessGroup | None) -> None:
    """Mark a parameter replicated over gtp_remat (dedup and checkpoint tags)."""
    if gtp_group is not None:
        param_attrs.mark_gtp_replica(param, gtp_group)


def forward_impl(
    input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Megatron's ``_forward_impl``: the frozen-weight path when the weight is not trained."""
    if not weight.requires_grad:
        return linear_with_frozen_weight(input, weight, *args, **kwargs)
    return linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)
