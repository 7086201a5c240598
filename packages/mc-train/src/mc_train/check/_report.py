"""The report of a layout check: per parameter, per step, per group; as text and JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mc_train.check._spec import Layout, Workload

__all__ = ["CollectiveCount", "LayoutReport", "ParamFinding", "RankFailureReport"]

EQUAL = "equal"


@dataclass(frozen=True)
class ParamFinding:
    """What the layout did to one parameter, against one process.

    Attributes:
        name: the one-process name (the first of a tied weight's names).
        verdict: ``"equal"`` or the pattern's short name: ``"ratio"``, ``"partial sum over
            TP"``, ``"tied copies not summed"``, ``"DP replicas differ"``, ``"never
            updated"``, ``"some TP slices differ"``, ``"replicas differ"``, ``"differs"``,
            ``"untagged expert param"``, ``"shape differs"``,
            ``"final weights differ"``, ``"later steps differ"`` (a consequence of another
            parameter's first step), ``"differs before training"``, ``"missing"``.
        pattern: the difference in words (``"×2 (= TP) on every rank"``).
        cause: the likely cause in words, with the fix.
        ratio: the first step's update on the layout over one process's (the ratio of the
            gradients: plain SGD moves each weight by ``-lr · grad``), fitted by least
            squares over every rank holding it; None where no rank holds it.
        error: the largest relative difference of a rank's first-step gradient from one
            process's (``‖g − g₁‖ / ‖g₁‖``).
        final_error: the largest relative difference of a rank's final weights from one
            process's, relative to how far one process moved them.
        ranks: the ranks whose copy differs (empty when equal).
        marks: the mc marks the layout's param carries (``sequence_parallel``, …).
    """

    name: str
    verdict: str
    pattern: str = ""
    cause: str = ""
    ratio: float | None = None
    error: float = 0.0
    final_error: float = 0.0
    ranks: tuple[int, ...] = ()
    marks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Equal to one process (first-step gradient and final weights)."""
        return self.verdict == EQUAL


@dataclass(frozen=True)
class CollectiveCount:
    """Collectives of one kind a rank issued in one step: ``count`` × ``op`` on ``group``
    labelled ``label``, ``bytes`` sent in all."""

    op: str
    group: str
    label: str
    count: int
    bytes: int


@dataclass(frozen=True)
class RankFailureReport:
    """A rank that raised: where (``phase``, the module whose forward was running, its
    input shapes and plan entries) and what, with the likely cause. ``rank`` is -1 for the
    one-process run and for a failure no rank described."""

    rank: int
    coords: tuple[int, int, int]
    phase: str
    error: str
    module: str | None = None
    module_type: str | None = None
    inputs: tuple[tuple[int, ...], ...] = ()
    plan_entries: tuple[str, ...] = ()
    cause: str = ""

    def text(self) -> str:
        """The failure in a few lines."""
        t, d, p = self.coords
        who = f"rank {self.rank} (tp {t}, dp {d}, stage {p})" if self.rank >= 0 else "the check"
        lines = [f"{who} failed in {self.phase}:"]
        if self.module is not None:
            entries = ", ".join(repr(e) for e in self.plan_entries) or "no plan entry"
            shapes = ", ".join(str(list(s)) for s in self.inputs) or "none"
            lines.append(
                f"  while {self.module} ({self.module_type}; {entries}) ran on inputs {shapes}"
            )
        lines.append(f"  {self.error}")
        if self.cause:
            lines.append(f"  likely cause: {self.cause}")
        return "\n".join(lines)


@dataclass(frozen=True)
class LayoutReport:
    """The result of :func:`mc_train.check.check_layout`.

    Attributes:
        layout: the layout checked.
        workload: what both runs trained.
        params: one finding per one-process parameter, in the model's order.
        losses: the layout's loss per step (the same on every rank).
        reference_losses: one process's loss per step.
        loss_note: what the losses' difference says, when they differ.
        collectives: per pipeline stage (its first rank), the collectives of one step (the
            second when there are two: the first adds one-off agreement exchanges and the
            pipeline's shape inference), by op, group and label.
        extra: names a rank holds that one process does not (with the rank).
        failure: the ranks that raised, or None.
        seconds: wall time of the check.
    """

    layout: Layout
    workload: Workload
    params: tuple[ParamFinding, ...] = ()
    losses: tuple[float, ...] = ()
    reference_losses: tuple[float, ...] = ()
    loss_note: str = ""
    collectives: dict[int, tuple[CollectiveCount, ...]] = field(default_factory=dict)
    extra: tuple[str, ...] = ()
    failure: tuple[RankFailureReport, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every parameter equal, every loss equal, no rank failed."""
        return (
            not self.failure
            and bool(self.params)
            and all(f.ok for f in self.params)
            and not self.loss_note
            and not self.extra
        )

    def finding(self, name: str) -> ParamFinding:
        """The finding of the one-process parameter ``name`` (a ``KeyError`` if none)."""
        for found in self.params:
            if found.name == name:
                return found
        raise KeyError(name)

    def text(self) -> str:
        """The report as the command line prints it."""
        lines = [
            f"mc layout check: {self.workload.model} at {self.layout.describe()}, "
            f"{self.workload.steps} steps of SGD (lr {self.workload.lr}) against one process"
        ]
        if self.failure:
            lines.append("FAILED before the comparison:")
            lines += [f.text() for f in self.failure]
            return "\n".join(lines)
        lines.append("")
        lines.append("loss per step (layout / one process):")
        for step, (a, b) in enumerate(zip(self.losses, self.reference_losses, strict=True), 1):
            lines.append(f"  step {step}: {a:.6f} / {b:.6f}  (rel {abs(a - b) / abs(b):.1e})")
        if self.loss_note:
            lines.append(f"  ! {self.loss_note}")
        lines.append("")
        equal = sum(f.ok for f in self.params)
        lines.append(f"parameters: {equal} of {len(self.params)} equal to one process")
        groups: dict[tuple[str, str], list[ParamFinding]] = {}
        for f in self.params:
            if not f.ok:
                groups.setdefault((f.verdict, f.cause), []).append(f)
        for (verdict, cause), found in groups.items():
            patterns = {f.pattern for f in found}
            shared = patterns.pop() if len(patterns) == 1 else ""
            lines.append(f"  {verdict} ({len(found)}){': ' + shared if shared else ''}")
            for f in found[:5] if len(found) > 8 else found:
                ranks = f" on ranks {list(f.ranks)}" if f.ranks else ""
                numbers = (
                    f" (first-step grad rel err {f.error:.2e}, final weights {f.final_error:.2e})"
                    if f.verdict not in ("shape differs", "missing")
                    else ""
                )
                lines.append(f"    {f.name}{'' if shared else ': ' + f.pattern}{ranks}{numbers}")
            if len(found) > 8:
                lines.append(f"    ... and {len(found) - 5} more (--json lists every one)")
            if cause:
                lines.append(f"    likely cause: {cause}")
        for name in self.extra:
            lines.append(f"  {name}: held by the layout, not by one process")
        lines.append("")
        for rank, counts in self.collectives.items():
            which = "2" if self.workload.steps > 1 else "1"
            lines.append(
                f"collectives of step {which} on rank {rank} (count × op on group: label, bytes):"
            )
            for c in counts:
                lines.append(f"  {c.count:3d} × {c.op} on {c.group}: {c.label} ({c.bytes} B)")
        lines.append("")
        lines.append("OK: every parameter matches one process" if self.ok else "NOT OK")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``--json``)."""
        return {
            "ok": self.ok,
            "layout": asdict(self.layout),
            "workload": asdict(self.workload),
            "losses": list(self.losses),
            "reference_losses": list(self.reference_losses),
            "loss_note": self.loss_note,
            "params": [asdict(f) | {"ok": f.ok} for f in self.params],
            "extra": list(self.extra),
            "collectives": {
                str(rank): [asdict(c) for c in counts] for rank, counts in self.collectives.items()
            },
            "failure": [asdict(f) for f in self.failure],
            "seconds": self.seconds,
        }
