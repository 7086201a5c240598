"""One rank's failed check is every rank's error, at each public entry point that leads
into a collective: DDP construction, ``finalize_model_grads``,
``ShardedOptimizer.step``, and the optimizer's checkpoint pair (``sharded_state_dict`` /
``load_sharded_state_dict``). (``initialize_model_parallel``: the mc-groups tests.)

Localizes what the package tests cannot: the entry points composed as the demo composes
them (its small GPT, mc layers + DDP with the distributed optimizer + ``finalize_model_grads``
+ ``ShardedOptimizer``), with bad input on rank 1 only. Before, rank 1 raised at once and
its peers waited in the entry point's first collective until the group's timeout (20 s in
these pools) and then failed with a timeout naming nothing.

Checks, per entry point: rank 1 raises its own error; every other rank of the entry
point's group raises ``mc_groups.PeerCheckError`` naming rank 1 and its message; all of
them within 5 s (the issue's bound; measured inside the ranks). Nothing allocated or
changed: DDP left no ``main_grad`` on any param; a refused step left every param as it
was; and afterwards the same call, made correctly on every rank, works (the world is
usable, nothing half done). On 4 ranks (TP=2 × DP=2, groups nested in the world) DDP and
``finalize_model_grads`` stop all 4 ranks (their exchange is over the world).
``finalize_model_grads`` and ``ShardedOptimizer.step`` exchange only with
``peer_checks=True`` (opt-in: a default step runs Megatron's collectives only).

A TP layer's forward is not such an entry point: its TP peers agree on how they built it
when it is built (``mc_tp_layers.agreement``), and each forward checks its input locally,
as Megatron's layers do, exchanging nothing. What holds, and is checked here: a bad input
on one rank is that rank's own clear error before it issues anything, its peers are not
told (a Column forward without ``gather_output`` issues no collective: they run on), and
the next forward, made correctly on every rank, works (the group is usable).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import GPTConfig, OptimizerConfig, ParallelLayout, init_full_weights
from examples.gpt.train import apply_ddp, build_model, parallelize
from mc_ddp import DistributedDataParallel
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers import ColumnParallelLinear

BOUND_S = 5.0
BAD = 1
CFG = GPTConfig(vocab_size=64, hidden_size=16, num_heads=2, num_layers=1, seq_length=8)


def _layout(tp: int) -> ParallelLayout:
    return ParallelLayout(
        tp=tp,
        dp=dist.get_world_size() // tp,
        sequence_parallel=False,
        distributed_optimizer=True,
        microbatches=1,
    )


def _timed(call: Callable[[], object]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        kind, text = "no error", ""
    except (ValueError, TypeError, RuntimeError) as err:
        kind, text = error_kind(err), str(err)
    return kind, text, time.monotonic() - start


def _backward(model: Any, pgc: mg.ProcessGroupCollection) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length + 1), generator=_gen())
    model.zero_grad_buffer()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    del pgc


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _case(case: str, tp: int = 1) -> dict[str, Any]:
    """Rank ``BAD`` passes bad input to ``case``'s entry point (TP = ``tp``); what each rank
    saw."""
    bad = dist.get_rank() == BAD
    pgc = mg.initialize_model_parallel(2 if case == "tp_forward" else tp)
    try:
        return _run_case(case, bad, pgc, tp)
    finally:
        mg.destroy_model_parallel(pgc)


def _run_case(case: str, bad: bool, pgc: mg.ProcessGroupCollection, tp: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if case == "ddp":
        layout = _layout(tp)
        gpt = build_model(CFG, layout, pgc, init_full_weights(CFG, 0), torch.device("cpu"))
        before = _params(gpt)
        flag: Any = "yes" if bad else False
        out["error"] = _timed(
            lambda: DistributedDataParallel(
                layout.model_parallel_config(),
                layout.ddp_config(),
                gpt,
                disable_bucketing=flag,
                pg_collection=pgc,
            )
        )
        out["untouched"] = all(not hasattr(p, "main_grad") for p in gpt.parameters()) and all(
            torch.equal(a, b) for a, b in zip(before, _params(gpt), strict=True)
        )
        out["retry"] = _timed(lambda: apply_ddp(gpt, layout, pgc))[0]
        return out
    if case == "tp_forward":
        layer = ColumnParallelLinear(
            8,
            8,
            config=mg.ModelParallelConfig(
                tensor_model_parallel_size=2, use_cpu_initialization=True
            ),
            init_method=torch.nn.init.ones_,
            pg_collection=pgc,
        )
        bad_here = bad and mg.group_rank(pgc.require("world", "test")) == BAD
        x = torch.ones(2, 1, 6 if bad_here else 8)
        with mg.record_collectives() as log:
            out["error"] = _timed(lambda: layer(x))
        out["issued"] = [r.op for r in log]
        out["retry"] = _timed(lambda: layer(torch.ones(2, 1, 8)))[0]
        return out
    trainer = parallelize(
        CFG,
        _layout(tp),
        OptimizerConfig("adamw", 1e-3),
        pgc,
        init_full_weights(CFG, 0),
        torch.device("cpu"),
    )
    model, opt = trainer.model, trainer.optimizer
    _backward(model, pgc)
    if case == "finalize":
        tokens = torch.ones(1) if bad else None  # not a per-token loss: num_tokens is wrong
        # opt-in: a default finalize checks on each rank and exchanges nothing
        out["error"] = _timed(lambda: finalize_model_grads([model], tokens, pgc, peer_checks=True))
        out["retry"] = _timed(lambda: finalize_model_grads([model], None, pgc))[0]
        return out
    finalize_model_grads([model], None, pgc)
    if case == "step":
        opt.peer_checks = True  # opt-in: an unguarded step exchanges nothing by default
        before = _params(model)
        if bad:
            model.offload_grad_buffers()  # a step is refused with offloaded grads
        out["error"] = _timed(opt.step)
        out["untouched"] = all(
            torch.equal(a, b) for a, b in zip(before, _params(model), strict=True)
        )
        if bad:
            model.restore_grad_buffers()
        return out
    opt.step()
    state = {f"{n}": p.detach() for n, p in model.module.named_parameters()}
    prefix: Any = 3 if bad else "optimizer."
    out["error"] = _timed(lambda: opt.sharded_state_dict(state, is_loading=True, prefix=prefix))
    loaded = opt.sharded_state_dict(state, is_loading=True)
    out["load_error"] = _timed(lambda: opt.load_sharded_state_dict([] if bad else loaded))  # type: ignore[arg-type]
    out["retry"] = _timed(lambda: opt.load_sharded_state_dict(loaded))[0]
    return out


def _check(out: dict[str, Any], key: str, rank: int, where: str, peers: list[int]) -> None:
    kind, text, seconds = out[key]
    assert seconds < BOUND_S, (rank, key, seconds)
    if rank == BAD:
        assert kind in ("ValueError", "TypeError", "RuntimeError"), (kind, text)
    elif rank in peers:
        assert kind == "PeerCheckError", (rank, kind, text)
        assert f"{where} failed its checks on rank(s) [{BAD}]" in text, text
        assert f"rank {BAD}: " in text, text
    else:
        assert kind == "no error", (rank, kind, text)


@pytest.mark.parametrize(
    ("case", "where"),
    [
        ("ddp", "DistributedDataParallel"),
        ("finalize", "finalize_model_grads"),
        ("step", "ShardedOptimizer.step"),
        ("checkpoint", "ShardedOptimizer.sharded_state_dict"),
    ],
)
def test_bad_input_on_one_rank_of_two(rank_pools: RankPools, case: str, where: str) -> None:
    outs = rank_pools.get(2).run(_case, case)
    for rank, out in enumerate(outs):
        _check(out, "error", rank, where, [0])
        if case == "checkpoint":
            _check(out, "load_error", rank, "ShardedOptimizer.load_sharded_state_dict", [0])
        if "untouched" in out:
            assert out["untouched"], rank
        if "retry" in out:
            assert out["retry"] == "no error", (rank, out["retry"])
    # rank 1's own message reaches rank 0 word for word
    assert outs[BAD]["error"][1] in outs[0]["error"][1]


@pytest.mark.parametrize(
    ("case", "where"),
    [("ddp", "DistributedDataParallel"), ("finalize", "finalize_model_grads")],
)
def test_bad_input_on_one_rank_of_four_at_tp2_dp2(
    rank_pools: RankPools, case: str, where: str
) -> None:
    """Groups nest (TP [0, 1] [2, 3], DP [0, 2] [1, 3]): the exchange is over the world, so
    rank 1's TP peer, its DP peer and the rank it shares no group with all raise."""
    outs = rank_pools.get(4).run(_case, case, 2)
    for rank, out in enumerate(outs):
        _check(out, "error", rank, where, [0, 2, 3])
        assert out.get("untouched", True), rank
        assert out["retry"] == "no error", (rank, out["retry"])


@pytest.mark.parametrize("world", [2, 4])
def test_a_tp_layer_forward_with_bad_input_on_one_rank_fails_there_only(
    rank_pools: RankPools, world: int
) -> None:
    outs = rank_pools.get(world).run(_case, "tp_forward")
    for rank, out in enumerate(outs):
        # rank 1 only: its TP peer (rank 0) is not told, and ranks 2 and 3 run their forward
        _check(out, "error", rank, "", [])
        assert out["retry"] == "no error", (rank, out["retry"])
        assert out["issued"] == [], (rank, out["issued"])  # no collective of the forward
    assert "input_" in outs[BAD]["error"][1] or "6" in outs[BAD]["error"][1]
