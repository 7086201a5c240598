"""Named RNG streams for tensor-parallel initialisation and dropout (Megatron's tracker).

A :class:`RNGStatesTracker` holds one generator state per name on one device (CPU or a
CUDA device). ``with tracker.fork(name):`` makes the device's default generator draw from
stream ``name`` and, on exit, stores how far the stream advanced and restores the stream
that was active before. Nesting follows the stack: forking B inside A checkpoints A first,
so A continues where it stopped once B exits; forking the stream that is already active
is a no-op (it keeps drawing from the same stream).

:func:`model_parallel_cuda_manual_seed` builds the tracker Megatron builds (no global: it
returns it)::

    data-parallel-rng   = seed                           (same on every rank)
    model-parallel-rng  = seed + 2718 + tp_rank          (differs across TP ranks)
    expert-parallel-rng = seed + 1024 + 100·ep_rank + etp_rank
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mc_groups import ProcessGroupCollection, get_default_collection

__all__ = [
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "model_parallel_cuda_manual_seed",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"

_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EP_RANK_STRIDE = 100


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


class RNGStatesTracker:
    """Named generator states for one device, switched in with :meth:`fork`.

    Args:
        device: the device whose default generator the streams drive (``"cpu"`` or a
            CUDA device; ``"cuda"`` means the current one).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        resolved = torch.device(device)
        if str(resolved) == "cuda":  # no index: the current device
            resolved = torch.device("cuda", torch.cuda.current_device())
        if resolved.type not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} must be a CPU or CUDA device")
        self.device = resolved
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active: list[str] = []

    def reset(self) -> None:
        """Forget every stream."""
        if self._active:
            raise RuntimeError(f"reset() inside fork({self._active[-1]!r})")
        self._states, self._seeds = {}, set()

    def is_initialized(self) -> bool:
        """True once a stream was added."""
        return bool(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's current state (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (from :meth:`get_states`)."""
        if self._active:
            raise RuntimeError(f"set_states() inside fork({self._active[-1]!r})")
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"name={name!r} must be a non-empty str")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already seeds a stream; each stream needs its own")
        if name in self._states:
            raise ValueError(f"stream {name!r} already exists; call reset() first")
        self._seeds.add(seed)
        self._states[name] = _seeded_state(self.device, seed)

    @contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream ``name`` inside the block (see the module docstring)."""
        if name not in self._states:
            raise ValueError(
                f"RNG stream {name!r} was never added (known: {sorted(self._states)}); "
                "build the tracker with model_parallel_cuda_manual_seed(seed, ...) or add() it"
            )
        if self._active and self._active[-1] == name:
            yield
            return
        outside = _generator_state(self.device)
        if self._active:
            self._states[self._active[-1]] = outside
        _set_generator_state(self.device, self._states[name])
        self._active.append(name)
        try:
            yield
        finally:
            self._states[name] = _generator_state(self.device)
            self._active.pop()
            resume = self._states[self._active[-1]] if self._active else outside
            _set_generator_state(self.device, resume)


CudaRNGStatesTracker = RNGStatesTracker
"""Megatron's name for :class:`RNGStatesTracker`."""


def _rank_of(explicit: int | None, collection: ProcessGroupCollection | None, field: str) -> int:
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 0:
            raise ValueError(f"{field}_rank={explicit!r} must be an int >= 0")
        return explicit
    group: dist.ProcessGroup | None = None if collection is None else getattr(collection, field)
    if group is not None:
        return int(group.rank())
    if collection is None and dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"model_parallel_cuda_manual_seed cannot tell this rank's {field} rank: pass "
            f"pg_collection=<ProcessGroupCollection> or {field}_rank=<int>"
        )
    return 0


def model_parallel_cuda_manual_seed(
    seed: int,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    device: torch.device | str | None = None,
) -> RNGStatesTracker:
    """Seed ``device``'s default generator with ``seed`` and return Megatron's tracker.

    Streams: ``data-parallel-rng`` = seed, ``model-parallel-rng`` = seed + 2718 + tp_rank,
    ``expert-parallel-rng`` = seed + 1024 + 100·ep_rank + etp_rank. Ranks come from the
    explicit arguments, else ``pg_collection`` (or the registered default collection:
    its ``tp``, ``ep`` and ``expt_tp`` groups), else 0 in a single process.
    ``device`` defaults to the current CUDA device when CUDA is available, else CPU.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    collection = pg_collection if pg_collection is not None else get_default_collection()
    tp = _rank_of(tp_rank, collection, "tp")
    ep = _rank_of(ep_rank, collection, "ep")
    etp = _rank_of(etp_rank, collection, "expt_tp")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tracker = RNGStatesTracker(device)
    if tracker.device.type == "cuda":
        torch.cuda.default_generators[tracker.device.index or 0].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp)
    tracker.add(
        _EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + _EXPERT_SEED_OFFSET + _EP_RANK_STRIDE * ep + etp,
    )
    return tracker
