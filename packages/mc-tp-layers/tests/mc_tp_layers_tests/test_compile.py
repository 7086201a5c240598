"""mc's TP layers under ``torch.compile(fullgraph=True)``, TP = 2.

Each case builds the same layers twice from one seed (freshly built: the compiled copy's
first forward happens while Dynamo traces; the layers' agreement ran at construction, so
no forward exchanges anything), runs one forward and backward eagerly and compiled on the
same inputs, and compares:

- outputs and every gradient: compiled equals eager within 1e-5 relative to each tensor's
  scale (``_helpers.assert_close``; eager itself is held to 1-process references by
  ``test_linear_parity``, ``test_cross_entropy`` and ``test_embedding``);
- graph breaks: none (``fullgraph=True``; Dynamo's counters: 0 breaks, one graph);
- the collectives of a step: the compiled step's records (``compiled=True``, written when
  the graph runs them) are the eager step's ops, groups, dtypes, sizes, labels and
  ``async_op``, as multisets (Inductor orders independent collectives itself).

Backends: Inductor's C++ backend for the MLP with sequence parallelism (the compiled
numerics: Inductor's kernels, its lowering of the gathers and of gloo's all-to-all
reduce-scatter, ``main_grad`` accumulated in the graph); ``aot_eager`` (Dynamo and
AOTAutograd trace the same forward and backward graphs, with the functional collectives
and mc's record op, run by eager kernels: no C++ compile, about 10 s less per case on 2
cores) for the rest. ``mc_groups_tests/test_traceable.py`` holds every collective
Inductor lowers (all-reduce SUM and MAX, gather, reduce-scatter, all-to-all) to exact
values.

Cases: Column → GELU → Row with sequence parallelism off, and on with
``gradient_accumulation_fusion`` (the wgrads accumulate into ``main_grad`` inside the
compiled backward); ``VocabParallelEmbedding`` → Column head → ``vocab_parallel_cross_entropy``,
whose range checks hold in compiled code (an id or target out of range raises when the
compiled step runs). A check that fails on one rank only at a fresh layer's first
(traced) forward is that rank's own clear error naming the argument (no graph break, no
exchange: its peer, whose forward issues no collective, runs on, as in eager mode). And
more MLP blocks than Dynamo's recompile limit (8), each compiled with ``fullgraph=True`` as
torchtitan compiles every block, compile once and share the graph (nothing in a layer's
forward may guard on the layer's identity: a recompile per block, and
``FailOnRecompileLimitHit`` past 8), with the eager blocks' output.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, config, grad, main_grad, randn, row_parallel

S, B, H, V = 8, 2, 16, 32  # sequence, batch, hidden, vocabulary
COMPILE_TIMEOUT = timedelta(seconds=300)
DEADLINE_S = 600.0


def _key(record: mg.CollectiveRecord) -> tuple[Any, ...]:
    return (
        record.op,
        record.reduce_op,
        record.group_ranks,
        record.dtype,
        record.numel,
        record.label,
        record.async_op,
    )


def _quiet_inductor() -> None:
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile workers in a 2-core rank process


class _MLP(torch.nn.Module):
    def __init__(self, cfg: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> None:
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.up = tpl.ColumnParallelLinear(
            H, 4 * H, config=cfg, init_method=init, bias=True, pg_collection=pgc
        )
        self.down = row_parallel(4 * H, H, cfg, init, pg_collection=pgc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)[0]))[0]
        return out


def _step(
    fn: Any, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, torch.Tensor], list[tuple[Any, ...]], list[bool]]:
    """One forward and backward (output grad: ones); outputs, grads, collective records."""
    with mg.record_collectives() as log:
        out = fn(*inputs)
        out.sum().backward()
    values = {"out": out.detach()}
    for name, param in module.named_parameters():
        values[f"grad {name}"] = grad(param) if param.grad is not None else main_grad(param)
    for index, tensor in enumerate(inputs):
        if tensor.requires_grad:
            values[f"grad input {index}"] = grad(tensor)
    return values, [_key(r) for r in log], [r.compiled for r in log]


def _compare(
    build: Any, inputs: tuple[torch.Tensor, ...], call: Any = None, backend: str = "inductor"
) -> dict[str, Any]:
    """Eager and compiled copies of ``build()``: the case's measurements. The compile is
    ``fullgraph=True`` (a graph break raises); Dynamo's counters say how many graphs it
    built and breaks it met."""
    from torch._dynamo.utils import counters

    eager_module, compiled_module = build(), build()
    eager_fn = eager_module if call is None else (lambda *a: call(eager_module, *a))
    plain = compiled_module if call is None else (lambda *a: call(compiled_module, *a))
    torch._dynamo.reset()
    counters.clear()
    eager_inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    compiled_inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    compiled_fn = torch.compile(plain, fullgraph=True, backend=backend)
    compiled, compiled_log, flags = _step(compiled_fn, compiled_module, compiled_inputs)
    eager, eager_log, eager_flags = _step(eager_fn, eager_module, eager_inputs)
    return {
        "eager": eager,
        "compiled": compiled,
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "eager log": eager_log,
        "compiled log": compiled_log,
        "flags": (flags, eager_flags),
        "compiled fn": compiled_fn,
    }


def _mlp_case(pgc: mg.ProcessGroupCollection, sp: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    cfg = config(2, sequence_parallel=sp, gradient_accumulation_fusion=sp)

    def build() -> _MLP:
        torch.manual_seed(0)
        mlp = _MLP(cfg, pgc)
        if sp:  # accumulate into main_grad (no DDP: the layer adds dW itself)
            for param in (mlp.up.weight, mlp.down.weight):
                assert param is not None
                param.main_grad = torch.zeros_like(param)  # type: ignore[attr-defined]
        return mlp

    x = randn(S, B, H, seed=1)
    x = (x.chunk(2, dim=0)[rank] if sp else x).contiguous().requires_grad_()
    # Inductor where SP is on (gathers, all-to-all reduce-scatters, main_grad in the graph);
    # SP off (two all-reduces, traced the same way) is held to aot_eager's graphs
    result = _compare(build, (x,), backend="inductor" if sp else "aot_eager")
    del result["compiled fn"]
    return result


class _LM(torch.nn.Module):
    """Vocabulary-parallel embedding and a column-parallel head (logits split by vocab)."""

    def __init__(self, cfg: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = tpl.VocabParallelEmbedding(
            V, H, init_method=torch.nn.init.normal_, config=cfg, pg_collection=pgc
        )
        self.head = tpl.ColumnParallelLinear(
            H,
            V,
            config=cfg,
            init_method=torch.nn.init.xavier_normal_,
            bias=False,
            pg_collection=pgc,
        )


def _lm_loss(lm: _LM, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    hidden = lm.embedding(ids)  # [b, s, h], all-reduced
    logits, _ = lm.head(hidden)  # [b, s, V/2]
    return tpl.vocab_parallel_cross_entropy(logits, target, tp_group=lm.head.tp_group).mean()


def _lm_case(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    cfg = config(2)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, S), generator=generator)
    target = torch.randint(0, V, (B, S), generator=generator)
    result = _compare(lambda: _LM(cfg, pgc), (ids, target), _lm_loss, backend="aot_eager")
    compiled_fn = result.pop("compiled fn")
    refusals = []
    for bad_ids, bad_target in ((ids.clone().fill_(V), target), (ids, target.clone().fill_(-1))):
        try:
            compiled_fn(bad_ids, bad_target)
            refusals.append("no error")
        except RuntimeError as err:
            refusals.append(str(err))
    result["refusals"] = refusals
    return result


def _one_rank_fails(pgc: mg.ProcessGroupCollection) -> str:
    """A fresh layer's first forward, traced; rank 1 passes a wrong width."""
    torch.manual_seed(0)
    layer = tpl.ColumnParallelLinear(
        H, H, config=config(2), init_method=torch.nn.init.xavier_normal_, pg_collection=pgc
    )
    width = H if dist.get_rank() == 0 else H + 1
    try:
        torch.compile(layer, fullgraph=True)(torch.ones(S, B, width))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _many_blocks(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    """More residual MLP blocks than Dynamo's recompile limit, each compiled as torchtitan
    does (``fullgraph=True``): they share one graph (backend ``eager``: Dynamo only)."""
    from torch._dynamo.utils import counters

    cfg = config(2)
    blocks = 2 + int(torch._dynamo.config.recompile_limit)

    def build() -> list[_MLP]:
        torch.manual_seed(0)
        return [_MLP(cfg, pgc) for _ in range(blocks)]

    eager, compiled = build(), build()
    for mlp in compiled:
        mlp.forward = torch.compile(mlp.forward, fullgraph=True, backend="eager")  # type: ignore[method-assign]
    x = randn(S, B, H, seed=2).requires_grad_()
    expected, out = x, x
    counters.clear()
    for eager_mlp, compiled_mlp in zip(eager, compiled, strict=True):
        expected = expected + eager_mlp(expected)
        out = out + compiled_mlp(out)
    return {
        "blocks": blocks,
        "graphs": counters["stats"]["unique_graphs"],
        "out": out.detach(),
        "expected": expected.detach(),
    }


def _cases(which: str) -> dict[str, Any]:
    _quiet_inductor()
    # a long timeout: a rank waits in the first compiled collective while its peer compiles
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2, timeout=COMPILE_TIMEOUT)
    try:
        if which == "mlp":
            return {"sp off": _mlp_case(pgc, False), "sp on": _mlp_case(pgc, True)}
        return {
            "lm": _lm_case(pgc),
            "one rank fails": _one_rank_fails(pgc),
            "many blocks": _many_blocks(pgc),
        }
    finally:
        torch._dynamo.reset()
        mg.destroy_model_parallel(pgc)


def _check(case: dict[str, Any], what: str) -> None:
    assert case["breaks"] == 0, what
    assert case["graphs"] == 1, what
    assert case["eager"].keys() == case["compiled"].keys()
    for name, value in case["eager"].items():
        assert_close(case["compiled"][name], value, f"{what}: {name}")
    assert case["eager log"], what
    assert Counter(case["compiled log"]) == Counter(case["eager log"]), what
    compiled_flags, eager_flags = case["flags"]
    assert all(compiled_flags), what
    assert not any(eager_flags), what


def test_column_row_mlp_compiles_whole_sp_off_and_on(rank_pools: RankPools) -> None:
    for rank, res in enumerate(rank_pools.get(2).run_with_deadline(DEADLINE_S, _cases, "mlp")):
        _check(res["sp off"], f"rank {rank} SP off")
        _check(res["sp on"], f"rank {rank} SP on")
        ops = Counter(key[0] for key in res["sp off"]["eager log"])
        assert ops == Counter({"all_reduce": 2})  # Row's forward, Column's dgrad
        ops = Counter(key[0] for key in res["sp on"]["eager log"])
        assert ops == Counter({"all_gather": 3, "reduce_scatter": 2})


def test_embedding_and_vocab_parallel_loss_compile_whole(rank_pools: RankPools) -> None:
    for rank, res in enumerate(rank_pools.get(2).run_with_deadline(DEADLINE_S, _cases, "lm")):
        _check(res["lm"], f"rank {rank} embedding + loss")
        ops = Counter((key[0], key[1]) for key in res["lm"]["eager log"])
        # embedding sum, cross-entropy max and sums, the head's dgrad
        assert ops == Counter({("all_reduce", "sum"): 3, ("all_reduce", "max"): 1})
        bad_ids, bad_target = res["lm"]["refusals"]
        assert "token id(s) outside [0, 32)" in bad_ids
        assert "class index(es) outside [0, 32)" in bad_target
        failed = res["one rank fails"]
        if rank == 1:
            assert "input_" in failed, failed
            assert f"{H + 1}" in failed, failed
        else:
            assert failed == "no error", failed
        many = res["many blocks"]
        assert many["blocks"] > 8
        assert many["graphs"] == 1  # the blocks share one graph: no recompile per block
        assert_close(many["out"], many["expected"], f"rank {rank}: {many['blocks']} blocks")
