"""``PendingCollective``: issued collectives plus the local work that completes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mc_groups as mg


class PendingCollective:
    """Handles of issued collectives and the functions to run once they are done.

    ``wait()`` waits every handle (each bounded by its process group's timeout), then runs
    the finishers in order (e.g. the local fp32 sum of an all-to-all reduce-scatter).
    A second ``wait()`` does nothing.
    """

    def __init__(
        self,
        handles: Sequence[mg.CollectiveHandle],
        finishers: Sequence[Callable[[], None]] = (),
    ) -> None:
        self._handles = list(handles)
        self._finishers = list(finishers)

    def is_completed(self) -> bool:
        """True when every handle finished (the finishers may still be due)."""
        return all(h.is_completed() for h in self._handles)

    def wait(self) -> None:
        """Wait for every handle, then run the finishers once."""
        handles, self._handles = self._handles, []
        finishers, self._finishers = self._finishers, []
        for handle in handles:
            handle.wait()
        for finish in finishers:
            finish()
