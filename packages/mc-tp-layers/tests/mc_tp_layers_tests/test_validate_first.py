"""Validate, then mutate; and the same call is judged the same at every group size.

A public function that refuses its arguments must leave everything as it was: the
deferral buffers of ``drain_embedding_wgrad_compute`` (which used to pop pairs before
failing, losing them), an RNG tracker's streams, the device generator and the default
tracker of ``model_parallel_cuda_manual_seed``, a weight's TP tags. And a wrong argument
that a group of one rank never needed to read (split sizes, a flag) is refused at TP=1
exactly as at TP=2, so a script that passes on one rank does not fail on the real group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers.layers import _initialize_affine_weight_cpu
from mc_tp_layers.linear import (
    drain_embedding_wgrad_compute,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from mc_tp_layers.random import clear_cuda_rng_tracker
from mc_tp_layers_tests._helpers import config, world


def _drain(sequence_parallel: bool) -> dict[str, Any]:
    pgc = world(2)
    try:
        weight = torch.ones(2, 8)
        weight.main_grad = torch.zeros(2, 8)  # type: ignore[attr-defined]
        if sequence_parallel:  # each activation holds this rank's rows: 2 × 2 ranks = 4
            activations = [torch.ones(2, 8), torch.ones(3, 8)]
        else:
            activations = [torch.ones(4, 8), torch.ones(4, 7)]
        grads = [torch.ones(4, 2), torch.ones(4, 2)]
        kept = (list(activations), list(grads))
        cfg = config(2, sequence_parallel=sequence_parallel)
        with mg.record_collectives() as log:
            try:
                drain_embedding_wgrad_compute(cfg, activations, grads, weight, pgc.tp)
                error = "no error"
            except ValueError as err:
                error = str(err)
        return {
            "error": error,
            "kept": (activations, grads) == kept,  # same tensors, same order: nothing popped
            "log": len(log),
            "untouched": not weight.main_grad.any(),  # type: ignore[attr-defined]
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(
    ("sequence_parallel", "start"),
    [
        (False, "embedding_activation_buffer[1] is torch.float32 of shape (4, 7)"),
        (True, "pair 1: the activation has 3 rows (× 2 ranks under sequence parallelism)"),
    ],
)
def test_a_refused_drain_keeps_every_pair_and_communicates_nothing(
    rank_pools: RankPools, sequence_parallel: bool, start: str
) -> None:
    for out in rank_pools.get(2).run(_drain, sequence_parallel):
        assert out["error"].startswith(start), out["error"]
        assert out["kept"]
        assert out["log"] == 0
        assert out["untouched"]


def test_set_states_refused_keeps_the_streams() -> None:
    tracker = tpl.RNGStatesTracker("cpu")
    tracker.add("a", 1)
    before = tracker.get_states()
    good = before["a"]
    with pytest.raises(TypeError, match="states holds the key 3; stream names must be"):
        tracker.set_states({"a": good, 3: good})  # type: ignore[dict-item]
    after = tracker.get_states()
    assert list(after) == ["a"]
    assert torch.equal(after["a"], before["a"])


def test_a_refused_seed_changes_no_generator_and_no_default() -> None:
    clear_cuda_rng_tracker()
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"gtp_remat_rank=2 is outside its axis of 2 rank"):
        tpl.model_parallel_cuda_manual_seed(
            7, gtp_remat_rank=2, gtp_remat_world_size=2, device="cpu"
        )
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(RuntimeError, match="no default RNG tracker"):
        tpl.get_cuda_rng_tracker()


def test_a_refused_cpu_init_leaves_the_weight_untagged() -> None:
    weight = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"per_partition_size=3 × world_size=2 must equal"):
        _initialize_affine_weight_cpu(weight, 4, 8, 3, 0, torch.nn.init.ones_, rank=0, world_size=2)
    assert not hasattr(weight, "tensor_model_parallel")
    assert not weight.any()


def _loose(value: object) -> Any:
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


CALLS: dict[str, tuple[Callable[[dist.ProcessGroup], object], str, str]] = {
    "split sizes for three ranks": (
        lambda g: scatter_to_sequence_parallel_region(torch.ones(4, 2), g, split_sizes=[1, 1, 2]),
        "ValueError",
        "split_sizes=[1, 1, 2] must hold one non-negative int per rank",
    ),
    "a flag that is not a bool": (
        lambda g: gather_from_sequence_parallel_region(torch.ones(2, 2), _loose("no"), g),
        "TypeError",
        "tensor_parallel_output_grad='no' must be a bool",
    ),
    "sizes that do not add up": (
        lambda g: reduce_scatter_to_sequence_parallel_region(
            torch.ones(4, 2), g, input_split_sizes=[5] * g.size()
        ),
        "ValueError",
        "sum to",
    ),
    "split sizes as a string": (
        lambda g: all_to_all(g, torch.ones(2, 2), output_split_sizes_=_loose("2")),
        "TypeError",
        "output_split_sizes_='2' must be a list of ints",
    ),
}


def _judge(tp: int, case: str) -> tuple[str, str, int]:
    pgc = world(tp)
    try:
        with mg.record_collectives() as log:
            try:
                CALLS[case][0](pgc.require("tp", "test"))
                return "no error", "", len(log)
            except (TypeError, ValueError) as err:
                return error_kind(err), str(err), len(log)
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("case", list(CALLS))
def test_the_same_call_is_judged_the_same_at_tp1_and_tp2(rank_pools: RankPools, case: str) -> None:
    _, kind, fragment = CALLS[case]
    for tp in (1, 2):
        for error, message, logged in rank_pools.get(2).run(_judge, tp, case):
            assert (error, logged) == (kind, 0), (tp, message)
            assert fragment in message, (tp, message)


def _after_destroy() -> list[str]:
    pgc = world(1)
    layers: list[Any] = [
        tpl.ColumnParallelLinear(
            4, 2, config=config(1), init_method=torch.nn.init.ones_, pg_collection=pgc
        ),
        tpl.VocabParallelEmbedding(
            4, 2, init_method=torch.nn.init.ones_, config=config(1), pg_collection=pgc
        ),
    ]
    inputs = [torch.ones(1, 4), torch.zeros(1, 2, dtype=torch.long)]
    mg.destroy_model_parallel(pgc)
    errors = []
    for layer, x in zip(layers, inputs, strict=True):
        try:
            layer(x)
            errors.append("no error")
        except RuntimeError as err:
            errors.append(str(err))
    return errors


def test_a_layer_used_after_destroy_model_parallel_says_so(rank_pools: RankPools) -> None:
    """At TP=1 nothing is communicated, so the forward used to run on a destroyed group."""
    for errors in rank_pools.get(2).run(_after_destroy):
        for what, error in zip(
            ("ColumnParallelLinear", "VocabParallelEmbedding"), errors, strict=True
        ):
            assert error.startswith(
                f"{what}'s tp_group (a process group of 1 rank(s)) was destroyed"
            )


def _absurd() -> str:
    pgc = world(1)
    try:
        tpl.ColumnParallelLinear(
            4, 2**62, config=config(1), init_method=torch.nn.init.ones_, pg_collection=pgc
        )
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        mg.destroy_model_parallel(pgc)


def test_absurd_sizes_name_the_layer_and_the_bytes(rank_pools: RankPools) -> None:
    """2**62 rows overflow torch's storage size at once: no memory is touched."""
    for error in rank_pools.get(2).run(_absurd):
        assert error.startswith(
            "ColumnParallelLinear(input_size=4, output_size=4611686018427387904) cannot "
            "allocate a [4611686018427387904, 4] torch.float32 tensor ("
        )
        assert "check the sizes" in error


def _offloaded_main_grad() -> str:
    pgc = world(2)
    try:
        weight = torch.nn.Parameter(torch.ones(3, 4))
        weight.main_grad = torch.zeros(3, 4)  # type: ignore[attr-defined]
        weight.main_grad.untyped_storage().resize_(0)  # type: ignore[attr-defined]
        with mg.record_collectives() as log:
            try:
                linear_with_grad_accumulation_and_async_allreduce(
                    torch.ones(2, 4), weight, None, True, False, False, tp_group=pgc.tp
                )
            except RuntimeError as err:
                return f"{err} | collectives: {len(log)}"
        return "no error"
    finally:
        mg.destroy_model_parallel(pgc)


def test_fused_wgrad_into_an_offloaded_main_grad_is_refused(rank_pools: RankPools) -> None:
    """A weight whose ``main_grad`` lost its storage (the grad buffer offloaded with
    ``offload_grad_buffers()``: ``untyped_storage().resize_(0)``) is refused before the
    forward, not written through a freed pointer by the fused wgrad kernel in backward."""
    for message in rank_pools.get(2).run(_offloaded_main_grad):
        assert "has no storage" in message
        assert "restore_grad_buffers()" in message
        assert message.endswith("collectives: 0")
