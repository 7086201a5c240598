"""A tiny ``transformers`` Llama (or Qwen2, Mistral, Phi-3, OLMo-2, Gemma) trained with mc at
TP=2 × DP=2 with sequence parallelism.

The model comes from a config (random weights, no hub access); ``parallelize`` converts it
with the plan ``sequence_parallel_plan`` derives from the model (its own ``tp_plan`` plus
the sequence-parallel entries); mc DDP with the distributed optimizer and
``finalize_model_grads`` train it; the script prints each step's loss beside the
one-process loss of the same model on the same global batch.

Run it with ``torchrun --standalone --nproc-per-node 4 -m examples.hf_llama [--kind phi3]``;
``integration_tests/test_parallelize_hf.py`` and ``test_sp_plan_hf.py`` run ``train`` on 2
and 4 gloo ranks.
"""

from __future__ import annotations

import argparse
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
    sequence_parallel_plan,
    vocab_parallel_causal_lm_loss,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "KINDS",
    "Run",
    "build_model",
    "global_batch",
    "reference",
    "train",
]

SEQ, BATCH, LR = 16, 4, 1.0
KINDS = {  # kind → its transformers config and model classes
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head q_norm / k_norm
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),  # fused qkv_proj, gate_up_proj (gathered)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),  # q_norm / k_norm over all heads; post-norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),  # (1 + w) norms, scaled embeddings
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),  # + per-head q/k norms, sliding window
}


def build_model(kind: str = "llama", seed: int = 0, *, tie: bool = False) -> PreTrainedModel:
    """A tiny causal LM of ``kind`` (a key of ``KINDS``) from a config, seeded."""
    # imported here: collecting the tests that import this module stays cheap (seconds)
    import transformers  # noqa: PLC0415

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(KINDS)}")
    sizes: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": tie,
    }
    if kind not in ("llama", "qwen2"):  # token ids inside the tiny vocabulary, small heads
        sizes.update(pad_token_id=None, bos_token_id=1, eos_token_id=2, head_dim=8)
    config_class, model_class = KINDS[kind]
    config = getattr(transformers, config_class)(**sizes)
    torch.manual_seed(seed)
    model: PreTrainedModel = getattr(transformers, model_class)(config)
    return model


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (BATCH, SEQ), generator=generator)


@dataclass
class Run:
    """Per-step losses (averaged over DP) and the final full, original-named weights."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def reference(kind: str = "llama", steps: int = 3, *, tie: bool = False, lr: float = LR) -> Run:
    """One process, plain PyTorch: SGD on the whole global batch."""
    model = build_model(kind, tie=tie)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
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
    lr: float = LR,
    overrides: Mapping[str, Any] | None = None,
) -> Run:
    """Train the tiny model on every rank of the world (TP = ``tp``, DP = world / tp);
    ``block_entries`` (default: ``sequence_parallel``) converts it with
    ``sequence_parallel_plan(model, base)`` instead of ``base``: the model's own ``tp_plan``
    with ``overrides`` (pattern → style) replacing its entries."""
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    model = build_model(kind, tie=tie)  # the same weights on every rank (same seed)
    base: dict[str, Any] = {**model.tp_plan, **(overrides or {})}  # transformers' names
    if vocab_parallel_loss:  # keep the logits split along the vocabulary: plain colwise
        base["lm_head"] = "colwise"
    if sequence_parallel if block_entries is None else block_entries:
        parallelize(model, sequence_parallel_plan(model, base), config=cfg, pg_collection=pgc)
    else:
        parallelize(model, base, config=cfg, pg_collection=pgc)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    ddp = DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=lr), ddp)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default="llama")
    kind = parser.parse_args().kind
    dist.init_process_group("gloo")
    run = train(2, kind=kind)
    if dist.get_rank() == 0:
        ref = reference(kind)
        for step, (a, b) in enumerate(zip(run.losses, ref.losses, strict=True)):
            print(f"step {step}: mc {a:.6f}  one process {b:.6f}  rel {abs(a - b) / b:.1e}")
        worst = max(float((run.weights[k] - v).abs().max()) for k, v in ref.weights.items())
        print(f"max |weight - one process| after {len(ref.losses)} SGD steps: {worst:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
