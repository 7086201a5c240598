"""Targets and token ids outside the vocabulary: the same verdict at TP=1 and TP=2.

References: ``F.cross_entropy(reduction="none", ignore_index=, label_smoothing=)`` on the
full logits and ``F.embedding`` on the full table, one process. ``F.cross_entropy``
refuses a target outside ``[0, V)`` that is not its ``ignore_index`` (and ``F.embedding``
an id outside the table) with an error; mc refuses them too, at every TP size (before,
Megatron's arithmetic scored such a target as ``log Z`` and a TP=2 embedding mapped such an
id to zeros), with a ``ValueError`` naming the value, raised before any collective. With
``ignore_index`` the ignored positions get loss 0 and no gradient, as in torch; tolerance
as in ``_helpers`` (1e-5 relative).

The device-side variant of the check (an asynchronous device assert, used on CUDA) is run
on CPU through the same helper, where ``torch._assert_async`` raises at once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers.utils import _check_index_range as check_index_range
from mc_tp_layers_tests._helpers import assert_close, backward, chunk, config, randn, world

S, B, V, H = 3, 2, 8, 4
IGNORE = -100


def _losses(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, ignore: int | None
) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        mine = chunk(logits, w, pgc.require("tp", "test").rank(), -1).requires_grad_()
        loss = tpl.vocab_parallel_cross_entropy(
            mine, target, smoothing, tp_group=pgc.tp, ignore_index=ignore
        )
        backward(loss, torch.ones_like(loss))
        return {"loss": loss.detach(), "grad": mine.grad}
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [1, 2])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [IGNORE, 3])
def test_ignore_index_matches_f_cross_entropy(
    rank_pools: RankPools, w: int, smoothing: float, ignore: int
) -> None:
    logits = 3 * randn(S, B, V, seed=1)
    target = torch.tensor([[0, IGNORE], [3, 4], [IGNORE, 7]])
    if ignore != IGNORE:  # an ignored class inside the vocabulary, as torch allows
        target = target.masked_fill(target == IGNORE, 5)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        full.reshape(-1, V),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing,
        ignore_index=ignore,
    ).reshape(S, B)
    backward(ref, torch.ones_like(ref))
    assert full.grad is not None
    results = rank_pools.get(w).run(_losses, logits, target, smoothing, ignore)
    for res in results:
        assert_close(res["loss"], ref, "per-token loss")
    assert_close(torch.cat([r["grad"] for r in results], dim=-1), full.grad, "logit grads")
    ignored = target == ignore
    assert bool((full.grad[ignored] == 0).all())  # the reference's own rule, held above


def _verdict(fn: str, *args: Any) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        rank = pgc.require("tp", "test").rank()
        with mg.record_collectives() as log:
            try:
                if fn == "ce":
                    logits, target, ignore = args
                    tpl.vocab_parallel_cross_entropy(
                        chunk(logits, w, rank, -1), target, tp_group=pgc.tp, ignore_index=ignore
                    )
                else:
                    (ids,) = args
                    emb = tpl.VocabParallelEmbedding(
                        V, H, init_method=torch.nn.init.ones_, config=config(w), pg_collection=pgc
                    )
                    emb(ids)
                verdict = "no error"
            except ValueError as err:
                verdict = f"ValueError: {err}"
        return {"verdict": verdict, "log": len(log)}
    finally:
        mg.destroy_model_parallel(pgc)


TARGETS = {
    "torch's -100 without ignore_index": (
        torch.tensor([[0, IGNORE]]),
        None,
        (
            "target holds 1 class index(es) outside [0, 8): e.g. -100 at index (0, 1)",
            "pass ignore_index=<that value>",
        ),
    ),
    "V itself": (
        torch.tensor([[8, 1]]),
        None,
        ("target holds 1 class index(es) outside [0, 8): e.g. 8 at index (0, 0)",),
    ),
    "-1 with ignore_index=-100": (
        torch.tensor([[-1, IGNORE]]),
        IGNORE,
        ("target holds 1 class index(es) other than ignore_index=-100 outside [0, 8)",),
    ),
}


@pytest.mark.parametrize("case", list(TARGETS))
def test_targets_outside_the_vocabulary_are_refused_at_every_tp_size(
    rank_pools: RankPools, case: str
) -> None:
    target, ignore, words = TARGETS[case]
    logits = randn(1, 2, V, seed=3)
    nothing_ignored = -12345  # torch ignores -100 by default; mc's None ignores nothing
    with pytest.raises(IndexError):  # torch refuses them too
        F.cross_entropy(
            logits[0], target[0], ignore_index=nothing_ignored if ignore is None else ignore
        )
    verdicts = []
    for w in (1, 2):
        for out in rank_pools.get(w).run(_verdict, "ce", logits, target, ignore):
            assert out["log"] == 0  # raised before any collective
            verdicts.append(out["verdict"])
    assert len(set(verdicts)) == 1, verdicts  # the same message at TP = 1 and TP = 2
    for part in words:
        assert part in verdicts[0], f"{part!r} not in {verdicts[0]!r}"


@pytest.mark.parametrize("bad", [V, -1])
def test_ids_outside_the_table_are_refused_at_every_tp_size(
    rank_pools: RankPools, bad: int
) -> None:
    ids = torch.tensor([[0, bad, 3]])
    with pytest.raises(IndexError):  # F.embedding's verdict on the full table
        F.embedding(ids, torch.ones(V, H))
    verdicts = []
    for w in (1, 2):
        for out in rank_pools.get(w).run(_verdict, "emb", ids):
            assert out["log"] == 0
            verdicts.append(out["verdict"])
    assert len(set(verdicts)) == 1, verdicts
    assert verdicts[0].startswith(
        f"ValueError: input_ holds 1 token id(s) outside [0, {V}): e.g. {bad} at index (0, 1)"
    )
    assert "map unknown or padding tokens to an id inside it" in verdicts[0]


def _embed(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        emb = tpl.VocabParallelEmbedding(
            V,
            H,
            init_method=lambda t: t.copy_(table),
            config=config(w),
            pg_collection=pgc,
        )
        out: torch.Tensor = emb(ids).detach()
        return out
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [1, 2])
def test_ids_at_both_ends_of_the_table_embed_as_f_embedding(rank_pools: RankPools, w: int) -> None:
    table = randn(V, H, seed=5)
    ids = torch.tensor([[0, V - 1, V // 2], [V // 2 - 1, 1, V - 2]])
    for out in rank_pools.get(w).run(_embed, table, ids):
        assert torch.equal(out, F.embedding(ids, table))


def test_the_device_side_check_asserts_asynchronously() -> None:
    good = torch.tensor([0, 7, -100])
    check_index_range(good, 8, "target", "x", "fix", ignore=-100, on_device=True)
    with pytest.raises(RuntimeError, match=r"target holds x outside \[0, 8\) \(device-side"):
        check_index_range(torch.tensor([0, 8]), 8, "target", "x", "fix", on_device=True)
