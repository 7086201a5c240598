"""``split_model`` / ``stage_module`` / ``decoder_stages`` without a world: the stages of a
``transformers`` Llama and of a torchtitan-style model (blocks in a ``ModuleDict``, a
``forward`` that skips missing modules) compose to the whole model's forward exactly (the
same ops on the same weights in the same order: ``torch.equal``), keep the model's
parameter names, and mark the copies of a weight tied across stages; bad splits are
refused naming the module and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mc_groups.errors import InputTypeError, InputValueError
from mc_train import decoder_stages
from mc_train.split import stage_module, tied_parameter_names
from mc_train_tests import _hf


class _Titan(nn.Module):
    """torchtitan's shape: blocks in a ModuleDict, modules a stage lacks are skipped."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings: nn.Module | None = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(3)})
        self.norm: nn.Module | None = nn.LayerNorm(8)
        self.output: nn.Module | None = nn.Linear(8, 16)
        self._act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings else x
        for layer in self.layers.values():
            h = self._act(layer(h))
        h = self.norm(h) if self.norm else h
        out: torch.Tensor = self.output(h) if self.output else h
        return out


def test_decoder_stages_of_a_llama() -> None:
    pytest.importorskip("transformers", reason="splits a transformers Llama")
    model = _hf.build(layers=5)
    assert decoder_stages(model, 2) == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.layers.4", "model.norm", "lm_head"],
    ]
    assert decoder_stages(model, 5, layers="model.layers")[2] == ["model.layers.2"]
    with pytest.raises(InputValueError, match="holds 5 blocks, fewer than num_stages=6"):
        decoder_stages(model, 6)
    with pytest.raises(InputValueError, match=r"LlamaRMSNorm, not a ModuleList or ModuleDict"):
        decoder_stages(model, 2, layers="model.norm")


@pytest.mark.parametrize("tie", [False, True])
def test_llama_stages_compose_to_the_model(tie: bool) -> None:
    pytest.importorskip("transformers", reason="splits a transformers Llama")
    model = _hf.build(tie=tie)
    stages = decoder_stages(model, 3)
    parts = [stage_module(model, stages, i) for i in range(3)]
    ids = _hf.batch(0)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        x = parts[0](input_ids=ids, use_cache=False).logits
        for part in parts[1:]:
            x = part(inputs_embeds=x, use_cache=False).logits
    assert torch.equal(x, whole)
    names = [{n for n, _ in p.named_parameters()} for p in parts]
    assert names[1] == {n for n, _ in model.named_parameters() if ".layers.2." in n}
    assert set().union(*names) >= {n for n, _ in model.named_parameters()}
    tied = [tied_parameter_names(p) for p in parts]
    if tie:
        assert tied == [("model.embed_tokens.weight",), (), ("lm_head.weight",)]
        assert getattr(parts[2].get_parameter("lm_head.weight"), "shared_embedding", False)
    else:
        assert tied == [(), (), ()]
    assert not any(getattr(p, "shared_embedding", False) for p in model.parameters())


def test_titan_style_stages_keep_global_names() -> None:
    model = _Titan()
    stages = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "output"]]
    assert decoder_stages(model, 2) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "norm", "output"],
    ]
    first, last = stage_module(model, stages, 0), stage_module(model, stages, 1)
    assert [n for n, _ in last.named_parameters()][:2] == ["layers.1.weight", "layers.1.bias"]
    x = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        assert torch.equal(last(first(x)), model(x))


def _bad(model: nn.Module, stages: object, index: int = 0) -> None:
    stage_module(model, stages, index)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stages", "error", "needle"),
    [
        (
            [["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"], []],
            InputValueError,
            "stages[1] is empty: the split would leave pipeline stage 1",
        ),
        (
            [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm"]],
            InputValueError,
            "parameter 'output.weight' is in no stage's modules",
        ),
        ([["tok_embeddings", "layers.9"]], InputValueError, "names 'layers.9', which is not"),
        (
            [["tok_embeddings", "layers"], ["layers.1", "norm", "output"]],
            InputValueError,
            "names 'layers.1', which is inside it",
        ),
        (
            [["tok_embeddings", "norm"], ["norm", "layers", "output"]],
            InputValueError,
            "'norm' is in stages[0] and stages[1]",
        ),
        ("layers", InputTypeError, "a non-empty list of lists of module names"),
        (
            [["tok_embeddings", "layers", "norm", "output"], ["_act"]],
            InputValueError,
            "stages[1] = ['_act'] holds no parameters: the split would leave",
        ),
    ],
)
def test_bad_splits_are_refused(stages: object, error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as raised:
        _bad(_Titan(), stages)
    assert needle in str(raised.value), str(raised.value)


def test_a_weight_tied_across_middle_stages_is_refused() -> None:
    model = _Titan()
    model.layers["1"].weight = model.layers["0"].weight  # used by stages 0 and 1 of 3
    stages = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "norm", "output"]]
    with pytest.raises(InputValueError, match=r"is used by stages \[0, 1\]: a weight shared"):
        stage_module(model, stages, 0)
