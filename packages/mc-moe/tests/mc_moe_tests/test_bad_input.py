"""mc-moe's bad-input catalogue: each case a ValueError/TypeError naming the argument, the
value and the fix, raised before any module changes and before any collective (listed in
``docs/bad_inputs.md``).

Every case runs on 4 gloo ranks inside ``record_collectives()``; the log must stay empty
(the check ran before anything was communicated) and, where a model was given, its state
dict must be unchanged (nothing was converted). The groups are built outside the recorder:
EP = 2, TP = 2 × EP = 2, and PP = 2 × EP = 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from mc_groups.testing import RankPools, error_kind

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")


def _loose(value: object) -> Any:
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


class Case(NamedTuple):
    """``call(model, groups)`` must raise ``error`` with every fragment of ``words``;
    ``kind`` the model it gets (``mixtral3``: Mixtral with 3 experts; ``mixtral_aux``: with
    ``config.output_router_logits=True``), ``layout`` the groups (``ep2``: EP = 2; ``tp2``:
    TP = 2 × EP = 2; ``pp2``: PP = 2 × EP = 2).
    ``doc_call`` / ``doc_input``: the catalogue's cells."""

    call: Callable[[Any, Any], object]
    error: str
    words: tuple[str, ...]
    doc_call: str
    doc_input: str
    kind: str = "mixtral"
    layout: str = "ep2"


def _parallelize(model: Any, pgc: Any, **kw: Any) -> object:
    import mc_groups as mg
    import mc_moe

    cfg = kw.pop("config", None) or mg.ModelParallelConfig(expert_model_parallel_size=2)
    plan = kw.pop("plan", model.tp_plan)
    ep_plan = kw.pop("ep_plan", model.ep_plan)
    return mc_moe.parallelize(model, plan, ep_plan=ep_plan, config=cfg, pg_collection=pgc, **kw)


def _bias_config() -> Any:
    import mc_groups as mg

    return mg.ModelParallelConfig(expert_model_parallel_size=2, moe_router_enable_expert_bias=True)


def _pp_config() -> Any:
    import mc_groups as mg

    return mg.ModelParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2)


def _no_sp_config() -> Any:
    import mc_groups as mg

    return mg.ModelParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)


CASES: dict[str, Case] = {
    "experts_not_divisible": Case(
        _parallelize,
        "ValueError",
        ("3 experts cannot be split over an EP group of 2", "expert_model_parallel_size"),
        "`mc_moe.parallelize` at EP = 2",
        "a model of 3 experts",
        kind="mixtral3",
    ),
    "ep_without_ep_plan": Case(
        lambda m, g: _parallelize(m, g, plan={}, ep_plan=None),
        "ValueError",
        ("pg_collection.ep has 2 ranks but ep_plan=None", "ep_plan=model.ep_plan"),
        "`mc_moe.parallelize`",
        "EP = 2, `ep_plan=None`",
    ),
    "tp_without_sequence_parallel": Case(
        lambda m, g: _parallelize(m, g, config=_no_sp_config()),
        "ValueError",
        ("tensor parallelism (tp=2)", "config.sequence_parallel=True"),
        "`mc_moe.parallelize` at TP = 2",
        "`config.sequence_parallel=False`",
        layout="tp2",
    ),
    "removed_style": Case(
        lambda m, g: _parallelize(
            m, g, ep_plan={**m.ep_plan, "model.layers.*.mlp.gate": "ep_router"}
        ),
        "ValueError",
        ("ep_plan['model.layers.*.mlp.gate'] = 'ep_router'", "transformers removed this style"),
        "`mc_moe.parallelize`",
        "`'ep_router'` in `ep_plan`",
    ),
    "ep_plan_dense_entry": Case(
        lambda m, g: _parallelize(
            m, g, ep_plan={**m.ep_plan, "model.layers.*.self_attn.q_proj": "colwise"}
        ),
        "ValueError",
        ("ep_plan entries", "name no experts module or expert parameter"),
        "`mc_moe.parallelize`",
        "a dense entry in `ep_plan`",
    ),
    "unmatched_expert_entry": Case(
        lambda m, g: _parallelize(
            m, g, ep_plan={"model.layers.*.moe.experts": "ep_dispatch_experts"}
        ),
        "ValueError",
        ("ep_plan['model.layers.*.moe.experts'] = 'ep_dispatch_experts' matches nothing",),
        "`mc_moe.parallelize`",
        "an experts pattern matching nothing",
    ),
    "expert_bias_without_router": Case(
        lambda m, g: _parallelize(m, g, config=_bias_config()),
        "ValueError",
        ("config.moe_router_enable_expert_bias=True", "moe_router_enable_expert_bias=False"),
        "`mc_moe.parallelize` (Mixtral)",
        "`moe_router_enable_expert_bias=True`, no router with a bias",
    ),
    "aux_loss_in_pipeline_stage": Case(
        lambda m, g: _parallelize(m, g, config=_pp_config()),
        "ValueError",
        (
            "config.output_router_logits=True",
            "pg_collection.pp has 2 ranks",
            "output_router_logits=False",
        ),
        "`mc_moe.parallelize` at PP = 2 (Mixtral)",
        "`config.output_router_logits=True` (the load-balancing loss no stage computes)",
        kind="mixtral_aux",
        layout="pp2",
    ),
    "gpt_oss_tensor_parallel": Case(
        lambda m, g: __import__("mc_moe").sequence_parallel_plan(m),
        "ValueError",
        ("self_attn.sinks", "tensor_model_parallel_size=1"),
        "`mc_moe.sequence_parallel_plan` (gpt-oss)",
        "a model whose attention has per-head sinks",
        kind="gpt_oss",
    ),
    "not_a_collection": Case(
        lambda m, g: _parallelize(m, _loose({"ep": None})),
        "TypeError",
        ("pg_collection must be a mc_groups.ProcessGroupCollection",),
        "`mc_moe.parallelize`",
        "`pg_collection={'ep': None}`",
    ),
    "global_aux_loss_flag": Case(
        lambda m, g: _parallelize(m, g, global_aux_loss=_loose("yes")),
        "TypeError",
        ("global_aux_loss='yes' must be a bool",),
        "`mc_moe.parallelize`",
        "`global_aux_loss='yes'`",
    ),
    "full_state_dict_collection": Case(
        lambda m, g: __import__("mc_moe").full_state_dict(m, _loose(None)),
        "TypeError",
        ("pg_collection must be a mc_groups.ProcessGroupCollection",),
        "`mc_moe.full_state_dict`",
        "`pg_collection=None`",
    ),
}


def _run_cases() -> dict[str, tuple[str, str, int, bool]]:
    import mc_groups as mg
    from examples.hf_moe import build_model

    torch.set_num_threads(1)
    groups = {
        "ep2": mg.initialize_model_parallel(expert_model_parallel_size=2),
        "tp2": mg.initialize_model_parallel(
            tensor_model_parallel_size=2, expert_model_parallel_size=2
        ),
        "pp2": mg.initialize_model_parallel(
            pipeline_model_parallel_size=2, expert_model_parallel_size=2
        ),
    }
    out: dict[str, tuple[str, str, int, bool]] = {}
    for name, case in CASES.items():
        if case.kind == "mixtral3":
            model = _three_experts()
        else:
            model = build_model(case.kind.removesuffix("_aux"))
            model.config.output_router_logits = case.kind.endswith("_aux")  # aux loss asked
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with mg.record_collectives() as log:
            try:
                case.call(model, groups[case.layout])
                out[name] = ("no error", "", len(log), True)
                continue
            except Exception as err:  # the table says which
                kind, message = error_kind(err), str(err)
        after = model.state_dict()
        same = sorted(after) == sorted(before) and all(
            torch.equal(after[k], before[k]) for k in before
        )
        out[name] = (kind, message, len(log), same)
    for pgc in groups.values():
        mg.destroy_model_parallel(pgc)
    return out


def _three_experts() -> Any:
    """A Mixtral of 3 experts: the EP size 2 does not divide them."""
    import transformers

    from examples.hf_moe import build_model

    config: Any = build_model("mixtral").config
    config.num_local_experts = 3
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


@pytest.fixture(scope="module")
def outcomes(rank_pools: RankPools) -> list[dict[str, tuple[str, str, int, bool]]]:
    return rank_pools.get(4).run(_run_cases)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_named_before_anything_changes(
    outcomes: list[dict[str, tuple[str, str, int, bool]]], name: str
) -> None:
    case = CASES[name]
    for out in outcomes:
        kind, message, issued, unchanged = out[name]
        assert kind == case.error, message
        for word in case.words:
            assert word in message, (word, message)
        assert issued == 0
        assert unchanged
