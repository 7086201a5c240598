"""mc's tensor parallelism under PyTorch's FSDP2 (``fully_shard``), against one process.

A ``transformers`` Llama and a torchtitan-laid-out Llama-3 (``examples/titan_llama.py``:
fused ``wqkv`` and separate ``wq`` / ``wk`` / ``wv``), converted by
``parallelize(model, sequence_parallel_plan(model), ...)`` and trained at TP=2 × FSDP DP=2
(4 gloo ranks, one world for the whole grid) with sequence parallelism off and on, through
both entry points:

- ``wrapper``: ``mc_ddp.TorchFullyShardedDataParallel`` (Megatron's wrapper);
- ``direct``: torchtitan's way, ``fully_shard`` on each decoder layer and the root by the
  user, the FSDP2 module passed to ``finalize_model_grads([model], pg_collection=pgc)`` as
  it is (mc's marks come back from the record ``parallelize`` left on the modules);
- ``compiled`` (torchtitan's fused Llama, SP on): as ``direct`` with each block compiled in
  place first (``block.compile(fullgraph=True)``, backend ``aot_eager``: Dynamo and
  AOTAutograd without C++ code generation), 0 graph breaks (Dynamo's counter).

Each run: 3 SGD steps (lr 1) on the global batch split over DP, ``finalize_model_grads``
every step; the losses (averaged over DP) against one process's per step (≤ 1e-5
relative), the final weights gathered by ``full_state_dict`` (one-process names and
shapes; torchtitan's fused ``wqkv`` saved as ``wq`` / ``wk`` / ``wv`` by its own hook)
against one process's after SGD (≤ 1e-6), every reference weight moving ≥ 1e-4.

Also: clipping against ``torch.nn.utils.clip_grad_norm_`` of one process, bf16 compute
with fp32 reduction, TP × PP × FSDP2 on 8 ranks, a resume across layouts through whole
state dicts, and the refusals of both entry points.

Then the collectives of one step, counted by hand: FSDP2 issues its all-gathers and
reduce-scatters through ``torch.distributed`` directly (counted by wrapping
``dist.all_gather_single`` / ``dist.reduce_scatter_single`` around the step), mc's over TP
through ``mc_groups.record_collectives``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch

from integration_tests._common import counting_dist
from mc_groups.testing import RankPools

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS, LR = 3, 1.0
KINDS = ("hf", "titan_fused", "titan")
Case = tuple[str, bool, str]  # (model kind, sequence parallel, entry point)
CASES: list[Case] = [
    (kind, sp, entry) for kind in KINDS for sp in (False, True) for entry in ("wrapper", "direct")
] + [("titan_fused", True, "compiled")]  # torchtitan's blocks compiled in place, then direct


def _build(kind: str, seed: int = 0) -> torch.nn.Module:
    if kind == "hf":
        from examples.hf_llama import build_model

        return build_model("llama", seed)
    from examples.titan_llama import build_model as build_titan

    return build_titan(fused=kind == "titan_fused", seed=seed)


def _batch(kind: str, step: int) -> torch.Tensor:
    if kind == "hf":
        from examples.hf_llama import global_batch

        return global_batch(step)
    from examples.titan_llama import global_batch as titan_batch

    return titan_batch(step)


def _loss(kind: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = _loss(kind, model, _batch(kind, step))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _shard(model: Any, entry: str, cfg: Any, pgc: Any) -> Any:
    """The model under FSDP2 through ``entry`` (the chunk to train and finalize)."""
    if entry == "wrapper":
        from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

        config = TorchFullyShardedDataParallelConfig()
        return TorchFullyShardedDataParallel(cfg, config, model, pg_collection=pgc)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pgc.dp_cp, "cpu")
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for layer in layers.children() if not isinstance(layers, torch.nn.ModuleList) else layers:
        if entry == "compiled":  # torchtitan: block.compile() in place, before fully_shard
            layer.compile(backend="aot_eager", fullgraph=True)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


Result = tuple[list[float], dict[str, torch.Tensor], bool, int]


def _train(case: Case, pgc: Any) -> Result:
    """One case on every rank: parallelize, shard, 3 SGD steps, gather the weights; the
    marks' presence after ``fully_shard`` and Dynamo's graph-break count."""
    from torch._dynamo.utils import counters

    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    counters.clear()

    kind, sp, entry = case
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)
    model = _build(kind)
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    chunk = _shard(model, entry, cfg, pgc)
    opt = torch.optim.SGD(chunk.parameters(), lr=LR)
    dp = pgc.require("dp", "data")
    rows = _batch(kind, 0).shape[0] // dp.size()
    losses = []
    for step in range(STEPS):
        ids = _batch(kind, step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        opt.zero_grad()
        loss = _loss(kind, chunk, ids)
        loss.backward()  # type: ignore[no-untyped-call]
        finalize_model_grads([chunk], pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    weights = full_state_dict(model)
    marked = any(mg.param_attrs.is_tensor_model_parallel(p) for p in model.parameters())
    return losses, weights, marked, sum(counters["graph_break"].values())


def _fresh_groups() -> Any:
    """TP=2 × DP=2 groups (``destroy_model_parallel`` of the pool's earlier calls forgot
    DTensor's cached meshes of theirs)."""
    import mc_groups as mg

    torch.set_num_threads(1)
    return mg.initialize_model_parallel(tensor_model_parallel_size=2)


def _grid(cases: list[Case]) -> list[Result] | None:
    """``cases`` in one world, on one set of groups (built once: less set-up)."""
    import torch.distributed as dist

    import mc_groups as mg

    pgc = _fresh_groups()
    results = [_train(case, pgc) for case in cases]
    mg.destroy_model_parallel(pgc)
    return results if dist.get_rank() == 0 else None


@pytest.mark.timeout(300)
def test_fsdp2_with_mc_tp_matches_one_process(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    results: list[Result] = []
    for part in (CASES[:6], CASES[6:]):  # two calls: each within the pool's deadline
        done = pool.run(_grid, part)[0]
        assert done is not None
        results += done
    references = {kind: _reference(kind) for kind in KINDS}
    for case, (losses, weights, marked, breaks) in zip(CASES, results, strict=True):
        kind = case[0]
        assert breaks == 0, (case, breaks)
        ref_losses, ref_weights = references[kind]
        start = _build(kind).state_dict()
        moved = min(float((ref_weights[k] - start[k]).abs().max()) for k in ref_weights)
        assert moved >= 1e-4, (case, moved)
        assert marked, case  # the marks are on the FSDP2 params
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert rel <= 1e-5, (case, losses, ref_losses)
        assert sorted(weights) == sorted(ref_weights), case
        worst = max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())
        assert worst <= 1e-6, (case, worst)
        print(f"{case}: loss rel {rel:.1e}, weights {worst:.1e}")


def _one_step_collectives(entry: str) -> dict[str, Any] | None:
    """The second step of the ``transformers`` Llama at TP=2 × DP=2 with SP (the first
    holds the one-off agreement exchanges): FSDP2's collectives and mc's."""
    import torch.distributed as dist

    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import parallelize, sequence_parallel_plan

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model = _build("hf")
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    chunk = _shard(model, entry, cfg, pgc)
    dp = pgc.require("dp", "data")
    rows = _batch("hf", 0).shape[0] // dp.size()
    for step in range(2):
        ids = _batch("hf", step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        chunk.zero_grad()
        with counting_dist() as fsdp, mg.record_collectives() as log:
            loss = _loss("hf", chunk, ids)
            forward = Counter(fsdp)
            loss.backward()  # type: ignore[no-untyped-call]
            finalize_model_grads([chunk], pg_collection=pgc)
    result = {
        "fsdp_forward": forward,
        "fsdp_backward": Counter(fsdp) - forward,
        "mc": Counter((r.op, r.label, r.group_ranks, r.bytes) for r in log),
        "dp": mg.group_ranks(dp),
        "tp": mg.group_ranks(pgc.require("tp", "test")),
    }
    mg.destroy_model_parallel(pgc)
    return result if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_one_step_collectives_counted(rank_pools: RankPools) -> None:
    """FSDP2's over DP and mc's over TP in one step of the ``transformers`` Llama (hidden
    32, 2 layers, vocabulary 64, 4 heads of 8, 2 key/value heads, MLP 64) at TP=2 × DP=2
    with SP, through the wrapper (default: each layer, the embedding and the head wrapped,
    the final norm with the root; torch's automatic resharding keeps the root gathered).

    By hand, this rank's TP-local numel: embedding and head 64·32/2 = 1024 each; a layer
    q 512, k 256, v 256, o 512, gate / up / down 1024 each, two norms 32 each = 4672; the
    root's final norm 32. FSDP2 all-gathers each group's flat TP-local params (the output
    numel counted) in forward (5), again in backward for the 4 resharded ones, and
    reduce-scatters each group's grads into this rank's half (5). mc's over TP per step
    (``B = 2`` rows, ``S = 16``, ``h = 32``, fp32): the schedule of
    ``test_sp_plan_hf._expected`` (an all-reduce of the embedding output, 5 all-gathers of
    ``[B, S/2, h]`` and 4 reduce-scatters of ``[B, S, h]`` forward, 5 and 5 the other way
    in backward, the head's output gathered ``[B, S, V/2]``) plus finalize's one
    all-reduce over TP of the 5 norms' grads (160 fp32), each rank's data-parallel half of
    them as it is (its TP peer holds the same half: no gather over DP)."""
    result = rank_pools.get(4).run(_one_step_collectives, "wrapper")[0]
    assert result is not None
    dp, tp = result["dp"], result["tp"]
    assert result["fsdp_forward"] == Counter(
        {
            ("all_gather_single", dp, 4672, torch.float32): 2,
            ("all_gather_single", dp, 1024, torch.float32): 2,
            ("all_gather_single", dp, 32, torch.float32): 1,
        }
    ), result["fsdp_forward"]
    assert result["fsdp_backward"] == Counter(
        {
            ("all_gather_single", dp, 4672, torch.float32): 2,
            ("all_gather_single", dp, 1024, torch.float32): 2,
            ("reduce_scatter_single", dp, 2336, torch.float32): 2,
            ("reduce_scatter_single", dp, 512, torch.float32): 2,
            ("reduce_scatter_single", dp, 16, torch.float32): 1,
        }
    ), result["fsdp_backward"]
    act, part, logits = 2 * 16 * 32 * 4, 2 * 16 * 32 * 4 // 2, 2 * 16 * 64 // 2 * 4
    on_tp = Counter(
        {
            ("all_reduce", "tp all-reduce", tp, act): 1,
            ("all_gather", "tp gather dim 0", tp, part): 10,
            ("reduce_scatter", "tp reduce-scatter dim 0", tp, act): 9,
            ("all_gather", "tp gather last dim", tp, logits): 1,
            ("all_reduce", "non-tensor-parallel grads", tp, 160 // 2 * 4): 1,
        }
    )
    assert result["mc"] == on_tp, result["mc"]  # nothing of mc's over dp


def _clip_reference(norm_type: float, max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: the first step's grads, ``torch.nn.utils.clip_grad_norm_``, one SGD step."""
    model = _build("hf")
    _loss("hf", model, _batch("hf", 0)).backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clip_cases(norm_types: list[float], max_norm: float) -> list[Any] | None:
    """Per norm type, the ``transformers`` Llama at TP=2 × FSDP DP=2 with SP (wrapper):
    one step, ``finalize_model_grads``, ``mc_ddp.clip_grad_norm``, SGD; then an fp16-style
    overflow on one rank under a ``DynamicGradScaler``."""
    import torch.distributed as dist

    import mc_groups as mg
    from mc_ddp import DynamicGradScaler, clip_grad_norm
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    dp = pgc.require("dp", "data")
    rows = _batch("hf", 0).shape[0] // dp.size()
    ids = _batch("hf", 0)[dp.rank() * rows : (dp.rank() + 1) * rows]
    out: list[Any] = []
    for norm_type in [*norm_types, None]:
        model = _build("hf")
        parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
        chunk = _shard(model, "wrapper", cfg, pgc)
        _loss("hf", chunk, ids).backward()  # type: ignore[no-untyped-call]
        finalize_model_grads([chunk], pg_collection=pgc)
        if norm_type is None:  # an overflow on the last rank only, under loss scaling
            if dist.get_rank() == dist.get_world_size() - 1:
                next(iter(chunk.parameters())).grad.to_local().view(-1)[0] = float("inf")
            scaler = DynamicGradScaler(initial_scale=8.0)
            result = clip_grad_norm([chunk], max_norm, grad_scaler=scaler, pg_collection=pgc)
            out.append((result.skipped, result.found_inf, scaler.scale))
            continue
        result = clip_grad_norm(chunk, max_norm, norm_type, pg_collection=pgc)
        torch.optim.SGD(chunk.parameters(), lr=LR).step()
        out.append((result.grad_norm, result.skipped, full_state_dict(model)))
    mg.destroy_model_parallel(pgc)
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_clip_grad_norm_equals_one_process(rank_pools: RankPools) -> None:
    """``mc_ddp.clip_grad_norm`` over FSDP2 DTensor grads and mc's TP shards (SP on: the
    norms' grads are replicated over TP after finalize, counted once; the embedding and
    head's shards on every TP rank; every DP shard once): the L2 and inf norms equal
    ``torch.nn.utils.clip_grad_norm_`` of one process on the global batch (1e-5 relative),
    and the clipped step's weights equal one process's (1e-6). An inf in one rank's grad
    under a ``DynamicGradScaler`` skips the step on every rank and halves the scale."""
    max_norm = 0.02  # below both norms: the clip acts
    norm_types = [2.0, float("inf")]
    results = rank_pools.get(4).run(_clip_cases, norm_types, max_norm)[0]
    assert results is not None
    for norm_type, (norm, skipped, weights) in zip(norm_types, results, strict=False):
        ref_norm, ref_weights = _clip_reference(norm_type, max_norm)
        assert ref_norm > 2 * max_norm, ref_norm
        print(f"norm_type {norm_type}: {norm} vs one process {ref_norm}")
        assert not skipped
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm_type, norm, ref_norm)
        worst = max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())
        assert worst <= 1e-6, (norm_type, worst)
    assert results[-1] == (True, True, 4.0)


class _Block(torch.nn.Module):
    """``Column(8 → 16) → Row(16 → 8)`` of mc's layers, built directly (no ``parallelize``)."""

    def __init__(self, cfg: Any, pgc: Any) -> None:
        super().__init__()
        from mc_tp_layers import ColumnParallelLinear, RowParallelLinear

        init = torch.nn.init.ones_
        self.fc1 = ColumnParallelLinear(8, 16, config=cfg, init_method=init, pg_collection=pgc)
        self.fc2 = RowParallelLinear(
            16,
            8,
            config=cfg,
            init_method=init,
            bias=True,
            skip_bias_add=False,
            input_is_parallel=True,
            pg_collection=pgc,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(hidden)
        return out  # type: ignore[no-any-return]


class _OwnSplit(torch.nn.Module):
    """A user's own tensor-parallel layer (a ``tp_group`` and a param marked split by hand),
    not one of mc's: nothing records its marks."""

    def __init__(self, pgc: Any) -> None:
        super().__init__()
        from mc_groups.param_attrs import set_tensor_model_parallel_attributes

        self.tp_group = pgc.tp
        self.weight = torch.nn.Parameter(torch.ones(4, 8))  # rows: this rank's outputs
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def _finalize_refusals(cfg: Any, pgc: Any, attempt: Callable[[Callable[[], object]], None]) -> None:
    """torchtitan's way (``fully_shard`` by hand) on a model whose own TP layer never
    recorded its marks, and, at EP=2 (expert data-parallel 2 of the 4 data-parallel ranks),
    on one whose expert param FSDP2 sharded over all 4: finalize refuses both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_groups.param_attrs import mark_allreduce, record_marks

    own = _OwnSplit(pgc)
    own.config = cfg
    fully_shard(own, mesh=DeviceMesh.from_group(pgc.dp_cp, "cpu"))
    own(torch.ones(2, 8)).sum().backward()
    attempt(partial(finalize_model_grads, [own], pg_collection=pgc))
    ep = mg.initialize_model_parallel(expert_model_parallel_size=2)
    expert: Any = torch.nn.Linear(8, 8)
    mark_allreduce(expert.weight, False)
    record_marks(expert)  # as mc_moe.parallelize would
    expert.config = mg.ModelParallelConfig(expert_model_parallel_size=2)
    fully_shard(expert, mesh=DeviceMesh.from_group(ep.require("dp_cp", "test"), "cpu"))
    expert(torch.ones(2, 8)).sum().backward()
    attempt(partial(finalize_model_grads, [expert], pg_collection=ep))
    mg.destroy_model_parallel(ep)


def _one_rank_experts_in_fp16(cfg: Any, attempt: Callable[[Callable[[], object]], None]) -> None:
    """The wrapper over an expert param on a one-rank ``expt_dp`` (TP 2, expert TP 2 × EP 2
    on 4 ranks) with ``config.fp16`` (grads reduced in float16)."""
    import mc_groups as mg
    from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from mc_groups.param_attrs import mark_allreduce

    alone = mg.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2
    )
    fp16 = cfg.replace(fp16=True, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    expert = _Block(fp16, alone)
    assert expert.fc1.weight is not None
    mark_allreduce(expert.fc1.weight, False)
    unused = TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=True)
    attempt(lambda: TorchFullyShardedDataParallel(fp16, unused, expert, pg_collection=alone))
    # A torch whose FSDP2 names its SUM-only field otherwise (simulated: the field is
    # gone and the public setter sets nothing): float32, refused rather than ÷ |dp|² twice
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    init = FSDPParamGroup.__init__

    def without_field(group: Any, *args: Any, **kwargs: Any) -> None:
        init(group, *args, **kwargs)
        del group.force_sum_reduction_for_comms

    fp32 = fp16.replace(fp16=False)
    expert = _Block(fp32, alone)
    assert expert.fc1.weight is not None
    mark_allreduce(expert.fc1.weight, False)
    with (
        mock.patch.object(FSDPParamGroup, "__init__", without_field),
        mock.patch.object(FSDPModule, "set_force_sum_reduction_for_comms", return_value=None),
    ):
        attempt(lambda: TorchFullyShardedDataParallel(fp32, unused, expert, pg_collection=alone))
    mg.destroy_model_parallel(alone)


def _refusals() -> list[tuple[str, str]]:
    """What each entry point refuses before any collective, as (error type, message)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import mc_groups as mg
    from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from mc_groups.testing import error_kind

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    out: list[tuple[str, str]] = []

    def attempt(action: Callable[[], object]) -> None:
        try:
            action()
            out.append(("", "no error"))
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
            out.append((error_kind(err), str(err)))

    fsdp_config = TorchFullyShardedDataParallelConfig
    world = pgc.require("world", "test")
    attempt(
        lambda: TorchFullyShardedDataParallel(
            cfg, fsdp_config(), _Block(cfg, pgc), None, False, world, pg_collection=pgc
        )
    )
    fused = cfg.replace(gradient_accumulation_fusion=True)
    attempt(
        lambda: TorchFullyShardedDataParallel(
            fused, fsdp_config(), _Block(cfg, pgc), pg_collection=pgc
        )
    )
    attempt(
        lambda: TorchFullyShardedDataParallel(
            cfg, fsdp_config(delay_wgrad_compute=True), _Block(cfg, pgc), pg_collection=pgc
        )
    )
    hsdp = fsdp_config(num_distributed_optimizer_instances=2)  # groups built with 1 instance
    attempt(lambda: TorchFullyShardedDataParallel(cfg, hsdp, _Block(cfg, pgc), pg_collection=pgc))
    attempt(lambda: fsdp_config(clone_output_views=True))
    from torch.distributed.tensor import Shard

    from mc_tp_layers import model_sharded_state_dict

    sharded = _Block(cfg, pgc)  # FSDP2 splitting dim 1: no one-process view for DCP
    mesh = DeviceMesh.from_group(pgc.dp_cp, "cpu")
    fully_shard(sharded, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    attempt(lambda: model_sharded_state_dict(sharded))
    from mc_tp_layers import ColumnParallelLinear

    # 3 packed parts per TP shard (12 rows, 4 a part): FSDP2's 2 data-parallel halves of 6
    # rows cut a part, so no DCP view is one chunk of the one-process tensor
    packed = ColumnParallelLinear(
        8, 24, config=cfg, init_method=torch.nn.init.ones_, stride=3, pg_collection=pgc
    )
    fully_shard(packed, mesh=mesh)
    attempt(lambda: model_sharded_state_dict(packed))
    from mc_groups.param_attrs import mark_allreduce

    def with_expert() -> _Block:  # an expert param: its replicas are expt_dp, not FSDP2's
        block = _Block(cfg, pgc)
        assert block.fc1.weight is not None
        mark_allreduce(block.fc1.weight, False)
        return block

    attempt(
        lambda: TorchFullyShardedDataParallel(cfg, fsdp_config(), with_expert(), pg_collection=pgc)
    )
    _finalize_refusals(cfg, pgc, attempt)
    _one_rank_experts_in_fp16(cfg, attempt)
    mg.destroy_model_parallel(pgc)
    return out


REFUSALS = [
    ("ValueError", ["process_group", "tensor-parallel peers", "dp_cp"]),
    ("ValueError", ["gradient_accumulation_fusion=True", "main_grad"]),
    ("ValueError", ["delay_wgrad_compute=True", "no counterpart under FSDP2"]),
    ("MissingGroupError", ["HSDP", "num_distributed_optimizer_instances", "intra_dp_cp"]),
    ("NotImplementedError", ["clone_output_views=True"]),
    ("NotImplementedError", ["fc1.weight is a DTensor placed", "Shard(0)", "full_state_dict"]),
    ("NotImplementedError", ["weight packs partition_stride=3", "2 does not divide 3"]),
    ("ValueError", ["'fc1.weight'", "allreduce=False", "reduce_scatter_unused_params=True"]),
    ("RuntimeError", ["under fully_shard", "its root", "_OwnSplit", "record_marks"]),
    ("ValueError", ["weight", "allreduce=False", "fully_shard", "expt_dp", "[0, 1, 2, 3]"]),
    ("ValueError", ["expt_dp is one rank", "float16", "twice", "grad_reduce_in_fp32=True"]),
    ("RuntimeError", ["has no force_sum_reduction_for_comms", "twice", "2 or more ranks"]),
]


@pytest.mark.timeout(120)
def test_refusals_name_the_argument_and_the_fix(rank_pools: RankPools) -> None:
    """The wrapper refuses a group holding TP peers, the fused wgrad path, DDP settings
    FSDP2 has no counterpart for, HSDP over a collection built without its groups, and
    Megatron's unimplemented ``clone_output_views``;
    ``model_sharded_state_dict`` refuses FSDP2 params split along another dim than 0
    (``shard_placement_fn``) and a packed colwise weight whose parts FSDP2's rows cut
    (``partition_stride`` 3 over 2 data-parallel ranks): no one-process view for DCP;
    finalize refuses, before any collective, an FSDP2 module whose own tensor-parallel
    layer (not one of mc's: those record theirs at construction) has no record of its
    marks. The wrapper takes an expert-parallel param (``allreduce=False``) only with
    ``reduce_scatter_unused_params=True`` (Megatron main's rule); finalize refuses one that
    ``fully_shard`` by hand sharded over the dense data-parallel group instead of
    ``expt_dp`` (FSDP2 averaged different experts). The wrapper refuses expert params on a
    one-rank ``expt_dp`` (expert TP 2 × EP 2 on 4 ranks) reduced in float16 (torch's
    one-rank FSDP2 path would divide their grads twice) and names ``grad_reduce_in_fp32``,
    and in float32 too on a torch whose FSDP2 lacks the private field mc turns off there."""
    for outcomes in rank_pools.get(4).run(_refusals):
        for (kind, message), (want, words) in zip(outcomes, REFUSALS, strict=True):
            assert kind == want, message
            for word in words:
                assert word in message, (word, message)


CLIP = 1.0  # below the first two steps' grad norms (1.88, 1.43): those steps are clipped


def _gpt_under_fully_shard(steps: int) -> dict[str, Any] | None:
    """The demo GPT (``examples/gpt``: mc's Column / Row / VocabParallel layers and its own
    layer norms, built directly, no ``parallelize``) at TP=2 × FSDP2 DP=2 with SP,
    ``fully_shard`` on each decoder layer and the root by hand (no ``record_marks`` call),
    the FSDP2 module passed as it is to every mc reader: ``finalize_model_grads``,
    ``mc_ddp.clip_grad_norm``, ``full_state_dict``, ``model_sharded_state_dict``; SGD with
    momentum."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import mc_groups as mg
    from examples.gpt import ParallelLayout
    from examples.gpt.data import dp_rows
    from examples.gpt.model import GPT
    from examples.gpt.weights import load_full_weights
    from integration_tests._common import CFG, SGD, batch, full_weights
    from mc_ddp import clip_grad_norm
    from mc_finalize import finalize_model_grads
    from mc_groups.param_attrs import is_sequence_parallel_param, is_tensor_model_parallel
    from mc_tp_layers import full_state_dict, model_sharded_state_dict

    def marks(model: torch.nn.Module) -> tuple[int, int]:
        params = list(model.parameters())
        return sum(map(is_tensor_model_parallel, params)), sum(
            map(is_sequence_parallel_param, params)
        )

    pgc = _fresh_groups()
    tp, dp = pgc.require("tp", "test"), pgc.require("dp", "test")
    mp = ParallelLayout(tp=2, dp=2, sequence_parallel=True).model_parallel_config()
    model = GPT(CFG, mp, pgc)
    load_full_weights(model, full_weights(), tp)
    # as Megatron's GPTModel carries its config (finalize reads it)
    model.config = mp  # type: ignore[assignment]
    marked = marks(model)
    mesh = DeviceMesh.from_group(pgc.dp_cp, "cpu")
    for layer in model.decoder.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lost = marks(model)
    opt = dataclasses.replace(SGD, clip_grad=CLIP).build(list(model.parameters()))
    losses, norms = [], []
    for step in range(steps):
        tokens = dp_rows(batch(step), dp.rank(), dp.size())
        opt.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        finalize_model_grads([model], pg_collection=pgc)
        norms.append(clip_grad_norm(model, CLIP, pg_collection=pgc).grad_norm)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    # mc's layers add Megatron's ``_extra_state`` entries (None) to their state dict
    weights = {k: v for k, v in full_state_dict(model).items() if not k.endswith("_extra_state")}
    views = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model_sharded_state_dict(model).items()
    }
    out = {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "views": views,
        "marked": marked,
        "lost": lost,
        "restored": marks(model),
    }
    mg.destroy_model_parallel(pgc)
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_mc_layers_under_direct_fully_shard_match_one_process(rank_pools: RankPools) -> None:
    """A model of mc's layers built directly (the demo GPT) and ``fully_shard``ed by hand
    keeps its marks for every mc reader with no call of the user's: mc's layers record
    theirs at construction (the demo's own layer norms and position table record the
    ``sequence_parallel`` marks they set). ``fully_shard`` drops every mark from the params
    (counted before and after); finalize puts them back and sums the norms' and position
    table's grads over TP, ``clip_grad_norm`` counts each element once, ``full_state_dict``
    gathers whole tensors and ``model_sharded_state_dict`` views them at full shape: 3
    steps' losses within 1e-5 relative of the plain-PyTorch one-process GPT
    (``examples/gpt/reference.py``, ``torch.nn.utils.clip_grad_norm_``), its grad norms
    within 1e-5, the final weights (both readers) within 1e-6."""
    import dataclasses

    from examples.gpt.reference import train_reference
    from integration_tests._common import CFG, SGD, batch, full_weights

    steps = 3
    result = rank_pools.get(4).run(_gpt_under_fully_shard, steps)[0]
    assert result is not None
    # split: per layer qkv, proj, fc1 (weight, bias), fc2 (weight); the word embeddings.
    # SP: per layer 2 norms' weight and bias and 2 Row biases; the final norm; the positions
    per_layer = (2 + 2 + 1, 2 * 2 + 2)
    want = (CFG.num_layers * per_layer[0] + 1, CFG.num_layers * per_layer[1] + 2 + 1)
    assert result["marked"] == want, result["marked"]
    assert result["lost"] == (0, 0)  # fully_shard replaced every param: no mark on any
    assert result["restored"] == want  # the readers put them back
    clipped = dataclasses.replace(SGD, clip_grad=CLIP)
    ref = train_reference(full_weights(), CFG, clipped, batch, steps)
    rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref.losses, strict=True))
    assert rel <= 1e-5, (result["losses"], ref.losses)
    assert min(ref.grad_norms[:2]) > CLIP  # clipping changed those steps
    pairs = zip(result["norms"], ref.grad_norms, strict=True)
    assert max(abs(a - b) / b for a, b in pairs) <= 1e-5, (result["norms"], ref.grad_norms)
    moved = min(float((v - full_weights()[k]).abs().max()) for k, v in ref.weights.items())
    assert moved >= 1e-4
    for reader in ("weights", "views"):
        got = result[reader]
        assert sorted(got) == sorted(ref.weights), (reader, sorted(got))
        worst = max(float((got[k] - v).abs().max()) for k, v in ref.weights.items())
        print(f"GPT under fully_shard: loss rel {rel:.1e}, {reader} {worst:.1e}")
        assert worst <= 1e-6, (reader, worst)


def _fused_checkpoints() -> list[dict[str, Any]] | None:
    """torchtitan's fused ``wqkv`` (``examples/titan_llama.py``: its parent's state-dict
    hooks split it into ``wq`` / ``wk`` / ``wv`` on save and merge them on load) at TP=2 ×
    FSDP2 DP=2 with SP, per entry point: a one-process checkpoint of other weights (seed 1,
    the unfused names) loaded by ``load_full_state_dict``, then ``full_state_dict`` and one
    forward's loss (averaged over DP); and the names of ``model_sharded_state_dict``."""
    import torch.distributed as dist

    import mc_groups as mg
    from mc_tp_layers import (
        full_state_dict,
        load_full_state_dict,
        model_sharded_state_dict,
        parallelize,
        sequence_parallel_plan,
    )

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    dp = pgc.require("dp", "data")
    rows = _batch("titan_fused", 0).shape[0] // dp.size()
    ids = _batch("titan_fused", 0)[dp.rank() * rows : (dp.rank() + 1) * rows]
    checkpoint = _build("titan_fused", seed=1).state_dict()
    out = []
    for entry in ("wrapper", "direct"):
        model = _build("titan_fused")
        parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
        chunk = _shard(model, entry, cfg, pgc)
        load_full_state_dict(model, checkpoint)
        with torch.no_grad():
            loss = _loss("titan_fused", chunk, ids)
        mg.all_reduce(loss, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        views = model_sharded_state_dict(model)
        out.append({"state": full_state_dict(model), "loss": float(loss), "views": sorted(views)})
    mg.destroy_model_parallel(pgc)
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_fused_wqkv_checkpoints_compose_with_the_models_hooks(rank_pools: RankPools) -> None:
    """Issue 39 item 3: a model's own state-dict hooks that split a packed weight compose
    with mc's gather and cut under FSDP2 × TP (both entry points, SP on). A one-process
    checkpoint of torchtitan's fused Llama (``wq`` / ``wk`` / ``wv`` names, other weights
    than the model was built with) loads through ``load_full_state_dict`` (the model's
    hook merges ``wqkv`` whole, mc cuts this rank's TP rows, then its FSDP2 rows):
    ``full_state_dict`` gives the checkpoint back exactly, and one forward's loss equals
    the one-process model's on those weights (1e-5 relative). Both readers run after that
    evaluation forward, when FSDP2's root still holds its unsharded params (its own
    state-dict hooks swap in the sharded ones: mc's readers take those first, not the
    unsharded ones FSDP2 is about to free). ``model_sharded_state_dict``
    (DCP) views the params as they are, the model's hooks not run: ``wqkv.weight`` under
    its own name (a DCP checkpoint loads into the same structure)."""
    result = rank_pools.get(4).run(_fused_checkpoints)[0]
    assert result is not None
    source = _build("titan_fused", seed=1)
    checkpoint = source.state_dict()
    assert not any("wqkv" in k for k in checkpoint)  # the model's hook split it
    assert any((checkpoint[k] != v).any() for k, v in _build("titan_fused").state_dict().items())
    with torch.no_grad():
        want = float(_loss("titan_fused", source, _batch("titan_fused", 0)))
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    for entry, got in zip(("wrapper", "direct"), result, strict=True):
        assert sorted(got["state"]) == sorted(checkpoint), entry
        for key, value in checkpoint.items():
            assert torch.equal(got["state"][key], value), (entry, key)
        assert abs(got["loss"] - want) <= 1e-5 * abs(want), (entry, got["loss"], want)
        assert fused in got["views"], (entry, got["views"])
        assert not any(".wq.weight" in k for k in got["views"]), entry


def _packed_views(strides: list[int]) -> list[dict[str, Any]] | None:
    """Per stride ``k``: a packed colwise layer (``ColumnParallelLinear(8, 8k, stride=k)``:
    each TP shard holds its rows of each of the ``k`` parts, as ``packed_colwise`` lays
    out a fused ``[gate; up]``) and a rowwise one, ``fully_shard`` over DP=2 (which divides
    ``k``); the DCP views of ``model_sharded_state_dict`` made whole (``full_tensor``: over
    TP, then DP) and ``full_state_dict``'s tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import mc_groups as mg
    from mc_tp_layers import full_state_dict, model_sharded_state_dict
    from mc_tp_layers.layers import ColumnParallelLinear, RowParallelLinear

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    mesh = DeviceMesh.from_group(pgc.dp_cp, "cpu")
    out = []
    for stride in strides:
        torch.manual_seed(stride)  # the same whole weights on every rank, distinct values
        init = torch.nn.init.normal_
        model = torch.nn.Sequential(
            ColumnParallelLinear(
                8, 8 * stride, config=cfg, init_method=init, stride=stride, pg_collection=pgc
            ),
            RowParallelLinear(
                8 * stride,
                8,
                config=cfg,
                init_method=init,
                bias=True,
                skip_bias_add=False,
                input_is_parallel=True,
                pg_collection=pgc,
            ),
        )
        fully_shard(model, mesh=mesh)
        dcp: dict[str, Any] = model_sharded_state_dict(model)  # DTensors: whole by DTensor
        views = {k: v.full_tensor() for k, v in dcp.items()}
        whole = {k: v for k, v in full_state_dict(model).items() if not k.endswith("_state")}
        out.append({"views": views, "whole": whole})
    mg.destroy_model_parallel(pgc)
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_packed_colwise_dcp_views_under_fsdp2(rank_pools: RankPools) -> None:
    """A packed colwise weight (``partition_stride`` 2 and 4) under TP=2 × FSDP2 DP=2:
    ``model_sharded_state_dict`` views it through its ``[k, rows/k, ..]`` layout (FSDP2's
    rows of whole parts), and that view made whole equals the one-process tensor
    ``full_state_dict`` gathers, exactly, as do the other params' views. (DP not dividing
    ``k`` is refused: ``test_refusals_name_the_argument_and_the_fix``.)"""
    result = rank_pools.get(4).run(_packed_views, [2, 4])[0]
    assert result is not None
    for stride, got in zip([2, 4], result, strict=True):
        assert sorted(got["views"]) == sorted(got["whole"]), stride
        packed = got["views"]["0.weight"]
        assert tuple(packed.shape) == (stride, 8, 8), (stride, tuple(packed.shape))
        for key, value in got["whole"].items():
            view = got["views"][key].reshape(value.shape)
            assert torch.equal(view, value), (stride, key)


def _per_token_loss() -> Result | None:
    """torchtitan's fused Llama at TP=2 × FSDP2 DP=2 with SP through the wrapper, Megatron's
    per-token loss (``calculate_per_token_loss``): each rank's loss is the SUM over its
    tokens, ``finalize_model_grads(num_tokens=...)`` divides every grad by the global count
    (so FSDP2 must SUM over dp, not average); 3 SGD steps, then ``full_state_dict``."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, calculate_per_token_loss=True
    )
    model = _build("titan_fused")
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    chunk = _shard(model, "wrapper", cfg, pgc)
    opt = torch.optim.SGD(chunk.parameters(), lr=LR)
    dp = pgc.require("dp", "data")
    rows = _batch("titan_fused", 0).shape[0] // dp.size()
    losses = []
    for step in range(STEPS):
        ids = _batch("titan_fused", step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        chunk.zero_grad_buffer()
        logits = chunk(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        loss.backward()  # type: ignore[no-untyped-call]
        tokens = torch.tensor(ids[:, 1:].numel(), dtype=torch.int64)
        total = torch.stack([loss.detach(), tokens.to(torch.float32)])
        finalize_model_grads([chunk], num_tokens=tokens, pg_collection=pgc)  # sums tokens
        opt.step()
        mg.all_reduce(total, dp, label="loss and tokens for logging")
        losses.append(float(total[0] / total[1]))
    weights = full_state_dict(model)
    mg.destroy_model_parallel(pgc)
    return (losses, weights, True, 0) if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_per_token_loss_under_the_wrapper_matches_one_process(rank_pools: RankPools) -> None:
    """Megatron's per-token loss under ``TorchFullyShardedDataParallel``: the wrapper
    makes FSDP2 reduce-scatter the grads as a SUM over dp (Megatron's rule;
    ``set_gradient_divide_factor(1)``), and finalize divides by the global token count: 3
    steps' mean losses within 1e-5 relative of one process (mean loss), the weights within
    1e-6 (FSDP2's default average would leave every grad 1/dp too small)."""
    result = rank_pools.get(4).run(_per_token_loss)[0]
    assert result is not None
    losses, weights, _, _ = result
    ref_losses, ref_weights = _reference("titan_fused")
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    assert rel <= 1e-5, (losses, ref_losses)
    worst = max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())
    print(f"per-token loss under the wrapper: loss rel {rel:.1e}, weights {worst:.1e}")
    assert worst <= 1e-6, worst


def _six_rows() -> torch.Tensor:
    """A global batch of 6 rows: 3 per data-parallel rank, one per micro-batch."""
    return torch.cat([_batch("hf", 0), _batch("hf", 1)[:2]])


def _one_sgd_step(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process: the ``transformers`` Llama's weights after one SGD step on ``ids``."""
    model = _build("hf")
    _loss("hf", model, ids).backward()  # type: ignore[no-untyped-call]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _micro_batches() -> dict[str, Any] | None:
    """The wrapper's ``no_sync`` and recompute prefetch at TP=2 × FSDP DP=2 with SP (the
    ``transformers`` Llama), each on a fresh model: :func:`_nested_no_sync`, then
    :func:`_recompute_prefetch`."""
    import torch.distributed as dist

    import mc_groups as mg

    pgc = _fresh_groups()
    result = {**_nested_no_sync(pgc), **_recompute_prefetch(pgc)}
    mg.destroy_model_parallel(pgc)
    return result if dist.get_rank() == 0 else None


def _nested_no_sync(pgc: Any) -> dict[str, Any]:
    """A ``no_sync`` whose body raises, then 3 micro-batches of one row: the first under two
    nested ``no_sync``, the second under the outer one only, the third outside; FSDP2's
    reduce-scatters counted per micro-batch, then finalize, one SGD step, the weights."""
    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    dp = pgc.require("dp", "data")
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model = _build("hf")
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    chunk = _shard(model, "wrapper", cfg, pgc)
    try:
        with chunk.no_sync():
            raise RuntimeError("a failed micro-batch")
    except RuntimeError:
        pass
    rows = _six_rows()[dp.rank() * 3 : (dp.rank() + 1) * 3]
    counts = []

    def micro_batch(row: int) -> None:
        with counting_dist() as fsdp:
            loss = _loss("hf", chunk, rows[row : row + 1]) / 3
            loss.backward()  # type: ignore[no-untyped-call]
        counts.append(sum(1 for op, *_ in fsdp if op == "reduce_scatter_single"))

    with chunk.no_sync():
        with chunk.no_sync():
            micro_batch(0)
        micro_batch(1)
    micro_batch(2)
    finalize_model_grads([chunk], pg_collection=pgc)
    torch.optim.SGD(chunk.parameters(), lr=LR).step()
    return {"counts": counts, "nested": full_state_dict(model)}


def _recompute_prefetch(pgc: Any) -> dict[str, Any]:
    """``recompute_granularity="full"`` with the model's own activation checkpointing
    (``activation_checkpointing_enable``, non-reentrant): the wrapper's
    ``set_modules_to_backward_prefetch`` calls, how often the first layer's attention ran
    in one step, the weights after finalize and one SGD step on 2 rows."""
    from torch.distributed.fsdp import FSDPModule

    import mc_groups as mg
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    dp = pgc.require("dp", "data")
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, recompute_granularity="full"
    )
    model: Any = _build("hf")
    model.activation_checkpointing_enable({"use_reentrant": False})
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[tuple[str, list[str]]] = []
    original = FSDPModule.set_modules_to_backward_prefetch

    def spy(self: Any, modules: list[Any]) -> None:
        calls.append((names[id(self)], [names[id(m)] for m in modules]))
        original(self, modules)

    FSDPModule.set_modules_to_backward_prefetch = spy  # type: ignore[method-assign]
    try:
        chunk = _shard(model, "wrapper", cfg, pgc)
    finally:
        FSDPModule.set_modules_to_backward_prefetch = original  # type: ignore[method-assign]
    runs = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: runs.append(1))
    ids = _batch("hf", 0)[dp.rank() * 2 : (dp.rank() + 1) * 2]
    _loss("hf", chunk, ids).backward()  # type: ignore[no-untyped-call]
    finalize_model_grads([chunk], pg_collection=pgc)
    torch.optim.SGD(chunk.parameters(), lr=LR).step()
    return {"prefetch": calls, "attention_runs": len(runs), "recompute": full_state_dict(model)}


@pytest.mark.timeout(180)
def test_no_sync_nesting_and_recompute_prefetch_match_one_process(rank_pools: RankPools) -> None:
    """Megatron main's ``no_sync`` of the wrapper: only the outermost of nested contexts
    turns FSDP2's gradient sync off and back on (a context whose body raised restores it):
    0 reduce-scatters in the micro-batch under both contexts and in the one under the
    outer only, FSDP2's 5 (2 layers, the embedding, the head, the root's norm) in the last
    one, outside; the weights after finalize and SGD within 1e-6 of one process's step on
    the 6 rows (each rank's 3 micro-batch losses ÷ 3, FSDP2's average over dp: the mean
    over the 6 equal rows). Under ``recompute_granularity="full"`` each wrapped module
    prefetches, in backward, the one before it in forward order (Megatron's explicit
    order), the model's own checkpointing reruns the attention in backward (2 runs in the
    step), and the weights after one step match one process's within 1e-6."""
    result = rank_pools.get(4).run(_micro_batches)[0]
    assert result is not None
    assert result["counts"] == [0, 0, 5], result["counts"]
    for key, ref in (
        ("nested", _one_sgd_step(_six_rows())),
        ("recompute", _one_sgd_step(_batch("hf", 0))),
    ):
        got = result[key]
        assert sorted(got) == sorted(ref), key
        worst = max(float((got[k] - v).abs().max()) for k, v in ref.items())
        moved = min(float((v - _build("hf").state_dict()[k]).abs().max()) for k, v in ref.items())
        print(f"{key}: weights {worst:.1e} from one process (every weight moved >= {moved:.1e})")
        assert worst <= 1e-6, (key, worst)
    layers = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    expected = [(name, layers[i - 1 : i]) for i, name in enumerate(layers)]
    assert result["prefetch"] == expected, result["prefetch"]
    assert result["attention_runs"] == 2, result["attention_runs"]


_FSDP2_OPS = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _hsdp(folder: str) -> dict[str, Any] | None:
    """The ``transformers`` Llama at TP=2 × HSDP over DP=4 (2 replicas × 2 shards,
    ``num_distributed_optimizer_instances=2``) with SP, through the wrapper, 8 ranks:
    (1) 3 SGD steps, 1 row per data-parallel rank, FSDP2's collectives of the last step
    counted; (2) ``gradient_accumulation_mode="partial_reduce_scatter"``: one step of 2
    micro-batches of one row, the first under ``no_sync``, collectives counted per
    micro-batch. The whole weights after each; after (1), the DCP views of
    ``model_sharded_state_dict`` made whole (``full_tensor``), and the weights of a model
    built from other weights (seed 1), at TP=2 without FSDP2, after ``dcp.load`` of the
    views ``dcp.save`` wrote to ``folder``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import mc_groups as mg
    from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import (
        full_state_dict,
        model_sharded_state_dict,
        parallelize,
        sequence_parallel_plan,
    )

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(
        tensor_model_parallel_size=2, num_distributed_optimizer_instances=2
    )
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    dp = pgc.require("dp", "data")
    tp = mg.group_ranks(pgc.require("tp", "test"))  # mc's all-reduces over tp: not FSDP2's
    out: dict[str, Any] = {"groups": {}}
    for name in ("dp", "intra_dp_cp", "inter_dist_opt"):
        out["groups"][name] = mg.group_ranks(pgc.require(name, "test"))

    def build(mode: Any, seed: int = 0) -> tuple[Any, Any]:
        model = _build("hf", seed)
        parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
        ddp_config = TorchFullyShardedDataParallelConfig(
            num_distributed_optimizer_instances=2, gradient_accumulation_mode=mode
        )
        return model, TorchFullyShardedDataParallel(cfg, ddp_config, model, pg_collection=pgc)

    for mode in ("classic", "partial_reduce_scatter"):
        model, chunk = build(mode)
        opt = torch.optim.SGD(chunk.parameters(), lr=LR)
        counts = []
        if mode == "classic":
            for step in range(STEPS):
                ids = _batch("hf", step)[dp.rank() : dp.rank() + 1]
                opt.zero_grad()
                with counting_dist(_FSDP2_OPS) as fsdp:
                    _loss("hf", chunk, ids).backward()  # type: ignore[no-untyped-call]
                finalize_model_grads([chunk], pg_collection=pgc)
                opt.step()
            counts.append(Counter((op, g) for op, g, *_ in fsdp if g != tp))
        else:
            rows = _eight_rows()[2 * dp.rank() : 2 * dp.rank() + 2]
            with chunk.no_sync(), counting_dist(_FSDP2_OPS) as fsdp:
                (_loss("hf", chunk, rows[:1]) / 2).backward()  # type: ignore[no-untyped-call]
            counts.append(Counter((op, g) for op, g, *_ in fsdp if g != tp))
            with counting_dist(_FSDP2_OPS) as fsdp:
                (_loss("hf", chunk, rows[1:]) / 2).backward()  # type: ignore[no-untyped-call]
            counts.append(Counter((op, g) for op, g, *_ in fsdp if g != tp))
            finalize_model_grads([chunk], pg_collection=pgc)
            opt.step()
        out[mode] = {"counts": counts, "weights": full_state_dict(model)}
        if mode == "classic":
            views = model_sharded_state_dict(model)
            out["views"] = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in views.items()}
            dcp_save(views, checkpoint_id=folder)
            fresh = _build("hf", 1)  # TP=2 without FSDP2: views checked elsewhere
            parallelize(fresh, sequence_parallel_plan(fresh), config=cfg, pg_collection=pgc)
            dcp_load(model_sharded_state_dict(fresh), checkpoint_id=folder)
            out.update(
                loaded=full_state_dict(fresh),
                adamw=_adamw_round_trip(model, fresh, f"{folder}/adamw", pgc),
            )
    mg.destroy_model_parallel(pgc)
    return out if dist.get_rank() == 0 else None


def _adamw_round_trip(model: Any, fresh: Any, folder: str, pgc: Any) -> dict[str, float]:
    """AdamW's state over ``model``'s FSDP2 (here HSDP) params through DCP into a plain
    ``torch.optim.AdamW`` over ``fresh`` (the same TP, no FSDP2): one step at lr 0 on the
    grads the last backward left (the params stay; ``exp_avg = 0.1·g``,
    ``exp_avg_sq = 0.001·g²``, ``step = 1``), saved with ``mc_ddp.optimizer_sharded_state_dict``
    beside the model's views, loaded with ``load_optimizer_sharded_state_dict``. Per key
    kind, the largest difference over the world: the saved states made whole against
    AdamW's rule on the whole grad, and against the loaded states."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import mc_groups as mg
    from mc_ddp import load_optimizer_sharded_state_dict, optimizer_sharded_state_dict
    from mc_tp_layers import model_sharded_state_dict

    def whole(tensor: Any) -> torch.Tensor:
        return cast(torch.Tensor, getattr(tensor, "full_tensor", lambda: tensor)())

    params = dict(model.named_parameters())
    saved = torch.optim.AdamW(params.values(), lr=0.0)
    saved.step()
    dcp_save(
        optimizer_sharded_state_dict(saved, model_sharded_state_dict(model)), checkpoint_id=folder
    )
    loaded = torch.optim.AdamW(fresh.parameters(), lr=0.0)
    views = model_sharded_state_dict(fresh)
    state = optimizer_sharded_state_dict(loaded, views, is_loading=True)
    dcp_load(state, checkpoint_id=folder)
    load_optimizer_sharded_state_dict(loaded, state, views)
    worst = [0.0, 0.0, 0.0]
    for name, other in fresh.named_parameters():
        mine, theirs = saved.state[params[name]], loaded.state[other]
        grad = whole(params[name].grad)
        rule = (0.1 * grad, 0.001 * grad * grad)
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            state_whole = whole(mine[key])
            worst[i] = max(worst[i], float((state_whole - rule[i]).abs().max()))
            worst[2] = max(worst[2], float((state_whole - theirs[key]).abs().max()))
        worst[2] = max(worst[2], abs(float(whole(mine["step"])) - float(theirs["step"])))
    largest = torch.tensor(worst, dtype=torch.float64)
    mg.all_reduce(largest, pgc.require("world", "test"), op=mg.ReduceOp.MAX, label="test")
    return dict(zip(("exp_avg rule", "exp_avg_sq rule", "loaded"), largest.tolist(), strict=True))


def _eight_rows() -> torch.Tensor:
    """A global batch of 8 rows: 2 per data-parallel rank of 4."""
    return torch.cat([_batch("hf", 0), _batch("hf", 1)])


@pytest.mark.timeout(300)
def test_hsdp_under_the_wrapper_matches_one_process(rank_pools: RankPools, tmp_path: Path) -> None:
    """HSDP (Megatron main's ``num_distributed_optimizer_instances`` > 1 under
    ``TorchFullyShardedDataParallel``): the 2-D mesh (replicate over ``inter_dist_opt``,
    shard over ``intra_dp_cp``) at TP=2 × 2 replicas × 2 shards with SP, 8 ranks. By
    hand, per step: FSDP2's 5 groups (2 layers, the embedding, the head, the root's norm)
    all-gather in forward and 4 again in backward over ``intra_dp_cp``, reduce-scatter over
    ``intra_dp_cp`` and all-reduce the shard over ``inter_dist_opt`` (5 each), nothing
    over the whole ``dp``. The weights after 3 SGD steps within 1e-6 of one process's
    (``_reference``: the average over 4 rows equals HSDP's average over the shards then
    the replicas). With ``"partial_reduce_scatter"`` a micro-batch under ``no_sync``
    reduce-scatters but does not all-reduce (5 and 0), the last one does both (5 and 5),
    and one step on 8 rows in 2 micro-batches matches one process's step on them. The DCP
    views (``[Shard(partition_dim), Replicate(), Shard(0)]`` on the ``(tp, replicate,
    shard)`` mesh) made whole equal ``full_state_dict``'s tensors exactly, and a model built
    from other weights at TP=2 without FSDP2 loads the checkpoint (``dcp.load``) and gives
    them back exactly; so does AdamW's state (``_adamw_round_trip``: ``exp_avg`` and
    ``exp_avg_sq`` made whole follow AdamW's first step on the whole grad within 1e-7 and
    load exactly into a plain AdamW at TP=2 without FSDP2)."""
    result = rank_pools.get(8).run_with_deadline(280.0, _hsdp, str(tmp_path))[0]
    assert result is not None
    shard, replicate = result["groups"]["intra_dp_cp"], result["groups"]["inter_dist_opt"]
    assert (len(shard), len(replicate), len(result["groups"]["dp"])) == (2, 2, 4), result["groups"]
    step = Counter(
        {
            ("all_gather_single", shard): 9,
            ("reduce_scatter_single", shard): 5,
            ("all_reduce", replicate): 5,
        }
    )
    assert result["classic"]["counts"] == [step], result["classic"]["counts"]
    first, last = result["partial_reduce_scatter"]["counts"]
    assert first == step - Counter({("all_reduce", replicate): 5}), first
    assert last == step, last
    _, three_steps = _reference("hf")
    for mode, ref in (
        ("classic", three_steps),
        ("partial_reduce_scatter", _one_sgd_step(_eight_rows())),
    ):
        got = result[mode]["weights"]
        assert sorted(got) == sorted(ref), mode
        worst = max(float((got[k] - v).abs().max()) for k, v in ref.items())
        print(f"HSDP {mode}: weights {worst:.1e} from one process")
        assert worst <= 1e-6, (mode, worst)
    trained = result["classic"]["weights"]
    for key in ("views", "loaded"):
        assert sorted(result[key]) == sorted(trained), key
        for name, value in trained.items():
            assert torch.equal(result[key][name], value), (key, name)
    adamw = result["adamw"]
    print(f"HSDP AdamW state through DCP: {adamw}")
    assert adamw["exp_avg rule"] <= 1e-7, adamw
    assert adamw["exp_avg_sq rule"] <= 1e-7, adamw
    assert adamw["loaded"] == 0.0, adamw


def _wrapped_moe(
    model: Any, cfg: Any, pgc: Any, instances: int = 1
) -> tuple[Any, torch.optim.Optimizer, Callable[[int], torch.Tensor]]:
    """``model`` under ``TorchFullyShardedDataParallel`` (``reduce_scatter_unused_params``,
    as expert params need; ``instances`` > 1: HSDP), SGD with the example's momentum, and
    this data-parallel rank's rows of a step's global batch."""
    import mc_groups as mg
    from examples.hf_moe import BATCH, LR, MOMENTUM, global_batch
    from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

    ddp_config = TorchFullyShardedDataParallelConfig(
        reduce_scatter_unused_params=True, num_distributed_optimizer_instances=instances
    )
    chunk = TorchFullyShardedDataParallel(cfg, ddp_config, model, pg_collection=pgc)
    opt = torch.optim.SGD(chunk.parameters(), lr=LR, momentum=MOMENTUM)
    dp = pgc.require("dp", "data")
    rows = BATCH // mg.group_size(dp)
    first = mg.group_rank(dp) * rows
    return chunk, opt, lambda step: global_batch(step)[first : first + rows]


# (transformers MoE model, TP with SP when 2, expert TP, Megatron's expert bias, every
# decoder layer "recompute"d in backward (transformers' activation checkpointing) or
# "compile"d in place with aot_eager before the wrapper, torchtitan's order)
MOE_KINDS = [
    ("qwen3_moe", 2, 1, False, ""),
    ("olmoe", 2, 2, False, ""),
    ("gpt_oss", 1, 2, False, ""),  # expt_dp one rank (expert TP 2 x EP 2 on 4 ranks)
    ("deepseek_v3", 2, 1, True, "compile"),  # torchtitan's TP x EP x FSDP2 with torch.compile
    ("mixtral", 2, 1, False, "recompute"),  # and with activation checkpointing
]


def _moe_kinds(cases: list[tuple[str, int, int, bool, str]]) -> list[dict[str, Any]]:
    """Each ``examples/hf_moe.py`` model of ``cases`` at EP 2 under the wrapper on every
    rank of a 4-rank world: 3 steps of its mean loss (with the model's load-balancing loss
    where it has one), ``finalize_model_grads`` (DeepSeek-V3: its routers' expert bias),
    ``mc_ddp.clip_grad_norm`` at the example's bound, SGD with momentum; the losses
    averaged over dp and the whole weights (``mc_moe.full_state_dict``). ``"recompute"``:
    each decoder layer checkpointed (``activation_checkpointing_enable``) before the
    wrapper shards it, so each layer's dispatch and FSDP2's gathers of its experts run
    again in backward. ``"compile"``: each decoder layer compiled in place (``aot_eager``;
    Dynamo's graph count kept). Not both: under ``transformers``' checkpointing a
    layer's ``compile()`` captures 2 calls of its forward, not the forward (torch 2.13)."""
    from torch._dynamo.utils import counters

    import mc_groups as mg
    import mc_moe
    from examples.hf_moe import CLIP, RATE, build_model
    from mc_ddp import (
        clip_grad_norm,
    )
    from mc_finalize import finalize_model_grads

    torch.set_num_threads(1)
    out = []
    for kind, tp, etp, bias, mode in cases:
        sizes: dict[str, Any] = {
            "tensor_model_parallel_size": tp,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": etp,
        }
        pgc = mg.initialize_model_parallel(**sizes)
        cfg = mg.ModelParallelConfig(
            **sizes,
            sequence_parallel=tp > 1,
            moe_router_enable_expert_bias=bias,
            moe_router_bias_update_rate=RATE,
        )
        model = build_model(kind)
        plan = mc_moe.sequence_parallel_plan(model) if tp > 1 else model.tp_plan
        mc_moe.parallelize(model, plan, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
        if mode == "recompute":
            model.activation_checkpointing_enable()
        counters.clear()
        for layer in model.model.layers if mode == "compile" else ():
            layer.compile(backend="aot_eager")
        chunk, opt, batch = _wrapped_moe(model, cfg, pgc)
        losses = []
        for step in range(STEPS):
            ids = batch(step)
            opt.zero_grad()
            with mg.record_collectives() as log:
                loss = _moe_loss(chunk, ids, False)
                loss.backward()  # type: ignore[no-untyped-call]
            finalize_model_grads([chunk], pg_collection=pgc)
            clip_grad_norm(chunk, CLIP, pg_collection=pgc)
            opt.step()
            mean = loss.detach().clone()
            mg.all_reduce(mean, pgc.require("dp", "data"), op=mg.ReduceOp.AVG, label="log")
            losses.append(float(mean))
        exchanges = sum(r.op == "all_to_all" for r in log)  # the last step's, over ep
        weights = mc_moe.full_state_dict(model, pgc)
        graphs = counters["stats"]["unique_graphs"]
        out.append(
            {"losses": losses, "weights": weights, "all_to_alls": exchanges, "graphs": graphs}
        )
        mg.destroy_model_parallel(pgc)
    return out


@pytest.mark.timeout(240)
def test_every_transformers_moe_kind_under_the_wrapper_matches_one_process(
    rank_pools: RankPools,
) -> None:
    """Qwen3-MoE (TP 2), OLMoE (TP 2 × expert TP 2), gpt-oss (expert TP 2: its ``expt_dp`` is
    one rank) and DeepSeek-V3 (TP 2, Megatron's expert bias moving its routers'
    ``e_score_correction_bias``) at EP 2 under ``TorchFullyShardedDataParallel`` on 4 ranks,
    DeepSeek-V3 with every decoder layer compiled (torchtitan's order: split, compiled,
    sharded; Dynamo splits each layer at the dispatcher's count read and the experts'
    ``nonzero``), and Mixtral at TP 2 (SP) × EP 2 × FSDP2 with every decoder layer
    recomputed in backward (transformers' activation checkpointing, torchtitan's order:
    split, then checkpointed, then sharded), beside Mixtral's cases above: 3 steps' mean
    losses within 1e-5 relative and every weight (the routers' biases included) within 1e-6 of
    ``examples.hf_moe.reference``; the last step's all-to-alls over ``ep`` counted (4 per
    MoE layer, 6 recomputed)."""
    from examples.hf_moe import reference

    runs = rank_pools.get(4).run_with_deadline(220.0, _moe_kinds, MOE_KINDS)[0]
    for (kind, tp, etp, bias, mode), run in zip(MOE_KINDS, runs, strict=True):
        ref = reference(kind, STEPS, expert_bias=bias)
        got, where = run["losses"], f"{kind} TP={tp} expert TP={etp} {mode}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref.losses, strict=True))
        assert rel <= 1e-5, (where, got, ref.losses)
        assert sorted(run["weights"]) == sorted(ref.weights), where
        worst = max(float((run["weights"][k] - v).abs().max()) for k, v in ref.weights.items())
        print(f"{where} under FSDP2: loss rel {rel:.1e}, weights {worst:.1e}")
        assert worst <= 1e-6, (where, worst)
        # per MoE layer (2): dispatch and combine, forward and backward; recomputed, the
        # forward's pair again in backward
        recompute = mode == "recompute"
        assert run["all_to_alls"] == (6 if recompute else 4) * 2, (where, run["all_to_alls"])
        assert (run["graphs"] > 0) == (mode == "compile"), (where, run["graphs"])


def _moe_loss(chunk: Any, ids: torch.Tensor, per_token: bool) -> torch.Tensor:
    """The model's mean loss with its load-balancing loss, or (``per_token``) the SUM of the
    rows' next-token cross entropy (HF's shift: ``logits[:, :-1]`` against ``ids[:, 1:]``)."""
    import torch.nn.functional as F

    if not per_token:
        return chunk(input_ids=ids, labels=ids, output_router_logits=True).loss  # type: ignore[no-any-return]
    logits = chunk(input_ids=ids).logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, ids[:, 1:].flatten(), reduction="sum")


def _moe_under_fsdp2(
    tp: int, folder: str, instances: int = 1, per_token: bool = False, etp: int = 1
) -> dict[str, Any] | None:
    """``examples/hf_moe.py``'s Mixtral (4 experts, top-2, the model's load-balancing loss)
    at TP=``tp`` (SP on, expert TP 1) × EP=2 × FSDP2 over the rest through the wrapper
    (``instances`` > 1: HSDP), every rank of the world: 3 steps
    of SGD with momentum after ``finalize_model_grads`` and ``mc_ddp.clip_grad_norm`` at the
    example's bound, FSDP2's collectives of the last backward counted by group, the whole
    weights (``mc_moe.full_state_dict``); then the DCP views of
    ``mc_moe.model_sharded_state_dict`` made whole, and the weights of a model built from
    other weights (seed 1), at the same TP × EP without FSDP2, after ``dcp.load`` of the
    views ``dcp.save`` wrote to ``folder``, at the other expert TP (2 for ``etp`` 1, else 1;
    a checkpoint serves every expert layout). ``per_token``: Megatron's per-token loss
    (``calculate_per_token_loss``) without the load-balancing loss: each rank's loss is the
    SUM of its tokens' cross entropy, ``finalize_model_grads(num_tokens=)`` divides by the
    global count; no checkpoint."""
    import torch.distributed as dist

    import mc_groups as mg
    import mc_moe
    from examples.hf_moe import CLIP, build_model
    from mc_ddp import (
        clip_grad_norm,
    )
    from mc_finalize import finalize_model_grads

    torch.set_num_threads(1)
    sizes: dict[str, Any] = {"tensor_model_parallel_size": tp, "expert_model_parallel_size": 2}
    pgc = mg.initialize_model_parallel(
        **sizes, expert_tensor_parallel_size=etp, num_distributed_optimizer_instances=instances
    )
    cfg = mg.ModelParallelConfig(
        **sizes,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        calculate_per_token_loss=per_token,
    )

    def build(seed: int, cfg: Any, pgc: Any) -> Any:
        model = build_model("mixtral", seed)
        plan = mc_moe.sequence_parallel_plan(model) if tp > 1 else model.tp_plan
        mc_moe.parallelize(model, plan, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
        return model

    model = build(0, cfg, pgc)
    chunk, opt, batch = _wrapped_moe(model, cfg, pgc, instances)
    dp = pgc.require("dp", "data")
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        opt.zero_grad()
        tokens = torch.tensor(ids[:, 1:].numel(), dtype=torch.int64) if per_token else None
        loss = _moe_loss(chunk, ids, per_token)
        with counting_dist() as fsdp:
            loss.backward()  # type: ignore[no-untyped-call]
        count = float(dp.size()) if tokens is None else float(tokens)
        logged = torch.stack([loss.detach(), torch.tensor(count)])
        finalize_model_grads([chunk], num_tokens=tokens, pg_collection=pgc)
        clip_grad_norm(chunk, CLIP, pg_collection=pgc)
        opt.step()
        # mean loss: Σ of the ranks' means ÷ dp, or Σ of their sums ÷ Σ of their counts
        mg.all_reduce(logged, dp, label="loss (and tokens) for logging")
        losses.append(float(logged[0] / (logged[1] if per_token else dp.size())))
    result: dict[str, Any] = {
        "losses": losses,
        "weights": mc_moe.full_state_dict(model, pg_collection=pgc),
        "scatters": Counter(group for op, group, *_ in fsdp if op == "reduce_scatter_single"),
        "dp": mg.group_ranks(dp),
        "expt_dp": mg.group_ranks(pgc.require("expt_dp", "test")),
    }
    if not per_token:
        other = {**sizes, "expert_tensor_parallel_size": 2 if etp == 1 else 1}
        there = mg.initialize_model_parallel(**other)
        fresh = build(1, mg.ModelParallelConfig(**other, sequence_parallel=tp > 1), there)
        result.update(_moe_checkpoint(model, fresh, there, folder))
        mg.destroy_model_parallel(there)
    mg.destroy_model_parallel(pgc)
    return result if dist.get_rank() == 0 else None


def _moe_checkpoint(model: Any, fresh: Any, there: Any, folder: str) -> dict[str, Any]:
    """``model``'s DCP views (``mc_moe.model_sharded_state_dict``, the expert-mesh
    exchanges counted) made whole, saved to ``folder`` and loaded into ``fresh`` (not under
    FSDP2, built on the collection ``there``): the views, ``fresh``'s whole weights after
    the load and the count."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import mc_groups as mg
    import mc_moe

    with mg.record_collectives() as log:
        views = mc_moe.model_sharded_state_dict(model)
    meshes = sum(r.op == "all_gather_object" and r.label == "expert mesh" for r in log)
    whole = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in views.items()}
    dcp_save(views, checkpoint_id=folder)
    dcp_load(mc_moe.model_sharded_state_dict(fresh), checkpoint_id=folder)
    loaded = mc_moe.full_state_dict(fresh, pg_collection=there)
    return {"views": whole, "loaded": loaded, "meshes": meshes}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp", "etp", "instances", "world", "per_token"),
    [
        (1, 1, 1, 4, False),
        (2, 1, 1, 4, False),
        (1, 1, 2, 8, False),
        (2, 1, 1, 4, True),
        (2, 2, 1, 8, False),
        (1, 2, 1, 4, False),
        (1, 2, 2, 8, False),
        (1, 1, 2, 8, True),
    ],
    ids=[
        "ep2_dp4",
        "tp2_ep2_dp2",
        "ep2_hsdp2x4",
        "tp2_ep2_dp2_per_token",
        "tp2_etp2_ep2_dp4",
        "etp2_ep2_dp4",
        "etp2_ep2_hsdp2x4",
        "ep2_hsdp2x4_per_token",
    ],
)
def test_expert_parallel_moe_under_the_wrapper_matches_one_process(
    rank_pools: RankPools,
    tp: int,
    etp: int,
    instances: int,
    world: int,
    per_token: bool,
    tmp_path: Path,
) -> None:
    """Expert parallelism under ``TorchFullyShardedDataParallel`` (Megatron main's
    per-parameter mesh): the expert params (``allreduce=False``) sharded over ``expt_dp``,
    the rest over ``dp_cp``, every group's reduction a SUM ÷ the dense data-parallel size
    (the experts' grads are Σ over expt_dp ÷ 4: each EP rank's expert saw its EP peer's
    tokens). Mixtral at EP=2 on 4 ranks, TP 1 (DP 4) and TP 2 with SP (DP 2, expert TP 1),
    and under HSDP on 8 ranks (2 replicas × 4 shards; the experts' mesh: 2 replicas
    (``inter_expt_dp``) × 2 shards (``intra_expt_dp``)), at TP 2 × expert TP 2 on 8
    ranks (DP 4; experts: expert TP 2 × EP 2 × expt_dp 2), and at TP 1 × expert TP 2 × EP 2
    on 4 ranks (``expt_dp`` one rank: torch's FSDP2 would divide those grads by |dp| twice,
    ``_divide_once_on_one_rank``; weights 1.9e-3 off without it), and that under HSDP on 8
    ranks (the experts' shard group one rank, 2 replicas; 2.2e-3 off without it): 3 steps'
    mean losses within 1e-5
    relative and the final weights within 1e-6 of one process
    (``examples.hf_moe.reference``: SGD with momentum, ``clip_grad_norm_`` at 1.0, the
    load-balancing loss over the global batch); the last backward reduce-scatters over both
    groups. The DCP views (experts on the ``(ep, expt_tp, expt_dp)`` mesh, ``[Shard(0),
    Shard(d), Shard(0)]``, a mesh axis of one rank left out; ``[gate; up]`` as ``[E, 2, I,
    H]``) made whole equal the whole weights exactly, and a model built from other weights
    at the other expert TP (1 ↔ 2) without FSDP2 loads the checkpoint (``dcp.load``) and
    gives them back exactly: the checkpoint holds the unsplit tensors, not FSDP2's or one
    expert TP's layout. With per-token loss (no load-balancing loss; the
    reference's mean cross entropy over the global batch; at TP 2 and under HSDP) FSDP2
    SUMs over both groups and the replicas (÷ 1) and finalize divides every grad by the
    global token count."""
    from examples.hf_moe import reference

    result = rank_pools.get(world).run_with_deadline(
        220.0, _moe_under_fsdp2, tp, str(tmp_path), instances, per_token, etp
    )[0]
    assert result is not None
    ref = reference("mixtral", STEPS, aux=not per_token)
    rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref.losses, strict=True))
    assert rel <= 1e-5, (result["losses"], ref.losses)
    got = result["weights"]
    assert sorted(got) == sorted(ref.weights)
    worst = max(float((got[k] - v).abs().max()) for k, v in ref.weights.items())
    print(f"MoE under FSDP2 TP={tp} x{instances}: loss rel {rel:.1e}, weights {worst:.1e}")
    assert worst <= 1e-6, worst
    scatters = result["scatters"]
    if instances == 1:
        groups = {result["dp"], result["expt_dp"]}  # a one-rank expt_dp issues none
        assert set(scatters) == {g for g in groups if len(g) > 1}, scatters
    else:  # over the rows: intra_dp_cp and intra_expt_dp, each when of more than one rank
        rows = [world // tp // instances, world // (2 * etp) // instances]
        assert sorted(len(g) for g in scatters) == sorted(r for r in rows if r > 1), scatters
    if not per_token:  # the view meshes built once per call, not per expert param (4 here)
        # one exchange per mesh dim of more than one rank: FSDP2's expert mesh (expt_dp,
        # or HSDP's replicate x shard), then expt_tp before it, then ep before those
        expt_dp = world // (2 * etp)
        mesh = [expt_dp] if instances == 1 else [instances, expt_dp // instances]
        dims = sum(size > 1 for size in mesh)
        assert result["meshes"] == (dims if etp == 1 else 2 * dims + 1), result["meshes"]
    for key in () if per_token else ("views", "loaded"):
        assert sorted(result[key]) == sorted(got), key
        for name, value in got.items():  # a [gate; up] view is [E, 2, I, H]
            assert torch.equal(result[key][name].reshape(value.shape), value), (key, name)


def _fsdp2_moe_steps(
    steps: int, save: str | None = None, resume: str | None = None, *, optimizer: bool = True
) -> list[float]:
    """Mixtral at TP 1 × EP 2 × FSDP2 DP 4 through the wrapper (SGD with momentum, clipped at
    the example's bound), built from other weights (seed 1) when it resumes from the
    newest checkpoint there (``optimizer`` False: the model alone, the momentum fresh); a
    checkpoint in ``save`` after the last step. The mean loss of each step run here, after
    the saved ones."""
    import mc_groups as mg
    import mc_moe
    from examples.hf_moe import CLIP, build_model
    from mc_ddp import clip_grad_norm
    from mc_finalize import finalize_model_grads
    from mc_train.checkpoint import Checkpointer

    sizes: dict[str, Any] = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 2}
    pgc = mg.initialize_model_parallel(**sizes)
    cfg = mg.ModelParallelConfig(**sizes)
    model = build_model("mixtral", 0 if resume is None else 1)
    mc_moe.parallelize(model, model.tp_plan, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
    chunk, opt, batch = _wrapped_moe(model, cfg, pgc)
    losses: list[float] = []
    if resume is not None:
        found = Checkpointer(resume, [chunk], opt if optimizer else None, pg_collection=pgc)
        losses = list(found.load("auto").state["losses"])
    dp = pgc.require("dp", "data")
    for step in range(len(losses), steps):
        opt.zero_grad()
        ids = batch(step)
        loss = chunk(input_ids=ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        finalize_model_grads([chunk], pg_collection=pgc)
        clip_grad_norm(chunk, CLIP, pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    if save is not None:
        Checkpointer(save, [chunk], opt, pg_collection=pgc).save(
            steps, state={"losses": losses}, last=True
        )
    mg.destroy_model_parallel(pgc)
    return losses


def _moe_resumes(folder: str) -> dict[str, list[float]] | None:
    """2 steps under FSDP2 × EP 2, saved, resumed by mc DDP at EP 4 (distributed optimizer)
    for steps 3-4; 2 steps of mc DDP at EP 4 saved, resumed under FSDP2 × EP 2; and the
    control: the FSDP2 checkpoint resumed under FSDP2 without the optimizer state."""
    import torch.distributed as dist

    from examples.hf_moe import Layout, train

    torch.set_num_threads(1)
    ep4 = Layout(ep=4, distributed_optimizer=True)
    out = {"fsdp2": _fsdp2_moe_steps(2, save=f"{folder}/fsdp2")}
    out["fsdp2 -> ddp ep4"] = train("mixtral", ep4, steps=4, resume=f"{folder}/fsdp2").losses
    train("mixtral", ep4, steps=2, save_dir=f"{folder}/ddp")
    out["ddp ep4 -> fsdp2"] = _fsdp2_moe_steps(4, resume=f"{folder}/ddp")
    out["model only"] = _fsdp2_moe_steps(4, resume=f"{folder}/fsdp2", optimizer=False)
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(240)
def test_expert_parallel_checkpoints_move_between_fsdp2_and_ddp(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    """``mc_train.Checkpointer`` under FSDP2 with expert parallelism (the experts' params and
    momentum DTensors on the ``expt_dp`` mesh, the rest on ``dp``) writes what mc DDP at
    another expert-parallel size loads, and the reverse: Mixtral 2 steps under the wrapper
    at EP 2, resumed by DDP at EP 4 with the distributed optimizer, and 2 steps of that
    resumed under FSDP2 at EP 2 (built from other weights): every step's loss within 1e-5
    relative of one process's 4 steps (``examples.hf_moe.reference``), as the uninterrupted
    layouts are. The control, the FSDP2 checkpoint resumed without its momentum, moves the
    last loss by over 100× that."""
    from examples.hf_moe import reference

    runs = rank_pools.get(4).run_with_deadline(220.0, _moe_resumes, str(tmp_path))[0]
    assert runs is not None
    ref = reference("mixtral", 4).losses
    for name in ("fsdp2 -> ddp ep4", "ddp ep4 -> fsdp2"):
        rel = max(abs(a - b) / b for a, b in zip(runs[name], ref, strict=True))
        print(f"{name}: {rel:.1e}")
        assert rel <= 1e-5, (name, runs[name], ref)
    assert runs["fsdp2 -> ddp ep4"][:2] == runs["fsdp2"]  # the saved history
    moved = abs(runs["model only"][3] - ref[3]) / ref[3]
    print(f"resumed without the momentum: {moved:.1e}")
    assert moved > 100 * 1e-5, (runs["model only"], ref)


def _pipeline(
    steps: int, compiled: bool = False
) -> tuple[list[float], list[float], dict[str, torch.Tensor], int] | None:
    """``examples/hf_3d.py``'s Llama (4 blocks, tied embeddings) at TP=2 × PP=2 × FSDP DP=2
    with SP: ``mc_train.build_pipeline`` with a ``TorchFullyShardedDataParallelConfig`` (each
    stage under FSDP2), 1F1B over 4 micro-batches, ``mc_ddp.clip_grad_norm`` at 1.0, SGD with
    momentum (the example's optimizer). ``compiled``: each stage's decoder layers compiled
    in place after ``parallelize`` and before the wrapper (torchtitan's order); also
    returns Dynamo's graph-break count."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import mc_groups as mg
    import mc_train
    from examples.hf_3d import BATCH, CLIP, build_model, global_batch, sgd
    from mc_ddp import TorchFullyShardedDataParallelConfig, clip_grad_norm
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(2, 2)
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True
    )
    model = build_model()
    plan = sequence_parallel_plan(model)
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, 2), pgc)
    counters.clear()
    for chunk in chunks:
        parallelize(chunk, mc_train.stage_plan(plan, chunk), config=cfg, pg_collection=pgc)
        for layer in chunk.modules() if compiled else ():
            if isinstance(layer, LlamaDecoderLayer):
                layer.compile(backend="aot_eager", fullgraph=True)
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=TorchFullyShardedDataParallelConfig(),
        pg_collection=pgc,
        microbatches=BATCH // 2,
        loss_fn=mc_train.token_cross_entropy(),
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=2),
    )
    opt = sgd(pipe.parameters())
    dp = pgc.require("dp", "data")
    rows = BATCH // dp.size()
    losses, norms = [], []
    for step in range(steps):
        ids = global_batch(step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        opt.zero_grad()
        losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
        norms.append(clip_grad_norm(pipe.chunks, CLIP, pg_collection=pgc).grad_norm or 0.0)
        opt.step()
    weights = {n: w for c in pipe.chunks for n, w in full_state_dict(c.module).items()}
    gathered = mg.all_gather_objects(weights, pgc.require("world", "test"), label="test")
    mg.destroy_model_parallel(pgc)
    if dist.get_rank() != 0:
        return None
    whole = {k: v for part in gathered for k, v in part.items()}  # type: ignore[attr-defined]
    return losses, norms, whole, sum(counters["graph_break"].values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tp_pp_fsdp2_on_8_ranks_matches_one_process(rank_pools: RankPools, compiled: bool) -> None:
    """TP=2 × PP=2 × FSDP2 DP=2 through ``build_pipeline``: per-step loss and grad norm
    before clipping within 1e-5 relative of one process (``transformers``' loss,
    ``torch.nn.utils.clip_grad_norm_`` at 1.0, SGD with momentum: ``hf_3d.reference``), the
    final weights of both stages within 1e-6 (the tied table summed between the first and
    last stage by finalize over ``embd``, each copy counted once in the norm). Compiled:
    torchtitan's stack, each stage's decoder layers compiled in place (``fullgraph``,
    ``aot_eager``) between ``parallelize`` and FSDP2, trains the same, with no graph break."""
    from examples.hf_3d import reference

    steps = 2  # the norm is above 1 at step 2: the clip acts
    result = rank_pools.get(8).run(_pipeline, steps, compiled)[0]
    assert result is not None
    losses, norms, weights, breaks = result
    assert breaks == 0, breaks
    ref = reference(steps)
    for got, want in ((losses, ref.losses), (norms, ref.grad_norms)):
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
        assert rel <= 1e-5, (got, want)
    assert max(ref.grad_norms) > 1.0  # clipping acts
    shared = set(weights) & set(ref.weights)
    assert shared == set(ref.weights) - {"lm_head.weight"} or shared == set(ref.weights)
    worst = max(float((weights[k] - ref.weights[k]).abs().max()) for k in shared)
    assert worst <= 1e-6, worst


def _bf16_step() -> dict[str, Any] | None:
    """The ``transformers`` Llama at TP=2 × DP=2 with SP under the wrapper with
    ``config.bf16`` and ``grad_reduce_in_fp32``: FSDP2's ``MixedPrecisionPolicy`` computes in
    bf16 (params gathered in bf16) and reduces in fp32; 3 SGD steps."""
    import torch.distributed as dist

    import mc_groups as mg
    from mc_ddp import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import parallelize, sequence_parallel_plan

    pgc = _fresh_groups()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, bf16=True)
    model = _build("hf")
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    ddp_config = TorchFullyShardedDataParallelConfig(grad_reduce_in_fp32=True)
    chunk = TorchFullyShardedDataParallel(cfg, ddp_config, model, pg_collection=pgc)
    opt = torch.optim.SGD(chunk.parameters(), lr=LR)
    dp = pgc.require("dp", "data")
    rows = _batch("hf", 0).shape[0] // dp.size()
    losses: list[float] = []
    ops: Counter[tuple[str, torch.dtype]] = Counter()
    for step in range(STEPS):
        ids = _batch("hf", step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        chunk.zero_grad_buffer()
        with counting_dist() as fsdp:
            loss = _loss("hf", chunk, ids)
            loss.backward()  # type: ignore[no-untyped-call]
        ops = Counter((name, dtype) for name, _, _, dtype in fsdp)
        finalize_model_grads([chunk], pg_collection=pgc)
        opt.step()
        mean = loss.detach().float()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    grads = {p.grad.dtype for p in chunk.parameters() if p.grad is not None}
    params = {p.dtype for p in chunk.parameters()}
    mg.destroy_model_parallel(pgc)
    result = {"losses": losses, "ops": ops, "grads": grads, "params": params}
    return result if dist.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_bf16_compute_with_fp32_reduction(rank_pools: RankPools) -> None:
    """``config.bf16`` + ``grad_reduce_in_fp32`` under the wrapper: the sharded params and
    their grads stay fp32, FSDP2 all-gathers the params in bf16 and reduce-scatters the grads
    in fp32 (every one of a step's collectives), and the losses stay within bf16's precision
    of one process's fp32 run (2e-2 relative; fp32 compute is held to 1e-5 above)."""
    result = rank_pools.get(4).run(_bf16_step)[0]
    assert result is not None
    assert result["params"] == {torch.float32}
    assert result["grads"] == {torch.float32}
    ops = result["ops"]
    assert set(ops) == {
        ("all_gather_single", torch.bfloat16),
        ("reduce_scatter_single", torch.float32),
    }, ops
    ref_losses, _ = _reference("hf")
    rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses, strict=True))
    assert rel <= 2e-2, (result["losses"], ref_losses)


Built = tuple[Any, Any, Any]  # a run's model, chunk (the FSDP2 module or mc DDP), optimizer


def _optimizer(params: Any, adamw: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if adamw else torch.optim.SGD(params, lr=LR)


def _fsdp2_run(pgc: Any, adamw: bool, state: Any = None, seed: int = 0) -> Built:
    """The ``transformers`` Llama at TP=2 × FSDP2 DP=2 with SP (torchtitan's way)."""
    import mc_groups as mg
    from mc_tp_layers import load_full_state_dict, parallelize, sequence_parallel_plan

    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model = _build("hf", seed)
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    chunk = _shard(model, "direct", cfg, pgc)
    if state is not None:
        load_full_state_dict(model, state)
    return model, chunk, _optimizer(chunk.parameters(), adamw)


def _ddp_run(pgc: Any, adamw: bool, state: Any = None, seed: int = 0) -> Built:
    """The same model whole under mc DDP (TP=1 × DP=4); with AdamW the distributed
    optimizer."""
    import mc_groups as mg
    from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer

    model = _build("hf", seed)
    if state is not None:
        model.load_state_dict(state)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=adamw)
    chunk = DistributedDataParallel(mg.ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
    return model, chunk, ShardedOptimizer(_optimizer(chunk.parameters(), adamw), chunk)


def _steps(built: Built, first: int, last: int, pgc: Any) -> list[float]:
    """Steps ``first`` to ``last - 1`` on this rank's rows; the losses averaged over DP."""
    import mc_groups as mg
    from mc_finalize import finalize_model_grads

    _, chunk, opt = built
    dp = pgc.require("dp", "data")
    rows = _batch("hf", 0).shape[0] // dp.size()
    losses = []
    for step in range(first, last):
        ids = _batch("hf", step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        opt.zero_grad()
        loss = _loss("hf", chunk, ids)
        loss.backward()  # type: ignore[no-untyped-call]
        finalize_model_grads([chunk], pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    return losses


def _carry(
    before: Built, pgc: Any, make: Callable[..., Built], after: Any, folder: str | None
) -> Built:
    """``before``'s state into a run ``make(after, adamw, ...)`` builds: its whole weights
    (``folder`` None: SGD), or through ``mc_train.Checkpointer`` in ``folder`` (AdamW),
    loaded into a run built from other weights (seed 1)."""
    from mc_tp_layers import full_state_dict
    from mc_train.checkpoint import Checkpointer

    if folder is None:
        return make(after, False, full_state_dict(before[0]))
    Checkpointer(folder, before[1], before[2], pg_collection=pgc).save(2, last=True)
    built = make(after, True, seed=1)
    Checkpointer(folder, built[1], built[2], pg_collection=after).load("auto")
    return built


def _resume_across_layouts(folder: str | None) -> dict[str, list[float]] | None:
    """The ``transformers`` Llama trained 4 steps: uninterrupted under FSDP2 TP=2 × DP=2
    with SP; FSDP2 for 2 steps, then mc DDP at TP=1 × DP=4 for steps 3 and 4; and back (mc
    DDP first, FSDP2 TP=2 after). ``folder`` None: SGD, the weights carried by
    ``full_state_dict`` / ``load_full_state_dict``; a folder: AdamW (with its state) and
    ``mc_train.Checkpointer`` (DCP), mc DDP with the distributed optimizer
    (``ShardedOptimizer``), FSDP2 with a plain ``torch.optim.AdamW`` over its params."""
    import torch.distributed as dist

    import mc_groups as mg

    tp2 = _fresh_groups()
    tp1 = mg.initialize_model_parallel(tensor_model_parallel_size=1)
    adamw = folder is not None
    there = None if folder is None else f"{folder}/there"
    back = None if folder is None else f"{folder}/back"
    out = {"uninterrupted": _steps(_fsdp2_run(tp2, adamw), 0, 4, tp2)}
    first = _fsdp2_run(tp2, adamw)
    losses = _steps(first, 0, 2, tp2)
    out["fsdp2_then_ddp"] = losses + _steps(_carry(first, tp2, _ddp_run, tp1, there), 2, 4, tp1)
    if folder is not None:  # the control: the same resume without the optimizer state
        from mc_train.checkpoint import Checkpointer

        control = _ddp_run(tp1, True, seed=1)
        Checkpointer(there, control[1], None, pg_collection=tp1).load("auto")
        control[2].reload_model_params()  # the masters from the loaded weights
        out["without_optimizer_state"] = losses + _steps(control, 2, 4, tp1)
    second = _ddp_run(tp1, adamw)
    losses = _steps(second, 0, 2, tp1)
    out["ddp_then_fsdp2"] = losses + _steps(_carry(second, tp1, _fsdp2_run, tp2, back), 2, 4, tp2)
    mg.destroy_model_parallel(tp1)
    mg.destroy_model_parallel(tp2)
    return out if dist.get_rank() == 0 else None


def _check_resumes(result: dict[str, list[float]] | None) -> None:
    assert result is not None
    want = result["uninterrupted"]
    for name in ("fsdp2_then_ddp", "ddp_then_fsdp2"):
        rel = max(abs(a - b) / abs(b) for a, b in zip(result[name], want, strict=True))
        print(f"{name}: max relative loss difference {rel:.1e}")
        assert rel <= 1e-6, (name, result[name], want)
    if "without_optimizer_state" in result:
        forgot = result["without_optimizer_state"]
        moved = max(abs(a - b) / abs(b) for a, b in zip(forgot, want, strict=True))
        print(f"resumed without the optimizer state: {moved:.1e}")
        assert moved > 100 * 1e-6, (forgot, want)


@pytest.mark.timeout(120)
def test_resume_across_layouts_through_whole_state_dicts(rank_pools: RankPools) -> None:
    """FSDP2 TP=2 × DP=2 → mc DDP TP=1 × DP=4 and back through ``full_state_dict`` /
    ``load_full_state_dict`` (whole tensors, one-process names): every step's loss within
    1e-6 relative of the uninterrupted FSDP2 run (SGD: no optimizer state to carry)."""
    _check_resumes(rank_pools.get(4).run(_resume_across_layouts, None)[0])


@pytest.mark.timeout(120)
def test_resume_across_layouts_through_the_checkpointer_with_adamw(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    """The same with AdamW through ``mc_train.Checkpointer`` (DCP): FSDP2's params and
    AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` saved under the one-process names at
    full shape (``(tp, dp)`` DTensor views), in ``ShardedOptimizer``'s keys, loaded by mc
    DDP's distributed optimizer at TP=1 × DP=4 and back: every step's loss within 1e-6
    relative of the uninterrupted FSDP2 run. The control, the same resume with the model
    only (a fresh AdamW from step 3), moves a loss by over 100× the bound."""
    _check_resumes(rank_pools.get(4).run(_resume_across_layouts, str(tmp_path))[0])
