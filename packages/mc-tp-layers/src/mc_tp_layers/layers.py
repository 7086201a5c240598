r"""The tensor-parallel layers, with every name of Megatron-Core's
``core.tensor_parallel.layers`` documentation (``from megatron.core.tensor_parallel.layers
import X`` becomes ``from mc_tp_layers.layers import X``; the underscore helpers it
documents, ``_initialize_affine_weight_cpu`` / ``_gpu``, ``_linear_forward``,
``_wgrad_gemm``, ``_grad_accum_fusion_available`` and
``_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS``, import from here too, outside ``__all__``).

:class:`ColumnParallelLinear`, :class:`RowParallelLinear` and :class:`VocabParallelEmbedding`
(each class states its math and collective schedule) share two bases:
:class:`TensorParallelModule` (every layer: the config check, the TP peers' agreement at
construction, the DCP state dict over ``self.tp_group``) and :class:`ParallelLinear` (Column
and Row: Megatron's ``_forward_impl`` hook, Transformer-Engine compatibility stubs, building
the weight and bias once the subclass chose the split).

Check once at the boundary, then trust: the layer's configuration is checked when it is
built, and its TP peers compare how they built it at the end of its constructor (one 8-byte
exchange, :mod:`mc_tp_layers.agreement`). One route per forward, which communicates nothing
besides the layer's own collectives: each forward checks its arguments locally
(``_check_call``: the input, the operands' devices, dtypes and widths, ``main_grad`` under
gradient-accumulation fusion; a few attribute reads), as Megatron's layers do; then
Megatron's ``_forward_impl`` applies the linear autograd function (:mod:`mc_tp_layers.linear`)
on the checked arguments. Where a layer's parameters live and how they are initialised is
:mod:`mc_tp_layers.initialization`; the linear functions and their GEMMs,
:mod:`mc_tp_layers.linear`; the TP-region mappings, :mod:`mc_tp_layers.mappings`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mc_groups import ProcessGroupCollection, param_attrs
from mc_groups.argcheck import (
    check_flag,
    check_float_dtype,
    check_group,
    check_int,
    check_optional_str,
    check_tensor,
    type_name,
)
from mc_groups.collection import is_group_live
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_groups.param_attrs import (
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from mc_tp_layers import _gemm, agreement, initialization
from mc_tp_layers._config import (
    check_layer_config,
    check_tp_size,
    expert_parallel,
    gtp_remat_size,
    sequence_parallel,
    uses_expert_groups,
)
from mc_tp_layers.gtp import shard_weight_for_gtp, unsharded_shape
from mc_tp_layers.initialization import (
    InitMethod,
    WeightInit,
    _check_device,
    _check_init,
    _check_tracker,
    _layer_device,
    _new_parameter,
)
from mc_tp_layers.linear import (
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    _apply_linear,
    _check_main_grad,
    _check_operands,
    _Reduction,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.mappings import (
    _reduce_layer_output,
    _reduce_scatter_layer_output,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers.random import RNGStatesTracker
from mc_tp_layers.sharded_state import sharded_state_dict_of
from mc_tp_layers.utils import _check_index_range, _resolve_gtp_group, _resolve_tp_group

__all__ = [
    "ColumnParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "gtp_local_pad_zero_count",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_gtp_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

# Megatron's documented underscore names (importable from here, outside __all__)
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = param_attrs.MODEL_PARALLEL_ATTRIBUTE_DEFAULTS
_grad_accum_fusion_available = _gemm._grad_accum_fusion_available
_linear_forward = _gemm._linear_forward
_wgrad_gemm = _gemm._wgrad_gemm
_initialize_affine_weight_cpu = initialization._initialize_affine_weight_cpu
_initialize_affine_weight_gpu = initialization._initialize_affine_weight_gpu

_P = ParamSpec("_P")
_R = TypeVar("_R")


# -- construction steps every layer shares ------------------------------------------------


def _check_buffer(name: str, value: object) -> list[torch.Tensor] | None:
    """A list the layer appends to (embedding wgrad deferral), or None."""
    if value is not None and not isinstance(value, list):
        raise InputTypeError(f"{name} must be a list or None, got {type_name(value)}")
    return value


def _zero_bias(bias: torch.Tensor, config: TransformerConfigLike) -> None:
    """Biases start at zero (when initialisation is performed)."""
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()


def _default_extra_state(module: torch.nn.Module) -> None:
    """Let state dicts without ``_extra_state`` (saved before it existed) load strictly."""

    def hook(
        _module: torch.nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        *_args: Any,
    ) -> None:
        state_dict.setdefault(f"{prefix}_extra_state", None)

    module.register_load_state_dict_pre_hook(hook)  # type: ignore[no-untyped-call]


def _keep_param_attributes(
    module: torch.nn.Module, before: dict[str, torch.nn.Parameter | None]
) -> None:
    """Give each param ``torch.nn.Module._apply`` replaced by a new object (``to_empty``
    from meta onto a device does) the attributes of the one it replaced: mc's tags
    (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``, ``allreduce``, …,
    :mod:`mc_groups.param_attrs`) say how the param is split and reduced, and a param that
    lost them would be gathered, reduced and counted in the norm as a whole one."""
    for name, old in before.items():
        new = module._parameters.get(name)
        if old is None or new is None or new is old:
            continue
        for attr, value in vars(old).items():
            new.__dict__.setdefault(attr, value)


def _tag_gtp_replica(param: torch.Tensor, gtp_group: dist.ProcessGroup | None) -> None:
    """Mark a parameter replicated over gtp_remat (dedup and checkpoint tags)."""
    if gtp_group is not None:
        param_attrs.mark_gtp_replica(param, gtp_group)


def _check_divisible(value: object, size: int, arg: str, fix: str) -> int:
    """``value // size``, or a ``ValueError`` naming ``arg``, its value and ``fix``.

    Judged the same at every group size: ``value`` must be an int >= 1 even where ``size``
    is 1.
    """
    number = check_int(arg, value)
    if number % size:
        raise InputValueError(
            f"{arg}={number} is not divisible by the tensor-parallel size {size}; {fix}"
        )
    return number // size


def _check_input(input_: object, last: int, what: str) -> torch.Tensor:
    """A 2-D or 3-D floating-point tensor whose last dimension is ``last``.

    A non-tensor or integer tensor is a ``TypeError``, a wrong shape a ``ValueError``.
    """
    x = input_ if isinstance(input_, torch.Tensor) else check_tensor("input_", input_)
    if not x.dtype.is_floating_point:
        raise InputTypeError(f"input_ holds {x.dtype}; {what} needs a floating-point input")
    if x.dim() not in (2, 3) or x.shape[-1] != last:
        raise InputValueError(
            f"{what} expects input_ of shape [sequence, batch, {last}] (or [tokens, {last}]), "
            f"got {tuple(x.shape)}"
        )
    return x


def _check_sequence(x: torch.Tensor, size: int) -> None:
    """Under SP the sequence (dim 0) must split evenly over the TP ranks."""
    if size > 1 and x.shape[0] % size:
        raise InputValueError(
            f"input_ has shape {tuple(x.shape)}: under sequence_parallel its sequence length "
            f"{x.shape[0]} must be divisible by the tensor-parallel size {size}; pad the "
            "sequence"
        )


class TensorParallelModule(torch.nn.Module):
    """A layer whose parameters are split over ``self.tp_group`` (set by the subclass).

    The subclass ends its constructor with :meth:`_record_construction` (its TP peers
    compare how they built it, :mod:`mc_tp_layers.agreement`) and runs its forward's
    checks through :meth:`_checked`.
    """

    tp_group: dist.ProcessGroup

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = check_layer_config(config)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``torch.nn.Module._apply`` keeping each param's attributes
        (:func:`keep_param_attributes`)."""
        before = dict(self._parameters)
        applied = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        _keep_param_attributes(self, before)
        return applied

    def _record_construction(self, fields: dict[str, object], name: str | None = None) -> None:
        """Record this layer's params' marks by name
        (:func:`mc_groups.param_attrs.record_marks`), so a model of mc's layers under FSDP2's
        ``fully_shard``, which replaces the params, gets them back in every mc reader with no
        call of the user's; then compare what this layer was built with (``fields``, and the
        config's ``params_dtype``) with its TP peers: one exchange over ``self.tp_group``, a
        :class:`~mc_tp_layers.TensorParallelAgreementError` on every rank of the group when
        they differ (see :mod:`mc_tp_layers.agreement`). Last in the constructor."""
        param_attrs.record_marks(self)
        fields["params_dtype"] = self.config.params_dtype
        agreement._agree(self.tp_group, type(self).__name__, fields, name)

    def _checked(self, check: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """``check(*args)``: a forward's per-call checks (cheap, local: nothing is
        exchanged), once the TP group was found alive (a dictionary lookup)."""
        if not is_group_live(self.tp_group):
            check_group(f"{type(self).__name__}'s tp_group", self.tp_group)
        return check(*args, **kwargs)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """TP-sharded parameters as DTensors, the others as plain (replicated) tensors.

        ``ColumnParallelLinear``: sharding along axis 0, bias sharded.
        ``RowParallelLinear``: sharding along axis 1, bias not sharded (a plain, replicated
        tensor). ``VocabParallelEmbedding``: the vocabulary-sharded table (a DTensor
        sharded along axis 0).

        Returns ``{prefix + "weight": DTensor, ...}`` for ``torch.distributed.checkpoint``
        (views of the parameters: loading writes into them). See
        :mod:`mc_tp_layers.sharded_state`.
        """
        return sharded_state_dict_of(self, self.tp_group, prefix, sharded_offsets, metadata)


class ParallelLinear(TensorParallelModule):
    """What ``ColumnParallelLinear`` and ``RowParallelLinear`` share besides their split."""

    is_expert: bool
    expert_parallel: bool
    gtp_group: dist.ProcessGroup | None
    master_weight: torch.Tensor | None
    bias: torch.nn.Parameter | None

    def __init__(self, config: object, input_size: int, output_size: int) -> None:
        super().__init__(config)
        self.input_size, self.output_size = input_size, output_size
        self.master_weight = None
        _default_extra_state(self)

    def _weight_and_bias(self) -> tuple[Any, Any]:
        """``(self.weight, self.bias)``, read from ``_parameters`` where registered there
        (``Module.__getattr__`` costs ~0.6 µs a read, several per forward of a small
        layer); otherwise (a parametrization's property, a plain attribute) as attributes."""
        params = self._parameters  # not .get(name, self.name): that reads the attribute too
        weight = params["weight"] if "weight" in params else self.weight  # noqa: SIM401
        bias = params["bias"] if "bias" in params else self.bias  # noqa: SIM401
        return weight, bias

    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Megatron's hook for the layer's linear (override it to replace the linear; its
        result is what the layer goes on with: gathered by a Column layer with
        ``gather_output``, reduced by a Row layer). Called by forward with Megatron's
        keyword arguments, checked: the frozen-weight function
        (:func:`~mc_tp_layers.linear.linear_with_frozen_weight`) when ``weight`` does not
        require grad, else the linear function applied directly
        (``linear._apply_linear``)."""
        if not weight.requires_grad:
            return linear_with_frozen_weight(input, weight, *args, **kwargs)
        return _apply_linear(input, weight, *args, **kwargs)

    def backward_dw(self) -> None:
        """Delayed wgrad computation (``delay_wgrad_compute``): not supported, does nothing.

        The weight gradient is always computed in backward.
        """

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (kept for Transformer-Engine state-dict compatibility)."""

    def get_extra_state(self) -> None:
        """None: there is no extra state (the key keeps TE state dicts loadable)."""
        return

    def _check_split(
        self, unsplit_size: int, side: str, per_partition: int, stride: int, init_method: object
    ) -> None:
        """The other side's size and ``stride`` positive, ``stride`` dividing the split ``side``.

        ``side`` is the dimension of A split over TP (``"output"`` or ``"input"``), whose
        per-rank size is ``per_partition``.
        """
        unsplit = "input" if side == "output" else "output"
        check_int(f"{unsplit}_size", unsplit_size)
        check_int("stride", stride)
        _check_init(init_method)
        if per_partition % stride:
            total = self.output_size if side == "output" else self.input_size
            raise InputValueError(
                f"stride={stride} must divide the per-rank {side} size {per_partition} "
                f"({side}_size={total} over {self.tp_group.size()} ranks)"
            )

    def _allreduce(self) -> bool:
        """The params' ``allreduce`` tag: ``not (is_expert and (ep > 1 or etp != tp))``
        (see :func:`._config.uses_expert_groups`)."""
        return not uses_expert_groups(self.config, self.is_expert)

    def _new_weight(
        self,
        init: WeightInit,
        device: torch.device,
        shape: tuple[int, int],
        partition_dim: int,
        stride: int,
        keep_master: bool,
    ) -> torch.nn.Parameter:
        """This rank's ``shape`` of the ``[output_size, input_size]`` weight, initialised."""
        weight = _new_parameter(shape, self.config, device, self._sizes())
        self.master_weight = init.run(
            weight,
            (self.output_size, self.input_size),
            partition_dim,
            stride,
            is_expert=self.is_expert,
            keep_master=keep_master,
        )
        param_attrs.mark_allreduce(weight, self._allreduce())
        if self.gtp_group is not None:
            weight = shard_weight_for_gtp(
                weight,
                self.gtp_group,
                calculate_per_token_loss=bool(
                    getattr(self.config, "calculate_per_token_loss", False)
                ),
            )
        return weight

    def _new_bias(
        self, device: torch.device, size: int, is_parallel: bool, dim: int, stride: int
    ) -> torch.nn.Parameter:
        """A bias of ``size`` (zeroed when initialising) with its TP attributes and tags."""
        bias = _new_parameter((size,), self.config, device, self._sizes())
        param_attrs.set_tensor_model_parallel_attributes(bias, is_parallel, dim, stride)
        _zero_bias(bias, self.config)
        param_attrs.mark_allreduce(bias, self._allreduce())
        _tag_gtp_replica(bias, self.gtp_group)
        return bias

    def _set_bias(self, bias: torch.nn.Parameter | None) -> None:
        """Register ``bias`` (None: no bias; ``self.bias`` reads None, as in ``nn.Linear``)."""
        self.register_parameter("bias", bias)

    def _sizes(self) -> str:
        return (
            f"{type(self).__name__}(input_size={self.input_size}, output_size={self.output_size})"
        )

    def _repr_sizes(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, TP={self.tp_group.size()}"
        )


class ColumnParallelLinear(ParallelLinear):
    """Linear layer with column parallelism.

    ::

                A = [ A_1 | A_2 | … | A_W ]           (torch stores Aᵀ: weight [n/W, k] per rank)
        rank r: Y_r = X · A_r + b_r                    ([s, b, n/W])
                Y   = [ Y_1 | … | Y_W ]                (only with gather_output)

    Collectives (W > 1; a weight that does not require grad uses the frozen-weight path):

        sequence_parallel off:  forward  —                        (all-gather Y if gather_output)
                                backward one all-reduce of dX      (async, overlaps the wgrad GEMM)
        sequence_parallel on:   forward  one all-gather of X along dim 0
                                backward one all-gather of X (async, overlaps the dgrad GEMM) and
                                         one reduce-scatter of dX (async, issued before the wgrad
                                         GEMM runs)

    Experts (``is_expert`` with TP or EP > 1) communicate explicitly in the MoE layer: no
    collective here. ``disable_grad_reduce`` drops the dX all-reduce (e.g. LoRA adapters).

    Args:
        input_size: k, the first dimension of A (the input features).
        output_size: n, the second dimension of A; must divide by the TP size.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        init_method: fills a weight tensor in place; the bias always starts at zero.
        bias: allocate a bias ``[n/W]`` (TP-sharded like the weight).
        gather_output: all-gather Y so every rank holds ``[s, b, n]``.
        stride: the weight's parts are strided (fused weights; see
            :mod:`mc_tp_layers.initialization`).
        keep_master_weight_for_test: keep the CPU-initialised master weight as
            ``self.master_weight``.
        skip_bias_add: return the bias instead of adding it (for fusion by the caller).
        skip_weight_param_allocation: allocate no weight; forward must get ``weight=``.
        embedding_activation_buffer: with ``config.defer_embedding_wgrad_compute``, holds
            the inputs whose wgrad is deferred.
        grad_output_buffer: with ``config.defer_embedding_wgrad_compute``, holds the
            output gradients whose wgrad is deferred.
        is_expert: an MoE expert layer (``expt_tp`` group; no collectives here).
        tp_comm_buffer_name: Transformer-Engine userbuffer name; unused.
        disable_grad_reduce: skip the all-reduce of dX.
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        name: a label kept as ``self.name``.
        output_dtype: dtype of Y when it should differ from X's.
        pg_collection: groups to read ``tp`` / ``gtp_remat`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition: Megatron
            reads a global one).
        device: where to allocate (mc addition; default: CPU under CPU initialisation,
            else the group's device).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfigLike,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        output_dtype: torch.dtype | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, input_size, output_size)
        self.gather_output = check_flag("gather_output", gather_output)
        self.skip_bias_add = check_flag("skip_bias_add", skip_bias_add)
        self.is_expert = check_flag("is_expert", is_expert)
        self.disable_grad_reduce = check_flag("disable_grad_reduce", disable_grad_reduce)
        with_bias = check_flag("bias", bias)
        keep_master = check_flag("keep_master_weight_for_test", keep_master_weight_for_test)
        skip_weight = check_flag("skip_weight_param_allocation", skip_weight_param_allocation)
        self.embedding_activation_buffer = _check_buffer(
            "embedding_activation_buffer", embedding_activation_buffer
        )
        self.grad_output_buffer = _check_buffer("grad_output_buffer", grad_output_buffer)
        self.tp_comm_buffer_name = check_optional_str("tp_comm_buffer_name", tp_comm_buffer_name)
        self.name = check_optional_str("name", name)
        self.output_dtype = check_float_dtype("output_dtype", output_dtype, allow_none=True)
        tracker = _check_tracker(rng_tracker)
        explicit_device = _check_device(device)
        self.tp_group = _resolve_tp_group(
            tp_group, pg_collection, is_expert=self.is_expert, what="ColumnParallelLinear"
        )
        check_tp_size(self.config, self.tp_group.size(), self.is_expert, "ColumnParallelLinear")
        self.output_size_per_partition = _check_divisible(
            output_size,
            self.tp_group.size(),
            "output_size",
            "choose an output_size that is a multiple of it",
        )
        self._check_arguments(input_size, stride, init_method)
        self._set_communication(pg_collection)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        target = _layer_device(explicit_device, self.config, self.tp_group)
        self.weight: torch.nn.Parameter | None = None
        if not skip_weight:
            init.check_tracker()
            shape = (self.output_size_per_partition, self.input_size)
            self.weight = self._new_weight(init, target, shape, 0, stride, keep_master)
        self._set_bias(
            self._new_bias(target, self.output_size_per_partition, True, 0, stride)
            if with_bias
            else None
        )
        self._record_construction(
            {
                "input_size": input_size,
                "output_size": output_size,
                "bias": with_bias,
                "gather_output": self.gather_output,
                "skip_bias_add": self.skip_bias_add,
                "sequence_parallel": self.sequence_parallel,
                "stride": stride,
                "is_expert": self.is_expert,
                "explicit_expert_comm": self.explicit_expert_comm,
                "disable_grad_reduce": self.disable_grad_reduce,
                "gtp_remat_size": self.gtp_remat_size,
                "output_dtype": self.output_dtype,
                "defer_embedding_wgrad_compute": self.config.defer_embedding_wgrad_compute,
                "wgrad_deferral_limit": self.config.wgrad_deferral_limit,
            },
            self.name,
        )

    def _set_communication(self, pg_collection: ProcessGroupCollection | None) -> None:
        """Which collectives this layer issues (see the module notes)."""
        world = int(self.tp_group.size())
        self.gtp_remat_size = gtp_remat_size(self.config)
        self.gtp_group = _resolve_gtp_group(
            self.gtp_remat_size,
            pg_collection,
            is_expert=self.is_expert,
            what="ColumnParallelLinear",
        )
        self.expert_parallel = expert_parallel(self.config)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.sequence_parallel = sequence_parallel(self.config, world, "ColumnParallelLinear")
        self.allreduce_dgrad = (
            world > 1 and not self.sequence_parallel and not self.disable_grad_reduce
        )
        self.gradient_accumulation_fusion = bool(self.config.gradient_accumulation_fusion)
        # f (identity forward, all-reduce of dX in backward) only where the linear function
        # does not reduce dX itself and nothing else does (Megatron's condition)
        self._copy_input = not (
            self.allreduce_dgrad
            or self.sequence_parallel
            or self.explicit_expert_comm
            or self.disable_grad_reduce
        )

    def _check_arguments(self, input_size: int, stride: int, init_method: object) -> None:
        self._check_split(input_size, "output", self.output_size_per_partition, stride, init_method)
        if self.config.defer_embedding_wgrad_compute and (
            self.embedding_activation_buffer is None or self.grad_output_buffer is None
        ):
            raise InputValueError(
                "config.defer_embedding_wgrad_compute=True needs embedding_activation_buffer "
                "and grad_output_buffer lists; pass both (e.g. [] and [])"
            )

    def _resolve_weight(
        self, weight: torch.Tensor | None, own: torch.nn.Parameter | None
    ) -> torch.Tensor:
        """``weight`` (checked), else the layer's own weight ``own``."""
        if weight is None:
            if own is None:
                raise InputValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True, so "
                    "forward needs weight=<tensor of shape "
                    f"[{self.output_size_per_partition}, {self.input_size}]>"
                )
            return own
        check_tensor("weight", weight)
        expected = (self.output_size_per_partition, self.input_size)
        actual = unsharded_shape(weight) if self.gtp_remat_size > 1 else tuple(weight.shape)
        if tuple(actual) != expected:
            raise InputValueError(
                f"weight has shape {tuple(weight.shape)} but this layer needs {list(expected)} "
                f"([output_size / TP size, input_size])"
            )
        return weight

    def _check_call(
        self, input_: object, weight: torch.Tensor | None, runtime_gather_output: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A forward's arguments checked: the input, the weight and the bias to add."""
        own_weight, own_bias = self._weight_and_bias()
        w = self._resolve_weight(weight, own_weight)
        x = _check_input(input_, self.input_size, "ColumnParallelLinear")
        bias = None if self.skip_bias_add else own_bias
        _check_operands(x, w, bias, self.output_dtype, self.output_size_per_partition)
        if runtime_gather_output is not None:
            check_flag("runtime_gather_output", runtime_gather_output)
        if self.gradient_accumulation_fusion and w.requires_grad:
            _check_main_grad(w)
        return x, w, bias

    def _defer_activation(self, input_parallel: torch.Tensor) -> None:
        buffer = self.embedding_activation_buffer
        limit = self.config.wgrad_deferral_limit
        if buffer is not None and (limit == 0 or len(buffer) < limit):
            buffer.append(input_parallel)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Y, bias)``: Y ``[s, b, n/W]`` (``[s, b, n]`` gathered); bias when ``skip_bias_add``.

        Args:
            input_: ``[s, b, k]`` (``[s/W, b, k]`` under sequence parallelism), or 2-D.
            weight: the weight to use (needed with ``skip_weight_param_allocation``).
            runtime_gather_output: overrides ``gather_output`` for this call (a bool, or
                None to keep it).
        """
        x, w, bias = self._checked(self._check_call, input_, weight, runtime_gather_output)
        deferring = self.config.defer_embedding_wgrad_compute and w.requires_grad
        if self._copy_input:
            x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        if deferring:
            self._defer_activation(x)
        expert = self.explicit_expert_comm
        output_parallel = self._forward_impl(
            input=x,
            weight=w,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False if expert else self.allreduce_dgrad,
            sequence_parallel=False if expert else self.sequence_parallel,
            grad_output_buffer=self.grad_output_buffer if deferring else None,
            wgrad_deferral_limit=self.config.wgrad_deferral_limit if deferring else None,
            tp_group=self.tp_group,
            gtp_remat_size=self.gtp_remat_size,
            output_dtype=self.output_dtype,
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        """Sizes, bias and TP degree, e.g. ``in_features=8, out_features=16, bias=True, TP=2``."""
        return (
            f"{self._repr_sizes()}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(ParallelLinear):
    """Linear layer with row parallelism.

    ::

                A = [ A_1 ; A_2 ; … ; A_W ]  (rows)    X = [ X_1 | … | X_W ]   (last dim)
        rank r: Y_r = X_r · A_r                        (a partial sum, [s, b, n])
                Y   = Σ_r Y_r + b                       (all-reduce, or reduce-scatter along
                                                        dim 0 under sequence parallelism)

    torch stores Aᵀ: the weight is ``[n, k/W]`` per rank; the bias ``[n]`` is replicated and
    added after the reduction.

    Collectives (W > 1)::

        sequence_parallel off: forward  one all-reduce of Y          backward —
        sequence_parallel on:  forward  one reduce-scatter of Y      backward one all-gather
                                        along dim 0                           of dY along dim 0

    With ``input_is_parallel=False`` the input ``[.., k]`` is first split along its last dim
    (no communication; backward all-gathers dX). Experts (``is_expert`` with TP or EP > 1)
    return the partial sums: the MoE layer reduces them.

    Args:
        input_size: k, the first dimension of A; must divide by the TP size.
        output_size: n, the second dimension of A.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        init_method: fills a weight tensor in place; the bias always starts at zero.
        bias: allocate a replicated bias ``[n]``.
        input_is_parallel: the input is already split along its last dim (required under
            sequence parallelism).
        skip_bias_add: return the bias instead of adding it.
        stride: the weight's parts are strided along the input dim.
        keep_master_weight_for_test: keep the CPU master weight as ``self.master_weight``.
        is_expert: an MoE expert layer (``expt_tp`` group; no reduction here).
        tp_comm_buffer_name: Transformer-Engine userbuffer name; unused.
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        name: a label kept as ``self.name``.
        pg_collection: groups to read ``tp`` / ``gtp_remat`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition).
        device: where to allocate (mc addition).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfigLike,
        init_method: InitMethod,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, input_size, output_size)
        self.input_is_parallel = check_flag("input_is_parallel", input_is_parallel)
        self.skip_bias_add = check_flag("skip_bias_add", skip_bias_add)
        self.is_expert = check_flag("is_expert", is_expert)
        with_bias = check_flag("bias", bias)
        keep_master = check_flag("keep_master_weight_for_test", keep_master_weight_for_test)
        self.tp_comm_buffer_name = check_optional_str("tp_comm_buffer_name", tp_comm_buffer_name)
        self.name = check_optional_str("name", name)
        tracker = _check_tracker(rng_tracker)
        explicit_device = _check_device(device)
        self.sequence_parallel = self.config.sequence_parallel
        if self.sequence_parallel and not self.input_is_parallel:
            raise InputValueError(
                "config.sequence_parallel=True needs input_is_parallel=True: under sequence "
                "parallelism the input arrives split along its last dim"
            )
        self.tp_group = _resolve_tp_group(
            tp_group, pg_collection, is_expert=self.is_expert, what="RowParallelLinear"
        )
        check_tp_size(self.config, self.tp_group.size(), self.is_expert, "RowParallelLinear")
        world = int(self.tp_group.size())
        self.input_size_per_partition = _check_divisible(
            input_size, world, "input_size", "choose an input_size that is a multiple of it"
        )
        self._check_split(output_size, "input", self.input_size_per_partition, stride, init_method)
        self.gtp_remat_size = gtp_remat_size(self.config)
        self.gtp_group = _resolve_gtp_group(
            self.gtp_remat_size, pg_collection, is_expert=self.is_expert, what="RowParallelLinear"
        )
        self.expert_parallel = expert_parallel(self.config)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.gradient_accumulation_fusion = self.config.gradient_accumulation_fusion
        # How the output is reduced over TP (None: an expert's partial sums stay as they
        # are, the MoE layer reduces them; nothing to reduce on one rank), and whether
        # _forward_impl does it (its default; an override returns the partial sums)
        self._reduction: _Reduction | None = None
        if not self.explicit_expert_comm and world > 1:
            self._reduction = "reduce-scatter" if self.sequence_parallel else "all-reduce"
        self._linear_reduces = type(self)._forward_impl is RowParallelLinear._forward_impl
        target = _layer_device(explicit_device, self.config, self.tp_group)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        init.check_tracker()
        shape = (self.output_size, self.input_size_per_partition)
        self.weight = self._new_weight(init, target, shape, 1, stride, keep_master)
        self._set_bias(self._make_bias(target) if with_bias else None)
        self._record_construction(
            {
                "input_size": input_size,
                "output_size": output_size,
                "bias": with_bias,
                "input_is_parallel": self.input_is_parallel,
                "skip_bias_add": self.skip_bias_add,
                "sequence_parallel": self.sequence_parallel,
                "stride": stride,
                "is_expert": self.is_expert,
                "explicit_expert_comm": self.explicit_expert_comm,
                "gtp_remat_size": self.gtp_remat_size,
            },
            self.name,
        )

    def _make_bias(self, device: torch.device) -> torch.nn.Parameter:
        bias = self._new_bias(device, self.output_size, False, -1, 1)
        # Under SP each rank's bias gradient sums only its own rows: finalize_model_grads
        # all-reduces parameters tagged sequence_parallel over the dense TP group. An expert
        # layer's bias is not tagged (mc differs from Megatron-Core here): its tokens come
        # from the MoE dispatcher, not from a reduce-scatter over the dense TP group, and its
        # grad is reduced by DDP (over expt_dp when ETP != TP), so the TP sum would double
        # count it (a doubled grad at TP = 2, ETP = 1: integration_tests/test_parity_experts).
        tagged = self.sequence_parallel and not self.is_expert
        param_attrs.mark_sequence_parallel(bias, tagged)
        return bias

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Y, bias)``: Y ``[s, b, n]`` (``[s/W, b, n]`` under SP); bias when ``skip_bias_add``.

        Args:
            input_: ``[s, b, k/W]`` when ``input_is_parallel`` else ``[s, b, k]`` (or 2-D).
        """
        x, weight, bias = self._checked(self._check_call, input_)
        if not (self.input_is_parallel or self.explicit_expert_comm):
            x = scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        output = self._forward_impl(
            input=x,
            weight=weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
            gtp_remat_size=self.gtp_remat_size,
        )
        if not self._linear_reduces:
            output = self._reduce(output)
        if self.skip_bias_add or bias is None:
            return output, bias if self.skip_bias_add else None
        return output + bias, None

    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Megatron's hook for the layer's linear; this default also reduces the output
        over TP (all-reduce, or reduce-scatter along dim 0 under sequence parallelism;
        nothing for an expert layer): in the linear's own autograd node when the weight
        is trained (``linear._apply_linear``'s ``reduce_output``: one
        node less per call than Megatron's two Functions, same collectives and values),
        else after the frozen-weight function. An override keeps Megatron's contract: it
        returns the partial sums, and forward reduces them (``_linear_reduces``, decided
        when the layer is built)."""
        if self._reduction is None or not weight.requires_grad:
            return self._reduce(super()._forward_impl(input, weight, *args, **kwargs))
        return _apply_linear(input, weight, *args, reduce_output=self._reduction, **kwargs)

    def _check_call(
        self, input_: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter | None]:
        """A forward's input checked, with the weight and bias it meets."""
        last = self.input_size_per_partition if self.input_is_parallel else self.input_size
        x = _check_input(input_, last, "RowParallelLinear")
        weight, bias = self._weight_and_bias()
        _check_operands(x, weight, None, None, width=self.input_size_per_partition)
        if self.sequence_parallel and not self.explicit_expert_comm:
            _check_sequence(x, int(self.tp_group.size()))
        if self.gradient_accumulation_fusion and weight.requires_grad:
            _check_main_grad(weight)
        return x, weight, bias

    def _reduce(self, output_parallel: torch.Tensor) -> torch.Tensor:
        """Megatron's reduction of the partial sums, as its own autograd Function."""
        if self.explicit_expert_comm:
            return output_parallel
        if self.sequence_parallel:
            return _reduce_scatter_layer_output(output_parallel, self.tp_group)
        return _reduce_layer_output(output_parallel, self.tp_group)

    def extra_repr(self) -> str:
        """Sizes, bias and TP degree, e.g. ``in_features=16, out_features=8, bias=True, TP=2``."""
        return (
            f"{self._repr_sizes()}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding parallelized in the vocabulary dimension.

    ::

        table E [V, h]  =  [ E_1 ; E_2 ; … ; E_W ]      rank r holds rows [r·V/W, (r+1)·V/W)
        rank r: out_r[t] = E_r[id_t - r·V/W]  if id_t is in its range, else 0
        out = Σ_r out_r                                   (all-reduce), or, with
                                                          reduce_scatter_embeddings, a
                                                          reduce-scatter along the sequence

    Collectives (W > 1): forward one all-reduce (or one reduce-scatter of ``[s, b, h]``, the
    ``[b, s]`` ids transposed to sequence-first); backward none (or one all-gather along dim
    0).

    Ids must lie in ``[0, V)`` at every TP size (``F.embedding``'s rule; without the check an
    id outside would embed to zeros at TP > 1). On CPU that is a ``ValueError`` before any
    collective; on a device an asynchronous device assert, which costs no host
    synchronisation (see :mod:`mc_tp_layers.utils`).

    Args:
        num_embeddings: V, the vocabulary size; must divide by the TP size.
        embedding_dim: h, the hidden size.
        init_method: fills the table in place.
        reduce_scatter_embeddings: reduce-scatter the ``[s, b, h]`` output along the
            sequence (sequence parallelism) instead of all-reducing ``[b, s, h]``.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        pg_collection: groups to read ``tp`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition).
        device: where to allocate (mc addition).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        reduce_scatter_embeddings: bool = False,
        config: TransformerConfigLike,
        tp_group: dist.ProcessGroup | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = check_flag(
            "reduce_scatter_embeddings", reduce_scatter_embeddings
        )
        tracker = _check_tracker(rng_tracker)
        explicit_device = _check_device(device)
        self.tp_group = _resolve_tp_group(tp_group, pg_collection, what="VocabParallelEmbedding")
        check_tp_size(self.config, self.tp_group.size(), False, "VocabParallelEmbedding")
        rank, world = int(self.tp_group.rank()), int(self.tp_group.size())
        self.num_embeddings_per_partition = _check_divisible(
            num_embeddings,
            world,
            "num_embeddings",
            "pad the vocabulary to a multiple of it (Megatron's make-vocab-size-divisible-by)",
        )
        check_int("embedding_dim", embedding_dim)
        _check_init(init_method)
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        target = _layer_device(explicit_device, self.config, self.tp_group)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        init.check_tracker()
        shape = (self.num_embeddings_per_partition, embedding_dim)
        what = (
            f"VocabParallelEmbedding(num_embeddings={num_embeddings}, "
            f"embedding_dim={embedding_dim})"
        )
        self.weight = _new_parameter(shape, self.config, target, what)
        init.run(self.weight, (num_embeddings, embedding_dim), 0, 1)
        param_attrs.mark_allreduce(self.weight, True)
        self._record_construction(
            {
                "num_embeddings": num_embeddings,
                "embedding_dim": embedding_dim,
                "reduce_scatter_embeddings": self.reduce_scatter_embeddings,
            }
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embeddings of the token ids ``input_`` (``[b, s]``), summed over the TP ranks.

        Returns ``[b, s, h]``, or ``[s/W, b, h]`` with ``reduce_scatter_embeddings``. Ids
        outside ``[0, num_embeddings)`` are an error (see the module notes).
        """
        ids = self._checked(self._check_ids, input_)
        world = int(self.tp_group.size())
        if world > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            output_parallel = F.embedding(local, self.weight).masked_fill(
                outside.unsqueeze(-1), 0.0
            )
        else:
            output_parallel = F.embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            sequence_first = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(sequence_first, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def _check_ids(self, input_: object) -> torch.Tensor:
        if not isinstance(input_, torch.Tensor):
            raise InputTypeError(
                f"input_ must be a torch.Tensor of token ids, got {type_name(input_)}"
            )
        if input_.dtype not in (torch.int64, torch.int32):
            raise InputTypeError(
                f"input_ holds {input_.dtype}; token ids must be an integer tensor "
                "(torch.int64 or torch.int32)"
            )
        if input_.device != self.weight.device:
            raise InputValueError(
                f"input_ is on {input_.device} but the embedding table is on "
                f"{self.weight.device}; move the ids there (ids.to(device))"
            )
        if self.reduce_scatter_embeddings:
            if input_.dim() != 2:
                raise InputValueError(
                    f"reduce_scatter_embeddings needs ids of shape [batch, sequence], got "
                    f"{tuple(input_.shape)}"
                )
            _check_sequence(input_.transpose(0, 1), int(self.tp_group.size()))
        _check_index_range(
            input_,
            self.num_embeddings,
            "input_",
            "token id(s)",
            f"ids index the num_embeddings={self.num_embeddings} rows of the vocabulary; map "
            "unknown or padding tokens to an id inside it",
        )
        return input_

    def extra_repr(self) -> str:
        """Sizes and TP degree."""
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"TP={self.tp_group.size()}, reduce_scatter_embeddings={self.reduce_scatter_embeddings}"
        )
