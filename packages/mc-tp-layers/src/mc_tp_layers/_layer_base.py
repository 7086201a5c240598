"""What the three tensor-parallel layers share: their construction steps and two base
classes.

Construction: the arguments every layer takes besides its sizes (``device``,
``rng_tracker``, the deferral buffers), where its parameters live and how they are
allocated (an allocation that fails names the layer and its sizes).
:class:`TensorParallelModule` (every layer): the config check, the TP peers' agreement on
the first forward, the DCP state dict over ``self.tp_group``. :class:`ParallelLinear`
(Column and Row): the frozen-weight dispatch, Transformer-Engine compatibility stubs, and
building the weight and bias once the subclass chose the split.

The config's own checks and what the layers derive from it are in :mod:`._config`, the
weight initialisation in :mod:`.initialization`, the shape checks in :mod:`._validate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_group, check_int, type_name
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import agreement
from mc_tp_layers._config import check_layer_config, uses_expert_groups
from mc_tp_layers._tp_groups import default_device
from mc_tp_layers.attributes import set_tensor_model_parallel_attributes
from mc_tp_layers.gtp import shard_weight_for_gtp
from mc_tp_layers.initialization import WeightInit, check_init
from mc_tp_layers.linear import apply_linear, linear_with_frozen_weight
from mc_tp_layers.random import RNGStatesTracker, check_device_name
from mc_tp_layers.sharded_state import sharded_state_dict_of

__all__: list[str] = []

_P = ParamSpec("_P")
_R = TypeVar("_R")


def check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None); a wrong type is a ``TypeError``,
    a string torch cannot parse a ``ValueError``."""
    return None if device is None else check_device_name(device)


def check_buffer(name: str, value: object) -> list[torch.Tensor] | None:
    """A list the layer appends to (embedding wgrad deferral), or None."""
    if value is not None and not isinstance(value, list):
        raise InputTypeError(f"{name} must be a list or None, got {type_name(value)}")
    return value


def check_tracker(rng_tracker: object) -> RNGStatesTracker | None:
    """``rng_tracker`` when it is an :class:`RNGStatesTracker` or None (checked whether or
    not this layer initialises on the device)."""
    if rng_tracker is not None and not isinstance(rng_tracker, RNGStatesTracker):
        raise InputTypeError(
            f"rng_tracker={rng_tracker!r} must be a mc_tp_layers.RNGStatesTracker or None"
        )
    return rng_tracker


def layer_device(
    device: torch.device | None, config: TransformerConfigLike, group: dist.ProcessGroup
) -> torch.device:
    """The explicit ``device``, else the default for the config and group."""
    if device is not None:
        return device
    return default_device(config.use_cpu_initialization, group)


def new_parameter(
    shape: tuple[int, ...], config: TransformerConfigLike, device: torch.device, what: str
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


def zero_bias(bias: torch.Tensor, config: TransformerConfigLike) -> None:
    """Biases start at zero (when initialisation is performed)."""
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()


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


def keep_param_attributes(
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


def tag_gtp_replica(param: torch.Tensor, gtp_group: dist.ProcessGroup | None) -> None:
    """Mark a parameter replicated over gtp_remat (dedup and checkpoint tags)."""
    if gtp_group is not None:
        param_attrs.mark_gtp_replica(param, gtp_group)


class _TracedCheckFailed(Exception):
    """This rank's first-forward check failed while tracing (its own error follows)."""


def _first_forward_exchanges(group_name: str, where: str, failure: str | None) -> bool:
    """A TP layer's first-forward exchanges over its group (``group_name``), run natively
    while Dynamo traces the layer (as ``_first_forward_at_trace``).

    Marked as ``torch.compiler.assume_constant_result`` does: Dynamo calls it as plain Python
    when it meets it and keeps only its (constant) result, so the exchanges happen at trace
    time, outside any graph, and the compiled graph has no break. Every rank traces the
    same frames, so the exchanges pair up across the TP group as the eager first forward's
    do: the status exchange (:func:`mc_groups.fail_together`; a rank whose traced checks
    failed passes its error text, its peers raise :class:`~mc_groups.PeerCheckError`,
    wrapped by Dynamo, and the failing rank its own error), then the agreement of the
    group's pending constructions. Returns whether this rank passed.

    It takes the group's name, never the layer or its fingerprint: Dynamo guards on what
    it passes here (a per-layer object by identity), and a per-layer argument would make
    every block of a model (one code object) compile again, up to Dynamo's recompile
    limit (8), past which ``fullgraph=True`` fails. (The group object itself reaches
    this function as a fake while tracing, hence its name.) Keyed by the group, the
    blocks share one graph; a block that reuses it traces nothing and exchanges nothing
    (its constructions were settled with the group's by the first trace, and its traced
    checks are the first block's, under the same guards). Each trace exchanges (one
    small message per traced layer, at trace time only).
    """
    resolve: Any = getattr(dist.distributed_c10d, "_resolve_process_group")  # noqa: B009
    group: dist.ProcessGroup = resolve(group_name)
    if group.size() > 1:
        try:
            with mg.fail_together(group, where):
                if failure is not None:
                    raise _TracedCheckFailed(failure)
        except _TracedCheckFailed:
            return False
        agreement.settle_group(group)
    return failure is None


# What torch.compiler.assume_constant_result(fn) does (torch 2.13: it sets this attribute),
# done here directly: calling it at import would import torch._dynamo (and with it
# torch.distributed.tensor, about a second) into every process that imports mc_tp_layers.
# The compile tests fail (a graph break) if torch stops honouring it.
_first_forward_exchanges._dynamo_marked_constant = True  # type: ignore[attr-defined]
_first_forward_at_trace: Callable[[str, str, str | None], bool] = _first_forward_exchanges


class TensorParallelModule(torch.nn.Module):
    """A layer whose parameters are split over ``self.tp_group`` (set by the subclass).

    The subclass ends its constructor with :meth:`_record_construction` and runs its
    forward's checks through :meth:`_checked` (see :mod:`mc_tp_layers.agreement`).
    """

    tp_group: dist.ProcessGroup
    _tp_agreement: agreement.LayerFingerprint

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = check_layer_config(config)
        self._peers_checked = False  # set by the first forward (see _checked)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``torch.nn.Module._apply`` keeping each param's attributes
        (:func:`keep_param_attributes`)."""
        before = dict(self._parameters)
        applied = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        keep_param_attributes(self, before)
        return applied

    def _record_construction(self, fields: dict[str, object], name: str | None = None) -> None:
        """Record what this layer was built with, for its TP peers to compare (no
        communication here; see :mod:`mc_tp_layers.agreement`)."""
        fields["params_dtype"] = self.config.params_dtype
        self._tp_agreement = agreement.register(self.tp_group, type(self).__name__, fields, name)

    def _checked(self, check: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """``check(*args)``: a forward's per-call checks (cheap, local), once the TP group
        was found alive (a dictionary lookup).

        On the layer's first forward they run inside one status exchange over the TP group
        (:func:`mc_groups.fail_together`: a check failing on one rank is an error on every
        rank), followed by the agreement of the group's pending constructions
        (:mod:`mc_tp_layers.agreement`); later forwards exchange nothing. While
        ``torch.compile`` traces a first forward, the checks are traced (Dynamo guards what
        they read) and the exchanges run natively at trace time
        (:func:`_first_forward_at_trace`)."""
        if not mg.is_group_live(self.tp_group):
            check_group(f"{type(self).__name__}'s tp_group", self.tp_group)
        if self._peers_checked:
            return check(*args, **kwargs)
        with self._first_forward_checks():
            return check(*args, **kwargs)

    @contextmanager
    def _first_forward_checks(self) -> Iterator[None]:
        """Around the first forward's checks (see :meth:`_checked`)."""
        if torch.compiler.is_compiling():
            where = f"{type(self).__name__}'s first forward"
            failure = None
            try:
                yield
            except Exception as err:
                failure = err
            _first_forward_at_trace(
                self.tp_group.group_name, where, None if failure is None else str(failure)
            )
            if failure is not None:
                raise failure
            return
        with mg.fail_together(self.tp_group, f"{type(self).__name__}'s first forward"):
            yield
        agreement.settle(self._tp_agreement)
        self._peers_checked = True

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
        default_extra_state(self)

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
        (:func:`~mc_tp_layers.linear.apply_linear`)."""
        if not weight.requires_grad:
            return linear_with_frozen_weight(input, weight, *args, **kwargs)
        return apply_linear(input, weight, *args, **kwargs)

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
        check_init(init_method)
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
        weight = new_parameter(shape, self.config, device, self._sizes())
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
        bias = new_parameter((size,), self.config, device, self._sizes())
        set_tensor_model_parallel_attributes(bias, is_parallel, dim, stride)
        zero_bias(bias, self.config)
        param_attrs.mark_allreduce(bias, self._allreduce())
        tag_gtp_replica(bias, self.gtp_group)
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
