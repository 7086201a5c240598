"""``torch.compile(fullgraph=True)`` over a ``parallelize``d ``transformers`` Llama, and mc
DDP over a model whose blocks are compiled; 2 gloo ranks, one world.

**Llama** (``examples.hf_llama.build_model``, TP = 2, sequence parallelism off with the
model's own ``tp_plan``, on with ``sequence_parallel_plan``), compiled two ways: a decoder
layer ``torch.compile(layer, fullgraph=True)`` (torchtitan's way; layer 1, the others run
eagerly) and the whole model. Against the same model run eagerly (same weights, same
batch), one step (``model(ids, labels=ids).loss.backward()``):

- 0 graph breaks (``fullgraph=True``, and Dynamo's break counter) and one graph (the
  decoder layer; the whole model), built once for both steps (Dynamo's graph counter);
- the loss and every parameter's gradient equal eager's within 1e-5 relative to the
  tensor's scale (measured: ≤ 5e-7);
- the compiled step's collective records (written by the graph when it runs them,
  ``compiled=True``) are the eager step's ops, groups, sizes, labels and ``async_op``.

Backend: ``aot_eager`` (Dynamo, AOTAutograd and the functional collectives, but no C++
code generation, which costs about a minute per variant on 2 cores); Inductor compiles
mc's layers in ``packages/mc-tp-layers/tests/mc_tp_layers_tests/test_compile.py`` and
this Llama's layer in ``benchmarks/compile_tp.py``.

**DDP** (DP = 2): two residual Column → Row blocks, compiled before mc DDP wraps the model
(one as ``torch.compile(block)``, one as ``block.forward = torch.compile(block.forward)``;
distributed optimizer, overlapped grad reduce and param gather, one bucket per block,
``gradient_accumulation_fusion``), 3 SGD steps against the same model
eager: equal losses and main grads (1e-6), the same collectives, and overlap: when block
0's weight gradient is ready (steps 2 and 3), block 1's bucket has already been
reduce-scattered, as in eager. Compiled autograd is not needed (DDP's hooks run after each
compiled block's backward). A block compiled in place (``block.compile()``) is refused
with ``overlap_param_gather``, naming the module.

**Mixture of experts** (EP = 2 × DP = 2): ``examples.hf_moe``'s one-layer Mixtral with its
decoder layer compiled in place after ``mc_moe.parallelize``, under mc DDP, against one
process; the dispatch's all-to-alls with uneven splits are traced into the graphs
(``mc_groups.comm.traceable``), the token counts read on the host between them
(``test_compiled_moe_layers_under_expert_parallelism_match_one_process``).
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch

from examples.hf_llama import build_model
from mc_groups.testing import RankPools

pytest.importorskip("transformers", reason="transformers is pinned in hatch.toml's default env")

BACKEND = "aot_eager"
RTOL = 1e-5
# a rank waits in the first compiled collective while its peer still compiles
TIMEOUT = timedelta(seconds=300)
DEADLINE_S = 600.0


def _key(record: Any) -> tuple[Any, ...]:
    return (
        record.op,
        record.reduce_op,
        record.group_ranks,
        record.dtype,
        record.numel,
        record.label,
        record.async_op,
    )


def _step(model: Any, call: Any, ids: torch.Tensor) -> tuple[float, list[torch.Tensor], list[Any]]:
    import mc_groups as mg

    with mg.record_collectives() as log:
        loss = call(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return float(loss), grads, list(log)


def _llama(sp: bool, how: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    import mc_groups as mg
    from mc_tp_layers import parallelize, sequence_parallel_plan

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2, timeout=TIMEOUT)
    try:
        cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)

        def build() -> Any:
            model = build_model("llama")
            model.config.use_cache = False
            plan = sequence_parallel_plan(model) if sp else dict(model.tp_plan)
            return parallelize(model, plan, config=cfg, pg_collection=pgc)

        eager, compiled = build(), build()
        rows = 1 if how == "first" else 2  # one row: the sequence scatter's part is a slice
        ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(1))
        if how != "whole":
            index = 0 if how == "first" else 1
            layer = compiled.model.layers[index]
            compiled.model.layers[index] = torch.compile(layer, fullgraph=True, backend=BACKEND)
            call = compiled
        else:
            call = torch.compile(compiled, fullgraph=True, backend=BACKEND)
        torch._dynamo.reset()
        counters.clear()
        eager(input_ids=ids, labels=ids)  # the eager copy's first forward (lazy imports)
        eager.zero_grad()
        with mg.record_collectives():  # traced as the recorded step runs: no retrace there
            call(input_ids=ids, labels=ids)  # compiles (fullgraph=True: a break raises)
        compiled.zero_grad()
        loss, grads, log = _step(compiled, call, ids)
        eager_loss, eager_grads, eager_log = _step(eager, eager, ids)
        return {
            "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],  # both steps: no recompile
            "loss": (loss, eager_loss),
            "grads": (grads, eager_grads),
            "log": ([_key(r) for r in log], [_key(r) for r in eager_log]),
            "flags": ([r.compiled for r in log], [r.compiled for r in eager_log]),
        }
    finally:
        torch._dynamo.reset()
        mg.destroy_model_parallel(pgc)


def _llama_case(sp: bool, how: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _llama(sp, how)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max())
    return float((actual - expected).abs().max()) / max(scale, 1e-12)


@pytest.mark.parametrize("how", ["layers", "first", "whole"])
@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_parallelized_llama_compiles(rank_pools: RankPools, how: str, sp: bool) -> None:
    """``first``: layer 0 compiled on a batch of one row, so the sequence scatter its entry
    hook runs under SP keeps a contiguous slice of the embeddings (a view, unless the
    mapping copies it: then the embedding grads lost the peer's part, 0.79 relative)."""
    case = f"{how} sp={sp}"
    for got in rank_pools.get(2).run_with_deadline(DEADLINE_S, _llama_case, sp, how):
        assert got["breaks"] == 0, case
        # the entry hook of layer 0 (SP: the sequence scatter) traced as a graph of its own
        assert got["graphs"] == (2 if how == "first" and sp else 1), case
        loss, eager_loss = got["loss"]
        assert abs(loss - eager_loss) <= RTOL * abs(eager_loss), case
        grads, eager_grads = got["grads"]
        worst = max(_close(a, b) for a, b in zip(grads, eager_grads, strict=True))
        assert worst <= RTOL, (case, worst)
        log, eager_log = got["log"]
        assert eager_log, case
        assert Counter(log) == Counter(eager_log), case
        flags, eager_flags = got["flags"]
        assert not any(eager_flags), case
        # layer 1, SP off: q, k, v and gate, up dgrad all-reduces, o_proj and down_proj
        # forward all-reduces (7); SP on: attention and MLP entry gathers and their grads'
        # reduce-scatters, o_proj and down_proj reduce-scatters and their grads' gathers
        # (8), and for layer 0 the scatter's grad all-gather (9). The rest of the model runs
        # eagerly when only that layer compiles.
        layer = (9 if how == "first" else 8) if sp else 7
        assert sum(flags) == (len(eager_log) if how == "whole" else layer), case


class _Block(torch.nn.Module):
    """``x + Row(GELU(Column(x)))`` at TP = 1 (DP carries the parallelism here)."""

    def __init__(self, cfg: Any, pgc: Any) -> None:
        from mc_tp_layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.up = ColumnParallelLinear(16, 32, config=cfg, init_method=init, pg_collection=pgc)
        self.down = RowParallelLinear(
            32,
            16,
            config=cfg,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(x)[0]))[0]
        return out


def _ddp_run(compiled: bool) -> dict[str, Any]:
    import mc_groups as mg
    from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
    from mc_finalize import finalize_model_grads

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=1, timeout=TIMEOUT)
    try:
        cfg = mg.ModelParallelConfig(use_cpu_initialization=True, gradient_accumulation_fusion=True)
        torch.manual_seed(0)
        plain = [_Block(cfg, pgc) for _ in range(2)]
        first_weight = plain[0].up.weight
        assert first_weight is not None
        blocks: list[Any] = list(plain)
        if compiled:  # block 0 as torch.compile's wrapper, block 1 with a compiled forward
            blocks[0] = torch.compile(plain[0], fullgraph=True, backend=BACKEND)
            forward = torch.compile(plain[1].forward, fullgraph=True, backend=BACKEND)
            plain[1].forward = forward  # type: ignore[method-assign]
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=sum(p.numel() for p in blocks[0].parameters()),
        )
        ddp = DistributedDataParallel(cfg, ddp_cfg, torch.nn.Sequential(*blocks), pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        seed = 1 + pgc.require("dp", "test").rank()
        x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(seed))
        losses, main_grads, logs, overlap = [], [], [], []
        for _ in range(3):
            ddp.zero_grad_buffer()
            with mg.record_collectives() as log:
                loss = ddp(x).pow(2).mean()
                hook: Any = first_weight.register_post_accumulate_grad_hook
                seen = hook(
                    lambda _p, log=log: overlap.append(sum(r.op == "reduce_scatter" for r in log))
                )
                loss.backward()
                seen.remove()
                finalize_model_grads([ddp], pg_collection=pgc)
            main_grads.append(torch.cat([b.grad_data.clone() for b in ddp.buffers]))
            opt.step()
            losses.append(float(loss))
            logs.append([_key(r) for r in log])
        return {"losses": losses, "main grads": main_grads, "logs": logs, "overlap": overlap}
    finally:
        torch._dynamo.reset()
        mg.destroy_model_parallel(pgc)


def _in_place_refused() -> str:
    import mc_groups as mg
    from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=1, timeout=TIMEOUT)
    try:
        cfg = mg.ModelParallelConfig(use_cpu_initialization=True)
        model = torch.nn.Sequential(_Block(cfg, pgc))
        model[0].compile(fullgraph=True)
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        )
        try:
            DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
        except ValueError as err:
            return str(err)
        return "no error"
    finally:
        mg.destroy_model_parallel(pgc)


def _ddp_cases() -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    torch.set_num_threads(1)
    return {
        "eager": _ddp_run(False),
        "compiled": _ddp_run(True),
        "in place": _in_place_refused(),
    }


def test_ddp_over_compiled_blocks_matches_eager(rank_pools: RankPools) -> None:
    for res in rank_pools.get(2).run_with_deadline(DEADLINE_S, _ddp_cases):
        eager, compiled = res["eager"], res["compiled"]
        for a, b in zip(compiled["losses"], eager["losses"], strict=True):
            assert abs(a - b) <= RTOL * abs(b)
        for a, b in zip(compiled["main grads"], eager["main grads"], strict=True):
            assert float((a - b).abs().max()) <= 1e-6
            assert float(b.abs().max()) > 1e-3  # the grads are not all zero
        for a, b in zip(compiled["logs"], eager["logs"], strict=True):
            assert Counter(a) == Counter(b)
            assert Counter(k[0] for k in b) == Counter({"all_gather": 2, "reduce_scatter": 2})
        # steps 2 and 3: block 1's bucket was reduce-scattered before block 0's grad was ready
        assert eager["overlap"][1:] == [1, 1]
        assert compiled["overlap"] == eager["overlap"]
        assert "compiled in place" in res["in place"]
        assert "'0'" in res["in place"]


MOE_STEPS = 2


def _moe_cases() -> dict[str, Any]:
    """``examples.hf_moe``'s Mixtral at EP = 2 × DP = 2 (mc DDP, overlapped grad reduce,
    the global aux loss, clipping, SGD with momentum): eagerly, then with each decoder
    layer compiled in place; each run's losses, whole weights, recorded collectives and
    Dynamo's graph count."""
    from torch._dynamo.utils import counters

    import mc_groups as mg
    from examples.hf_moe import Layout, train

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        for name, layout in (("eager", Layout(ep=2)), ("compiled", Layout(ep=2, compile=BACKEND))):
            torch._dynamo.reset()
            counters.clear()
            with mg.record_collectives() as log:
                run = train("mixtral", layout, steps=MOE_STEPS, layers=1)
            out[name] = {
                "losses": run.losses,
                "weights": run.weights,
                "log": [_key(r) for r in log],
                "in graphs": sum(r.compiled for r in log),
                "graphs": counters["stats"]["unique_graphs"],
            }
    finally:
        torch._dynamo.reset()
    return out


def test_compiled_moe_layers_under_expert_parallelism_match_one_process(
    rank_pools: RankPools,
) -> None:
    """torchtitan's per-block compile of a mixture-of-experts model: the decoder layer of a
    one-layer ``transformers`` Mixtral (``examples.hf_moe``: 4 experts, top-2, 2 per rank)
    compiled in place (``layer.compile()``, parameter names kept) after
    ``mc_moe.parallelize`` split the experts over ``ep`` = 2, then wrapped by mc DDP
    (DP = 2), global aux loss, clipping, 2 SGD steps with momentum; 2 ranks. The dispatch
    reads its split sizes on the host once per forward (Megatron's all-to-all dispatcher),
    so Dynamo breaks the graph there (20 graphs; 28 when it read them five times); the
    all-to-alls with those sizes are traced into the graphs. Against one process
    (``examples.hf_moe.reference``, the same global batch):
    losses within 1e-5 relative, every whole weight within 1e-6 (measured: 1.1e-7,
    1.5e-8); Dynamo built graphs (the layer did compile); the compiled run recorded exactly
    the eager run's collectives (op, group, size, label: 4 all-to-alls over ``ep`` a
    step, every one recorded from inside a graph)."""
    from examples.hf_moe import reference

    ref = reference("mixtral", MOE_STEPS, layers=1)
    for rank, res in enumerate(rank_pools.get(2).run_with_deadline(DEADLINE_S, _moe_cases)):
        eager, compiled = res["eager"], res["compiled"]
        assert (eager["graphs"], compiled["graphs"] > 0) == (0, True), rank
        for name, run in res.items():
            rel = max(abs(a - b) / b for a, b in zip(run["losses"], ref.losses, strict=True))
            assert rel <= 1e-5, (rank, name, run["losses"], ref.losses)
            worst = max(float((run["weights"][k] - v).abs().max()) for k, v in ref.weights.items())
            assert worst <= 1e-6, (rank, name, worst)
            print(f"rank {rank} {name}: loss rel {rel:.1e}, weights {worst:.1e}")
        assert Counter(compiled["log"]) == Counter(eager["log"]), rank
        a2a = sum(key[0] == "all_to_all" for key in compiled["log"])
        assert a2a == 4 * MOE_STEPS == compiled["in graphs"], (rank, a2a, compiled["in graphs"])
        print(
            f"rank {rank}: {compiled['graphs']} graphs, {compiled['in graphs']} collectives in them"
        )
