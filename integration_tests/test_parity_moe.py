"""``transformers`` mixture-of-experts models split by ``mc_moe.parallelize`` and trained with
mc DDP, ``finalize_model_grads`` and SGD, against the same model trained by plain PyTorch on
one process over the same global batch (``examples/hf_moe.py``).

Tiny Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 and gpt-oss (hidden 64, 2 layers, 4 experts of
width 32, top-2), each converted by its own ``tp_plan`` and ``ep_plan``: experts split over
``ep`` (whole experts per rank), tokens dispatched by all-to-all and combined with their
routing weights (``mc_moe.dispatcher``), the expert weights tagged ``allreduce=False`` so
mc DDP reduces them over ``expt_dp``. Localizes: the dispatch (a token sent to the wrong
rank, a lost routing weight, a combine out of order), the expert split (wrong experts kept),
the tag (an expert grad averaged over ranks that hold other experts), the backward of both
exchanges.

Layouts, every model in each it accepts: EP = 2 on 2 ranks (expt_dp of one rank); on 4
ranks EP = 2 × DP = 2 (expert grads summed over expt_dp of 2 and scaled by 1/|dp|, dense
over dp; Mixtral with the distributed optimizer), TP = 2 × EP = 2 with sequence parallelism
(``mc_moe.sequence_parallel_plan``: each TP rank routes its part of the sequence, the
router's grads summed over TP; DeepSeek-V3's latent attention split by heads, its shared
experts gathered) with expert TP 1 and with expert TP 2 (experts split over expt_tp, their
tokens all-gathered and reduce-scattered there) and the distributed optimizer; gpt-oss,
refused at TP > 1, at EP = 2 × expert TP = 2 (interleaved gate/up split by pairs, the down
bias added once). With every decoder layer's activations recomputed in backward
(``transformers``' ``activation_checkpointing_enable``, non-reentrant: each layer's
dispatch runs again, its all-to-alls included), Mixtral (global aux loss, distributed
optimizer) and DeepSeek-V3 (expert bias) at EP = 2 × DP = 2: the same parity, and the
recorded collectives are the run without recomputation plus, per step and MoE layer, the
forward's counts all-gather and two all-to-alls again (``_check_recompute``).

The models' own load-balancing loss is on (``output_router_logits=True``: Mixtral,
Qwen3-MoE, OLMoE, gpt-oss), computed by mc on the global batch (``mc_moe.router``): with
each rank's own, EP = 2 × DP = 2 already differs from one process by about 1e-4 relative.
DeepSeek-V3 trains with ``moe_router_enable_expert_bias`` (rate 0.01): its routers'
``e_score_correction_bias``, updated by ``finalize_model_grads`` from the routed tokens of
the global batch, must equal the one-process application of Megatron's rule
``bias += rate · sign(mean − tokens)`` after every step (it is in the compared state dict;
it moves by 0.01 per step).

Tolerances (fp32, gloo): loss per step ≤ 1e-5 relative, final weights ≤ 1e-6 absolute.
Measured here: loss ≤ 1.2e-7 relative, weights ≤ 1.7e-7 in every case.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import cache
from typing import Any

import pytest
import torch

from examples.hf_moe import Layout, Run
from examples.hf_moe import reference as _reference
from mc_groups.testing import RankPools
from mc_train.checkpoint import Checkpointer

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS = 3
SAVED = 1  # the pipeline run's checkpoint: after this many steps
BIASED = ("deepseek_v3",)  # trained with Megatron's aux-loss-free expert bias
KINDS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
CASES_2 = [(kind, Layout(ep=2)) for kind in KINDS]  # EP = 2, expt_dp of one rank
TP_KINDS = KINDS[:4]  # gpt-oss is refused at TP > 1 (its attention's per-head sinks)
CASES_4 = [
    *((kind, Layout(ep=2, distributed_optimizer=kind == "mixtral")) for kind in KINDS),
    *((kind, Layout(tp=2, ep=2, etp=1)) for kind in TP_KINDS),  # TP x EP, SP
    *((kind, Layout(tp=2, ep=2, etp=2, distributed_optimizer=True)) for kind in TP_KINDS),
    ("gpt_oss", Layout(ep=2, etp=2)),  # EP x expert TP: interleaved gate/up, the down bias
    # every decoder layer recomputed in backward (transformers' activation checkpointing):
    # the aux loss of the global batch (Mixtral), the expert bias's counts (DeepSeek-V3)
    ("mixtral", Layout(ep=2, distributed_optimizer=True, recompute=True)),
    ("deepseek_v3", Layout(ep=2, recompute=True)),
]

reference = cache(_reference)  # each model's one-process run once


Collectives = Counter[tuple[Any, ...]]  # (op, group ranks, elements, label) → how many


def _train_cases(cases: list[tuple[str, Layout]]) -> list[tuple[Run, Collectives]] | None:
    """Each case trained on every rank; rank 0's runs and the collectives it recorded."""
    import torch.distributed as dist

    import mc_groups as mg
    from examples.hf_moe import train

    torch.set_num_threads(1)
    runs = []
    for kind, layout in cases:
        with mg.record_collectives() as log:
            run = train(kind, layout, steps=STEPS, expert_bias=kind in BIASED)
        runs.append((run, Counter((r.op, r.group_ranks, r.numel, r.label) for r in log)))
    return runs if dist.get_rank() == 0 else None


def _check_recompute(
    recomputed: Collectives, plain: Collectives, case: tuple[str, Layout], layers: int = 2
) -> None:
    """A run whose decoder layers are recomputed issues every collective of the same run
    without recomputation, and in each step's backward the forward's dispatch again: per
    MoE layer one all-gather of the token counts and two all-to-alls (dispatch, combine),
    each with the forward's groups and sizes; nothing else (the aux loss's all-reduce and
    the router steps are the model's, outside the layers, once a step)."""
    assert not plain - recomputed, (case, plain - recomputed)
    extra = recomputed - plain
    per_step = Counter(
        {("all_gather", "moe token counts"): layers, ("all_to_all", "tp all-to-all"): 2 * layers}
    )
    kinds: Counter[tuple[str, str]] = Counter()
    for (op, _, _, label), n in extra.items():
        kinds[op, label] += n
    assert kinds == Counter({key: n * STEPS for key, n in per_step.items()}), (case, extra)
    assert all(plain[key] >= n for key, n in extra.items()), (case, extra)  # the forward's


def _check(run: Run, case: tuple[str, Layout]) -> None:
    ref = reference(case[0], STEPS, expert_bias=case[0] in BIASED)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert rel <= 1e-5, (case, run.losses, ref.losses)
    assert sorted(run.weights) == sorted(ref.weights)
    worst = 0.0
    for key, value in ref.weights.items():
        assert run.weights[key].shape == value.shape, (case, key)
        diff = float((run.weights[key] - value).abs().max())
        assert diff <= 1e-6, (case, key, diff)
        worst = max(worst, diff)
    print(f"{case}: loss rel {rel:.1e}, weights {worst:.1e}")


@pytest.mark.timeout(300)
def test_moe_models_match_one_process(rank_pools: RankPools) -> None:
    for cases, world in ((CASES_2, 2), (CASES_4, 4)):
        runs = rank_pools.get(world).run(_train_cases, cases)[0]
        assert runs is not None
        for (run, _), case in zip(runs, cases, strict=True):
            _check(run, case)
        logs = dict(zip(cases, (log for _, log in runs), strict=True))
        for (kind, layout), log in logs.items():
            if layout.recompute:
                plain = logs[kind, dataclasses.replace(layout, recompute=False)]
                _check_recompute(log, plain, (kind, layout))


def _schedule() -> dict[str, Any]:
    """Mixtral at EP = 2 × DP = 2 (aux loss on): the collectives of its second training
    step (forward, backward, finalize) as this rank records them, with the sizes to check
    them against; then the untagged-expert refusal."""
    import torch.distributed as dist

    import mc_groups as mg
    import mc_moe
    from examples.hf_moe import build_model, global_batch
    from mc_ddp import DataParallelAgreementError, DistributedDataParallel
    from mc_ddp import DistributedDataParallelConfig as DDPConfig
    from mc_finalize import finalize_model_grads
    from mc_moe.state import expert_params

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(expert_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(expert_model_parallel_size=2)
    model = build_model("mixtral")
    mc_moe.parallelize(model, model.tp_plan, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
    ddp = DistributedDataParallel(
        cfg, DDPConfig(overlap_grad_reduce=True), model, pg_collection=pgc
    )
    dp = pgc.require("dp", "test")
    ids = global_batch(0)[2 * dp.rank() : 2 * dp.rank() + 2]  # this DP rank's 2 sequences
    records = []
    for step in range(2):
        ddp.zero_grad_buffer()
        with mg.record_collectives() as log:
            ddp(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
            finalize_model_grads([ddp], pg_collection=pgc)
        records = [(r.op, r.group_ranks, r.dtype, r.bytes, r.label) for r in log]
        del step
    experts = sum(p.numel() for _, p, _ in expert_params(model))
    dense = sum(p.numel() for p in model.parameters()) - experts
    ranks = {n: mg.group_ranks(pgc.require(n, "test")) for n in ("ep", "dp", "expt_dp", "tp_ep")}
    ranks["tp_dp_cp"] = mg.group_ranks(pgc.require("tp_dp_cp", "test"))
    # one piece and back: a fresh model takes this one's full state dict, its experts cut
    state = mc_moe.full_state_dict(model, pgc)
    fresh = build_model("mixtral", seed=5)
    mc_moe.parallelize(fresh, fresh.tp_plan, ep_plan=fresh.ep_plan, config=cfg, pg_collection=pgc)
    mc_moe.load_full_state_dict(fresh, state, pgc)
    again = mc_moe.full_state_dict(fresh, pgc)
    first = 2 * mg.group_rank(pgc.require("ep", "test"))  # this rank's 2 of the 4 experts
    round_trip = sorted(again) == sorted(state) and all(
        torch.equal(again[key], state[key]) for key in state
    )
    cut = all(
        torch.equal(param, state[key][first : first + 2]) for key, param, _ in expert_params(fresh)
    )
    # an expert shard tagged dense (allreduce=True) is refused by DDP's build, by name
    other = build_model("mixtral")
    mc_moe.parallelize(other, other.tp_plan, ep_plan=other.ep_plan, config=cfg, pg_collection=pgc)
    untagged = other.get_parameter("model.layers.1.mlp.experts.down_proj")
    mg.param_attrs.mark_allreduce(untagged, True)
    try:
        DistributedDataParallel(cfg, DDPConfig(), other, pg_collection=pgc)
        refused = ""
    except DataParallelAgreementError as err:
        refused = str(err)
    mg.destroy_model_parallel(pgc)
    return {
        "records": records,
        "ranks": ranks,
        "tokens": int(ids.numel()),
        "experts": experts,
        "dense": dense,
        "refused": refused,
        "round_trip": round_trip and cut,
        "rank": dist.get_rank(),
    }


@pytest.mark.timeout(180)
def test_one_step_collectives(rank_pools: RankPools) -> None:
    """One step's collectives, counted by hand: per MoE layer (2) one all-gather of E = 4
    int64 token counts over tp_ep (= ep here), and on ep four all-to-alls: forward the
    dispatch of this rank's T·k routed rows (T = 32 tokens, k = 2) and the combine of the
    rows it received, backward the same two the other way; the routed rows × H = 64 × 4
    bytes, every row sent and received once over the group. One all-reduce of 2E + 1 floats
    over tp_dp_cp (the global aux loss). DDP: every expert param's grad over expt_dp, every
    dense one over dp, each element once. Nothing else."""
    outcomes = rank_pools.get(4).run(_schedule)
    h, k, e, layers = 64, 2, 4, 2
    sent: dict[tuple[int, ...], int] = {}
    for out in outcomes:
        ranks, records, rows = out["ranks"], out["records"], out["tokens"] * k
        a2a = [(g, b) for op, g, _, b, _ in records if op == "all_to_all"]
        assert len(a2a) == 4 * layers
        assert {g for g, _ in a2a} == {ranks["ep"]}
        forward = [b for _, b in a2a[: 2 * layers]]
        assert forward[0::2] == [rows * h * 4] * layers  # each layer's dispatch
        assert sorted(b for _, b in a2a[2 * layers :]) == sorted(forward)  # the reverse
        sent[ranks["ep"]] = sent.get(ranks["ep"], 0) + sum(forward[1::2]) - rows * h * 4 * layers
        counts = [r[:4] for r in records if r[0] == "all_gather"]
        assert counts == [("all_gather", ranks["tp_ep"], torch.int64, e * 8)] * layers
        aux = [r[:4] for r in records if r[4] == "moe aux loss statistics"]
        assert aux == [("all_reduce", ranks["tp_dp_cp"], torch.float32, (2 * e + 1) * 4)]
        grads = [r for r in records if r[0] == "all_reduce" and r[4] != "moe aux loss statistics"]
        by_group: dict[tuple[int, ...], int] = {}
        for _, group, _, size, _ in grads:
            by_group[group] = by_group.get(group, 0) + size
        assert by_group == {ranks["expt_dp"]: out["experts"] * 4, ranks["dp"]: out["dense"] * 4}
        assert len(records) == len(a2a) + len(counts) + len(aux) + len(grads)
        assert "model.layers.1.mlp.experts.down_proj" in out["refused"]
        assert out["round_trip"]  # load_full_state_dict then full_state_dict: the same dict
    # the combine sends back, over each ep group, exactly the rows its dispatch sent
    assert set(sent.values()) == {0}


def _pipeline(folder: str) -> dict[str, Any] | None:
    """Mixtral (2 layers) at PP = 2 × EP = 2 through ``mc_train``: split into stages, each
    stage's experts split over ep by ``mc_moe.parallelize`` with the stage's entries of the
    model's plans, each stage's decoder layer recomputed in backward (``transformers``'
    activation checkpointing), 1F1B over 4 micro-batches of one sequence per DP rank, SGD
    with momentum and the grad norm clipped (over both stages), 3 steps (the last one's
    all-to-alls counted); after step 1 a checkpoint in
    ``folder`` (``mc_train.Checkpointer``), which :func:`_resumed` continues at another
    layout."""
    import torch.distributed as dist

    import mc_groups as mg
    import mc_moe
    import mc_train
    from examples.hf_moe import CLIP, LR, MOMENTUM, build_model, global_batch
    from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer, ensure_params_ready

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    model = build_model("mixtral")
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, 2), pgc)
    for chunk in chunks:
        mc_moe.parallelize(
            chunk,
            mc_train.stage_plan(model.tp_plan, chunk),
            ep_plan=mc_train.stage_plan(model.ep_plan, chunk),
            config=cfg,
            pg_collection=pgc,
        )
        stage: Any = chunk  # a copy of the transformers model, cut to the stage's modules
        stage.activation_checkpointing_enable()
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True),
        pg_collection=pgc,
        microbatches=4,
        loss_fn=mc_train.token_cross_entropy(),
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=1),
    )
    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    opt = ShardedOptimizer(sgd, pipe.chunks, max_grad_norm=CLIP, pg_collection=pgc)
    dp = pgc.require("dp", "data")
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[4 * dp.rank() : 4 * dp.rank() + 4]
        with mg.record_collectives() as log:
            losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
        opt.step()
        if step == SAVED - 1:
            ckpt = Checkpointer(folder, pipe.chunks, opt, pg_collection=pgc)
            ckpt.save(SAVED, state={"losses": losses}, last=True)
    ensure_params_ready(pipe.parameters())
    weights = {n: w for c in pipe.chunks for n, w in mc_moe.full_state_dict(c.module, pgc).items()}
    mg.destroy_model_parallel(pgc)
    resumed = _resumed(folder)
    if dist.get_rank() not in (0, 2):
        return None
    exchanges = sum(r.op == "all_to_all" for r in log)
    return {"losses": losses, "weights": weights, "resumed": resumed, "all_to_alls": exchanges}


def _resumed(folder: str) -> dict[str, Any]:
    """The checkpoint :func:`_pipeline` wrote at PP = 2 × EP = 2 × DP = 2 (2 experts per
    rank, stage by stage) resumed by ``examples.hf_moe.train`` at PP = 1 × EP = 4 × DP = 4
    (one expert per rank, the whole model in one mc DDP, the distributed optimizer), the
    remaining steps with ``transformers``' loss on this rank's rows: the losses (the saved
    history first), the whole weights and the collectives of the run."""
    import mc_groups as mg
    from examples.hf_moe import train

    layout = Layout(ep=4, distributed_optimizer=True)
    with mg.record_collectives() as log:
        run = train("mixtral", layout, steps=STEPS, resume=folder, aux=False)
    records = [(r.op, r.group_ranks, r.label) for r in log]
    return {"losses": run.losses, "weights": run.weights, "records": records}


@pytest.mark.timeout(180)
def test_pipeline_stages_with_experts(rank_pools: RankPools, tmp_path: Any) -> None:
    """PP = 2 × EP = 2 (4 ranks), each stage's MoE layer recomputed in backward, against
    one process (no aux loss: a pipeline stage does not compute the model's loss): losses
    1e-5 relative, every weight 1e-6, each weight from the stage that holds it (stage 0:
    ranks 0, 1; stage 1: ranks 2, 3); a step's all-to-alls per rank: 6 per micro-batch
    (dispatch and combine forward, again in the recompute, and backward; without the
    recompute ``test_pipeline_moe.py``'s 4).

    Its checkpoint after step 1, resumed at PP = 1 × EP = 4 × DP = 4 with the distributed
    optimizer (``_resumed``: each expert, its momentum included, re-cut from 2 per rank of
    a stage to 1 per rank of the whole model), then steps 2 and 3: the losses and every
    final weight against the same one process (1e-5, 1e-6); the collectives: the
    all-to-alls of the two resumed steps only, over the 4-rank ``ep``, the dense grads
    reduce-scattered over ``dp`` (4 ranks), the experts reduced over nothing (``expt_dp``
    is one rank)."""
    outcomes = rank_pools.get(4).run(_pipeline, str(tmp_path))
    first, last = outcomes[0], outcomes[2]
    assert first is not None
    assert last is not None
    ref = reference("mixtral", STEPS, aux=False)
    rel = max(abs(a - b) / b for a, b in zip(last["losses"], ref.losses, strict=True))
    assert rel <= 1e-5, (last["losses"], ref.losses)
    weights = {**first["weights"], **last["weights"]}
    assert sorted(weights) == sorted(ref.weights)
    worst = max(float((weights[k] - v).abs().max()) for k, v in ref.weights.items())
    assert worst <= 1e-6
    print(f"PP=2 x EP=2: loss rel {rel:.1e}, weights {worst:.1e}")
    for rank, outcome in ((0, first), (2, last)):
        assert outcome["all_to_alls"] == 6 * 4, (rank, outcome["all_to_alls"])  # 4 micro-batches
        _check_resumed(outcome["resumed"], ref, rank)


def _check_resumed(resumed: dict[str, Any], ref: Run, rank: int) -> None:
    """One rank's run of :func:`_resumed` against the one-process run ``ref``: losses
    (1e-5 relative) and whole weights (1e-6); its all-to-alls, 4 per MoE layer (2) and
    step, on the 4 ranks of ``ep`` for the resumed steps only; its grad reductions
    reduce-scatters over the 4 ranks of ``dp``, none for the experts (``expt_dp`` one
    rank)."""
    rel = max(abs(a - b) / b for a, b in zip(resumed["losses"], ref.losses, strict=True))
    assert rel <= 1e-5, (rank, resumed["losses"], ref.losses)
    worst = max(float((resumed["weights"][k] - v).abs().max()) for k, v in ref.weights.items())
    assert worst <= 1e-6, (rank, worst)
    world = (0, 1, 2, 3)
    a2a = [group for op, group, _ in resumed["records"] if op == "all_to_all"]
    assert a2a == [world] * 8 * (STEPS - SAVED), (rank, a2a)
    grads = {
        (op, g, label) for op, g, label in resumed["records"] if label.startswith("grad reduce")
    }
    assert {(op, group) for op, group, _ in grads} == {("reduce_scatter", world)}, grads
    assert not [label for *_, label in grads if "expert" in label], grads
    print(f"resumed at PP=1 x EP=4 (rank {rank}): loss rel {rel:.1e}, weights {worst:.1e}")


def _resume(folder: str) -> dict[str, list[float]] | None:
    """Mixtral on 2 ranks: 4 steps at EP = 2 (distributed optimizer); 2 steps at EP = 2 saved,
    resumed at EP = 1 (experts whole on both ranks, plain DP) for steps 3-4; and 2 steps at
    EP = 1 saved, resumed at EP = 2."""
    import torch.distributed as dist

    from examples.hf_moe import train

    torch.set_num_threads(1)
    ep2, ep1 = Layout(ep=2, distributed_optimizer=True), Layout(ep=1)
    runs = {"uninterrupted": train("mixtral", ep2, steps=4).losses}
    train("mixtral", ep2, steps=2, save_dir=f"{folder}/ep2")
    runs["ep2 -> ep1"] = train("mixtral", ep1, steps=4, resume=f"{folder}/ep2").losses
    train("mixtral", ep1, steps=2, save_dir=f"{folder}/ep1")
    runs["ep1 -> ep2"] = train("mixtral", ep2, steps=4, resume=f"{folder}/ep1").losses
    # DeepSeek-V3 with Megatron's expert bias: the routers' biases are model state too
    bias: dict[str, Any] = {"expert_bias": True}
    runs["deepseek uninterrupted"] = train("deepseek_v3", ep2, steps=4, **bias).losses
    train("deepseek_v3", ep2, steps=2, save_dir=f"{folder}/ds", **bias)
    resumed = train("deepseek_v3", ep1, steps=4, resume=f"{folder}/ds", **bias)
    runs["deepseek ep2 -> ep1"] = resumed.losses
    return runs if dist.get_rank() == 0 else None


@pytest.mark.timeout(240)
def test_checkpoint_resumes_across_expert_layouts(rank_pools: RankPools, tmp_path: Any) -> None:
    """``mc_train.Checkpointer`` saves the experts as full-shape DTensors over ep
    (``mc_moe.model_sharded_state_dict``) and the momentum as pieces of the same shapes, so
    a checkpoint written at EP = 2 loads at EP = 1 and back: the resumed steps' losses
    within 1e-6 relative of the uninterrupted run (a resume that lost the momentum or
    loaded an expert into the wrong place moves them by more than 1e-3). DeepSeek-V3 with
    the expert bias resumes with its routers' biases (model state that finalize updates)."""
    runs = rank_pools.get(2).run(_resume, str(tmp_path))[0]
    assert runs is not None
    for name in ("ep2 -> ep1", "ep1 -> ep2", "deepseek ep2 -> ep1"):
        whole = runs["deepseek uninterrupted" if "deepseek" in name else "uninterrupted"]
        resumed = runs[name]
        assert resumed[:2] == whole[:2], name  # the saved history
        rel = max(abs(a - b) / b for a, b in zip(resumed[2:], whole[2:], strict=True))
        assert rel <= 1e-6, (name, resumed, whole)
