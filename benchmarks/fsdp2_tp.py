"""FSDP2 + mc's tensor parallelism against FSDP2 + torch DTensor TP (torchtitan's layout) on
the same ``transformers`` Llama, TP = 2 × FSDP DP = 2 on 4 gloo ranks, SP off and on.

One training step, the same weights (same seed) and global batch for both variants:

- ``mc``: ``parallelize(model, sequence_parallel_plan(model))`` then
  ``mc_ddp.TorchFullyShardedDataParallel`` (each layer, the embedding, the head and the root
  ``fully_shard``\\ ed over the data-parallel group); a step is forward + loss + backward,
  ``finalize_model_grads`` (SP on: the norms' grads summed over TP), ``mc_ddp.clip_grad_norm``
  (1.0) and ``AdamW.step()``;
- ``torch``: torchtitan's plan on the TP dim of a 2-D ``(dp, tp)`` device mesh
  (``ColwiseParallel`` / ``RowwiseParallel``, SP on: ``SequenceParallel`` norms and
  ``PrepareModuleInput``; ``_common.dtensor_llama_layer_plan``), ``fully_shard`` of each
  layer, the embedding, the head and the root over the DP dim; a step is forward + loss +
  backward, torchtitan's clipping (1.0: ``get_total_norm`` per device mesh, ``full_tensor``,
  ``clip_grads_with_norm_``; torch's ``clip_grad_norm_`` refuses grads on two meshes) and
  ``AdamW.step()``.

Variants are interleaved step by step (``_common.interleaved_medians``); each of the rounds
reports ``mc / torch`` of the slowest rank's medians. Targets (issue 39): mc ≤ 0.80 × torch
with SP off and on; memory per rank (params + grads + optimizer state, local bytes) equal
to torch's within 5 %. Run from the repository root::

    python -m benchmarks.fsdp2_tp [--iters N] [--warmup W] [--rounds R]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TP, DP = 2, 2
SIZES: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
SEQ, BATCH = 128, 4  # global batch; each DP rank steps BATCH / DP rows
TARGET, MEMORY_TOLERANCE = 0.80, 0.05


def _model() -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (optional dependency)

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES))


def _mc(sp: bool, pgc: Any) -> tuple[torch.nn.Module, Step, torch.optim.Optimizer]:
    import mc_groups as mg  # noqa: PLC0415
    from mc_ddp import (  # noqa: PLC0415
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
        clip_grad_norm,
    )
    from mc_finalize import finalize_model_grads  # noqa: PLC0415
    from mc_tp_layers import parallelize, sequence_parallel_plan  # noqa: PLC0415

    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp)
    model = _model()
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    fsdp = TorchFullyShardedDataParallel(
        cfg, TorchFullyShardedDataParallelConfig(), model, pg_collection=pgc
    )
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    ids = _rows(pgc)

    def step() -> None:
        fsdp.zero_grad_buffer()
        fsdp(input_ids=ids, labels=ids).loss.backward()
        finalize_model_grads([fsdp], pg_collection=pgc)
        clip_grad_norm(fsdp, 1.0, pg_collection=pgc)
        opt.step()

    return fsdp, step, opt


def _torch(sp: bool, pgc: Any) -> tuple[torch.nn.Module, Step, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # rank = tp + TP·dp, as mc's default order: the inner mesh dim is TP
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _model()
    top: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()
        ),
    }
    if sp:
        top["model.layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        top["model.norm"] = SequenceParallel(sequence_dim=1, use_local_output=False)
    parallelize_module(model, mesh["tp"], top)
    layers = list(model.get_submodule("model.layers").children())
    for block in layers:
        parallelize_module(block, mesh["tp"], _common.dtensor_llama_layer_plan(sp))
    for sub in [*layers, model.get_submodule("model.embed_tokens"), model.lm_head]:
        fully_shard(sub, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = _rows(pgc)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        _dtensor_clip(list(model.parameters()), 1.0)
        opt.step()

    return model, step, opt


def _dtensor_clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's clipping over DTensor grads on several meshes (the TP-split params on
    ``(dp, tp)``, the others on ``dp``: ``clip_grad_norm_`` refuses to stack norms of
    different meshes): ``get_total_norm`` per mesh, ``full_tensor()``, combined, then
    ``clip_grads_with_norm_``."""
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)  # type: ignore[attr-defined]
    parts = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], 2.0)
        parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.stack(parts).pow(2).sum().sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _rows(pgc: Any) -> torch.Tensor:
    """This DP rank's rows of the global batch."""
    ids = torch.randint(
        0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    rank, rows = pgc.dp.rank(), BATCH // DP
    return ids[rank * rows : (rank + 1) * rows]


def _local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _memory(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's params + grads + optimizer state, local bytes."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _local_bytes(params) + _local_bytes(grads) + _local_bytes(states)


def _measure(sp: bool, warmup: int, iters: int, rounds: int) -> dict[str, Any]:
    """On every rank: both variants of one SP setting, their first losses, memory, timings."""
    import mc_groups as mg  # noqa: PLC0415

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        built = {"mc": _mc(sp, pgc), "torch": _torch(sp, pgc)}
        ids = _rows(pgc)
        with torch.no_grad():
            losses = {n: float(m(input_ids=ids, labels=ids).loss) for n, (m, _, _) in built.items()}
        steps = {name: step for name, (_, step, _) in built.items()}
        per_round = [_common.interleaved_medians(steps, warmup, iters) for _ in range(rounds)]
        memory = {name: _memory(m, opt) for name, (m, _, opt) in built.items()}
        return {"losses": losses, "rounds": per_round, "memory": memory}
    finally:
        mg.destroy_model_parallel(pgc)


def main() -> int:
    args = _common.parse_arguments(__doc__, iters=5, iters_help="timed steps per round", warmup=2)
    rounds = 3
    measure = _common.rank_worker("benchmarks.fsdp2_tp")
    lines = [
        f"| SP | round | mc (ms) | torch DTensor (ms) | mc / torch (target ≤ {TARGET}) |",
        "|---|---:|---:|---:|---:|",
    ]
    ratios: list[float] = []
    memory_ok = True
    with _common.rank_pool(TP * DP) as pool:
        for sp in (False, True):
            per_rank = pool.run(measure, sp, args.warmup, args.iters, rounds)
            print(f"SP {'on' if sp else 'off'}: first losses {per_rank[0]['losses']}", flush=True)
            for rank, result in enumerate(per_rank):
                mc, peer = result["memory"]["mc"], result["memory"]["torch"]
                memory_ok &= abs(mc - peer) <= MEMORY_TOLERANCE * peer
                print(
                    f"  rank {rank}: memory mc {mc / 2**20:.2f} MiB, torch {peer / 2**20:.2f} MiB"
                )
            for r in range(rounds):
                slowest = _common.slowest_medians([{"medians": p["rounds"][r]} for p in per_rank])
                mc, peer = slowest["mc"], slowest["torch"]
                ratios.append(mc / peer)
                lines.append(
                    f"| {'on' if sp else 'off'} | {r} | {mc * 1e3:.1f} | {peer * 1e3:.1f} | "
                    f"{mc / peer:.3f} |"
                )
    print("\n".join(lines))
    print(
        f"mc / torch: {min(ratios):.3f} – {max(ratios):.3f} "
        f"(median {statistics.median(ratios):.3f}); memory within "
        f"{MEMORY_TOLERANCE:.0%}: {memory_ok}"
    )
    return 0 if max(ratios) <= TARGET and memory_ok else 1


if __name__ == "__main__":
    sys.exit(main())
