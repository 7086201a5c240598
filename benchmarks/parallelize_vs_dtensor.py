"""``mc_tp_layers.parallelize`` against torch's ``parallelize_module`` (DTensor) on the same
``transformers`` Llama, TP = 2, sequence parallelism off and on.

One step is forward + loss (``model(input_ids, labels=input_ids).loss``) + backward on 2
gloo ranks, one thread each, the same weights (same seed) and batch for both variants:

- ``mc``: ``parallelize(model, sequence_parallel_plan(model))``: the model's own ``tp_plan``
  plus the sequence-parallel entries (SP off: the blocks' entries share one input grad
  all-reduce per block);
- ``torch``: the equivalent plan of ``ColwiseParallel`` / ``RowwiseParallel`` (SP on:
  ``SequenceParallel(sequence_dim=1)`` on the norms, ``PrepareModuleInput`` gathering the
  sequence before attention and MLP and scattering it at the first layer, the row layers'
  output ``Shard(1)``) on a ``DeviceMesh`` of the gloo world.

Variants are interleaved step by step (``_common.interleaved_medians``); each of ``--rounds``
rounds reports ``mc / torch`` of the slower rank's medians. Target: mc ≤ 0.90 × torch.
Run from the repository root::

    python -m benchmarks.parallelize_vs_dtensor [--iters N] [--rounds R]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TP = 2
SIZES: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
SEQ, BATCH = 128, 2
TARGET = 0.90


def _model() -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (optional dependency)

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> Step:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def _mc(sp: bool) -> torch.nn.Module:
    import mc_groups as mg  # noqa: PLC0415
    from mc_tp_layers import parallelize, sequence_parallel_plan  # noqa: PLC0415

    pgc = mg.get_default_collection()
    assert pgc is not None
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp)
    model = _model()
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    return model


def _torch(sp: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (TP,))
    model = _model()
    layer = _common.dtensor_llama_layer_plan(sp)
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
    parallelize_module(model, mesh, top)
    for block in model.get_submodule("model.layers").children():
        parallelize_module(block, mesh, layer)
    return model


def _measure(sp: bool, warmup: int, iters: int, rounds: int) -> dict[str, Any]:
    """On every rank: both variants of one SP setting, their losses, ``rounds`` timings."""
    import mc_groups as mg  # noqa: PLC0415

    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=TP, set_default=True)
    try:
        ids = torch.randint(
            0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
        )
        models = {"mc": _mc(sp), "torch": _torch(sp)}
        losses = {name: m(input_ids=ids, labels=ids).loss.item() for name, m in models.items()}
        steps = {name: _step(m, ids) for name, m in models.items()}
        per_round = [_common.interleaved_medians(steps, warmup, iters) for _ in range(rounds)]
        return {"losses": losses, "rounds": per_round}
    finally:
        mg.destroy_model_parallel(pgc)


def main() -> int:
    args = _common.parse_arguments(__doc__, iters=10, iters_help="timed steps per round", warmup=2)
    rounds = 3
    measure = _common.rank_worker("benchmarks.parallelize_vs_dtensor")
    lines = [
        f"| SP | round | mc (ms) | torch DTensor (ms) | mc / torch (target ≤ {TARGET}) |",
        "|---|---:|---:|---:|---:|",
    ]
    ratios: list[float] = []
    with _common.rank_pool(TP) as pool:
        for sp in (False, True):
            per_rank = pool.run(measure, sp, args.warmup, args.iters, rounds)
            print(f"SP {'on' if sp else 'off'}: losses {per_rank[0]['losses']}", flush=True)
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
        f"(median {statistics.median(ratios):.3f})"
    )
    return 0 if max(ratios) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
