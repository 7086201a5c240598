"""Device helpers: the one place mc touches CUDA streams, synchronisation and caches.

On CPU every helper is a no-op (or its CPU equivalent), so the packages above never branch
on the device type themselves. Streams are represented by :class:`StreamLike`; on CPU it is
:class:`NullStream`, whose methods do nothing (CPU kernels run in program order).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

import torch

from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "NullStream",
    "StreamLike",
    "current_stream",
    "empty_cache",
    "is_graph_capturing",
    "side_stream",
    "stream_scope",
    "synchronize",
]


class NullStream:
    """The stream of a CPU device: work is already ordered, so waiting does nothing."""

    def wait_stream(self, stream: StreamLike) -> None:
        """No-op: CPU ops run in program order."""

    def __repr__(self) -> str:
        return "NullStream()"


StreamLike: TypeAlias = "torch.cuda.Stream | NullStream"
"""A CUDA stream, or :class:`NullStream` off CUDA."""


def _cuda(device: object) -> torch.device | None:
    """``device`` as a torch.device when it is a CUDA device, else None (a ``TypeError`` /
    ``ValueError`` naming ``device`` when it is not a device at all)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise InputTypeError(f"device={device!r} must be None, a torch.device or a device string")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise InputValueError(f"device={device!r} is not a device: {err}") from None
    return resolved if resolved.type == "cuda" else None


def current_stream(device: torch.device | str | None) -> StreamLike:
    """The current CUDA stream of ``device``, or a :class:`NullStream` off CUDA."""
    cuda = _cuda(device)
    if cuda is not None:
        return torch.cuda.current_stream(cuda)
    return NullStream()


def side_stream(device: torch.device | str | None) -> StreamLike:
    """A new stream for overlapping communication on ``device`` (NullStream off CUDA)."""
    cuda = _cuda(device)
    if cuda is not None:
        return torch.cuda.Stream(device=cuda)  # type: ignore[no-untyped-call]
    return NullStream()


@contextmanager
def stream_scope(stream: StreamLike) -> Iterator[None]:
    """Run the block on ``stream`` (nothing to switch on CPU)."""
    if not isinstance(stream, torch.cuda.Stream | NullStream):
        raise InputTypeError(
            f"stream={stream!r} must be a torch.cuda.Stream or a NullStream (see "
            "current_stream / side_stream)"
        )
    if isinstance(stream, torch.cuda.Stream):
        with torch.cuda.stream(stream):
            yield
    else:
        yield


def synchronize(device: torch.device | str | None) -> None:
    """Block until queued work on ``device`` finished (no-op off CUDA)."""
    cuda = _cuda(device)
    if cuda is not None:
        torch.cuda.synchronize(cuda)


def empty_cache(device: torch.device | str | None) -> None:
    """Return cached blocks of ``device``'s allocator to the driver (no-op off CUDA)."""
    if _cuda(device) is not None:
        torch.cuda.empty_cache()


def is_graph_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (False on CPU).

    Asked once per parameter per backward by DDP's hooks, so it stays cheap: a capture
    needs an initialized CUDA context, and ``torch.cuda.is_initialized()`` is one flag read
    (``is_available()`` would query the driver and the environment at every call)."""
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    return bool(initialized and torch.cuda.is_current_stream_capturing())
