r"""Activation memory of a rank: the tensors autograd saves for backward, measured on the
meta device, per micro-batch and per transformer block, times the micro-batches the
pipeline schedule keeps in flight.

Measurement (:func:`measure_forward`): one forward of every chunk of the rank runs under
``torch.autograd.graph.saved_tensors_hooks``; each saved tensor is counted once per
*storage* (a view and its base, or one tensor saved by two ops, share one allocation), at
the storage's full size, and attributed to the block whose forward is running (module
hooks on each ``TransformerLayer``), or to ``other`` (embedding, final norm, LM head and
loss). Storages of parameters (and so of DDP's param buffer) are not activations and are
skipped. Meta tensors have storages with sizes and no data, so this costs no memory.

Attention on the meta device would take PyTorch's math path and save the ``[b, a, s, s]``
probabilities; on GPUs (FlashAttention, cuDNN) and on this CPU (``_scaled_dot_product_
flash_attention_for_cpu``) the fused kernel saves ``q, k, v``, the output and the
log-sum-exp ``[b, a, s]`` (fp32) and recomputes the probabilities in backward. While
measuring, ``scaled_dot_product_attention`` on meta tensors is replaced by a stand-in that
saves exactly that set (keys and values unexpanded under grouped-query attention, as the
GPU kernels keep them), so the dry run counts what a fused-attention run holds.

In flight (:func:`mc_train.in_flight_forwards`), for pipeline stage ``p`` of ``P``, ``M``
micro-batches, ``V`` chunks per stage: the chunk-forwards whose activations are alive at
the peak, as ``torch.distributed.pipelining`` (and Megatron) order them:

- GPipe: every forward before any backward, ``M·V``;
- 1F1B: ``min(M, P − p)`` (the warm-up forwards plus the first steady-state one);
- interleaved 1F1B: ``min(M·V, 2·(P − p − 1) + (V − 1)·R + 1)``, ``R = M / max(1, ⌊M/P⌋)``
  micro-batches per round (``P`` when ``P`` divides ``M``; torch 2.13's
  ``_get_warmup_ops``);
- no pipeline (``P = 1``): 1 (each micro-batch's backward follows its forward).

The peak is ``in_flight × (bytes of one micro-batch over the rank's chunks) / V``: exact
when the rank's chunks save the same bytes (the first and last chunks, with the embedding
and the LM head, hold more: ``other``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from examples.dry_run.step import Batch, StageModel, forward_only
from examples.gpt.model import TransformerLayer
from mc_train import in_flight_forwards

__all__ = [
    "ActivationInfo",
    "SavedBytes",
    "korthikanti_layer_bytes",
    "measure_activations",
    "measure_forward",
]


def korthikanti_layer_bytes(
    seq_length: int, micro_batch: int, hidden: int, heads: int, tp: int
) -> int:
    """Korthikanti et al. (2022), Table 2, tensor + sequence parallelism, no recomputation:
    ``s·b·h·(34/t + 5·a·s/(h·t))`` bytes per transformer layer (16-bit activations,
    dropout, 4h MLP, multi-head attention without a fused kernel)."""
    s, b, h, a, t = seq_length, micro_batch, hidden, heads, tp
    return (34 * s * b * h + 5 * a * s * s * b) // t


@dataclass
class SavedBytes:
    """What :func:`measure_forward` counted: bytes per block (global index) and the rest."""

    per_layer: dict[int, int] = field(default_factory=dict)
    other: int = 0

    @property
    def total(self) -> int:
        """Every counted byte of the forward (one micro-batch)."""
        return sum(self.per_layer.values()) + self.other


@dataclass(frozen=True)
class ActivationInfo:
    """A rank's activation memory (bytes): one micro-batch's saved tensors per block and
    for the rest, the schedule's chunk-forwards in flight, and the resulting peak."""

    per_layer: dict[int, int]
    other: int
    schedule: str
    in_flight: int
    chunks: int

    @property
    def per_microbatch(self) -> int:
        """Saved bytes of one micro-batch over every chunk of the rank."""
        return sum(self.per_layer.values()) + self.other

    @property
    def peak(self) -> int:
        """``in_flight × per_microbatch / chunks`` (module notes)."""
        return self.in_flight * self.per_microbatch // self.chunks


class _FusedAttention(torch.autograd.Function):
    """Shapes-only stand-in of a fused attention kernel for meta tensors: saves q, k, v,
    the output and an fp32 log-sum-exp ``[b, heads, s]``, returns grads of the inputs'
    shapes."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _MetaFusedAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` on meta tensors to :class:`_FusedAttention`."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            return _FusedAttention.apply(*args[:3])  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)


@contextmanager
def measure_forward(
    modules: list[nn.Module], into: SavedBytes | None = None
) -> Iterator[SavedBytes]:
    """Count the bytes autograd saves while the body runs forwards of ``modules`` (the
    rank's chunks), per block and the rest (module notes), into ``into`` (or a new
    :class:`SavedBytes`, yielded). On meta tensors attention is counted as a fused kernel
    saves it."""
    counted = SavedBytes() if into is None else into
    params = [p for m in modules for p in m.parameters()]
    seen: set[int] = set()
    current: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        # Read now: DDP's param gather may point the params at new storage mid-forward.
        if key in seen or key in {p.untyped_storage()._cdata for p in params}:
            return t
        seen.add(key)
        layer = current[0]
        if layer is None:
            counted.other += storage.nbytes()
        else:
            counted.per_layer[layer] = counted.per_layer.get(layer, 0) + storage.nbytes()
        return t

    handles = []
    for module in modules:
        for name, layer in module.named_modules():
            if isinstance(layer, TransformerLayer):
                index = int(name.rsplit(".", 1)[-1])
                handles.append(layer.register_forward_pre_hook(_enter(current, index)))
                handles.append(layer.register_forward_hook(_leave(current)))
    try:
        with _MetaFusedAttention(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield counted
    finally:
        for handle in handles:
            handle.remove()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _enter(current: list[int | None], index: int) -> Any:
    def hook(_module: nn.Module, _args: Any) -> None:
        current[0] = index

    return hook


def _leave(current: list[int | None]) -> Any:
    def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
        current[0] = None

    return hook


def measure_activations(stage: StageModel, batch: Batch) -> ActivationInfo:
    """One forward of ``batch`` over the rank's chunks under :func:`measure_forward` (a
    forward of its own, whose graph is dropped: with saved-tensor hooks autograd unpacks
    each saved tensor as a new tensor object, without the Python attributes mc's layers
    read in backward, so the measured graph is never run backward), then the in-flight
    count of the spec's schedule on this rank's stage. Collective like a forward: every
    rank calls it. Run it before the first step (no param gather is then in flight)."""
    saved = SavedBytes()
    with measure_forward([chunk.module for chunk in stage.chunks], saved):
        forward_only(stage, batch)
    spec = stage.spec
    lay, vpp = spec.layout, spec.layout.vpp or 1
    schedule = spec.pipeline_schedule
    flight = in_flight_forwards(schedule, stage.stage, lay.pp, lay.microbatches, vpp)
    return ActivationInfo(dict(saved.per_layer), saved.other, schedule, flight, vpp)
