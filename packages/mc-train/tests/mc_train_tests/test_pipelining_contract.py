"""The one place ``mc_train`` leans on ``torch.distributed.pipelining`` beyond its documented
API (:mod:`mc_train._pipelining`): ``MCStage`` overrides ``PipelineStage`` methods that the
schedules call but torch does not document as hooks. A torch upgrade that renames them,
changes their arguments or stops calling them must fail here, not turn into grads that are
never reduced (a ``last_backward`` that never comes) or reduced every micro-batch.

- Signatures (no world): the overridden methods exist on ``PipelineStage`` with the
  parameters ``MCStage`` passes on (shape inference's ``_forward_metadata_inference``
  among them: ``MCStage`` puts the stage's buffers and the RNG back after it).
- Calls (2 ranks, a small MLP of 4 blocks, 4 micro-batches, 2 steps, each offered
  schedule): per stage and step, ``forward_one_chunk`` and ``backward_one_chunk`` run M
  times, ``last_backward=True`` exactly once and on the last of them, and the P2P ops
  returned by the ``get_*_ops`` methods are those recorded (M per boundary and direction).
  The losses equal one process's on the whole batch within 1e-6 relative (fp32; the same
  sums split by micro-batch), so the grads the calls produce are the right ones. A
  stateful forward (a counter buffer, as a router's tokens per expert) counts exactly the
  M · steps training forwards: shape inference's extra forward is not one of them. A
  buffer autograd saves for backward (a rotary cache) survives that restore: shape
  inference's backward pass runs on the inference forward's graph after it.
- Refusals before anything is built (every rank the same error): a chunk already in DDP,
  a chunk without parameters (an empty stage), a chunk count the schedule does not run, a
  zero-bubble schedule, inferred shapes with gradient-accumulation fusion.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
from mc_groups.testing import RankPools
from mc_train import build_pipeline, decoder_stages, split_model

M, STEPS, BATCH = 4, 2, 8
OVERRIDDEN = {
    "forward_one_chunk": ["self", "fwd_chunk_id", "args", "kwargs", "save_forward_output"],
    "backward_one_chunk": ["self", "bwd_chunk_id", "loss", "full_backward", "last_backward"],
    "get_fwd_send_ops": ["self", "fwd_chunk_id"],
    "get_fwd_recv_ops": ["self", "fwd_chunk_id"],
    "get_bwd_send_ops": ["self", "bwd_chunk_id"],
    "get_bwd_recv_ops": ["self", "bwd_chunk_id"],
    "_forward_metadata_inference": ["self", "args", "kwargs", "has_backward"],
}


def test_overridden_methods_keep_their_signatures() -> None:
    from torch.distributed.pipelining import PipelineStage

    from mc_train._pipelining import MCStage

    for name, params in OVERRIDDEN.items():
        base = inspect.signature(getattr(PipelineStage, name))
        assert list(base.parameters) == params, (name, base)
        assert getattr(MCStage, name) is not getattr(PipelineStage, name), name


def test_shape_inference_puts_back_only_the_buffers_it_changed() -> None:
    """``MCStage._forward_metadata_inference`` around torch's (replaced here by a forward
    that counts into one buffer): the changed buffer gets its value back, an unchanged one
    keeps its version (autograd may have saved it), a meta buffer (a dry run: no values)
    is left alone instead of failing ``torch.equal``."""
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    from mc_train._pipelining import MCStage

    module = nn.Module()
    module.register_buffer("counts", torch.zeros(3))
    module.register_buffer("cache", torch.ones(4))
    module.register_buffer("meta", torch.zeros(2, device="meta"))
    version = module.get_buffer("cache")._version

    def inference(*_args: Any, **_kwargs: Any) -> str:
        module.get_buffer("counts").add_(1.0)
        return "metadata"

    stage = object.__new__(MCStage)  # only what the override reads
    stage.__dict__.update(submod=module, device=torch.device("cpu"))
    with mock.patch.object(PipelineStage, "_forward_metadata_inference", inference):
        assert stage._forward_metadata_inference(()) == "metadata"
    assert torch.equal(module.get_buffer("counts"), torch.zeros(3))
    assert module.get_buffer("cache")._version == version


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=gen), torch.randint(0, 5, (BATCH,), generator=gen)


def _losses(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


def _reference() -> list[float]:
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(float(loss.detach()))
    return out


def _spy(calls: list[tuple[int, str, bool]]) -> Any:
    from mc_train import _pipelining

    stage_cls = _pipelining.MCStage
    forward, backward = stage_cls.forward_one_chunk, stage_cls.backward_one_chunk

    def fwd(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((self.stage_index, "F", False))
        return forward(self, *args, **kwargs)

    def bwd(self: Any, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        last = kwargs.get("last_backward", args[2] if len(args) > 2 else False)
        calls.append((self.stage_index, "B", bool(last)))
        backward(self, bwd_chunk_id, *args, **kwargs)

    stage_cls.forward_one_chunk = fwd  # type: ignore[method-assign]
    stage_cls.backward_one_chunk = bwd  # type: ignore[method-assign]
    return stage_cls, forward, backward


def _count_forward(module: nn.Module, _args: Any, _output: Any) -> None:
    if module.training and torch.is_grad_enabled():  # as a router counts its tokens
        forwards = module.get_buffer("forwards")
        forwards += 1


def _scaled(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    # a buffer autograd saves for backward (as a rotary cache buffer is: torchtitan's)
    return output * module.get_buffer("scale")


def _run(schedule: str, vpp: int) -> dict[str, Any]:
    pgc = mg.initialize_model_parallel(1, 2)
    calls: list[tuple[int, str, bool]] = []
    stage_cls, forward, backward = _spy(calls)
    try:
        model = _MLP()
        chunks = split_model(model, decoder_stages(model, 2 * vpp), pgc)
        for linear in (m for c in chunks for m in c.modules() if isinstance(m, nn.Linear)):
            linear.register_buffer("forwards", torch.zeros(()))  # a stateful forward's state
            linear.register_forward_hook(_count_forward)
            linear.register_buffer("scale", torch.ones(()))
            linear.register_forward_hook(_scaled)
        pipe = build_pipeline(
            chunks,
            config=mg.ModelParallelConfig(),
            ddp_config=DistributedDataParallelConfig(),
            pg_collection=pgc,
            microbatches=M,
            loss_fn=_losses,
            schedule=schedule,
        )
        opt = ShardedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.5), pipe.chunks)
        steps, p2p = [], []
        for step in range(STEPS):
            calls.clear()
            with mg.record_collectives() as log:
                loss = pipe.forward_backward(*_data(step))
            opt.step()
            steps.append((loss, list(calls)))
            p2p.append([r.op for r in log if r.label in ("activation", "activation grad")])
        counts = {float(b) for c in pipe.chunks for n, b in c.named_buffers() if "forwards" in n}
        stages = [s.stage_index for s in pipe.stages]
        return {"steps": steps, "p2p": p2p, "stages": stages, "forwards": sorted(counts)}
    finally:
        stage_cls.forward_one_chunk, stage_cls.backward_one_chunk = forward, backward
        mg.destroy_model_parallel(pgc)


def _refusals() -> list[str]:
    pgc = mg.initialize_model_parallel(1, 2)
    cfg, ddp_cfg = mg.ModelParallelConfig(), DistributedDataParallelConfig()
    fused = SimpleNamespace(calculate_per_token_loss=False, gradient_accumulation_fusion=True)
    errors = []
    bad: list[tuple[list[nn.Module], str]] = [
        ([DistributedDataParallel(cfg, ddp_cfg, nn.Linear(4, 4), pg_collection=pgc)], "1f1b"),
        ([nn.ReLU()], "1f1b"),
        ([nn.Linear(4, 4)], "interleaved"),
        ([nn.Linear(4, 4)], "ZBVZeroBubble"),
        ([nn.Linear(4, 4)], "fusion"),
    ]
    try:
        for chunks, schedule in bad:
            try:
                build_pipeline(
                    chunks,
                    config=cfg if schedule != "fusion" else fused,
                    ddp_config=ddp_cfg,
                    pg_collection=pgc,
                    microbatches=M,
                    loss_fn=_losses,
                    schedule=schedule if schedule != "fusion" else "1f1b",
                )
            except (TypeError, ValueError) as err:
                errors.append(str(err))
    finally:
        mg.destroy_model_parallel(pgc)
    return errors


def run_contract() -> dict[str, Any]:
    """Runs on both ranks: every offered schedule, then the refusals."""
    torch.set_num_threads(1)
    runs = {name: _run(name, vpp) for name, vpp in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2))}
    return {"runs": runs, "refusals": _refusals()}


def test_schedules_call_the_overridden_methods_as_mc_needs(rank_pools: RankPools) -> None:
    per_rank = rank_pools.get(2).run(run_contract)
    ref = _reference()
    for rank, out in enumerate(per_rank):
        for name, run in out["runs"].items():
            stages = run["stages"]
            for step, (loss, calls) in enumerate(run["steps"]):
                assert abs(loss - ref[step]) <= 1e-6 * ref[step], (name, loss, ref)
                for stage in stages:
                    mine = [(kind, last) for s, kind, last in calls if s == stage]
                    backwards = [last for kind, last in mine if kind == "B"]
                    assert [kind for kind, _ in mine].count("F") == M, (name, stage, mine)
                    assert backwards == [False] * (M - 1) + [True], (name, stage, backwards)
            # pipelining's shape inference (a forward on stand-ins) leaves no trace
            assert run["forwards"] == [M * STEPS], (name, run["forwards"])
            boundaries = sum((s > 0) + (s < 2 * len(stages) - 1) for s in stages)
            for ops in run["p2p"]:
                assert ops.count("send") == ops.count("recv") == M * boundaries, (name, ops)
        first, empty, count, zero_bubble, fusion = out["refusals"]
        assert "chunks[0] is already a DistributedDataParallel" in first, rank
        assert "ReLU) has no trainable parameters: the split left this pipeline stage" in empty
        assert "schedule='interleaved' runs several chunks per rank (got 1)" in count
        assert "(ScheduleZBVZeroBubble) is not offered" in zero_bubble
        assert "gradient_accumulation_fusion=True needs stage_shapes" in fusion
