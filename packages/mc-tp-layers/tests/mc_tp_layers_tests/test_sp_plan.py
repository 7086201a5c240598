"""``mc_tp_layers.sequence_parallel_plan`` on toy decoders (plain torch, no world, no
``transformers``): the plan it derives against plans written by hand (the Llama recipe
``examples/hf_llama.py`` carried before the helper, and OLMo-2's split q/k norms), and
each structure it cannot read, refused with the name of what it looked for. Its plans
train equal to one process on ``transformers`` models in
integration_tests/test_sp_plan_hf.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mc_tp_layers import sequence_parallel_plan
from mc_tp_layers.tp_plan import ColwiseRMSNorm, SequenceGather, SequenceParallelNorm, _sequence


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Attention(nn.Module):
    def __init__(self, qk_norm: int = 0) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
        self.v_proj, self.o_proj = nn.Linear(8, 4), nn.Linear(8, 8)
        if qk_norm:
            self.q_norm, self.k_norm = _RMSNorm(8 // qk_norm), _RMSNorm(4 // qk_norm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(self.q_proj(hidden_states))
        return out


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x))
        return out


class _Layer(nn.Module):
    def __init__(self, qk_norm: int = 0) -> None:
        super().__init__()
        self.attn, self.mlp = _Attention(qk_norm), _MLP()
        self.norm1, self.norm2 = _RMSNorm(8), _RMSNorm(8)
        self.drop = nn.Dropout(0.0)


class _Body(nn.Module):
    def __init__(self, qk_norm: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Layer(qk_norm) for _ in range(2)])
        self.norm = _RMSNorm(8)


class _Decoder(nn.Module):
    def __init__(self, qk_norm: int = 0) -> None:
        super().__init__()
        self.model = _Body(qk_norm)
        self.head = nn.Linear(8, 16)


TP_PLAN = {
    "model.embed": "embedding_rowwise",
    "model.layers.*.attn.q_proj": "colwise",
    "model.layers.*.attn.k_proj": "colwise",
    "model.layers.*.attn.v_proj": "colwise",
    "model.layers.*.attn.o_proj": "rowwise",
    "model.layers.*.mlp.up": "colwise",
    "model.layers.*.mlp.down": "rowwise",
    "head": "colwise_gather_output",
}


def test_derives_the_hand_written_recipe() -> None:
    model = _Decoder()
    model.tp_plan = TP_PLAN  # type: ignore[assignment]  # as transformers carries it
    plan = sequence_parallel_plan(model)
    assert plan == {
        **TP_PLAN,
        "model.layers.0": "sequence_scatter",
        "model.layers.*.attn": "sequence_gather",
        "model.layers.*.mlp": SequenceGather(kwarg="x"),  # its forward's first argument
        "model.layers.*.norm1": "sequence_parallel",
        "model.layers.*.norm2": "sequence_parallel",
        "model.norm": "sequence_parallel",
        "head": ("sequence_gather", "colwise_gather_output"),
    }
    assert list(plan)[:3] == ["model.embed", "model.layers.0", "model.layers.*.attn"]
    assert sequence_parallel_plan(_Decoder(), TP_PLAN) == plan  # base= instead of tp_plan


def test_full_width_qk_norms_keep_the_heads_split() -> None:
    gathered = {
        **TP_PLAN,
        "model.layers.*.attn.q_proj": "colwise_gather_output",
        "model.layers.*.attn.k_proj": "colwise_gather_output",
        "model.layers.*.attn.v_proj": "colwise_gather_output",
        "model.layers.*.attn.o_proj": "rowwise_split_input",
    }
    plan = sequence_parallel_plan(_Decoder(qk_norm=1), gathered)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert plan[f"model.layers.*.attn.{name}"] == "colwise"
    assert plan["model.layers.*.attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.attn.q_norm"] == "colwise_rmsnorm"
    assert plan["model.layers.*.attn.k_norm"] == "colwise_rmsnorm"
    kept = sequence_parallel_plan(_Decoder(qk_norm=1), gathered, split_qk_norms=False)
    assert kept["model.layers.*.attn.q_proj"] == "colwise_gather_output"
    assert "model.layers.*.attn.q_norm" not in kept  # replicated: every rank runs it whole
    # per-head norms (narrower than the projections) are not OLMo-2's: left as they are
    per_head = sequence_parallel_plan(_Decoder(qk_norm=2), gathered)
    assert per_head["model.layers.*.attn.q_proj"] == "colwise_gather_output"
    assert ColwiseRMSNorm() not in per_head.values()


def test_a_model_without_head_gathers_after_its_final_norm() -> None:
    """A bare decoder (no LM head after the layers, as ``transformers``' ``LlamaModel``):
    the hidden states leave whole, gathered along the sequence after the final norm."""
    body = _Decoder().model
    base = {k.removeprefix("model."): v for k, v in TP_PLAN.items() if k != "head"}
    plan = sequence_parallel_plan(body, base)
    with_head = sequence_parallel_plan(_Decoder(), TP_PLAN)
    expected = {k.removeprefix("model."): v for k, v in with_head.items() if k != "head"}
    assert plan == {**expected, "norm": SequenceParallelNorm(gather_output=True)}
    assert SequenceParallelNorm(gather_output=True) not in with_head.values()


def test_gather_output_is_checked() -> None:
    """A non-bool ``gather_output`` is refused when the style is built; a module under
    ``gather_output=True`` that returns no tensor is refused by name before any
    collective (the gather is never called)."""
    with pytest.raises(TypeError, match="gather_output='yes' must be a bool"):
        SequenceParallelNorm(gather_output="yes")  # type: ignore[arg-type]

    def gather(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the gather ran on a non-tensor output")

    hook = _sequence.output_hook("model.norm", gather)
    with pytest.raises(ValueError, match=r"model\.norm returned tuple, not a tensor"):
        hook(nn.Identity(), (), (torch.ones(2),))
    assert torch.equal(
        _sequence.output_hook("n", lambda x: 2 * x)(nn.Identity(), (), torch.ones(2)),
        2 * torch.ones(2),
    )


def _with(change: str) -> tuple[nn.Module, dict[str, Any]]:
    model, plan = _Decoder(), dict(TP_PLAN)
    if change == "no list":
        model.model.layers = nn.Sequential(*model.model.layers)  # type: ignore[assignment]
    elif change == "two lists":
        model.extra = nn.ModuleList([_MLP()])
        plan["extra.*.up"] = "colwise"
    elif change == "loose linear":
        model.model.layers[0].gate = nn.Linear(8, 8)
    elif change == "own parameter":
        model.model.layers[1].scale = nn.Parameter(torch.ones(8))
    elif change == "no rowwise":
        plan.pop("model.layers.*.mlp.down")
    elif change == "no head":
        plan.pop("head")
    elif change == "per-head norm":
        model = _Decoder(qk_norm=2)
    elif change == "base model without norm":
        model = _Decoder().model  # type: ignore[assignment]
        del model.norm
        plan = {k.removeprefix("model."): v for k, v in plan.items() if k != "head"}
    elif change == "after":
        model.score = nn.Linear(8, 2)
    elif change == "sequence base":
        plan["model.norm"] = "sequence_parallel"
    elif change == "layer converted":
        model.model.layers[0].proj = nn.Linear(8, 8)
        plan["model.layers.0.proj"] = "colwise"
    return model, plan


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            "no list",
            ["one nn.ModuleList or nn.ModuleDict of decoder layers", "found none", "layers="],
        ),
        ("two lists", ["found ['model.layers', 'extra']", "layers="]),
        (
            "loose linear",
            ["model.layers.0.gate (torch.nn.modules.linear.Linear)", "nor a norm", "token by"],
        ),
        ("own parameter", ["model.layers.1", "parameters of its own"]),
        ("no rowwise", ["model.layers.0.mlp", "no rowwise output layer"]),
        ("no head", ["head (torch.nn.modules.linear.Linear)", "no plan entry", "'colwise_ga"]),
        (
            "base model without norm",
            ["neither a colwise layer", "nor a final norm", "after layers", "split along"],
        ),
        ("per-head norm", ["q_norm", "heads split", "give them 'replicated_with_grad_all"]),
        ("after", ["score (torch.nn.modules.linear.Linear)", "registered after model.layers"]),
        ("sequence base", ["model.norm", "sequence style already"]),
        ("layer converted", ["model.layers.0.proj", "converted by the plan itself"]),
    ],
)
def test_unreadable_structures_are_named(change: str, words: list[str]) -> None:
    model, plan = _with(change)
    with pytest.raises(ValueError) as info:
        sequence_parallel_plan(model, plan)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        sequence_parallel_plan("model", TP_PLAN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no tp_plan"):
        sequence_parallel_plan(_Decoder())
    with pytest.raises(TypeError, match="non-empty mapping"):
        sequence_parallel_plan(_Decoder(), {})
    with pytest.raises(ValueError, match="matches no module"):
        sequence_parallel_plan(_Decoder(), {**TP_PLAN, "model.nope": "colwise"})
    with pytest.raises(ValueError, match=r"not an nn\.ModuleList"):
        sequence_parallel_plan(_Decoder(), TP_PLAN, layers="model.norm")
    with pytest.raises(TypeError, match="split_qk_norms"):
        sequence_parallel_plan(_Decoder(), TP_PLAN, split_qk_norms=1)  # type: ignore[arg-type]
    model, plan = _with("two lists")
    chosen = sequence_parallel_plan(model, plan, layers="model.layers")
    assert chosen["model.layers.0"] == "sequence_scatter"
