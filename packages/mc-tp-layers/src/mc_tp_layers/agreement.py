r"""Agreement at construction: the ranks of a tensor-parallel group compare how they built
their layers, once, before the first forward communicates.

Why: a TP layer's peers must be built alike. A Column ``input_size`` or a Row
``output_size`` that differs across the ranks of a group aborts inside gloo or hangs at the
first collective; a ``num_embeddings`` that differs shifts every rank's vocabulary range; a
Row bias, ``skip_bias_add`` or ``input_is_parallel`` on one rank only, or a Row output size
that differs at equal numel, gives wrong numbers with no error at all.

Mechanism::

    construction   each layer records a fingerprint (its class and the sizes and flags
                   below) on its TP group's ledger; nothing is communicated
    first forward  of any layer whose fingerprint is pending, or
                   check_tp_agreement(model): every pending fingerprint of that group is
                   compared at once: one exchange of an 8-byte digest over the group
    mismatch       the ranks exchange their fingerprints (only then) and every rank
                   raises the same TensorParallelAgreementError naming the layer, the
                   field and the global ranks holding each value
    later forwards one attribute read; no communication

The ledger hangs off the process group object: it is a weak reference to the group (a
:class:`weakref.ref` subclass carrying the pending fingerprints), found again through
:func:`weakref.getweakrefs` by the next layer built on that group and kept alive by the
layers' fingerprints. There is no module-level registry: a group that is gone takes its
ledger with it. Fingerprints are small tuples, never the layers themselves, so a layer
dropped before its first forward is still compared (every rank built it) and never kept
alive.

The comparison is :func:`mc_groups.cross_check` over the group (its fingerprint exchange is
point to point on its own tag on gloo, one all-gather on NCCL, followed by a device-to-host
read there), with one field per layer's class and per compared setting: it is not recorded
by :func:`mc_groups.record_collectives`, so collective counts do not change. Cost: at
construction, a tuple of about 15 fields per layer; at the first forward, one 8-byte
exchange per TP group per batch of newly built layers (a model built before its first
step: one exchange per group); per step, none. Call :func:`check_tp_agreement`
before capturing a CUDA graph (the first forward would otherwise exchange inside the
capture). Under ``torch.compile`` the first forward's exchanges run while Dynamo traces
the layer (natively, outside the graph, at each trace, keyed by the group so that
blocks compiled alike share one graph; see :mod:`mc_tp_layers.layers`): the
compiled graph holds no exchange and no graph break (every rank traces the same frames,
so the exchanges pair up).

Compared fields: Column ``input_size``, ``output_size``, ``bias``, ``gather_output``,
``skip_bias_add``, ``sequence_parallel``, ``params_dtype``, ``stride``, ``is_expert``,
``explicit_expert_comm``, ``disable_grad_reduce``, ``gtp_remat_size``, ``output_dtype``,
``defer_embedding_wgrad_compute``, ``wgrad_deferral_limit``; Row the same sizes and
``input_is_parallel``; ``VocabParallelEmbedding`` ``num_embeddings``, ``embedding_dim``,
``reduce_scatter_embeddings``, ``params_dtype``. Layers on a group of one rank compare
nothing.

What this catches that mc_groups' schedule check does not: the schedule check (opt-in, one
exchange per collective) compares each collective's op, numel, dtype and label as it is
issued, so it cannot see settings that leave those alike: a ``num_embeddings`` that
differs (the all-reduce of ``[b, s, h]`` has the same numel on every rank while the ranks
look up different rows), a Row bias, ``skip_bias_add`` or ``input_is_parallel`` on one rank
(local arithmetic after or before the same all-reduce), a Row output size at equal numel,
``gather_output`` or ``gtp_remat_size`` where the first differing collective is far from
the cause; and it is off unless asked for. Not compared: the weights' values, the init
method, the RNG tracker, and everything a layer receives per call (inputs, ``weight=``,
``runtime_gather_output``); :func:`~mc_tp_layers.vocab_parallel_cross_entropy` checks its
per-call vocabulary slice itself (see :mod:`mc_tp_layers.cross_entropy`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.comm.cross_rank import Value
from mc_groups.errors import ABSENT, Difference, InputTypeError

__all__ = ["LayerFingerprint", "TensorParallelAgreementError", "check_tp_agreement"]

_MAX_LINES = 20


class TensorParallelAgreementError(mg.AgreementError):
    """The ranks of a tensor-parallel group built their layers (or called the
    vocabulary-parallel cross-entropy) differently; every rank of the group raises it, with
    the same message."""


class _Ledger(weakref.ref[dist.ProcessGroup]):
    """The pending fingerprints of one group, hung off the group as a weak reference."""

    __slots__ = ("pending",)

    def __init__(self, group: dist.ProcessGroup) -> None:
        del group  # weakref.ref.__new__ made the reference
        self.pending: list[LayerFingerprint] = []


class LayerFingerprint:
    """What one layer was built with, and whether its TP peers confirmed the same.

    ``kind`` is the layer's class name, ``fields`` the compared sizes and flags, ``name``
    a label for messages (the layer's ``name=``, or its path once
    :func:`check_tp_agreement` saw it in a model; never compared).
    """

    __slots__ = ("checked", "fields", "kind", "ledger", "name")

    def __init__(
        self,
        kind: str,
        fields: tuple[tuple[str, Value], ...],
        name: str | None,
        ledger: _Ledger | None,
    ) -> None:
        self.kind, self.fields, self.name, self.ledger = kind, fields, name, ledger
        self.checked = ledger is None

    def group(self) -> dist.ProcessGroup | None:
        """The TP group this fingerprint is compared over (None: a group of one rank, or
        gone)."""
        return None if self.ledger is None else self.ledger()

    def describe(self) -> str:
        """``ColumnParallelLinear 'fc1'`` (or without the name)."""
        return f"{self.kind} {self.name!r}" if self.name else self.kind


def _ledger_of(group: dist.ProcessGroup) -> _Ledger:
    for ref in weakref.getweakrefs(group):
        if isinstance(ref, _Ledger):
            return ref
    return _Ledger(group)


def _plain(value: object) -> Value:
    if isinstance(value, torch.dtype):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def register(
    group: dist.ProcessGroup, kind: str, fields: Mapping[str, object], name: str | None
) -> LayerFingerprint:
    """Record a new layer's fingerprint on ``group``'s ledger (nothing is communicated).

    Call it last in the constructor, once every argument was accepted. On a group of one
    rank the fingerprint is born checked.
    """
    plain = tuple((key, _plain(value)) for key, value in fields.items())
    if group.size() == 1:
        return LayerFingerprint(kind, plain, name, None)
    ledger = _ledger_of(group)
    entry = LayerFingerprint(kind, plain, name, ledger)
    ledger.pending.append(entry)
    return entry


def settle(entry: LayerFingerprint) -> None:
    """Compare every pending fingerprint of ``entry``'s group (a no-op once checked)."""
    if not entry.checked and entry.ledger is not None:
        _settle(entry.ledger)


def settle_group(group: dist.ProcessGroup) -> None:
    """Compare every pending fingerprint of ``group``'s ledger (a no-op when none is
    pending or the group has no ledger)."""
    for ref in weakref.getweakrefs(group):
        if isinstance(ref, _Ledger):
            _settle(ref)


def check_tp_agreement(model: torch.nn.Module | Sequence[torch.nn.Module]) -> int:
    """Compare now, over each TP group, how every rank built the TP layers of ``model``.

    ``model`` is a module or a list of model chunks. For each TP group its layers use (in
    the order the layers appear), every fingerprint still pending on that group (the
    model's and any other layer built on it since the last comparison) is compared in one
    exchange; a mismatch raises :class:`TensorParallelAgreementError` on every rank of the
    group, naming the layers by their path in ``model``. Every rank of each group must
    call it (as for a collective). The first forward of each layer does the same
    comparison when this was not called; call it explicitly before compiling the model or
    capturing it in a CUDA graph. Returns how many layers were compared (0 when all were
    compared before).
    """
    if not isinstance(model, (torch.nn.Module, list, tuple)):
        raise InputTypeError(
            f"model={model!r} must be a torch.nn.Module or a list of model chunks (modules)"
        )
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise InputTypeError(
                f"model[{index}]={chunk!r} must be a torch.nn.Module (model is a module or "
                "a list of model chunks)"
            )
    ledgers: list[_Ledger] = []
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 else ""
        for path, module in chunk.named_modules():
            entry = getattr(module, "_tp_agreement", None)
            if not isinstance(entry, LayerFingerprint) or entry.checked:
                continue
            entry.name = prefix + path if path or prefix else entry.name
            if entry.ledger is not None and all(entry.ledger is not seen for seen in ledgers):
                ledgers.append(entry.ledger)
    compared = 0
    for ledger in ledgers:
        compared += _settle(ledger)
    return compared


def _settle(ledger: _Ledger) -> int:
    batch = list(ledger.pending)
    group = ledger()
    if not batch or group is None:
        return 0
    _compare(group, batch)
    for entry in batch:
        entry.checked = True
    del ledger.pending[: len(batch)]
    return len(batch)


_WHAT = "tensor-parallel layers"
_COUNT = "layers"


def _key(index: int, name: str | None = None) -> str:
    r"""The field of layer #``index`` (1-based): its class, or one of its ``name``\ d
    fields."""
    return f"layer #{index}" if name is None else f"layer #{index}.{name}"


def _layer_of(key: str) -> tuple[int, str | None] | None:
    """Inverse of :func:`_key` (None for the count): the keys are this module's own."""
    if not key.startswith("layer #"):
        return None
    index, _, name = key.removeprefix("layer #").partition(".")
    return int(index), name or None


def _fields(batch: list[LayerFingerprint]) -> dict[str, Value]:
    fields: dict[str, Value] = {_COUNT: len(batch)}
    for index, entry in enumerate(batch, start=1):
        fields[_key(index)] = entry.kind
        fields.update({_key(index, name): value for name, value in entry.fields})
    return fields


def _compare(group: dist.ProcessGroup, batch: list[LayerFingerprint]) -> None:
    try:
        mg.cross_check(group, _WHAT, _fields(batch))
    except mg.AgreementError as err:
        raise TensorParallelAgreementError(
            _message(err, batch), err.what, err.group_ranks, err.differences
        ) from None


def _values(difference: Difference) -> str:
    """The values that some rank holds (a layer that a rank did not build is left out),
    the most common first."""
    held = [(value, ranks) for value, ranks in difference.values if value != ABSENT]
    held.sort(key=lambda pair: -len(pair[1]))
    return ", ".join(f"{value} on rank(s) {sorted(ranks)}" for value, ranks in held)


def _differences(err: mg.AgreementError, local: list[LayerFingerprint]) -> list[str]:
    lines: list[str] = []
    classes_differ: set[int] = set()
    for difference in err.differences:
        layer = _layer_of(difference.field)
        if layer is None:
            lines.append(f"number of layers built on this group: {_values(difference)}")
            continue
        index, name = layer
        if index in classes_differ or sum(v != ABSENT for v, _ in difference.values) < 2:
            continue  # a layer only some ranks built: the count says it
        label = f"layer #{index}"
        if index <= len(local):
            label += f" ({local[index - 1].describe()})"
        if name is None:
            classes_differ.add(index)
            lines.append(f"{label}: class {_values(difference)}")
        else:
            lines.append(f"{label}: {name} = {_values(difference)}")
    return lines


def _message(err: mg.AgreementError, local: list[LayerFingerprint]) -> str:
    lines = _differences(err, local)
    shown = [f"  {line}" for line in lines[:_MAX_LINES]]
    if len(lines) > _MAX_LINES:
        shown.append(f"  ... and {len(lines) - _MAX_LINES} more difference(s)")
    return "\n".join(
        [
            f"tensor-parallel group ranks {list(err.group_ranks)} built their layers "
            "differently (compared before the first forward; nothing of it was "
            "communicated); layers are numbered in construction order since the group's last "
            "comparison:",
            *shown,
            "Every rank of a tensor-parallel group must build the same layers, in the same "
            "order, with the same sizes and flags.",
        ]
    )
