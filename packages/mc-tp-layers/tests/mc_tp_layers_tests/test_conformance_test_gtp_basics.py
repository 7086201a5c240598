"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_gtp_basics.py``.

Upstream drives gtp_remat through Transformer Engine modules wrapped by
``wrap_module_params_gtp``; mc's counterparts are :func:`mc_tp_layers.gtp.shard_weight_for_gtp`,
the layers' ``config.gtp_remat_size`` and the linear functions' ``gtp_remat_size``. Four
ranks form one gtp_remat group of 4 (TP = 1), as upstream's world of 4.

Held by existing tests: forward/backward values against the full weight, the weight
gradient's shape (the shard's), main_grad filled by the reduce-scatter for one and for two
layers, fused wgrad accumulation (``TestLinearGTP``, ``TestGTPWgradRS``,
``TestFuseWgradAccumulation``, ``TestGTPGradAccumHook``):
``test_linear_functions.py::test_gtp_remat_shards_the_weight_rows``.

Not covered (mc has no such machinery): the weight cache, prefetch chains and their
classification, double buffering, asynchronous reduce-scatter bookkeeping
(``wait_async_comms``), CUDA-graph wgrad rings and capture readiness, TE's recompute flag,
``LayerNormLinear`` / ``GroupedLinear`` / ``te.ops.GroupedLinear`` and MXFP8 shards. The
DDP bucket-layout and grad-ready tests (``TestGTPDDPBucketAlignment``,
``TestGTPDDPGradReadyWiring``) concern the DDP wrapper, not these layers.
"""  # noqa: E501

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers.gtp import shard_weight_for_gtp
from mc_tp_layers.linear import linear_with_grad_accumulation_and_async_allreduce
from mc_tp_layers_tests._helpers import assert_close, backward, config, world

W = 4  # gtp_remat ranks


def _gtp_basics() -> dict[str, Any]:
    pgc = world(1, gtp_remat_size=W, set_default=True)
    try:
        g = pgc.require("gtp_remat", "test")
        r = g.rank()
        out: dict[str, Any] = {}
        # Sharding, aligned: K = 32·W rows, no padding.
        full = torch.arange(128.0 * 16).reshape(128, 16)
        shard = shard_weight_for_gtp(torch.nn.Parameter(full.clone()), g)
        out["aligned"] = (shard.detach(), shard.pad_length)  # type: ignore[attr-defined]
        # Sharding, unaligned: K = 16·W - 1 rows of ones, padded to 16·W.
        ones = torch.nn.Parameter(torch.ones(16 * W - 1, 16))
        shard = shard_weight_for_gtp(ones, g)
        out["unaligned"] = (shard.detach(), shard.pad_length)  # type: ignore[attr-defined]
        # A layer's weight is replaced by its shard, tagged with the group.
        layer = tpl.ColumnParallelLinear(
            64, 128, config=config(1, gtp_remat_size=W), init_method=torch.nn.init.ones_
        )
        assert layer.weight is not None
        w = layer.weight
        out["layer"] = {
            "shape": tuple(w.shape),
            "group_is_gtp_remat": getattr(w, "group", None) is g,
            "tagged": getattr(w, "is_gtp_weight_remat", False),
        }
        # Two micro-batches with an unchanged weight give the same output; the weight is
        # all-gathered again for each.
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
        with mg.record_collectives() as log:
            first, _ = layer(x)
            second, _ = layer(x)
        out["microbatches"] = (torch.equal(first, second), [e.op for e in log])
        out["wgrad_dtype"] = _wgrad_rs_dtype(r)
        # gtp_remat off: nothing is sharded and nothing is gathered, with or without a
        # collection that lacks gtp_remat.
        plain = tpl.ColumnParallelLinear(
            8,
            16,
            config=config(1),
            init_method=torch.nn.init.ones_,
            pg_collection=mg.ProcessGroupCollection(tp=pgc.tp),
        )
        assert plain.weight is not None
        with mg.record_collectives() as log:
            plain(torch.ones(2, 8))
        out["off"] = {
            "shape": tuple(plain.weight.shape),
            "tagged": hasattr(plain.weight, "is_gtp_weight_remat"),
            "gtp_group": plain.gtp_group,
            "ops": [e.op for e in log],
        }
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def _wgrad_rs_dtype(r: int) -> dict[str, Any]:
    """A bf16 gtp_remat shard with an fp32 main_grad, through the linear function."""
    dense = torch.nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    default = mg.get_default_collection()
    assert default is not None
    assert isinstance(dense.weight, torch.nn.Parameter)
    weight = shard_weight_for_gtp(dense.weight, default.require("gtp_remat", "test"))
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)  # type: ignore[attr-defined]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(r)).bfloat16()
    x.requires_grad_()
    with mg.record_collectives() as log:
        y = linear_with_grad_accumulation_and_async_allreduce(
            input=x,
            weight=weight,
            bias=None,
            gradient_accumulation_fusion=True,
            allreduce_dgrad=False,
            sequence_parallel=False,
            gtp_remat_size=W,
        )
        backward(y, torch.ones_like(y))
    return {
        "x": x.detach(),
        "main_grad": weight.main_grad,  # type: ignore[attr-defined]
        "rs": [(e.op, e.dtype) for e in log if e.op == "reduce_scatter"],
    }


def test_gtp_basics(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_basics.py::
    TestGTPSharding::test_aligned_shard_content``, ``::TestGTPSharding::
    test_unaligned_shard_padding``, ``::TestWrapModuleParams`` (the plain-linear case),
    ``::TestGTPWgradRSDtype::test_wgrad_rs_follows_main_grad_dtype``,
    ``::TestGTPMicrobatches::test_consistent_across_microbatches``,
    ``::TestGTPGroupSizeOne::test_no_sharding_when_gtp_remat_size_one`` and
    ``::TestGTPRematPgCollectionWithoutParallelState::test_gtp_remat_pgs_are_none_and_do_not_raise``.

    - Aligned ``[128, 16]`` over 4: rank r holds rows ``[32r, 32r + 32)``, ``pad_length``
      0. Unaligned ``[63, 16]``: padded to 64, every shard has 16 rows, the last holds the
      one zero padding row; ``pad_length`` (1) is the global amount on every rank. mc's
      shard includes its padding rows (upstream's ``get_padded_shard()``).
    - A gtp_remat layer's weight is its ``[128 / 4, 64]`` shard, tagged
      ``is_gtp_weight_remat``, with ``group`` the gtp_remat group.
    - With an fp32 ``main_grad`` on a bf16 shard the reduce-scatter runs in fp32, and its
      result is right: with ``dY = 1`` every wgrad row is the input's column sum, so each
      shard row holds the mean over the 4 ranks of their column sums (mean: the 1/G
      reading, see ``test_gtp_grad_correctness``). Upstream feeds every rank the same
      input; distinct inputs per rank here make the mean visible.
    - Two forwards with the same weight give the same output (each gathers the weight).
    - gtp_remat off (size 1): the weight keeps its full shape and no tags, nothing is
      gathered, and a collection without ``gtp_remat`` is fine (no group is looked up).
    """
    full = torch.arange(128.0 * 16).reshape(128, 16)
    results = rank_pools.get(W).run(_gtp_basics)
    column_sums = torch.stack([res["wgrad_dtype"]["x"].float().sum(dim=0) for res in results]).mean(
        dim=0
    )
    for r, res in enumerate(results):
        shard, pad = res["aligned"]
        assert torch.equal(shard, full[32 * r : 32 * r + 32])
        assert pad == 0
        shard, pad = res["unaligned"]
        assert shard.shape == (16, 16)
        assert pad == 1
        expected = torch.ones(16, 16)
        if r == W - 1:
            expected[-1] = 0.0
        assert torch.equal(shard, expected)
        assert res["layer"] == {"shape": (32, 64), "group_is_gtp_remat": True, "tagged": True}
        assert res["microbatches"] == (True, ["all_gather", "all_gather"])
        wgrad = res["wgrad_dtype"]
        assert wgrad["rs"] == [("reduce_scatter", torch.float32)]
        assert wgrad["main_grad"].dtype == torch.float32
        assert_close(wgrad["main_grad"], column_sums.expand(32, 64), "fp32 wgrad rows")
        assert res["off"] == {"shape": (16, 8), "tagged": False, "gtp_group": None, "ops": []}
