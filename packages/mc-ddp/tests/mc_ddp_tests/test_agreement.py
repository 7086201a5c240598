"""DDP's agreement at construction (2 gloo ranks): ranks that will reduce gradients together
compare how they built their DistributedDataParallel, once, before anything is allocated.

Localizes the comparison, not the collectives: in each case exactly one rank (rank 1)
builds with one setting changed (a config field, a param shape or dtype, the per-token loss,
``disable_bucketing``, a caller's layout, an expert param); every rank must raise the same
``DataParallelAgreementError`` naming the field, each value and the ranks holding it, within
5 seconds (without the check these cases aborted inside gloo, hung until the group's timeout
or gave silently wrong gradients: ``docs/bad_inputs_sweep.md``), and nothing may have been
built (no ``main_grad`` on the params). Matching ranks exchange one 8-byte fingerprint per
group at construction (dense over dp_cp, expert over expt_dp), recorded by nothing, and none
per step. Exact string comparisons, no tolerance.
"""

from __future__ import annotations

import time
import warnings
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_buffers.layout import compute_full_param_layout
from mc_ddp import DataParallelAgreementError, DistributedDataParallel, ShardedOptimizer
from mc_ddp_tests._harness import (
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    mlp,
    model_parallel,
)
from mc_groups.comm import cross_rank
from mc_groups.testing import RankPools

MP = mg.ModelParallelConfig()


class _Experts(nn.Module):
    """A dense Linear(8, 16) then an expert Linear(16, 4) (``allreduce=False``)."""

    def __init__(self, expert_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(8, 16)
        self.expert = nn.Linear(16, 4).to(expert_dtype)
        for p in self.expert.parameters():
            p.allreduce = False  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.expert(torch.tanh(self.dense(x)).to(self.expert.weight.dtype))
        return out


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())


def _build(case: str, pgc: mg.ProcessGroupCollection) -> tuple[nn.Module, Any]:
    """(module, a zero-argument constructor) of ``case`` on this rank; rank 1 differs."""
    other = dist.get_rank() == 1
    config: Any = MP
    fields: dict[str, Any] = {}
    module: nn.Module = mlp()
    kwargs: dict[str, Any] = {}
    if case in ("bucket_size", "overlap_grad_reduce"):
        fields = {"overlap_grad_reduce": other or case == "bucket_size", "bucket_size": 16}
        if case == "bucket_size" and other:
            fields["bucket_size"] = 32
    elif case in ("use_distributed_optimizer", "check_for_nan_in_grad"):
        fields = {case: other}
    elif case == "grad_reduce_in_fp32":
        fields, module = {case: other}, mlp(torch.bfloat16)
    elif case == "hidden_size" and other:
        module = _wide_mlp()
    elif case == "param_dtype" and other:
        module = mlp(torch.bfloat16)
    elif case == "calculate_per_token_loss":
        config = mg.ModelParallelConfig(calculate_per_token_loss=other)
    elif case == "disable_bucketing":
        kwargs["disable_bucketing"] = other
    elif case == "layout_only":
        size = 64 if other else 16
        kwargs["full_param_layout"] = compute_full_param_layout(
            list(module.parameters()),
            size,
            2,
            use_distributed_optimizer=False,
            grad_reduce_in_fp32=False,
        )
    elif case == "expert_dtype":
        module = _Experts(torch.bfloat16 if other else torch.float32)
    elif case == "expert_count" and other:
        last: Any = module.get_submodule("4")
        last.bias.allreduce = False

    def construct() -> DistributedDataParallel:
        cfg = ddp_config(**fields)
        return DistributedDataParallel(config, cfg, module, pg_collection=pgc, **kwargs)

    return module, construct


CASES = (
    "bucket_size",
    "overlap_grad_reduce",
    "grad_reduce_in_fp32",
    "use_distributed_optimizer",
    "check_for_nan_in_grad",
    "hidden_size",
    "param_dtype",
    "calculate_per_token_loss",
    "disable_bucketing",
    "layout_only",
    "expert_dtype",
    "expert_count",
)


def _disagreements() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with model_parallel() as pgc:
        for case in CASES:
            module, construct = _build(case, pgc)
            start = time.monotonic()
            try:
                construct()
                message = "no error"
            except DataParallelAgreementError as err:
                message = str(err)
            out[case] = {
                "message": message,
                "seconds": time.monotonic() - start,
                "built": any(hasattr(p, "main_grad") for p in module.parameters()),
            }
    return out


_HEAD = "DistributedDataParallel: the ranks [0, 1] of group {group} were built differently"

EXPECTED: dict[str, tuple[str, ...]] = {
    "bucket_size": (
        "  ddp_config.bucket_size: 16 on rank(s) [0]; 32 on rank(s) [1]",
        "  bucket size (resolved): 16 on rank(s) [0]; 32 on rank(s) [1]",
        "  dense buffer layouts, entry #0: ",
    ),
    "overlap_grad_reduce": (
        "  ddp_config.overlap_grad_reduce: False on rank(s) [0]; True on rank(s) [1]",
        "  bucket size (resolved): None on rank(s) [0]; 16 on rank(s) [1]",
    ),
    "grad_reduce_in_fp32": (
        "  ddp_config.grad_reduce_in_fp32: False on rank(s) [0]; True on rank(s) [1]",
        "  dense buffers (param dtype -> grad dtype), entry #0: bfloat16 -> bfloat16 on "
        "rank(s) [0]; bfloat16 -> float32 on rank(s) [1]",
    ),
    "use_distributed_optimizer": (
        "  ddp_config.use_distributed_optimizer: False on rank(s) [0]; True on rank(s) [1]",
        "  dense buffer layouts, entry #0: 1 bucket(s), 484 elements (484 unpadded), layout ",
    ),
    "check_for_nan_in_grad": (
        "  ddp_config.check_for_nan_in_grad: False on rank(s) [0]; True on rank(s) [1]",
    ),
    "hidden_size": (
        "  dense params: 6 entries on rank(s) [0]; 4 entries on rank(s) [1]",
        "  dense buffer layouts, entry #0: 1 bucket(s), 484 elements (484 unpadded), layout ",
    ),
    "param_dtype": (
        "  dense params, entry #0: '0.weight' (16, 8) float32 on rank(s) [0]; '0.weight' "
        "(16, 8) bfloat16 on rank(s) [1]",
        "  dense buffers (param dtype -> grad dtype), entry #0: float32 -> float32 on "
        "rank(s) [0]; bfloat16 -> bfloat16 on rank(s) [1]",
    ),
    "calculate_per_token_loss": (
        "  config.calculate_per_token_loss: False on rank(s) [0]; True on rank(s) [1]",
    ),
    "disable_bucketing": ("  disable_bucketing: False on rank(s) [0]; True on rank(s) [1]",),
    "layout_only": ("  dense buffer layouts, entry #0: ",),
    "expert_dtype": (
        "  expert params, entry #0: 'expert.weight' (4, 16) float32 on rank(s) [0]; "
        "'expert.weight' (4, 16) bfloat16 on rank(s) [1]",
        "  expert buffers (param dtype -> grad dtype), entry #0: float32 -> float32 on "
        "rank(s) [0]; bfloat16 -> bfloat16 on rank(s) [1]",
    ),
    "expert_count": ("  expert params (count): 0 on rank(s) [0]; 1 on rank(s) [1]",),
}

ONLY: dict[str, int] = {  # cases where exactly these many fields differ
    "check_for_nan_in_grad": 1,
    "calculate_per_token_loss": 1,
    "disable_bucketing": 1,
    "layout_only": 1,
}


def test_every_rank_names_the_field_that_differs(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(_disagreements)
    for case in CASES:
        messages = [out[case]["message"] for out in results]
        assert messages[0] == messages[1], case  # the same error on every rank
        message = messages[0]
        group = "expt_dp" if case == "expert_dtype" else "dp_cp"
        assert message.startswith(_HEAD.format(group=group)), (case, message)
        lines = message.splitlines()
        for line in EXPECTED[case]:
            assert any(got.startswith(line) for got in lines), (case, line, message)
        if case in ONLY:
            differing = [got for got in lines if got.startswith("  ")]
            assert len(differing) == ONLY[case], (case, message)
        assert lines[-1].startswith("Build the DistributedDataParallel alike on every rank")
        for out in results:
            assert out[case]["seconds"] < 5.0, case
            assert not out[case]["built"], case  # refused before any buffer was made


def _agreeing() -> dict[str, Any]:
    calls: list[str] = []

    def counted(group: dist.ProcessGroup, where: str, *args: Any, **kwargs: Any) -> None:
        calls.append(where)
        cross_check(group, where, *args, **kwargs)

    cross_check = cross_rank.cross_check
    out: dict[str, Any] = {}
    patched = mock.patch.object(cross_rank, "cross_check", counted)
    with model_parallel() as pgc, patched, mock.patch.object(mg, "cross_check", counted):
        with mg.record_collectives() as log:
            cfg = ddp_config(overlap_grad_reduce=True, use_distributed_optimizer=True)
            ddp = DistributedDataParallel(MP, cfg, mlp(), pg_collection=pgc)
            experts = DistributedDataParallel(MP, ddp_config(), _Experts(), pg_collection=pgc)
        out["construction"] = (list(calls), len(log))
        calls.clear()
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        x, y = global_batch(0, dist.get_world_size(), torch.float32)
        rows = local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())
        for _ in range(2):
            ddp.zero_grad_buffer()
            ddp_backward(ddp, *rows, 2)
            ddp.finish_grad_sync()
            opt.step()
            experts.zero_grad_buffer()
            experts(rows[0]).sum().backward()
            experts.finish_grad_sync()
        out["steps"] = list(calls)
    return out


def test_matching_ranks_exchange_one_fingerprint_per_group_and_none_per_step(
    rank_pools: RankPools,
) -> None:
    for out in rank_pools.get(2).run(_agreeing):
        # each DDP: its checks over the world, then dense over dp_cp; the expert model also
        # expt_dp; nothing recorded; no exchange in the steps (the optimizer's defaults)
        labels = [
            f"DistributedDataParallel{over}"
            for over in ("", " over dp_cp", "", " over dp_cp", " over expt_dp")
        ]
        assert out["construction"] == (labels, 0)
        assert out["steps"] == []


# -- the params' values (issue 40 item 3) ---------------------------------------------------


class _ExpertShard(nn.Module):
    """A dense Linear(8, 16), the same on every rank (seed 0), then this rank's expert
    Linear(16, 4): at EP = 2 each rank holds another expert (seed 100 + EP rank)."""

    def __init__(self, ep_rank: int, tagged: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(8, 16)
        torch.manual_seed(100 + ep_rank)
        self.expert = nn.Linear(16, 4)
        if tagged:
            for p in self.expert.parameters():
                mg.param_attrs.mark_allreduce(p, False)


def _values() -> dict[str, str]:
    out: dict[str, str] = {}
    with model_parallel(expert_model_parallel_size=2) as pgc:
        ep_rank = mg.group_rank(pgc.require("ep", "test"))
        for case, tagged, check in (
            ("untagged", False, True),
            ("tagged", True, True),
            ("unchecked", False, False),
        ):
            module = _ExpertShard(ep_rank, tagged)
            try:
                DistributedDataParallel(
                    MP, ddp_config(), module, pg_collection=pgc, check_param_values=check
                )
                out[case] = "built"
            except DataParallelAgreementError as err:
                out[case] = str(err)
    return out


def test_a_param_that_differs_across_its_reduction_group_is_refused_by_name(
    rank_pools: RankPools,
) -> None:
    """2 ranks at EP = 2: ``dp_cp`` = {0, 1}, ``expt_dp`` = {r}. The expert Linear differs
    across the EP ranks by construction (another seed per rank). Untagged, it counts as
    dense and would be averaged over ``dp_cp`` with the other rank's expert: refused on
    both ranks, naming both of its params and the fix; tagged ``allreduce=False`` it is
    compared over ``expt_dp`` (one rank) and the dense Linear, equal by construction, over
    ``dp_cp``: built. ``check_param_values=False`` builds the untagged model (the caller
    vouches for it)."""
    outs = rank_pools.get(2).run(_values)
    assert outs[0]["untagged"] == outs[1]["untagged"]  # the same error on every rank
    message = outs[0]["untagged"]
    assert message.startswith(_HEAD.format(group="dp_cp")), message
    assert (
        "  the values of 2 param(s) differ across the ranks: 'expert.weight', 'expert.bias'"
        in message.splitlines()
    ), message
    assert "'dense." not in message  # the dense params are equal
    assert "mark_allreduce(param, False)" in message
    assert [(o["tagged"], o["unchecked"]) for o in outs] == [("built", "built")] * 2


def test_value_checksums_by_hand() -> None:
    """The checksum of bits ``b_i`` is ``(Σ b_i, Σ (i + 1) b_i) mod 2^64`` as 32 hex digits:
    int32 params [1, 2, 3] give (6, 1 + 4 + 9 = 14); a permutation of the same values has
    the same sum and another weighted sum; a param of one repeated value is ``constant``;
    meta params are not compared."""
    from mc_ddp._agreement import Checksum, value_checksums

    ints = nn.Parameter(torch.tensor([1, 2, 3], dtype=torch.int32), requires_grad=False)
    swapped = nn.Parameter(torch.tensor([3, 2, 1], dtype=torch.int32), requires_grad=False)
    meta = nn.Parameter(torch.empty(3, device="meta"))
    assert value_checksums([ints, swapped, meta]) == [
        Checksum(f"{6:016x}{14:016x}", False),
        Checksum(f"{6:016x}{3 + 4 + 3:016x}", False),
        None,
    ]
    ones = nn.Parameter(torch.full((2,), -1.0))  # bits 0xbf800000 as int32: negative
    word = (0xBF800000 - 2**32) % 2**64
    assert value_checksums([ones]) == [
        Checksum(f"{2 * word % 2**64:016x}{3 * word % 2**64:016x}", True)
    ]


def _per_rank_init() -> list[str]:
    """Every param initialised per rank (another seed per rank, as a model built without a
    common seed): built, with a warning naming the fix; no error."""
    with model_parallel() as pgc:
        torch.manual_seed(10 + dist.get_rank())
        module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DistributedDataParallel(MP, ddp_config(), module, pg_collection=pgc)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_model_initialised_per_rank_builds_with_a_warning(rank_pools: RankPools) -> None:
    """As Megatron's DDP (its own unit tests build models without a common seed; its
    ``data_parallel_random_init`` broadcasts after wrapping): when no param that is not
    constant agrees across the ranks (the LayerNorm's ones and zeros agree whatever the
    seed), differing values are a warning, not an error."""
    for messages in rank_pools.get(2).run(_per_rank_init):
        assert len(messages) == 1, messages
        assert messages[0].startswith(
            "DistributedDataParallel over dp_cp: the values of every param differ"
        )
        assert "broadcast_params()" in messages[0]
