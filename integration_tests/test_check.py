"""``mc_train.check``: the layout check names what users get wrong, and passes what is right.

Each case runs the check as a user would (``check_layout``, or the command line on a module
outside the repository), with the set-ups of ``_check_setups.py`` imported by name in the
ranks. The one-process run is the check's own (``reference_run``): its losses are first held
to a plain PyTorch loop in this process (``test_reference_is_plain_pytorch``), then shared
by the Llama cases (2 steps: the first step's gradients and one more).

Right set-ups, every parameter equal: the HF 3D example's Llama at TP=2 × PP=2 × DP=2 with
SP; a ``transformers`` Qwen2 at TP=2 with SP; the demo's GPT (built from mc's layers) at
TP=2 × DP=2 with SP and the distributed optimizer.

Wrong set-ups, each named with its cause:

- a norm left unmarked under SP → its TP copies are partial sums (``partial sum over TP``);
- a plan that splits ``gate``/``up`` but not ``down_proj`` → refused in step 1, naming the
  module, its inputs and the fix (``'rowwise'``);
- a tied embedding with PP where the loop forgets finalize: entirely → refused by the
  optimizer step (grads not synced); with only DDP's sync → ``tied copies not summed``;
- logits gathered by the head fed to the vocabulary-parallel loss → the loss off by log(TP);
- a norm marked ``sum_gradients_across_tp_domain`` outside the split region (injected with
  the ``after_parallelize`` hook) → ``×2 (= TP)``.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from integration_tests import _check_setups as setups
from mc_groups.testing import RankPool, RankPools
from mc_train.check import LayoutReport, ReferenceRun, Workload, check_layout, reference_run
from mc_train.check.__main__ import main as check_main

pytest.importorskip("transformers", reason="the check's models are transformers models")

STEPS = 2


@pytest.fixture(scope="module")
def llama_ref(rank_pools: RankPools) -> ReferenceRun:
    """One process's run of the HF 3D Llama, shared by the Llama cases (8 rows)."""
    return reference_run(
        Workload(model="integration_tests._check_setups:llama", steps=STEPS),
        8,
        pool=rank_pools.get(1),
    )


def _llama(rank_pools: RankPools, ref: ReferenceRun, **kwargs: object) -> LayoutReport:
    world = int(kwargs.get("tp", 1)) * int(kwargs.get("pp", 1)) * int(kwargs.get("dp", 1))  # type: ignore[call-overload]
    return check_layout(
        setups.llama,
        steps=STEPS,
        reference=ref,
        pool=rank_pools.get(world),
        **kwargs,  # type: ignore[arg-type]
    )


def _verdicts(report: LayoutReport) -> dict[str, str]:
    return {f.name: f.verdict for f in report.params}


USER_MODULE = '''
"""A user's model outside mc's repository: a gain applied after a colwise layer."""
import torch
from torch import nn


class Tiny(nn.Module):
    tp_plan = {"up": "colwise", "down": "rowwise", "head": "colwise_gather_output"}

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 32)
        self.gain = nn.Parameter(torch.ones(1))  # replicated, applied to the split output
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.up(h)) * self.gain))


def build():
    torch.manual_seed(0)
    return Tiny()
'''


def test_command_line_on_a_user_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m mc_train.check mymodel:build --tp 2 --json`` (its ``main``, in this
    process) from a folder outside the repository: exit 1, the gain named as a partial sum
    over TP, the JSON written; a refused flag: exit 2 before any process starts."""
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(USER_MODULE), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # what ``python -m`` puts first: the cwd
    out = tmp_path / "report.json"
    assert check_main(["mymodel:build", "--tp", "2", "--steps", "1", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    result = json.loads(out.read_text(encoding="utf-8"))
    verdicts = {p["name"]: p["verdict"] for p in result["params"]}
    assert verdicts.pop("gain") == "partial sum over TP", result
    assert set(verdicts.values()) == {"equal"}, verdicts
    assert "replicated_with_grad_allreduce" in printed
    assert result["ok"] is False
    assert check_main(["mymodel:build", "--sp"]) == 2
    assert "sequence_parallel=True with tp=1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def failing_pool() -> Iterator[RankPool]:
    """2 ranks of its own for the set-ups that make a rank raise (a failed call restarts
    its pool; the shared one keeps its ranks, with ``transformers`` imported)."""
    with RankPool(2, failure_grace_s=0.5) as pool:  # both ranks raise at once in these cases
        yield pool


def test_plan_splits_what_the_forward_uses_whole(
    rank_pools: RankPools, failing_pool: RankPool
) -> None:
    """``up`` split, ``down`` left whole: refused in step 1's forward, with the module, its
    input and the fix named. (A plain-PyTorch model: a failed rank restarts its pool, which
    costs a second here and several with ``transformers`` in every rank.)"""
    report = check_layout(
        setups.tiny,
        tp=2,
        plan=setups.tiny_plan_without_down,
        steps=1,
        pool=failing_pool,
        reference_pool=rank_pools.get(1),
    )
    print(report.text())
    assert not report.ok
    assert not report.params
    first = report.failure[0]
    assert first.module == "layers.0.down", first
    assert first.phase == "step 1: forward and backward"
    assert first.inputs[0][-1] == 16  # 1/TP of the 32 features down expects
    assert first.plan_entries == ()
    assert "give it 'rowwise'" in first.cause
    assert "layers.0.down" in report.text()


def test_pp_without_finalize_is_refused(rank_pools: RankPools, failing_pool: RankPool) -> None:
    """A tied embedding with PP and a loop that skips ``finalize_model_grads``: the
    optimizer step refuses grads that were never synced, naming the fix."""
    report = check_layout(
        setups.tiny,
        pp=2,
        finalize=setups.skip_finalize,
        steps=1,
        pool=failing_pool,
        reference_pool=rank_pools.get(1),
    )
    print(report.text())
    assert not report.params
    assert report.failure[0].phase == "step 1: optimizer step"
    assert "finalize_model_grads" in report.failure[0].error


def test_gathered_logits_into_vocab_parallel_loss(
    rank_pools: RankPools, failing_pool: RankPool
) -> None:
    """The model's own plan gathers the logits (``colwise_gather_output`` head) and the
    loss reads them as vocabulary-parallel: ``vocab_parallel_cross_entropy`` refuses logits
    that mc's all-gather produced, on every rank, before any collective of the loss (issue
    41 item 3), and the report shows it (without that refusal the loss was off by log(TP):
    the loss note names that signature)."""
    report = check_layout(
        setups.tiny,
        tp=2,
        loss="vocab_parallel",
        steps=1,
        pool=failing_pool,
        reference_pool=rank_pools.get(1),
    )
    print(report.text())
    assert not report.params
    first = report.failure[0]
    assert first.phase == "step 1: forward and backward"
    assert "come from an all-gather along the vocabulary" in first.error
    assert "colwise_gather_output" in first.error


def test_reference_is_plain_pytorch(llama_ref: ReferenceRun) -> None:
    """The check's one-process run equals ``transformers``' own loss and ``torch.optim.SGD``
    in this process: losses, first-step gradients and final weights, bit for bit."""
    from mc_train.check._rank import global_batch

    model = setups.llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    work = llama_ref.workload
    assert work is not None
    losses = []
    for step in range(STEPS):
        ids = global_batch(work, step, 8, 64)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for name, param in model.named_parameters():
                assert param.grad is not None
                torch.testing.assert_close(param.grad, llama_ref.grad[name], rtol=1e-6, atol=1e-8)
        opt.step()
        losses.append(loss.item())
    assert losses == pytest.approx(llama_ref.losses, rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), llama_ref.final[name], rtol=1e-6, atol=1e-7)
    assert llama_ref.names["lm_head.weight"] == "model.embed_tokens.weight"  # tied


def test_hf_3d_example_every_param_equal(rank_pools: RankPools, llama_ref: ReferenceRun) -> None:
    """The HF 3D example's layout: TP=2 × PP=2 × DP=2, SP (``sequence_parallel_plan``)."""
    report = _llama(rank_pools, llama_ref, tp=2, pp=2, dp=2, sequence_parallel=True)
    assert report.ok, report.text()
    assert len(report.params) == 38
    assert max(f.error for f in report.params) < 1e-2  # the norms' fp32 floor, module notes
    assert report.losses == pytest.approx(llama_ref.losses, rel=1e-5)
    # One step's collectives by group, on the first rank of each stage (mc order: TP fastest)
    assert set(report.collectives) == {0, 4}
    for counts in report.collectives.values():
        kinds = {(c.op, c.group, c.label): c.count for c in counts}
        assert kinds["all_reduce", "pp=embd", "embedding grads"] == 1  # the tied table
        assert kinds["all_reduce", "tp", "non-tensor-parallel grads"] == 1  # SP norms
        dp_reductions = [n for (op, g, _), n in kinds.items() if (op, g) == ("all_reduce", "dp")]
        assert sum(dp_reductions) == 2  # the grads' bucket and the logged loss
    print(report.text())


def test_norm_unmarked_under_sp(rank_pools: RankPools, llama_ref: ReferenceRun) -> None:
    report = _llama(
        rank_pools, llama_ref, tp=2, sequence_parallel=True, plan=setups.sp_plan_without_norms
    )
    print(report.text())
    norms = {n for n in _verdicts(report) if "norm" in n}
    assert len(norms) == 9
    for name, verdict in _verdicts(report).items():
        assert verdict == ("partial sum over TP" if name in norms else "equal"), (name, verdict)
    cause = report.finding("model.norm.weight").cause
    assert "sequence_parallel" in cause
    assert "plan entry" in cause
    assert not report.ok


def test_tied_embedding_with_pp_finalize_skipped(
    rank_pools: RankPools, llama_ref: ReferenceRun
) -> None:
    """A loop that only waits for DDP (``finish_grad_sync``) leaves the tied copies
    unsummed, and the report says so (one that skips finalize entirely: refused, below)."""
    report = _llama(rank_pools, llama_ref, pp=2, finalize=setups.ddp_sync_only)
    print(report.text())
    tied = report.finding("model.embed_tokens.weight")
    assert tied.verdict == "tied copies not summed", tied
    assert tied.ranks == (0, 1)
    assert "embd" in tied.cause
    others = [f for f in report.params if f.name != tied.name]
    assert all(f.verdict in ("equal", "later steps differ") for f in others), report.text()


def test_injected_mark_doubles_a_replicated_grad(
    rank_pools: RankPools, llama_ref: ReferenceRun
) -> None:
    """The ``after_parallelize`` hook marks the final norm ``sum_gradients_across_tp_domain``
    though its grad is whole on every TP rank (no SP): ×2 = TP."""
    report = _llama(rank_pools, llama_ref, tp=2, after_parallelize=setups.mark_final_norm_summed)
    print(report.text())
    found = report.finding("model.norm.weight")
    assert found.verdict == "ratio", found
    assert found.ratio == pytest.approx(2.0, rel=1e-3)
    assert "= TP" in found.pattern
    assert "sum_gradients_across_tp_domain" in found.cause
    assert found.marks == ("sum_gradients_across_tp_domain",)


def test_fsdp2_and_fsdp2_with_the_marks_stripped(
    rank_pools: RankPools, llama_ref: ReferenceRun
) -> None:
    """TP=2 × FSDP2 DP=2 with SP (``mc_ddp.TorchFullyShardedDataParallel``): every
    parameter equal. With every param's attributes cleared after ``parallelize`` (what
    ``fully_shard`` did before mc recorded the marks, pytorch #136929): the split params
    come back in their TP shapes and the norms as partial sums over TP, each named."""
    layout = {"tp": 2, "dp": 2, "sequence_parallel": True, "data_parallel": "fsdp2"}
    report = _llama(rank_pools, llama_ref, **layout)
    assert report.ok, report.text()
    stripped = _llama(rank_pools, llama_ref, after_parallelize=setups.strip_marks, **layout)
    print(stripped.text())
    verdicts = _verdicts(stripped)
    norms = {n for n in verdicts if "norm" in n}
    assert {verdicts[n] for n in norms} == {"partial sum over TP"}
    assert {v for n, v in verdicts.items() if n not in norms} == {"shape differs"}
    assert "partition_dim" in stripped.finding("model.embed_tokens.weight").cause


def test_qwen2_every_param_equal(rank_pools: RankPools) -> None:
    report = check_layout(
        setups.qwen2,
        tp=2,
        sequence_parallel=True,
        steps=STEPS,
        pool=rank_pools.get(2),
        reference_pool=rank_pools.get(1),
    )
    assert report.ok, report.text()
    assert any(f.name.endswith("q_proj.bias") for f in report.params)


def test_demo_gpt_every_param_equal(rank_pools: RankPools) -> None:
    """A model built from mc's layers for the layout (``build(config, pg_collection)``)."""
    report = check_layout(
        setups.demo_gpt,
        tp=2,
        dp=2,
        sequence_parallel=True,
        distributed_optimizer=True,
        forward=setups.gpt_forward,
        sequence_first=True,
        steps=STEPS,
        pool=rank_pools.get(4),
        reference_pool=rank_pools.get(1),
    )
    assert report.ok, report.text()
    kinds = {(c.op, c.group, c.label) for c in report.collectives[0]}
    assert ("reduce_scatter", "dp", "grad reduce dense bucket group 0") in kinds


def test_moe_at_ep_and_an_untagged_expert(rank_pools: RankPools, failing_pool: RankPool) -> None:
    """A ``transformers`` Mixtral at EP = 2 (``mc_moe.parallelize`` with its ``ep_plan``):
    every parameter equal, under mc DDP and under the FSDP2 wrapper (``data_parallel=
    "fsdp2"``: the check asks FSDP2 to reduce-scatter unused expert params, as the wrapper
    requires; before, the check could not build it). With the experts' ``allreduce=False``
    tag stripped after
    ``parallelize`` (the hook), mc DDP refuses to build, naming each expert weight and the
    tag (the check's ``untagged expert param`` verdict covers DDP built with
    ``check_param_values=False``: ``test_check_compare.py``)."""
    ref = reference_run(Workload(model="integration_tests._check_setups:mixtral", steps=STEPS))
    report = check_layout(
        setups.mixtral, dp=2, expert_parallel=2, steps=STEPS, reference=ref, pool=rank_pools.get(2)
    )
    assert report.ok, report.text()
    kinds = {(c.op, c.group) for c in report.collectives[0]}
    assert ("all_to_all", "dp=ep") in kinds  # the token dispatch
    fsdp2 = check_layout(  # the wrapper (reduce_scatter_unused_params: the check sets it)
        setups.mixtral,
        dp=2,
        expert_parallel=2,
        data_parallel="fsdp2",
        steps=STEPS,
        reference=ref,
        pool=rank_pools.get(2),
    )
    assert fsdp2.ok, fsdp2.text()
    untagged = check_layout(
        setups.mixtral,
        dp=2,
        expert_parallel=2,
        after_parallelize=setups.untag_experts,
        steps=STEPS,
        reference=ref,
        pool=failing_pool,
    )
    print(untagged.text())
    assert not untagged.params
    first = untagged.failure[0]
    assert first.phase == "build_pipeline"
    for name in ref.before:
        assert (f"'{name}'" in first.error) == (".experts." in name), name
    assert "mark_allreduce(param, False)" in first.error
