"""``ScratchBuffers``: temporaries a bucket group reuses across iterations.

The all-to-all reduce-scatter and all-gather need a temporary the size of the bucket. On
CPU, torch's allocator returns large blocks to the OS, so a fresh 33 MB tensor paid ~27 ms of
page faults per use where a reused one took 1.5 ms to fill (measured on this project's CPU
machines); a bucket group therefore keeps its temporaries until ``free_overlap_buffers()``.
"""

from __future__ import annotations

import torch


class ScratchBuffers:
    """Tensors keyed by ``(name, numel, dtype, device)``, allocated on first use."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D tensor of ``like.numel()`` elements (``dtype`` or ``like``'s), reused."""
        key = (name, like.numel(), dtype or like.dtype, like.device)
        found = self._buffers.get(key)
        if found is None:
            found = torch.empty(key[1], dtype=key[2], device=key[3])
            self._buffers[key] = found
        return found

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.nbytes for t in self._buffers.values())

    def free(self) -> None:
        """Drop every temporary (the next use allocates again)."""
        self._buffers.clear()
