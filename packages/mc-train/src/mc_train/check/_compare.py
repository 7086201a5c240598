r"""Reading the two runs: per parameter, the pattern of the difference and its likely cause.

The quantity compared first is the first step's gradient as each rank applied it: plain
SGD moves a weight by ``-lr · g``, so a rank's gathered ``(w₀ − w₁) / lr`` is the gradient
its optimizer used, whatever reduced it (DDP's all-reduce, the distributed optimizer's
reduce-scatter, finalize's TP and embedding sums). Against one process's ``g₁``:

- every rank's ``g`` equal to ``g₁``:   equal (then the final weights are compared too);
- every rank's ``g = c · g₁``:          a ratio, named when ``c`` is TP, DP, 2, the
                                       micro-batch count or their inverses;
- the TP ranks' copies differ, ``Σ_t g_t = g₁``:  a partial sum over TP nobody summed;
- the stages' copies differ, ``Σ_stages g = g₁``: a tied weight not summed over ``embd``;
- the DP replicas differ:               the grad not reduced over DP;
- some TP ranks' slices differ:         a split the forward does not use that way;
- every ``g = 0``:                      never updated.

Floating-point noise: a weight ``w`` stored in fp32 moves by ``-lr · g`` rounded to its
precision, so the recovered ``g`` carries an error up to ``ε·|w| / lr`` per element;
the check allows that plus ``rtol`` of ``‖g₁‖``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import replace

import torch

from mc_tp_layers.shards import split_full
from mc_train.check._rank import IN_EXPERTS, ParamRecord, RankRun, ReferenceRun
from mc_train.check._report import EQUAL, CollectiveCount, ParamFinding
from mc_train.check._spec import Layout

__all__ = ["collective_counts", "compare_params", "loss_note"]

_EPS = float(torch.finfo(torch.float32).eps)


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


class _Param:
    """One parameter's numbers: one process's and every holder's."""

    def __init__(
        self,
        name: str,
        ref: ReferenceRun,
        holders: list[tuple[RankRun, ParamRecord]],
        lr: float,
        rtol: float,
    ) -> None:
        self.name, self.holders, self.rtol = name, holders, rtol
        self.r = ref.grad[name].double()
        self.floor = 8 * _EPS * _norm(ref.before[name]) / lr
        self.grads = [(rec.before.double() - rec.after_first.double()) / lr for _, rec in holders]
        self.r_norm = _norm(self.r)
        moved = _norm(ref.final[name].double() - ref.before[name].double())
        self.final_errors = [
            _norm(rec.final.double() - ref.final[name].double()) / max(moved, 1e-30)
            for _, rec in holders
        ]
        self.final_floor = 8 * _EPS * _norm(ref.final[name]) / max(moved, 1e-30)

    def close(self, g: torch.Tensor, r: torch.Tensor) -> bool:
        return _norm(g - r) <= self.rtol * _norm(r) + self.floor

    def error(self, g: torch.Tensor) -> float:
        return _norm(g - self.r) / max(self.r_norm, self.floor, 1e-30)

    def ratio(self) -> float:
        num = sum(float((g * self.r).sum()) for g in self.grads)
        den = len(self.grads) * float((self.r * self.r).sum())
        return num / den if den > 0 else math.nan


_TP_MARKS = ("sum_gradients_across_tp_domain", "sequence_parallel")


def _ratio_names(
    layout: Layout, marks: tuple[str, ...], everywhere: bool
) -> list[tuple[float, str, str]]:
    """(value, name, cause) of the ratios a layout's mistakes produce. ``everywhere``: every
    parameter shows the same ratio, which points at the loss's scale rather than at one
    parameter's reduction."""
    tp, dp, m = layout.tp, layout.dp, layout.micro
    out: list[tuple[float, str, str]] = []
    marked = [mark for mark in _TP_MARKS if mark in marks]
    if tp > 1 and marked:
        out.append(
            (
                tp,
                "TP",
                f"it carries {marked[0]}, so finalize_model_grads summed its gradient over TP, "
                "but every TP rank already held the whole gradient (the param is outside the "
                "split region, or SP does not split its input): drop the mark or its plan entry",
            )
        )
    elif tp > 1:
        out.append(
            (
                tp,
                "TP",
                "summed over TP although every TP rank already held the whole gradient: two "
                "reductions over TP, or a mark (sum_gradients_across_tp_domain, or "
                "sequence_parallel under SP) set by code outside the plan",
            )
        )
    if tp > 1:
        out.append(
            (
                1 / tp,
                "1/TP",
                "each TP rank kept 1/TP of the gradient: averaged over TP where it should be "
                "summed (average_gradients_across_tp_domain)",
            )
        )
    if dp > 1:
        out += [
            (dp, "DP", "summed over DP instead of averaged (a reduction without DDP's 1/DP)"),
            (1 / dp, "1/DP", "divided by DP twice, or only one DP rank's rows reached it"),
        ]
    if everywhere:
        out += [
            (m, "micro-batches", "each micro-batch's loss not divided by the micro-batch count"),
            (1 / m, "1/micro-batches", "the loss divided by the micro-batch count twice"),
            (dp, "DP", "the loss not divided by DP (a sum over DP ranks where DDP averages)"),
        ]
    return out


def _name_ratio(
    c: float, layout: Layout, marks: tuple[str, ...], everywhere: bool
) -> tuple[str, str]:
    hits = [
        (name, cause)
        for v, name, cause in _ratio_names(layout, marks, everywhere)
        if abs(c / v - 1) < 0.02
    ]
    if not hits and abs(c / 2 - 1) < 0.02:
        hits = [
            ("2", "counted twice: a weight used twice (a tied embedding and head) summed again")
        ]
    if not hits:
        return f"×{c:.4g}", ""
    names = " = ".join(dict.fromkeys(n for n, _ in hits))
    causes = "; or ".join(dict.fromkeys(c for _, c in hits))
    return f"×{c:.4g} (= {names})", causes


def _ranks(holders: list[tuple[RankRun, ParamRecord]], keep: list[bool]) -> tuple[int, ...]:
    return tuple(sorted(run.rank for (run, _), k in zip(holders, keep, strict=True) if k))


def _group_sum(p: _Param, axis: int) -> bool | None:
    """Whether the copies that differ only along ``axis`` (0: tp, 1: dp, 2: stage) sum to
    one process's gradient, for every group of them (None: no group has two copies)."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
    for (run, _), g in zip(p.holders, p.grads, strict=True):
        key = tuple(c for i, c in enumerate(run.coords) if i != axis)
        groups[key].append(g)
    if all(len(v) < 2 for v in groups.values()):
        return None
    return all(p.close(torch.stack(v).sum(0), p.r) for v in groups.values() if len(v) > 1)


def _replicated_cause(layout: Layout, marks: tuple[str, ...]) -> str:
    if "sequence_parallel" in marks and not layout.sequence_parallel:
        return (
            "it is marked sequence_parallel but sequence parallelism is off, so "
            "finalize_model_grads ignores the mark (as Megatron does); a gradient that is a "
            "partial sum over TP without SP needs sum_gradients_across_tp_domain (the plan "
            "style 'replicated_with_grad_allreduce')"
        )
    if layout.sequence_parallel:
        return (
            "a replicated param (a norm) that runs on this rank's part of the sequence under "
            "SP: its gradient is a partial sum over TP that nothing sums. Give its module the "
            "plan entry 'sequence_parallel' (sequence_parallel_plan derives it), or mark the "
            "param with mc_groups.param_attrs.mark_sequence_parallel"
        )
    return (
        "a replicated param applied to this rank's split part (a per-head norm after a "
        "colwise layer): its gradient is a partial sum over TP that nothing sums. Give its "
        "module the plan entry 'replicated_with_grad_allreduce' (the mark "
        "sum_gradients_across_tp_domain)"
    )


_TIED = (
    "a weight tied across pipeline stages (embedding and LM head): each stage's copy holds "
    "its own part of the gradient and they were not summed over the embd group: "
    "finalize_model_grads was skipped, or the copies are not marked shared_embedding"
)
_DP = (
    "the data-parallel replicas applied different gradients: the grad was not reduced over "
    "DP (a param outside mc DDP's buffers, e.g. added after DDP was built, or the DP "
    "reduction never waited for: finalize_model_grads skipped with overlap_grad_reduce)"
)
_NEVER = (
    "no rank's optimizer moved it: it got no gradient in the layout (its module did not run "
    "in the parallel forward, requires_grad was turned off, or a hook dropped the grad) or "
    "the optimizer does not hold it"
)
_SLICES = (
    "the TP slices of these ranks differ while the others match: the plan splits this "
    "layer along a dimension, or with a stride, the forward does not use that way (a fused "
    "weight needs 'packed_colwise'), or only some ranks' part of the gradient was reduced"
)
_EXPERT_TAG = "expert (allreduce=False)"
_UNTAGGED = (
    "a param of an experts module without the expert tag (allreduce=False): mc DDP put it "
    "in the dense buffers and averaged it over the whole DP group, whose ranks hold other "
    "experts at the same place, instead of over the expert data-parallel group; tag it "
    "(mc_groups.param_attrs.mark_allreduce(param, False), as mc_moe.parallelize does) "
    "before DDP is built"
)
_SHAPE = (
    "a split param that does not say how it is split: without its tensor_model_parallel / "
    "partition_dim marks (lost when a wrapper replaced the params, e.g. fully_shard "
    "without mc's record) it is gathered as if whole, and finalize and the grad norm "
    "misread it too; keep the marks (mc_groups.param_attrs.record_marks before the wrapper, "
    "restore_marks after)"
)
_LATER = "final weights differ"
_CONSEQUENCE = "later steps differ"
_AFTER = (
    "a consequence of the parameters above: once one weight differs after the first step, "
    "every later step differs"
)
_FORWARD = (
    "the forward already differs from one process (see the loss), so the gradients behind "
    "the first differing module differ too; fix the loss first"
)


def _classify(
    p: _Param, layout: Layout, marks: tuple[str, ...], forward_differs: bool
) -> tuple[str, str, str, tuple[int, ...]]:
    """(verdict, pattern, cause, ranks off) of a parameter whose gradient is off somewhere."""
    ok = [p.close(g, p.r) for g in p.grads]
    off = _ranks(p.holders, [not k for k in ok])
    if p.r_norm <= p.floor:
        return "differs", "one process leaves it unchanged, the layout moves it", _NEVER, off
    if all(_norm(g) <= p.floor for g in p.grads):
        return (
            "never updated",
            f"unchanged on every rank (one process: ‖g‖ = {p.r_norm:.3g})",
            _NEVER,
            off,
        )
    first = p.grads[0]
    agree = all(_norm(g - first) <= p.rtol * _norm(first) + p.floor for g in p.grads)
    if not agree:
        if layout.tp > 1 and _group_sum(p, 0):
            return (
                "partial sum over TP",
                "the TP ranks' copies differ and sum to one process's gradient",
                _replicated_cause(layout, marks),
                off,
            )
        if _group_sum(p, 2):
            return (
                "tied copies not summed",
                "each pipeline stage's copy differs; the copies sum to one process's gradient",
                _TIED,
                off,
            )
        dp_sum = _group_sum(p, 1) if layout.dp > 1 else None
        if dp_sum is not None:
            return "DP replicas differ", "the DP replicas applied different gradients", _DP, off
        return (
            "replicas differ",
            f"equal on ranks {list(_ranks(p.holders, ok))}, differs on {list(off)}",
            _FORWARD if forward_differs else "",
            off,
        )
    c = p.ratio()
    if math.isfinite(c) and abs(c - 1) > 1e-3 and all(p.close(g, c * p.r) for g in p.grads):
        pattern, cause = _name_ratio(c, layout, marks, everywhere=False)
        return "ratio", f"{pattern} on every rank holding it", cause, off
    _, record = p.holders[0]
    if record.split is not None and layout.tp > 1:
        dim, stride = record.split
        bad = [
            t
            for t in range(layout.tp)
            if not p.close(
                split_full(first, dim, t, layout.tp, stride),
                split_full(p.r, dim, t, layout.tp, stride),
            )
        ]
        if 0 < len(bad) < layout.tp:
            return (
                "some TP slices differ",
                f"only the slices of TP rank(s) {bad} differ",
                _SLICES,
                off,
            )
    pattern = f"differs (best-fit ratio {c:.4g})" if math.isfinite(c) else "differs"
    return "differs", pattern, _FORWARD if forward_differs else "", off


def compare_params(
    ref: ReferenceRun,
    runs: list[RankRun],
    layout: Layout,
    lr: float,
    rtol: float,
    forward_differs: bool,
) -> tuple[list[ParamFinding], list[str]]:
    """One finding per one-process parameter, and the names a rank holds that one process
    does not (``"name (rank r)"``)."""
    holders: dict[str, list[tuple[RankRun, ParamRecord]]] = defaultdict(list)
    extra: list[str] = []
    for run in runs:
        seen: set[str] = set()
        for name, record in run.params.items():
            canonical = ref.names.get(name)
            if canonical is None and "shared_embedding" in record.marks:
                canonical = ref.tied_table
            if canonical is None:
                extra.append(f"{name} (rank {run.rank})")
            elif canonical not in seen:  # a tied weight's aliases on one rank: one copy
                seen.add(canonical)
                holders[canonical].append((run, record))
    findings = []
    for name in ref.before:
        found = holders.get(name, [])
        if not found:
            findings.append(
                ParamFinding(
                    name,
                    "missing",
                    "no rank holds it",
                    "the stage split or the model built for the layout leaves it out",
                )
            )
            continue
        shapes = {tuple(rec.before.shape) for _, rec in found}
        if shapes != {tuple(ref.before[name].shape)}:
            findings.append(
                ParamFinding(
                    name,
                    "shape differs",
                    f"the layout's gathered param has shape(s) {sorted(shapes)}, one "
                    f"process's {tuple(ref.before[name].shape)}",
                    _SHAPE,
                    marks=tuple(sorted({m for _, rec in found for m in rec.marks})),
                    ranks=tuple(run.rank for run, _ in found),
                )
            )
            continue
        p = _Param(name, ref, found, lr, rtol)
        marks = tuple(sorted({m for _, rec in found for m in rec.marks}))
        error = max(p.error(g) for g in p.grads)
        final_error = max(p.final_errors)
        ratio = p.ratio()
        before_off = [
            run.rank
            for run, rec in found
            if not torch.allclose(rec.before, ref.before[name], rtol=1e-6, atol=1e-7)
        ]
        base = ParamFinding(
            name, EQUAL, ratio=ratio, error=error, final_error=final_error, marks=marks
        )
        if before_off:
            findings.append(
                replace(
                    base,
                    verdict="differs before training",
                    pattern=f"the weights differ from one process's before any step on ranks "
                    f"{before_off}",
                    cause="the model builder must return the same weights on every call (seed "
                    "it), and a conversion must keep them (a plan style that re-initialises)",
                    ranks=tuple(before_off),
                )
            )
        elif all(p.close(g, p.r) for g in p.grads):
            if final_error <= 100 * rtol + p.final_floor:
                findings.append(base)
            else:
                findings.append(
                    replace(
                        base,
                        verdict=_LATER,
                        pattern=f"the first step's gradient matches, the weights after step "
                        f"{len(ref.losses)} differ by {final_error:.2e} of their movement",
                        cause="a later step differs: the optimizer state, the param all-gather "
                        "of the distributed optimizer, or a gradient right only in the first step",
                    )
                )
        elif IN_EXPERTS in marks and _EXPERT_TAG not in marks and layout.expert_parallel > 1:
            _, pattern, _, off = _classify(p, layout, marks, forward_differs)
            findings.append(
                replace(
                    base,
                    verdict="untagged expert param",
                    pattern=pattern,
                    cause=_UNTAGGED,
                    ranks=off,
                )
            )
        else:
            verdict, pattern, cause, off = _classify(p, layout, marks, forward_differs)
            findings.append(replace(base, verdict=verdict, pattern=pattern, cause=cause, ranks=off))
    return _loss_scale(_consequences(findings), layout), extra


def _loss_scale(findings: list[ParamFinding], layout: Layout) -> list[ParamFinding]:
    """Every parameter off by one ratio: the loss's scale, not a reduction (named again)."""
    ratios = [f.ratio for f in findings if f.verdict == "ratio" and f.ratio is not None]
    if len(ratios) != len(findings) or max(ratios) > min(ratios) * 1.01:
        return findings
    out = []
    for f in findings:
        pattern, cause = _name_ratio(ratios[0], layout, f.marks, everywhere=True)
        out.append(replace(f, pattern=f"{pattern} on every rank and every parameter", cause=cause))
    return out


def _consequences(findings: list[ParamFinding]) -> list[ParamFinding]:
    """Once one parameter's first step differs, every later step differs everywhere: the
    params whose first step matched are then reported as a consequence, not a finding."""
    if all(f.verdict in (EQUAL, _LATER) for f in findings):
        return findings
    return [
        replace(
            f, verdict=_CONSEQUENCE, pattern="first step equal, later steps differ", cause=_AFTER
        )
        if f.verdict == _LATER
        else f
        for f in findings
    ]


def loss_note(losses: list[float], reference: list[float], layout: Layout, rtol: float) -> str:
    """What the losses' difference says ("" when they match)."""
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference, strict=True)]
    if all(d <= rtol for d in diffs):
        return ""
    step = next(i for i, d in enumerate(diffs) if d > rtol)
    gap = losses[step] - reference[step]
    note = f"the loss differs from step {step + 1} on ({losses[step]:.6f} vs {reference[step]:.6f})"
    if step > 0:
        return note + ": the forward matched at first, a later update differs (see the params)"
    if layout.tp > 1 and abs(gap - math.log(layout.tp)) < 0.02:
        return (
            note + f": by log(TP) = {math.log(layout.tp):.4f}, the signature of logits gathered "
            "over the whole vocabulary read as one TP rank's slice by the vocabulary-parallel "
            "loss (a 'colwise_gather_output' head feeding vocab_parallel_cross_entropy): use "
            "'colwise' on the head, or the whole-vocabulary loss"
        )
    return (
        note + ": the forward itself differs from one process: a plan entry that splits a "
        "layer whose output the model then uses whole (or the reverse), a module the plan "
        "does not cover, or a loss reading split logits as whole"
    )


def collective_counts(log: list[tuple[str, str, str, int]]) -> tuple[CollectiveCount, ...]:
    """The step's collectives grouped by (op, group, label), in order of first issue."""
    counts: Counter[tuple[str, str, str]] = Counter()
    sizes: Counter[tuple[str, str, str]] = Counter()
    for op, group, label, size in log:
        counts[op, group, label] += 1
        sizes[op, group, label] += size
    return tuple(CollectiveCount(*key, counts[key], sizes[key]) for key in counts)
