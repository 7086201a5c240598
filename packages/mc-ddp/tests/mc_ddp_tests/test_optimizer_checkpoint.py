"""ShardedOptimizer.sharded_state_dict through torch.distributed.checkpoint on 2 gloo ranks:
saved with the distributed optimizer (16-element buckets; fp32 params, and bf16 params
with fp32 grads and separate fp32 masters), loaded into fresh models with
other bucket layouts (200 elements, one bucket: each rank steps other slices of the params,
checked) and without the distributed optimizer (each rank steps every param whole).

Localizes the resharding of the optimizer state across data-parallel layouts (which flat
slice of which param each rank steps changes with the bucket size and the sharding) and
the load path (lr = 0 step to materialize AdamW's state, DCP writing into the pieces,
masters written back and published). Two steps after the load must give params
bit-identical (``torch.equal``) to the run that never stopped: only the data-parallel
layout changed, and with 2 ranks every reduction is the same ``a + b`` whichever collective
computes it, so the arithmetic is identical. Input errors are raised before any collective
(empty recorder).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer, ensure_params_ready
from mc_ddp_tests._catalogue import Expect, assert_fails_as
from mc_ddp_tests._harness import (
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools, error_kind

SAVED: dict[str, Any] = {
    "use_distributed_optimizer": True,
    "overlap_param_gather": True,
    "bucket_size": 16,
}
LOADING: list[dict[str, Any]] = [
    SAVED,
    {"use_distributed_optimizer": True, "bucket_size": 200},
    {"use_distributed_optimizer": True, "bucket_size": None},
    {"use_distributed_optimizer": False, "bucket_size": 64},
]


def _wrap(
    pgc: Any, fields: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Any, ShardedOptimizer]:
    cfg = ddp_config(overlap_grad_reduce=True, grad_reduce_in_fp32=True, **fields)
    model = mlp(dtype, seed=seed)
    ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
    inner = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    return ddp, ShardedOptimizer(inner, ddp)


def _train(ddp: Any, opt: ShardedOptimizer, steps: range) -> None:
    dtype = next(iter(ddp.parameters())).dtype
    for step in steps:
        x, y = global_batch(step, dist.get_world_size(), dtype)
        ddp.zero_grad_buffer()
        ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
        ddp.finish_grad_sync()
        opt.step()
    ensure_params_ready(list(ddp.parameters()))


def _model_sd(ddp: Any) -> dict[str, torch.Tensor]:
    return {f"model.{n}": p.detach() for n, p in ddp.module.named_parameters()}


def _params(ddp: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.module.parameters()]


def save_and_reload(path: str, dtype_name: str) -> dict[str, Any]:
    """Runs on each rank: uninterrupted 4 steps; 2 steps, save; per loading layout: load
    into a model from other weights, 2 more steps."""
    dtype = getattr(torch, dtype_name)
    with model_parallel() as pgc:
        ref, ref_opt = _wrap(pgc, SAVED, 1, dtype)
        _train(ref, ref_opt, range(4))
        ddp, opt = _wrap(pgc, SAVED, 1, dtype)
        _train(ddp, opt, range(2))
        model_sd = _model_sd(ddp)
        dcp_save({**model_sd, **opt.sharded_state_dict(model_sd)}, checkpoint_id=path)
        out: dict[str, Any] = {"same": [], "slices": []}
        for fields in LOADING:
            other, other_opt = _wrap(pgc, fields, 2, dtype)
            fresh = _params(other)
            other_sd = _model_sd(other)
            with mg.record_collectives() as log:
                state = {**other_sd, **other_opt.sharded_state_dict(other_sd, is_loading=True)}
            materialized = [torch.equal(a, b) for a, b in zip(fresh, _params(other), strict=True)]
            dcp_load(state, checkpoint_id=path)
            other_opt.load_sharded_state_dict(state)
            _train(other, other_opt, range(2, 4))
            out["same"].append(
                [torch.equal(a, b) for a, b in zip(_params(ref), _params(other), strict=True)]
                + materialized
                + [not log]
            )
            names = {p: n for n, p in other.module.named_parameters()}
            out["slices"].append([(names[o.param], o.start, o.end) for o in other_opt.owned_slices])
        return out


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_state_reshards_across_data_parallel_layouts(
    rank_pools: RankPools, tmp_path: Path, dtype_name: str
) -> None:
    results = rank_pools.get(2).run(save_and_reload, str(tmp_path / "ckpt"), dtype_name)
    for out in results:
        for fields, same in zip(LOADING, out["same"], strict=True):
            assert all(same), (fields, same)
    # every loading layout steps other slices than the saving one (index 0) on both ranks;
    # without the distributed optimizer, each rank steps the whole of all 6 params
    for out in results:
        for other in out["slices"][1:]:
            assert other != out["slices"][0]
        assert len(out["slices"][3]) == 6
        assert all(start == 0 for _, start, _ in out["slices"][3])


def _errors() -> dict[str, str]:
    found: dict[str, str] = {}
    with model_parallel() as pgc:
        ddp, opt = _wrap(pgc, SAVED, seed=1)
        model_sd = _model_sd(ddp)
        partial = {k: v for k, v in model_sd.items() if k != "model.2.weight"}
        fresh_ddp, fresh = _wrap(pgc, SAVED, seed=1)
        cases: dict[str, Callable[[], object]] = {
            "not_mapping": lambda: opt.sharded_state_dict([]),  # type: ignore[arg-type]
            "is_loading": lambda: opt.sharded_state_dict(model_sd, is_loading="yes"),  # type: ignore[arg-type]
            "prefix": lambda: opt.sharded_state_dict(model_sd, prefix=3),  # type: ignore[arg-type]
            "missing_param": lambda: opt.sharded_state_dict(partial, is_loading=True),
            "no_state": lambda: opt.sharded_state_dict(model_sd),
            "load_first": lambda: fresh.load_sharded_state_dict({}),
            "load_not_mapping": lambda: fresh.load_sharded_state_dict(5),  # type: ignore[arg-type]
        }
        with mg.record_collectives() as log:
            for name, call in cases.items():
                try:
                    call()
                except (TypeError, ValueError, RuntimeError) as err:
                    found[name] = f"{error_kind(err)}: {err}"
            fresh_sd = _model_sd(fresh_ddp)
            fresh.sharded_state_dict(fresh_sd, is_loading=True)
            try:
                fresh.load_sharded_state_dict({})
            except ValueError as err:
                found["load_missing_key"] = f"ValueError: {err}"
            loaded = fresh.sharded_state_dict(fresh_sd, is_loading=True)
            lr_before = fresh.param_groups[0]["lr"]
            try:
                fresh.load_sharded_state_dict({**loaded, "optimizer.param_groups.0.lr": None})
            except TypeError as err:
                found["load_wrong_kind"] = f"TypeError: {err}"
            found["lr_kept"] = str(fresh.param_groups[0]["lr"] == lr_before)
            master = fresh.owned_slices[0].master
            fresh.optimizer.state[master]["odd"] = torch.zeros(master.numel() + 1)
            try:
                fresh.sharded_state_dict(fresh_sd)
            except NotImplementedError as err:
                found["odd_state"] = f"NotImplementedError: {err}"
        found["collectives"] = str(len(log))
    return found


_SAVE = "`opt.sharded_state_dict(model_sd, ...)`"
_LOAD = "`opt.load_sharded_state_dict(sd)`"

ERRORS = {
    "not_mapping": Expect(
        "TypeError: model_sharded_state_dict must be a mapping",
        doc_call=_SAVE,
        doc_input="a list",
        also=("got list",),
    ),
    "is_loading": Expect(
        "TypeError: is_loading='yes' must be a bool",
        doc_call="`opt.sharded_state_dict(..., is_loading=)`",
        doc_input="`'yes'`",
    ),
    "prefix": Expect(
        "TypeError: prefix=3 must be a str",
        doc_call="`opt.sharded_state_dict(..., prefix=)`",
        doc_input="`3`",
        also=("'optimizer.'",),
    ),
    "missing_param": Expect(
        "ValueError: model_sharded_state_dict has no entry for param '2.weight' (shape (16, 16))",
        doc_call="`opt.sharded_state_dict(model_sd, is_loading=True)`",
        doc_input="a model state dict without one of the stepped params",
        also=("their live params",),
    ),
    "no_state": Expect(
        "RuntimeError: sharded_state_dict(): param '",
        doc_call=_SAVE,
        doc_input="before the first `step()` (call order)",
        also=("has no optimizer state yet", "is_loading=True"),
    ),
    "load_first": Expect(
        "RuntimeError: load_sharded_state_dict() before sharded_state_dict()",
        doc_call=_LOAD,
        doc_input="without a `sharded_state_dict()` call first (load before save; call order)",
        also=("is_loading=True",),
    ),
    "load_not_mapping": Expect(
        "TypeError: state_dict must be the mapping",
        doc_call=_LOAD,
        doc_input="`5`",
        also=("got int",),
    ),
    "load_missing_key": Expect(
        "ValueError: state_dict has no 'optimizer.param_groups.0.lr'",
        doc_call=_LOAD,
        doc_input="`{}` after `sharded_state_dict(..., is_loading=True)` (a key missing)",
        also=("the last sharded_state_dict() call returned",),
    ),
    "load_wrong_kind": Expect(
        "TypeError: state_dict['optimizer.param_groups.0.lr'] is None (NoneType) where the "
        "optimizer holds a float",
        doc_call=_LOAD,
        doc_input="a hyperparameter of another kind (`lr=None`; set silently before)",
        also=("does not fit this optimizer",),
    ),
    "odd_state": Expect(
        "NotImplementedError: optimizer state 'odd' of ",
        doc_call=_SAVE,
        doc_input="a state tensor neither scalar nor shaped like the master slice",
        also=("cannot be resharded elementwise",),
    ),
}


def test_bad_input_is_rejected_before_any_collective(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_errors):
        assert found["collectives"] == "0"
        assert found["is_loading"] == "TypeError: is_loading='yes' must be a bool"
        assert found["lr_kept"] == "True"  # checked before anything was written
        for name, expect in ERRORS.items():
            assert_fails_as(name, found[name], expect)
