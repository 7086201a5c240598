"""``mc_groups.comm.traceable``: the new-tensor collectives, eager and under ``torch.compile``.

On 2 gloo ranks, rank r holds ``x_r = arange(12).view(4, 3) + 100·r``; every expectation is
computed here by hand from the two inputs (sums, maxima, concatenations, the halves of a
sum), not by another collective. One function runs every collective (sync and started,
SUM and MAX, gather, reduce-scatter, all-to-all) eagerly and compiled with
``fullgraph=True`` (Inductor's C++ backend, one compile):

- values: eager and compiled both equal the hand-made results, exactly (small integers in
  fp32);
- graph breaks: none (``fullgraph=True``; Dynamo's counters: 0 breaks, one graph, built
  once for both calls);
- records: the compiled run records each collective when it runs (``compiled=True``),
  the same ops, groups, dtypes, sizes, labels and ``async_op`` as the eager run (compared
  as multisets: Inductor orders independent collectives itself); the first call, which
  traces, compiles and runs, records one run;
- the opt-in schedule check runs in compiled code: ranks that compiled different labels
  raise :class:`~mc_groups.CollectiveScheduleError` on both ranks (a second, tiny compile,
  ``aot_eager``: the graph holds the same record op, without Inductor's code generation);
- the record op is in a graph only while a recorder is open (else the graph holds no
  operator Inductor's FX graph cache refuses), the recorder's flag guarded by Dynamo;
- the eager ``inplace`` flag reuses the input; one-rank groups return the input itself;
  bad inputs are refused before anything is issued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.comm import traceable
from mc_groups.testing import RankPools, error_kind


def _inputs(rank: int) -> torch.Tensor:
    return torch.arange(12.0).view(4, 3) + 100.0 * rank


def _every_op(x: torch.Tensor, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    summed = traceable.all_reduce_tensor(x, group, label="sum")
    gathered = traceable.all_gather_tensor(x, group, label="gather")
    scattered = traceable.reduce_scatter_tensor(x, group, label="scatter")
    exchanged = traceable.all_to_all_tensor(x, group, label="exchange")
    peak = traceable.start_all_reduce(x, group, op=mg.ReduceOp.MAX, label="max")
    late_gather = traceable.start_all_gather(x * 2, group, label="gather later")
    late_scatter = traceable.start_reduce_scatter(x * 3, group, label="scatter later")
    return {
        "sum": summed,
        "gather": gathered,
        "scatter": scattered,
        "exchange": exchanged,
        "max": peak.wait(),
        "gather later": late_gather.wait(),
        "scatter later": late_scatter.wait(),
    }


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


def _compiled_run() -> dict[str, Any]:
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.compile_threads = 1  # no compile workers in a 2-core rank process
    # a long timeout: a rank waits in the first compiled collective while its peer compiles
    group = dist.new_group([0, 1], timeout=timedelta(seconds=300))
    x = _inputs(dist.get_rank())
    with mg.record_collectives() as eager_log:
        eager = _every_op(x, group)
    torch._dynamo.reset()
    counters.clear()
    compiled_fn = torch.compile(_every_op, fullgraph=True)  # a graph break raises
    with mg.record_collectives() as first_log:
        compiled_fn(x, group)  # the first call traces, compiles, and runs once
    with mg.record_collectives() as compiled_log:
        compiled = compiled_fn(x, group)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    mismatch = _schedule_mismatch(x, group)
    torch._dynamo.reset()
    return {
        "eager": eager,
        "compiled": compiled,
        "breaks": breaks,
        "graphs": graphs,
        "first call records": len(first_log),
        "eager records": [_key(r) for r in eager_log],
        "compiled records": [_key(r) for r in compiled_log],
        "compiled flags": [r.compiled for r in compiled_log],
        "eager flags": [r.compiled for r in eager_log],
        "mismatch": mismatch,
    }


def _schedule_mismatch(x: torch.Tensor, group: dist.ProcessGroup) -> str:
    """Ranks compile different labels; the schedule check in the graph's op catches it."""
    label = f"rank {dist.get_rank()}"

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return traceable.all_reduce_tensor(t, group, label=label)

    # aot_eager: the graph holds the same record op (the check runs in it), no C++ compile
    compiled_fn = torch.compile(reduce, fullgraph=True, backend="aot_eager")
    compiled_fn(x)  # unchecked: compiles
    try:
        with mg.check_collective_schedule():
            compiled_fn(x)
    except mg.CollectiveScheduleError as err:
        return str(err)
    return "no error"


def _expected() -> dict[str, torch.Tensor]:
    x0, x1 = _inputs(0), _inputs(1)
    return {
        "sum": x0 + x1,
        "gather": torch.cat([x0, x1]),
        "max": torch.maximum(x0, x1),
        "gather later": torch.cat([x0, x1]) * 2,
    }


def _expected_for_rank(rank: int) -> dict[str, torch.Tensor]:
    x0, x1 = _inputs(0), _inputs(1)
    total = x0 + x1
    return {
        "scatter": total[2 * rank : 2 * rank + 2],
        "scatter later": 3 * total[2 * rank : 2 * rank + 2],
        "exchange": torch.cat([x0[2 * rank : 2 * rank + 2], x1[2 * rank : 2 * rank + 2]]),
    }


def test_eager_and_compiled_collectives_match_by_hand_and_record_alike(
    rank_pools: RankPools,
) -> None:
    results = rank_pools.get(2).run_with_deadline(600.0, _compiled_run)
    common = _expected()
    for rank, res in enumerate(results):
        wanted = {**common, **_expected_for_rank(rank)}
        for mode in ("eager", "compiled"):
            for name, value in wanted.items():
                assert torch.equal(res[mode][name], value), f"rank {rank} {mode} {name}"
        assert res["breaks"] == 0
        assert res["graphs"] == 1
        assert res["first call records"] == 7  # tracing and compiling record nothing
        assert len(res["eager records"]) == 7
        assert Counter(res["compiled records"]) == Counter(res["eager records"])
        assert all(res["compiled flags"])
        assert not any(res["eager flags"])
        assert "rank 0" in res["mismatch"], res["mismatch"]
        assert "rank 1" in res["mismatch"], res["mismatch"]


def _graphs_with_and_without_the_record_op() -> dict[str, Any]:
    """One all-reduce compiled through AOTAutograd with a backend that keeps each graph it
    is given: called without a recorder, inside one, and without again."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch._aot_autograd.utils import make_boxed_func

    group = dist.new_group([0, 1], timeout=timedelta(seconds=120))
    x = _inputs(dist.get_rank())
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return traceable.all_reduce_tensor(t * 2, group, label="tap")

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(reduce, fullgraph=True, backend=aot_autograd(fw_compiler=keep))
    plain = compiled(x)
    with mg.record_collectives() as log:
        recorded = compiled(x)
    again = compiled(x)
    seen = []
    for gm in graphs:
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        hops = [n.target for n in nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
        seen.append(
            {
                "record op": any("mc_groups.collective" in str(n.args) for n in nodes),
                "uncacheable": [hop.name() for hop in hops if not hop.cacheable()],  # type: ignore[no-untyped-call]
            }
        )
    torch._dynamo.reset()
    return {
        "values": [plain, recorded, again],
        "graphs": seen,
        "unique graphs": counters["stats"]["unique_graphs"],
        "records": [(r.op, r.label, r.compiled) for r in log],
    }


def test_the_record_op_is_traced_only_while_a_recorder_is_open(rank_pools: RankPools) -> None:
    """Without a recorder (and without the schedule check) a compiled collective's graph
    holds no ``mc_groups::collective`` op and so no ``with_effects`` operator, which
    Inductor's FX graph cache refuses (``HigherOrderOperator.cacheable()``, the test
    Inductor's cache makes); opening a recorder retraces (Dynamo guards the recorder's
    flag) into a graph with the op, which records the run (``compiled=True``); closing it
    goes back to the first graph (2 graphs in all). Values: 2·(x_0 + x_1) on every call."""
    results = rank_pools.get(2).run_with_deadline(300.0, _graphs_with_and_without_the_record_op)
    want = 2 * (_inputs(0) + _inputs(1))
    for res in results:
        assert all(torch.equal(v, want) for v in res["values"])
        assert res["graphs"] == [
            {"record op": False, "uncacheable": []},
            {"record op": True, "uncacheable": ["with_effects"]},
        ], res["graphs"]
        assert res["unique graphs"] == 2
        assert res["records"] == [("all_reduce", "tap", True)]


def _eager_details() -> dict[str, Any]:
    group = dist.group.WORLD
    assert group is not None
    x = _inputs(dist.get_rank())
    kept = x.clone()
    out = traceable.all_reduce_tensor(x, group)
    untouched = torch.equal(x, kept) and out is not x
    reused = traceable.all_reduce_tensor(x, group, inplace=True)
    solo = [dist.new_group([r]) for r in range(2)][dist.get_rank()]  # every rank builds both
    one_rank = [
        traceable.all_reduce_tensor(kept, solo) is kept,
        traceable.all_gather_tensor(kept, solo) is kept,
        traceable.reduce_scatter_tensor(kept, solo) is kept,
        traceable.all_to_all_tensor(kept, solo) is kept,
        traceable.start_all_reduce(kept, solo).wait() is kept,
    ]
    errors = []
    calls: tuple[Callable[[], object], ...] = (
        lambda: traceable.all_reduce_tensor(kept, None),  # type: ignore[arg-type]
        lambda: traceable.all_reduce_tensor([1.0], group),  # type: ignore[arg-type]
        lambda: traceable.reduce_scatter_tensor(torch.ones(3), group),
        lambda: traceable.all_to_all_tensor(kept, group, input_split_sizes=[1, 1]),
        lambda: traceable.all_to_all_tensor(kept, group, output_split_sizes=[4]),
        lambda: traceable.all_reduce_tensor(kept, group, inplace=1),  # type: ignore[arg-type]
    )
    for call in calls:
        with mg.record_collectives() as log:
            try:
                call()
                errors.append("no error")
            except Exception as err:
                errors.append(f"{error_kind(err)}: {err}")
        assert log == []
    return {
        "untouched": untouched,
        "reused": reused is x,
        "value": reused,
        "one rank": one_rank,
        "errors": errors,
    }


def test_eager_inplace_one_rank_groups_and_bad_inputs(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(_eager_details)
    total = _inputs(0) + _inputs(1)
    for res in results:
        assert res["untouched"]
        assert res["reused"]
        assert torch.equal(res["value"], total)
        assert all(res["one rank"])
        kinds = [e.split(":")[0] for e in res["errors"]]
        assert kinds == [
            "TypeError",
            "TypeError",
            "ValueError",
            "ValueError",
            "ValueError",
            "TypeError",
        ], res["errors"]
        assert "group size 2" in res["errors"][2]
        assert "input_split_sizes=[1, 1]" in res["errors"][3]


def _torch_op(name: str) -> Any:
    """torch's ``ReduceOp`` member (accepted at run time, outside the annotated type)."""
    return getattr(dist.ReduceOp, name)


def _fast_and_general_paths() -> dict[str, Any]:
    """The same all-reduces through the eager fast path (plain tensor, mc op, str label,
    bool flag) and the general checks (a Parameter, torch's op), recorded; then what each
    path raises for a failing backend call, a bad label and a destroyed group."""
    group, dead = dist.new_group([0, 1]), dist.new_group([0, 1])
    x = _inputs(dist.get_rank())
    param = torch.nn.Parameter(x.clone(), requires_grad=False)
    with mg.record_collectives() as log:
        values = [
            traceable.all_reduce_tensor(x, group, label="fast"),
            traceable.all_reduce_tensor(param, group, op=_torch_op("SUM"), label="general"),
            traceable.start_all_reduce(x, group, op=mg.ReduceOp.MAX, label="fast").wait(),
            traceable.start_all_reduce(param, group, op=_torch_op("MAX"), label="general").wait(),
            traceable.all_gather_tensor(x, group, label="fast"),
            traceable.start_all_gather(param, group, label="general").wait(),
            traceable.reduce_scatter_tensor(x, group, label="fast"),
            traceable.start_reduce_scatter(param, group, op=_torch_op("SUM"), label="all").wait(),
        ]
    handle_text = mg.all_reduce(x.clone(), group, async_op=True, label="text").description
    errors = []
    calls: tuple[Callable[[], object], ...] = (
        lambda: traceable.all_reduce_tensor(torch.ones(4, dtype=torch.uint16), group, label="u"),
        lambda: traceable.start_all_reduce(x, group, label=3),  # type: ignore[arg-type]
        lambda: traceable.all_reduce_tensor(x, group, op="sum"),  # type: ignore[arg-type]
        lambda: traceable.start_all_gather(x, group, label=None),  # type: ignore[arg-type]
        lambda: traceable.reduce_scatter_tensor(x[:3], group),
    )
    dist.destroy_process_group(dead)
    calls += (lambda: traceable.start_all_reduce(x, dead),)
    for call in calls:
        try:
            call()
            errors.append("no error")
        except Exception as err:
            errors.append(f"{error_kind(err)}: {err}")
    return {
        "values": values,
        "records": [(r.op, r.reduce_op, r.numel, r.dtype, r.async_op, r.label) for r in log],
        "handle text": handle_text,
        "errors": errors,
    }


def test_fast_path_matches_general_path_values_records_and_errors(
    rank_pools: RankPools,
) -> None:
    """The eager all-reduce's one-test-per-argument path (``traceable._eager_all_reduce``)
    against the general checks: equal values (by hand), equal records but the label, and
    the same errors the general path raises."""
    results = rank_pools.get(2).run(_fast_and_general_paths)
    x0, x1 = _inputs(0), _inputs(1)
    wanted = [x0 + x1] * 2 + [torch.maximum(x0, x1)] * 2 + [torch.cat([x0, x1])] * 2
    for rank, res in enumerate(results):
        mine = (x0 + x1)[2 * rank : 2 * rank + 2]
        for value, want in zip(res["values"], [*wanted, mine, mine], strict=True):
            assert torch.equal(value, want)
        assert res["records"] == [
            ("all_reduce", "sum", 12, torch.float32, False, "fast"),
            ("all_reduce", "sum", 12, torch.float32, False, "general"),
            ("all_reduce", "max", 12, torch.float32, True, "fast"),
            ("all_reduce", "max", 12, torch.float32, True, "general"),
            ("all_gather", None, 12, torch.float32, False, "fast"),
            ("all_gather", None, 12, torch.float32, True, "general"),
            ("reduce_scatter", "sum", 12, torch.float32, False, "fast"),
            ("reduce_scatter", "sum", 12, torch.float32, True, "all"),
        ]
        assert res["handle text"] == "all_reduce on group ranks [0, 1] (12 × float32) for 'text'"
        failed, label, op, gather_label, rows, dead = res["errors"]
        assert failed.startswith(
            "CollectiveError: all_reduce on group ranks [0, 1] (4 × uint16) for 'u' failed:"
        ), failed
        assert label.startswith("TypeError: label=3"), label
        assert op.startswith("TypeError: op='sum'"), op
        assert gather_label.startswith("TypeError: label=None"), gather_label
        assert rows.startswith("ValueError: reduce_scatter_tensor: tensor has shape (3, 3)"), rows
        assert dead.startswith("RuntimeError: group (a process group of 2 rank(s)) was destroyed")
