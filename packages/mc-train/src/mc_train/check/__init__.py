r"""Check a model's parallel layout against one process, on CPU, before renting GPUs.

::

    from mc_train.check import check_layout

    report = check_layout("examples.hf_3d:build_model", tp=2, pp=2, dp=2, sequence_parallel=True)
    print(report.text())            # per parameter: equal, or the pattern and likely cause
    assert report.ok

or from a shell (exit status 0 only when every parameter matches)::

    python -m mc_train.check examples.hf_3d:build_model --tp 2 --pp 2 --dp 2 --sp

What runs (``docs/check.md``):

1. **One process** (a world of one rank, :class:`~mc_groups.testing.RankPool`): the model as
   built, called on each step's whole global batch, the mean next-token cross-entropy,
   ``torch.optim.SGD``; it keeps the first step's gradients and the weights.
2. **The layout** (``tp · pp · dp`` gloo ranks): the same model cut into pipeline stages
   (:func:`mc_train.split_model`), converted with the plan
   (:func:`mc_tp_layers.parallelize`), trained by :func:`mc_train.build_pipeline` (mc DDP,
   ``finalize_model_grads``) and :class:`mc_ddp.ShardedOptimizer` over the same SGD on the
   same global batches, each DP rank on its rows. Each rank gathers its weights whole
   (:func:`mc_tp_layers.full_state_dict`) before training, after step 1 and at the end,
   and records the collectives of one step.
3. **The comparison**, per parameter under its one-process name: a rank's first-step
   update over ``-lr`` is the gradient its optimizer applied, compared with one process's
   gradient; then the final weights, the losses, and the pattern of any difference with its
   likely cause (:mod:`mc_train.check._compare`).

A rank that raises is reported with the phase and the module whose forward was running,
its inputs' shapes and plan entries, instead of a bare traceback. The loss takes one of
the LOSSES (``auto``: vocabulary-parallel when the logits are ``V/TP`` wide).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from mc_groups.argcheck import check_real, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_groups.testing import RankFailure, RankPool
from mc_train.check._compare import collective_counts, compare_params, loss_note
from mc_train.check._rank import RankRun, ReferenceRun, reference_here, run_layout, run_reference
from mc_train.check._report import CollectiveCount, LayoutReport, ParamFinding, RankFailureReport
from mc_train.check._spec import (
    LOSSES,
    Layout,
    Ref,
    Workload,
    check_plan,
    function_ref,
    resolve,
    takes_layout,
)

__all__ = [
    "LOSSES",
    "CollectiveCount",
    "Layout",
    "LayoutReport",
    "ParamFinding",
    "RankFailureReport",
    "ReferenceRun",
    "Workload",
    "check_layout",
    "default_rows",
    "reference_run",
]

_DEFAULT_ROWS = 8
_PEER_ERRORS = (
    "PeerCheckError",
    "CollectiveError",
    "timed out",
    "Connection closed",
    "DistBackendError",
)


def default_rows(layout: Layout) -> int:
    """Rows of the default global batch: 8, rounded up to a multiple of ``dp ·
    microbatches`` (so most small layouts share one process's run)."""
    unit = layout.dp * layout.micro
    return -(-max(_DEFAULT_ROWS, unit) // unit) * unit


def reference_run(
    workload: Workload, rows: int = _DEFAULT_ROWS, *, pool: RankPool | None = None
) -> ReferenceRun:
    """One process's run of ``workload`` (``rows``: the default batch's rows). A whole
    model (``build()``) runs in this process, plain PyTorch with no process group (the
    builder's seeding and imports happen here); a model built from mc's layers
    (``build(config, pg_collection)``) in a world of one rank (``pool``: a
    :class:`~mc_groups.testing.RankPool` of 1, else one started here). Give the result to
    :func:`check_layout` (``reference=``) to check several layouts against one run."""
    if not isinstance(workload, Workload):
        raise InputTypeError(
            f"workload must be a mc_train.check.Workload, got {type_name(workload)}"
        )
    if not takes_layout(resolve(workload.model)):
        return reference_here(workload, rows)
    owned = pool is None
    runner = RankPool(1, pg_timeout_s=120.0, call_deadline_s=600.0) if pool is None else pool
    if runner.world_size != 1:
        raise InputValueError(f"pool has {runner.world_size} ranks; the reference runs on 1")
    try:
        return runner.run(run_reference, workload, rows)[0]
    finally:
        if owned:
            runner.close()


def check_layout(
    model: Ref,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    sequence_parallel: bool = False,
    plan: Mapping[str, Any] | Ref | None = None,
    batch: Ref | None = None,
    forward: Ref | None = None,
    sequence_first: bool = False,
    steps: int = 3,
    lr: float = 0.1,
    distributed_optimizer: bool = False,
    overlap: bool = True,
    microbatches: int | None = None,
    loss: str = "auto",
    data_parallel: str = "ddp",
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    after_parallelize: Ref | None = None,
    finalize: Ref | None = None,
    rtol: float = 1e-4,
    reference: ReferenceRun | None = None,
    pool: RankPool | None = None,
    reference_pool: RankPool | None = None,
) -> LayoutReport:
    """Train ``model`` at the layout and in one process; compare every parameter (module
    notes). Returns a :class:`LayoutReport` (``report.ok``, ``report.text()``).

    Args:
        model: ``"module:function"`` (or a module-level function) returning a fresh model
            with fixed weights: ``build()`` for a whole model the check converts and
            splits, ``build(config, pg_collection)`` for one built from mc's layers
            (:class:`Workload`).
        tp: the layout, with ``pp``, ``dp``, ``sequence_parallel``,
            ``distributed_optimizer``, ``overlap``, ``microbatches``, ``loss``,
            ``data_parallel`` (``"ddp"`` or ``"fsdp2"``), ``expert_parallel`` and
            ``expert_tensor_parallel`` (:class:`Layout`). With expert parallelism a MoE
            model is converted by :func:`mc_moe.parallelize` with its ``ep_plan``.
        plan: the ``parallelize`` plan: a mapping, or a function of the model returning
            one; None: ``sequence_parallel_plan(model)`` with ``sequence_parallel``, else
            the model's own ``tp_plan``.
        batch: the workload, with ``forward``, ``sequence_first``, ``steps`` and ``lr``
            (:class:`Workload`).
        after_parallelize: ``hook(chunk, stage)`` run on each of a rank's chunks after
            ``parallelize`` (and for a model built from mc's layers, after building),
            before mc DDP wraps it: e.g. tags your own code sets; also how the tests inject
            a mistake.
        finalize: what the pipeline runs after the last backward instead of
            ``mc_finalize.finalize_model_grads`` (``build_pipeline``'s
            ``finalize_model_grads_func``), e.g. your loop's own.
        rtol: the relative difference of a gradient still called equal (beyond fp32
            rounding of the weights); final weights get 100 × that.
        reference: one process's run from :func:`reference_run` (its workload must be
            this one); None: run here.
        pool: a :class:`~mc_groups.testing.RankPool` of ``tp · pp · dp`` ranks to run in
            (tests reuse theirs); None: one started and closed here.
        reference_pool: a pool of 1 rank for the one-process run of a model built from
            mc's layers; None: one started and closed here.
    """
    start = time.monotonic()
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer,
        overlap=overlap,
        microbatches=microbatches,
        loss=loss,
        data_parallel=data_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    work = Workload(
        model=_ref("model", model),
        batch=function_ref("batch", batch, optional=True),
        forward=function_ref("forward", forward, optional=True),
        sequence_first=sequence_first,
        steps=steps,
        lr=lr,
    )
    plan_arg = check_plan(plan)
    hook = function_ref("after_parallelize", after_parallelize, optional=True)
    fin = function_ref("finalize", finalize, optional=True)
    check_real("rtol", rtol, positive=True, allow_zero=False)
    if pool is not None and pool.world_size != layout.world_size:
        raise InputValueError(
            f"pool has {pool.world_size} ranks, the layout needs tp·pp·dp = {layout.world_size}"
        )
    rows = default_rows(layout)
    if reference is None:
        try:
            reference = reference_run(work, rows, pool=reference_pool)
        except RankFailure as err:
            failed = RankFailureReport(-1, (0, 0, 0), "the one-process run", _last_error(str(err)))
            return LayoutReport(layout, work, failure=(failed,), seconds=time.monotonic() - start)
        except Exception as err:  # the user's builder, forward or batch, in this process
            what = f"{type(err).__name__}: {err}"
            failed = RankFailureReport(-1, (0, 0, 0), "the one-process run (this process)", what)
            return LayoutReport(layout, work, failure=(failed,), seconds=time.monotonic() - start)
    elif reference.workload != work or (work.batch is None and reference.rows != rows):
        raise InputValueError(
            "reference= was run for another workload (model, batch, forward, steps, lr or "
            f"the default batch's rows, {rows} here); run reference_run with this one"
        )
    _check_batch(reference, layout)
    runs, failure = _run_ranks(work, layout, plan_arg, hook, fin, reference, pool)
    if failure:
        return LayoutReport(layout, work, failure=tuple(failure), seconds=time.monotonic() - start)
    losses = runs[0].losses
    note = loss_note(losses, reference.losses, layout, max(rtol, 1e-5))
    params, extra = compare_params(
        reference, runs, layout, work.lr, rtol, forward_differs=bool(note)
    )
    firsts = {}
    for run in runs:
        stage = run.coords[2]
        if stage not in firsts:
            firsts[stage] = run
    collectives = {run.rank: collective_counts(run.collectives) for run in firsts.values()}
    return LayoutReport(
        layout,
        work,
        tuple(params),
        tuple(losses),
        tuple(reference.losses),
        note,
        collectives,
        tuple(extra),
        seconds=time.monotonic() - start,
    )


def _ref(name: str, value: object) -> str:
    ref = function_ref(name, value)
    assert ref is not None
    return ref


def _last_error(text: str) -> str:
    """The exception line of a rank's traceback (the last line that names an error)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line.strip()
    return lines[-1].strip() if lines else text


def _check_batch(reference: ReferenceRun, layout: Layout) -> None:
    rows, seq = reference.batch_shape
    unit = layout.dp * layout.micro
    if rows % unit:
        raise InputValueError(
            f"the global batch has {rows} rows, not a multiple of dp·microbatches = "
            f"{layout.dp}·{layout.micro} = {unit}: change the batch, --dp or --microbatches"
        )
    if layout.sequence_parallel and seq % layout.tp:
        raise InputValueError(
            f"the sequence length {seq} does not divide by tp={layout.tp}, which sequence "
            "parallelism splits it over"
        )


def _run_ranks(
    work: Workload,
    layout: Layout,
    plan: Mapping[str, Any] | str | None,
    hook: str | None,
    fin: str | None,
    reference: ReferenceRun,
    pool: RankPool | None,
) -> tuple[list[RankRun], list[RankFailureReport]]:
    owned = pool is None
    builder_module = work.model.partition(":")[0]
    preload = ["mc_train.check._rank", *reference.imports]
    if "@" not in work.model and builder_module != "__main__":
        preload.append(builder_module)
    runner = (
        RankPool(layout.world_size, pg_timeout_s=60.0, call_deadline_s=600.0, preload=preload)
        if pool is None
        else pool
    )
    diag_dir = tempfile.mkdtemp(prefix="mc-check-")
    try:
        runs = runner.run(
            run_layout,
            work,
            layout,
            plan,
            hook,
            fin,
            (reference.vocab, reference.batch_shape[0]),
            diag_dir,
        )
        return runs, []
    except RankFailure as err:
        return [], _failures(diag_dir, layout, str(err))
    finally:
        if owned:
            runner.close()
        shutil.rmtree(diag_dir, ignore_errors=True)


def _failures(diag_dir: str, layout: Layout, text: str) -> list[RankFailureReport]:
    """The ranks' own accounts of their errors, root causes first (an error that only
    reports a peer's comes last); the pool's text when no rank wrote one."""
    found = []
    for path in sorted(glob.glob(os.path.join(diag_dir, "rank*.json"))):
        with open(path, encoding="utf-8") as f:
            found.append(json.load(f))
    if not found:
        return [RankFailureReport(-1, (0, 0, 0), "the ranks' run", text[-3000:])]
    found.sort(
        key=lambda d: (any(p in d["error"] for p in _PEER_ERRORS), d["where"] is None, d["rank"])
    )
    out, seen = [], set()
    for d in found:
        key = (d["phase"], d["error"][:200])
        if key in seen:
            continue
        seen.add(key)
        where = d["where"] or {}
        out.append(
            RankFailureReport(
                d["rank"],
                tuple(d["coords"]),
                d["phase"],
                d["error"][:2000],
                where.get("module"),
                where.get("type"),
                tuple(tuple(s) for s in where.get("inputs", ())),
                tuple(where.get("plan", ())),
                _failure_cause(where, layout),
            )
        )
    return out[:3]


def _failure_cause(where: dict[str, Any], layout: Layout) -> str:
    expected = where.get("expects")
    shapes = where.get("inputs") or []
    if not where or expected is None or not shapes or not shapes[0]:
        return ""
    got, tp = shapes[0][-1], layout.tp
    name = where.get("module")
    if got * tp == expected:
        return (
            f"{name} gets 1/TP of the {expected} features it expects: the layer before it "
            "is split ('colwise') but this one is whole; give it 'rowwise' in the plan (or "
            "make the layer before it 'colwise_gather_output')"
        )
    if got == expected * tp:
        return (
            f"{name} expects 1/TP of its input's {got} features: it is split 'rowwise' but "
            "its input is whole; use 'rowwise_split_input', or make the layer before it "
            "'colwise'"
        )
    return ""
