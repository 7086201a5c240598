"""``sequence_parallel_plan`` on ``transformers`` models, against one process.

Tiny Qwen2, Qwen3, Mistral, Phi-3, OLMo-2, Gemma and Gemma-3 causal LMs (``examples/hf_llama.py``'s
``build_model``; Llama's run is in test_parallelize_hf.py) converted by
``parallelize(model, sequence_parallel_plan(model), ...)`` and trained by the example's
``train`` at TP=2 × DP=2 with sequence parallelism, mc DDP (distributed optimizer,
overlapped reduce and param gather), ``finalize_model_grads`` and SGD for 3 steps, in one
spawned world of 4 ranks for all models (the pool test_parallelize_hf.py also uses).
Localizes what each architecture adds:

- Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` kept as its ``tp_plan`` gathers them
  (``colwise_gather_output``), and ``rowwise_split_input`` under sequence parallelism; and
  with its MLP split instead (``packed_colwise`` gate_up, ``rowwise`` down);
- OLMo-2: norms after attention and MLP (no input norm), and ``q_norm`` / ``k_norm`` over
  all heads as ``colwise_rmsnorm`` (sum of squares all-reduced over TP);
- Gemma: ``(1 + weight)`` norms, the scaled word embedding, tied embeddings;
- Qwen3 and Gemma-3: per-head ``q_norm`` / ``k_norm`` as their ``tp_plan`` says
  (``replicated_with_grad_allreduce``: each rank's grad covers its heads, summed over TP by
  ``finalize_model_grads``, so no collective of theirs in forward or backward);
- Qwen2's q/k/v biases, Mistral as Llama.

A bare ``LlamaModel`` (no head) trained at TP=2 × DP=2 with SP through public API only:
its plan gathers the hidden states after the final norm, so it returns them whole.

Then the collectives of one forward and one backward per model at TP=2 (op, group, bytes,
counted from the plan by hand below), the plans themselves, Qwen3 with its norm entries
dropped from the plan, which the helper refuses by name, and the plans ``parallelize``
refuses before changing anything (a ``(1 + weight)`` norm or one without ``eps`` as
``colwise_rmsnorm``, ``nn.Linear`` / ``nn.Embedding`` subclasses whose ``forward`` adds a
step, ``rowwise_split_input`` under SP outside a ``sequence_gather`` block).

Tolerances (fp32, gloo): loss per step ≤ 1e-5 relative, final weights ≤ 1e-6 absolute,
every reference tensor moving ≥ 1e-4 (checked). The learning rate is per model: OLMo-2's
norms of small branch outputs amplify fp32 rounding at lr=1 (its own ``tp_plan`` without
sequence parallelism differs by 2e-5 there, a sum-order effect: 1.6e-7 in fp64 weights),
so it trains at 0.4; Gemma's q/k move < 1e-4 at lr=1, so it trains at 2. Measured here:
loss ≤ 1.2e-7 relative, weights ≤ 3.2e-7.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from examples.hf_llama import BATCH, SEQ, Run, build_model, global_batch, reference
from mc_groups.testing import RankPools

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

STEPS = 3
# Phi-3's MLP split (the lighter plan docs/parallelize.md shows): gate_up is chunked in two
PACKED_MLP = {
    "model.layers.*.mlp.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
# (kind, tied embeddings, learning rate, entries replacing the model's tp_plan ones)
Case = tuple[str, bool, float, dict[str, str]]
CASES: list[Case] = [
    ("qwen2", False, 1.0, {}),
    ("qwen3", False, 1.0, {}),
    ("mistral", False, 1.0, {}),
    ("phi3", False, 1.0, {}),
    ("phi3", False, 1.0, PACKED_MLP),
    ("olmo2", False, 0.4, {}),
    ("gemma", True, 2.0, {}),
    ("gemma3", False, 1.0, {}),
]


def _case(case: Case) -> tuple[Run, dict[str, Any]] | None:
    """One model trained, then its collectives recorded (one call per model: each gets the
    pool's deadline)."""
    import torch.distributed as dist

    from examples.hf_llama import train

    torch.set_num_threads(1)
    kind, tie, lr, overrides = case
    run = train(2, kind=kind, steps=STEPS, tie=tie, lr=lr, overrides=overrides)
    schedule = _schedule(kind, tie, overrides)
    return (run, schedule) if dist.get_rank() == 0 else None


class _OnePlusNorm(torch.nn.Module):
    """Gemma's RMS norm: x / rms(x) × (1 + weight)."""

    def __init__(self, width: int, eps: float | None = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width))
        if eps is not None:
            self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (1.0 + self.weight)


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class _OffsetEmbedding(torch.nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 1.0


REFUSALS = [
    ("ValueError", ["norm", "does not compute weight · x / sqrt(mean(x²)", "colwise_gather"]),
    ("TypeError", ["norm", "epsilon", "variance_epsilon", "keep the module replicated"]),
    ("TypeError", ["0 (plan['0']", "_ScaledLinear overrides nn.Linear.forward"]),
    ("TypeError", ["_OffsetEmbedding overrides nn.Embedding.forward", "scaled lookup"]),
    ("ValueError", ["1 (plan['1']", "rowwise_split_input", "whole sequence", "sequence_gather"]),
]


def _refusals() -> list[tuple[str, str, bool]]:
    """Plans parallelize refuses before changing anything: each error and whether every
    module kept its class."""
    import mc_groups as mg
    from mc_groups.testing import error_kind
    from mc_tp_layers import parallelize

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    tp = mg.ModelParallelConfig(tensor_model_parallel_size=2)
    sp = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    seq = torch.nn.Sequential
    cases: list[tuple[torch.nn.Module, dict[str, str], Any]] = [
        (seq(torch.nn.Linear(8, 8), _OnePlusNorm(8)), {"0": "colwise", "1": "colwise_rmsnorm"}, tp),
        (seq(torch.nn.Linear(8, 8), _OnePlusNorm(8, None)), {"1": "colwise_rmsnorm"}, tp),
        (seq(_ScaledLinear(8, 8)), {"0": "colwise"}, tp),
        (seq(_OffsetEmbedding(8, 4)), {"0": "embedding_rowwise"}, tp),
        (seq(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), {"1": "rowwise_split_input"}, sp),
    ]
    out = []
    for model, plan, config in cases:
        before = [type(m) for m in model.modules()]
        try:
            parallelize(model, plan, config=config, pg_collection=pgc)
            kind, message = "", "no error"
        except (ValueError, TypeError) as err:
            kind, message = error_kind(err), str(err)
        out.append((kind, message, [type(m) for m in model.modules()] == before))
    mg.destroy_model_parallel(pgc)
    return out


def _schedule(kind: str, tie: bool, overrides: dict[str, str]) -> dict[str, Any]:
    """One forward and one backward at TP=2 (no DDP), every collective recorded."""
    import mc_groups as mg
    from mc_tp_layers import parallelize, sequence_parallel_plan

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model = build_model(kind, tie=tie)
    plan = sequence_parallel_plan(model, {**model.tp_plan, **overrides})
    parallelize(model, plan, config=cfg, pg_collection=pgc)
    ids = global_batch(0)
    model(input_ids=ids, labels=ids).loss.backward()  # a warm-up step
    with mg.record_collectives() as log:
        loss = model(input_ids=ids, labels=ids).loss
        forward = Counter((r.op, r.bytes) for r in log)
        loss.backward()
    backward = Counter((r.op, r.bytes) for r in log) - forward
    tp = mg.group_ranks(pgc.require("tp", "test"))
    groups = {r.group_ranks for r in log}
    mg.destroy_model_parallel(pgc)
    return {"forward": forward, "backward": backward, "groups": groups, "tp": tp}


def _expected(kind: str, packed: bool) -> tuple[Counter[tuple[str, int]], Counter[tuple[str, int]]]:
    """The collectives the plan implies (W=2, fp32 bytes; an all-gather counts the shard
    it sends, a reduce-scatter its whole input), derived by hand:

    forward: the embedding's all-reduce of [b, s, h]; per layer and block (attention, MLP)
    the entry's all-gather of [b, s/W, h] and the rowwise output's reduce-scatter of
    [b, s, h]; the LM head's entry all-gather and its output all-gather [b, s, V/W].
    backward: each all-gather's reduce-scatter and each reduce-scatter's all-gather, plus
    the all-gather of the scatter at layer 0's input grad; none for the embedding.
    """
    layers, heads, kv_heads, head_dim, hidden, inter, vocab, w = 2, 4, 2, 8, 32, 64, 64, 2
    act, part = BATCH * SEQ * hidden * 4, BATCH * SEQ * hidden * 4 // w
    forward = Counter(
        {
            ("all_reduce", act): 1,
            ("all_gather", part): 2 * layers + 1,
            ("reduce_scatter", act): 2 * layers,
        }
    )
    forward[("all_gather", BATCH * SEQ * vocab // w * 4)] += 1
    backward = Counter(
        {("all_gather", part): 2 * layers + 1, ("reduce_scatter", act): 2 * layers + 1}
    )
    if kind == "olmo2":  # q_norm, k_norm: Σx² of [b, s, 1] all-reduced forward and backward
        forward[("all_reduce", BATCH * SEQ * 4)] += 2 * layers
        backward[("all_reduce", BATCH * SEQ * 4)] += 2 * layers
    # qwen3, gemma3: per-head q_norm, k_norm grads are summed by finalize, not in backward
    if kind == "phi3":  # gathered qkv (/ gate_up) outputs; split o_proj (/ down_proj) inputs
        forward[("all_gather", BATCH * SEQ * (heads + 2 * kv_heads) * head_dim // w * 4)] += layers
        backward[("all_gather", BATCH * SEQ * heads * head_dim // w * 4)] += layers
        if not packed:
            forward[("all_gather", BATCH * SEQ * 2 * inter // w * 4)] += layers
            backward[("all_gather", BATCH * SEQ * inter // w * 4)] += layers
    return forward, backward


def _check(run: Run, kind: str, tie: bool, lr: float) -> str:
    ref = reference(kind, STEPS, tie=tie, lr=lr)
    start = build_model(kind, tie=tie).state_dict()
    moved = min(float((ref.weights[k] - start[k]).abs().max()) for k in ref.weights)
    assert moved >= 1e-4, f"{kind}: a reference tensor moves only {moved:.1e}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert rel <= 1e-5, (kind, run.losses, ref.losses)
    assert sorted(run.weights) == sorted(ref.weights)
    worst = max(float((run.weights[k] - v).abs().max()) for k, v in ref.weights.items())
    assert worst <= 1e-6, (kind, worst)
    return f"{kind}: loss rel {rel:.1e}, weights {worst:.1e}, smallest move {moved:.1e}"


BARE_LR = 0.1  # the loss is linear in normed states: at lr=1 the embedding grows to |w| 14
# and fp32 rounding in its update reaches 6e-6 (4e-7 relative); at 0.1 every weight stays
# within 7e-7 of one process's


def _bare_loss(hidden: torch.Tensor, rows: slice) -> torch.Tensor:
    """A loss on the hidden states ``[rows, SEQ, 32]`` a bare ``LlamaModel`` returns: their
    mean dot product with fixed random directions (every token and feature gets a grad)."""
    direction = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(7))
    return (hidden * direction[rows]).sum(-1).mean()


def _bare_reference(steps: int, lr: float) -> Run:
    model = build_model("llama").model  # the bare LlamaModel: no LM head
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = _bare_loss(model(input_ids=global_batch(step)).last_hidden_state, slice(None))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def _bare(steps: int, lr: float) -> tuple[Run, tuple[int, int], bool, dict[str, Any]] | None:
    """A bare ``LlamaModel`` at TP=2 × DP=2 with SP through public API only: the plan
    gathers the hidden states after the final norm; mc DDP, finalize, SGD."""
    import mc_groups as mg
    from mc_ddp import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        ShardedOptimizer,
        ensure_params_ready,
    )
    from mc_finalize import finalize_model_grads
    from mc_tp_layers import full_state_dict, parallelize, sequence_parallel_plan

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model = build_model("llama").model
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=lr), ddp)
    dp = pgc.require("dp", "data")
    per = BATCH // dp.size()
    rows = slice(dp.rank() * per, (dp.rank() + 1) * per)
    tp = mg.group_ranks(pgc.require("tp", "test"))
    losses, shape, schedule = [], (0, 0), {}
    for step in range(steps):
        ddp.zero_grad_buffer()
        ids = global_batch(step)[rows]
        with mg.record_collectives() as log:  # every step: the same collectives
            hidden = ddp(input_ids=ids).last_hidden_state
            forward = Counter((r.op, r.bytes) for r in log if r.group_ranks == tp)
            shape = (hidden.shape[0], hidden.shape[1])
            loss = _bare_loss(hidden, rows)
            loss.backward()  # type: ignore[no-untyped-call]
        if step == 1:
            on_tp = Counter((r.op, r.bytes) for r in log if r.group_ranks == tp)
            schedule = {"forward": forward, "backward": on_tp - forward}
        finalize_model_grads([ddp], pg_collection=pgc)
        opt.step()
        mean = loss.detach().clone()
        mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
        losses.append(float(mean))
    ensure_params_ready(ddp.parameters())
    weights = full_state_dict(model)
    tagged = all(
        mg.param_attrs.is_sequence_parallel_param(p)
        for n, p in model.named_parameters()
        if "norm" in n
    )
    mg.destroy_model_parallel(pgc)
    result = (Run(losses, weights), shape, tagged, schedule)
    return result if torch.distributed.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_bare_llama_model_returns_whole_hidden_states(rank_pools: RankPools) -> None:
    """``transformers``' ``LlamaModel`` without a head: ``sequence_parallel_plan`` gathers
    its hidden states after the final norm, so at TP=2 × DP=2 with SP it returns
    ``[rows, SEQ, h]`` (not ``SEQ / 2``) and trains equal to one process (loss per step
    ≤ 1e-5 relative, final weights ≤ 2e-6); its TP collectives of one step counted."""
    result = rank_pools.get(4).run(_bare, STEPS, BARE_LR)[0]
    assert result is not None
    run, shape, tagged, schedule = result
    assert shape == (BATCH // 2, SEQ)
    assert tagged  # every norm's grad is summed over TP by finalize
    # on the TP group, one step (W=2, fp32 bytes; an all-gather counts the shard it sends,
    # a reduce-scatter its whole input), by hand: the causal LM's schedule (_expected)
    # without its head, plus the final norm's gather, which has no backward collective
    layers, hidden, w = 2, 32, 2
    act = BATCH // 2 * SEQ * hidden * 4  # this DP rank's rows
    part = act // w
    assert schedule["forward"] == Counter(
        {
            ("all_reduce", act): 1,
            ("all_gather", part): 2 * layers + 1,
            ("reduce_scatter", act): 2 * layers,
        }
    ), schedule["forward"]
    assert schedule["backward"] == Counter(
        {("all_gather", part): 2 * layers + 1, ("reduce_scatter", act): 2 * layers}
    ), schedule["backward"]
    ref = _bare_reference(STEPS, BARE_LR)
    start = build_model("llama").model.state_dict()
    moved = min(float((ref.weights[k] - start[k]).abs().max()) for k in ref.weights)
    assert moved >= 1e-4, moved
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert rel <= 1e-5, (run.losses, ref.losses)
    assert sorted(run.weights) == sorted(ref.weights)
    worst = max(float((run.weights[k] - v).abs().max()) for k, v in ref.weights.items())
    assert worst <= 2e-6, worst  # measured 6.9e-7 (the embedding, |w| up to 1.0)


@pytest.mark.timeout(300)
def test_sp_plan_matches_one_process(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    for case in CASES:
        result = pool.run(_case, case)[0]
        assert result is not None
        run, schedule = result
        kind, tie, lr, overrides = case
        print(_check(run, kind, tie, lr))
        forward, backward = _expected(kind, bool(overrides))
        assert schedule["forward"] == forward, (kind, schedule["forward"])
        assert schedule["backward"] == backward, (kind, schedule["backward"])
        assert schedule["groups"] == {schedule["tp"]}, kind
    refusals = pool.run(_refusals)[0]
    for (kind, message, untouched), (want, words) in zip(refusals, REFUSALS, strict=True):
        assert kind == want, message
        for word in words:
            assert word in message, (word, message)
        assert untouched, message


def test_plans_per_architecture() -> None:
    from mc_tp_layers import sequence_parallel_plan
    from mc_tp_layers.tp_plan import SequenceGather

    llama = build_model("llama")
    norms = ("input_layernorm", "post_attention_layernorm")
    assert sequence_parallel_plan(llama) == {  # the recipe examples/hf_llama.py used to carry
        **llama.tp_plan,
        "model.layers.0": "sequence_scatter",
        "model.layers.*.self_attn": "sequence_gather",
        "model.layers.*.mlp": SequenceGather(kwarg="x"),
        **{f"model.layers.*.{n}": "sequence_parallel" for n in norms},
        "model.norm": "sequence_parallel",
        "lm_head": ("sequence_gather", "colwise_gather_output"),
    }
    phi3 = sequence_parallel_plan(build_model("phi3"))
    assert phi3["model.layers.*.self_attn.qkv_proj"] == "colwise_gather_output"
    assert phi3["model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    olmo2 = sequence_parallel_plan(build_model("olmo2"))
    assert olmo2["model.layers.*.self_attn.q_proj"] == "colwise"
    assert olmo2["model.layers.*.self_attn.k_norm"] == "colwise_rmsnorm"
    assert olmo2["model.layers.*.post_feedforward_layernorm"] == "sequence_parallel"
    assert "model.layers.*.input_layernorm" not in olmo2


def test_per_head_norms_outside_the_plan_are_refused() -> None:
    from mc_tp_layers import sequence_parallel_plan

    model = build_model("qwen3")
    plan = sequence_parallel_plan(model)
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    base = {k: v for k, v in model.tp_plan.items() if v != "replicated_with_grad_allreduce"}
    with pytest.raises(ValueError, match=r"q_norm.*keeps its heads split"):
        sequence_parallel_plan(model, base)
