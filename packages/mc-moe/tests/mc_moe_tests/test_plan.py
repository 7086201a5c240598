"""``mc_moe.sequence_parallel_plan`` and the plan checks of ``mc_moe.parallelize`` on tiny
``transformers`` MoE models (no ranks: the plan is read from the module tree).

Localizes what each MoE model's plan must hold (against entries written by hand from the
models' code): each MoE block runs on this rank's part of the sequence (no
``sequence_gather`` on it), its router tagged ``sequence_parallel``, DeepSeek-V3's shared
experts gathered like an MLP and its latent attention split by heads (q_b / kv_b column,
o row, the latent down projections and their norms replicated with their grads summed over
TP), the expert entries kept for ``parallelize``; the dense entries of layers that are all
MoE skipped with one warning (Qwen3-MoE's and DeepSeek-V3's ``mlp.gate_proj``); gpt-oss
refused by name at TP > 1; a misspelt entry in a model without MoE layers still an error.
"""

from __future__ import annotations

import warnings

import pytest

import mc_moe
from examples.hf_moe import build_model
from mc_tp_layers.tp_plan import Colwise, SequenceGather

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

L = "model.layers.*."


def _plan(kind: str) -> tuple[dict[str, object], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = mc_moe.sequence_parallel_plan(build_model(kind))
    return plan, [str(w.message) for w in caught if w.category is mc_moe.MoEPlanWarning]


def test_mixtral_moe_block_runs_on_the_split_sequence() -> None:
    plan, warned = _plan("mixtral")
    assert warned == []
    assert plan[L + "mlp.gate"] == "sequence_parallel"
    assert L + "mlp" not in plan  # the block is not gathered
    assert plan[L + "self_attn"] == "sequence_gather"
    assert plan["model.layers.0"] == "sequence_scatter"
    expert = {k: v for k, v in plan.items() if ".experts" in k}
    assert expert == {
        L + "mlp.experts.gate_up_proj": "packed_colwise",
        L + "mlp.experts.down_proj": "rowwise",
        L + "mlp.experts": "moe_tp_experts",
    }


def test_deepseek_v3_shared_experts_and_latent_attention() -> None:
    plan, warned = _plan("deepseek_v3")
    assert len(warned) == 1
    assert "mlp.gate_proj" in warned[0]
    attn = L + "self_attn."
    assert plan[attn + "q_b_proj"] == Colwise(block_input=False)
    assert plan[attn + "kv_b_proj"] == Colwise(block_input=False)
    assert plan[attn + "o_proj"] == "rowwise"
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        assert plan[attn + name] == "replicated_with_grad_allreduce", name
    assert plan[L + "mlp.shared_experts"] == SequenceGather(kwarg="x")
    assert plan[L + "mlp.shared_experts.down_proj"] == "rowwise"
    assert plan[L + "mlp.gate"] == "sequence_parallel"
    assert L + "mlp.gate_proj" not in plan


def test_qwen3_moe_dense_entries_skipped_once() -> None:
    plan, warned = _plan("qwen3_moe")
    assert len(warned) == 1
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert f"'{L}mlp.{name}'" in warned[0]
        assert L + "mlp." + name not in plan
    assert plan[L + "self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_gpt_oss_refused_at_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match=r"self_attn\.sinks .*tensor_model_parallel_size=1"):
        mc_moe.sequence_parallel_plan(build_model("gpt_oss"))


def test_unmatched_entry_without_moe_layers_stays_an_error() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    base = {**model.tp_plan, "model.layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(ValueError, match="matches nothing"):
        mc_moe.sequence_parallel_plan(model, base)
    base = {**model.tp_plan, "model.layers.*.mlp.gate_projj": "colwise"}
    with pytest.raises(ValueError, match="matches no module"):
        mc_moe.sequence_parallel_plan(model, base)
