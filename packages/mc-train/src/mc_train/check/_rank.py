r"""What the ranks run: the one-process reference (a world of one rank) and the layout.

Both runs build the same model, train ``steps`` steps of plain SGD on the same global
batches and return what the parent compares (weights are gathered whole with
:func:`mc_tp_layers.full_state_dict`, under the one-process names)::

    reference (1 rank)                      layout (tp·pp·dp ranks)
      model = build()                         model = build(); split_model; parallelize(plan)
      loss = CE(forward(model, ids))          build_pipeline (mc DDP, finalize) + ShardedOptimizer
      grad of step 1, weights before,         weights before, after step 1 and at the end,
      after step 1 and at the end, losses     losses, the collectives of one step by group

A rank that raises writes what it was doing (phase, the module whose forward was running,
its inputs' shapes and plan entry) to ``diag_dir/rank<r>.json`` before the error reaches
the pool, so the parent can name the module instead of showing a bare traceback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mc_groups as mg
import mc_moe
from mc_ddp import (
    DistributedDataParallelConfig,
    ShardedOptimizer,
    TorchFullyShardedDataParallelConfig,
    ensure_params_ready,
)
from mc_groups import param_attrs
from mc_groups.errors import InputTypeError, InputValueError
from mc_moe.state import expert_params
from mc_tp_layers import parallelize, sequence_parallel_plan
from mc_train.check._spec import Layout, Workload, resolve, takes_layout
from mc_train.loss import IGNORE_INDEX, causal_targets, token_cross_entropy
from mc_train.pipeline import Pipeline, build_pipeline
from mc_train.split import decoder_stages, split_model, stage_plan
from mc_train.stages import HFCausalLMForward, StageForward, StageInfo, call_module

__all__ = ["ParamRecord", "RankRun", "ReferenceRun", "run_layout", "run_reference"]

# The groups a collective's group is named by (several can hold the same ranks: then all).
_GROUP_NAMES = ("tp", "dp", "pp", "embd")
_EXPERT_GROUPS = ("ep", "expt_tp", "expt_dp")


@dataclass
class ReferenceRun:
    """The one-process run.

    Attributes:
        losses: the loss of each step (mean cross-entropy over the global batch).
        names: every parameter name (tied aliases included) → its canonical name (the
            first under which ``named_parameters`` lists the tensor).
        before / grad / after_first / final: canonical name → weight before training,
            gradient of step 1, weight after step 1, weight after the last step.
        vocab: the logits' last dimension ``V``.
        tied_table: canonical name of the weight a Megatron-style model shares
            between embedding and output layer (``shared_embedding_or_output_weight()``),
            where a later stage's copy has a name of its own.
        batch_shape: the global batch's ``[B, S]``.
        modules: the model's module names in registration order.
        workload / rows: what was run (the default batch's rows).
        imports: the modules defining the model's classes (what the layout's ranks
            preload: ``transformers`` costs seconds per rank otherwise).
    """

    losses: list[float]
    names: dict[str, str]
    before: dict[str, torch.Tensor]
    grad: dict[str, torch.Tensor]
    after_first: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    vocab: int
    tied_table: str | None
    batch_shape: tuple[int, int]
    modules: list[str] = field(default_factory=list)
    workload: Workload | None = None
    rows: int = 0
    imports: tuple[str, ...] = ()


@dataclass
class ParamRecord:
    """One parameter as a rank holds it (whole: split params gathered over TP).

    Attributes:
        split: ``(partition_dim, partition_stride)`` of a TP-split param, None if whole.
        marks: the mc marks it carries (``sequence_parallel``, ``shared_embedding``, …).
        before / after_first / final: the whole tensor before, after step 1, at the end.
    """

    split: tuple[int, int] | None
    marks: tuple[str, ...]
    before: torch.Tensor
    after_first: torch.Tensor
    final: torch.Tensor


@dataclass
class RankRun:
    """One rank of the layout.

    Attributes:
        rank: global rank.
        coords: ``(tp rank, dp rank, pp rank)``.
        stages: the global pipeline stages of its chunks.
        params: every parameter name its chunks hold (tied aliases included).
        losses: each step's loss as the pipeline reports it (the same on every rank).
        collectives: ``(op, group name, label, bytes)`` issued by this rank in one step
            (the second, or the only one).
    """

    rank: int
    coords: tuple[int, int, int]
    stages: list[int]
    params: dict[str, ParamRecord]
    losses: list[float]
    collectives: list[tuple[str, str, str, int]]


_MARKS: tuple[tuple[str, Callable[[torch.Tensor], bool]], ...] = (
    ("sequence_parallel", param_attrs.is_sequence_parallel_param),
    ("sum_gradients_across_tp_domain", param_attrs.sums_grad_across_tp),
    ("average_gradients_across_tp_domain", param_attrs.averages_grad_across_tp),
    ("shared_embedding", param_attrs.is_shared_embedding),
    ("expert (allreduce=False)", param_attrs.is_expert_param),
)
IN_EXPERTS = "in an experts module"
"""The mark of a param that :func:`expert_params` lists (a converted experts
module's), whatever its tags say."""


def _marks(param: torch.Tensor) -> tuple[str, ...]:
    return tuple(name for name, test in _MARKS if test(param))


def _build(work: Workload, config: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> Any:
    builder = resolve(work.model)
    model = builder(config, pgc) if takes_layout(builder) else builder()
    if not isinstance(model, nn.Module):
        raise InputTypeError(
            f"model builder {work.model!r} returned {type(model).__name__}, not a module"
        )
    return model


def _forward(work: Workload, model: nn.Module, sp_size: int) -> StageForward:
    if work.forward is not None:
        fn: StageForward = resolve(work.forward)
        return fn
    config = getattr(model, "config", None)
    if (
        config is not None
        and hasattr(config, "vocab_size")
        and hasattr(model, "get_input_embeddings")
    ):
        return HFCausalLMForward(sequence_parallel_size=sp_size)
    return call_module


def _vocab_of(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int):
        return size
    for module in model.modules():
        num = getattr(module, "num_embeddings", None)
        if isinstance(num, int):
            return num
    return None


def global_batch(work: Workload, step: int, rows: int, vocab: int | None) -> torch.Tensor:
    """The global batch of ``step``: the workload's ``batch(step)``, or ``rows`` random
    rows of ``work.seq_length`` ids below ``vocab`` (seeded by the step)."""
    if work.batch is not None:
        ids = resolve(work.batch)(step)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise InputTypeError(
                f"batch {work.batch!r}({step}) must return [B, S] int64 ids, got {got}"
            )
        return ids
    if vocab is None:
        raise InputValueError(
            "cannot find the model's vocabulary (no config.vocab_size, no embedding): pass "
            "batch= ('module:function' returning each step's [B, S] token ids)"
        )
    generator = torch.Generator().manual_seed(10_007 + step)
    return torch.randint(0, vocab, (rows, work.seq_length), generator=generator)


def _mean_ce(logits: torch.Tensor, target: torch.Tensor, sequence_first: bool) -> torch.Tensor:
    if sequence_first:
        logits = logits.transpose(0, 1)
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX)


def layout_config(
    tp: int, pp: int, sequence_parallel: bool, layout: Layout | None = None
) -> mg.ModelParallelConfig:
    """The config both runs give a builder and mc's parts: the layout, and
    ``use_cpu_initialization`` so that a model built from mc's layers draws every full
    weight on CPU and keeps its piece (the same numbers at every layout, given a seed)."""
    experts: dict[str, Any] = {}
    if layout is not None:
        experts = {
            "expert_model_parallel_size": layout.expert_parallel,
            "expert_tensor_parallel_size": layout.expert_tensor_parallel,
        }
    return mg.ModelParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        **experts,
    )


def run_reference(work: Workload, rows: int) -> ReferenceRun:
    """The one-process run of a model built from mc's layers, in a world of one rank (see
    :func:`reference_here`)."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(1)
    try:
        model = _build(work, layout_config(1, 1, False), pgc)
        return _train_reference(work, model, rows)
    finally:
        mg.destroy_model_parallel(pgc)


def reference_here(work: Workload, rows: int) -> ReferenceRun:
    """The one-process run in this process (a whole model needs no process group): the
    model as built, called on each step's whole global batch with the workload's forward,
    the mean cross-entropy of the next token, ``torch.optim.SGD``."""
    model = resolve(work.model)()
    if not isinstance(model, nn.Module):
        raise InputTypeError(
            f"model builder {work.model!r} returned {type(model).__name__}, not a module"
        )
    return _train_reference(work, model, rows)


def _train_reference(work: Workload, model: nn.Module, rows: int) -> ReferenceRun:
    names: dict[str, str] = {}
    canonical: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = canonical.setdefault(id(param), name)
    params = dict(model.named_parameters())
    shared = None
    get_shared = getattr(model, "shared_embedding_or_output_weight", None)
    if callable(get_shared):
        weight = get_shared()
        shared = canonical.get(id(weight)) if weight is not None else None
    forward = _forward(work, model, 1)
    opt = torch.optim.SGD(params.values(), lr=work.lr)
    before = {n: p.detach().clone() for n, p in params.items()}
    losses: list[float] = []
    grad: dict[str, torch.Tensor] = {}
    after_first: dict[str, torch.Tensor] = {}
    vocab, shape = 0, (0, 0)
    for step in range(work.steps):
        ids = global_batch(work, step, rows, _vocab_of(model))
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        logits: torch.Tensor = forward(model, ids, StageInfo(0, 1, 0))
        vocab = int(logits.shape[-1])
        loss = _mean_ce(logits, causal_targets(ids), work.sequence_first)
        opt.zero_grad()
        torch.autograd.backward(loss)
        if step == 0:
            grad = {n: _zero_if_none(p) for n, p in params.items()}
        opt.step()
        losses.append(float(loss.detach()))
        if step == 0:
            after_first = {n: p.detach().clone() for n, p in params.items()}
    final = {n: p.detach().clone() for n, p in params.items()}
    modules = [name for name, _ in model.named_modules() if name]
    imports = tuple(sorted({type(m).__module__ for m in model.modules()}))
    return ReferenceRun(
        losses,
        names,
        before,
        grad,
        after_first,
        final,
        vocab,
        shared,
        shape,
        modules,
        work,
        rows,
        imports,
    )


def _zero_if_none(param: nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()


# ---------------------------------------------------------------------------------------
# The layout


class _Tracker:
    """Which module's forward is running on this rank (forward pre/post hooks), so an error
    can name it; and which phase of the run this is."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.stack: list[tuple[str, nn.Module, list[tuple[int, ...]]]] = []
        self.plan: Mapping[str, Any] = {}

    def watch(self, module: nn.Module) -> None:
        for name, sub in module.named_modules():
            if not name:
                continue
            sub.register_forward_pre_hook(self._enter(name))
            sub.register_forward_hook(self._leave)  # not on error: the stack keeps the culprit

    def _enter(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.stack.append((name, module, shapes))

        return hook

    def _leave(self, _module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        if self.stack:
            self.stack.pop()

    def where(self) -> dict[str, Any] | None:
        if not self.stack:
            return None
        name, module, shapes = self.stack[-1]
        entries = [str(p) for p in self.plan if fnmatchcase(name, str(p))]
        weight = getattr(module, "weight", None)
        expects = (
            int(weight.shape[-1])
            if isinstance(weight, torch.Tensor) and weight.dim() == 2
            else None
        )
        return {
            "module": name,
            "type": type(module).__name__,
            "inputs": shapes,
            "plan": entries,
            "expects": expects,
        }


@contextmanager
def _diagnosed(tracker: _Tracker, diag_dir: str, coords: tuple[int, int, int]) -> Iterator[None]:
    """On an error, write what this rank was doing for the parent, then re-raise."""
    try:
        yield
    except BaseException as err:
        rank = torch.distributed.get_rank()
        record = {
            "rank": rank,
            "coords": coords,
            "phase": tracker.phase,
            "error": f"{type(err).__name__}: {err}",
            "where": tracker.where(),
        }
        with open(os.path.join(diag_dir, f"rank{rank}.json"), "w", encoding="utf-8") as out:
            json.dump(record, out)
        raise


def _is_moe(model: nn.Module, layout: Layout) -> bool:
    """A mixture-of-experts model (a ``transformers`` ``ep_plan``), or a layout with EP."""
    return layout.expert_parallel > 1 or isinstance(getattr(model, "ep_plan", None), Mapping)


def _plan_of(
    plan: Mapping[str, Any] | str | None, model: nn.Module, layout: Layout
) -> Mapping[str, Any]:
    if isinstance(plan, str):
        made = resolve(plan)(model)
        if not isinstance(made, Mapping):
            raise InputTypeError(f"plan {plan!r} returned {type(made).__name__}, not a mapping")
        return made
    if plan is not None:
        return plan
    if layout.sequence_parallel:
        if _is_moe(model, layout):
            return mc_moe.sequence_parallel_plan(model)
        return sequence_parallel_plan(model)
    own = getattr(model, "tp_plan", None)
    if not isinstance(own, Mapping) or not own:
        raise InputValueError(
            f"{type(model).__name__} has no tp_plan: pass plan= (a mapping of module patterns "
            "to styles, or 'module:function' returning one; docs/parallelize.md)"
        )
    return own


def _loss(layout: Layout, pgc: mg.ProcessGroupCollection, vocab: int, sequence_first: bool) -> Any:
    whole = token_cross_entropy(sequence_first=sequence_first)
    split = token_cross_entropy(tp_group=pgc.tp, sequence_first=sequence_first)

    def losses(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        width = int(output.shape[-1])
        vocab_split = layout.tp > 1 and width * layout.tp == vocab
        if layout.loss == "vocab_parallel" or (layout.loss == "auto" and vocab_split):
            return split(output, target)
        return whole(output, target)

    return losses


def _whole_params(
    chunks: list[nn.Module], pgc: mg.ProcessGroupCollection
) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Every param of this rank's chunks by name, with its whole tensor (collective over
    TP and EP: :func:`mc_moe.full_state_dict`, which is :func:`mc_tp_layers.full_state_dict`
    plus one all-gather over ``ep`` per expert param)."""
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    for chunk in chunks:
        state = mc_moe.full_state_dict(chunk, pg_collection=pgc)
        for name, param in chunk.named_parameters(remove_duplicate=False):
            out[name] = (param, state[name].detach().clone())
    return out


def _group_names(pgc: mg.ProcessGroupCollection, layout: Layout) -> dict[tuple[int, ...], str]:
    """Each group's ranks → its names, joined where several hold the same ranks
    (``dp=ep`` when the experts are split over the whole DP group); ``world`` where no
    other group has its ranks; the expert groups only with expert parallelism."""
    experts = layout.expert_parallel > 1 or layout.expert_tensor_parallel is not None
    names: dict[tuple[int, ...], list[str]] = {}
    for name in (*_GROUP_NAMES, *(_EXPERT_GROUPS if experts else ()), "world"):
        group = getattr(pgc, name, None)
        if group is not None:
            ranks = tuple(mg.group_ranks(group))
            if name != "world" or ranks not in names:
                names.setdefault(ranks, []).append(name)
    return {ranks: "=".join(found) for ranks, found in names.items()}


@dataclass
class _Rank:
    """What one rank of the layout works with."""

    work: Workload
    layout: Layout
    pgc: mg.ProcessGroupCollection
    cfg: mg.ModelParallelConfig
    tracker: _Tracker
    coords: tuple[int, int, int]


def run_layout(
    work: Workload,
    layout: Layout,
    plan: Mapping[str, Any] | str | None,
    after_parallelize: str | None,
    finalize: str | None,
    reference: tuple[int, int],
    diag_dir: str,
) -> RankRun:
    """Train the layout on this rank (collective over the world of ``layout.world_size``);
    ``reference`` is the one-process run's ``(vocab, rows)``."""
    torch.set_num_threads(1)
    tracker = _Tracker()
    rank = torch.distributed.get_rank()
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    coords = (rank % tp, rank // tp % dp, rank // (tp * dp))
    with _diagnosed(tracker, diag_dir, coords):
        tracker.phase = "initialize_model_parallel"
        pgc = mg.initialize_model_parallel(
            tp,
            pp,
            expert_model_parallel_size=layout.expert_parallel,
            expert_tensor_parallel_size=layout.expert_tensor_parallel,
        )
        try:
            me = _Rank(
                work,
                layout,
                pgc,
                layout_config(tp, pp, layout.sequence_parallel, layout),
                tracker,
                coords,
            )
            chunks, forward_model = _chunks(me, plan, after_parallelize)
            pipe, opt = _pipeline(me, chunks, forward_model, finalize, reference[0])
            return _train(me, pipe, opt, *reference)
        finally:
            mg.destroy_model_parallel(pgc)


def _chunks(
    me: _Rank, plan: Mapping[str, Any] | str | None, after_parallelize: str | None
) -> tuple[list[nn.Module], nn.Module]:
    """This rank's chunks, converted, and the module the default forward is chosen by."""
    tp, pp, tracker = me.layout.tp, me.layout.pp, me.tracker
    tracker.phase = "building the model"
    builder = resolve(me.work.model)
    model = _build(me.work, me.cfg, me.pgc)
    if takes_layout(builder):
        chunks: list[nn.Module] = [model]
    else:
        moe = _is_moe(model, me.layout)
        convert = tp > 1 or me.layout.expert_parallel > 1
        if tp > 1:
            tracker.phase = "reading the plan"
            tracker.plan = _plan_of(plan, model, me.layout)
        ep_plan = getattr(model, "ep_plan", None) if me.layout.expert_parallel > 1 else None
        tracker.phase = "splitting pipeline stages"
        chunks = split_model(model, decoder_stages(model, pp), me.pgc) if pp > 1 else [model]
        if convert:
            tracker.phase = "parallelize"
            for chunk in chunks:
                entries = stage_plan(tracker.plan, chunk) if pp > 1 else tracker.plan
                if moe:
                    experts = stage_plan(ep_plan, chunk) if pp > 1 and ep_plan else ep_plan
                    mc_moe.parallelize(
                        chunk, entries, ep_plan=experts, config=me.cfg, pg_collection=me.pgc
                    )
                else:
                    parallelize(chunk, entries, config=me.cfg, pg_collection=me.pgc)
    if after_parallelize is not None:
        tracker.phase = f"after_parallelize ({after_parallelize})"
        hook = resolve(after_parallelize)
        for chunk in chunks:
            hook(chunk, StageInfo(me.coords[2], pp, 0))
    for chunk in chunks:
        tracker.watch(chunk)
    return chunks, model


def _pipeline(
    me: _Rank, chunks: list[nn.Module], model: nn.Module, finalize: str | None, vocab: int
) -> tuple[Pipeline, Any]:
    layout = me.layout
    loss = _loss(layout, me.pgc, vocab, me.work.sequence_first)
    forward = _forward(me.work, model, layout.tp if layout.sequence_parallel else 1)
    me.tracker.phase = "build_pipeline"
    fsdp2 = layout.data_parallel == "fsdp2"
    # expert params need every rank's reduce-scatter, also of an expert without tokens there
    experts = any(param_attrs.is_expert_param(p) for c in chunks for p in c.parameters())
    ddp_config = (
        TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=experts)
        if fsdp2
        else DistributedDataParallelConfig(
            use_distributed_optimizer=layout.distributed_optimizer,
            overlap_grad_reduce=layout.overlap,
            overlap_param_gather=layout.overlap and layout.distributed_optimizer,
        )
    )
    extra: dict[str, Any] = {}
    if finalize is not None:
        extra["finalize_model_grads_func"] = resolve(finalize)
    pipe = build_pipeline(
        chunks,
        config=me.cfg,
        ddp_config=ddp_config,
        pg_collection=me.pgc,
        microbatches=layout.micro,
        loss_fn=loss,
        forward=forward,
        **extra,
    )
    sgd = torch.optim.SGD(pipe.parameters(), lr=me.work.lr)
    if fsdp2:  # each rank steps the DTensor shards it holds
        return pipe, sgd
    return pipe, ShardedOptimizer(sgd, pipe.chunks, pg_collection=me.pgc)


def _train(me: _Rank, pipe: Pipeline, opt: Any, vocab: int, rows: int) -> RankRun:
    tracker, work = me.tracker, me.work
    modules = [chunk.module for chunk in pipe.chunks]
    tracker.phase = "gathering the weights before training"
    before = _whole_params(modules, me.pgc)
    after_first = before
    losses: list[float] = []
    log: list[tuple[str, str, str, int]] = []
    names = _group_names(me.pgc, me.layout)
    per_rank = rows // me.layout.dp
    for step in range(work.steps):
        ids = global_batch(work, step, rows, vocab)
        mine = ids[me.coords[1] * per_rank : (me.coords[1] + 1) * per_rank]
        tracker.phase = f"step {step + 1}: forward and backward"
        with mg.record_collectives() as records:
            losses.append(pipe.forward_backward(mine, causal_targets(mine)))
            tracker.phase = f"step {step + 1}: optimizer step"
            opt.step()
        if step == min(1, work.steps - 1):
            log = [
                (r.op, names.get(r.group_ranks, str(list(r.group_ranks))), r.label, r.bytes)
                for r in records
            ]
        if step == 0:
            tracker.phase = "gathering the weights after step 1"
            ensure_params_ready(pipe.parameters())
            after_first = _whole_params(modules, me.pgc)
    tracker.phase = "gathering the final weights"
    ensure_params_ready(pipe.parameters())
    final = _whole_params(modules, me.pgc)
    in_experts = {name for chunk in modules for name, _, _ in expert_params(chunk)}
    params = {
        name: ParamRecord(
            _split_of(param),
            _marks(param) + ((IN_EXPERTS,) if name in in_experts else ()),
            start,
            after_first[name][1],
            final[name][1],
        )
        for name, (param, start) in before.items()
    }
    return RankRun(torch.distributed.get_rank(), me.coords, [me.coords[2]], params, losses, log)


def _split_of(param: torch.Tensor) -> tuple[int, int] | None:
    if not param_attrs.is_tensor_model_parallel(param):
        return None
    return param_attrs.partition_dim_of(param) % param.dim(), param_attrs.partition_stride_of(param)
