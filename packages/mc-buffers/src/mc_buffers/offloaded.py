"""``OffloadedView``: what a view into an offloaded buffer reads as while it is offloaded.

Offloading frees a buffer's storage (``untyped_storage().resize_(0)``) but leaves every view
into it (``param.main_grad``, a bucket's ``grad_data`` / ``param_data``, the buffer's own
``grad_data`` / ``param_data``) with its old shape. Torch does not bounds-check a resized
storage, so a read or write through such a view (a backward hook's ``main_grad.add_``, a
layer's fused wgrad ``addmm_`` into ``main_grad``, ``bucket.grad_data.sum()``) touches freed
memory: a segmentation fault at best, silently wrong numbers at worst. While offloaded,
each of them is therefore an ``OffloadedView``: a storage-free tensor with the view's
shape, dtype and device (so code that only inspects metadata keeps working, and
``untyped_storage()`` still reports the freed storage: ``nbytes() == 0``) on which every
operation raises ``RuntimeError`` naming the view and the fix, before anything is read or
written. Reloading puts the original view objects back.

Cost: one small Python object per param at offload (``main_grad``), one per access of a
bucket's or buffer's data while offloaded; nothing while resident, nothing per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["OffloadedView"]


def _find(value: object) -> OffloadedView | None:
    if isinstance(value, OffloadedView):
        return value
    if isinstance(value, (list, tuple)):
        values: Sequence[object] = value
    elif isinstance(value, Mapping):
        values = list(value.values())
    else:
        return None
    for item in values:
        found = _find(item)
        if found is not None:
            return found
    return None


class OffloadedView(torch.Tensor):
    """Stands in for a view into an offloaded buffer: metadata only, every op refused.

    ``what`` names the view in the error (``"main_grad of 'a' (shape (8,), float32,
    cpu)"``); ``untyped_storage()`` and ``data_ptr()`` report the original view's (freed)
    storage.
    """

    _what: str
    _view: torch.Tensor

    @staticmethod
    def __new__(cls, view: torch.Tensor, what: str) -> OffloadedView:
        """A storage-free tensor shaped like ``view`` (same dtype and device)."""
        made = torch.Tensor._make_wrapper_subclass(
            cls, view.shape, dtype=view.dtype, device=view.device
        )
        made._what = what
        made._view = view
        return made

    # torch's stub types Tensor.__torch_dispatch__ as a plain function attribute; every
    # subclass overrides it as a classmethod (as DTensor does).
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        found = _find(list(args))
        if found is None:
            found = _find(kwargs or {})
        what = found._what if found is not None else "a view of an offloaded buffer"
        raise RuntimeError(
            f"{func}: {what} is offloaded (its buffer's storage was freed by "
            "offload_grad_buffers() / offload_to_cpu()): restore it first, with "
            "ddp.restore_grad_buffers() for the grads or the buffer's reload_from_cpu(); "
            "nothing was read or written"
        )

    def untyped_storage(self) -> torch.UntypedStorage:
        """The original view's storage (freed: ``nbytes() == 0``)."""
        return self._view.untyped_storage()

    def data_ptr(self) -> int:
        """The original view's (freed) address."""
        return self._view.data_ptr()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"OffloadedView({self._what}, shape={tuple(self.shape)})"
