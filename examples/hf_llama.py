"""A tiny ``transformers`` Llama trained with mc at TP=2 × DP=2 with sequence parallelism.

The model comes from a config (random weights, no hub access); ``parallelize`` converts it
with the model's own ``tp_plan`` plus four sequence-parallel entries; mc DDP with the
distributed optimizer and ``finalize_model_grads`` train it; the script prints each step's
loss beside the one-process loss of the same model on the same global batch.

Run it with ``torchrun --standalone --nproc-per-node 4 -m examples.hf_llama``;
``integration_tests/test_parallelize_hf.py`` runs ``train`` on 2 and 4 gloo ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ShardedOptimizer,
    ensure_params_ready,
)
from mc_finalize import finalize_model_grads
from mc_tp_layers import (
    full_state_dict,
    parallelize,
    vocab_parallel_causal_lm_loss,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "Run",
    "build_model",
    "global_batch",
    "reference",
    "sequence_parallel_plan",
    "train",
]

SEQ, BATCH, LR = 16, 4, 1.0


def build_model(kind: str = "llama", seed: int = 0, *, tie: bool = False) -> PreTrainedModel:
    """A tiny ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (q/k/v biases) from a config."""
    # imported here: collecting the tests that import this module stays cheap (seconds)
    from transformers import (  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    sizes: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": tie,
    }
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes))
    raise ValueError(f"kind={kind!r}: choose 'llama' or 'qwen2'")


# --8<-- [start:sp-plan]
def sequence_parallel_plan(tp_plan: Mapping[str, Any]) -> dict[str, Any]:
    """The model's ``tp_plan`` plus where the sequence is split, gathered and scattered.

    The residual stream is split along the sequence from the first decoder layer on (the
    embedding's output stays whole: ``transformers`` derives positions from its length);
    norms run on the split; attention and MLP gather it on entry (attention reshapes by its
    input's length) and their ``rowwise`` output layer reduce-scatters it; the LM head
    gathers it again.
    """
    plan = dict(tp_plan)
    plan["model.layers.0"] = "sequence_scatter"
    plan["model.layers.*.input_layernorm"] = "sequence_parallel"
    plan["model.layers.*.post_attention_layernorm"] = "sequence_parallel"
    plan["model.layers.*.self_attn"] = "sequence_gather"
    plan["model.layers.*.mlp"] = "sequence_gather"
    plan["model.norm"] = "sequence_parallel"
    plan["lm_head"] = ("sequence_gather", plan["lm_head"])
    return plan


# --8<-- [end:sp-plan]


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (BATCH, SEQ), generator=generator)


@dataclass
class Run:
    """Per-step losses (averaged over DP) and the final full, original-named weights."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def reference(kind: str = "llama", steps: int = 3, *, tie: bool = False) -> Run:
    """One process, plain PyTorch: SGD on the whole global batch."""
    model = build_model(kind, tie=tie)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        ids = global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def _loss(
    model: torch.nn.Module, ids: torch.Tensor, vocab_parallel: bool, tp: dist.ProcessGroup
) -> torch.Tensor:
    if vocab_parallel:
        logits = model(input_ids=ids).logits  # [b, s, V / tp]
        config: Any = getattr(model, "module", model).config  # the HF model's, under DDP
        vocab = int(config.vocab_size)  # gathered logits: an error, not the loss + log(tp)
        return vocab_parallel_causal_lm_loss(logits, ids, tp_group=tp, vocab_size=vocab)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


# --8<-- [start:train]
def train(
    tp: int = 2,
    *,
    kind: str = "llama",
    sequence_parallel: bool = True,
    vocab_parallel_loss: bool = False,
    steps: int = 3,
    tie: bool = False,
    block_entries: bool | None = None,
) -> Run:
    """Train the tiny model on every rank of the world (TP = ``tp``, DP = world / tp);
    ``block_entries`` (default: ``sequence_parallel``) adds ``sequence_parallel_plan``'s
    entries to the model's ``tp_plan``."""
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    model = build_model(kind, tie=tie)  # the same weights on every rank (same seed)
    plan: dict[str, Any] = dict(model.tp_plan)  # transformers' own plan, names as they are
    if sequence_parallel if block_entries is None else block_entries:
        plan = sequence_parallel_plan(plan)
    if vocab_parallel_loss:  # keep the logits split along the vocabulary: plain colwise
        entry = "sequence_gather" in plan["lm_head"]
        plan["lm_head"] = ("sequence_gather", "colwise") if entry else "colwise"
    parallelize(model, plan, config=cfg, pg_collection=pgc)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    ddp = DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), ddp)
    dp = pgc.require("dp", "data")
    rows = BATCH // dp.size()
    losses = []
    for step in range(steps):
        ids = global_batch(step)[dp.rank() * rows : (dp.rank() + 1) * rows]  # this DP rank's
        ddp.zero_grad_buffer()
        loss = _loss(ddp, ids, vocab_parallel_loss, pgc.require("tp", "loss"))
        loss.backward()  # type: ignore[no-untyped-call]
        finalize_model_grads([ddp], pg_collection=pgc)  # DP sum; SP norms' grads over TP
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    ensure_params_ready(ddp.parameters())  # the last step's param all-gather (overlapped)
    weights = full_state_dict(model)  # gathered, original names: loads into the HF model
    mg.destroy_model_parallel(pgc)
    return Run(losses, weights)


# --8<-- [end:train]


def main() -> None:
    """Train at TP=2 × DP=(world / 2) with SP and print the parity with one process."""
    dist.init_process_group("gloo")
    run = train(2)
    if dist.get_rank() == 0:
        ref = reference()
        for step, (a, b) in enumerate(zip(run.losses, ref.losses, strict=True)):
            print(f"step {step}: mc {a:.6f}  one process {b:.6f}  rel {abs(a - b) / b:.1e}")
        worst = max(float((run.weights[k] - v).abs().max()) for k, v in ref.weights.items())
        print(f"max |weight - one process| after {len(ref.losses)} SGD steps: {worst:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
