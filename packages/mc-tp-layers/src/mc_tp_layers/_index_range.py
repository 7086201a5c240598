"""Token ids and class targets inside ``[0, size)``: one check, cheap where it can be.

On CPU the check is a host comparison (one pass over the integers, no synchronisation to
speak of) and raises ``ValueError`` before anything is communicated. On a device the same
comparison is queued as an asynchronous device assert (:func:`torch._assert_async`): no
host synchronisation per step, but a failure surfaces at a later CUDA call as a
device-side assert and leaves that process's CUDA context unusable (as an out-of-range
``F.embedding`` index on CUDA does), so the message printed on the host is generic.

While ``torch.compile`` traces, the device form is used on every device: the host check
needs the values (a graph break); the assert is a node of the graph, so compiled code still
refuses an out-of-range value on each call (on CPU a ``RuntimeError`` with the message
below, raised when the compiled code runs).
"""

from __future__ import annotations

import torch

from mc_groups.errors import InputValueError

__all__: list[str] = []


def check_index_range(
    values: torch.Tensor,
    size: int,
    arg: str,
    what: str,
    fix: str,
    *,
    ignore: int | None = None,
    on_device: bool | None = None,
) -> None:
    """Every element of ``values`` in ``[0, size)``, except those equal to ``ignore``.

    ``on_device`` (default: ``values.is_cuda`` or another accelerator) selects the
    asynchronous device assert; tests force it on CPU, where ``torch._assert_async``
    raises at once.
    """
    if values.numel() == 0 or values.device.type == "meta":
        return
    outside = (values < 0) | (values >= size)
    if ignore is not None:
        outside &= values != ignore
    device_side = values.device.type != "cpu" if on_device is None else on_device
    device_side = device_side or torch.compiler.is_compiling()
    if device_side:
        torch._assert_async(
            ~outside.any(), f"{arg} holds {what} outside [0, {size}) (device-side check)"
        )
        return
    if bool(outside.any()):
        bad = values[outside]
        first = tuple(int(i) for i in outside.nonzero()[0].tolist())
        kept = "" if ignore is None else f" other than ignore_index={ignore}"
        raise InputValueError(
            f"{arg} holds {bad.numel()} {what}{kept} outside [0, {size}): e.g. "
            f"{int(bad[0])} at index {first} (smallest {int(bad.min())}, largest "
            f"{int(bad.max())}); {fix}"
        )
