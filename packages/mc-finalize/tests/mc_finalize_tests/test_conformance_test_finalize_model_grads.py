"""Conformance with Megatron-LM's ``tests/unit_tests/distributed/test_finalize_model_grads.py``:
the same facts held against mc-finalize on 2 gloo ranks.

Upstream drives ``finalize_model_grads`` and its steps with real GPT / MoE layers on GPUs.
What those steps read of a model is its params (with ``main_grad`` or ``grad``), their marks,
a few module attributes and router buffers, so the models here are hand-made chunks with
exactly those (``_helpers.Chunk``). Grads are small integers and rates binary fractions, so
results are compared exactly. One pool call runs every case; the tests read their part.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize import (
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_word_embedding_grads,
    _update_router_expert_bias,
    _update_router_qb_beta,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from mc_finalize_tests._helpers import Cfg, Chunk, add_param, layout, rank, records
from mc_finalize_tests.test_router_state import BiasRouter, QuantileRouter
from mc_groups.testing import RankPools


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _grads(chunk: Chunk) -> dict[str, list[float] | None]:
    """Each param's grad (``main_grad`` when present, else ``grad``), or None."""
    out: dict[str, list[float] | None] = {}
    for name, param in chunk.named_parameters():
        grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        out[name] = None if grad is None else [float(v) for v in grad.reshape(-1)]
    return out


def _buffers(chunk: Chunk) -> dict[str, list[float]]:
    return {n: [float(v) for v in b.reshape(-1)] for n, b in chunk.named_buffers()}


# -- router state -------------------------------------------------------------------------


def _bias_config() -> Cfg:
    return Cfg(
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.25,
        moe_router_load_balancing_type="none",
    )


def _bias_chunk() -> Chunk:
    """Upstream's ``_RouterExpertBiasModel``: one router, 2 experts, no params; rank 0 routed
    2 tokens to expert 1, rank 1 none."""
    chunk = Chunk(_bias_config())
    tokens = [0.0, 2.0] if rank() == 0 else [0.0, 0.0]
    chunk.router = BiasRouter(tokens, [0.0, 0.0])
    return chunk


def _custom_group_finalize() -> dict[str, Any]:
    world = _world()
    pgc = mg.ProcessGroupCollection(
        tp=world, pp=world, embd=None, pos_embd=None, dp_cp=world, tp_dp_cp=world
    )
    chunk = _bias_chunk()
    with mg.record_collectives() as log:
        finalize_model_grads([chunk], pg_collection=pgc)
    return {"buffers": _buffers(chunk), "sync": chunk.sync_calls, "log": records(log)}


def _step_level_router_state() -> dict[str, Any]:
    chunk = _bias_chunk()
    _update_router_expert_bias([chunk], chunk.config, _world())
    bias_after_update = _buffers(chunk)
    reset_model_temporary_tensors(chunk.config, [chunk])
    bias_after_reset = _buffers(chunk)

    cfg = Cfg(moe_router_load_balancing_type="quantile_balancing")
    cfg.moe_router_quantile_balancing_ema = 0.5
    quantile = Chunk(cfg)
    accum, count = ([2.0, 0.0], 1) if rank() == 0 else ([0.0, 4.0], 2)
    quantile.router = QuantileRouter([1.0, -1.0], accum, count)
    _update_router_qb_beta([quantile], cfg, _world())
    qb_after_update = _buffers(quantile)
    reset_model_temporary_tensors(cfg, [quantile])
    qb_after_reset = _buffers(quantile)
    return {
        "bias_update": bias_after_update,
        "bias_reset": bias_after_reset,
        "qb_update": qb_after_update,
        "qb_reset": qb_after_reset,
    }


# -- non-tensor-parallel grads ------------------------------------------------------------

_QK_NAMES = (
    "decoder.self_attention.q_layernorm.weight",
    "decoder.self_attention.k_layernorm.weight",
)


def _qk_chunk(frozen: bool) -> Chunk:
    """A layer's params as upstream's GPT model holds them, grads in ``param.grad`` (upstream
    sets ``param.grad = ones``), or every param frozen without a grad."""
    chunk = Chunk(Cfg(qk_layernorm=True))  # sequence_parallel stays False, as upstream
    value = None if frozen else 1.0
    for name in _QK_NAMES:
        add_param(chunk, name, value, main_grad=False, requires_grad=not frozen)
    add_param(
        chunk,
        "decoder.input_layernorm.weight",
        value,
        main_grad=False,
        requires_grad=not frozen,
        sequence_parallel=False,  # Megatron's norms carry config.sequence_parallel
    )
    add_param(chunk, "decoder.linear_qkv.weight", value, main_grad=False, requires_grad=not frozen)
    return chunk


def _tp_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(tensor_model_parallel_size=2) as pgc:
        for frozen in (False, True):
            chunk = _qk_chunk(frozen)
            with mg.record_collectives() as log:
                _allreduce_non_tensor_model_parallel_grads([chunk], chunk.config, pgc.tp)
            out[str(frozen)] = {"grads": _grads(chunk), "log": records(log)}
    return out


# -- word embeddings ----------------------------------------------------------------------


class _GPTStage(Chunk):
    """One pipeline stage of a GPT model: the word embedding on the first stage, the output
    layer on the last, Megatron's ``shared_embedding_or_output_weight()`` returning the one it
    holds; grads in ``param.grad``."""

    def __init__(self, stage: int, share: bool, frozen: bool) -> None:
        super().__init__(Cfg())
        self.pre_process = stage == 0
        self.post_process = stage == 1
        self.share_embeddings_and_output_weights = share
        value = None if frozen else 1.0
        name = "embedding.word_embeddings.weight" if stage == 0 else "output_layer.weight"
        self.held = name
        add_param(self, name, value, main_grad=False, requires_grad=not frozen)
        add_param(self, "decoder.weight", value, main_grad=False, requires_grad=not frozen)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.get_parameter(self.held)


def _embedding_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(pipeline_model_parallel_size=2) as pgc:
        assert pgc.pp is not None
        for share in (True, False):
            for frozen in (True, False):
                chunk = _GPTStage(pgc.pp.rank(), share, frozen)
                with mg.record_collectives() as log:
                    _allreduce_word_embedding_grads([chunk], chunk.config, pgc.embd, pgc.pp)
                out[str((share, frozen))] = {"grads": _grads(chunk), "log": records(log)}
    return out


def _two_rank_facts() -> dict[str, Any]:
    return {
        "custom_group": _custom_group_finalize(),
        "router_steps": _step_level_router_state(),
        "tp": _tp_cases(),
        "embedding": _embedding_cases(),
    }


@pytest.fixture(scope="module")
def two_ranks(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(2).run(_two_rank_facts)


def test_finalize_model_grads_updates_router_expert_bias_with_custom_group(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Follows ``tests/unit_tests/distributed/test_finalize_model_grads.py::
    TestFinalizeModelGradsMoEExpertBias::
    test_finalize_model_grads_updates_router_expert_bias_with_custom_group``.

    Same facts, on a hand-built collection (tp, pp, dp_cp and tp_dp_cp all the world, no
    embedding groups) and no default collection: tokens per expert summed over tp_dp_cp are
    [0, 2], mean 1, so with rate 0.25 the bias moves to [+0.25, −0.25]; the token counts are
    zeroed; the chunk's ``finish_grad_sync`` ran once. The recorder shows the router update
    is the only collective (the model has no params, so no grad step communicates).
    """
    for out in two_ranks:
        facts = out["custom_group"]
        assert facts["buffers"] == {
            "router.local_tokens_per_expert": [0.0, 0.0],
            "router.expert_bias": [0.25, -0.25],
        }
        assert facts["sync"] == [False]
        assert facts["log"] == [("all_reduce", "sum", (0, 1), "float32", 2, "router expert bias")]


def test_expert_bias_update_leaves_token_counts_to_the_reset(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Follows ``tests/unit_tests/distributed/test_finalize_model_grads.py::
    TestFinalizeModelGradsMoEExpertBias::
    test_finalize_model_grads_updates_router_expert_bias_with_custom_group``, step by step.

    Reading: upstream sees the token counts zeroed after ``finalize_model_grads``. In
    Megatron-Core the update step all-reduces a stacked copy of the counts and leaves each
    router's own ``local_tokens_per_expert`` as it was; ``reset_model_temporary_tensors``
    (which finalize runs next) zeroes them. So between the two steps rank 0 still holds
    [0, 2] and rank 1 [0, 0].
    """
    for r, out in enumerate(two_ranks):
        steps = out["router_steps"]
        assert steps["bias_update"]["router.expert_bias"] == [0.25, -0.25]
        own = [0.0, 2.0] if r == 0 else [0.0, 0.0]
        assert steps["bias_update"]["router.local_tokens_per_expert"] == own
        assert steps["bias_reset"]["router.local_tokens_per_expert"] == [0.0, 0.0]


def test_qb_beta_update_leaves_accumulators_to_the_reset(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Follows ``tests/unit_tests/distributed/test_finalize_model_grads.py::
    TestUpdateRouterQBBeta::test_update_router_qb_beta``.

    Reading: upstream computes the expected bias from the accumulators, runs the update, then
    calls ``reset_model_temporary_tensors`` to clear them "for the next global batch": in
    Megatron-Core the update reads the accumulators without clearing them. Here (ema 0.5):
    accum/count is [2, 0] and [0, 2], DP mean [1, 1]; 0.5·[1, −1] + 0.5·[1, 1] = [1, 0],
    re-centred [0.5, −0.5]; the accumulators survive the update and the reset zeroes them.
    """
    for r, out in enumerate(two_ranks):
        steps = out["router_steps"]
        assert steps["qb_update"]["router.qb_beta"] == [0.5, -0.5]
        accum, count = ([2.0, 0.0], [1.0]) if r == 0 else ([0.0, 4.0], [2.0])
        assert steps["qb_update"]["router.qb_beta_accum"] == accum
        assert steps["qb_update"]["router.qb_beta_count"] == count
        assert steps["qb_reset"]["router.qb_beta_accum"] == [0.0, 0.0]
        assert steps["qb_reset"]["router.qb_beta_count"] == [0.0]


def test_allreduce_layernorm_grads(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_finalize_model_grads.py::TestAllReduceLNGrads::
    test_allreduce_layernorm_grads`` (``freeze_model`` True and False, tp = 2).

    Upstream only checks that the step runs on a GPT layer with ``qk_layernorm=True`` and no
    sequence parallelism, grads set as ``param.grad = ones``, or on a frozen model. Same
    inputs here, with the values it implies: the q/k layer-norm grads are summed over tp
    (1 + 1 = 2) in one all-reduce, read from and written back to ``param.grad``; the input
    layer norm, marked ``sequence_parallel=False`` as Megatron's norms mark it
    (``config.sequence_parallel``), is not reduced; other params are untouched; a frozen
    model (no grads) communicates nothing.
    """
    for out in two_ranks:
        trained = out["tp"]["False"]
        assert trained["grads"] == {
            _QK_NAMES[0]: [2.0] * 3,
            _QK_NAMES[1]: [2.0] * 3,
            "decoder.input_layernorm.weight": [1.0] * 3,
            "decoder.linear_qkv.weight": [1.0] * 3,
        }
        assert trained["log"] == [
            ("all_reduce", "sum", (0, 1), "float32", 6, "non-tensor-parallel grads")
        ]
        frozen = out["tp"]["True"]
        assert set(frozen["grads"].values()) == {None}
        assert frozen["log"] == []


def test_allreduce_word_embedding_grads(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_finalize_model_grads.py::TestAllReduceLNGrads::
    test_allreduce_word_embedding_grads`` (pp = 2; shared embeddings on/off; frozen or not).

    Upstream only checks that the step runs. Same inputs, with the values they imply: with
    shared embeddings, the first stage's word embedding and the last stage's output weight
    (each grad ``ones`` in ``param.grad``) both end with 2 after one all-reduce over the
    embedding group; without sharing, or with a frozen model (no grads), nothing is
    communicated and nothing changes.
    """
    for r, out in enumerate(two_ranks):
        held = "embedding.word_embeddings.weight" if r == 0 else "output_layer.weight"
        shared = out["embedding"][str((True, False))]
        assert shared["grads"] == {held: [2.0] * 3, "decoder.weight": [1.0] * 3}
        assert shared["log"] == [("all_reduce", "sum", (0, 1), "float32", 3, "embedding grads")]
        unshared = out["embedding"][str((False, False))]
        assert unshared["grads"] == {held: [1.0] * 3, "decoder.weight": [1.0] * 3}
        assert unshared["log"] == []
        for share in (True, False):
            frozen = out["embedding"][str((share, True))]
            assert set(frozen["grads"].values()) == {None}
            assert frozen["log"] == []
