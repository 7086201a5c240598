"""One training step of a tiny ``transformers`` Mixtral on 4 gloo ranks: mc's expert
parallelism against ``transformers``' own and against mc DDP with the experts replicated,
in one run.

Model: Mixtral, hidden 128, 2 layers, 4 experts of width 256, top-2, vocabulary 256;
batch 4 sequences of 64 tokens per rank, one thread per rank, the load-balancing loss off
(``transformers``' own EP computes it from each rank's tokens; mc's on the global batch: not
the same work). One step = forward, loss, backward, gradient reduction, SGD step.
Variants, built side by side from the same weights and timed in rounds (each pass times
every variant once, after a barrier, in a shuffled order; a round keeps each variant's
fastest pass: ``benchmarks._common.round_bests``):

- ``transformers EP``: ``DistributedConfig(ep_size=2, fsdp_size=2, dp_replicate_size=2)``
  applied by ``transformers`` itself (``prepare_distribute_model`` /
  ``maybe_distribute_model``): all-to-all token dispatch, FSDP2 over 2 × HSDP 2 as its data
  parallelism, ``torch.optim.SGD``;
- ``mc EP``: ``mc_moe.parallelize`` at EP = 2 (experts over ``ep``, expert DP = 2, dense
  DP = 4), mc DDP (overlapped grad reduce), ``finalize_model_grads``, ``ShardedOptimizer``;
- ``mc DDP (replicated experts)``: the model as it is under mc DDP at DP = 4.

Reported: the slowest rank's median over rounds of each round's best step, the ratios,
and the expert weights + grads each rank holds (elements, counted) against the whole
experts'. Targets (issue 40): mc EP ≤ 0.60 × ``transformers`` EP and ≤ 1.25 × mc DDP with
replicated experts; expert weights + grads per rank = 1/EP of the whole. Prints a Markdown
table; exits 1 when a target is missed. From the repository root::

    python -m benchmarks.moe_step [--iters ROUNDS] [--warmup N]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mc_groups as mg
import mc_moe
from benchmarks import _common
from benchmarks._common import Step
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
from mc_finalize import finalize_model_grads

HIDDEN, WIDTH, EXPERTS, LAYERS, VOCAB, SEQ, BATCH, LR = 128, 256, 4, 2, 256, 64, 4, 1e-3
TRANSFORMERS, MC_EP, REPLICATED = "transformers EP", "mc EP", "mc DDP (replicated experts)"
TARGETS = {TRANSFORMERS: 0.60, REPLICATED: 1.25}  # mc EP / variant


def _model() -> Any:
    import transformers  # noqa: PLC0415 (the ranks import it, not the parent)

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _transformers_ep(ids: torch.Tensor) -> Step:
    from transformers.distributed.configuration_utils import (  # noqa: PLC0415
        DistributedConfig,
    )

    model = _model()
    cls = type(model)
    config, _, mesh = cls.prepare_distribute_model(
        DistributedConfig(ep_size=2, fsdp_size=2, dp_replicate_size=2)
    )
    model = cls.maybe_distribute_model(model, config, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step


def _mc(ids: torch.Tensor, pgc: mg.ProcessGroupCollection, ep: bool) -> tuple[Step, int]:
    cfg = mg.ModelParallelConfig(expert_model_parallel_size=2 if ep else 1)
    model = _model()
    if ep:
        mc_moe.parallelize(model, {}, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(overlap_grad_reduce=True), model, pg_collection=pgc
    )
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), ddp, pg_collection=pgc)

    def step() -> None:
        ddp.zero_grad_buffer()
        ddp(input_ids=ids, labels=ids).loss.backward()
        finalize_model_grads([ddp], pg_collection=pgc)
        opt.step()

    # expert weights and their grads (main_grad views) this rank holds, in elements
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    held = sum(p.numel() + mg.param_attrs.main_grad_of(p).numel() for p in experts)
    return step, held


def _measure(warmup: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ids = _batch()
    ep_groups = mg.initialize_model_parallel(expert_model_parallel_size=2)
    dp_groups = mg.initialize_model_parallel()
    mc_ep, held_ep = _mc(ids, ep_groups, ep=True)
    replicated, held_all = _mc(ids, dp_groups, ep=False)
    steps = {TRANSFORMERS: _transformers_ep(ids), MC_EP: mc_ep, REPLICATED: replicated}
    bests = _common.round_bests(steps, warmup=warmup, rounds=rounds, steps_per_round=3)
    return {
        "rounds": bests["wall"],
        "medians": {name: statistics.median(v) for name, v in bests["wall"].items()},
        "held": {"ep": held_ep, "replicated": held_all},
    }


def _table(per_rank: list[dict[str, Any]]) -> tuple[list[str], bool]:
    slowest = _common.slowest_medians(per_rank)
    mine = slowest[MC_EP]
    lines = [
        "| variant | median step (ms) | mc EP / variant | target | per-round ratios |",
        "|---|---:|---:|---:|---|",
    ]
    ok = True
    for name, seconds in slowest.items():
        ratio = mine / seconds
        rounds = [
            max(r["rounds"][MC_EP][i] for r in per_rank)
            / max(r["rounds"][name][i] for r in per_rank)
            for i in range(len(per_rank[0]["rounds"][name]))
        ]
        target = TARGETS.get(name)
        ok = ok and (target is None or ratio <= target)
        shown = "—" if target is None else f"≤ {target:.2f}"
        each = ", ".join(f"{r:.2f}" for r in rounds)
        lines.append(f"| {name} | {seconds * 1e3:.1f} | {ratio:.3f} | {shown} | {each} |")
    held = per_rank[0]["held"]
    share = held["ep"] / held["replicated"]
    ok = ok and abs(share - 0.5) < 1e-9
    lines.append(
        f"\nexpert weights + grads per rank: {held['ep']:,} elements with EP = 2, "
        f"{held['replicated']:,} replicated ({share:.3f} of the whole; target 1/EP = 0.500)"
    )
    return lines, ok


def main() -> int:
    """Run the variants on 4 ranks and print the table; 1 when a target is missed."""
    args = _common.parse_arguments(__doc__, iters=5, iters_help="timed rounds (>= 3)", warmup=2)
    with _common.rank_pool(4) as pool:
        per_rank = pool.run(_common.rank_worker("benchmarks.moe_step"), args.warmup, args.iters)
    print(
        f"Mixtral hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts of width {WIDTH}, top-2; "
        f"batch {BATCH} x {SEQ} tokens per rank; 4 gloo ranks, 1 thread each"
    )
    lines, ok = _table(per_rank)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
