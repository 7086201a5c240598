"""The linear functions' options: overlap order, frozen weight, main_grad fusion, wgrad
deferral, gtp_remat and output_dtype, each against a single-process computation.

fp32 comparisons use 1e-5 relative to scale (see ``_helpers``). bf16 cases compare with
references computed from the same bf16 values converted to fp32 (exact), so they keep
the fp32 tolerance except where a bf16 result is rounded (stated at the assertion).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
import mc_tp_layers.linear as tpl_linear
from mc_groups.testing import RankPools
from mc_tp_layers import _gemm
from mc_tp_layers.layers import (
    _linear_forward,
    _wgrad_gemm,
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
)
from mc_tp_layers.linear import drain_embedding_wgrad_compute
from mc_tp_layers_tests._helpers import (
    assert_close,
    backward,
    chunk,
    config,
    main_grad,
    ops,
    randn,
    world,
)

S, B, K, N = 4, 2, 8, 16


def _column(pgc: mg.ProcessGroupCollection, **cfg: Any) -> tpl.ColumnParallelLinear:
    w = pgc.require("tp", "test").size()
    return tpl.ColumnParallelLinear(
        K, N, config=config(w, **cfg), init_method=torch.nn.init.zeros_, pg_collection=pgc
    )


def _load(
    param: torch.Tensor | None, weight: torch.Tensor, dim: int, rank: int, parts: int
) -> None:
    assert param is not None
    with torch.no_grad():
        param.copy_(chunk(weight, parts, rank, dim))


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.matmul(w.t())


def _order_of_wgrad(sp: bool) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        layer = _column(pgc, sequence_parallel=sp)
        x = randn(S, B, K, seed=1)
        x = (chunk(x, 2, r, 0) if sp else x).requires_grad_()
        y, _ = layer(x)
        seen: list[list[str]] = []
        original = tpl_linear.__dict__["_new_wgrad"]  # the wgrad GEMM of a plain weight
        with mg.record_collectives() as log:

            def spy(
                like: torch.Tensor, shape: Any, g: torch.Tensor, t: torch.Tensor
            ) -> torch.Tensor:
                seen.append(ops(log))
                result: torch.Tensor = original(like, shape, g, t)
                return result

            tpl_linear.__dict__["_new_wgrad"] = spy
            try:
                y.sum().backward()
            finally:
                tpl_linear.__dict__["_new_wgrad"] = original
        return {"at_wgrad": seen, "all": ops(log), "async": [e.async_op for e in log]}
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("sp", [False, True])
def test_dgrad_reduction_is_issued_before_the_wgrad_gemm(rank_pools: RankPools, sp: bool) -> None:
    for out in rank_pools.get(2).run(_order_of_wgrad, sp):
        expected = ["all_gather", "reduce_scatter"] if sp else ["all_reduce"]
        # When the wgrad GEMM starts, the dgrad reduction (and under SP the input
        # re-gather) has already been issued, asynchronously, and nothing comes after it.
        assert out["at_wgrad"] == [expected]
        assert out["all"] == expected
        assert all(out["async"])


def _frozen(sp: bool, d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        layer = _column(pgc, sequence_parallel=sp)
        assert layer.weight is not None
        assert layer.bias is not None
        _load(layer.weight, d["w"], 0, r, 2)
        layer.weight.requires_grad_(False)
        x = (chunk(d["x"], 2, r, 0) if sp else d["x"].clone()).requires_grad_()
        with mg.record_collectives() as fwd:
            y, _ = layer(x)
        saved = [tuple(t.shape) for t in y.grad_fn.saved_tensors]
        with mg.record_collectives() as bwd:
            y.backward(chunk(d["dy"], 2, r, -1))
        return {
            "y": y.detach(),
            "dx": x.grad,
            "dw": layer.weight.grad,
            "db": layer.bias.grad,
            "saved": saved,
            "fwd": ops(fwd),
            "bwd": ops(bwd),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("sp", [False, True])
def test_frozen_weight(rank_pools: RankPools, sp: bool) -> None:
    d = {"x": randn(S, B, K, seed=1), "w": randn(N, K, seed=2), "dy": randn(S, B, N, seed=3)}
    xx = d["x"].clone().requires_grad_()
    y_ref = _linear(xx, d["w"])
    backward(y_ref, d["dy"])
    assert xx.grad is not None
    results = rank_pools.get(2).run(_frozen, sp, d)
    assert_close(torch.cat([o["y"] for o in results], dim=-1), y_ref, "frozen output")
    dx = [o["dx"] for o in results]
    assert_close(torch.cat(dx, 0) if sp else dx[0], xx.grad, "frozen dX")
    assert_close(torch.cat([o["db"] for o in results]), d["dy"].sum(dim=(0, 1)), "frozen db")
    for o in results:
        assert o["dw"] is None
        assert o["saved"] == [(N // 2, K)]  # only the weight shard, no activation
        assert o["fwd"] == (["all_gather"] if sp else [])
        assert o["bwd"] == (["reduce_scatter"] if sp else ["all_reduce"])


def _fusion(dtype: torch.dtype, with_flag: bool, d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        col = _column(pgc, gradient_accumulation_fusion=True, params_dtype=dtype)
        row = tpl.RowParallelLinear(
            N,
            K,
            config=config(2, gradient_accumulation_fusion=True, params_dtype=dtype),
            init_method=torch.nn.init.zeros_,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        )
        assert col.weight is not None
        _load(col.weight, d["w"].to(dtype), 0, r, 2)
        _load(row.weight, d["wr"].to(dtype), 1, r, 2)
        for p in (col.weight, row.weight):
            p.main_grad = torch.full(p.shape, 0.5)  # type: ignore[attr-defined]
            if with_flag:
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        h, _ = col(d["x"].to(dtype))
        y, _ = row(h)
        y.backward(d["dy"].to(dtype))
        return {
            "col": main_grad(col.weight),
            "row": main_grad(row.weight),
            "flags": [
                getattr(p, "grad_added_to_main_grad", None) for p in (col.weight, row.weight)
            ],
            "grads": [p.grad is not None for p in (col.weight, row.weight)],
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(("dtype", "with_flag"), [(torch.float32, True), (torch.bfloat16, False)])
def test_gradient_accumulation_fusion_adds_into_main_grad(
    rank_pools: RankPools, dtype: torch.dtype, with_flag: bool
) -> None:
    d = {
        "x": randn(S, B, K, seed=1),
        "w": randn(N, K, seed=2),
        "wr": randn(K, N, seed=3),
        "dy": randn(S, B, K, seed=4),
    }
    # Reference in fp32 from the same (possibly bf16-rounded) values. The column layer's
    # activations are bf16 products in the bf16 run, so the reference rounds h like it does.
    x, w, wr, dy = (d[k].to(dtype).float() for k in ("x", "w", "wr", "dy"))
    h = (x @ w.t()).to(dtype).float()
    dh = (dy @ wr).to(dtype).float()
    ref_row = dy.reshape(-1, K).t() @ h.reshape(-1, N)
    ref_col = dh.reshape(-1, N).t() @ x.reshape(-1, K)
    for r, out in enumerate(rank_pools.get(2).run(_fusion, dtype, with_flag, d)):
        assert out["col"].dtype == torch.float32
        assert_close(out["col"], 0.5 + chunk(ref_col, 2, r, 0), "column main_grad")
        assert_close(out["row"], 0.5 + chunk(ref_row, 2, r, 1), "row main_grad")
        # With DDP's flag the layer sets it and hands autograd a dummy grad; without it,
        # nothing lands in .grad.
        assert out["flags"] == ([True, True] if with_flag else [None, None])
        assert out["grads"] == [with_flag, with_flag]


def _deferral(limit: int, sp: bool, xs: list[torch.Tensor], dy: torch.Tensor) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        acts: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        cfg = config(
            2,
            sequence_parallel=sp,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            wgrad_deferral_limit=limit,
        )
        layer = tpl.ColumnParallelLinear(
            K,
            N,
            config=cfg,
            init_method=torch.nn.init.ones_,
            bias=False,
            embedding_activation_buffer=acts,
            grad_output_buffer=grads,
            pg_collection=pgc,
        )
        assert layer.weight is not None
        layer.weight.main_grad = torch.zeros(layer.weight.shape)  # type: ignore[attr-defined]
        after_each = []
        for x in xs:
            y, _ = layer(chunk(x, 2, r, 0) if sp else x)
            y.backward(chunk(dy, 2, r, -1))
            after_each.append(layer.weight.main_grad.clone())  # type: ignore[attr-defined]
        held = (len(acts), len(grads))
        with mg.record_collectives() as log:
            drain_embedding_wgrad_compute(cfg, acts, grads, layer.weight, pgc.tp)
        return {
            "after_each": after_each,
            "held": held,
            "final": layer.weight.main_grad,  # type: ignore[attr-defined]
            "empty": (len(acts), len(grads)),
            "drain": ops(log),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(("limit", "sp"), [(0, False), (2, True)])
def test_wgrad_deferral_and_drain(rank_pools: RankPools, limit: int, sp: bool) -> None:
    xs = [randn(S, B, K, seed=10 + i) for i in range(3)]
    dy = randn(S, B, N, seed=20)
    dws = [dy.reshape(-1, N).t() @ x.reshape(-1, K) for x in xs]
    deferred = 3 if limit == 0 else limit
    for r, out in enumerate(rank_pools.get(2).run(_deferral, limit, sp, xs, dy)):
        mine = [chunk(dw, 2, r, 0) for dw in dws]
        for i, grad in enumerate(out["after_each"]):
            # micro-batches beyond the limit compute their wgrad at once
            expected = sum((mine[j] for j in range(deferred, i + 1)), torch.zeros_like(mine[0]))
            assert_close(grad, expected, f"main_grad after micro-batch {i}")
        assert out["held"] == (deferred, deferred)
        assert out["empty"] == (0, 0)
        assert_close(out["final"], mine[0] + mine[1] + mine[2], "main_grad after drain")
        assert out["drain"] == (["all_gather"] * deferred if sp else [])


def _gtp(d: dict[str, torch.Tensor], fusion: bool, per_token: bool) -> dict[str, Any]:
    pgc = world(1, gtp_remat_size=2)
    try:
        r = pgc.require("gtp_remat", "test").rank()
        cfg = config(
            1,
            gtp_remat_size=2,
            gradient_accumulation_fusion=fusion,
            calculate_per_token_loss=per_token,
        )
        col = tpl.ColumnParallelLinear(
            K, 5, config=cfg, init_method=lambda t: t.copy_(d["w"]), pg_collection=pgc
        )
        row = tpl.RowParallelLinear(
            5,
            K,
            config=cfg,
            init_method=lambda t: t.copy_(d["wr"]),
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        )
        assert col.weight is not None
        assert col.bias is not None
        if fusion:
            for p in (col.weight, row.weight):
                p.main_grad = torch.zeros(p.shape)  # type: ignore[attr-defined]
        shards = [col.weight.detach().clone(), row.weight.detach().clone()]
        with mg.record_collectives() as fwd:
            h, _ = col(d["x"][r])
            y, _ = row(h)
        with mg.record_collectives() as bwd:
            backward(y, d["dy"][r])
        grads = [
            getattr(p, "main_grad", None) if fusion else p.grad for p in (col.weight, row.weight)
        ]
        return {
            "y": y.detach(),
            "shards": shards,
            "grads": grads,
            "pads": [col.weight.pad_length, row.weight.pad_length],  # type: ignore[attr-defined]
            "pad_zeros": [
                gtp_local_pad_zero_count(p, 0, p.numel()) for p in (col.weight, row.weight)
            ],
            "keep": [param_is_not_gtp_duplicate(p) for p in (col.weight, col.bias)],
            "fwd": ops(fwd),
            "bwd": ops(bwd),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("fusion", [False, True])
def test_gtp_remat_shards_the_weight_rows(
    rank_pools: RankPools, fusion: bool, per_token: bool
) -> None:
    """TP = 1, gtp_remat = 2: each rank holds ceil(5/2) = 3 rows of the column weight [5, 8]
    (rank 1's last row is padding) and 4 of the row weight [8, 5]. The ranks see different
    data; every GEMM uses the full weight, and each shard's grad is the MEAN of both ranks'
    grads (the wgrad is pre-scaled by 1/2 before the SUM reduce-scatter), or their SUM under
    calculate_per_token_loss. Reading from Megatron-Core's
    ``generalized_tensor_parallelism.py::_prescale_wgrads_for_mean_rs``: the gtp_remat axis
    is averaged like every replicated param's (finalize's AVG), summed under per-token
    loss (finalize divides by the global token count)."""
    d = {
        "x": randn(2, S, B, K, seed=1),
        "w": randn(5, K, seed=2),
        "wr": randn(K, 5, seed=3),
        "dy": randn(2, S, B, K, seed=4),
    }
    refs, dw, dwr = [], torch.zeros(5, K), torch.zeros(K, 5)
    for r in range(2):
        w = d["w"].clone().requires_grad_()
        wr = d["wr"].clone().requires_grad_()
        y = _linear(_linear(d["x"][r], w), wr)
        backward(y, d["dy"][r])
        refs.append(y.detach())
        dw, dwr = dw + w.grad, dwr + wr.grad  # type: ignore[operator]
    if not per_token:
        dw, dwr = dw / 2, dwr / 2
    padded_w = torch.cat([d["w"], torch.zeros(1, K)])
    padded_dw = torch.cat([dw, torch.zeros(1, K)])
    for r, out in enumerate(rank_pools.get(2).run(_gtp, d, fusion, per_token)):
        assert_close(out["y"], refs[r], "gtp output")
        assert torch.equal(out["shards"][0], padded_w[3 * r : 3 * r + 3])
        assert torch.equal(out["shards"][1], d["wr"][4 * r : 4 * r + 4])
        assert_close(out["grads"][0], padded_dw[3 * r : 3 * r + 3], "column shard grad")
        assert_close(out["grads"][1], dwr[4 * r : 4 * r + 4], "row shard grad")
        assert out["pads"] == [1, 0]
        assert out["pad_zeros"] == [K * r, 0]  # the padding row sits in rank 1's shard
        assert out["keep"] == [True, r == 0]  # shards unique; the bias counts on rank 0 only
        assert out["fwd"] == ["all_gather", "all_gather"]
        # backward: row re-gathers its weight and reduce-scatters dW, then the column
        assert out["bwd"] == ["all_gather", "reduce_scatter"] * 2


def _output_dtype(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        layer = tpl.ColumnParallelLinear(
            K,
            N,
            config=config(2, sequence_parallel=True, params_dtype=torch.bfloat16),
            init_method=torch.nn.init.zeros_,
            output_dtype=torch.float32,
            pg_collection=pgc,
        )
        assert layer.weight is not None
        assert layer.bias is not None
        _load(layer.weight, d["w"], 0, r, 2)
        x = chunk(d["x"], 2, r, 0).requires_grad_()
        y, _ = layer(x)
        y.backward(chunk(d["dy"], 2, r, -1))
        return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad}
    finally:
        mg.destroy_model_parallel(pgc)


def test_output_dtype_fp32_from_bf16(rank_pools: RankPools) -> None:
    d = {
        "x": randn(S, B, K, seed=1).bfloat16(),
        "w": randn(N, K, seed=2).bfloat16(),
        "dy": randn(S, B, N, seed=3),
    }
    y_ref = torch.nn.functional.linear(d["x"].float(), d["w"].float())
    # Backward runs in the input dtype: the fp32 output gradient is rounded to bf16, each
    # rank's dgrad GEMM gives a bf16 partial dX and the reduce-scatter adds the two partials
    # in bf16. The reference repeats those roundings, so results agree to one bf16 ulp.
    dy = d["dy"].bfloat16()
    partials = [chunk(dy, 2, r, -1).matmul(chunk(d["w"], 2, r, 0)) for r in range(2)]
    dx_ref = (partials[0].float() + partials[1].float()).bfloat16()
    dw_ref = dy.reshape(-1, N).t().matmul(d["x"].reshape(-1, K))
    results = rank_pools.get(2).run(_output_dtype, d)
    y = torch.cat([o["y"] for o in results], dim=-1)
    assert y.dtype == torch.float32
    assert_close(y, y_ref, "fp32 output of bf16 operands")
    assert all(o["dx"].dtype == torch.bfloat16 and o["dw"].dtype == torch.bfloat16 for o in results)
    ulp = 2.0**-8
    torch.testing.assert_close(torch.cat([o["dx"] for o in results], 0), dx_ref, rtol=ulp, atol=0.0)
    torch.testing.assert_close(torch.cat([o["dw"] for o in results], 0), dw_ref, rtol=ulp, atol=0.0)


def test_gemm_helpers_widen_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (6, 64), generator=g).bfloat16()
    w = torch.randint(-8, 9, (5, 64), generator=g).bfloat16()
    dy = torch.randint(-8, 9, (6, 5), generator=g).bfloat16()
    # Integer operands below 2^24 make every product and sum exact in fp32: bitwise equal.
    y = _linear_forward(x, w, None, torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, x.double().matmul(w.double().t()).float())
    out = torch.empty(5, 64, dtype=torch.float32)
    assert _wgrad_gemm(out, dy, x) is out
    assert torch.equal(out, dy.double().t().matmul(x.double()).float())
    assert _linear_forward(x, w, None, None).dtype == torch.bfloat16


def test_te_wrapper_reshapes_and_adds_bias() -> None:
    """Localizes mc's use of Transformer Engine's ``general_gemm`` for ``output_dtype`` (the
    real kernel needs CUDA: ``test_cuda.py``): a stand-in with TE 2.x's contract
    (``general_gemm(A, B, out_dtype=None, ..., layout="TN", ...)``, no workspace;
    ``layout="TN"``: ``out = B · Aᵀ`` in ``out_dtype``, returned first of four) receives a
    2-D input and the weight, and the wrapper restores the leading dims and adds the bias in
    fp32. Integer operands keep every value exact, so the torch path must agree bitwise.
    ``test_te_gemm.py`` builds the stand-in from the pinned TE release's own signature."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...], str]] = []

    def general_gemm(
        A: torch.Tensor,  # noqa: N803 - TE's parameter names
        B: torch.Tensor,  # noqa: N803
        out_dtype: torch.dtype | None = None,
        quantization_params: object = None,
        gelu: bool = False,
        gelu_in: torch.Tensor | None = None,
        alpha: float = 1.0,
        beta: float | None = None,
        accumulate: bool = False,
        layout: str = "TN",
        out: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None, None, None]:
        assert out_dtype is not None
        calls.append((tuple(A.shape), tuple(B.shape), layout))
        return B.double().matmul(A.double().t()).to(out_dtype), None, None, None

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, (3, 2, 16), generator=g).bfloat16()
    w = torch.randint(-8, 9, (5, 16), generator=g).bfloat16()
    bias = torch.randint(-8, 9, (5,), generator=g).bfloat16()
    for b in (None, bias):
        y = _gemm._te_linear_forward(general_gemm, x, w, b, torch.float32)
        assert y.dtype == torch.float32
        assert y.shape == (3, 2, 5)
        assert torch.equal(y, _linear_forward(x, w, b, torch.float32))
    assert calls == [((5, 16), (6, 16), "TN")] * 2


def _layer_options(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        out: dict[str, Any] = {}
        variants: dict[str, dict[str, Any]] = {
            "skip_bias": {"skip_bias_add": True},
            "expert": {"is_expert": True},
            "no_reduce": {"disable_grad_reduce": True},
        }
        for name, kw in variants.items():
            col = tpl.ColumnParallelLinear(
                K, N, config=config(2), init_method=torch.nn.init.zeros_, pg_collection=pgc, **kw
            )
            row = tpl.RowParallelLinear(
                N,
                K,
                config=config(2),
                init_method=torch.nn.init.zeros_,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=name == "skip_bias",
                is_expert=name == "expert",
                pg_collection=pgc,
            )
            assert col.bias is not None
            assert row.bias is not None
            _load(col.weight, d["w"], 0, r, 2)
            _load(row.weight, d["wr"], 1, r, 2)
            with torch.no_grad():
                col.bias.copy_(chunk(d["b"], 2, r, 0))
                row.bias.copy_(d["br"])
            x = d["x"].clone().requires_grad_()
            with mg.record_collectives() as log:
                h, col_bias = col(x)
                y, row_bias = row(h)
                backward(y, d["dy"])
            gathered, _ = col(d["x"], runtime_gather_output=True)
            out[name] = {
                "gathered": gathered.detach(),
                "h": h.detach(),
                "y": y.detach(),
                "dx": x.grad,
                "ops": ops(log),
                "col_bias": col_bias,
                "row_bias": row_bias,
            }
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_skip_bias_add_expert_and_disable_grad_reduce(rank_pools: RankPools) -> None:
    d = {
        "x": randn(S, B, K, seed=1),
        "w": randn(N, K, seed=2),
        "b": randn(N, seed=3),
        "wr": randn(K, N, seed=4),
        "br": randn(K, seed=5),
        "dy": randn(S, B, K, seed=6),
    }
    results = rank_pools.get(2).run(_layer_options, d)
    h_nobias = _linear(d["x"], d["w"])
    for r, res in enumerate(results):
        # skip_bias_add: each layer returns its bias instead of adding it
        skip = res["skip_bias"]
        assert_close(skip["h"], chunk(h_nobias, 2, r, -1), "column output without bias")
        assert torch.equal(skip["col_bias"], chunk(d["b"], 2, r, 0))
        assert torch.equal(skip["row_bias"], d["br"])
        # runtime_gather_output=True overrides gather_output=False for one call
        assert_close(skip["gathered"], h_nobias, "gathered column output")
        assert skip["ops"] == ["all_reduce", "all_reduce"]  # row forward, column dX
        # experts communicate in the MoE layer: no collective here, row returns partials
        assert res["expert"]["ops"] == []
        # disable_grad_reduce leaves dX unreduced: only the row forward all-reduce runs
        assert res["no_reduce"]["ops"] == ["all_reduce"]
    # expert row layers return each rank's partial product (plus the bias), unreduced
    for r, res in enumerate(results):
        partial = _linear(chunk(h_nobias + d["b"], 2, r, -1), chunk(d["wr"], 2, r, 1)) + d["br"]
        assert_close(res["expert"]["y"], partial, "expert partial output")
    # the unreduced dX of each rank sums to the full dX
    xx = d["x"].clone().requires_grad_()
    y_full = _linear(_linear(xx, d["w"]) + d["b"], d["wr"]) + d["br"]
    backward(y_full, d["dy"])
    assert xx.grad is not None
    assert_close(
        results[0]["no_reduce"]["dx"] + results[1]["no_reduce"]["dx"], xx.grad, "unreduced dX"
    )
