"""``finalize_model_grads`` end to end on hand-made chunks: step order, groups, num_tokens,
force_all_reduce, the default collection, and bad input.

Localizes the composition (each step already has its own test module): the recorder shows
the steps in the documented order (Megatron's), each on its group, that nothing runs for a
step that does not apply, and that a default call exchanges no status (``peer_checks`` is
opt-in); bad input fails on every rank before any collective and before any chunk's
``finish_grad_sync``. Grads and token counts are small integers whose quotients are binary
fractions, except the 1/11 of the dp case, compared with ``torch.testing.assert_close``
defaults for fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

import mc_groups as mg
from mc_finalize import (
    _allreduce_embedding_grad,
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_replicated_grads_over_gtp_remat_group,
    _get_main_grad_attr,
    _get_shared_word_embedding_weight,
    _unshard_if_dtensor,
    _update_router_expert_bias,
    finalize_model_grads,
)
from mc_finalize_tests._helpers import (
    TIMEOUT,
    Cfg,
    Chunk,
    add_param,
    first,
    layout,
    rank,
    records,
)
from mc_finalize_tests.test_router_state import BiasRouter, QuantileRouter
from mc_groups.collection import set_default_collection
from mc_groups.testing import RankPools, error_kind


class StageChunk(Chunk):
    """A pipeline stage with every kind of param and router finalize touches."""

    def __init__(self, cfg: Cfg, pp_rank: int, pp_size: int, tp_rank: int) -> None:
        super().__init__(cfg)
        self.pre_process = pp_rank == 0
        self.post_process = pp_rank == pp_size - 1
        self.share_embeddings_and_output_weights = True
        add_param(self, "cond.weight", 1 + 10 * pp_rank, pipeline_parallel=True)
        add_param(self, "router.weight", 100 + pp_rank, flextron_router_pp_sync=True)
        add_param(self, "ln.weight", 2**tp_rank, sequence_parallel=True)
        add_param(self, "embedding.weight", 1 + 10 * pp_rank)
        add_param(self, "plain.weight", 4)
        self.bias_router = BiasRouter([float(tp_rank), 1.0], [0.0, 0.0])
        self.qb_router = QuantileRouter([0.0, 0.0], [2.0, 0.0], 1)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.get_parameter("embedding.weight")


def _grads(chunk: Chunk) -> dict[str, float]:
    return {n: first(p) for n, p in chunk.named_parameters()}


def _all_steps_tp2_pp2() -> dict[str, Any]:
    """One layout, two calls on fresh chunks: default arguments, then ``peer_checks=True``."""
    cfg = Cfg(
        sequence_parallel=True,
        calculate_per_token_loss=True,
        has_cond_embedder=True,
        flextron=True,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.25,
        moe_router_load_balancing_type="quantile_balancing",
    )
    out: dict[str, Any] = {}
    with layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2) as pgc:
        assert pgc.pp is not None
        assert pgc.tp is not None
        p, t = pgc.pp.rank(), pgc.tp.rank()
        for peer_checks in (False, True):
            chunk = StageChunk(cfg, p, 2, t)
            num_tokens = torch.tensor(4 if p == 1 else 1000)  # only the last stage counts
            with mg.record_collectives(status_exchanges=True) as log:
                finalize_model_grads(
                    [chunk], num_tokens, pgc, force_all_reduce=True, peer_checks=peer_checks
                )
            out["checked" if peer_checks else "default"] = {
                "grads": _grads(chunk),
                "buffers": {n: b.reshape(-1).tolist() for n, b in chunk.named_buffers()},
                "log": records(log),
                "sync": chunk.sync_calls,
                "scale": chunk.scale_calls,
                "tokens": int(num_tokens),
            }
    return out


@pytest.fixture(scope="module")
def tp2_pp2(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(4).run(_all_steps_tp2_pp2)


def test_every_step_in_order_tp2_pp2(tp2_pp2: list[dict[str, Any]]) -> None:
    """With default arguments, exactly Megatron-Core's collectives in its order (its
    ``finalize_model_grads``: conditional embedders and routers over pp, the non-TP grads
    over tp, the tied embedding over embd, the expert-bias tokens over tp_dp_cp, qb_beta
    over dp_cp, num_tokens broadcast over pp then summed over dp_cp; here dp_cp has one
    rank), and no status exchange (recorded with ``status_exchanges=True``)."""
    # rank = tp + 2·pp. Sums: cond 1 + 11 = 12 and router 100 + 101 = 201 over pp; ln
    # 1 + 2 = 3 over tp; tied embedding 1 + 11 = 12 over embd (= pp here); then ÷ 4 tokens
    # broadcast from the last stage (dp_cp has one rank: no sum). Expert bias: tokens over
    # tp_dp_cp (= tp) Σ [t, 1] = [1, 2], mean 1.5 → bias [+0.25, −0.25]. qb over a dp_cp of
    # one rank: quantile [2, 0], ema 0, re-centred → [1, −1]; accumulators reset.
    for r, runs in enumerate(tp2_pp2):
        out = runs["default"]
        tp, pp = (r & ~1, r | 1), (r % 2, r % 2 + 2)
        assert out["grads"] == {
            "cond.weight": 3.0,
            "router.weight": 50.25,
            "ln.weight": 0.75,
            "embedding.weight": 3.0,
            "plain.weight": 1.0,
        }
        assert out["buffers"]["bias_router.expert_bias"] == [0.25, -0.25]
        assert out["buffers"]["bias_router.local_tokens_per_expert"] == [0.0, 0.0]
        assert out["buffers"]["qb_router.qb_beta"] == [1.0, -1.0]
        assert out["buffers"]["qb_router.qb_beta_accum"] == [0.0, 0.0]
        assert out["log"] == [
            ("all_reduce", "sum", pp, "float32", 3, "conditional embedding grads"),
            ("all_reduce", "sum", pp, "float32", 3, "router grads"),
            ("all_reduce", "sum", tp, "float32", 3, "non-tensor-parallel grads"),
            ("all_reduce", "sum", pp, "float32", 3, "embedding grads"),
            ("all_reduce", "sum", tp, "float32", 2, "router expert bias"),
            ("broadcast", None, pp, "float64", 1, "num_tokens"),
        ]
        assert out["sync"] == [True]
        assert out["scale"] == [0.25]
        assert out["tokens"] == 4


def test_peer_checks_add_one_status_exchange_and_nothing_else(
    tp2_pp2: list[dict[str, Any]],
) -> None:
    """``peer_checks=True``: one status exchange over the world before the first
    collective, then the same collectives and the same grads as a default call."""
    for runs in tp2_pp2:
        default, checked = runs["default"], runs["checked"]
        exchange = ("status_exchange", None, (0, 1, 2, 3), "int64", 1, "finalize_model_grads")
        assert checked["log"] == [exchange, *default["log"]]
        assert checked["grads"] == default["grads"]
        assert checked["buffers"] == default["buffers"]


def _gtp_per_token() -> dict[str, Any]:
    cfg = Cfg(
        calculate_per_token_loss=True,
        gtp_remat_size=2,
        moe_router_load_balancing_type="quantile_balancing",
    )
    with layout(gtp_remat_size=2) as pgc:
        r = rank()
        chunk = Chunk(cfg)
        add_param(chunk, "dense.weight", 2**r)
        router = QuantileRouter([0.0, 0.0], [float(r), 0.0], 1)
        chunk.qb_router = router
        num_tokens = torch.tensor([1, 2, 2, 3][r])
        with mg.record_collectives() as log:
            finalize_model_grads([chunk], num_tokens, pgc)
        return {
            "dense": first(chunk.get_parameter("dense.weight")),
            "beta": router.get_buffer("qb_beta").tolist(),
            "log": records(log),
            "tokens": int(num_tokens),
            "sync": chunk.sync_calls,
        }


def test_gtp_remat_per_token_loss_counts_every_data_rank(rank_pools: RankPools) -> None:
    # rank = gtp + 2·dp: gtp_remat pairs {0, 1}, {2, 3}; dp_cp pairs {0, 2}, {1, 3}.
    # Per-token loss: dense grads SUM over gtp_remat (1 + 2 = 3, 4 + 8 = 12), then ÷ the
    # tokens of all four data ranks (1 + 2 + 2 + 3 = 8): 0.375 and 1.5. qb: quantile [r, 0]
    # averaged over all four ranks (dp_cp_gtp_remat: gtp_remat peers see different tokens;
    # Megatron-Core's finalize_model_grads passes `dp_cp_gtp_remat or dp_cp` to
    # _update_router_qb_beta) → [1.5, 0], re-centred → [0.75, -0.75].
    for r, out in enumerate(rank_pools.get(4).run(_gtp_per_token)):
        gtp = (r & ~1, r | 1)
        assert out["dense"] == (0.375 if r < 2 else 1.5)
        assert out["beta"] == [0.75, -0.75]
        assert out["tokens"] == 8
        assert out["sync"] == [False]
        assert out["log"] == [
            ("all_reduce", "sum", gtp, "float32", 3, "replicated grads over gtp_remat"),
            ("all_reduce", "avg", (0, 1, 2, 3), "float32", 2, "router qb_beta"),
            ("all_reduce", "sum", (0, 1, 2, 3), "float64", 1, "num_tokens"),
        ]


def _tokens_pp2_dp2() -> dict[str, Any]:
    with layout(pipeline_model_parallel_size=2) as pgc:
        assert pgc.pp is not None
        assert pgc.dp is not None
        r, p, d = rank(), pgc.pp.rank(), pgc.dp.rank()
        chunk = Chunk(Cfg(calculate_per_token_loss=True))
        add_param(chunk, "w", 2**r)
        add_param(chunk, "g", 2**r, main_grad=False)
        num_tokens = torch.tensor(5 + d if p == 1 else 1000, dtype=torch.int32)
        set_default_collection(pgc)
        with mg.record_collectives() as log:
            finalize_model_grads([chunk], num_tokens)  # groups from the default collection
        return {
            "grads": [first(chunk.get_parameter(n)) for n in ("w", "g")],
            "tokens": int(num_tokens),
            "log": records(log),
        }


def test_num_tokens_broadcast_from_last_stage_and_summed_over_dp(rank_pools: RankPools) -> None:
    # rank = dp + 2·pp. Last-stage counts 5 + dp = 5, 6 reach stage 0 by broadcast (the 1000
    # there is ignored); dp sums them: 11 on every rank; grads 2**r become 2**r / 11.
    for r, out in enumerate(rank_pools.get(4).run(_tokens_pp2_dp2)):
        pp, dp = (r % 2, r % 2 + 2), (r & ~1, r | 1)
        torch.testing.assert_close(torch.tensor(out["grads"]), torch.full((2,), 2**r / 11))
        assert out["tokens"] == 11
        assert out["log"] == [
            ("broadcast", None, pp, "float64", 1, "num_tokens"),
            ("all_reduce", "sum", dp, "float64", 1, "num_tokens"),
        ]


def _defaults_and_zero_tokens() -> dict[str, Any]:
    with layout() as pgc:
        # no MoE, qk or gtp attributes: defaults
        chunk = Chunk(mg.ModelParallelConfig(calculate_per_token_loss=True))
        add_param(chunk, "w", 3.0, sequence_parallel=True, average_gradients_across_tp_domain=True)
        zero = torch.tensor(0.0)
        with mg.record_collectives() as log:
            finalize_model_grads([chunk], zero, pgc)
        return {
            "w": first(chunk.get_parameter("w")),
            "scale": chunk.scale_calls,
            "log": records(log),
        }


def test_model_parallel_config_and_zero_tokens(rank_pools: RankPools) -> None:
    # dp = 2, tp = pp = 1: only the token sum communicates; 0 + 0 tokens clamp to 1.
    for out in rank_pools.get(2).run(_defaults_and_zero_tokens):
        assert out["w"] == 3.0
        assert out["scale"] == [1.0]
        # the count travels as float64 (exact for any int count below 2**53)
        assert out["log"] == [("all_reduce", "sum", (0, 1), "float64", 1, "num_tokens")]


class FirstStage(Chunk):
    """A first pipeline stage without position embeddings."""

    pre_process = True


def _chunk() -> Chunk:
    chunk = FirstStage(Cfg())
    add_param(chunk, "w", 2.0)
    return chunk


class NoSequenceParallel:
    calculate_per_token_loss = False


def _pt(chunk: Chunk) -> Chunk:
    """The chunk with a per-token-loss config (num_tokens is given exactly then)."""
    return _set(chunk, Cfg(calculate_per_token_loss=True))


def _finalized(chunk: Chunk) -> Chunk:
    # what mc_ddp's DDP says until its next zero_grad_buffer()
    setattr(chunk, "grads_finalized", True)  # noqa: B010
    return chunk


def _mismatched_router(chunk: Chunk) -> Chunk:
    chunk.add_module("router", BiasRouter([1.0, 2.0, 3.0], [0.0, 0.0]))  # 3 counts, 2 biases
    return chunk


def _integer_bias_router(chunk: Chunk) -> Chunk:
    chunk.add_module("router", BiasRouter([1.0, 2.0], [0, 0]))  # int64 bias: updates round away
    return chunk


def _routers_of_two_sizes(chunk: Chunk) -> Chunk:
    frozen = BiasRouter([1.0], [0.0])  # frozen: not reduced, so its size does not matter
    frozen.frozen_expert_bias = True  # type: ignore[assignment]
    chunk.add_module("frozen", frozen)
    chunk.add_module("first", BiasRouter([1.0, 2.0], [0.0, 0.0]))
    chunk.add_module("second", BiasRouter([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]))
    return chunk


def _bad_calls(pgc: mg.ProcessGroupCollection) -> dict[str, Callable[[Chunk], object]]:
    pgc_ = mg.ProcessGroupCollection
    tokens = torch.tensor(4)
    no_config = torch.nn.Linear(1, 1)
    dead = mg.initialize_model_parallel(timeout=TIMEOUT)
    mg.destroy_model_parallel(dead)
    world = pgc.world
    assert world is not None
    cfg = Cfg()
    return {
        "not_a_list": lambda c: finalize_model_grads(c, pg_collection=pgc),  # type: ignore[arg-type]
        "empty": lambda c: finalize_model_grads([], pg_collection=pgc),
        "not_a_chunk": lambda c: finalize_model_grads([object()], pg_collection=pgc),  # type: ignore[list-item]
        "no_config": lambda c: finalize_model_grads([_with(no_config)], pg_collection=pgc),
        "config_attr": lambda c: finalize_model_grads([_set(c, NoSequenceParallel())], None, pgc),
        "config_type": lambda c: finalize_model_grads([_set(c, _bad_qk())], None, pgc),
        "tokens_int": lambda c: finalize_model_grads([_pt(c)], 4, pgc),  # type: ignore[arg-type]
        "tokens_shape": lambda c: finalize_model_grads([_pt(c)], torch.tensor([2, 2]), pgc),
        "tokens_2d": lambda c: finalize_model_grads([_pt(c)], torch.tensor([[4]]), pgc),
        "tokens_half": lambda c: finalize_model_grads([_pt(c)], torch.tensor(4.0).half(), pgc),
        "tokens_bool": lambda c: finalize_model_grads([_pt(c)], torch.tensor(True), pgc),
        "tokens_device": lambda c: finalize_model_grads(
            [_pt(c)], torch.tensor(4, device="meta"), pgc
        ),
        "no_tp": lambda c: finalize_model_grads([c], None, pgc_(pp=pgc.pp, dp_cp=pgc.dp_cp)),
        "no_pp": lambda c: finalize_model_grads(
            [_set(c, Cfg(has_cond_embedder=True))], None, pgc_(tp=pgc.tp)
        ),
        "no_pp_tokens": lambda c: finalize_model_grads(
            [_pt(c)], tokens, pgc_(tp=pgc.tp, dp_cp=pgc.dp)
        ),
        "no_tp_dp_cp": lambda c: finalize_model_grads(
            [_set(c, Cfg(moe_router_enable_expert_bias=True))], None, pgc_(tp=pgc.tp, pp=pgc.pp)
        ),
        "no_dp_cp_tokens": lambda c: finalize_model_grads(
            [_pt(c)], tokens, pgc_(tp=pgc.tp, pp=pgc.pp)
        ),
        "no_dp_cp_qb": lambda c: finalize_model_grads(
            [_set(c, Cfg(moe_router_load_balancing_type="quantile_balancing"))],
            None,
            pgc_(tp=pgc.tp, pp=pgc.pp),
        ),
        "no_gtp": lambda c: finalize_model_grads(
            [_set(c, Cfg(gtp_remat_size=2))], None, pgc_(tp=pgc.tp, pp=pgc.pp)
        ),
        "gtp_size": lambda c: finalize_model_grads([_set(c, Cfg(gtp_remat_size=2))], None, pgc),
        "embd_without_pp": lambda c: finalize_model_grads([c], None, pgc_(tp=pgc.tp, embd=pgc.dp)),
        "no_position_embedding": lambda c: finalize_model_grads(
            [c], None, pgc_(tp=pgc.tp, pp=pgc.pp, pos_embd=pgc.dp)
        ),
        "collection_type": lambda c: finalize_model_grads([c], None, "tp"),  # type: ignore[arg-type]
        "force_type": lambda c: finalize_model_grads([c], None, pgc, "yes"),  # type: ignore[arg-type]
        "no_default": lambda c: finalize_model_grads([c]),
        # issue 16: misuse sequences, flags, the steps' own arguments
        "same_chunk": lambda c: finalize_model_grads([c, c], None, pgc),
        "finalized": lambda c: finalize_model_grads([_finalized(c)], None, pgc),
        "tokens_without_per_token": lambda c: finalize_model_grads([c], tokens, pgc),
        "force_int": lambda c: finalize_model_grads([c], None, pgc, 1),  # type: ignore[arg-type]
        "destroyed": lambda c: finalize_model_grads([c], None, dead),
        "step_group": lambda c: _allreduce_non_tensor_model_parallel_grads(
            [c],
            cfg,
            "tp",  # type: ignore[arg-type]
        ),
        "gtp_group": lambda c: _allreduce_replicated_grads_over_gtp_remat_group(
            [c],
            0,  # type: ignore[arg-type]
            None,
        ),
        "weight_getter": lambda c: _allreduce_embedding_grad(
            [c],
            world,
            world,
            "weight",  # type: ignore[arg-type]
        ),
        "main_grad_attr": lambda c: _get_main_grad_attr(None),  # type: ignore[arg-type]
        "unshard": lambda c: _unshard_if_dtensor("grad"),  # type: ignore[arg-type]
        "router_shape": lambda c: _update_router_expert_bias(
            [_mismatched_router(c)], Cfg(moe_router_enable_expert_bias=True), world
        ),
        "router_dtype": lambda c: _update_router_expert_bias(
            [_integer_bias_router(c)], Cfg(moe_router_enable_expert_bias=True), world
        ),
        "router_sizes": lambda c: finalize_model_grads(
            [_set(_routers_of_two_sizes(c), Cfg(moe_router_enable_expert_bias=True))],
            pg_collection=pgc,
        ),
        "module": lambda c: _get_shared_word_embedding_weight(None, cfg),
    }


def _with(module: torch.nn.Module) -> Any:
    module.finish_grad_sync = lambda force_all_reduce=False: None  # type: ignore[assignment]
    module.scale_gradients = lambda scaling_factor: None  # type: ignore[assignment]
    return module


def _bad_qk() -> Cfg:
    cfg = Cfg()
    cfg.qk_layernorm = "yes"  # type: ignore[assignment]
    return cfg


def _set(chunk: Chunk, config: object) -> Chunk:
    chunk.config = config
    return chunk


def _bad_inputs() -> dict[str, tuple[str, str, int, int, float]]:
    out = {}
    with layout() as pgc:
        for name, call in _bad_calls(pgc).items():
            chunk = _chunk()
            with mg.record_collectives() as log:
                try:
                    call(chunk)
                    error = ("none", "")
                except (TypeError, ValueError, RuntimeError) as err:
                    error = (error_kind(err), str(err))
            out[name] = (*error, len(log), len(chunk.sync_calls), first(chunk.get_parameter("w")))
    return out


class Expected(NamedTuple):
    """A bad call's exception type and the fragments its message must hold; ``doc_call``
    and ``doc_input`` are the catalogue's "call" and "bad input" cells (markdown), read by
    ``scripts/gen_bad_inputs.py``."""

    error: str
    words: tuple[str, ...]
    doc_call: str
    doc_input: str


EXPECTED_ERRORS = {
    "not_a_list": Expected(
        "TypeError",
        (
            "model must be a list of model chunks (one per virtual pipeline stage), got "
            "mc_finalize_tests.test_finalize.FirstStage",
        ),
        doc_call="`finalize_model_grads(model)`",
        doc_input="a chunk, not a list",
    ),
    "empty": Expected(
        "ValueError",
        ("model=[] holds no model chunk",),
        doc_call="`finalize_model_grads(model)`",
        doc_input="`[]`",
    ),
    "not_a_chunk": Expected(
        "TypeError",
        ("model[0] (object) lacks ['finish_grad_sync'",),
        doc_call="`finalize_model_grads(model)`",
        doc_input="`[object()]`",
    ),
    "no_config": Expected(
        "TypeError",
        ("model[0] (torch.nn.modules.linear.Linear) has no config",),
        doc_call="`finalize_model_grads(model)`",
        doc_input="a chunk without `config`",
    ),
    "config_attr": Expected(
        "TypeError",
        ("lacks ['sequence_parallel']: finalize_model_grads reads config.sequence_parallel",),
        doc_call="`finalize_model_grads(model)`",
        doc_input="config without `sequence_parallel`",
    ),
    "config_type": Expected(
        "TypeError",
        ("config.qk_layernorm='yes' must be a bool",),
        doc_call="`finalize_model_grads(model)`",
        doc_input="`config.qk_layernorm='yes'`",
    ),
    "tokens_int": Expected(
        "TypeError",
        ("num_tokens must be a torch.Tensor",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="`4` (an int)",
    ),
    "tokens_shape": Expected(
        "ValueError",
        ("num_tokens has shape (2,)",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="shape (2,)",
    ),
    "tokens_2d": Expected(
        "ValueError",
        ("num_tokens has shape (1, 1)",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="shape (1, 1)",
    ),
    "tokens_half": Expected(
        "TypeError",
        ("num_tokens has dtype torch.float16",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="float16",
    ),
    "tokens_bool": Expected(
        "TypeError",
        ("num_tokens has dtype torch.bool",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="bool",
    ),
    "tokens_device": Expected(
        "ValueError",
        ("num_tokens is on meta but the model is on cpu",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="on `meta`, model on cpu",
    ),
    "no_tp": Expected(
        "MissingGroupError",
        ("needs pg_collection.tp",),
        doc_call="`finalize_model_grads(..., pg_collection=)`",
        doc_input="no `tp`",
    ),
    "no_pp": Expected(
        "MissingGroupError",
        ("needs pg_collection.pp",),
        doc_call="`finalize_model_grads` with `has_cond_embedder`",
        doc_input="no `pp`",
    ),
    "no_pp_tokens": Expected(
        "MissingGroupError",
        ("needs pg_collection.pp",),
        doc_call="`finalize_model_grads(..., num_tokens)`",
        doc_input="no `pp`",
    ),
    "no_tp_dp_cp": Expected(
        "MissingGroupError",
        ("needs pg_collection.tp_dp_cp",),
        doc_call="`finalize_model_grads` with expert bias",
        doc_input="no `tp_dp_cp`",
    ),
    "no_dp_cp_tokens": Expected(
        "MissingGroupError",
        ("needs pg_collection.dp_cp",),
        doc_call="`finalize_model_grads(..., num_tokens)`",
        doc_input="no `dp_cp`",
    ),
    "no_dp_cp_qb": Expected(
        "MissingGroupError",
        ("needs pg_collection.dp_cp",),
        doc_call="`finalize_model_grads` with quantile balancing",
        doc_input="no `dp_cp`",
    ),
    "no_gtp": Expected(
        "MissingGroupError",
        ("needs pg_collection.gtp_remat",),
        doc_call="`finalize_model_grads` with `gtp_remat_size=2`",
        doc_input="no `gtp_remat`",
    ),
    "gtp_size": Expected(
        "ValueError",
        ("pg_collection.gtp_remat has 1 ranks but the config says 2",),
        doc_call="`finalize_model_grads` with `gtp_remat_size=2`",
        doc_input="a 1-rank `gtp_remat` group",
    ),
    "embd_without_pp": Expected(
        "MissingGroupError",
        ("needs pg_collection.pp",),
        doc_call="`finalize_model_grads` with `embd`",
        doc_input="no `pp`",
    ),
    "no_position_embedding": Expected(
        "ValueError",
        ("has no position_embeddings.weight",),
        doc_call="`finalize_model_grads` with `pos_embd` of 2 ranks",
        doc_input="stage without position embeddings",
    ),
    "collection_type": Expected(
        "TypeError",
        ("pg_collection='tp' must be a ProcessGroupCollection",),
        doc_call="`finalize_model_grads(..., pg_collection=)`",
        doc_input="`'tp'`",
    ),
    "force_type": Expected(
        "TypeError",
        ("force_all_reduce='yes' must be a bool",),
        doc_call="`finalize_model_grads(..., force_all_reduce=)`",
        doc_input="`'yes'`",
    ),
    "no_default": Expected(
        "NoDefaultCollectionError",
        ("finalize_model_grads got no process group and no default ProcessGroupCollection",),
        doc_call="`finalize_model_grads([c])`",
        doc_input="no collection, none registered",
    ),
    "same_chunk": Expected(
        "ValueError",
        ("model[1] is the same object as model[0]", "reduced and scaled twice"),
        doc_call="`finalize_model_grads(model)`",
        doc_input="`[ddp, ddp]` (the same chunk twice)",
    ),
    "finalized": Expected(
        "RuntimeError",
        ("model[0]'s gradients were already finalized this iteration", "zero_grad_buffer()"),
        doc_call="`finalize_model_grads(model)`",
        doc_input="a second call in one iteration (the chunk's `grads_finalized` is True)",
    ),
    "tokens_without_per_token": Expected(
        "ValueError",
        ("num_tokens was given but config.calculate_per_token_loss=False",),
        doc_call="`finalize_model_grads(..., num_tokens=)`",
        doc_input="a count without per-token loss (grads already averaged)",
    ),
    "force_int": Expected(
        "TypeError",
        ("force_all_reduce=1 must be a bool",),
        doc_call="`finalize_model_grads(..., force_all_reduce=)`",
        doc_input="`1`",
    ),
    "destroyed": Expected(
        "RuntimeError",
        ("pg_collection was destroyed by destroy_model_parallel()",),
        doc_call="`finalize_model_grads(..., pg_collection=)`",
        doc_input="a destroyed collection",
    ),
    "step_group": Expected(
        "TypeError",
        ("tp_group='tp' must be a torch.distributed.ProcessGroup or None",),
        doc_call="`_allreduce_non_tensor_model_parallel_grads(model, config, tp_group)`",
        doc_input="`'tp'`",
    ),
    "gtp_group": Expected(
        "TypeError",
        ("gtp_remat_group=0 must be a torch.distributed.ProcessGroup or None",),
        doc_call="`_allreduce_replicated_grads_over_gtp_remat_group(...)`",
        doc_input="`gtp_remat_group=0`",
    ),
    "weight_getter": Expected(
        "TypeError",
        ("weight_getter='weight' must be callable",),
        doc_call="`_allreduce_embedding_grad(..., weight_getter)`",
        doc_input="`'weight'`",
    ),
    "main_grad_attr": Expected(
        "TypeError",
        ("param must be a torch.Tensor, got NoneType",),
        doc_call="`_get_main_grad_attr(param)`",
        doc_input="`None`",
    ),
    "unshard": Expected(
        "TypeError",
        ("tensor must be a torch.Tensor, got str",),
        doc_call="`_unshard_if_dtensor(tensor)`",
        doc_input="`'grad'`",
    ),
    "router_shape": Expected(
        "ValueError",
        ("BiasRouter.local_tokens_per_expert has shape (3,)", "BiasRouter.expert_bias has (2,)"),
        doc_call="`_update_router_expert_bias(model, config, group)`",
        doc_input="a router with 3 token counts for 2 biases",
    ),
    "router_dtype": Expected(
        "TypeError",
        ("BiasRouter.expert_bias has dtype torch.int64; make it floating-point",),
        doc_call="`_update_router_expert_bias(model, config, group)`",
        doc_input="a router with an integer `expert_bias`",
    ),
    "router_sizes": Expected(
        "ValueError",
        ("BiasRouter.local_tokens_per_expert has shape (3,)", "first router's", "(2,)"),
        doc_call="`finalize_model_grads(model)` with expert bias",
        doc_input="two routers of 2 and 3 experts (a frozen one of 1 is ignored)",
    ),
    "module": Expected(
        "TypeError",
        ("model_module=None must be the wrapped model",),
        doc_call="`_get_shared_word_embedding_weight(model_module, config)`",
        doc_input="`None`",
    ),
}


@pytest.fixture(scope="module")
def bad_input_results(rank_pools: RankPools) -> list[dict[str, tuple[str, str, int, int, float]]]:
    return rank_pools.get(2).run(_bad_inputs)


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_input_fails_before_any_collective(
    bad_input_results: list[dict[str, tuple[str, str, int, int, float]]], case: str
) -> None:
    expected = EXPECTED_ERRORS[case]
    for out in bad_input_results:
        error_type, message, collectives, syncs, grad = out[case]
        assert error_type == expected.error, message
        for word in expected.words:
            assert word in message, (word, message)
        assert (collectives, syncs, grad) == (0, 0, 2.0)  # nothing ran, nothing changed


class MarkingChunk(Chunk):
    """A chunk with the finalize protocol of ``mc_ddp.DistributedDataParallel``: it says
    whether this iteration's grads were finalized and records the mark."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.grads_finalized = False

    def mark_grads_finalized(self) -> None:
        self.grads_finalized = True


def _counts_that_are_not_counts(per_rank: list[Any]) -> dict[str, Any]:
    with layout() as pgc:  # dp = 2
        chunk = MarkingChunk(Cfg(calculate_per_token_loss=True))
        add_param(chunk, "w", 2.0 + rank())
        value = per_rank[rank()]
        tokens = None if value is None else torch.tensor(value)
        with mg.record_collectives() as log:
            try:
                finalize_model_grads([chunk], tokens, pgc)
                error = "none"
            except ValueError as err:
                error = str(err)
        return {
            "error": error,
            "ops": [r[0] for r in records(log)],
            "w": first(chunk.get_parameter("w")),
            "scale": chunk.scale_calls,
            "marked": chunk.grads_finalized,
        }


@pytest.mark.parametrize(
    ("per_rank", "shown"),
    [
        ([math.nan, 3.0], ["nan", "3.0"]),
        ([5, None], ["5", "None"]),  # num_tokens given on one rank only
        ([-1, 4], ["-1", "4"]),  # a negative count would cancel against the other rank's
        ([math.inf, 1.0], ["inf", "1.0"]),
    ],
)
def test_a_count_that_is_not_a_count_fails_on_every_rank(
    rank_pools: RankPools, per_rank: list[Any], shown: list[str]
) -> None:
    # Every rank takes the same path: the bad count travels as NaN through the token
    # all-reduce and each rank raises after reading the sum, before scaling; a rank that
    # raised alone would have left its peer waiting in that all-reduce.
    outs = rank_pools.get(2).run(_counts_that_are_not_counts, per_rank)
    for r, out in enumerate(outs):
        assert (
            "num_tokens summed over the data-parallel ranks [0, 1] is not a count" in (out["error"])
        )
        assert f"this rank passed {shown[r]}" in out["error"]
        assert out["ops"] == ["all_reduce"]  # the token sum (dp = 2; pp has one rank)
        assert out["w"] == 2.0 + r  # finish_grad_sync is the chunk's; nothing was scaled
        assert out["scale"] == []
        assert out["marked"] is False


def _finalize_twice() -> dict[str, Any]:
    with layout() as pgc:
        chunk = MarkingChunk(Cfg(calculate_per_token_loss=True))
        add_param(chunk, "w", 6.0)
        finalize_model_grads([chunk], torch.tensor(3), pgc)
        with mg.record_collectives() as log:
            try:
                finalize_model_grads([chunk], torch.tensor(3), pgc)
                error = "none"
            except RuntimeError as err:
                error = str(err)
        return {
            "error": error,
            "log": len(log),
            "w": first(chunk.get_parameter("w")),
            "syncs": len(chunk.sync_calls),
        }


def test_a_second_finalize_in_one_iteration_is_refused_before_anything_runs(
    rank_pools: RankPools,
) -> None:
    # 6 / (3 + 3 tokens) = 1 after the first call; the second would have made it 1/6
    for out in rank_pools.get(2).run(_finalize_twice):
        assert "model[0]'s gradients were already finalized this iteration" in out["error"]
        assert (out["log"], out["w"], out["syncs"]) == (0, 1.0, 1)


def _config_changed_between_calls() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(tensor_model_parallel_size=2) as pgc:
        cfg = Cfg(sequence_parallel=True)
        chunk = Chunk(cfg)
        norm = add_param(chunk, "ln.weight", 1.0 + rank(), sequence_parallel=True)

        def attempt(key: str) -> None:
            try:
                finalize_model_grads([chunk], None, pgc)
                out[key] = ("none", first(norm))
            except (TypeError, ValueError) as err:
                out[key] = (error_kind(err), str(err))

        attempt("first")  # SUM over tp: 1 + 2
        cfg.sequence_parallel = False  # the same config object, a field changed
        attempt("sp_off")
        cfg.sequence_parallel = "yes"  # type: ignore[assignment]
        attempt("not_a_bool")
        cfg.sequence_parallel = True
        attempt("back_on")  # SUM again: 3 + 3
        chunk.config = Cfg(sequence_parallel=False)  # another config object
        attempt("new_config")
    return out


def test_the_config_is_read_again_when_it_changes(rank_pools: RankPools) -> None:
    # finalize checks model[0]'s config once and keeps the result on model[0]; a changed
    # field or another config object is read (and checked) again, never a stale setting.
    for out in rank_pools.get(2).run(_config_changed_between_calls):
        assert out["first"] == ("none", 3.0)
        kind, message = out["sp_off"]
        assert kind == "ValueError"
        assert "config.sequence_parallel is False" in message
        kind, message = out["not_a_bool"]
        assert kind == "TypeError"
        assert "config.sequence_parallel='yes'" in message
        assert out["back_on"] == ("none", 6.0)
        kind, message = out["new_config"]
        assert kind == "ValueError"
        assert "config.sequence_parallel is False" in message
