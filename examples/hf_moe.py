"""A tiny ``transformers`` mixture-of-experts model (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3
or gpt-oss) trained with mc at TP × EP × DP with sequence parallelism, beside one process.

The model comes from a config (random weights, no hub access); ``mc_moe.parallelize``
splits it by its own ``tp_plan`` and ``ep_plan`` (experts over the expert-parallel ranks,
dense layers over TP); mc DDP (expert params in their own buffers, reduced over the
expert data-parallel group), ``finalize_model_grads`` and SGD train it; the script prints
each step's loss beside the one-process loss of the same model on the same global batch.

Run it with ``torchrun --standalone --nproc-per-node 4 -m examples.hf_moe [--kind qwen3_moe]
[--tp 2 --ep 2 --etp 1] [--save-dir DIR]`` (TP=2 × EP=2 × DP=2 with sequence parallelism,
the distributed optimizer, clipping; DeepSeek-V3 with Megatron's expert bias);
``integration_tests/test_parity_moe.py`` runs ``train`` on 2 and 4 gloo ranks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import mc_groups as mg
import mc_moe
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ShardedOptimizer,
    ensure_params_ready,
)
from mc_finalize import finalize_model_grads
from mc_train.checkpoint import Checkpointer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["KINDS", "Layout", "Run", "build_model", "global_batch", "reference", "train"]

SEQ, BATCH, LR, MOMENTUM, CLIP, VOCAB = 16, 8, 0.5, 0.5, 1.0, 64
RATE = 0.01  # moe_router_bias_update_rate (Megatron's default 1e-3; larger so 3 steps show)
KINDS = {  # kind → its transformers config and model classes
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def _sizes(kind: str, layers: int = 2) -> dict[str, Any]:
    """Hidden 64, 2 layers, 4 experts of width 32, top-2 (every layer MoE)."""
    sizes: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    experts = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts"}
    sizes[experts.get(kind, "n_routed_experts" if kind == "deepseek_v3" else "num_experts")] = 4
    if kind in ("qwen3_moe", "deepseek_v3"):
        sizes.update(intermediate_size=64, moe_intermediate_size=32)
    else:
        sizes["intermediate_size"] = 32
    if kind != "olmoe":
        sizes["head_dim"] = 16
    if kind == "deepseek_v3":
        sizes.update(
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
        del sizes["head_dim"]
    return sizes


def build_model(kind: str = "mixtral", seed: int = 0, *, layers: int = 2) -> PreTrainedModel:
    """A tiny MoE causal LM of ``kind`` (a key of ``KINDS``) from a config, seeded, with
    ``layers`` decoder layers."""
    import transformers  # noqa: PLC0415  (collecting the tests stays cheap)

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(KINDS)}")
    config_class, model_class = KINDS[kind]
    config = getattr(transformers, config_class)(**_sizes(kind, layers))
    torch.manual_seed(seed)
    model: PreTrainedModel = getattr(transformers, model_class)(config)
    with torch.no_grad():  # routers start at zero in some models: give them a direction
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                param.normal_(0.0, 0.2)
    return model


def global_batch(step: int) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


@dataclass(frozen=True)
class Layout:
    """A parallel layout: TP, EP and expert TP sizes (DP is what the world leaves);
    ``recompute``: every decoder layer's activations recomputed in backward
    (``transformers``' ``activation_checkpointing_enable``, non-reentrant); ``compile``: a
    ``torch.compile`` backend each decoder layer is compiled with in place (torchtitan's
    per-block compile; the parameter names stay the model's)."""

    tp: int = 1
    ep: int = 2
    etp: int = 1
    distributed_optimizer: bool = False
    recompute: bool = False
    compile: str | None = None


@dataclass
class Run:
    """Per-step losses (averaged over DP), the final full, original-named weights and (the
    one-process reference only) every step's grad norm before clipping."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)


def reference(
    kind: str = "mixtral",
    steps: int = 3,
    *,
    expert_bias: bool = False,
    aux: bool = True,
    lr: float = LR,
    layers: int = 2,
) -> Run:
    """One process, plain PyTorch: SGD on the whole global batch, with the model's own
    load-balancing loss (``aux``); ``expert_bias``: after each step every DeepSeek-V3 router's
    ``e_score_correction_bias`` moves by Megatron's rule, ``bias += RATE · sign(mean − t)``
    (t: the step's routed tokens per expert); ``layers``: as :func:`build_model`."""
    model = build_model(kind, layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    routed: dict[torch.nn.Module, torch.Tensor] = {}
    if expert_bias:
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.register_forward_hook(
                    lambda m, _a, out: routed.__setitem__(
                        m,
                        routed.get(m, 0)
                        + torch.bincount(
                            out[2].reshape(-1), minlength=m.e_score_correction_bias.numel()
                        ),
                    )
                )
    losses, norms = [], []
    for step in range(steps):
        ids = global_batch(step)
        loss = model(input_ids=ids, labels=ids, output_router_logits=aux).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        with torch.no_grad():
            for router, tokens in routed.items():
                counts = tokens.to(torch.float64)
                bias: Any = router.e_score_correction_bias
                bias += (RATE * torch.sign(counts.mean() - counts)).to(bias.dtype)
        routed.clear()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(losses, weights, norms)


# --8<-- [start:train]
def train(
    kind: str = "mixtral",
    layout: Layout | None = None,
    *,
    steps: int = 3,
    expert_bias: bool = False,
    save_dir: str | None = None,
    resume: str | None = None,
    layers: int = 2,
    aux: bool = True,
) -> Run:
    """Train the tiny model on every rank of the world at ``layout``; DP = world / TP; the
    model's own load-balancing loss (over the global batch) unless ``aux`` is False; SGD
    with momentum, the grad norm clipped at ``CLIP``; ``expert_bias``: Megatron's
    aux-loss-free balancing of DeepSeek-V3's routers. ``save_dir``: a checkpoint after the
    last step; ``resume``: a checkpoint folder to start from (written at any layout, a
    pipeline's included); ``layers``, ``aux``: as :func:`reference`."""
    layout = layout or Layout()
    pgc = mg.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
        moe_router_enable_expert_bias=expert_bias,
        moe_router_bias_update_rate=RATE,
    )
    model = build_model(kind, layers=layers)  # the same weights on every rank (same seed)
    # under TP the MoE blocks run on each rank's part of the sequence (Megatron's layout)
    plan = mc_moe.sequence_parallel_plan(model) if layout.tp > 1 else model.tp_plan
    mc_moe.parallelize(model, plan, ep_plan=model.ep_plan, config=cfg, pg_collection=pgc)
    if layout.recompute:  # the dispatch and its all-to-alls run again in each layer's backward
        model.activation_checkpointing_enable()
    if layout.compile is not None:  # then what DDP wraps: compiled blocks (torchtitan's order)
        for layer in model.model.layers:
            layer.compile(backend=layout.compile)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=layout.distributed_optimizer, overlap_grad_reduce=True
    )
    ddp = DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    opt = ShardedOptimizer(sgd, ddp, max_grad_norm=CLIP, pg_collection=pgc)
    losses: list[float] = []
    if resume is not None:  # the newest checkpoint in that folder, written at any layout
        found = Checkpointer(resume, [ddp], opt, pg_collection=pgc).load("auto")
        losses = list(found.state["losses"])
    dp = pgc.require("dp", "data")
    rows = BATCH // dp.size()
    for step in range(len(losses), steps):
        ids = global_batch(step)[dp.rank() * rows : (dp.rank() + 1) * rows]  # this DP rank's
        ddp.zero_grad_buffer()
        loss = ddp(input_ids=ids, labels=ids, output_router_logits=aux).loss
        loss.backward()
        finalize_model_grads([ddp], pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    if save_dir is not None:
        ckpt = Checkpointer(save_dir, [ddp], opt, pg_collection=pgc)
        ckpt.save(steps, state={"losses": losses}, last=True)
    ensure_params_ready(ddp.parameters())
    weights = mc_moe.full_state_dict(model, pg_collection=pgc)
    mg.destroy_model_parallel(pgc)
    return Run(losses, weights)


# --8<-- [end:train]


def main() -> None:
    """Train at TP × EP × DP (default TP=2, EP=2, world / 2 DP) and print the parity with
    one process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default="mixtral")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    parser.add_argument("--save-dir", default=None, help="a checkpoint after the last step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    layout = Layout(args.tp, args.ep, args.etp, distributed_optimizer=True)
    run = train(args.kind, layout, expert_bias=args.kind == "deepseek_v3", save_dir=args.save_dir)
    kind = args.kind
    if dist.get_rank() == 0:
        ref = reference(kind, expert_bias=kind == "deepseek_v3")
        for step, (a, b) in enumerate(zip(run.losses, ref.losses, strict=True)):
            print(f"step {step}: mc {a:.6f}  one process {b:.6f}  rel {abs(a - b) / b:.1e}")
        worst = max(float((run.weights[k] - v).abs().max()) for k, v in ref.weights.items())
        print(f"max |weight - one process| after {len(ref.losses)} SGD steps: {worst:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
