"""mc's TP layers compiled (``torch.compile(block, fullgraph=True)``, Inductor's C++
backend) against mc eager and against torch DTensor TP compiled, TP = 2 on 2 gloo ranks.

Two blocks, sequence parallelism off and on, each variant with the same weights and input:

- ``mlp``: ``Column(h → 4h) → GELU → Row(4h → h)`` on ``[seq, batch, h]`` (sequence first;
  under SP each rank holds its ``seq / 2`` rows); DTensor: the same ``nn.Sequential`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (SP: ``Shard(0)`` input and output layouts);
- ``llama layer``: decoder layer 1 of a ``transformers`` Llama (hidden 512, intermediate
  1024, 8 heads, 4 KV heads; ``[batch, seq, h]``), converted by ``mc_tp_layers.parallelize``
  with ``mc_tp_layers.sequence_parallel_plan`` (the model's ``tp_plan`` plus block
  entries: SP off, one input-grad all-reduce per attention or MLP block); DTensor:
  ``parallelize_module`` with the equivalent plan (SP: ``SequenceParallel(sequence_dim=1)``
  norms, ``PrepareModuleInput`` gathering the sequence before attention and MLP, row
  layers' output ``Shard(1)``), as in ``benchmarks/parallelize_vs_dtensor.py``.

One step is the block's forward and backward (output gradient of ones). Variants:
``mc eager``, ``mc compiled``, ``DTensor compiled``; each compiled once before timing
(``fullgraph=True``; DTensor's block too). Steps are interleaved (``_common.interleaved_medians``,
a barrier before each), ``--rounds`` rounds; each round reports the slower rank's medians
and the ratios ``mc compiled / mc eager`` (target ≤ 1.0) and ``mc compiled / DTensor
compiled`` (target ≤ 0.90). Prints a Markdown table and the machine's load average before
and after (a shared 2-core machine: read the ratios, not the milliseconds). Run from the
repository root::

    python -m benchmarks.compile_tp [--iters N] [--rounds R] [--blocks mlp,llama]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

TP = 2
MLP = (256, 128, 4)  # h, seq, batch (the overhead-bound size of benchmarks/tp_mlp.py)
LLAMA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
SEQ, BATCH = 128, 2
TARGETS = {"mc compiled / mc eager": 1.0, "mc compiled / DTensor compiled": 0.90}

Block = Callable[[torch.Tensor], torch.Tensor]


def _mlp_mc(sp: bool) -> Block:
    import mc_groups as mg  # noqa: PLC0415
    import mc_tp_layers as tpl  # noqa: PLC0415

    pgc = mg.get_default_collection()
    assert pgc is not None
    h = MLP[0]
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=TP, sequence_parallel=sp, use_cpu_initialization=True
    )
    fc1, fc2 = _common.column_row_layers(tpl, h, cfg, pg_collection=pgc)

    class _Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)[0]))[0]
            return out

    return _Block()


def _mlp_dtensor(sp: bool) -> Block:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    h = MLP[0]
    fc1, fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
    torch.manual_seed(0)  # mc's CPU init draws the full weights in this order
    with torch.no_grad():
        for layer in (fc1, fc2):
            master = torch.empty(layer.weight.shape)
            _common.normal_init(master)
            layer.weight.copy_(master)
            layer.bias.zero_()
    block = torch.nn.Sequential(fc1, torch.nn.GELU(), fc2)
    mesh = init_device_mesh("cpu", (TP,))
    if sp:
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(block, mesh, plan)
    return block


def _mlp_input(sp: bool) -> torch.Tensor:
    h, seq, batch = MLP
    full = torch.randn(seq, batch, h, generator=torch.Generator().manual_seed(1))
    return full.chunk(TP, dim=0)[dist.get_rank()] if sp else full


def _llama_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (optional dependency)

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.config.use_cache = False
    return model


class _Layer(torch.nn.Module):
    """A decoder layer called as ``layer(x)``: fixed rotary embeddings, no mask (causal)."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        hidden = torch.zeros(BATCH, SEQ, LLAMA["hidden_size"])
        cos, sin = rotary(hidden, torch.arange(SEQ).unsqueeze(0))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, position_embeddings=(self.cos, self.sin))
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


def _llama_mc(sp: bool) -> Block:
    import mc_groups as mg  # noqa: PLC0415
    from mc_tp_layers import parallelize, sequence_parallel_plan  # noqa: PLC0415

    pgc = mg.get_default_collection()
    assert pgc is not None
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp)
    model = _llama_model()
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    return _Layer(model.model.layers[1], model.model.rotary_emb)


def _llama_dtensor(sp: bool) -> Block:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (TP,))
    model = _llama_model()
    layer = model.model.layers[1]
    parallelize_module(layer, mesh, _common.dtensor_llama_layer_plan(sp))
    return _Layer(layer, model.model.rotary_emb)


def _llama_input(sp: bool) -> torch.Tensor:
    full = torch.randn(BATCH, SEQ, LLAMA["hidden_size"], generator=torch.Generator().manual_seed(1))
    return full.chunk(TP, dim=1)[dist.get_rank()].contiguous() if sp else full


BUILDERS: dict[str, tuple[Callable[[bool], Block], Callable[[bool], Block], Any]] = {
    "mlp": (_mlp_mc, _mlp_dtensor, _mlp_input),
    "llama layer": (_llama_mc, _llama_dtensor, _llama_input),
}


def _step(block: Block, params: list[torch.Tensor], x: torch.Tensor) -> Step:
    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        y = block(x)
        y.backward(torch.ones_like(y))  # type: ignore[no-untyped-call]

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else t
    return local


def _measure(name: str, sp: bool, warmup: int, iters: int, rounds: int) -> dict[str, Any]:
    """On every rank: the three variants of one block and SP setting, their output
    difference, ``rounds`` interleaved timings."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    import mc_groups as mg  # noqa: PLC0415

    torch.set_num_threads(1)
    inductor_config.compile_threads = 1
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=TP, set_default=True)
    try:
        build_mc, build_dtensor, make_input = BUILDERS[name]
        eager, compiled_mc, dtensor = build_mc(sp), build_mc(sp), build_dtensor(sp)
        blocks: dict[str, Block] = {
            "mc eager": eager,
            "mc compiled": torch.compile(compiled_mc, fullgraph=True),
            "DTensor compiled": torch.compile(dtensor, fullgraph=True),
        }
        params = {
            "mc eager": list(eager.parameters()),  # type: ignore[attr-defined]
            "mc compiled": list(compiled_mc.parameters()),  # type: ignore[attr-defined]
            "DTensor compiled": list(dtensor.parameters()),  # type: ignore[attr-defined]
        }
        inputs = {key: make_input(sp).requires_grad_() for key in blocks}
        outputs = {key: _local(block(inputs[key])).detach() for key, block in blocks.items()}
        differences = {
            key: float((value - outputs["mc eager"]).abs().max()) for key, value in outputs.items()
        }
        steps = {key: _step(blocks[key], params[key], inputs[key]) for key in blocks}
        per_round = [_common.interleaved_medians(steps, warmup, iters) for _ in range(rounds)]
        return {"rounds": per_round, "differences": differences}
    finally:
        torch._dynamo.reset()
        mg.destroy_model_parallel(pgc)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each: every variant)")
    parser.add_argument("--blocks", default=",".join(BUILDERS), help="mlp,llama layer")
    parser.add_argument("--sp", default="off,on", help="off,on")
    return parser.parse_args()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main() -> int:
    args = _arguments()
    names = [n.strip() for n in args.blocks.split(",") if n.strip()]
    sps = [s.strip() == "on" for s in args.sp.split(",") if s.strip()]
    measure = _common.rank_worker("benchmarks.compile_tp")
    print(f"before: {_load()}", flush=True)
    lines = [
        "| block | SP | round | mc eager (ms) | mc compiled (ms) | DTensor compiled (ms) | "
        "compiled / eager (≤ 1.0) | mc / DTensor compiled (≤ 0.90) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios: dict[str, list[float]] = {key: [] for key in TARGETS}
    with _common.rank_pool(TP) as pool:
        for name in names:
            for sp in sps:
                per_rank = pool.run(measure, name, sp, args.warmup, args.iters, args.rounds)
                print(
                    f"{name} SP {'on' if sp else 'off'}: max |output - mc eager| "
                    f"{per_rank[0]['differences']}",
                    flush=True,
                )
                for r in range(args.rounds):
                    slow = _common.slowest_medians([{"medians": p["rounds"][r]} for p in per_rank])
                    eager, mc = slow["mc eager"], slow["mc compiled"]
                    peer = slow["DTensor compiled"]
                    ratios["mc compiled / mc eager"].append(mc / eager)
                    ratios["mc compiled / DTensor compiled"].append(mc / peer)
                    lines.append(
                        f"| {name} | {'on' if sp else 'off'} | {r} | {eager * 1e3:.2f} | "
                        f"{mc * 1e3:.2f} | {peer * 1e3:.2f} | {mc / eager:.3f} | {mc / peer:.3f} |"
                    )
    print("\n".join(lines))
    print(f"after: {_load()}")
    ok = True
    for key, values in ratios.items():
        met = max(values) <= TARGETS[key]
        ok &= met
        print(
            f"{key}: {min(values):.3f} – {max(values):.3f} (median {statistics.median(values):.3f}"
            f", target ≤ {TARGETS[key]}: {'met' if met else 'NOT met'})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
