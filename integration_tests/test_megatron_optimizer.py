"""Megatron-Core's own optimizers over mc's DDP, where megatron-core is installed.

A Megatron-Core user who switches DDP to mc keeps Megatron's optimizer:
``get_megatron_optimizer`` builds a ``DistributedOptimizer`` over the DDP's buffers (its
``partition_buckets`` makes bucket groups from each buffer's ``ddp_config``,
``data_parallel_group`` and ``data_parallel_world_size``; it maps params through
``param_index_map``, ``buckets[i].offset`` / ``grad_data`` / ``numel_unpadded`` /
``param_data``, ``num_optimizer_shards``, ``param_dtype`` / ``grad_dtype``, and steps
through the chunk's ``ddp_config``, ``bucket_groups``, ``expert_parallel_bucket_groups``,
``_start_bucket_group_param_sync`` and ``zero_grad_buffer``). On Megatron main, a Muon user's
``LayerWiseDistributedOptimizer`` reads the chunk's ``full_param_layout`` and the buffer
keys' ``is_managed_by_layer_wise_optimizer``. Held here (2 gloo ranks, dp = 2, fp32):

1. ``get_megatron_optimizer`` (Adam, ``use_distributed_optimizer``, ``clip_grad=0.05``, so
   every step clips) over mc DDP with overlapped grad reduce, param gather off and on: the
   grad norm Megatron reports equals ``torch.nn.utils.clip_grad_norm_`` of one process on
   the whole batch (1e-6 relative) and the weights after 3 steps equal that process's
   clipped AdamW run (1e-6 absolute).
2. Megatron main only: for the model of ``test_parity_layer_wise.py``, Megatron's
   ``LayerWiseDistributedOptimizer.compute_full_param_layout`` equals the layout derived by
   hand there; mc DDP built over it, with Megatron's ``LayerWiseDistributedOptimizer``
   (whole-matrix normalised SGD) chained with a ``DistributedOptimizer`` (the biases), trains
   like one process (1e-6 absolute after 3 steps, overlapped param gather off and on);
   Megatron's and mc's ``BufferKey`` are equal both ways and hash alike.
3. Megatron main only: ``numel_unpadded`` and every other layout field of mc's
   ``compute_distributed_optimizer_param_layout`` equal Megatron's
   ``DistributedOptimizer._compute_per_buffer_param_layout`` over a sweep of param lists,
   bucket sizes, dp sizes and shared-embedding positions (the buckets a shared embedding
   closes included).

Megatron's optimizers are CUDA-only in three places, adapted for this file only (undone
after): ``import megatron.core`` imports triton (a throwaway module stands in during the
import), ``MixedPrecisionOptimizer`` and the grad-norm code allocate a few small tensors with
``device='cuda'`` (sent to the CPU), and ``DistributedOptimizer`` accepts only params whose
``Tensor.type()`` names a ``torch.cuda`` type (CPU tensors report those names). None of them
touches what mc provides. Run it where megatron-core is installed, e.g. in the upstream
harness's venv (``../shared/upstream/run`` builds it), with main's source on the path for
cases 2 and 3::

    PYTHONPATH=$HOME/.cache/mc-upstream/megatron-main \\
        $HOME/.cache/mc-upstream/venv/bin/python -m pytest \\
        integration_tests/test_megatron_optimizer.py
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from integration_tests import test_parity_layer_wise as lw
from mc_buffers import BufferKey
from mc_buffers.layout import compute_distributed_optimizer_param_layout
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ensure_params_ready
from mc_groups.testing import RankPool

STEPS, LR, CLIP = 3, 1e-2, 0.05
_MISSING = importlib.util.find_spec("megatron") is None
pytestmark = pytest.mark.skipif(
    _MISSING,
    reason="megatron-core is not installed here: the project's environments do not install it "
    "(only PyPI has it, installed without its dependencies and past its Python pin); run "
    "this file in the upstream harness's venv (see the module docstring)",
)


# ------------------------------------------------------------------ Megatron on CPU


class _Anything(types.ModuleType):
    """A module whose every attribute is a no-op decorator (``@triton.jit``) or itself."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


def _import_megatron() -> Any:
    if "megatron.core.optimizer" in sys.modules:
        return sys.modules["megatron.core.optimizer"]
    import torch._dynamo
    import torch._inductor

    torch.compile(lambda x: x)  # loads the compile stack Megatron's decorators reach for
    names = ("triton", "triton.language")
    for name in names:
        stand_in = _Anything(name)
        stand_in.__path__ = []
        stand_in.__version__ = "0.0.0"  # type: ignore[attr-defined]  # older than any gate
        stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = stand_in
    try:
        return importlib.import_module("megatron.core.optimizer")
    finally:
        for name in names:
            del sys.modules[name]


_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextmanager
def _megatron_on_cpu() -> Iterator[Any]:
    """Megatron's optimizer package, with its CUDA-only spots adapted (module notes)."""
    module = _import_megatron()
    saved = (torch.tensor, torch.zeros, torch.Tensor.type)

    def on_cpu(factory: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        return saved[2](self, *args, **kwargs)

    torch.tensor, torch.zeros = on_cpu(saved[0]), on_cpu(saved[1])
    torch.Tensor.type = tensor_type  # type: ignore[assignment, method-assign]
    try:
        yield module
    finally:
        torch.tensor, torch.zeros = saved[0], saved[1]
        torch.Tensor.type = saved[2]  # type: ignore[method-assign]


def _has_layer_wise() -> bool:
    return importlib.util.find_spec("megatron.core.optimizer.layer_wise_optimizer") is not None


# ------------------------------------------------------------ 1. DistributedOptimizer


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _batch() -> torch.Tensor:
    return torch.randn(12, 8, generator=torch.Generator().manual_seed(1))


def _reference_clipped() -> tuple[list[float], list[torch.Tensor]]:
    net = _model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        net(_batch()).pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
    return norms, [p.detach().clone() for p in net.parameters()]


def _distributed_optimizer(megatron: Any, overlap_param_gather: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    pgc = mg.initialize_model_parallel()
    try:
        net = _model()
        cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=overlap_param_gather,
            bucket_size=40,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, net, pg_collection=pgc)
        config = megatron.OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=0.0,
            clip_grad=CLIP,
            use_distributed_optimizer=True,
        )
        opt = megatron.get_megatron_optimizer(
            config, [ddp], pg_collection=pgc, use_gloo_process_groups=False
        )
        norms = []
        rows = slice(6 * rank, 6 * rank + 6)
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(_batch()[rows]).pow(2).mean().backward()
            ddp.finish_grad_sync()
            ok, norm, _ = opt.step()
            assert ok
            norms.append(float(norm))
        ensure_params_ready(list(net.parameters()))
        ref_norms, ref_weights = _reference_clipped()
        return {
            "buckets": len(ddp.bucket_groups),
            "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
            "min_norm_over_clip": min(ref_norms) / CLIP,
            "weight_abs": max(
                float((p - r).abs().max())
                for p, r in zip(net.parameters(), ref_weights, strict=True)
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


# ----------------------------------------------------- 2. LayerWiseDistributedOptimizer


def _layer_wise(megatron: Any, overlap_param_gather: bool) -> dict[str, Any]:
    layer_wise = importlib.import_module("megatron.core.optimizer.layer_wise_optimizer")
    rank = dist.get_rank()
    pgc = mg.initialize_model_parallel()
    try:
        net = lw.model()
        layer_wise.tag_params_for_buffer_routing([net])
        cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=overlap_param_gather,
        )
        theirs = layer_wise.LayerWiseDistributedOptimizer.compute_full_param_layout(
            list(net.parameters()), None, 2, cfg
        )
        ours = lw.layer_wise_layout(net)
        # field by field, Megatron's keys looked up with mc's (and the other way round)
        same_layout = {k: vars(v) for k, v in theirs.layouts.items()} == {
            k: vars(v) for k, v in ours.layouts.items()
        } and all(vars(theirs.layouts[k]) == vars(v) for k, v in ours.layouts.items())
        ddp = DistributedDataParallel(
            mg.ModelParallelConfig(), cfg, net, pg_collection=pgc, full_param_layout=theirs
        )
        config = megatron.OptimizerConfig(
            optimizer="adam", lr=lw.LR, weight_decay=0.0, use_distributed_optimizer=True
        )
        matrices = [p for p in net.parameters() if p.dim() == 2]
        biases = [p for p in net.parameters() if p.dim() != 2]
        base = lw.NormalizedSGD([{"params": matrices, "normalize": True}])
        by_layer = layer_wise.LayerWiseDistributedOptimizer(
            [megatron.FP32Optimizer(base, config, None)], config, pgc, model_chunks=[ddp]
        )
        plain = torch.optim.SGD(
            [{"params": biases, "wd_mult": 1.0, "lr_mult": 1.0, "default_config": True}],
            lr=lw.LR,
        )
        dense = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        rest = dense.DistributedOptimizer(
            plain,
            config,
            None,
            lambda opt, config=None: None,
            model_chunks=[ddp],
            per_model_buffers={0: [b for b in ddp.buffers if b.params[0].dim() != 2]},
            data_parallel_group=pgc.dp_cp,
            data_parallel_group_gloo=None,
            data_parallel_group_idx=0,
            distributed_optimizer_instance_id=0,
        )
        for child in (by_layer, by_layer.chained_optimizers[0], rest):
            child.tp_group = child.expert_tp_group = pgc.tp
            child.grad_stats_parallel_group = pgc.intra_dist_opt
        opt = megatron.ChainedOptimizer([by_layer, rest])
        mine = {id(p) for p in base.param_groups[0]["params"]}
        owned = sorted(n for n, p in net.named_parameters() if id(p) in mine)
        x, target = lw.data()
        rows = slice(rank * lw.ROWS // 2, (rank + 1) * lw.ROWS // 2)
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            (ddp(x[rows]) - target[rows]).pow(2).mean().backward()
            ddp.finish_grad_sync()
            opt.step()
        ensure_params_ready(list(net.parameters()))
        reference = lw.model()
        ref_opt = lw.optimizer_over(list(reference.parameters()))
        for _ in range(STEPS):
            ref_opt.zero_grad()
            (reference(x) - target).pow(2).mean().backward()
            ref_opt.step()
        key = BufferKey(torch.float32, torch.float32, False, True)
        their_key = next(k for k in theirs.layouts if k.is_managed_by_layer_wise_optimizer)
        return {
            "same_layout": same_layout,
            "keys": (key == their_key, their_key == key, hash(key) == hash(their_key)),
            "owned": owned,
            "weight_abs": max(
                float((p - r).abs().max())
                for p, r in zip(net.parameters(), reference.parameters(), strict=True)
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


# ------------------------------------------------------------------- 3. layout sweep


def _layout_sweep() -> dict[str, int]:
    dist_opt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    megatron_layout = dist_opt.DistributedOptimizer._compute_per_buffer_param_layout
    cases = differ = closed_by_shared = 0
    sizes = [[100], [10, 100], [100, 10, 37], [64, 64, 1000, 3], [5000, 7, 130, 129]]
    for numels, bucket, dp, busbw in itertools.product(
        sizes, [None, 50, 128, 1000], [1, 2, 3, 8], [False, True]
    ):
        for shared in itertools.chain([()], ((i,) for i in range(len(numels))), [(0, -1)]):
            params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in numels]
            for i in shared:
                params[i].shared_embedding = True  # type: ignore[attr-defined]
            cfg = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=busbw)
            theirs = megatron_layout(params, bucket, dp, cfg, list(range(len(params))))
            ours = compute_distributed_optimizer_param_layout(params, bucket, dp, busbw)
            ours.param_indices = list(range(len(params)))
            cases += 1
            differ += vars(theirs) != vars(ours)
            closed_by_shared += (
                any(getattr(params[i], "shared_embedding", False) for i in shared)
                and len(theirs.bucket_indices) > 1
            )
    return {"cases": cases, "differ": differ, "with_shared_buckets": closed_by_shared}


def _all_cases() -> dict[str, Any]:
    with _megatron_on_cpu() as megatron:
        out: dict[str, Any] = {
            "dist_opt": [_distributed_optimizer(megatron, flag) for flag in (False, True)],
            "main": _has_layer_wise(),
        }
        if out["main"]:
            out["layer_wise"] = [_layer_wise(megatron, flag) for flag in (False, True)]
            out["sweep"] = _layout_sweep()
        return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    with RankPool(2) as pool:  # its own processes: the CPU adaptation dies with them
        return pool.run(_all_cases)


def test_megatron_distributed_optimizer_over_mc_ddp(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        for case in run["dist_opt"]:
            print(f"DistributedOptimizer over mc DDP: {case}")
            assert case["buckets"] >= 2
            assert case["min_norm_over_clip"] > 1  # every step clipped
            assert case["norm_rel"] <= 1e-6
            assert case["weight_abs"] <= 1e-6


def test_megatron_layer_wise_optimizer_over_mc_ddp(runs: list[dict[str, Any]]) -> None:
    if not runs[0]["main"]:
        pytest.skip("this megatron-core has no LayerWiseDistributedOptimizer (Megatron main)")
    owners = {0: ["2.weight", "4.weight"], 1: ["0.weight", "6.weight"]}
    for rank, run in enumerate(runs):
        for case in run["layer_wise"]:
            print(f"LayerWiseDistributedOptimizer over mc DDP: {case}")
            assert case["same_layout"]
            assert case["keys"] == (True, True, True)
            assert case["owned"] == owners[rank]
            assert case["weight_abs"] <= 1e-6


def test_distributed_optimizer_layouts_equal_megatrons(runs: list[dict[str, Any]]) -> None:
    if not runs[0]["main"]:
        pytest.skip("this megatron-core computes layouts inside its buffer (Megatron main)")
    sweep = runs[0]["sweep"]
    print(f"layout sweep: {sweep}")
    assert sweep["cases"] == (3 + 4 + 5 + 6 + 6) * 4 * 4 * 2  # every case ran
    assert sweep["with_shared_buckets"] > 0
    assert sweep["differ"] == 0
