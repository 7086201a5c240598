"""The dry run's activation memory against numbers derived by hand (the real-run
comparison, byte for byte, is part 1 of ``test_dry_run.py``).

1. **Per block, closed form.** With sequence parallelism (``t`` TP ranks, one query group
   per rank, SwiGLU, 16-bit activations, a fused-attention kernel) a block saves, per token
   of its ``s·b``: the two layer-norm inputs and the two normed outputs (the Column layers'
   inputs), ``4·h/t`` elements; the QKV output ``(1 + 2g/a)·h/t`` (q, k, v are views of
   it); the attention output ``h/t`` (the projection's input is a view of it); fc1's output
   ``2F/t``, ``silu(gate)`` ``F/t`` and the product ``F/t`` (fc2's input); in fp32 the two
   norms' mean and 1/std, ``4/t`` values, and the kernel's log-sum-exp, ``a/t`` values::

       bytes = s·b·(2·(h/t)·(6 + 2g/a) + 2·4F/t + 16/t + 4a/t)

   The dry run measures exactly that at two sizes (and 324.3 MiB at the 70B shape of
   ``docs/dry_run.md``, against Korthikanti et al.'s 2.77 GiB, computed here too).
2. **In flight**: micro-batches a schedule keeps alive, by hand from the schedules' warm-up
   lengths (GPipe all, 1F1B ``P − p``, interleaved ``2(P − p − 1) + (V − 1)P + 1``), and
   the peak on each stage of a PP=4 dry run.
3. **``--device-memory``**: the verdict line says fits / does NOT fit around the measured
   total.
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from examples.dry_run import DryRunSpec, dry_run
from examples.dry_run.activations import korthikanti_layer_bytes
from examples.dry_run.cli import main
from examples.gpt import GPTConfig


def _by_hand(s: int, b: int, h: int, a: int, g: int, f: int, t: int) -> int:
    per_token = 2 * (h // t) * (6 + 2 * g / a) + 2 * 4 * f // t + 16 / t + 4 * a / t
    return round(s * b * per_token)


@pytest.mark.parametrize(("h", "s", "b", "t"), [(64, 32, 1, 4), (128, 64, 2, 2)])
def test_block_bytes_equal_the_closed_form(h: int, s: int, b: int, t: int) -> None:
    a, g, f = 8, t, 7 * h // 2  # one query group per TP rank, FFN 3.5·h, as the 70B shape
    cfg = GPTConfig(
        vocab_size=128,
        hidden_size=h,
        num_heads=a,
        num_layers=2,
        seq_length=s,
        ffn_hidden_size=f,
        num_query_groups=g,
        gated_mlp=True,
    )
    spec = DryRunSpec.create(
        cfg,
        t,
        tp=t,
        sequence_parallel=True,
        params_dtype=torch.bfloat16,
        micro_batch_size=b,
        microbatches=1,
    )
    act = dry_run(spec, 0).activations
    assert act is not None
    assert act.per_layer == {0: _by_hand(s, b, h, a, g, f, t), 1: _by_hand(s, b, h, a, g, f, t)}
    assert act.in_flight == 1
    assert act.peak == act.per_microbatch == 2 * act.per_layer[0] + act.other


def test_seventy_b_block_by_hand_and_korthikanti() -> None:
    s, h, a, g, f, t = 8192, 8192, 64, 8, 28672, 8
    assert _by_hand(s, 1, h, a, g, f, t) == 340_017_152  # 324.27 MiB, docs/dry_run.md
    assert korthikanti_layer_bytes(s, 1, h, a, t) == 2_969_567_232  # 2.77 GiB: 8192²·(34 + 320)/8


def test_peak_per_stage_of_a_pipeline() -> None:
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, seq_length=16)
    spec = DryRunSpec.create(cfg, 4, pp=4, microbatches=8)
    for stage in range(4):
        act = dry_run(spec, stage).activations
        assert act is not None
        assert (act.schedule, act.in_flight) == ("1f1b", 4 - stage)
        assert act.peak == (4 - stage) * act.per_microbatch


def test_device_memory_verdict() -> None:
    argv = ["--world-size", "2", "--tp", "2", "--num-layers", "2", "--hidden-size", "64"]
    argv += ["--ffn-hidden-size", "224", "--num-heads", "8", "--num-query-groups", "2"]
    argv += ["--vocab-size", "128", "--seq-length", "32"]
    out = io.StringIO()
    assert main([*argv, "--device-memory", "1"], out) == 0
    assert "  fits in 1 GiB of device memory" in out.getvalue()
    out = io.StringIO()
    assert main([*argv, "--device-memory", "0.0001"], out) == 0
    assert "  does NOT fit in 0.0001 GiB of device memory" in out.getvalue()
    assert main([*argv, "--device-memory", "0"], io.StringIO()) == 2


def test_schedule_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--world-size", "4", "--pp", "2", "--num-layers", "4", "--hidden-size", "64"]
    small += ["--ffn-hidden-size", "224", "--num-heads", "8", "--num-query-groups", "8"]
    small += ["--vocab-size", "128", "--seq-length", "32"]
    assert main([*small, "--schedule", "interleaved"], io.StringIO()) == 2
    assert "--schedule interleaved with --vpp None" in capsys.readouterr().err
    out = io.StringIO()
    assert main([*small, "--schedule", "gpipe", "--num-microbatches", "4"], out) == 0
    line = r"^  chunk-forwards in flight \(gpipe, 1 chunk\(s\)/stage\) +4$"
    assert re.search(line, out.getvalue(), re.MULTILINE), out.getvalue()
