"""vocab_parallel_cross_entropy against ``F.cross_entropy`` on the full logits.

Each rank gets its vocabulary slice of shared logits; losses (identical on every rank)
and the concatenated logit gradients must match ``F.cross_entropy(reduction="none")``,
with and without label smoothing, at TP = 1, 2 and 4. Tolerance 1e-5 relative to scale
(``_helpers``): TP splits the exp-sum into W partial sums, a reordering of fp32 adds.
Targets cover every rank's range, including the first and last class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, backward, chunk, ops, randn, world

S, B, V = 3, 2, 8


def _ce(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, dl: torch.Tensor
) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        r = pgc.require("tp", "test").rank()
        mine = chunk(logits, w, r, -1).requires_grad_()
        before = mine.detach().clone()
        with mg.record_collectives() as fwd:
            loss = tpl.vocab_parallel_cross_entropy(mine, target, smoothing, tp_group=pgc.tp)
        with mg.record_collectives() as bwd:
            backward(loss, dl)
        return {
            "loss": loss.detach(),
            "grad": mine.grad,
            "fwd": [(e.op, e.reduce_op) for e in fwd],
            "bwd": ops(bwd),
            "unchanged": torch.equal(mine.detach(), before),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_f_cross_entropy(rank_pools: RankPools, w: int, smoothing: float) -> None:
    logits = 3 * randn(S, B, V, seed=1)
    target = torch.tensor([[0, 7], [3, 4], [5, 1]])
    dl = randn(S, B, seed=2)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        full.reshape(-1, V), target.reshape(-1), reduction="none", label_smoothing=smoothing
    ).reshape(S, B)
    backward(ref, dl)
    assert full.grad is not None
    results = rank_pools.get(w).run(_ce, logits, target, smoothing, dl)
    for res in results:
        assert_close(res["loss"], ref, "per-token loss")
        assert res["unchanged"]
        assert res["fwd"] == ([("all_reduce", "max"), ("all_reduce", "sum")] if w > 1 else [])
        assert res["bwd"] == []
    assert_close(torch.cat([res["grad"] for res in results], dim=-1), full.grad, "logit grads")


def test_bad_arguments() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"target has shape \(3,\)"):
        tpl.vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"target holds torch\.float32"):
        tpl.vocab_parallel_cross_entropy(logits, torch.zeros(2))
    with pytest.raises(ValueError, match=r"label_smoothing=1\.0 must be in \[0, 1\)"):
        tpl.vocab_parallel_cross_entropy(logits, torch.zeros(2, dtype=torch.long), 1.0)


def _from_a_gathering_head(target: torch.Tensor) -> dict[str, Any]:
    """TP = 2: logits of a column-parallel head, gathered (``gather_output=True``) and then
    transposed, cast and scaled as a loss would, or split; and the same values handed in
    as a new tensor (no history: Megatron's own test passes one tensor to every rank)."""
    pgc = world(2)
    out: dict[str, Any] = {}
    try:
        tp = pgc.require("tp", "test")
        cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
        torch.manual_seed(0)
        head = tpl.ColumnParallelLinear(
            8, V, config=cfg, init_method=torch.nn.init.normal_, bias=False, pg_collection=pgc
        )
        hidden = randn(B, S, 8, seed=5)
        gathered = head(hidden, runtime_gather_output=True)[0]
        logits = (gathered.transpose(0, 1).double() / 0.7)[:, :]
        with mg.record_collectives() as log:
            try:
                tpl.vocab_parallel_cross_entropy(logits, target, tp_group=tp)
            except ValueError as err:
                out["gathered"] = (str(err), len(log))
        split = head(hidden)[0].transpose(0, 1)
        out["split"] = tpl.vocab_parallel_cross_entropy(split, target, tp_group=tp).detach()
        out["no_history"] = tpl.vocab_parallel_cross_entropy(
            gathered.detach().transpose(0, 1), target, tp_group=tp
        )
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_logits_from_a_gathering_head_are_refused(rank_pools: RankPools) -> None:
    """Megatron-LM #7452 row 2 without ``vocab_size``: logits that mc's all-gather along
    the vocabulary produced (through a transpose, a cast, a temperature and a slice) are a
    ValueError before any collective; the head's split output passes; a tensor without
    that history is taken as a slice (Megatron's semantics: the true loss + log(TP) for
    gathered values, as the trap shows)."""
    target = torch.tensor([[0, 7], [3, 4], [5, 1]])
    for out in rank_pools.get(2).run(_from_a_gathering_head, target):
        text, collectives = out["gathered"]
        assert text.startswith(
            "vocab_parallel_cross_entropy: vocab_parallel_logits come from an all-gather"
        ), text
        assert "loss + log(2)" in text
        assert collectives == 0
        assert out["split"].shape == (S, B)
        assert_close(out["no_history"] - out["split"], torch.full((S, B), math.log(2)), "trap")


def _gathered(logits: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """TP = 2: the full logits on both ranks (as a gathered head returns them), with and
    without ``vocab_size``; this rank's slice with it; the causal-LM loss likewise."""
    pgc = world(2)
    out: dict[str, Any] = {}
    try:
        tp = pgc.require("tp", "test")
        mine = chunk(logits, 2, tp.rank(), -1)
        out["silent"] = tpl.vocab_parallel_cross_entropy(logits, target, tp_group=tp)
        out["split"] = tpl.vocab_parallel_cross_entropy(mine, target, tp_group=tp, vocab_size=V)
        calls: dict[str, Callable[[], object]] = {
            "ce": lambda: tpl.vocab_parallel_cross_entropy(
                logits, target, tp_group=tp, vocab_size=V
            ),
            "causal": lambda: tpl.vocab_parallel_causal_lm_loss(
                logits.transpose(0, 1), target.transpose(0, 1), tp_group=tp, vocab_size=V
            ),
            "wrong_size": lambda: tpl.vocab_parallel_cross_entropy(
                mine, target, tp_group=tp, vocab_size=V + 2
            ),
        }
        for name, call in calls.items():
            with mg.record_collectives() as log:
                try:
                    call()
                except ValueError as err:
                    out[name] = (str(err), len(log))
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_gathered_logits_are_refused_when_the_vocabulary_size_is_known(
    rank_pools: RankPools,
) -> None:
    """Megatron-LM #7452 row 2: gathered logits give the true loss + log(TP) silently;
    with ``vocab_size`` the call refuses them before any collective."""
    logits = 3 * randn(S, B, V, seed=3)
    target = torch.tensor([[0, 7], [3, 4], [5, 1]])
    ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none")
    for out in rank_pools.get(2).run(_gathered, logits, target):
        assert_close(out["silent"], ref.reshape(S, B) + torch.log(torch.tensor(2.0)), "trap")
        assert_close(out["split"], ref.reshape(S, B), "split logits with vocab_size")
        for name in ("ce", "causal"):
            text, collectives = out[name]
            assert "the logits were gathered" in text, (name, text)
            assert "loss + log(2)" in text
            assert collectives == 0
        assert out["wrong_size"][0].startswith(
            "vocab_parallel_cross_entropy: the logits hold 4 classes on each of 2"
        )
