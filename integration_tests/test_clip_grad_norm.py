"""Global grad-norm clipping (``ShardedOptimizer(max_grad_norm=...)``) against
``torch.nn.utils.clip_grad_norm_`` of the unsharded model on one process, then the same
SGD step, over the compositions where a per-rank norm goes wrong.

Models (``H = 8``, ``S = 8``, ``B = 2``, 4 units per global batch, see ``_compositions.py``):

- **dense block**: ``out = x + fc2(gelu(headnorm(fc1(ln(x)))))``; ``fc1`` Column ``H → 4
  heads × 4`` with a bias (TP-sharded), ``headnorm`` an RMS norm over each head's 4 channels
  whose weight ``g [4]`` is shared by all heads (Megatron-LM #7452 row 11: each TP rank
  holds its own heads' part of ``g``'s grad, so it is marked
  ``sum_gradients_across_tp_domain``), ``fc2`` Row with a bias (replicated, marked
  ``sequence_parallel`` under SP), ``ln`` a LayerNorm (replicated; marked under SP).
  Layouts: DP=2, DP=2 with the distributed optimizer, TP=2 (replicated norms and row bias
  counted once), TP=2 with SP, TP=2 with the inf norm, TP=2 × DP=2 with the distributed
  optimizer, TP=2 × DP=2 with the inf norm.
- **tied embedding over 2 pipeline stages**: stage 0 ``h = tanh(fc(E[tokens]))``, stage 1
  ``logits = ln(h) · Eᵀ`` with its own copy of ``E``; both copies marked
  ``shared_embedding`` (mc's marking), ``finalize_model_grads`` sums their grads over
  ``embd``; a hand-written 1F1B of one micro-batch moves the activation and its grad with
  ``mg.send`` / ``mg.recv``. L2 and inf norms.
- **experts** (``test_parity_experts.MoEModel``): EP=2 × TP=2 with ETP=1 (≠ TP) under SP,
  and EP=2 × gtp_remat=2.
- **a ``parallelize``d transformers model** (``examples.hf_llama.build_model``): Llama with
  tied embeddings and Qwen3 (per-head q/k norms, ``replicated_with_grad_allreduce``), TP=2 ×
  DP=2 with ``sequence_parallel_plan``, the distributed optimizer; 2 clipped SGD steps
  (norms, then the gathered ``full_state_dict`` against the 1-process model's weights).

Each layout's clip value sits below the reference's norm at every step (checked), so a
norm counted twice or missing a piece scales the update and moves the weights. Bounds: the
norm per step within 1e-5 relative, losses 1e-5 relative, final weights 1e-6 absolute after
5 clipped SGD steps (``_compositions``), every copy of a weight on every rank identical.
Measured (``pytest -s`` prints them): norms within 1.1e-7 relative, losses 1.0e-7, weights
6e-8 absolute (``docs/optimizer.md`` has the table).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
from examples import hf_llama as hf
from integration_tests import test_parity_experts as experts
from integration_tests._compositions import (
    LR,
    MOMENTUM,
    STEPS,
    UNITS,
    Layout,
    RankRun,
    Reference,
    collection,
    compare,
    ddp_config,
    full_state,
    load_weights,
    normalised,
    reference_loss,
    reference_run,
    token_loss,
    tp_mlp,
    train,
)
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ShardedOptimizer,
    ensure_params_ready,
)
from mc_finalize import finalize_model_grads
from mc_groups import param_attrs
from mc_groups.pipeline_stages import pipeline_rank
from mc_groups.testing import RankPools
from mc_tp_layers import (
    full_state_dict,
    parallelize,
    sequence_parallel_plan,
)
from mc_tp_layers.mappings import gather_from_sequence_parallel_region

H, HEADS, D = 8, 4, 4
S, B = 8, 2
EPS = 1e-6


# -------------------------------------------------------------------------- dense block


def _rms(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS) * g


class Block(torch.nn.Module):
    """The dense block of the module docstring (this rank's heads)."""

    def __init__(
        self, config: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection, mark: str
    ) -> None:
        super().__init__()
        self.tp = pgc.require("tp", "Block")
        self.ln = torch.nn.LayerNorm(H)
        self.fc1, self.fc2 = tp_mlp(config, pgc, H, HEADS * D)
        self.head_norm = torch.nn.Parameter(torch.ones(D))
        for param in self.ln.parameters():
            param_attrs.mark_sequence_parallel(param, config.sequence_parallel)
        if mark == "sum":
            param_attrs.mark_sum_gradients_across_tp_domain(self.head_norm)
        elif mark == "sequence_parallel":
            param_attrs.mark_sequence_parallel(self.head_norm, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(self.ln(x))
        heads = hidden.view(*hidden.shape[:-1], -1, D)
        y, _ = self.fc2(F.gelu(_rms(heads, self.head_norm).flatten(-2)))
        out: torch.Tensor = x + y
        return out


@cache
def dense_initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(32)
    return {
        "ln.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "ln.bias": 0.1 * torch.randn(H, generator=g),
        "fc1.weight": 0.4 * torch.randn(HEADS * D, H, generator=g),
        "fc1.bias": 0.1 * torch.randn(HEADS * D, generator=g),
        "head_norm": 1 + 0.2 * torch.randn(D, generator=g),
        "fc2.weight": 0.3 * torch.randn(H, HEADS * D, generator=g),
        "fc2.bias": 0.1 * torch.randn(H, generator=g),
    }


@cache
def dense_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(UNITS, S, B, H, generator=g), torch.randn(UNITS, S, B, H, generator=g)


def dense_forward(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The block on one process: ``x`` ``[S, B, H]``."""
    a = F.layer_norm(x, (H,), w["ln.weight"], w["ln.bias"])
    heads = F.linear(a, w["fc1.weight"], w["fc1.bias"]).view(S, B, HEADS, D)
    y = F.linear(F.gelu(_rms(heads, w["head_norm"]).flatten(-2)), w["fc2.weight"], w["fc2.bias"])
    return x + y


def dense_loss_of(w: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    x, target = dense_batch(step)
    per_token = torch.stack([token_loss(dense_forward(w, x[u]), target[u]) for u in range(UNITS)])
    return reference_loss(per_token, torch.ones_like(per_token), per_token_loss=False)


def _dense_model(
    layout: Layout, pgc: mg.ProcessGroupCollection, sp: bool, mark: str
) -> tuple[Block, DistributedDataParallel[Any]]:
    config = layout.config(sequence_parallel=sp)
    module = Block(config, pgc, mark)
    load_weights(module, dense_initial())
    return module, DistributedDataParallel(config, ddp_config(layout), module, pg_collection=pgc)


def _dense_micro_loss(
    module: Block, ddp: DistributedDataParallel[Any], layout: Layout, sp: bool, shard: int
) -> Callable[[int, int, int], tuple[torch.Tensor, int]]:
    tp_rank, rows = mg.group_rank(module.tp), S // layout.tp
    first = tp_rank * rows if sp else 0  # SP: this rank's sequence slice; else all of it

    def micro_loss(step: int, m: int, count: int) -> tuple[torch.Tensor, int]:
        x, target = dense_batch(step)
        unit = shard * count + m
        out = ddp(x[unit, first : first + rows] if sp else x[unit])
        if sp:
            out = gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=module.tp
            )
        per_token = token_loss(out, target[unit])
        return normalised(per_token, torch.ones_like(per_token), count, layout)

    return micro_loss


def train_dense(layout: Layout, sp: bool) -> RankRun:
    """Runs on every rank: the dense block, DDP, 5 clipped SGD steps."""
    with collection(layout) as pgc:
        module, ddp = _dense_model(layout, pgc, sp, mark="sum")
        data = pgc.require("dp_cp_gtp_remat", "test")
        micro = _dense_micro_loss(module, ddp, layout, sp, mg.group_rank(data))
        return train(ddp, pgc, layout, micro, UNITS // mg.group_size(data))


def head_norm_grads(mark: str) -> dict[str, torch.Tensor] | str:
    """TP=2 without SP, step 0: the head norm's grad after finalize on this rank, or
    finalize's error."""
    layout = Layout(2, tp=2)
    with collection(layout) as pgc:
        module, ddp = _dense_model(layout, pgc, sp=False, mark=mark)
        micro = _dense_micro_loss(module, ddp, layout, False, 0)
        ddp.zero_grad_buffer()
        for m in range(UNITS):
            with ddp.no_sync() if m < UNITS - 1 else nullcontext():
                micro(0, m, UNITS)[0].backward()  # type: ignore[no-untyped-call]
        try:
            finalize_model_grads([ddp], pg_collection=pgc)
        except ValueError as err:
            return str(err)
        return full_state(module, str, grads=True)


@cache
def dense_reference(clip: float, norm_type: float) -> Reference:
    return reference_run(dict(dense_initial()), dense_loss_of, clip, norm_type)


DENSE = [
    (Layout(2, clip=0.5), False),
    (Layout(2, dist_opt=True, clip=0.5), False),
    (Layout(2, tp=2, clip=0.5), False),
    (Layout(2, tp=2, clip=0.5), True),
    (Layout(2, tp=2, clip=0.1, norm_type=float("inf")), False),
    (Layout(4, tp=2, dist_opt=True, clip=0.5), True),
    (Layout(4, tp=2, clip=0.1, norm_type=float("inf")), False),
]


@pytest.mark.parametrize(
    ("layout", "sp"),
    [
        pytest.param(lay, sp, id=lay.describe().replace(" ", "-") + ("-sp" if sp else ""))
        for lay, sp in DENSE
    ],
)
def test_dense_block_clips_like_one_process(
    rank_pools: RankPools, layout: Layout, sp: bool
) -> None:
    per_rank = rank_pools.get(layout.world).run(train_dense, layout, sp)
    assert layout.clip is not None
    compare(layout, per_rank, dense_reference(layout.clip, layout.norm_type))


def test_head_norm_partial_sum_needs_its_mark(rank_pools: RankPools) -> None:
    """#7452 row 11 at TP=2 without SP: marked ``sum_gradients_across_tp_domain`` both TP
    copies hold the 1-process grad; marked ``sequence_parallel`` (summed only under SP,
    Megatron's meaning: the two copies would keep their own heads' halves, 0.31 relative off
    on rank 0) it is an error at the first finalize on every rank, naming the param and the
    mark that fits (issue 41)."""
    params = {k: v.clone().requires_grad_(True) for k, v in dense_initial().items()}
    dense_loss_of(params, 0).backward()  # type: ignore[no-untyped-call]
    want = params["head_norm"].grad
    assert want is not None
    pool = rank_pools.get(2)
    results = pool.run(head_norm_grads, "sum")
    grads = [r["head_norm"] for r in results if not isinstance(r, str)]
    assert len(grads) == 2
    assert torch.equal(grads[0], grads[1])
    assert float((grads[0] - want).abs().max() / want.abs().max()) < 1e-5
    for error in pool.run(head_norm_grads, "sequence_parallel"):
        assert isinstance(error, str), error
        assert "param 'module.head_norm' is marked sequence_parallel=True" in error, error
        assert "mark_sum_gradients_across_tp_domain(param)" in error


# ----------------------------------------------------------------- tied embedding, PP=2

V = 16
PP_UNITS = 2


@cache
def pp_initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(33)
    return {
        "E": 0.5 * torch.randn(V, H, generator=g),
        "fc.weight": 0.4 * torch.randn(H, H, generator=g),
        "fc.bias": 0.1 * torch.randn(H, generator=g),
        "ln.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "ln.bias": 0.1 * torch.randn(H, generator=g),
    }


@cache
def pp_batch(step: int) -> torch.Tensor:
    """``[PP_UNITS, B, S + 1]`` token ids."""
    return torch.randint(0, V, (PP_UNITS, B, S + 1), generator=torch.Generator().manual_seed(step))


def _pp_stage0(w: dict[str, torch.Tensor], tokens: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    return torch.tanh(F.linear(F.embedding(tokens, emb), w["fc.weight"], w["fc.bias"]))


def _pp_stage1(
    w: dict[str, torch.Tensor], h: torch.Tensor, out: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(F.layer_norm(h, (H,), w["ln.weight"], w["ln.bias"]), out)
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def pp_loss_of(w: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    tokens = pp_batch(step)
    losses = [_pp_stage1(w, _pp_stage0(w, t[:, :-1], w["E"]), w["E"], t[:, 1:]) for t in tokens]
    return torch.stack(losses).mean()


class _Stage(torch.nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        full = pp_initial()
        self.E = torch.nn.Parameter(full["E"].clone())
        self.E.shared_embedding = True  # type: ignore[attr-defined]  # both copies, as mc
        names = ("fc.weight", "fc.bias") if stage == 0 else ("ln.weight", "ln.bias")
        self.w = torch.nn.ParameterDict({n.replace(".", "_"): full[n].clone() for n in names})

    def weights(self) -> dict[str, torch.Tensor]:
        return {n.replace("_", "."): p for n, p in self.w.items()}


def train_pipeline(norm_type: float, clip: float) -> RankRun:
    """Runs on both ranks (PP=2): one micro-batch unit at a time, forward on stage 0, send,
    forward and backward on stage 1, the activation grad back, backward on stage 0."""
    pgc = mg.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        stage, pp = pipeline_rank(pgc), pgc.require("pp", "test")
        config = mg.ModelParallelConfig(pipeline_model_parallel_size=2)
        module = _Stage(stage)
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(), module, pg_collection=pgc
        )
        opt = ShardedOptimizer(
            torch.optim.SGD(list(ddp.parameters()), lr=LR, momentum=MOMENTUM, foreach=False),
            ddp,
            max_grad_norm=clip,
            norm_type=norm_type,
            pg_collection=pgc,
        )
        losses, norms, grads = [], [], {}
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            total = torch.zeros(())
            for u, tokens in enumerate(pp_batch(step)):
                with ddp.no_sync() if u < PP_UNITS - 1 else nullcontext():
                    h = torch.empty(B, S, H)
                    if stage == 0:
                        h = _pp_stage0(module.weights(), tokens[:, :-1], module.E)
                        mg.send(h.detach(), pp, group_dst=1, label="test: activation")
                        grad = torch.empty_like(h)
                        mg.recv(grad, pp, group_src=1, label="test: activation grad")
                        h.backward(grad)  # type: ignore[no-untyped-call]
                    else:
                        mg.recv(h, pp, group_src=0, label="test: activation")
                        h.requires_grad_(True)
                        loss = _pp_stage1(module.weights(), h, module.E, tokens[:, 1:])
                        (loss / PP_UNITS).backward()  # type: ignore[no-untyped-call]
                        assert h.grad is not None
                        mg.send(h.grad, pp, group_dst=0, label="test: activation grad")
                        total += loss.detach() / PP_UNITS
            finalize_model_grads([ddp], pg_collection=pgc)
            if step == 0:
                named = {**module.weights(), "E": module.E}
                grads = {n: p.main_grad.clone() for n, p in named.items()}  # type: ignore[attr-defined]
            result = opt.step()
            norms.append(result.grad_norm)
            mg.broadcast(total, pp, group_src=1, label="test: loss")
            losses.append(float(total))
        weights = {n: p.detach().clone() for n, p in module.weights().items()}
        weights["E"] = module.E.detach().clone()
        return RankRun(losses, weights, grads, [], {}, {}, norms=norms)
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_tied_embedding_over_two_stages_counts_once(
    rank_pools: RankPools, norm_type: float
) -> None:
    clip = 0.5 if norm_type == 2.0 else 0.05
    layout = Layout(2, clip=clip, norm_type=norm_type)
    ref = reference_run(dict(pp_initial()), pp_loss_of, clip, norm_type)
    per_rank = rank_pools.get(2).run(train_pipeline, norm_type, clip)
    compare(layout, per_rank, ref)


# ------------------------------------------------------------------------------ experts

EXPERT_LAYOUTS = [
    Layout(4, tp=2, etp=1, ep=2, clip=0.3),
    Layout(4, ep=2, gtp=2, egtp=2, clip=0.3),
]


@cache
def experts_reference(clip: float, norm_type: float) -> Reference:
    return reference_run(dict(experts.initial()), experts.reference_loss_of, clip, norm_type)


@pytest.mark.parametrize(
    "layout", [pytest.param(x, id=x.describe().replace(" ", "-")) for x in EXPERT_LAYOUTS]
)
def test_experts_clip_like_one_process(rank_pools: RankPools, layout: Layout) -> None:
    per_rank = rank_pools.get(layout.world).run(experts.train_experts, layout)
    assert layout.clip is not None
    compare(layout, per_rank, experts_reference(layout.clip, layout.norm_type))


# --------------------------------------------------------------- parallelize'd transformers

HF_CLIP, HF_STEPS = 0.5, 2


def train_hf(kind: str, tie: bool) -> dict[str, Any]:
    """TP=2 × DP=2: the tiny HF model through ``parallelize`` with SP, mc DDP (distributed
    optimizer), 2 clipped SGD steps; the norms and the gathered weights."""
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
        model = hf.build_model(kind, tie=tie)
        plan = sequence_parallel_plan(model, dict(model.tp_plan))
        parallelize(model, plan, config=cfg, pg_collection=pgc)
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=2048)
        ddp = DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
        sgd = torch.optim.SGD(ddp.parameters(), lr=hf.LR)
        opt = ShardedOptimizer(sgd, ddp, max_grad_norm=HF_CLIP, pg_collection=pgc)
        dp = pgc.require("dp", "test")
        rows = hf.BATCH // mg.group_size(dp)
        norms = []
        for step in range(HF_STEPS):
            ids = hf.global_batch(step)[mg.group_rank(dp) * rows :][:rows]
            ddp.zero_grad_buffer()
            ddp(input_ids=ids, labels=ids).loss.backward()
            finalize_model_grads([ddp], pg_collection=pgc)
            norms.append(opt.step().grad_norm)
        ensure_params_ready(list(ddp.parameters()))
        return {"norms": norms, "weights": full_state_dict(model)}
    finally:
        mg.destroy_model_parallel(pgc)


def hf_reference(kind: str, tie: bool) -> dict[str, Any]:
    model = hf.build_model(kind, tie=tie)
    opt = torch.optim.SGD(model.parameters(), lr=hf.LR)
    norms = []
    for step in range(HF_STEPS):
        ids = hf.global_batch(step)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), HF_CLIP)))
        opt.step()
    return {"norms": norms, "weights": {k: v.detach() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize(("kind", "tie"), [("llama", True), ("qwen3", False)])
def test_parallelized_transformers_model_clips_like_one_process(
    rank_pools: RankPools, kind: str, tie: bool
) -> None:
    ref = hf_reference(kind, tie)
    runs = rank_pools.get(4).run(train_hf, kind, tie)
    assert all(n > HF_CLIP for n in ref["norms"]), ref["norms"]
    for run in runs:
        assert run["norms"] == runs[0]["norms"]
    norm_rel = max(abs(a - b) / b for a, b in zip(runs[0]["norms"], ref["norms"], strict=True))
    weights = runs[0]["weights"]
    assert sorted(weights) == sorted(ref["weights"])
    weight_abs = max(float((weights[k] - v).abs().max()) for k, v in ref["weights"].items())
    print(f"[hf {kind} tie={tie}] norm {norm_rel:.3g} relative, weights {weight_abs:.3g}")
    assert norm_rel <= 1e-5
    assert weight_abs <= 1e-6
