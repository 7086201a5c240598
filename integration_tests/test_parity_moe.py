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

Layouts (each model at EP = 2 on 2 ranks, then one layout per model on 4 ranks): EP = 2
(expt_dp of one rank); EP = 2 × DP = 2 (expert grads summed over expt_dp of 2 and scaled by
1/|dp|, dense over dp); TP = 2 × EP = 2 with sequence parallelism
(``mc_moe.sequence_parallel_plan``: each TP rank routes its part of the sequence, the
router's grads summed over TP) with expert TP 1 (Qwen3-MoE) and 2 (OLMoE: its experts split
over expt_tp, tokens all-gathered and reduce-scattered there); DeepSeek-V3 there with its
latent attention split by heads, its shared experts and the distributed optimizer; gpt-oss
at EP = 2 × expert TP = 2 (interleaved gate/up split by pairs, the down bias added once).

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

from functools import cache

import pytest
import torch

from examples.hf_moe import Layout, Run
from examples.hf_moe import reference as _reference
from mc_groups.testing import RankPools

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS = 3
BIASED = ("deepseek_v3",)  # trained with Megatron's aux-loss-free expert bias
KINDS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
CASES_2 = [(kind, Layout(ep=2)) for kind in KINDS]  # EP = 2, expt_dp of one rank
CASES_4 = [
    ("mixtral", Layout(ep=2)),  # EP = 2 × DP = 2
    ("qwen3_moe", Layout(tp=2, ep=2, etp=1)),  # TP = 2 × EP = 2, SP; experts whole over etp
    ("olmoe", Layout(tp=2, ep=2, etp=2)),  # TP = 2 × EP = 2 × expert TP = 2, SP
    ("deepseek_v3", Layout(tp=2, ep=2, etp=2, distributed_optimizer=True)),  # + MLA, dist. opt
    ("gpt_oss", Layout(ep=2, etp=2)),  # EP = 2 × expert TP = 2: interleaved gate/up, down bias
]

reference = cache(_reference)  # each model's one-process run once


def _train_cases(cases: list[tuple[str, Layout]]) -> list[Run] | None:
    import torch.distributed as dist

    from examples.hf_moe import train

    torch.set_num_threads(1)
    runs = [train(kind, layout, steps=STEPS, expert_bias=kind in BIASED) for kind, layout in cases]
    return runs if dist.get_rank() == 0 else None


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
        for run, case in zip(runs, cases, strict=True):
            _check(run, case)
