"""Buffers laid out by Megatron-Core main's layer-wise optimizer (Muon's
``LayerWiseDistributedOptimizer``), trained on 2 ranks against one process.

A Megatron-Core main user who trains with Muon tags the matrices
(``tag_params_for_buffer_routing``: ``is_managed_by_layer_wise_optimizer``), computes
``LayerWiseDistributedOptimizer.compute_full_param_layout`` and passes it to DDP with
``use_distributed_optimizer=True``. The tagged params get a buffer of their own whose
buckets split into dp equal shards that each hold **whole** params, so every rank can run a
whole-matrix update (Newton-Schulz for Muon) on the params of its shard; DDP reduce-scatters
the grads into the shards and all-gathers the updated params, as for any
distributed-optimizer buffer. The other params (biases) keep the byte-level
distributed-optimizer layout in a second buffer.

The model: four ``nn.Linear`` (8 → 32 → 8 → 16 → 4, GELU between), dp = 2, overlapped grad
reduce and param gather, mc's ``ShardedOptimizer``. The layer-wise layout is Megatron's for
these shapes, derived by hand below from its rules (``integration_tests/test_megatron_optimizer.py``
checks that Megatron computes exactly this one, where megatron-core is installed). The
optimizer makes whole params matter: matrices step by ``w ← w − lr · g / ‖g‖_F`` (a
per-matrix normalisation, as Muon's orthogonalisation is per matrix), biases by plain SGD.
Each rank's masters are the whole matrices of its shard, so the normalisation sees the same
``‖g‖`` as one process.

Localizes: the 4-field ``BufferKey`` routing (two buffers of one dtype), DDP accepting a
layout whose params are not in backprop order inside a bucket (placed by cost, shards padded
to one size), the reduce-scatter / all-gather of its one 768-element bucket, and that every
rank owns whole matrices. A control run with mc's own byte-level layout for every param
(matrices cut across the two shards, each rank normalising a piece) must miss the reference
by far, so the parity depends on the layout.

Tolerances (fp32, 5 steps): loss per step within 1e-5 relative (measured 1.3e-7), final
weights within 1e-6 absolute (measured 3.0e-8), as the parity matrix; every reference tensor
moves by ≥ 100 × the weight tolerance; both ranks hold bit-identical weights. The control
(byte-level layout: ``2.weight`` cut across the shards) misses by 5.2e-2.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from integration_tests._compositions import LOSS_RTOL, MIN_MOVE, WEIGHT_ATOL, merge
from mc_buffers import BufferKey, FullParamLayout, PerBufferParamLayout
from mc_buffers.layout import compute_distributed_optimizer_param_layout
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ShardedOptimizer,
    ensure_params_ready,
)
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPools

SIZES = (8, 32, 8, 16, 4)
ROWS, STEPS, LR, RECORDED_STEP = 16, 5, 0.05, 2
FP32 = torch.float32
LAYER_WISE = BufferKey(FP32, FP32, False, True)
BYTE_LEVEL = BufferKey(FP32, FP32, False)


def model() -> torch.nn.Sequential:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(SIZES)):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.GELU()] if i < 3 else [])
    return torch.nn.Sequential(*layers)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``ROWS`` inputs and targets (each DP rank takes half the rows)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, SIZES[0], generator=g), torch.randn(ROWS, SIZES[-1], generator=g)


class NormalizedSGD(torch.optim.Optimizer):
    """``p ← p − lr · g / ‖g‖`` for groups with ``normalize=True`` (the whole tensor's norm:
    right only when this rank holds the whole param), plain SGD otherwise."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {"lr": LR, "normalize": False})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    step = p.grad / p.grad.norm() if group["normalize"] else p.grad
                    p.add_(step, alpha=-group["lr"])


def optimizer_over(params: list[torch.nn.Parameter]) -> NormalizedSGD:
    """Matrices normalised, biases plain (the param order of ``model()``)."""
    return NormalizedSGD(
        [
            {"params": [p for p in params if p.dim() == 2], "normalize": True},
            {"params": [p for p in params if p.dim() != 2]},
        ]
    )


def layer_wise_layout(net: torch.nn.Sequential) -> FullParamLayout:
    """Megatron main's layout at dp = 2 (``LayerWiseDistributedOptimizer``), by hand.

    Matrices w0 [32, 8] (256), w1 [8, 32] (256), w2 [16, 8] (128), w3 [4, 16] (64), one
    bucket (no bucket size). Placed by Newton-Schulz cost ``max(m, n) · min(m, n)²`` (2048,
    2048, 1024, 256), largest first, stable in backprop order w3, w2, w1, w0: w1, w0, w2, w3;
    each on the least-loaded shard (by cost) whose 64-aligned cursor stays within
    1.3 · 704 / 2 = 457.6 elements: w1 → 0; w0 → 1 (shard 0 would reach 512); w2 → 0 (loads
    tie at 2048); w3 → 1 (cost 2304 < 3072). Cursors 384 and 320; shards padded to
    ``pad(384, lcm(64, lcm(2, 128) / 2)) = 384``: the bucket is [0, 768), shard 1 starts at
    384, and the unpadded size is the matrices' sum, 704. Biases: the byte-level layout."""
    w0, b0, w1, b1, w2, b2, w3, b3 = net.parameters()
    matrices = PerBufferParamLayout(
        param_index_map={w1: (0, 256, 0), w2: (256, 384, 0), w0: (384, 640, 0), w3: (640, 704, 0)},
        bucket_indices=[(0, 768)],
        per_bucket_numel_unpadded=[704],
        param_indices=[0, 1, 2, 3],
        num_optimizer_shards=2,
    )
    biases = compute_distributed_optimizer_param_layout([b0, b1, b2, b3], None, 2)
    return FullParamLayout({LAYER_WISE: matrices, BYTE_LEVEL: biases})


def _train(layer_wise: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    pgc = mg.initialize_model_parallel()
    try:
        net = model()
        layout = None
        if layer_wise:  # what Megatron's tag_params_for_buffer_routing sets
            for p in net.parameters():
                p.is_managed_by_layer_wise_optimizer = p.dim() == 2  # type: ignore[attr-defined]
            layout = layer_wise_layout(net)
        cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        )
        ddp = DistributedDataParallel(
            mg.ModelParallelConfig(), cfg, net, pg_collection=pgc, full_param_layout=layout
        )
        opt = ShardedOptimizer(optimizer_over(list(ddp.parameters())), ddp)
        names = {p: n for n, p in net.named_parameters()}
        owned = [(names[s.param], s.start, s.end) for s in opt.owned_slices]
        x, target = data()
        half = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
        losses, records = [], []
        for step in range(STEPS):
            with mg.record_collectives() as log:
                ddp.zero_grad_buffer()
                loss = (ddp(x[half]) - target[half]).pow(2).mean()
                loss.backward()
                finalize_model_grads([ddp], pg_collection=pgc)
                opt.step()
            if step == RECORDED_STEP:
                records = [(r.op, r.group_ranks, r.numel) for r in log]
            mean = loss.detach().double().clone()
            mg.all_reduce(
                mean,
                pgc.require("dp", "the test's loss logging"),
                op=mg.ReduceOp.AVG,
                label="test: loss",
            )
            losses.append(float(mean))
        ensure_params_ready(list(net.parameters()))
        assert ddp.full_param_layout is not None
        return {
            "losses": losses,
            "weights": {n: p.detach().clone() for n, p in net.named_parameters()},
            "owned": owned,
            "records": records,
            "keys": [list(ddp.full_param_layout.layouts), [b.numel for b in ddp.buffers]],
        }
    finally:
        mg.destroy_model_parallel(pgc)


def _both() -> dict[str, Any]:
    with warnings.catch_warnings():
        # Each Linear has its weight in the layer-wise buffer and its bias in the other, so
        # a forward pre-hook finds the next bucket group's gather already dispatched and
        # warns, as Megatron's DDP does for such a model (expected here, not an error).
        warnings.filterwarnings("ignore", "the param all-gather of", RuntimeWarning)
        return {"layer_wise": _train(True), "byte_level": _train(False)}


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    net = model()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = optimizer_over(list(net.parameters()))
    x, target = data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (net(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}, initial


def test_layer_wise_layout_trains_like_one_process(rank_pools: RankPools) -> None:
    runs = rank_pools.get(2).run(_both)
    ref_losses, ref_weights, initial = _reference()
    for name, final in ref_weights.items():
        assert float((final - initial[name]).abs().max()) >= MIN_MOVE, name

    lw = [r["layer_wise"] for r in runs]
    assert lw[0]["losses"] == lw[1]["losses"]
    loss_rel = max(abs(a - b) / b for a, b in zip(lw[0]["losses"], ref_losses, strict=True))
    weights = merge([r["weights"] for r in lw], "layer-wise final weight")
    weight_abs = max(float((w - ref_weights[n]).abs().max()) for n, w in weights.items())
    print(f"layer-wise layout: loss rel {loss_rel:.3g}, weights abs {weight_abs:.3g}")
    assert loss_rel <= LOSS_RTOL
    assert weight_abs <= WEIGHT_ATOL

    # each rank steps the whole matrices of its shard (and its slices of the biases)
    whole = {0: [("2.weight", 256), ("4.weight", 128)], 1: [("0.weight", 256), ("6.weight", 64)]}
    for rank, run in enumerate(lw):
        mine = sorted((n, e - s) for n, s, e in run["owned"] if n.endswith("weight"))
        assert mine == whole[rank], (rank, run["owned"])
        assert all(s == 0 for n, s, _ in run["owned"] if n.endswith("weight"))
        # two buffers of one dtype: layer-wise matrices (768) and byte-level biases (256)
        assert run["keys"] == [[LAYER_WISE, BYTE_LEVEL], [768, 256]]
        # per step, one grad reduce-scatter per bucket (its full input) and one param
        # all-gather of each rank's half, over the 2-rank data-parallel group
        data_moves = [r for r in run["records"] if r[0] in ("reduce_scatter", "all_gather")]
        assert sorted(data_moves) == [
            ("all_gather", (0, 1), 128),
            ("all_gather", (0, 1), 384),
            ("reduce_scatter", (0, 1), 256),
            ("reduce_scatter", (0, 1), 768),
        ], run["records"]

    # control: the byte-level layout cuts matrices across shards; normalising a piece by its
    # own norm is not the whole matrix's update
    control = merge([r["byte_level"]["weights"] for r in runs], "byte-level final weight")
    miss = max(float((w - ref_weights[n]).abs().max()) for n, w in control.items())
    cut = [n for n, s, e in runs[0]["byte_level"]["owned"] if (s, e) != (0, weights[n].numel())]
    print(f"byte-level control: {cut} cut across shards, weights miss by {miss:.3g}")
    assert any(n.endswith("weight") for n in cut)
    assert miss >= 100 * WEIGHT_ATOL


def test_megatron_style_owner_lists_follow_the_layout() -> None:
    """What Megatron's ``LayerWiseDistributedOptimizer._shard_params_from_layout`` derives
    from a layout (shard of a param = its offset in the bucket // shard size) names the same
    owners as the hand derivation, and no matrix crosses a shard boundary."""
    net = model()
    names = {p: n for n, p in net.named_parameters()}
    layout = layer_wise_layout(net).layouts[LAYER_WISE]
    owners: dict[int, list[str]] = {0: [], 1: []}
    for param, (start, end, bucket) in layout.param_index_map.items():
        b_start, b_end = layout.bucket_indices[bucket]
        size = (b_end - b_start) // 2
        shard = (start - b_start) // size
        assert end <= b_start + (shard + 1) * size
        owners[shard].append(names[param])
    assert {k: sorted(v) for k, v in owners.items()} == {
        0: ["2.weight", "4.weight"],
        1: ["0.weight", "6.weight"],
    }
