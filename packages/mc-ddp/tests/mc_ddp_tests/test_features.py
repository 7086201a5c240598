"""The rest of DDP's surface on 2 gloo ranks, each against a reference or hand-derived values.

Localizes: params used twice (shared weight; reentrant checkpointing fires a param's hook
twice, so the learned ready counts matter), expert params in their own buffers, NaN/Inf and
large-grad checks before the collective, offload → restore, broadcast_params, fp32 local
accumulation, the fp32-accumulating reduce-scatter, force_all_reduce, per-token loss,
grad_added_to_main_grad, delay_wgrad_compute, bucket-size rules and disable_bucketing.

Tolerances: fp32 comparisons with the single-process reference use |Δ| ≤ 1e-6 (summation
order only, as in the parity matrix); values built from powers of two are exact (==).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import mc_groups as mg
from mc_buffers import ParamAndGradBuffer
from mc_ddp import DistributedDataParallel, NonFiniteGradError, partition_buckets
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp_tests._harness import (
    GATHER_OP,
    LOCAL_BATCH,
    SCATTER_OP,
    Reference,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    loss_fn,
    main_grad,
    max_grad_error,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools

MP = mg.ModelParallelConfig()


def _wrap(pgc: Any, model: nn.Module, **fields: Any) -> DistributedDataParallel:
    return DistributedDataParallel(MP, ddp_config(**fields), model, pg_collection=pgc)


def _step_grads(ddp: DistributedDataParallel, ref: Reference, step: int) -> float:
    """One iteration on both; the largest |main_grad − reference grad| on owned ranges."""
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    ddp.zero_grad_buffer()
    ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
    ddp.finish_grad_sync()
    return max_grad_error(ddp, ref.grads(x, y))


class _Twice(nn.Module):
    """``inner`` runs twice per forward: shared (one graph, one hook call per backward) or
    through two reentrant checkpoints (each recomputes and back-propagates on its own, so
    the param's hook fires twice per backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.reentrant = reentrant

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:
            x = x.requires_grad_(True)
            h = checkpoint(self._inner, x, use_reentrant=True)
            h = checkpoint(self._inner, h, use_reentrant=True)
        else:
            h = self._inner(self._inner(x))
        out: torch.Tensor = self.head(h)
        return out


def _param_used_twice() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        for reentrant in (False, True):
            model = _Twice(reentrant)
            ref = Reference(model, 0.1)
            ddp = _wrap(pgc, model, overlap_grad_reduce=True, bucket_size=8)
            errors = [_step_grads(ddp, ref, step) for step in range(3)]
            weight: Any = model.inner.weight
            inner = ddp.param_to_bucket_group[weight]
            out[f"reentrant={reentrant}"] = {
                "err": max(errors),
                "golden": inner.golden_per_param_grad_ready_counts[weight],
            }
    return out


def test_param_used_twice(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_param_used_twice):
        assert out["reentrant=False"] == {"err": out["reentrant=False"]["err"], "golden": 1}
        assert out["reentrant=True"]["golden"] == 2
        assert out["reentrant=False"]["err"] <= 1e-6
        assert out["reentrant=True"]["err"] <= 1e-6


def _expert_model() -> nn.Sequential:
    model = mlp()
    for param in model[2].parameters():
        param.allreduce = False  # type: ignore[attr-defined]
    return model


def _expert_params() -> dict[str, Any]:
    with model_parallel() as pgc:  # ep = 1: expt_dp is the 2-rank data-parallel group
        model = _expert_model()
        ref = Reference(model, 0.1)
        ddp = _wrap(pgc, model, overlap_grad_reduce=True, average_in_collective=True)
        errors = []
        with mg.record_collectives() as log:
            for step in range(2):
                errors.append(_step_grads(ddp, ref, step))
        return {
            "err": max(errors),
            "dense": len(ddp.buffers),
            "expert": len(ddp.expert_parallel_buffers),
            "expert_params": [len(g.params) for g in ddp.expert_parallel_bucket_groups],
            "labels": sorted({r.label for r in log}),
            "ops": sorted({str(r.reduce_op) for r in log}),
        }


def test_expert_params_get_their_own_buffer(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_expert_params):
        assert (out["dense"], out["expert"], out["expert_params"]) == (1, 1, [2])
        assert out["labels"] == [
            "grad reduce dense bucket group 0",
            "grad reduce expert bucket group 0",
        ]
        assert out["ops"] == ["avg"]
        assert out["err"] <= 1e-6


def _nan_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad * float("nan")


def _inf_hook(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, float("inf"))


# case → per rank: (param of the last layer to poison, hook) or None for a clean rank
_POISON = {
    "both_nan": (("bias", _nan_hook), ("weight", _nan_hook)),
    "one_inf": (None, ("weight", _inf_hook)),
}


def _non_finite(overlap: bool, case: str) -> dict[str, Any]:
    with model_parallel() as pgc:
        model = mlp()
        ddp = _wrap(
            pgc, model, overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=16
        )
        ref = Reference(model, 0.1)
        x, y = global_batch(0, dist.get_world_size(), torch.float32)
        x, y = local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())
        ddp_backward(ddp, x, y, 1)  # a clean first iteration learns the counts
        ddp.finish_grad_sync()
        ddp.zero_grad_buffer()
        poison = _POISON[case][dist.get_rank()]
        handle = None
        if poison is not None:
            handle = getattr(model[4], poison[0]).register_hook(poison[1])
        message = ""
        with mg.record_collectives() as log:
            try:
                ddp_backward(ddp, x, y, 1)
                ddp.finish_grad_sync()
            except NonFiniteGradError as err:
                message = str(err)
        if handle is not None:
            handle.remove()
        issued = [(r.op, r.label, r.numel) for r in log]
        # the DDP object stays usable: a clean step after zero_grad_buffer matches the
        # single-process reference
        error = _step_grads(ddp, ref, 1)
        return {"message": message, "issued": issued, "error": error}


def test_non_finite_grads_fail_every_rank_before_the_bucket_collective(
    rank_pools: RankPools,
) -> None:
    both = (
        "non-finite local gradients on rank(s) [0, 1]: rank 0: NaN in bucket 0, first bad "
        "param '4.bias' (shape (4,)); rank 1: NaN in bucket 0, first bad param '4.weight' "
        "(shape (4, 16)). Every data-parallel rank of this bucket group raises this error; "
        "nothing was reduced"
    )
    one = (
        "non-finite local gradients on rank(s) [1]: rank 1: Inf in bucket 0, first bad param "
        "'4.weight' (shape (4, 16)). Every data-parallel rank"
    )
    for overlap in (False, True):
        both_out = rank_pools.get(2).run(_non_finite, overlap, "both_nan")
        one_out = rank_pools.get(2).run(_non_finite, overlap, "one_inf")
        for rank in range(2):
            bad = "'4.bias' (shape (4,))" if rank == 0 else "'4.weight' (shape (4, 16))"
            assert both_out[rank]["message"] == (
                f"rank {rank}: NaN in the local gradients of dense bucket group 0, bucket 0, "
                f"before the data-parallel collective; first bad param: {bad}; {both}"
            )
        assert one_out[0]["message"].startswith(
            f"rank 0: dense bucket group 0 was not reduced: {one}"
        )
        assert one_out[1]["message"].startswith(
            "rank 1: Inf in the local gradients of dense bucket group 0, bucket 0, before the "
            f"data-parallel collective; first bad param: '4.weight' (shape (4, 16)); {one}"
        )
        for out in both_out + one_out:
            # only the 4-int64 agreement ran: no gradient was reduced anywhere
            assert out["issued"] == [("all_gather", "non-finite check dense bucket group 0", 4)]
            assert out["error"] <= 1e-6


def _large_grads() -> list[str]:
    with model_parallel() as pgc:
        ddp = _wrap(pgc, mlp(), check_for_large_grads=True)
        x, y = global_batch(0, dist.get_world_size(), torch.float32)
        x, y = local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for scale in (1.0, 1.0, 1000.0):
                ddp.zero_grad_buffer()
                torch.autograd.backward(loss_fn(ddp(x), y) * scale)
                ddp.finish_grad_sync()
        return [str(w.message) for w in caught]


def test_large_grads_warn(rank_pools: RankPools) -> None:
    for rank, messages in enumerate(rank_pools.get(2).run(_large_grads)):
        assert len(messages) == 1  # only the 1000× step
        assert messages[0].startswith(
            f"rank {rank}: unexpectedly large gradients in dense bucket group 0, bucket 0"
        )


def _offload_broadcast() -> dict[str, Any]:
    rank = dist.get_rank()
    with model_parallel() as pgc:
        model = mlp(seed=rank)  # different params per rank, made equal by broadcast_params
        rank0 = [p.detach().clone() for p in mlp(seed=0).parameters()]
        cfg = ddp_config(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc, check_param_values=False)
        with mg.record_collectives() as log:
            ddp.broadcast_params()
        broadcast = [(r.op, r.numel, r.group_ranks) for r in log]
        equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), rank0, strict=True))
        ref = Reference(model, 0.1)
        first = _step_grads(ddp, ref, 0)
        grad = ddp.buffers[0].grad_data
        views = [main_grad(p) for p in model.parameters()]
        ddp.zero_grad_buffer()
        ddp.offload_grad_buffers()
        freed = grad.untyped_storage().nbytes()
        ddp.restore_grad_buffers()
        params = model.parameters()
        same_views = all(main_grad(p) is v for p, v in zip(params, views, strict=True))
        zeroed = float(grad.abs().max())
        after = _step_grads(ddp, ref, 1)
        return {
            "broadcast": broadcast,
            "equal": equal,
            "first": first,
            "freed": freed,
            "restored": grad.untyped_storage().nbytes(),
            "same_views": same_views,
            "zeroed": zeroed,
            "after": after,
        }


def test_broadcast_then_offload_and_restore(rank_pools: RankPools) -> None:
    numels = [p.numel() for p in mlp().parameters()]
    for out in rank_pools.get(2).run(_offload_broadcast):
        assert out["broadcast"] == [("broadcast", n, (0, 1)) for n in numels]
        assert out["equal"]
        assert out["first"] <= 1e-6
        assert out["freed"] == 0
        assert out["restored"] > 0
        assert out["same_views"]
        assert out["zeroed"] == 0.0
        assert out["after"] <= 1e-6


class _Scalar(nn.Module):
    """One bf16 param p (4 elements) with loss c·Σp: the gradient is exactly c."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, c: float) -> torch.Tensor:
        return (self.p * c).sum()


def _local_accumulation() -> dict[str, Any]:
    """Three microbatches with grads 1, 2^-8, 2^-8: the exact sum 1 + 2^-7 is a bf16 number,
    but bf16 accumulation rounds 1 + 2^-8 back to 1 (a tie, to even) twice and ends at 1."""
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        for patterns in ([], ["p"]):
            model = _Scalar()
            ddp = _wrap(pgc, model, param_name_patterns_for_fp32_local_accumulation=patterns)
            for m, c in enumerate((1.0, 2.0**-8, 2.0**-8)):
                if m < 2:
                    with ddp.no_sync():
                        torch.autograd.backward(ddp(c))
                else:
                    torch.autograd.backward(ddp(c))
            ddp.finish_grad_sync()
            grad = main_grad(model.p)
            out[str(patterns)] = (
                grad.dtype,
                grad.tolist(),
                ddp.buffers[0].grad_data.tolist(),
            )
    return out


def test_fp32_local_accumulation(rank_pools: RankPools) -> None:
    exact = 1.0 + 2.0**-7  # both ranks hold it; SUM of the halves (scaled by 1/2) is exact
    for out in rank_pools.get(2).run(_local_accumulation):
        assert out["[]"] == (torch.bfloat16, [1.0] * 4, [1.0] * 4)
        assert out["['p']"] == (torch.float32, [exact] * 4, [exact] * 4)


def _fp32_reduce_scatter_and_force() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        for fields in (
            {"reduce_scatter_with_fp32_accumulation": True},
            {"overlap_grad_reduce": True, "bucket_size": 16},
            {},
        ):
            model = mlp()
            ref = Reference(model, 0.1)
            ddp = _wrap(pgc, model, use_distributed_optimizer=True, **fields)
            x, y = global_batch(0, dist.get_world_size(), torch.float32)
            rank = dist.get_rank()
            for _ in range(2):  # with overlap, the 2nd iteration dispatches from the hooks
                ddp.zero_grad_buffer()
                with mg.record_collectives() as log:
                    ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
                    ddp.finish_grad_sync(force_all_reduce=True)
            ref_grads = ref.grads(x, y)
            full = max(
                float((main_grad(p) - g).abs().max())
                for p, g in zip(model.parameters(), ref_grads, strict=True)
            )
            ops = [(r.op, r.label.rsplit(" bucket", 1)[0]) for r in log]
            out[str(sorted(fields))] = {"ops": ops, "full_err": full}
            if fields.get("reduce_scatter_with_fp32_accumulation"):
                ddp.zero_grad_buffer()
                with mg.record_collectives() as log:
                    ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
                    ddp.finish_grad_sync()
                out["fp32_rs"] = {
                    "ops": [(r.op, r.dtype) for r in log],
                    "err": max_grad_error(ddp, ref_grads),
                }
    return out


def test_force_all_reduce_and_fp32_accumulating_reduce_scatter(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_fp32_reduce_scatter_and_force):
        # force_all_reduce: every rank gets the full reduced grads, whichever path ran
        all_reduce = [("all_reduce", "grad reduce dense")]
        assert out["['reduce_scatter_with_fp32_accumulation']"]["ops"] == all_reduce
        # the hooks issued reduce-scatters; finish completes them with all-gathers
        assert out["['bucket_size', 'overlap_grad_reduce']"]["ops"] == (
            [(SCATTER_OP, "grad reduce dense")] * 5 + [(GATHER_OP, "grad gather dense")] * 5
        )
        assert out["[]"]["ops"] == all_reduce
        for key in out:
            if key != "fp32_rs":
                assert out[key]["full_err"] <= 1e-6, key
        assert out["fp32_rs"]["ops"] == [("all_to_all", torch.float32)]
        assert out["fp32_rs"]["err"] <= 1e-6


def _per_token_and_fusion() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        model = mlp()
        ref = Reference(model, 0.1)
        per_token = mg.ModelParallelConfig(calculate_per_token_loss=True)
        ddp = DistributedDataParallel(per_token, ddp_config(), model, pg_collection=pgc)
        x, y = global_batch(0, dist.get_world_size(), torch.float32)
        ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
        ddp.finish_grad_sync()
        # no 1/dp: main_grad is the SUM of the two ranks' mean-loss grads = 2 × global grad
        out["per_token_err"] = max(
            float((main_grad(p) - 2 * g).abs().max())
            for p, g in zip(model.parameters(), ref.grads(x, y), strict=True)
        )
        fused = mlp()
        wrapped = _wrap(pgc, fused)
        weight: Any = fused[4].weight
        main_grad(weight).fill_(3.0)  # a fused layer wrote its wgrad into main_grad
        weight.grad_added_to_main_grad = True
        torch.autograd.backward(wrapped(torch.ones(LOCAL_BATCH, 8)).sum())
        wrapped.finish_grad_sync()
        out["fused"] = main_grad(weight).unique().tolist()  # type: ignore[no-untyped-call]
        out["grad_dropped"] = weight.grad is None
        wrapped.zero_grad_buffer()
        out["flag_reset"] = weight.grad_added_to_main_grad
    return out


def test_per_token_loss_and_grad_added_to_main_grad(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_per_token_and_fusion):
        assert out["per_token_err"] <= 1e-6
        assert out["fused"] == [3.0]  # (3 + 3) / 2: the dummy autograd grad was not added
        assert out["grad_dropped"]
        assert out["flag_reset"] is False


class _DelayedLinear(nn.Linear):
    """Computes its weight gradient later (``backward_dw``) and then runs DDP's hooks."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.weight.skip_backward_post_hook = True  # type: ignore[attr-defined]
        self.hooks: list[Any] = []

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None:
        self.hooks.append(hook)

    def backward_dw(self) -> None:
        for hook in self.hooks:
            hook()


def _delayed_wgrad_and_buckets() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        torch.manual_seed(0)
        layer = _DelayedLinear()
        ddp = _wrap(pgc, layer, delay_wgrad_compute=True)
        torch.autograd.backward(ddp(torch.ones(2, 8)).sum())
        out["before_dw"] = (
            float(main_grad(layer.weight).abs().max()),
            layer.weight.grad is not None,
        )
        layer.backward_dw()
        ddp.finish_grad_sync()
        values = main_grad(layer.weight).unique().tolist()  # type: ignore[no-untyped-call]
        out["after_dw"] = (values, layer.weight.grad is None)

        out["default_size"] = _wrap(pgc, mlp(), overlap_grad_reduce=True).bucket_size
        out["num_buckets"] = _wrap(pgc, mlp(), overlap_grad_reduce=True, num_buckets=4).bucket_size
        out["no_overlap"] = _wrap(pgc, mlp(), bucket_size=16).bucket_size
        out["disabled"] = (
            _wrap(pgc, mlp(), overlap_grad_reduce=True, bucket_size=16).bucket_size,
            DistributedDataParallel(
                MP, ddp_config(overlap_grad_reduce=True, bucket_size=16), mlp(), True, pgc
            ).bucket_size,
        )
        mixed = mlp()
        mixed[4].to(torch.bfloat16)
        single = DistributedDataParallel(
            MP, ddp_config(), mixed, disable_bucketing=True, pg_collection=pgc
        )
        with mg.record_collectives() as log:
            single.finish_grad_sync()
        out["single_group"] = [(r.op, r.dtype, r.coalesced, r.label) for r in log]
        gc.collect()
    return out


def test_delay_wgrad_compute_and_bucket_rules(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_delayed_wgrad_and_buckets):
        assert out["before_dw"] == (0.0, True)  # AccumulateGrad did not reach DDP
        assert out["after_dw"] == ([2.0], True)  # ∂Σ(W·1 + b)/∂W = 2 per element, averaged
        assert out["default_size"] == 40_000_000  # max(40M, 1M × 2)
        assert out["num_buckets"] == 484 // 4
        assert out["no_overlap"] is None
        assert out["disabled"] == (16, None)
        # one batch per dtype (gloo), each of one bucket, so issued alone (not coalesced)
        label = "grad reduce dense bucket group 0"
        assert out["single_group"] == [
            ("all_reduce", torch.float32, False, label),
            ("all_reduce", torch.bfloat16, False, label),
        ]


def _pipeline_stage_one_bucket() -> list[int]:
    with model_parallel(pipeline_model_parallel_size=2) as pgc:
        ddp = _wrap(pgc, mlp(), overlap_grad_reduce=True, bucket_size=16)
        return [len(ddp.bucket_groups), ddp.bucket_size or 0]


def test_later_pipeline_stages_use_one_bucket(rank_pools: RankPools) -> None:
    assert rank_pools.get(2).run(_pipeline_stage_one_bucket) == [[5, 16], [1, 0]]


def _buffer(bucket_size: int) -> ParamAndGradBuffer:
    params = [nn.Parameter(torch.zeros(n)) for n in (40, 30, 20)]
    return ParamAndGradBuffer(params, bucket_size=bucket_size, gradient_scaling_factor=0.5)


def test_partition_buckets() -> None:
    # reverse order 20, 30, 40: a bucket closes at the param reaching 25 → [20 30] [40]
    buffers = [_buffer(25), _buffer(1000)]  # 2 buckets and 1 bucket
    assert [len(g) for g in partition_buckets(buffers)] == [1, 1, 1]
    assert [len(g) for g in partition_buckets(buffers, force_single_bucket_group=True)] == [3]
    assert partition_buckets([]) == []


def _coalesced_group() -> dict[str, Any]:
    world = dist.group.WORLD
    assert world is not None
    buffer = _buffer(25)
    group = ParamAndGradBucketGroup(buffer.buckets, ddp_config(), world, name="test group")
    buffer.grad_data.fill_(dist.get_rank() + 1)
    with mg.record_collectives() as log:
        group.finish_grad_sync()
    return {
        "records": [(r.op, r.numel, r.coalesced, r.label) for r in log],
        "values": buffer.grad_data.unique().tolist(),  # type: ignore[no-untyped-call]
    }


def test_several_buckets_of_one_group_go_in_one_coalesced_batch(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_coalesced_group):
        # buckets [20 30] and [40]; 0.5·1 + 0.5·2 = 1.5 everywhere
        assert out["records"] == [
            ("all_reduce", n, True, "grad reduce test group") for n in (50, 40)
        ]
        assert out["values"] == [1.5]
