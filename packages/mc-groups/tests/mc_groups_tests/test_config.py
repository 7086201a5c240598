"""ModelParallelConfig: Megatron defaults and ``replace`` (each validation rule with its message
is in the bad-input catalogue, ``test_bad_input.py``); the shared config protocol
(``check_config`` / ``config_value``): Megatron's defaults for missing fields, the checks of
present ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mc_groups import ModelParallelConfig
from mc_groups.config import check_config, config_value


def test_defaults_match_megatron() -> None:
    c = ModelParallelConfig()
    assert c.tensor_model_parallel_size == 1
    assert c.sequence_parallel is False
    assert c.params_dtype is torch.float32
    assert c.perform_initialization is True
    assert c.use_cpu_initialization is False
    assert c.gradient_accumulation_fusion is False
    assert c.wgrad_deferral_limit == 0
    # Megatron-Core's TransformerConfig router fields and defaults
    assert c.moe_router_load_balancing_type == "aux_loss"
    assert c.moe_router_enable_expert_bias is False
    assert c.moe_router_bias_update_rate == 1e-3
    assert c.moe_router_quantile_balancing_ema == 0.0


def test_router_fields_are_checked() -> None:
    cfg = ModelParallelConfig(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5)
    assert config_value(cfg, "moe_router_bias_update_rate") == 0.5
    with pytest.raises(ValueError, match="'seq_aux' is not a load-balancing type"):
        ModelParallelConfig(moe_router_load_balancing_type="seq_aux")
    with pytest.raises(TypeError, match=r"config\.moe_router_enable_expert_bias=1 must be a bool"):
        ModelParallelConfig(moe_router_enable_expert_bias=1)  # type: ignore[arg-type]


def test_sequence_parallel_with_tp() -> None:
    c = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert c.sequence_parallel


def test_replace_validates() -> None:
    c = ModelParallelConfig(tensor_model_parallel_size=2)
    assert c.replace(sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match="no field"):
        c.replace(nonsense=1)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ModelParallelConfig().replace(sequence_parallel=True)


# ------------------------------------------------------------ the shared config protocol

# Megatron-Core's defaults (megatron/core/model_parallel_config.py and
# transformer/transformer_config.py of the release the spec documents): a config that
# lacks a field must read exactly these.
MEGATRON_DEFAULTS = {
    "sequence_parallel": False,
    "params_dtype": torch.float32,
    "use_cpu_initialization": False,
    "perform_initialization": True,
    "gradient_accumulation_fusion": False,
    "defer_embedding_wgrad_compute": False,
    "wgrad_deferral_limit": 0,
    "calculate_per_token_loss": False,
    "tensor_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "cuda_graph_impl": "none",
    "qk_layernorm": False,
    "mtp_num_layers": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_load_balancing_type": ("aux_loss",),
}


def test_a_missing_field_reads_megatrons_default() -> None:
    empty = SimpleNamespace()
    assert {name: config_value(empty, name) for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def test_a_present_field_is_checked_and_read() -> None:
    cfg = SimpleNamespace(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"])
    assert config_value(cfg, "moe_router_load_balancing_type") == ("aux_loss", "global_aux_loss")
    with pytest.raises(TypeError, match=r"config\.qk_layernorm='yes' must be a bool"):
        config_value(SimpleNamespace(qk_layernorm="yes"), "qk_layernorm")
    with pytest.raises(KeyError):  # a field mc does not know: mc's typo, not the user's
        config_value(cfg, "sequence_paralel")


@pytest.mark.parametrize(
    ("fields", "error", "fragment"),
    [
        ({}, TypeError, "config=types.SimpleNamespace lacks ['calculate_per_token_loss']: X"),
        ({"calculate_per_token_loss": 1}, TypeError, "config.calculate_per_token_loss=1"),
        ({"gtp_remat_size": 0}, ValueError, "config.gtp_remat_size=0 must be >= 1"),
        ({"params_dtype": torch.int64}, TypeError, "config.params_dtype=torch.int64"),
        ({"sequence_parallel": None}, TypeError, "config.sequence_parallel=None must be a bool"),
        ({"moe_router_quantile_balancing_ema": 1.5}, ValueError, "<= 1.0"),
        ({"moe_router_bias_update_rate": float("nan")}, ValueError, "must be finite"),
        ({"moe_router_load_balancing_type": 3}, TypeError, "a str or a list of str"),
        ({"recompute_granularity": "layer"}, ValueError, "None, 'full' or 'selective'"),
        ({"recompute_granularity": True}, TypeError, "config.recompute_granularity=True"),
        (
            {"moe_router_load_balancing_type": ["aux_loss", "global_aux_los"]},
            ValueError,
            "'global_aux_los' is not a load-balancing type; use one of ['aux_loss'",
        ),
    ],
)
def test_check_config_names_the_field_and_the_fix(
    fields: dict[str, object], error: type[Exception], fragment: str
) -> None:
    cfg = SimpleNamespace(**({"calculate_per_token_loss": False} | fields))
    if not fields:
        cfg = SimpleNamespace()
    with pytest.raises(error) as info:
        check_config(cfg, "X", required=("calculate_per_token_loss",))
    assert fragment in str(info.value)


def test_none_only_where_megatrons_type_allows_it() -> None:
    cfg = SimpleNamespace(
        expert_tensor_parallel_size=None, mtp_num_layers=None, recompute_granularity=None
    )
    assert check_config(cfg, "X") is cfg  # Optional in Megatron: None reads as None
    assert config_value(cfg, "mtp_num_layers") is None
    assert config_value(cfg, "recompute_granularity") is None
    assert config_value(SimpleNamespace(recompute_granularity="full"), "recompute_granularity")


def test_model_parallel_config_is_checked_by_the_same_table() -> None:
    with pytest.raises(TypeError, match=r"config\.fp16=1 must be a bool"):
        ModelParallelConfig(fp16=1)  # type: ignore[arg-type]
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert check_config(cfg, "X", required=tuple(MEGATRON_DEFAULTS)[:8]) is cfg
