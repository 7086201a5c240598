"""Activation checkpointing that replays the RNG (Megatron's ``checkpoint`` and
``CheckpointWithoutOutput``; exported by :mod:`mc_tp_layers.random`).

The forward runs without autograd and keeps only its inputs; backward runs it again with
autograd and back-propagates through the recomputed graph. Dropout must draw the same
mask both times, so the forward records every generator the function may draw from and
the recompute replays them::

    forward:   snapshot S = (CPU generator, CUDA generator(s), tracker streams)
               outputs = f(*inputs)                        (no autograd, nothing saved)
    backward:  now = snapshot(); restore S; outputs' = f(*inputs) (autograd); restore now
               backward(outputs', grads)  ->  input grads

so ``outputs' == outputs`` bit for bit, and the generators after backward are where they
were before it (the recompute does not shift the training run's random stream). The
CUDA generators recorded are the current device's (when CUDA is initialised) and the
tracker's device. The tracker is ``rng_tracker`` or else the default that
``model_parallel_cuda_manual_seed`` registered (Megatron's global tracker); with neither,
only the device generators are replayed. Nothing here communicates except
``distribute_saved_activations`` (one all-gather over the TP group in backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_tensor
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers._rng_default import StatesTracker, default_tracker
from mc_tp_layers._tp_groups import resolve_tp_group
from mc_tp_layers.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

__all__: list[str] = []

_R = TypeVar("_R")


class _RngStates(NamedTuple):
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    tracker: Any


def _tracker(rng_tracker: object, what: str) -> StatesTracker | None:
    if rng_tracker is None:
        return default_tracker()
    if not isinstance(rng_tracker, StatesTracker):
        raise InputTypeError(
            f"{what}: rng_tracker={rng_tracker!r} must be an RNG tracker (get_states() and "
            "set_states(), e.g. mc_tp_layers.RNGStatesTracker) or None (the default one)"
        )
    return rng_tracker


def _cuda_devices(tracker: StatesTracker | None) -> list[int]:
    devices: set[int] = set()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if torch.cuda.is_available() and initialized:
        devices.add(torch.cuda.current_device())
    device = getattr(tracker, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        devices.add(torch.cuda.current_device() if device.index is None else device.index)
    return sorted(devices)


def _capture(tracker: StatesTracker | None, devices: Sequence[int]) -> _RngStates:
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    streams = None if tracker is None else tracker.get_states()
    return _RngStates(torch.get_rng_state(), cuda, streams)


def _restore(states: _RngStates, tracker: StatesTracker | None) -> None:
    torch.set_rng_state(states.cpu)
    for device, state in states.cuda.items():
        torch.cuda.set_rng_state(state, device)
    if tracker is not None:
        tracker.set_states(states.tracker)


@contextmanager
def _replayed(states: _RngStates, tracker: StatesTracker | None) -> Iterator[None]:
    """Inside: the generators as ``states`` recorded them; after: as they were before."""
    now = _capture(tracker, list(states.cuda))
    _restore(states, tracker)
    try:
        yield
    finally:
        _restore(now, tracker)


def _detached(values: Sequence[object]) -> tuple[object, ...]:
    """Tensors detached from the forward's graph (keeping ``requires_grad``)."""
    out: list[object] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            leaf = value.detach()
            out.append(leaf.requires_grad_(value.requires_grad))
        else:
            out.append(value)
    return tuple(out)


def _backward_through(outputs: object, grads: Sequence[torch.Tensor | None]) -> None:
    """``torch.autograd.backward`` over the outputs that require grad."""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (o, g)
        for o, g in zip(outs, grads, strict=False)
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _input_grads(inputs: Sequence[object]) -> tuple[torch.Tensor | None, ...]:
    return tuple(v.grad if isinstance(v, torch.Tensor) else None for v in inputs)


def _check_recompute_allowed() -> None:
    if not torch.autograd._is_checkpoint_valid():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "activation checkpointing recomputes in backward, which torch.autograd.grad() "
            "does not allow; use .backward()"
        )


class _Setup(NamedTuple):
    """What the checkpoint's backward needs beyond the inputs."""

    tracker: StatesTracker | None
    split_group: dist.ProcessGroup | None  # set: the first input is kept split over it


class _CheckpointFunction(torch.autograd.Function):
    """Megatron's ``CheckpointFunction`` (see the module notes)."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], setup: _Setup, *args: object) -> Any:
        ctx.run_function, ctx.setup = run_function, setup
        ctx.rng_states = _capture(setup.tracker, _cuda_devices(setup.tracker))
        with torch.no_grad():
            outputs = run_function(*args)
        if setup.split_group is not None:
            first = cast(torch.Tensor, args[0])
            ctx.input_0_shape = first.data.shape
            first.data = split_tensor_into_1d_equal_chunks(
                first.data, new_buffer=True, tp_group=setup.split_group
            )
        ctx.layout = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        _check_recompute_allowed()
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if a is None else a for a in ctx.layout]
        setup: _Setup = ctx.setup
        if setup.split_group is not None:
            first = cast(torch.Tensor, inputs[0])
            whole = gather_split_1d_tensor(first.data, tp_group=setup.split_group)
            first.data = whole.view(ctx.input_0_shape)
        with _replayed(ctx.rng_states, setup.tracker):
            detached = _detached(inputs)
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        _backward_through(outputs, grads)
        return (None, None, *_input_grads(detached))


def checkpoint(
    function: Callable[..., _R],
    distribute_saved_activations: bool | None,
    *args: object,
    rng_tracker: StatesTracker | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> _R:
    """``function(*args)``, recomputed in backward instead of keeping its activations
    (Megatron's ``tensor_parallel.checkpoint``; see the module notes for the RNG replay).

    Args:
        function: called as ``function(*args)`` in forward (no autograd) and again in
            backward; returns a tensor or a tuple.
        distribute_saved_activations: True keeps only this TP rank's 1-D part of
            ``args[0]`` between forward and backward (its ``.data`` becomes that part, as in
            Megatron, and is all-gathered back before the recompute): the memory of the
            saved input divides by the TP size. ``args[0]`` must then be a tensor that is
            not a view, with as many elements as a multiple of the TP size, and the same
            on every rank of the TP group (as the hidden states entering a TP block are:
            the gather rebuilds it from the mates' parts). None or False: the inputs are
            kept whole.
        args: the inputs; tensors are saved, other values kept as they are.
        rng_tracker: mc's addition (keyword only): the tracker whose streams are replayed;
            None is the default tracker if one is registered.
        tp_group: mc's addition (keyword only): the group ``distribute_saved_activations``
            splits over; None is the default collection's ``tp``.
    """
    if not callable(function):
        raise InputTypeError(f"function={function!r} must be callable (the checkpointed function)")
    if distribute_saved_activations is not None and not isinstance(
        distribute_saved_activations, bool
    ):
        raise InputTypeError(
            f"distribute_saved_activations={distribute_saved_activations!r} must be a bool "
            "(None counts as False)"
        )
    tracker = _tracker(rng_tracker, "checkpoint")
    group = None
    if distribute_saved_activations:
        group = _check_distributable(args, tp_group)
    outputs = _CheckpointFunction.apply(  # type: ignore[no-untyped-call]
        function, _Setup(tracker, group), *args
    )
    return cast(_R, outputs)


def _check_distributable(args: Sequence[object], tp_group: object) -> dist.ProcessGroup:
    if not args:
        raise InputValueError(
            "distribute_saved_activations=True splits args[0], but no args were given"
        )
    first = check_tensor("args[0]", args[0])
    if first._base is not None:
        raise InputValueError(
            f"distribute_saved_activations=True replaces args[0].data, but args[0] (shape "
            f"{tuple(first.shape)}) is a view of another tensor; pass a tensor that owns its "
            "memory (.clone()) or distribute_saved_activations=False"
        )
    group = resolve_tp_group(tp_group, None, what="checkpoint(distribute_saved_activations=True)")
    if first.numel() % group.size():
        raise InputValueError(
            f"distribute_saved_activations=True splits args[0] ({first.numel()} elements, "
            f"shape {tuple(first.shape)}) over {group.size()} TP ranks, which needs a "
            f"multiple of {group.size()} elements; pass distribute_saved_activations=False"
        )
    return group


class _WithoutOutputFunction(torch.autograd.Function):
    """Runs the function without autograd; backward goes through the recompute that
    :meth:`CheckpointWithoutOutput._recompute` left on ``ctx``."""

    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        owner: CheckpointWithoutOutput,
        *args: object,
    ) -> Any:
        with torch.no_grad():
            outputs = run_function(*args)
        # owner <-> ctx is a cycle until the recompute clears owner.ctx
        ctx.owner, ctx.inputs, ctx.outputs = owner, None, None
        ctx.layout = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.outputs is None:  # no hook ran the recompute: run it now
            ctx.owner._recompute(None)
        inputs, outputs = ctx.inputs, ctx.outputs
        ctx.inputs = ctx.outputs = ctx.owner = None
        _backward_through(outputs, grads)
        return (None, None, *_input_grads(inputs))


class CheckpointWithoutOutput:
    """Checkpoint a function and also drop its outputs until backward needs them
    (Megatron's ``CheckpointWithoutOutput``).

    :meth:`checkpoint` runs ``run_function`` without autograd, as :func:`checkpoint` does;
    :meth:`discard_output_and_register_recompute` then frees the outputs' memory (their
    storage shrinks to 0 bytes; shapes stay) and hooks the recompute onto ``hook_tensor``'s
    gradient: when backward reaches ``hook_tensor`` (computed from the outputs), the
    function runs again with the recorded RNG states and its results are copied into the
    outputs' storage, so every consumer that saved an output (or a view of it) for its
    backward reads the recomputed values. Use it when the outputs are only consumed by
    operations that save them, e.g. an activation feeding a linear layer. As in Megatron,
    nothing may read the outputs between the discard and the recompute (their memory is
    gone): call it after the outputs' last use in forward.

    Args:
        fp8: Megatron's Transformer Engine FP8 recompute; anything but False or None raises
            ``NotImplementedError``.
        rng_tracker: mc's addition (keyword only): as :func:`checkpoint`'s.
    """

    def __init__(self, fp8: object = False, *, rng_tracker: StatesTracker | None = None) -> None:
        if fp8 is not None and fp8 is not False:
            raise NotImplementedError(
                f"CheckpointWithoutOutput(fp8={fp8!r}): FP8 recompute needs Transformer "
                "Engine, which mc does not drive; pass fp8=False"
            )
        self.fp8 = False
        self._tracker = _tracker(rng_tracker, "CheckpointWithoutOutput")
        self.run_function: Callable[..., Any] | None = None
        self.rng_states: _RngStates | None = None
        self.ctx: Any = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._nbytes: list[int] = []

    def checkpoint(self, run_function: Callable[..., _R], *args: object) -> _R:
        """``run_function(*args)`` without autograd, recomputable later (see the class)."""
        if not callable(run_function):
            raise InputTypeError(f"run_function={run_function!r} must be callable")
        tracker = self._tracker if self._tracker is not None else default_tracker()
        self._tracker = tracker
        self.run_function = run_function
        self.rng_states = _capture(tracker, _cuda_devices(tracker))
        outputs = _WithoutOutputFunction.apply(  # type: ignore[no-untyped-call]
            run_function, self, *args
        )
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return cast(_R, outputs)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' memory and recompute them when ``hook_tensor``'s gradient is
        ready (a tensor that does not require grad registers nothing: the recompute then
        runs in this checkpoint's own backward)."""
        check_tensor("hook_tensor", hook_tensor)
        if self.outputs is None:
            raise RuntimeError(
                "discard_output_and_register_recompute() before checkpoint(): checkpoint a "
                "function first"
            )
        self._nbytes = [o.untyped_storage().nbytes() for o in self.outputs]
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)  # type: ignore[no-untyped-call]

    def _recompute(self, _grad: object) -> None:
        ctx = self.ctx
        if ctx is None or self.run_function is None or self.rng_states is None:
            return  # already recomputed
        _check_recompute_allowed()
        saved = iter(ctx.saved_tensors)
        inputs = _detached([next(saved) if a is None else a for a in ctx.layout])
        with _replayed(self.rng_states, self._tracker), torch.enable_grad():
            outputs = self.run_function(*inputs)
        recomputed = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        for output, fresh, nbytes in zip(
            self.outputs or (), recomputed, self._nbytes or [0] * len(recomputed), strict=False
        ):
            storage = output.untyped_storage()
            if storage.nbytes() == 0 and nbytes:
                storage.resize_(nbytes)
            # .data: the copy must not bump the version autograd saved with the output
            output.data.copy_(fresh.detach())
        ctx.inputs, ctx.outputs = inputs, recomputed
        self.run_function = self.rng_states = self.ctx = self.outputs = None
