"""``mc_train.check``'s reading of two runs, on numbers made by hand (no ranks).

Each case builds one process's run and the ranks' runs of a one-parameter model from
gradients chosen to show one pattern (SGD, lr 0.5: a rank's weight after step 1 is
``w₀ − 0.5·g``), and checks the verdict the comparison gives it.
"""

from __future__ import annotations

import math

import pytest
import torch

from mc_tp_layers.shards import split_full
from mc_train.check import Layout
from mc_train.check._compare import compare_params, loss_note
from mc_train.check._rank import ParamRecord, RankRun, ReferenceRun

LR = 0.5
W0 = torch.linspace(-1.0, 1.0, 24).reshape(4, 6)
G = torch.linspace(0.5, 2.0, 24).reshape(4, 6)  # one process's gradient


def _ref(grad: torch.Tensor = G) -> ReferenceRun:
    w1 = W0 - LR * grad
    names = {"w": "w", "alias": "w"}
    return ReferenceRun([1.0], names, {"w": W0}, {"w": grad}, {"w": w1}, {"w": w1}, 8, None, (8, 4))


def _run(rank: int, coords: tuple[int, int, int], grad: torch.Tensor, **kw: object) -> RankRun:
    split = kw.get("split")
    marks = kw.get("marks", ())
    name = str(kw.get("name", "w"))
    before = kw.get("before", W0)
    assert isinstance(before, torch.Tensor)
    w1 = before - LR * grad
    record = ParamRecord(split, marks, before, w1, w1)  # type: ignore[arg-type]
    return RankRun(rank, coords, [coords[2]], {name: record}, [1.0], [])


def _verdict(
    runs: list[RankRun], layout: Layout, ref: ReferenceRun | None = None
) -> tuple[str, str, str]:
    found, extra = compare_params(ref or _ref(), runs, layout, LR, 1e-4, forward_differs=False)
    assert extra == []
    (f,) = found
    return f.verdict, f.pattern, f.cause


def test_equal_within_the_fp32_floor_and_not_beyond() -> None:
    """A gradient recovered from fp32 weights is off by up to ε·|w|/lr: equal; 1e-3 off: not."""
    layout = Layout(dp=2)
    noisy = G + 1e-7  # below 8·ε·‖w₀‖/lr
    assert _verdict([_run(0, (0, 0, 0), G), _run(1, (0, 1, 0), noisy)], layout)[0] == "equal"
    off = G * (1 + 1e-3)
    verdict, pattern, _ = _verdict([_run(0, (0, 0, 0), off), _run(1, (0, 1, 0), off)], layout)
    assert verdict == "ratio"
    assert pattern.startswith("×1.001")


def test_ratio_named_by_the_layout_and_the_marks() -> None:
    layout = Layout(tp=2, dp=3)
    runs = [
        _run(r, (r % 2, r // 2, 0), 2 * G, marks=("sum_gradients_across_tp_domain",))
        for r in range(6)
    ]
    verdict, pattern, cause = _verdict(runs, layout)
    assert verdict == "ratio"
    assert pattern.startswith("×2 (= TP")  # one param: also the loss scale (micro-batches)
    assert "carries sum_gradients_across_tp_domain" in cause
    runs = [_run(r, (r % 2, r // 2, 0), G / 3) for r in range(6)]
    assert _verdict(runs, layout)[1].startswith("×0.3333 (= 1/DP")


def test_partial_sum_over_tp() -> None:
    """Each TP rank holds its part of a replicated param's gradient (a norm under SP)."""
    parts = [0.25 * G, 0.75 * G]
    runs = [_run(t, (t, 0, 0), parts[t]) for t in range(2)]
    verdict, _, cause = _verdict(runs, Layout(tp=2, sequence_parallel=True))
    assert verdict == "partial sum over TP"
    assert "'sequence_parallel'" in cause
    verdict, _, cause = _verdict(runs, Layout(tp=2))
    assert "replicated_with_grad_allreduce" in cause
    marked = [_run(t, (t, 0, 0), parts[t], marks=("sequence_parallel",)) for t in range(2)]
    assert "ignores the mark" in _verdict(marked, Layout(tp=2))[2]


def test_tied_copies_not_summed() -> None:
    """The embedding (stage 0, name ``w``) and the head (stage 1, its alias) each hold
    their use's gradient."""
    runs = [_run(0, (0, 0, 0), 0.4 * G), _run(1, (0, 0, 1), 0.6 * G, name="alias")]
    verdict, _, cause = _verdict(runs, Layout(pp=2))
    assert verdict == "tied copies not summed"
    assert "embd" in cause


def test_dp_replicas_differ() -> None:
    """Each DP rank applied its own rows' gradient (one process: their mean)."""
    runs = [_run(0, (0, 0, 0), 0.5 * G), _run(1, (0, 1, 0), 1.5 * G)]
    assert _verdict(runs, Layout(dp=2))[0] == "DP replicas differ"


def test_some_tp_slices_differ() -> None:
    """A split param (dim 0, stride 2) whose TP rank 1 slice is doubled."""
    bad = G.clone()
    bad[[1, 3]] *= 2  # rank 1's rows of 4 with stride 2: blocks r and r + W
    assert torch.equal(split_full(bad, 0, 1, 2, 2), 2 * split_full(G, 0, 1, 2, 2))
    runs = [_run(t, (t, 0, 0), bad, split=(0, 2)) for t in range(2)]
    verdict, pattern, _ = _verdict(runs, Layout(tp=2))
    assert verdict == "some TP slices differ"
    assert pattern == "only the slices of TP rank(s) [1] differ"


def test_never_updated_and_before_training() -> None:
    runs = [_run(0, (0, 0, 0), torch.zeros_like(G))]
    assert _verdict(runs, Layout())[0] == "never updated"
    runs = [_run(0, (0, 0, 0), G, before=W0 + 0.1)]
    verdict, _, cause = _verdict(runs, Layout())
    assert verdict == "differs before training"
    assert "seed" in cause


def test_untagged_expert_param() -> None:
    """An experts module's param (by structure) without ``allreduce=False`` under EP: DDP
    averaged it with other experts' gradients (a DDP built with check_param_values=False)."""
    marks = ("in an experts module",)
    runs = [_run(r, (0, r, 0), (0.5 + r) * G, marks=marks) for r in range(2)]
    verdict, _, cause = _verdict(runs, Layout(dp=2, expert_parallel=2))
    assert verdict == "untagged expert param"
    assert "allreduce=False" in cause
    tagged = [_run(r, (0, r, 0), G, marks=(*marks, "expert (allreduce=False)")) for r in range(2)]
    assert _verdict(tagged, Layout(dp=2, expert_parallel=2))[0] == "equal"


def test_loss_note_names_gathered_logits() -> None:
    layout = Layout(tp=4)
    assert loss_note([2.0, 1.9], [2.0, 1.9], layout, 1e-5) == ""
    note = loss_note([2.0 + math.log(4), 2.0], [2.0, 1.9], layout, 1e-5)
    assert "log(TP)" in note
    assert "colwise_gather_output" in note
    assert "later update" in loss_note([2.0, 2.5], [2.0, 1.9], layout, 1e-5)


def test_shape_differs() -> None:
    """A split param gathered as if whole (its marks lost) comes back in its shard's shape."""
    run = _run(0, (0, 0, 0), G[:2], before=W0[:2])
    verdict, pattern, cause = _verdict([run], Layout(tp=2))
    assert verdict == "shape differs"
    assert "(2, 6)" in pattern
    assert "partition_dim" in cause


def test_missing_and_extra_names() -> None:
    run = _run(0, (0, 0, 0), G, name="other")
    found, extra = compare_params(_ref(), [run], Layout(), LR, 1e-4, forward_differs=False)
    assert [f.verdict for f in found] == ["missing"]
    assert extra == ["other (rank 0)"]


@pytest.mark.parametrize("bad", [{"tp": 0}, {"sequence_parallel": True}, {"loss": "mean"}])
def test_layout_refuses_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        Layout(**bad)  # type: ignore[arg-type]
