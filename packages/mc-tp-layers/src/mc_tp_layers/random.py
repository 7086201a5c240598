"""Named RNG streams for tensor-parallel initialisation and dropout (Megatron's tracker).

A :class:`RNGStatesTracker` holds one generator state per name on one device (CPU or a
CUDA device). ``with tracker.fork(name):`` makes the device's default generator draw from
stream ``name`` and, on exit, stores how far the stream advanced and restores the stream
that was active before. Nesting follows the stack: forking B inside A checkpoints A first,
so A continues where it stopped once B exits; forking the stream that is already active
is a no-op (it keeps drawing from the same stream).

:func:`model_parallel_cuda_manual_seed` builds the tracker Megatron builds and returns it::

    data-parallel-rng   = seed                           (same on every rank)
    model-parallel-rng  = seed + 2718 + tp_rank          (differs across TP ranks)
    expert-parallel-rng = seed + 1024 + 100·ep_rank + etp_rank
    gtp-remat-rng       = seed + 2718 + tp_rank + 65536·(1 + gtp_remat_rank)   (gtp_remat > 1)
    egtp-remat-rng      = expert seed + 32768 + 65536·(1 + egtp_remat_rank)    (egtp_remat > 1)

It also registers the tracker as the process default (``set_default=False`` opts out), as
Megatron's call sets its global tracker: :func:`get_cuda_rng_tracker` returns it and layers
built with ``rng_tracker=None`` initialise with it. This is the opt-in pattern of
``mc_groups.collection.set_default_collection``: nothing requires the default, explicit
trackers keep working, and a process that never seeds has none.

**Activation checkpointing that replays the RNG** (:func:`checkpoint`,
:class:`CheckpointWithoutOutput`). The forward runs without autograd and keeps only its
inputs; backward runs it again with autograd and back-propagates through the recomputed
graph. Dropout must draw the same mask both times, so the forward records every
generator the function may draw from and the recompute replays them::

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

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

import torch
import torch.distributed as dist

from mc_groups import ProcessGroupCollection
from mc_groups.argcheck import check_flag, check_int, check_tensor, type_name
from mc_groups.collection import collection_or_default
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.utils import (
    _resolve_tp_group,
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "clear_cuda_rng_tracker",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "model_parallel_cuda_manual_seed",
    "set_cuda_rng_tracker",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_GTP_REMAT_RNG_TRACKER_NAME = "gtp-remat-rng"
_EXPERT_GTP_REMAT_RNG_TRACKER_NAME = "egtp-remat-rng"

_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EP_RANK_STRIDE = 100
_GTP_SEED_STRIDE = 65536
_EGTP_SEED_OFFSET = 32768
_SEED_LIMIT = 2**64

_R = TypeVar("_R")


@runtime_checkable
class _StatesTracker(Protocol):
    """What the recompute needs of an RNG tracker (mc's or Megatron's)."""

    def get_states(self) -> Any:
        """Every stream's state."""

    def set_states(self, states: Any) -> None:
        """Replace every stream's state."""


class _DefaultTracker:
    """The process default tracker (the one permitted global of this package): registered
    by :func:`model_parallel_cuda_manual_seed` / :func:`set_cuda_rng_tracker` (as Megatron
    sets its global tracker), read when a caller passes no tracker."""

    tracker: RNGStatesTracker | None = None


def get_model_parallel_rng_tracker_name() -> str:
    """``"model-parallel-rng"``: the stream that differs across tensor-parallel ranks."""
    return _MODEL_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """``"data-parallel-rng"``: the stream that is identical on every rank."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """``"expert-parallel-rng"``: the stream of expert (MoE) weights."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    return torch.Generator(device=device).manual_seed(seed).get_state()


def _copied(state: object) -> Any:
    return state.clone() if isinstance(state, torch.Tensor) else state


class RNGStatesTracker:
    """Named generator states for one device, switched in with :meth:`fork`.

    Args:
        device: the device whose default generator the streams drive (``"cpu"`` or a
            CUDA device; ``"cuda"`` means the current one).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        resolved = _check_device_name(device)
        if str(resolved) == "cuda":  # no index: the current device
            resolved = torch.device("cuda", torch.cuda.current_device())
        if resolved.type not in ("cpu", "cuda"):
            raise InputValueError(f"device={device!r} must be a CPU or CUDA device")
        self.device = resolved
        self._state_size = _seeded_state(resolved, 0).numel()
        self._states: dict[str, object] = {}
        self._seeds: set[int] = set()
        self._active: list[str] = []
        self._initialized = False

    def reset(self) -> None:
        """Forget every stream."""
        if self._active:
            raise RuntimeError(f"reset() inside fork({self._active[-1]!r})")
        self._states, self._seeds, self._initialized = {}, set(), False

    def is_initialized(self) -> bool:
        """True once a stream was added or :meth:`set_states` was called (as Megatron's)."""
        return self._initialized

    def get_states(self) -> dict[str, Any]:
        """Every stream's current state (for checkpoints): generator states as copies, and
        any other value :meth:`set_states` was given as it was given."""
        return {name: _copied(state) for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Replace the streams with ``states`` (from :meth:`get_states`).

        ``states`` maps stream names (non-empty str) to generator states of this tracker's
        device: 1-D ``torch.uint8`` CPU tensors of the size :meth:`get_states` returns,
        checked here before any stream is replaced (a tensor of another shape or dtype
        is a ``ValueError``). A value that is not a tensor is stored as given, as
        Megatron's tracker stores any value (its own test stores an int; its graph-safe
        and Transformer Engine trackers hold ``torch.Generator`` objects): it comes back
        from :meth:`get_states` and :meth:`fork` on its stream is a ``ValueError``.
        """
        if self._active:
            raise RuntimeError(f"set_states() inside fork({self._active[-1]!r})")
        if not isinstance(states, Mapping):
            raise InputTypeError(
                f"states must be a dict of stream name -> generator state (from "
                f"get_states()), got {type_name(states)}"
            )
        for name, state in states.items():
            if not isinstance(name, str) or not name:
                raise InputTypeError(
                    f"states holds the key {name!r}; stream names must be non-empty str"
                )
            if isinstance(state, torch.Tensor) and not self._is_generator_state(state):
                raise InputValueError(
                    f"states[{name!r}] is {state.dtype} of shape {tuple(state.shape)} on "
                    f"{state.device}; a {self.device.type} generator state is a torch.uint8 "
                    f"CPU tensor of shape ({self._state_size},) (as get_states() returns)"
                )
        self._states = {name: _copied(state) for name, state in states.items()}
        self._initialized = True

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name`` seeded with ``seed`` (an int in ``[0, 2**64)``); names and
        seeds must be new."""
        _check_name(name)
        check_int("seed", seed, minimum=0)
        if seed >= _SEED_LIMIT:
            raise InputValueError(f"seed={seed} must be < 2**64 (a generator seed is 64 bits)")
        if seed in self._seeds:
            raise InputValueError(f"seed {seed} already seeds a stream; each stream needs its own")
        if name in self._states:
            raise InputValueError(f"stream {name!r} already exists; call reset() first")
        self._seeds.add(seed)
        self._states[name] = _seeded_state(self.device, seed)
        self._initialized = True

    @contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream ``name`` inside the block (see the module docstring)."""
        _check_name(name)
        if name not in self._states:
            raise InputValueError(
                f"RNG stream {name!r} was never added (known: {sorted(self._states)}); "
                "build the tracker with model_parallel_cuda_manual_seed(seed, ...) or add() it"
            )
        if self._active and self._active[-1] == name:
            yield
            return
        state = self._generator_state_of(name)
        outside = _generator_state(self.device)
        if self._active:
            self._states[self._active[-1]] = outside
        _set_generator_state(self.device, state)
        self._active.append(name)
        try:
            yield
        finally:
            self._states[name] = _generator_state(self.device)
            self._active.pop()
            resume = self._states[self._active[-1]] if self._active else outside
            _set_generator_state(self.device, cast(torch.Tensor, resume))

    def _is_generator_state(self, state: torch.Tensor) -> bool:
        return (
            state.dtype == torch.uint8
            and state.device.type == "cpu"
            and tuple(state.shape) == (self._state_size,)
        )

    def _generator_state_of(self, name: str) -> torch.Tensor:
        state = self._states[name]
        if not isinstance(state, torch.Tensor):
            raise InputValueError(
                f"stream {name!r} holds {state!r} (a {type_name(state)} given to "
                f"set_states()), not a {self.device.type} generator state; set_states() "
                "needs what get_states() returns to fork it"
            )
        return state


class CudaRNGStatesTracker(RNGStatesTracker):
    """Megatron's tracker class and constructor: a :class:`RNGStatesTracker` on the current
    CUDA device (CPU when CUDA is not available, e.g. a gloo world).

    Args:
        use_cudagraphable_rng: Megatron's CUDA-graph-safe generator states; True raises
            ``NotImplementedError`` (mc has no graph-safe tracker).
        is_inference_rng_tracker: recorded as the attribute of that name, as Megatron's
            tracker does (Megatron's inference tracker, a subclass whose ``fork`` draws
            nothing, is built by its ``initialize_rng_tracker``, which mc does not have).
        device: mc's addition (keyword only): the device whose generator the streams
            drive; None means CUDA when available, else CPU.
    """

    def __init__(
        self,
        use_cudagraphable_rng: bool = False,
        is_inference_rng_tracker: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        check_flag("use_cudagraphable_rng", use_cudagraphable_rng)
        check_flag("is_inference_rng_tracker", is_inference_rng_tracker)
        if use_cudagraphable_rng:
            raise NotImplementedError(
                "CudaRNGStatesTracker(use_cudagraphable_rng=True): mc has no CUDA-graph-safe "
                "generator states; leave use_cudagraphable_rng=False"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device)
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker


def set_cuda_rng_tracker(tracker: RNGStatesTracker) -> None:
    """Register ``tracker`` as the default (``model_parallel_cuda_manual_seed`` does this)."""
    if not isinstance(tracker, RNGStatesTracker):
        raise InputTypeError(f"tracker={tracker!r} must be a mc_tp_layers.RNGStatesTracker")
    _DefaultTracker.tracker = tracker


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The default tracker registered by :func:`model_parallel_cuda_manual_seed` (Megatron's
    name; the CPU tracker of a gloo world too). RuntimeError when none is registered:
    Megatron would hand out an empty tracker whose ``fork()`` then fails."""
    tracker = _default_tracker()
    if tracker is None:
        raise RuntimeError(
            "no default RNG tracker is registered: call "
            "mc_tp_layers.model_parallel_cuda_manual_seed(seed, pg_collection=...) first, or "
            "pass rng_tracker= explicitly"
        )
    return tracker


def clear_cuda_rng_tracker() -> None:
    """Forget the default tracker (explicit trackers are unaffected)."""
    _DefaultTracker.tracker = None


def _default_tracker() -> RNGStatesTracker | None:
    """The registered default (only :func:`set_cuda_rng_tracker` and
    :func:`model_parallel_cuda_manual_seed` register one, both an :class:`RNGStatesTracker`)."""
    return _DefaultTracker.tracker


def _check_device_name(device: object) -> torch.device:
    """``device`` (a ``torch.device`` or a str torch parses) as a ``torch.device``."""
    if not isinstance(device, (torch.device, str)):
        raise InputTypeError(f"device={device!r} must be a torch.device or a str such as 'cpu'")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise InputValueError(f"device={device!r} is not a device torch knows ({err})") from None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InputTypeError(f"name={name!r} must be a non-empty str")
    return name


def _rank_of(
    explicit: object, collection: ProcessGroupCollection | None, field: str, arg: str
) -> int:
    if explicit is not None:
        return check_int(arg, explicit, minimum=0)
    group: dist.ProcessGroup | None = None if collection is None else getattr(collection, field)
    if group is not None:
        return int(group.rank())
    if collection is None and dist.is_available() and dist.is_initialized():
        raise InputValueError(
            f"model_parallel_cuda_manual_seed cannot tell this rank's {field} rank: pass "
            f"pg_collection=<ProcessGroupCollection> or {arg}=<int>"
        )
    return 0


def _size_of(
    explicit: object, collection: ProcessGroupCollection | None, field: str, arg: str
) -> int:
    if explicit is not None:
        return check_int(arg, explicit)
    group: dist.ProcessGroup | None = None if collection is None else getattr(collection, field)
    return 1 if group is None else int(group.size())


def _axis_rank(
    explicit: object, collection: ProcessGroupCollection | None, field: str, arg: str, size: int
) -> int:
    """A gtp_remat axis rank in ``[0, size)``; an explicit one is checked at every size."""
    if explicit is None and size == 1:
        return 0
    rank = _rank_of(explicit, collection, field, arg)
    if rank >= size:
        raise InputValueError(
            f"{arg}={rank} is outside its axis of {size} rank(s); a rank must be in "
            f"[0, {size}) (pass the matching world size or pg_collection)"
        )
    return rank


def _check_flags(flags: dict[str, object], unsupported: tuple[str, ...]) -> None:
    for name, value in flags.items():
        check_flag(name, value)
    for name in unsupported:
        if flags[name]:
            raise NotImplementedError(
                f"{name}=True: mc's tracker has no Transformer Engine, inference or "
                "CUDA-graph-safe variant; leave it False"
            )


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    gtp_remat_rank: int | None = None,
    egtp_remat_rank: int | None = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: int | None = None,
    egtp_remat_world_size: int | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    device: torch.device | str | None = None,
    set_default: bool = True,
) -> RNGStatesTracker:
    """Seed ``device``'s default generator with ``seed``, build Megatron's tracker, register
    it as the default (unless ``set_default=False``) and return it.

    Streams (see the module notes): data-parallel, model-parallel, expert-parallel, and the
    gtp_remat streams when those axes span more than one rank. Ranks and sizes come from the
    explicit arguments, else ``pg_collection`` (or the registered default collection: its
    ``tp``, ``ep``, ``expt_tp``, ``gtp_remat`` and ``expt_gtp_remat`` groups), else rank 0
    of size 1 in a single process. ``device`` defaults to the current CUDA device when CUDA
    is available, else CPU. The signature is Megatron-Core's (positional order included);
    ``te_rng_tracker``, ``inference_rng_tracker`` and ``use_cudagraphable_rng`` must stay
    False (``NotImplementedError``), ``force_reset_rng`` is accepted (a new tracker is built
    on every call anyway).
    """
    check_int("seed", seed, minimum=0)
    _check_flags(
        {
            "te_rng_tracker": te_rng_tracker,
            "inference_rng_tracker": inference_rng_tracker,
            "use_cudagraphable_rng": use_cudagraphable_rng,
            "force_reset_rng": force_reset_rng,
            "set_default": set_default,
        },
        unsupported=("te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng"),
    )
    collection = collection_or_default(
        pg_collection, "model_parallel_cuda_manual_seed", required=False
    )
    tp = _rank_of(tp_rank, collection, "tp", "tp_rank")
    ep = _rank_of(ep_rank, collection, "ep", "ep_rank")
    etp = _rank_of(etp_rank, collection, "expt_tp", "etp_rank")
    gtp_size = _size_of(gtp_remat_world_size, collection, "gtp_remat", "gtp_remat_world_size")
    egtp_size = _size_of(
        egtp_remat_world_size, collection, "expt_gtp_remat", "egtp_remat_world_size"
    )
    gtp = _axis_rank(gtp_remat_rank, collection, "gtp_remat", "gtp_remat_rank", gtp_size)
    egtp = _axis_rank(egtp_remat_rank, collection, "expt_gtp_remat", "egtp_remat_rank", egtp_size)
    # Every stream is added to a tracker nobody sees yet, so a bad seed fails before the
    # device's generator or the default tracker changes.
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tracker = CudaRNGStatesTracker(device=device)
    tp_seed = seed + _TP_SEED_OFFSET + tp
    expert_seed = seed + _EXPERT_SEED_OFFSET + _EP_RANK_STRIDE * ep + etp
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)
    if gtp_size > 1:
        tracker.add(_GTP_REMAT_RNG_TRACKER_NAME, tp_seed + _GTP_SEED_STRIDE * (1 + gtp))
    if egtp_size > 1:
        tracker.add(
            _EXPERT_GTP_REMAT_RNG_TRACKER_NAME,
            expert_seed + _EGTP_SEED_OFFSET + _GTP_SEED_STRIDE * (1 + egtp),
        )
    if tracker.device.type == "cuda":
        torch.cuda.default_generators[tracker.device.index or 0].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    if set_default:
        set_cuda_rng_tracker(tracker)
    return tracker


# -- activation checkpointing that replays the RNG ---------------------------------------


class _RngStates(NamedTuple):
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    tracker: Any


def _tracker(rng_tracker: object, what: str) -> _StatesTracker | None:
    if rng_tracker is None:
        return _DefaultTracker.tracker
    if not isinstance(rng_tracker, _StatesTracker):
        raise InputTypeError(
            f"{what}: rng_tracker={rng_tracker!r} must be an RNG tracker (get_states() and "
            "set_states(), e.g. mc_tp_layers.RNG_StatesTracker) or None (the default one)"
        )
    return rng_tracker


def _cuda_devices(tracker: _StatesTracker | None) -> list[int]:
    devices: set[int] = set()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if torch.cuda.is_available() and initialized:
        devices.add(torch.cuda.current_device())
    device = getattr(tracker, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        devices.add(torch.cuda.current_device() if device.index is None else device.index)
    return sorted(devices)


def _capture(tracker: _StatesTracker | None, devices: Sequence[int]) -> _RngStates:
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    streams = None if tracker is None else tracker.get_states()
    return _RngStates(torch.get_rng_state(), cuda, streams)


def _restore(states: _RngStates, tracker: _StatesTracker | None) -> None:
    torch.set_rng_state(states.cpu)
    for device, state in states.cuda.items():
        torch.cuda.set_rng_state(state, device)
    if tracker is not None:
        tracker.set_states(states.tracker)


@contextmanager
def _replayed(states: _RngStates, tracker: _StatesTracker | None) -> Iterator[None]:
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

    tracker: _StatesTracker | None
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
    rng_tracker: _StatesTracker | None = None,
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
    group = _resolve_tp_group(tp_group, None, what="checkpoint(distribute_saved_activations=True)")
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

    def __init__(self, fp8: object = False, *, rng_tracker: _StatesTracker | None = None) -> None:
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
        tracker = self._tracker if self._tracker is not None else _DefaultTracker.tracker
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
