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

The digest exchange is :func:`mc_groups.schedule_check.verify_schedule` (point to point on
its own tag on gloo, one all-gather on NCCL, followed by a device-to-host read there): it
is not recorded by :func:`mc_groups.record_collectives`, so collective counts do not
change. Cost: at construction, a tuple of about 15 fields per layer; at the first forward,
one 8-byte exchange per TP group per batch of newly built layers (a model built before its
first step: one exchange per group); per step, none. Call :func:`check_tp_agreement`
before capturing a CUDA graph (the first forward would otherwise exchange inside the
capture). Under ``torch.compile`` the first forward's exchanges run while Dynamo traces
the layer (natively, outside the graph, once per layer; see
:mod:`mc_tp_layers._layer_base`): the compiled graph holds no exchange and no graph
break (every rank traces at its first call, so the exchanges pair up).

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

import json
import re
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import schedule_check
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["LayerFingerprint", "TensorParallelAgreementError", "check_tp_agreement"]

_KIND = "tp layer agreement"
_MAX_LINES = 20


class TensorParallelAgreementError(InputValueError):
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

    __slots__ = ("checked", "fields", "first_forward_done", "kind", "ledger", "name")

    def __init__(
        self,
        kind: str,
        fields: tuple[tuple[str, object], ...],
        name: str | None,
        ledger: _Ledger | None,
    ) -> None:
        self.kind, self.fields, self.name, self.ledger = kind, fields, name, ledger
        self.checked = ledger is None
        self.first_forward_done = False  # the layer's first forward checks ran (either mode)

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


def _plain(value: object) -> object:
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


def _exchange_device(group: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(batch: list[LayerFingerprint]) -> str:
    rows = [[entry.kind, [list(field) for field in entry.fields]] for entry in batch]
    return json.dumps(rows, separators=(",", ":"))


def _compare(group: dist.ProcessGroup, batch: list[LayerFingerprint]) -> None:
    planned = schedule_check.PlannedCollective(
        kind=_KIND, payload=f"{len(batch)} layer(s)", detail=_encode(batch)
    )
    try:
        schedule_check.verify_schedule(group, planned, _exchange_device(group))
    except mg.CollectiveScheduleError as err:
        variants = _variants(str(err))
        if variants is None:  # a peer was about to run something else: its error says what
            raise
        ranks = list(mg.group_ranks(group))
        raise TensorParallelAgreementError(_message(ranks, variants, batch)) from None


_VARIANT = re.compile(
    r"^  rank\(s\) \[(?P<ranks>[0-9, ]*)\]: "
    + re.escape(_KIND)
    + r" of \d+ layer\(s\) \[(?P<detail>.*)\]$"
)

_Row = tuple[str, dict[str, object]]


def _variants(message: str) -> list[tuple[list[int], list[_Row]]] | None:
    """The schedule check's variants when every one is a layer comparison, else None."""
    lines = [line for line in message.splitlines() if line.startswith("  rank(s) ")]
    variants: list[tuple[list[int], list[_Row]]] = []
    for line in lines:
        match = _VARIANT.match(line)
        if match is None:
            return None
        ranks = [int(r) for r in match["ranks"].split(",")]
        rows = [(kind, dict(fields)) for kind, fields in json.loads(match["detail"])]
        variants.append((ranks, rows))
    return variants or None


def _show(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _by_value(values: Sequence[tuple[object, list[int]]]) -> str:
    merged: dict[str, list[int]] = {}
    for value, ranks in values:
        merged.setdefault(_show(value), []).extend(ranks)
    return ", ".join(f"{value} on rank(s) {sorted(ranks)}" for value, ranks in merged.items())


def _differences(
    variants: list[tuple[list[int], list[_Row]]], local: list[LayerFingerprint]
) -> list[str]:
    lines: list[str] = []
    counts = [(len(rows), ranks) for ranks, rows in variants]
    if len({count for count, _ in counts}) > 1:
        lines.append(f"number of layers built on this group: {_by_value(list(counts))}")
    for index in range(max(count for count, _ in counts)):
        label = f"layer #{index + 1}"
        if index < len(local):
            label += f" ({local[index].describe()})"
        present = [(rows[index], ranks) for ranks, rows in variants if index < len(rows)]
        kinds = [(row[0], ranks) for row, ranks in present]
        if len({kind for kind, _ in kinds}) > 1:
            lines.append(f"{label}: class {_by_value(kinds)}")
            continue
        names: list[str] = []
        for row, _ in present:
            names += [name for name in row[1] if name not in names]
        for name in names:
            values = [(row[1].get(name, "(absent)"), ranks) for row, ranks in present]
            if len({_show(value) for value, _ in values}) > 1:
                lines.append(f"{label}: {name} = {_by_value(values)}")
    return lines


def _message(
    ranks: list[int],
    variants: list[tuple[list[int], list[_Row]]],
    local: list[LayerFingerprint],
) -> str:
    lines = _differences(variants, local)
    shown = [f"  {line}" for line in lines[:_MAX_LINES]]
    if len(lines) > _MAX_LINES:
        shown.append(f"  ... and {len(lines) - _MAX_LINES} more difference(s)")
    return "\n".join(
        [
            f"tensor-parallel group ranks {ranks} built their layers differently (compared "
            "before the first forward; nothing of it was communicated); layers are numbered "
            "in construction order since the group's last comparison:",
            *shown,
            "Every rank of a tensor-parallel group must build the same layers, in the same "
            "order, with the same sizes and flags.",
        ]
    )
