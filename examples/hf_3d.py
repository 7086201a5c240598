"""A tiny ``transformers`` Llama at TP × PP × DP with sequence parallelism, resumable.

Every layout trains the same run (model, data and global batch do not depend on it):
``split_model`` cuts pipeline stages, ``parallelize`` converts each with the SP plan,
``build_pipeline`` runs them in mc DDP (distributed optimizer, ``finalize_model_grads``),
``ShardedOptimizer`` clips the whole model's grad norm at 1.0, ``Checkpointer`` saves and
resumes at any layout. Walk-through: ``docs/hf_3d.md``. Run it under torchrun:
``torchrun --standalone --nproc-per-node 8 -m examples.hf_3d --tp 2 --pp 2 --dp 2``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import mc_groups as mg
import mc_train
from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer, ensure_params_ready
from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan
from mc_train.checkpoint import Checkpointer, Resumed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VOCAB, SEQ, BATCH, LAYERS, KV_HEADS, LR, MOMENTUM, CLIP = 64, 16, 8, 4, 4, 0.12, 0.9, 1.0
CHUNKS = {"1f1b": 1, "gpipe": 1, "interleaved": 2}  # model chunks per pipeline rank
SP_OFF = "note: --tp 1: sequence parallelism is off (it splits activations over the TP ranks)"


def build_model() -> PreTrainedModel:
    """The Llama every layout trains: 4 blocks, hidden 32, 8 heads over 4 KV heads, tied
    input and output embeddings; the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (seconds)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids of ``step`` (0-based), the same on every rank: each row
    counts from a random token by a random stride of 1 to 3 (mod ``VOCAB``)."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def check_layout(tp: int, pp: int, dp: int, schedule: str, world: int | None = None) -> None:
    """``ValueError`` naming the flag when the layout cannot train this model's batch."""
    if KV_HEADS % tp:
        raise ValueError(f"--tp {tp} must divide the model's {KV_HEADS} KV heads (1, 2 or 4)")
    if BATCH % dp:
        raise ValueError(f"--dp {dp} must divide the global batch of {BATCH} sequences")
    if pp * CHUNKS[schedule] > LAYERS:
        raise ValueError(f"--pp {pp} --schedule {schedule}: more stages than {LAYERS} blocks")
    if world is not None and tp * pp * dp != world:
        raise ValueError(f"--tp {tp} × --pp {pp} × --dp {dp} is not the {world} ranks started")
    mc_train.check_schedule(schedule, pp=pp, chunks=CHUNKS[schedule], microbatches=BATCH // dp)


@dataclass
class Run:
    """Every step's loss and grad norm before clipping (from step 1, a resumed run's
    history included), the weights of this rank's stages (whole, original names) and what
    ``--resume`` found."""

    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor]
    resumed: Resumed | None = None


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.SGD:
    """The optimizer of every run (the one process's and each rank's shard of it)."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def reference(steps: int) -> Run:
    """One process, plain PyTorch and ``transformers``' own loss on the whole global batch,
    the grad norm clipped by ``torch.nn.utils.clip_grad_norm_``."""
    model = build_model()
    opt = sgd(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        loss = model(input_ids=global_batch(step), labels=global_batch(step)).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return Run(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})


def train(args: argparse.Namespace) -> Run:
    """Train as ``args`` say on every rank of the world (``tp × pp × dp``); collective."""
    tp, pp, dp, v = args.tp, args.pp, args.dp, CHUNKS[args.schedule]
    check_layout(tp, pp, dp, args.schedule, dist.get_world_size())
    pgc = mg.initialize_model_parallel(tp, pp, v if v > 1 else None)
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1
    )
    model = build_model()
    plan = sequence_parallel_plan(model) if tp > 1 else model.tp_plan
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, pp * v), pgc)
    for chunk in chunks:  # each stage gets the plan entries its modules match
        parallelize(chunk, mc_train.stage_plan(plan, chunk), config=cfg, pg_collection=pgc)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    pipe = mc_train.build_pipeline(
        chunks,
        config=cfg,
        ddp_config=ddp_config,
        pg_collection=pgc,
        microbatches=BATCH // dp,  # one sequence per micro-batch
        loss_fn=mc_train.token_cross_entropy(),
        schedule=args.schedule,
        forward=mc_train.HFCausalLMForward(sequence_parallel_size=tp),  # positions under SP
    )
    # The optimizer state sharded over DP; the whole model's grad norm clipped at CLIP.
    opt = ShardedOptimizer(
        sgd(pipe.parameters()), pipe.chunks, max_grad_norm=CLIP, pg_collection=pgc
    )
    run = {"model": "examples.hf_3d", "lr": LR, "momentum": MOMENTUM, "clip": CLIP}
    ckpt = Checkpointer(
        args.save_dir, pipe.chunks, opt, pg_collection=pgc, interval=args.save_every, run=run
    )
    resumed = ckpt.load(args.resume) if args.resume else None
    state: dict[str, list[float]] = resumed.state if resumed else {}
    losses, norms = list(state.get("losses", [])), list(state.get("grad_norms", []))
    rows, dp_rank = BATCH // dp, mg.group_rank(pgc.require("dp", "data"))
    for step in range(len(losses), args.steps):
        ids = global_batch(step)[dp_rank * rows : (dp_rank + 1) * rows]  # this DP rank's rows
        losses.append(pipe.forward_backward(ids, mc_train.causal_targets(ids)))
        norms.append(opt.step().grad_norm or 0.0)  # before clipping (None only unclipped)
        if args.save_dir is not None:
            history = {"losses": losses, "grad_norms": norms}
            ckpt.save(step + 1, state=history, last=step + 1 == args.steps)
    ensure_params_ready(pipe.parameters())  # the last step's overlapped param all-gather
    weights = {n: w for chunk in pipe.chunks for n, w in full_state_dict(chunk.module).items()}
    mg.destroy_model_parallel(pgc)
    return Run(losses, norms, weights, resumed)


def parse_args(argv: list[str] | None = None, world: int | None = None) -> argparse.Namespace:
    """The flags (``--help``), the layout checked for ``world`` ranks (torchrun's default)."""
    p = argparse.ArgumentParser(prog="examples.hf_3d", description=__doc__.split("\n")[0])
    for flag in ("--tp", "--pp", "--dp"):
        p.add_argument(flag, type=int, default=1, help="tensor / pipeline / data parallel size")
    p.add_argument("--schedule", choices=mc_train.SCHEDULES, default="1f1b")
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-dir", help="publish checkpoints in this folder")
    p.add_argument("--save-every", type=int, help="save every N steps (and after the last)")
    p.add_argument("--resume", help="'auto' (the newest intact in --save-dir) or a checkpoint")
    p.add_argument("--json", help="write every step's loss and the one-process losses here")
    args = p.parse_args(argv)
    if (args.resume == "auto" or args.save_every) and not args.save_dir:
        p.error("--resume auto and --save-every need --save-dir (the folder of checkpoints)")
    world = world or int(os.environ.get("WORLD_SIZE", "0")) or None
    try:
        check_layout(args.tp, args.pp, args.dp, args.schedule, world)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> None:
    """Train (under torchrun), print each step's loss beside one process's, write ``--json``."""
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank0 = dist.get_rank() == 0
    if args.tp == 1 and rank0:
        print(SP_OFF)
    run = train(args)
    if rank0:
        if run.resumed is not None and run.resumed.path is not None:
            print(f"resumed from {run.resumed.path} (step {run.resumed.step})")
        ref = reference(len(run.losses))
        rows = zip(run.losses, ref.losses, run.grad_norms, ref.grad_norms, strict=True)
        for step, (a, b, norm, ref_norm) in enumerate(rows, 1):
            print(
                f"step {step}: loss {a:.6f} (one process {b:.6f}, rel {abs(a - b) / b:.1e})  "
                f"grad norm {norm:.4f} (one process {ref_norm:.4f})"
            )
        if args.json:
            layout = {k: getattr(args, k) for k in ("tp", "pp", "dp", "schedule")}
            result = {"layout": layout, "losses": run.losses, "grad_norms": run.grad_norms}
            result |= {"reference": ref.losses, "reference_grad_norms": ref.grad_norms}
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
