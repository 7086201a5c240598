"""``mc_tp_layers.parallelize`` on ``transformers`` models, against one process.

Tiny ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (q/k/v biases) built from a config with a
fixed seed (``examples/hf_llama.py``), converted by the model's own ``tp_plan`` (plus the
sequence-parallel entries of ``sequence_parallel_plan`` when SP is on), trained with mc DDP
(distributed optimizer, overlapped reduce and param gather), ``finalize_model_grads`` and
SGD for 3 steps on the same global batch as the 1-process reference. Localizes:

- the conversion from existing weights (column rows and bias split, row columns split, row
  bias whole, vocabulary rows split, a tied embedding/LM-head weight kept tied);
- sequence parallelism on batch-first activations: the residual stream split along dim 1,
  gathered before attention / MLP / LM head, reduce-scattered by o_proj / down_proj, the
  norms' grads summed over TP by finalize (a missing sum shows in the norm weights);
- the vocabulary-parallel LM head + loss (``colwise`` head, logits never gathered);
- back to one piece: ``full_state_dict`` keys and shapes load strictly into the unconverted
  model, and a ``save_pretrained`` / ``from_pretrained`` round trip keeps every tensor;
- the meta device (each rank allocates only its shards, then loads the full state dict),
  a packed ``[gate; up]`` projection (``packed_colwise``), sequence parallelism on
  ``[s, b, h]`` (``sequence_dim=0``) around it, and the bad plans, each refused before any
  weight changes;
- the collectives of one step (recorded, counted by hand in the test): SP on, SP off with
  the block entries (one input-grad all-reduce per block), the model's own ``tp_plan``;
- ``rowwise_split_input``, ``padding_idx``, and greedy generation (KV cache) at TP=2.

Most of the time is ``import transformers`` in each rank (about 5 s of CPU each here).

Tolerances (fp32, gloo): loss per step ≤ 1e-5 relative, final weights ≤ 1e-6 absolute,
while every reference tensor moves ≥ 1e-4 (checked), so a lost or mis-scaled update fails.
Measured here: loss ≤ 1.2e-7 relative, weights ≤ 1.2e-7; packed, padding-row and
sequence-first checks ≤ 1e-6.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.hf_llama import Run, build_model, global_batch, reference
from mc_groups.testing import RankPools, error_kind

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS = 3
# (kind, sequence_parallel, vocab-parallel loss, tied embeddings); TP=2 on 2 ranks, TP=2 ×
# DP=2 on 4. SP off on 4 ranks: with sequence_parallel_plan's block entries (one input-grad
# all-reduce per block).
CASES_2 = [
    ("llama", False, False, False),  # the model's own tp_plan, as transformers gives it
    ("qwen2", True, True, True),
]
CASES_4 = [
    ("llama", True, False, False),
    ("qwen2", False, True, False),
]


def _train_cases(cases: list[tuple[str, bool, bool, bool]]) -> list[Run] | None:
    import torch.distributed as dist

    from examples.hf_llama import train

    torch.set_num_threads(1)
    blocks = dist.get_world_size() == 4
    runs = [
        train(
            2,
            kind=k,
            sequence_parallel=sp,
            vocab_parallel_loss=vp,
            steps=STEPS,
            tie=tie,
            block_entries=sp or blocks,
        )
        for k, sp, vp, tie in cases
    ]
    return runs if dist.get_rank() == 0 else None


def _check(run: Run, case: tuple[str, bool, bool, bool], tmp_path: Path | None) -> None:
    kind, _, _, tie = case
    ref = reference(kind, STEPS, tie=tie)
    start = build_model(kind, tie=tie).state_dict()
    moved = min(float((ref.weights[k] - start[k]).abs().max()) for k in ref.weights)
    assert moved >= 1e-4, f"a reference tensor moves only {moved:.1e}: the check is too weak"
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert rel <= 1e-5, (case, run.losses, ref.losses)
    assert sorted(run.weights) == sorted(ref.weights)
    worst = 0.0
    for key, value in ref.weights.items():
        diff = float((run.weights[key] - value).abs().max())
        assert diff <= 1e-6, (case, key, diff)
        worst = max(worst, diff)
    print(f"{case}: loss rel {rel:.1e}, weights {worst:.1e}, smallest move {moved:.1e}")
    # Back to one piece: the gathered dict loads strictly and survives save_pretrained.
    plain = build_model(kind, seed=99, tie=tie)
    plain.load_state_dict(run.weights, strict=True)
    if tmp_path is None:
        return
    plain.save_pretrained(tmp_path / kind)
    again = type(plain).from_pretrained(tmp_path / kind)
    for key, value in again.state_dict().items():
        assert torch.equal(value, run.weights[key]), key


@pytest.mark.timeout(240)
def test_hf_models_match_one_process(rank_pools: RankPools, tmp_path: Path) -> None:
    for cases, world in ((CASES_2, 2), (CASES_4, 4)):
        runs = rank_pools.get(world).run(_train_cases, cases)[0]
        assert runs is not None
        for run, case in zip(runs, cases, strict=True):
            _check(run, case, tmp_path if world == 2 else None)


def _schedules() -> dict[str, dict[str, Any]]:
    """One forward/backward of the Llama at TP=2 (no DDP), its collectives recorded: SP on
    and off with the SP plan, and SP off with the model's own tp_plan."""
    return {
        "sp": _schedule(sequence_parallel=True, block_entries=True),
        "blocks": _schedule(sequence_parallel=False, block_entries=True),
        "tp_plan": _schedule(sequence_parallel=False, block_entries=False),
    }


def _schedule(*, sequence_parallel: bool, block_entries: bool) -> dict[str, Any]:
    import mc_groups as mg
    from mc_tp_layers import parallelize, sequence_parallel_plan

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    model = build_model("llama")
    plan = sequence_parallel_plan(model) if block_entries else model.tp_plan
    parallelize(model, plan, config=cfg, pg_collection=pgc)
    ids = global_batch(0)
    model(input_ids=ids, labels=ids).loss.backward()  # the agreement exchange happens here
    with mg.record_collectives() as log:
        loss = model(input_ids=ids, labels=ids).loss
        forward = Counter(r.op for r in log)
        loss.backward()
    backward = Counter(r.op for r in log) - forward
    tp = mg.group_ranks(pgc.require("tp", "test"))
    groups = {r.group_ranks for r in log}
    norm = model.get_parameter("model.layers.0.input_layernorm.weight")
    mg.destroy_model_parallel(pgc)
    return {
        "forward": dict(forward),
        "backward": dict(backward),
        "groups": groups,
        "tp": tp,
        "norm_tagged": bool(getattr(norm, "sequence_parallel", False)),
    }


def _generate() -> tuple[list[list[int]], list[list[int]]]:
    """Greedy generation (KV cache, one token per step) at TP=2 without SP, and in one
    process."""
    import mc_groups as mg
    from mc_tp_layers import parallelize

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    ref, model = build_model("llama"), build_model("llama")
    parallelize(model, model.tp_plan, config=cfg, pg_collection=pgc)
    prompt = global_batch(0)[:1, :5]
    tokens = _greedy(model, prompt)
    mg.destroy_model_parallel(pgc)
    return tokens, _greedy(ref, prompt)


def _greedy(model: Any, prompt: torch.Tensor) -> list[list[int]]:
    """6 greedy tokens after ``prompt`` (``model``: a causal LM with ``generate``)."""
    tokens: list[list[int]] = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    return tokens


def _bad_plans() -> list[tuple[str, str, bool]]:
    """Each bad plan's error, and whether the model's weights were left untouched."""
    import mc_groups as mg
    from mc_tp_layers import parallelize

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    base = {"model.layers.*.self_attn.q_proj": "colwise"}
    plans: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({**base, "model.layers.*.attn.nope": "colwise"}, {}),
        ({**base, "model.layers.*.mlp.up_proj": "megatron_magic"}, {}),
        ({**base, "model.layers.*.input_layernorm": "colwise"}, {}),
        ({**base, "model.embed_tokens": "rowwise"}, {}),
        ({**base, "model.layers.*.mlp.up_proj": "embedding_rowwise"}, {}),
        ({"model.layers.*.self_attn.k_proj": "colwise"}, {"num_key_value_heads": 1}),
        ({"model.embed_tokens": "embedding_rowwise"}, {"vocab_size": 63}),
        ({**base, "model.embed_tokens": "embedding_rowwise", "lm_head": "rowwise"}, {"tie": 1}),
        ({**base, "model.embed_tokens": "embedding_rowwise"}, {"tie": 1}),
        (base, {"sp": 1}),  # colwise under SP with nothing gathering its input
        (
            {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise"},
            {"tie": 1, "pad_token_id": 3},
        ),
    ]
    out = []
    sp_cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    for plan, change in plans:
        config = sp_cfg if change.pop("sp", False) else cfg
        model = _model(change)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            parallelize(model, plan, config=config, pg_collection=pgc)
            message, kind = "no error", ""
        except (ValueError, TypeError) as err:
            message, kind = str(err), error_kind(err)
        after = model.state_dict()
        untouched = sorted(after) == sorted(before) and all(
            torch.equal(after[k], v) and type(model.get_submodule(k.rpartition(".")[0])) is not None
            for k, v in before.items()
        )
        untouched = untouched and not any("Parallel" in type(m).__name__ for m in model.modules())
        out.append((kind, message, untouched))
    mg.destroy_model_parallel(pgc)
    return out


def _model(change: dict[str, Any]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": bool(change.pop("tie", False)),
    }
    sizes.update(change)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes))


BAD_PLAN_MESSAGES = [
    ("ValueError", ["model.layers.*.attn.nope", "matches no module", "fix the pattern"]),
    ("ValueError", ["megatron_magic", "does not offer", "colwise"]),
    ("TypeError", ["input_layernorm", "colwise", "nn.Linear", "LlamaRMSNorm"]),
    ("TypeError", ["embed_tokens", "rowwise", "use 'embedding_rowwise'"]),
    ("TypeError", ["up_proj", "embedding_rowwise", "nn.Embedding", "Linear"]),
    ("ValueError", ["k_proj", "1 heads of head_dim=8", "TP size 2"]),
    ("ValueError", ["embed_tokens", "num_embeddings=63", "pad_to_multiple_of=2"]),
    ("ValueError", ["tied", "lm_head", "embed_tokens", "split by columns", "split by rows"]),
    ("ValueError", ["tied", "lm_head", "replicated", "untie"]),
    (
        "ValueError",
        ["q_proj", "sequence parallelism", "'model.layers.0.self_attn': 'sequence_gather'"],
    ),
    ("ValueError", ["embed_tokens", "padding_idx=3", "tied", "untie"]),
]


def _packed_and_meta() -> dict[str, Any]:
    """A packed [gate; up] MLP at TP=2 against one process; a Llama parallelized on meta."""
    import mc_groups as mg
    from mc_tp_layers import full_state_dict, load_full_state_dict, parallelize

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    mlp, x = _PackedMLP(), torch.randn(3, 5, 8)
    ref = _PackedMLP()
    ref.load_state_dict(mlp.state_dict())
    ref_out = ref(x)
    ref_out.square().sum().backward()
    parallelize(
        mlp, {"gate_up": "packed_colwise", "down": "rowwise"}, config=cfg, pg_collection=pgc
    )
    out = mlp(x)
    out.square().sum().backward()
    with torch.no_grad():
        for param in list(mlp.parameters()) + list(ref.parameters()):
            assert param.grad is not None
            param.sub_(0.1 * param.grad)
    packed = {
        "out": float((out - ref_out).detach().abs().max()),
        "weights": max(
            float((v - ref.state_dict()[k]).abs().max()) for k, v in full_state_dict(mlp).items()
        ),
        "shard": tuple(mlp.gate_up.weight.shape),
    }
    packed["sp_dim0"] = _sequence_first_sp(pgc)
    packed["padding"] = _padding_row(pgc)
    packed["split_input"] = _split_input(pgc)
    with torch.device("meta"):
        meta = build_model("llama")
    parallelize(meta, meta.tp_plan, config=cfg, pg_collection=pgc)
    on_meta = all(p.device.type == "meta" for p in meta.parameters())
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    meta.to_empty(device="cpu")
    full = build_model("llama")
    load_full_state_dict(meta, full.state_dict())
    inv_freq = "model.rotary_emb.inv_freq"  # a non-persistent buffer
    meta.get_buffer(inv_freq).copy_(full.get_buffer(inv_freq))
    ids = global_batch(0)
    logits = float((meta(input_ids=ids).logits - full(input_ids=ids).logits).abs().max())
    mg.destroy_model_parallel(pgc)
    return {"packed": packed, "on_meta": on_meta, "shapes": shapes, "logits": logits}


def _sequence_first_sp(pgc: Any) -> float:
    """A residual block around the packed MLP on ``[s, b, h]`` with SP (``sequence_dim=0``):
    this rank's output rows and the gathered weight grads (the row bias's summed over TP, as
    finalize_model_grads does for params tagged ``sequence_parallel``) against one process."""
    import mc_groups as mg
    from mc_tp_layers import full_state_dict, parallelize

    torch.manual_seed(1)
    block, x = _Block(), torch.randn(4, 3, 8)
    ref = _Block()
    ref.load_state_dict(block.state_dict())
    ref_out = ref(x)
    ref_out.square().sum().backward()
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    plan = {"mlp": "sequence_gather", "mlp.gate_up": "packed_colwise", "mlp.down": "rowwise"}
    parallelize(block, plan, config=cfg, pg_collection=pgc, sequence_dim=0)
    tp = pgc.require("tp", "test")
    out = block(x.chunk(2, dim=0)[tp.rank()])
    out.square().sum().backward()
    bias = block.get_parameter("mlp.down.bias")
    assert bias.grad is not None
    assert getattr(bias, "sequence_parallel", False)
    mg.all_reduce(bias.grad, tp, label="test: SP bias grad")
    for param in block.parameters():
        assert param.grad is not None
        param.data = param.grad  # gather the grads as if they were the weights
    grads = full_state_dict(block)
    worst = float((out - ref_out.chunk(2, dim=0)[tp.rank()]).detach().abs().max())
    for name, param in ref.named_parameters():
        assert param.grad is not None
        worst = max(worst, float((grads[name] - param.grad).abs().max()))
    return worst


def _split_input(pgc: Any) -> float:
    """``rowwise_split_input`` after a replicated layer at TP=2: output and gathered grads
    (the first layer's grad complete through the split's backward all-gather)."""
    import mc_groups as mg
    from mc_tp_layers import full_state_dict, parallelize

    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 8)
    ref_out = ref(x)
    ref_out.square().sum().backward()
    parallelize(model, {"2": "rowwise_split_input"}, config=cfg, pg_collection=pgc)
    out = model(x)
    out.square().sum().backward()
    worst = float((out - ref_out).detach().abs().max())
    for param in model.parameters():
        assert param.grad is not None
        param.data = param.grad
    grads = full_state_dict(model)
    for name, param in ref.named_parameters():
        assert param.grad is not None
        worst = max(worst, float((grads[name] - param.grad).abs().max()))
    return worst


def _padding_row(pgc: Any) -> float:
    """An embedding with ``padding_idx`` (on rank 1's half of the vocabulary) at TP=2: the
    gathered grad against one process's, whose padding row is zero."""
    import mc_groups as mg
    from mc_tp_layers import full_state_dict, parallelize

    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4, padding_idx=5), torch.nn.Linear(4, 3))
    ref = torch.nn.Sequential(torch.nn.Embedding(8, 4, padding_idx=5), torch.nn.Linear(4, 3))
    ref.load_state_dict(model.state_dict())
    ids = torch.tensor([[5, 1, 6, 5], [2, 5, 7, 0]])
    ref(ids).square().sum().backward()
    parallelize(model, {"0": "embedding_rowwise"}, config=cfg, pg_collection=pgc)
    model(ids).square().sum().backward()
    weight = model.get_parameter("0.weight")
    assert weight.grad is not None
    weight.data = weight.grad
    ref_grad = ref.get_parameter("0.weight").grad
    assert ref_grad is not None
    assert float(ref_grad[5].abs().max()) == 0.0
    return float((full_state_dict(model)["0.weight"] - ref_grad).abs().max())


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _PackedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)  # type: ignore[no-any-return]


class _PackedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(8, 2 * 12)
        self.down = torch.nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down(torch.nn.functional.silu(gate) * up)
        return out


@pytest.mark.timeout(120)
def test_sp_schedule_bad_plans_packed_and_meta(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    schedules = pool.run(_schedules)[0]
    # SP on, forward, per decoder layer (2): all-gather before attention and MLP,
    # reduce-scatter after o_proj and down_proj; the embedding's all-reduce; the LM head's
    # sequence all-gather and its colwise_gather_output all-gather. Backward: each gather's
    # reduce-scatter (5), each reduce-scatter's all-gather (4), the scatter at layer 0's
    # all-gather (1); no dX all-reduce in the colwise layers (the gathers' reduce-scatters
    # sum them).
    sp = schedules["sp"]
    assert sp["forward"] == {"all_gather": 6, "reduce_scatter": 4, "all_reduce": 1}
    assert sp["backward"] == {"all_gather": 5, "reduce_scatter": 5}
    assert sp["norm_tagged"]
    # SP off, same plan: forward all-reduces after o_proj, down_proj (2 × 2) and the
    # embedding, the LM head's output all-gather; backward one all-reduce of each block's
    # input grad (2 × 2 + the LM head). The model's own tp_plan: one dX all-reduce per
    # colwise layer instead (2 × 5 + the LM head).
    blocks, own = schedules["blocks"], schedules["tp_plan"]
    assert blocks["forward"] == own["forward"] == {"all_reduce": 5, "all_gather": 1}
    assert blocks["backward"] == {"all_reduce": 5}
    assert own["backward"] == {"all_reduce": 11}
    assert not blocks["norm_tagged"]
    for schedule in schedules.values():
        assert schedule["groups"] == {schedule["tp"]}
    tokens, ref_tokens = pool.run(_generate)[0]
    assert tokens == ref_tokens
    assert len(tokens[0]) == 11
    for (kind, message, untouched), (want, words) in zip(
        pool.run(_bad_plans)[0], BAD_PLAN_MESSAGES, strict=True
    ):
        assert kind == want, message
        for word in words:
            assert word in message, (word, message)
        assert untouched, message
    result = pool.run(_packed_and_meta)[0]
    packed = result["packed"]
    assert packed["shard"] == (12, 8)  # [gate_r; up_r]: 6 + 6 rows of 24
    assert packed["out"] <= 1e-6, packed
    assert packed["weights"] <= 1e-6, packed
    assert packed["sp_dim0"] <= 1e-5, packed
    assert packed["padding"] <= 1e-6, packed
    assert packed["split_input"] <= 1e-6, packed
    assert result["on_meta"]
    assert result["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (16, 32)
    assert result["shapes"]["model.layers.0.self_attn.o_proj.weight"] == (32, 16)
    assert result["shapes"]["model.embed_tokens.weight"] == (32, 32)
    assert result["logits"] <= 1e-5


def test_docs_show_the_example_verbatim() -> None:
    root = Path(__file__).resolve().parents[1]
    source = (root / "examples" / "hf_llama.py").read_text(encoding="utf-8")
    page = (root / "docs" / "parallelize.md").read_text(encoding="utf-8")
    for name in ("train",):
        start = source.index(f"# --8<-- [start:{name}]\n") + len(f"# --8<-- [start:{name}]\n")
        block = source[start : source.index(f"# --8<-- [end:{name}]")].rstrip()
        assert block in page, f"docs/parallelize.md lost the example's {name!r} block"
