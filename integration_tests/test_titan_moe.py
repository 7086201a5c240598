"""torchtitan's MoE layout (``examples/titan_moe.py``: ``GroupedExperts`` with ``w1`` /
``w2`` / ``w3`` on rows its MoE module grouped by expert, a softmax top-2 router, a shared
expert) through ``mc_moe.parallelize`` with ``ep_plan={"layers.*.moe.experts":
"ep_dispatch_experts"}``, against one process.

On 4 gloo ranks, 3 steps of SGD with momentum on the mean next-token cross entropy of the
global batch (each rank its data-parallel rows), ``finalize_model_grads``; layouts: EP 2 ×
DP 4 under mc DDP, EP 2 × expert TP 2 under mc DDP with the distributed optimizer
(``expt_dp`` one rank: each expert's ``w1`` / ``w3`` split along I, ``w2`` along I, the
partial sums reduce-scattered over expt_tp), EP 4 under mc DDP, EP 2 under
``mc_ddp.TorchFullyShardedDataParallel`` (the experts sharded over ``expt_dp``), and TP 2
with sequence parallelism × EP 2 under both (``mc_moe.sequence_parallel_plan``: torchtitan's
plan from the layout; each rank routes its half of the sequence, the shared experts gather
the flattened tokens along dim 0). Every
step's mean loss within 1e-5 relative and every final weight (``mc_moe.full_state_dict``:
whole experts, the model's names) within 1e-6 of ``examples.titan_moe.reference``; the
checkpoint views (``mc_moe.model_sharded_state_dict``, what ``mc_train.Checkpointer``
saves) made whole equal those weights exactly; each
rank holds E/EP experts of width I/expert TP; a step's all-to-alls are on ``ep``, 4 per MoE
layer (dispatch and combine, forward and backward). A torchtitan MoE module with an
``expert_bias`` (torchtitan's trainer moves it; mc does not) is refused by name.

Pipeline stages: PP 2 × EP 2 through ``mc_train`` (``split_model``, ``call_module``: the
model's forward passes the modules a stage lacks through, as torchtitan's does), the same
losses and weights. Its rotary cache is a buffer autograd saves for backward: before
mc-train 0.9.4 the buffers' restore after shape inference bumped its version and the first
step failed in the backward shape inference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mc_groups.testing import RankPools

# (TP size with SP, EP size, expert TP size, FSDP2 wrapper, distributed optimizer, every
# block under torch's checkpoint_wrapper: torchtitan's activation checkpointing)
LAYOUTS = [
    (1, 2, 1, False, False, False),
    (1, 2, 2, False, True, False),
    (1, 4, 1, False, False, False),
    (1, 2, 1, True, False, False),
    (2, 2, 1, False, True, False),
    (2, 2, 1, True, False, False),
    (2, 2, 1, False, True, True),
]
WRAPPED = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper: in module paths only
STEPS = 3


def _train(
    tp: int, ep: int, etp: int, fsdp: bool, distributed: bool, recompute: bool
) -> dict[str, Any]:
    import mc_groups as mg
    import mc_moe
    from examples.titan_moe import BATCH, LR, MOMENTUM, build_model, global_batch, loss_of
    from mc_ddp import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        ShardedOptimizer,
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
        ensure_params_ready,
    )
    from mc_finalize import finalize_model_grads

    sizes: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }
    pgc = mg.initialize_model_parallel(**sizes)
    cfg = mg.ModelParallelConfig(**sizes, sequence_parallel=tp > 1)
    model: Any = build_model()
    ep_plan = {"layers.*.moe.experts": "ep_dispatch_experts"}
    plan = mc_moe.sequence_parallel_plan(model, ep_plan=ep_plan) if tp > 1 else {}
    mc_moe.parallelize(model, plan, ep_plan=ep_plan, config=cfg, pg_collection=pgc)
    shape = tuple(model.layers["0"].moe.experts.w1.shape)
    if recompute:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for name in list(model.layers.keys()):
            model.layers[name] = checkpoint_wrapper(model.layers[name])
    chunk: Any
    if fsdp:
        wrapper = TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=True)
        chunk = TorchFullyShardedDataParallel(cfg, wrapper, model, pg_collection=pgc)
        opt: Any = torch.optim.SGD(chunk.parameters(), lr=LR, momentum=MOMENTUM)
    else:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, overlap_grad_reduce=True
        )
        chunk = DistributedDataParallel(cfg, ddp_config, model, pg_collection=pgc)
        sgd = torch.optim.SGD(chunk.parameters(), lr=LR, momentum=MOMENTUM)
        opt = ShardedOptimizer(sgd, chunk, pg_collection=pgc)
    dp = pgc.require("dp", "test")
    rows = BATCH // dp.size()
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        if fsdp:
            opt.zero_grad()
        else:
            chunk.zero_grad_buffer()
        with mg.record_collectives() as log:
            loss = loss_of(chunk, ids)
            loss.backward()  # type: ignore[no-untyped-call]
        finalize_model_grads([chunk], pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    if not fsdp:
        ensure_params_ready(chunk.parameters())
    a2a = [r.group_ranks for r in log if r.op == "all_to_all"]
    out = {
        "losses": losses,
        **_state(model, pgc, reload=not fsdp),
        "shape": shape,
        "all_to_alls": a2a,
        "ep": mg.group_ranks(pgc.require("ep", "test")),
    }
    mg.destroy_model_parallel(pgc)
    return out


def _state(model: Any, pgc: Any, reload: bool) -> dict[str, Any]:
    """The whole weights (``mc_moe.full_state_dict``) and DCP's views made whole; with
    ``reload`` the whole weights are cut back into the model (``load_full_state_dict``) and
    must gather to the same tensors."""
    import mc_moe

    views = mc_moe.model_sharded_state_dict(model)
    weights = mc_moe.full_state_dict(model, pg_collection=pgc)
    if reload:
        mc_moe.load_full_state_dict(model, weights, pg_collection=pgc)
        again = mc_moe.full_state_dict(model, pg_collection=pgc)
        assert all(torch.equal(again[k], v) for k, v in weights.items())
    whole = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in views.items()}
    return {"weights": weights, "views": whole}


def _pipeline() -> dict[str, Any]:
    """PP 2 × EP 2 (DP 2): ``mc_train.split_model`` cuts the model into 2 stages (one MoE
    block each, torchtitan's forward passing a missing embedding / norm / head through),
    ``build_pipeline`` (1F1B over 2 micro-batches, ``mc_train.call_module``, the
    distributed optimizer): the losses (the last stage's) and each stage's weights."""
    import mc_groups as mg
    import mc_moe
    import mc_train
    from examples.titan_moe import BATCH, LR, MOMENTUM, build_model, global_batch
    from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer, ensure_params_ready

    sizes: dict[str, Any] = {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}
    pgc = mg.initialize_model_parallel(**sizes)
    cfg = mg.ModelParallelConfig(**sizes)
    model = build_model()
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, 2), pgc)
    ep_plan = {"layers.*.moe.experts": "ep_dispatch_experts"}
    for chunk in chunks:
        stage_plan = mc_train.stage_plan(ep_plan, chunk)
        mc_moe.parallelize(chunk, {}, ep_plan=stage_plan, config=cfg, pg_collection=pgc)
    pipe = mc_train.build_pipeline(
        list(chunks),
        config=cfg,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        pg_collection=pgc,
        microbatches=2,
        loss_fn=mc_train.token_cross_entropy(),
        forward=mc_train.call_module,
    )
    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    opt = ShardedOptimizer(sgd, pipe.chunks, pg_collection=pgc)
    dp = pgc.require("dp", "test")
    rows = BATCH // dp.size()
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[dp.rank() * rows : (dp.rank() + 1) * rows]
        losses.append(pipe.forward_backward(ids[:, :-1], ids[:, 1:]))
        opt.step()
    ensure_params_ready(pipe.parameters())
    weights = {n: w for c in pipe.chunks for n, w in mc_moe.full_state_dict(c.module, pgc).items()}
    mg.destroy_model_parallel(pgc)
    return {"losses": losses, "weights": weights}


def _refused() -> str:
    import mc_groups as mg
    import mc_moe
    from examples.titan_moe import build_model

    pgc = mg.initialize_model_parallel(expert_model_parallel_size=2)
    model: Any = build_model()
    moe = model.layers["1"].moe
    moe.load_balance_coeff, moe.expert_bias = 1e-3, torch.zeros(4)
    try:
        mc_moe.parallelize(
            model,
            {},
            ep_plan={"layers.*.moe.experts": "ep_dispatch_experts"},
            config=mg.ModelParallelConfig(expert_model_parallel_size=2),
            pg_collection=pgc,
        )
    except ValueError as err:
        return str(err)
    finally:
        mg.destroy_model_parallel(pgc)
    return "no error"


def _grid() -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = [_train(*layout) for layout in LAYOUTS]
    return {"runs": runs, "pipeline": _pipeline(), "refused": _refused()}


@pytest.mark.timeout(200)
def test_torchtitan_moe_layout_matches_one_process(rank_pools: RankPools) -> None:
    """The module notes' layouts, losses and weights against one process; the experts'
    local shapes and the all-to-alls counted; the ``expert_bias`` refusal."""
    from examples.titan_moe import EXPERT_HIDDEN, EXPERTS, reference

    outcomes = rank_pools.get(4).run_with_deadline(180.0, _grid)
    ref_losses, ref_weights = reference(STEPS)
    stages = {k: v for o in outcomes for k, v in o["pipeline"]["weights"].items()}
    assert sorted(stages) == sorted(ref_weights)  # the two stages hold every weight
    worst = max(float((stages[k] - v).abs().max()) for k, v in ref_weights.items())
    assert worst <= 1e-6, ("PP 2 x EP 2", worst)
    for rank, outcome in enumerate(outcomes):
        for layout, run in zip(LAYOUTS, outcome["runs"], strict=True):
            tp, ep, etp, fsdp, distributed, recompute = layout
            where = f"TP {tp} EP {ep} x expert TP {etp} fsdp={fsdp} distopt={distributed}"
            where += f" recompute={recompute} rank {rank}"
            rel = max(abs(a - b) / b for a, b in zip(run["losses"], ref_losses, strict=True))
            assert rel <= 1e-5, (where, run["losses"], ref_losses)
            assert sorted(run["weights"]) == sorted(ref_weights), where
            worst = max(float((run["weights"][k] - v).abs().max()) for k, v in ref_weights.items())
            assert worst <= 1e-6, (where, worst)
            assert run["shape"] == (EXPERTS // ep, EXPERT_HIDDEN // etp, 32), where
            views = {k.replace(WRAPPED, ""): v for k, v in run["views"].items()}
            got = {k: v.reshape(run["weights"][k].shape) for k, v in views.items()}
            assert sorted(got) == sorted(run["weights"]), where
            assert all(torch.equal(got[k], v) for k, v in run["weights"].items()), where
            per_layer = 6 if recompute else 4  # the forward's pair again in the recompute
            assert run["all_to_alls"] == [run["ep"]] * per_layer * 2, (where, run["all_to_alls"])
            if rank == 0:
                print(f"{where}: loss rel {rel:.1e}, weights {worst:.1e}")
        assert "layers.1.moe.expert_bias is set (load_balance_coeff=0.001)" in outcome["refused"]
        if rank >= 2:  # the last stage's ranks report the losses
            got = outcome["pipeline"]["losses"]
            rel = max(abs(a - b) / b for a, b in zip(got, ref_losses, strict=True))
            assert rel <= 1e-5, ("PP 2 x EP 2", got, ref_losses)
        assert "load_balance_coeff=None" in outcome["refused"]
