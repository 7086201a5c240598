"""Expert parallelism inside pipeline stages, against one process.

``examples/hf_moe.py``'s ``transformers`` Mixtral (2 layers, 4 experts of width 32, top-2)
cut into 2 pipeline stages by ``mc_train.split_model`` (one MoE layer each), each rank's
stage converted by ``mc_moe.parallelize`` with the stage's entries of the model's own
``tp_plan`` and ``ep_plan`` (experts over ``ep``, 2 whole experts per rank) and trained
by ``mc_train.build_pipeline`` (mc DDP, the expert params in their own buffers reduced
over ``expt_dp``, 1F1B over 2 micro-batches, ``finalize_model_grads``), the whole model's
grad norm clipped by ``ShardedOptimizer(max_grad_norm=...)`` (mc DDP's grads live in
``main_grad``: ``mc_ddp.clip_grad_norm`` refuses them and names this route), SGD with
momentum. One world of 8 gloo ranks, two layouts:

- PP=2 × EP=2 × DP=4 (TP 1): per stage, ``dp`` holds 4 ranks and ``expt_dp`` 2 (the
  ranks of the same EP coordinate), so a dense grad and an expert grad are reduced over
  different groups; the expert grad is Σ over expt_dp ÷ |dp| (each EP rank's experts saw
  the tokens of both ranks of its ep group).
- PP=2 × TP=2 with sequence parallelism × EP=2 (expert TP 1) × DP=2, the distributed
  optimizer: each TP rank routes its half of the sequence, the stages exchange ``[b, s/2,
  h]``; grads reduce-scattered over dp and expt_dp.
- DeepSeek-V3 (MLA attention, a shared expert, grouped top-k routing) at PP=2 × EP=2 ×
  DP=4 with Megatron's aux-loss-free expert bias: ``finalize_model_grads`` moves each
  stage's routers' ``e_score_correction_bias`` from the tokens per expert summed over
  that stage's ``tp_dp_cp`` (the reference moves it from the whole batch's counts).
- PP=2 × EP=2 × DP=4 with 2 virtual stages per rank: a 4-layer Mixtral in 4 stages (one
  MoE layer each), the interleaved schedule, two chunks per rank whose all-to-alls
  interleave (8 per micro-batch).
- PP=2 × TP=2 (SP) × expert TP 2 × EP=2 × DP=2: each expert split over its expert-TP
  pair, ``expt_dp`` one rank (nothing to reduce the experts over; the ``÷ |dp|`` still
  applies).

Against ``examples.hf_moe.reference("mixtral", 3, aux=False)`` (one process, plain
PyTorch: the mean cross entropy of the whole global batch, SGD with momentum,
``clip_grad_norm_`` at 1.0; no load-balancing loss: a pipeline stage does not compute the
model's loss, ``mc_moe.parallelize`` leaves it off under PP): every step's loss (the same
on every rank) within 1e-5 relative, the grad norm before clipping within 1e-5 relative
(above 1.0 at every step, so the clip acts), every rank's final weights of its stage
(``mc_moe.full_state_dict``: whole experts, one-process names) within 1e-6.

The collectives of step 2 (``mc_groups.record_collectives``), per rank: the grad
reductions (label ``grad reduce``) are exactly one pass over this rank's expert grads on
its ``expt_dp`` group and one over its dense grads on its ``dp`` group (elements counted
from the params; under the distributed optimizer the buffers' padded sizes), SUM (the
``÷ |dp|`` is applied before: Megatron's ``gradient_scaling_factor``); every all-to-all
is on this rank's ``ep`` group, 4 per micro-batch (dispatch and combine, forward and
backward, one MoE layer per stage).

The same under FSDP2 (torchtitan's DeepSeek-V3 layout, PP × FSDP2 × EP): each stage in
``mc_ddp.TorchFullyShardedDataParallel`` through ``build_pipeline``, clipped by
``mc_ddp.clip_grad_norm``, with expert TP 1 and 2
(``test_expert_parallel_pipeline_stages_under_fsdp2_match_one_process``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from integration_tests._common import counting_dist
from mc_groups.testing import RankPools

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS, MICROBATCHES, WORLD, RECORDED = 3, 2, 8, 1
# (tensor-parallel size with SP, distributed optimizer, expert tensor-parallel size, model,
# virtual stages per pipeline rank: 2 runs the interleaved schedule over a 4-layer model)
CASES = [
    (1, False, 1, "mixtral", 1),
    (2, True, 1, "mixtral", 1),
    (2, False, 2, "mixtral", 1),
    (1, False, 1, "deepseek_v3", 1),
    (1, False, 1, "mixtral", 2),
]
MODELS = sorted({(kind, 2 * vp) for *_, kind, vp in CASES})  # (model, decoder layers)


def _stages(
    tp: int, etp: int, kind: str = "mixtral", vp: int = 1
) -> tuple[Any, Any, list[torch.nn.Module]]:
    """The groups, config and this rank's chunks of the ``kind`` model at PP 2 × TP ``tp``
    (SP when 2) × EP 2 × expert TP ``etp``: split into 2 stages, each converted by
    ``mc_moe.parallelize`` with the entries of both plans its modules match; DeepSeek-V3
    with Megatron's expert bias (``moe_router_enable_expert_bias``, the example's rate)."""
    import mc_groups as mg
    import mc_moe
    import mc_train
    from examples.hf_moe import RATE, build_model

    sizes: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": etp,
    }
    pgc = mg.initialize_model_parallel(**sizes)
    cfg = mg.ModelParallelConfig(
        **sizes,
        sequence_parallel=tp > 1,
        moe_router_enable_expert_bias=kind == "deepseek_v3",
        moe_router_bias_update_rate=RATE,
    )
    model = build_model(kind, layers=2 * vp)  # one decoder layer per (virtual) stage
    plan = mc_moe.sequence_parallel_plan(model) if tp > 1 else model.tp_plan
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, 2 * vp), pgc)
    for chunk in chunks:
        mc_moe.parallelize(
            chunk,
            mc_train.stage_plan(plan, chunk),
            ep_plan=mc_train.stage_plan(model.ep_plan, chunk),
            config=cfg,
            pg_collection=pgc,
        )
    return pgc, cfg, list(chunks)


def _train(tp: int, distributed: bool, etp: int, kind: str, vp: int) -> dict[str, Any]:
    """One layout (module notes) on every rank of the world: this rank's losses, grad
    norms, stage weights, group members, param sizes and the collectives of one step."""
    import mc_groups as mg
    import mc_moe
    import mc_train
    from examples.hf_moe import BATCH, CLIP, LR, MOMENTUM, global_batch
    from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer, ensure_params_ready
    from mc_moe.state import expert_params

    pgc, cfg, chunks = _stages(tp, etp, kind, vp)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=distributed
    )
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=ddp_config,
        pg_collection=pgc,
        microbatches=MICROBATCHES,
        loss_fn=mc_train.token_cross_entropy(),
        schedule="interleaved" if vp > 1 else "1f1b",
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=tp),
    )
    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    opt = ShardedOptimizer(sgd, pipe.chunks, max_grad_norm=CLIP, pg_collection=pgc)
    dp = pgc.require("dp", "test")
    rows = BATCH // mg.group_size(dp)
    losses, norms, records = [], [], []
    for step in range(STEPS):
        ids = global_batch(step)[mg.group_rank(dp) * rows : (mg.group_rank(dp) + 1) * rows]
        with mg.record_collectives() as log:
            losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
            norms.append(opt.step().grad_norm)
        if step == RECORDED:
            records = [(r.op, r.group_ranks, r.numel, r.reduce_op, r.label) for r in log]
    ensure_params_ready(pipe.parameters())  # the last step's param all-gather
    weights = {n: w for c in pipe.chunks for n, w in mc_moe.full_state_dict(c.module, pgc).items()}
    experts = {id(p) for c in pipe.chunks for _, p, _ in expert_params(c.module)}
    local = [p for c in pipe.chunks for p in c.module.parameters()]
    buffers = {
        "expert": [b for c in pipe.chunks for b in c.expert_parallel_buffers],
        "dense": [b for c in pipe.chunks for b in c.buffers],
    }
    out = {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "records": records,
        "groups": {n: mg.group_ranks(pgc.require(n, "test")) for n in ("dp", "expt_dp", "ep")},
        "numel": {
            "expert": sum(p.numel() for p in local if id(p) in experts),
            "dense": sum(p.numel() for p in local if id(p) not in experts),
        },
        "padded": {k: sum(b.grad_data.numel() for b in v) for k, v in buffers.items()},
    }
    mg.destroy_model_parallel(pgc)
    return out


def _grid(cases: list[tuple[int, bool, int, str, int]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_train(*case) for case in cases]


def _grad_reductions(out: dict[str, Any], distributed: bool) -> Iterator[str]:
    """What is wrong with one rank's grad reductions of the recorded step (nothing: empty)."""
    groups, numel = out["groups"], out["padded" if distributed else "numel"]
    reduced: dict[tuple[int, ...], int] = {}
    for op, ranks, count, reduce_op, label in out["records"]:
        if label.startswith("grad reduce"):
            kind = "reduce_scatter" if distributed else "all_reduce"
            if (op, reduce_op) != (kind, "sum"):
                yield f"{label}: {op} {reduce_op}, expected {kind} sum"
            reduced[ranks] = reduced.get(ranks, 0) + count
    # a one-rank expt_dp (expert TP 2 × EP 2 × PP 2 on 8 ranks) reduces nothing
    want = {groups["expt_dp"]: numel["expert"]} if len(groups["expt_dp"]) > 1 else {}
    want[groups["dp"]] = want.get(groups["dp"], 0) + numel["dense"]  # TP 2: the same ranks
    if reduced != want:
        yield f"grad reductions {reduced}, expected {want} (expt_dp: experts, dp: dense)"


def _compare(run: dict[str, Any], ref: Any, where: str, worst: dict[str, float]) -> None:
    """One rank's grad norms and losses (within 1e-5 relative) and stage weights (within
    1e-6) against the one-process run ``ref``; the largest differences kept in ``worst``."""
    for key, want in (("norms", ref.grad_norms), ("losses", ref.losses)):
        got = run[key]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
        assert rel <= 1e-5, (where, key, got, want)
        worst[key] = max(worst[key], rel)
    for name, value in run["weights"].items():
        diff = float((value - ref.weights[name]).abs().max())
        assert diff <= 1e-6, (where, name, diff)
        worst["weights"] = max(worst["weights"], diff)


@pytest.mark.timeout(240)
def test_expert_parallel_pipeline_stages_match_one_process(rank_pools: RankPools) -> None:
    """PP=2 × EP=2 × DP=4, PP=2 × TP=2 (SP) × EP=2 × DP=2, the same with expert TP 2,
    DeepSeek-V3 with Megatron's expert bias at PP=2 × EP=2 × DP=4, and the interleaved
    schedule over 2 virtual stages per rank, on 8 ranks (module notes):
    losses, grad norms and weights against one process; one step's grad reductions (experts
    over expt_dp, dense over dp, each element once) and all-to-alls (ep) counted."""
    from examples.hf_moe import CLIP, build_model, reference

    outcomes = rank_pools.get(WORLD).run_with_deadline(200.0, _grid, CASES)
    refs = {
        (kind, layers): reference(
            kind, STEPS, aux=False, expert_bias=kind == "deepseek_v3", layers=layers
        )
        for kind, layers in MODELS
    }
    for ref in refs.values():
        assert min(ref.grad_norms) > CLIP, ref.grad_norms  # the clip acts at every step
    start = build_model("mixtral").state_dict()
    moved = refs["mixtral", 2].weights
    assert all(float((moved[k] - v).abs().max()) > 1e-4 for k, v in start.items())
    for index, (tp, distributed, etp, kind, vp) in enumerate(CASES):
        ref = refs[kind, 2 * vp]
        worst = {"losses": 0.0, "norms": 0.0, "weights": 0.0}
        stages: dict[str, torch.Tensor] = {}
        for rank, outcome in enumerate(outcomes):
            run, where = outcome[index], f"{kind} TP={tp} expert TP={etp} VP={vp} rank {rank}"
            groups = run["groups"]
            if tp == 1:  # the layout where the two reductions differ
                assert (len(groups["dp"]), len(groups["expt_dp"])) == (4, 2), groups
            problems = list(_grad_reductions(run, distributed))
            assert not problems, (where, problems)
            a2a = [r[1] for r in run["records"] if r[0] == "all_to_all"]
            assert a2a == [groups["ep"]] * (4 * MICROBATCHES * vp), (where, a2a)
            _compare(run, ref, where, worst)
            stages.update(run["weights"])
        assert sorted(stages) == sorted(ref.weights), tp  # the two stages hold every weight
        print(
            f"{kind} PP=2 x VP={vp} x TP={tp} x expert TP={etp} x EP=2: loss rel "
            f"{worst['losses']:.1e}, "
            f"grad norm rel {worst['norms']:.1e}, weights {worst['weights']:.1e}"
        )


def _interleaved(folder: str, steps: int, *, save: bool = False) -> list[float]:
    """A 4-layer Mixtral at PP 2 × 2 virtual stages × EP 2 × DP (the world's rest), the
    interleaved schedule, mc DDP with the distributed optimizer, clipped SGD with momentum:
    resumed from the newest checkpoint in ``folder`` when there is one, trained to
    ``steps``, then saved there when ``save``. Every step's loss (the saved ones first)."""
    import mc_groups as mg
    import mc_train
    from examples.hf_moe import BATCH, CLIP, LR, MOMENTUM, global_batch
    from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer
    from mc_train.checkpoint import Checkpointer

    pgc, cfg, chunks = _stages(1, 1, "mixtral", vp=2)
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        pg_collection=pgc,
        microbatches=MICROBATCHES,
        loss_fn=mc_train.token_cross_entropy(),
        schedule="interleaved",
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=1),
    )
    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    opt = ShardedOptimizer(sgd, pipe.chunks, max_grad_norm=CLIP, pg_collection=pgc)
    ckpt = Checkpointer(folder, pipe.chunks, opt, pg_collection=pgc)
    losses = list(ckpt.load("auto").state.get("losses", []))
    dp = pgc.require("dp", "test")
    rows = BATCH // mg.group_size(dp)
    for step in range(len(losses), steps):
        ids = global_batch(step)[mg.group_rank(dp) * rows : (mg.group_rank(dp) + 1) * rows]
        losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
        opt.step()
    if save:
        ckpt.save(steps, state={"losses": losses}, last=True)
    mg.destroy_model_parallel(pgc)
    return losses


def _interleaved_resumes(folder: str) -> dict[str, list[float]]:
    """2 interleaved steps saved and resumed by ``examples.hf_moe.train`` at PP 1 × EP 4
    (one mc DDP, the distributed optimizer) for steps 3-4; and 2 steps of that saved and
    resumed by the interleaved stages."""
    from examples.hf_moe import Layout, train

    torch.set_num_threads(1)
    ep4 = Layout(ep=4, distributed_optimizer=True)
    _interleaved(f"{folder}/vpp", 2, save=True)
    out = {
        "vpp -> ep4": train("mixtral", ep4, steps=4, resume=f"{folder}/vpp", aux=False, layers=4)
    }
    train("mixtral", ep4, steps=2, save_dir=f"{folder}/ep4", aux=False, layers=4)
    return {"vpp -> ep4": out["vpp -> ep4"].losses, "ep4 -> vpp": _interleaved(f"{folder}/ep4", 4)}


@pytest.mark.timeout(180)
def test_interleaved_expert_stages_resume_at_another_layout(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    """``mc_train.Checkpointer`` over 2 virtual stages per pipeline rank with experts: a
    checkpoint of the interleaved PP 2 × EP 2 stages (4 chunks, one MoE layer each, 2
    experts per rank) resumed as one model at EP 4 (one expert per rank), and the reverse,
    on 4 ranks: every step's loss (the last stage's; rank 3) within 1e-5 relative of one
    process's 4 steps (``examples.hf_moe.reference``, no load-balancing loss: a pipeline
    stage does not compute it)."""
    from examples.hf_moe import reference

    runs = rank_pools.get(4).run_with_deadline(160.0, _interleaved_resumes, str(tmp_path))[3]
    ref = reference("mixtral", 4, aux=False, layers=4).losses
    for name, losses in runs.items():
        rel = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
        print(f"{name}: loss rel {rel:.1e}")
        assert rel <= 1e-5, (name, losses, ref)


FSDP2_CASES = [(1, 1), (2, 2)]  # (tensor-parallel size with SP, expert tensor-parallel size)


def _train_fsdp2(tp: int, etp: int) -> dict[str, Any]:
    """One layout under FSDP2 (``test_expert_parallel_pipeline_stages_under_fsdp2``'s
    notes) on every rank: losses, grad norms, stage weights, groups, the local param sizes
    of each kind and FSDP2's reduce-scatters of the last step."""
    import mc_groups as mg
    import mc_moe
    import mc_train
    from examples.hf_moe import BATCH, CLIP, LR, MOMENTUM, global_batch
    from mc_ddp import TorchFullyShardedDataParallelConfig, clip_grad_norm
    from mc_moe.state import expert_params

    pgc, cfg, chunks = _stages(tp, etp)
    experts = {id(p) for c in chunks for _, p, _ in expert_params(c)}
    shapes = {  # this rank's TP / EP-local param shapes, before FSDP2 shards them
        kind: [tuple(p.shape) for c in chunks for p in c.parameters() if (id(p) in experts) == e]
        for kind, e in (("expert", True), ("dense", False))
    }
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=True),
        pg_collection=pgc,
        microbatches=MICROBATCHES,
        loss_fn=mc_train.token_cross_entropy(),
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=tp),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    dp = pgc.require("dp", "test")
    rows = BATCH // mg.group_size(dp)
    losses, norms = [], []
    for step in range(STEPS):
        ids = global_batch(step)[mg.group_rank(dp) * rows : (mg.group_rank(dp) + 1) * rows]
        opt.zero_grad()
        with counting_dist(("reduce_scatter_single",)) as fsdp:
            losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
        norms.append(clip_grad_norm(pipe.chunks, CLIP, pg_collection=pgc).grad_norm or 0.0)
        opt.step()
    out = {
        "losses": losses,
        "norms": norms,
        "weights": {n: w for c in chunks for n, w in mc_moe.full_state_dict(c, pgc).items()},
        "scatters": [(group, numel) for _, group, numel, _ in fsdp],
        "groups": {n: mg.group_ranks(pgc.require(n, "test")) for n in ("dp", "expt_dp")},
        "stage": mg.group_rank(pgc.require("pp", "test")),
        "shapes": shapes,
    }
    mg.destroy_model_parallel(pgc)
    return out


def _grid_fsdp2(cases: list[tuple[int, int]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_train_fsdp2(tp, etp) for tp, etp in cases]


def _shard_numel(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """This rank's share of ``shapes`` under FSDP2 over ``ranks``: each param's dim 0
    padded up to a multiple of ``ranks``, split in ``ranks`` (``Shard(0)``)."""
    total = 0
    for shape in shapes:
        rest = 1
        for size in shape[1:]:
            rest *= size
        total += -(-shape[0] // ranks) * rest
    return total


@pytest.mark.timeout(240)
def test_expert_parallel_pipeline_stages_under_fsdp2_match_one_process(
    rank_pools: RankPools,
) -> None:
    """torchtitan's DeepSeek-V3 layout (PP × FSDP2 × EP): the Mixtral of the module notes
    in 2 pipeline stages, each chunk converted at EP=2 and put under
    ``mc_ddp.TorchFullyShardedDataParallel`` by ``build_pipeline`` (a
    ``TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=True)``), 1F1B over
    2 micro-batches, ``mc_ddp.clip_grad_norm`` at 1.0, SGD with momentum (torch.optim), 3
    steps on 8 ranks, two layouts:

    - PP=2 × EP=2 × DP=4 (TP 1, expert TP 1): FSDP2 shards the dense params over ``dp``
      (4 ranks) and the experts over ``expt_dp`` (2);
    - PP=2 × TP=2 (SP) × expert TP 2 × EP=2 × DP=2: dense over ``dp`` (2), each expert's
      TP half over ``expt_dp`` (1 rank: 4 / (expert TP 2 × EP 2); FSDP2 reduces nothing
      there, and the wrapper must still divide the expert grads by |dp| once, not twice).

    Against ``examples.hf_moe.reference("mixtral", 3, aux=False)``: losses and grad norms
    before clipping within 1e-5 relative, every rank's final whole weights of its stage
    (``mc_moe.full_state_dict``) within 1e-6. FSDP2's reduce-scatters of the last step
    (``dist.reduce_scatter_single``, which bypasses mc's recorder), per rank, only in the
    chunk's last backward (the others run under ``no_sync``): one over ``expt_dp`` for the
    stage's MoE layer's experts (none when ``expt_dp`` is one rank) and over ``dp`` one per
    dense FSDP2 unit (first stage: the layer and the embedding, 2; last stage: the head, the
    layer and the root's final norm, 3), their output elements on each group this rank's
    shard of the params of that kind (each param's dim 0 padded to the group size)."""
    from examples.hf_moe import CLIP, reference

    outcomes = rank_pools.get(WORLD).run_with_deadline(200.0, _grid_fsdp2, FSDP2_CASES)
    ref = reference("mixtral", STEPS, aux=False)
    assert min(ref.grad_norms) > CLIP, ref.grad_norms
    for index, (tp, etp) in enumerate(FSDP2_CASES):
        worst = {"losses": 0.0, "norms": 0.0, "weights": 0.0}
        stages: dict[str, torch.Tensor] = {}
        for rank, outcome in enumerate(outcomes):
            run, where = outcome[index], f"TP={tp} expert TP={etp} rank {rank}"
            groups, shapes = run["groups"], run["shapes"]
            # FSDP2 units: the layer's experts, the layer's dense params, the embedding
            # (first stage) or the head and the root's final norm (last stage)
            units = {"expert": 1, "dense": 2 + run["stage"]}
            want: Counter[tuple[int, ...]] = Counter()
            numel: Counter[tuple[int, ...]] = Counter()
            for group, kind in ((groups["expt_dp"], "expert"), (groups["dp"], "dense")):
                if len(group) > 1:  # FSDP2 reduces nothing over one rank
                    want[group] += units[kind]
                    numel[group] += _shard_numel(shapes[kind], len(group))
            got = Counter(group for group, _ in run["scatters"])
            assert got == want, (where, "reduce-scatters (expt_dp: experts, dp: dense)", got)
            got_numel: Counter[tuple[int, ...]] = Counter()
            for group, count in run["scatters"]:
                got_numel[group] += count
            assert got_numel == numel, (where, "reduce-scattered elements", got_numel, numel)
            if tp == 1:
                assert (len(groups["dp"]), len(groups["expt_dp"])) == (4, 2), groups
            _compare(run, ref, where, worst)
            stages.update(run["weights"])
        assert sorted(stages) == sorted(ref.weights), (tp, etp)
        print(
            f"FSDP2 PP=2 x TP={tp} x expert TP={etp} x EP=2: loss rel {worst['losses']:.1e}, "
            f"grad norm rel {worst['norms']:.1e}, weights {worst['weights']:.1e}"
        )
