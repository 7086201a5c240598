"""Megatron-LM's own unit tests in ``docs/compatibility.md``: where mc holds each upstream
test's facts (:data:`UPSTREAM`), the recorded runs of the upstream suites against mc
(:data:`SUITES`, ``records/upstream_run*.json``), and why each test that fails against mc
still fails (:data:`UPSTREAM_FAILING`, checked against the records). Read by
``gen_compatibility.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "records" / "upstream_run.json"
RUN_MAIN = ROOT / "records" / "upstream_run_main.json"

UPSTREAM: tuple[tuple[str, tuple[str, ...], str], ...] = (
    # (Megatron-LM test file, mc test files holding its facts, what is not covered and why)
    (
        "distributed/test_param_and_grad_buffer.py",
        (
            "packages/mc-buffers/tests/mc_buffers_tests/test_conformance_test_param_and_grad_buffer.py",
            "packages/mc-ddp/tests/mc_ddp_tests/test_conformance_test_param_and_grad_buffer.py",
        ),
        "TestNVFP4IndexMaps (mc has no NVFP4 params; the upstream tests fake them by patching "
        "Megatron's own module)",
    ),
    (
        "distributed/test_distributed_data_parallel.py",
        ("packages/mc-ddp/tests/mc_ddp_tests/test_conformance_test_distributed_data_parallel.py",),
        "the dp = 8 variant (8 ranks; dp = 2 held)",
    ),
    (
        "distributed/test_finalize_model_grads.py",
        (
            "packages/mc-finalize/tests/mc_finalize_tests/test_conformance_test_finalize_model_grads.py",
        ),
        "",
    ),
    (
        "distributed/test_grad_sync_with_expert_parallel.py",
        (
            "packages/mc-ddp/tests/mc_ddp_tests/test_conformance_test_grad_sync_with_expert_parallel.py",
        ),
        "(ep, etp, instances) = (2, 2, 2) (8 ranks); TE variants collapse into one (DDP sees "
        "only `allreduce=False`)",
    ),
    (
        "distributed/test_grad_reduce_for_replicated_embedder.py",
        ("packages/mc-finalize/tests/mc_finalize_tests/test_pipeline_grads.py",),
        "",
    ),
    (
        "distributed/test_param_layout.py",
        (
            "packages/mc-buffers/tests/mc_buffers_tests/test_padding.py",
            "packages/mc-buffers/tests/mc_buffers_tests/test_keys.py",
            "packages/mc-buffers/tests/mc_buffers_tests/test_layout_examples.py",
            "packages/mc-buffers/tests/mc_buffers_tests/test_layout_properties.py",
        ),
        "",
    ),
    (
        "distributed/test_layer_wise_param_layout.py",
        (),
        "all: mc has no LayerWiseDistributedOptimizer (Muon routing, layer-wise layouts)",
    ),
    (
        "distributed/test_param_readiness.py",
        (
            "packages/mc-ddp/tests/mc_ddp_tests/test_param_ready.py",
            "packages/mc-ddp/tests/mc_ddp_tests/test_conformance_test_param_readiness.py",
        ),
        "",
    ),
    (
        "distributed/test_reduce_scatter_with_fp32_accumulation.py",
        (
            "packages/mc-ddp/tests/mc_ddp_tests/test_conformance_test_reduce_scatter_with_fp32_accumulation.py",
        ),
        "",
    ),
    (
        "distributed/mfsdp_v1, mfsdp_v2, test_torch_fully_sharded_parallel.py",
        (),
        "all: mc has no FSDP",
    ),
    (
        "tensor_parallel/test_layers.py",
        ("packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_layers.py",),
        "TE `general_gemm` parity needs CUDA + Transformer Engine (test_cuda.py, GPU only)",
    ),
    (
        "tensor_parallel/test_mappings.py",
        (
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_mappings.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_mapping_functions.py",
        ),
        "",
    ),
    (
        "tensor_parallel/test_random.py",
        (
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_random.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_random.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_activation_checkpoint.py",
        ),
        "graph-safe trackers (`use_cudagraphable_rng=True`) and `_convert_cuda_rng_state` "
        "(NotImplementedError in mc)",
    ),
    (
        "tensor_parallel/test_initialization.py",
        ("packages/mc-tp-layers/tests/mc_tp_layers_tests/test_initialization.py",),
        "the TE layers' init (Transformer Engine)",
    ),
    (
        "tensor_parallel/test_cross_entropy.py",
        ("packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_cross_entropy.py",),
        "`LanguageModule`'s unfused loss (mc has no LanguageModule)",
    ),
    (
        "tensor_parallel/test_tp_attrs_without_init.py",
        (
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_tp_attrs_without_init.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_attributes.py",
        ),
        "",
    ),
    (
        "tensor_parallel/test_tensor_parallel_utils.py",
        (
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_tensor_parallel_utils.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_mapping_functions.py",
        ),
        "",
    ),
    ("tensor_parallel/test_data.py", (), "`broadcast_data` (not offered by mc)"),
    (
        "generalized_tensor_parallel/test_gtp_basics.py, test_tp_gtp.py, "
        "test_gtp_custom_pgs.py, test_gtp_loss_correctness.py, test_gtp_grad_correctness.py, "
        "test_moe_egtp.py",
        (
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_gtp_basics.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_tp_gtp.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_gtp_custom_pgs.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_gtp_loss_correctness.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_gtp_grad_correctness.py",
            "packages/mc-tp-layers/tests/mc_tp_layers_tests/test_conformance_test_moe_egtp.py",
            "integration_tests/test_parity_gtp.py",
        ),
        "weight cache, prefetch chains, CUDA-graph wgrad rings, TE LayerNormLinear / "
        "GroupedLinear, MXFP8, `pad_for_alignment`, the fp32-accumulating gtp reduce-scatter, "
        "Megatron's optimizer grad norms, the MoE layer (mc has none of these)",
    ),
    (
        "generalized_tensor_parallel/ (attention, cudagraph, partial_cg, dcp internals, "
        "ddp_param_sync_race, recompute_chain, fp8_param_gather, mtp, muon, muon_dcp, "
        "symmetric_memory, mamba)",
        (),
        "all: TE attention, CUDA graphs, ShardedTensor internals (mc's gtp checkpoints: "
        "test_checkpoint.py), prefetch chains, fp8, MTP, Muon, symmetric memory and Mamba are "
        "not in mc",
    ),
)
"""Megatron-LM's unit tests (``tests/unit_tests/``) and where mc holds their facts."""


_NVFP4 = (
    "not applicable (mc has no NVFP4 params): builds the buffer with Megatron main's keywords "
    "(`ddp_config=`, `params_with_names=`, `data_parallel_group=`, `nccl_ub=`, `pg_collection=`: "
    "mc's `ParamAndGradBuffer` accepts them) and fakes NVFP4 params by patching "
    "`megatron.core.distributed.param_and_grad_buffer.is_nvfp4tensor` and friends, with a "
    "packed `param_dtype=torch.uint8` that mc refuses by name (a buffer's params are floating "
    "point). The index values of plain params it checks are held by "
    "`mc_buffers_tests/test_conformance_test_param_and_grad_buffer.py` (Megatron's keywords) "
    "and `mc_buffers_tests/test_layout_examples.py`"
)

UPSTREAM_FAILING: dict[str, str] = {
    # upstream test id (under tests/unit_tests/) -> why it stays failing against mc, in both
    # suites (0.19 and main) where the id exists in both
    "distributed/test_param_and_grad_buffer.py::test_grad_sync[2-False-True-True]": (
        "deliberate (correctness hazard): with overlap and 2 optimizer instances, Megatron's "
        "early `finish_grad_sync` returns and marks the sync finished with nothing reduced, so "
        "unreduced grads can reach the optimizer; mc raises `InputStateError` (an "
        "AssertionError) as it does with one instance"
    ),
    "distributed/test_param_and_grad_buffer.py::test_grad_sync[2-True-True-True]": (
        "deliberate (correctness hazard): as the case above, with `average_in_collective`"
    ),
    "distributed/test_param_and_grad_buffer.py::"
    "test_force_all_reduce_uses_correct_collective[False]": (
        "not applicable (no user code can depend on it): patches "
        "`megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func`, a private "
        "module global that only Megatron's bucket group calls; what a user can observe is the "
        "collective issued, and that fact (with the distributed optimizer and "
        "`force_all_reduce=False` the grads are reduce-scattered, with True all-reduced) is held "
        "by `mc_ddp_tests/test_features.py::"
        "test_force_all_reduce_and_fp32_accumulating_reduce_scatter` on recorded collectives; "
        "the `True` case, which patches `torch.distributed.all_reduce`, passes"
    ),
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_exact_index_values_no_padding": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_multi_bucket_param_to_index": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_with_distributed_optimizer[1]": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_with_distributed_optimizer[2]": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_with_distributed_optimizer[4]": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_with_distributed_optimizer[8]": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_mixed_params": _NVFP4,
    "distributed/test_param_and_grad_buffer.py::TestNVFP4IndexMaps::"
    "test_nvfp4_varied_param_sizes": _NVFP4,
    "tensor_parallel/test_cross_entropy.py::"
    "test_vocab_parallel_cross_entropy_uses_explicit_tp_group": (
        "not applicable (no user code can depend on it): monkeypatches "
        "`get_tensor_model_parallel_group` on Megatron's cross-entropy module (mc has no "
        "parallel_state lookup there to patch) and counts three `torch.distributed.all_reduce` "
        "calls on a fake one-rank group object. The number of internal all-reduces is not "
        "behaviour a caller sees (mc issues two: MAX, then one stacked SUM, and none on a "
        "one-rank group), and a group that is not a `ProcessGroup` cannot carry a collective "
        "(mc's agreement check exchanges over it). The fact a user relies on, that the explicit "
        "`tp_group` is used instead of the global one, is held by "
        "`mc_tp_layers_tests/test_conformance_test_cross_entropy.py::"
        "test_vocab_parallel_cross_entropy_uses_explicit_tp_group` on real groups"
    ),
}
"""The upstream tests that fail against mc and why (checked against the recorded run)."""


def upstream_section() -> str:
    """The table of Megatron-LM unit tests; every mc test file it names must exist."""
    lines = [
        "## Megatron-LM's unit tests and where mc holds their facts\n",
        "Each `test_conformance_*` test's docstring names the upstream test it follows; "
        "`existing` tests were already holding the fact. Upstream paths are under "
        "`tests/unit_tests/` of NVIDIA/Megatron-LM.\n",
        "| upstream | mc tests | not covered (why) |",
        "|---|---|---|",
    ]
    for upstream, files, missing in UPSTREAM:
        for path in files:
            if not (ROOT / path).is_file():
                raise ValueError(f"UPSTREAM names {path}, which does not exist")
        cited = "<br>".join(f"`{path}`" for path in files) or "—"
        lines.append(f"| `{upstream}` | {cited} | {missing or '—'} |")
    return "\n".join(lines) + "\n"


def record_run(path: Path, target: Path = RUN) -> None:
    """Keep of a harness run (``--json``) what the document needs: per test its kind and,
    for a failure or a test not applicable, the reason (first line, 240 characters)."""
    run = json.loads(path.read_text(encoding="utf-8"))
    tests = {}
    for nid, row in sorted(run["rows"].items()):
        test = nid.removeprefix("tests/unit_tests/")
        side = row["mc"] if row["kind"] == "fail" else row["control"]
        reason = "" if row["kind"] == "pass" else str(side[1]).splitlines()[0][:240]
        tests[test] = {"kind": row["kind"], "reason": reason}
    kept = {
        "date": time.strftime("%Y-%m-%d", time.gmtime(path.stat().st_mtime)),
        "nproc": run["nproc"],
        "elapsed_s": round(run["elapsed_s"]),
        "tests": tests,
    }
    target.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n", encoding="utf-8")


class Suite(NamedTuple):
    """One recorded harness run: where it is kept, how it is made, what it tests."""

    record: Path
    title: str
    command: str
    tests: str
    flag: str


SUITES = (
    Suite(
        RUN,
        "Megatron-LM's own tests against mc (measured)",
        "../shared/upstream/run",
        "Megatron-LM's unit tests for `core.distributed` and `core.tensor_parallel` (release "
        "core_r0.19.0)",
        "--upstream-run",
    ),
    Suite(
        RUN_MAIN,
        "Megatron-LM main's own tests against mc (measured)",
        "../shared/upstream/run-main",
        "Megatron-LM main's unit tests (commit d98e8a64, the branch the spec documents) for "
        "the same modules plus `param_layout`, the layer-wise optimizer's layout and param "
        "readiness",
        "--upstream-run-main",
    ),
)
"""The 0.19 suite and the main suite; their failures share :data:`UPSTREAM_FAILING`."""


def failing_tests(suite: Suite) -> set[str]:
    """The tests of ``suite``'s recorded run that failed against mc."""
    run = json.loads(suite.record.read_text(encoding="utf-8"))
    return {t for t, v in run["tests"].items() if v["kind"] == "fail"}


def check_failing_reasons() -> None:
    failing = set().union(*(failing_tests(suite) for suite in SUITES))
    stale = sorted(set(UPSTREAM_FAILING) - failing)
    if stale:
        raise ValueError(f"UPSTREAM_FAILING lists tests that did not fail: {stale}")


def _na_reason(reason: str) -> str:
    """A short cause for a test that fails against Megatron-Core itself on CPU."""
    for needle, cause in (
        ("transformer_engine", "Transformer Engine"),
        ("TransformerEngine", "Transformer Engine"),
        ("FP8GlobalStateManager", "Transformer Engine (FP8)"),
        ("cudagraph", "CUDA graphs"),
        ("CUDA", "CUDA"),
        ("cuda", "CUDA"),
        ("Gloo", "gloo (NCCL-only collective)"),
        ("exercises only Megatron", "Megatron-only (imports no ported name)"),
    ):
        if needle in reason:
            return cause
    return "skipped or failing on CPU" if reason else "skipped"


def measured_section(suite: Suite) -> str:
    """The recorded run of ``suite`` (Megatron-LM's own tests against mc), per file."""
    run = json.loads(suite.record.read_text(encoding="utf-8"))
    tests: dict[str, dict[str, str]] = run["tests"]
    failing = failing_tests(suite)
    undocumented = sorted(failing - set(UPSTREAM_FAILING))
    if undocumented:
        raise ValueError(f"upstream tests fail with no reason in UPSTREAM_FAILING: {undocumented}")
    per_file: dict[str, dict[str, Any]] = {}
    for test, value in tests.items():
        entry = per_file.setdefault(test.split("::")[0], {"pass": 0, "fail": 0, "na": {}})
        if value["kind"] == "na":
            cause = _na_reason(value["reason"])
            entry["na"][cause] = entry["na"].get(cause, 0) + 1
        else:
            entry[value["kind"]] += 1
    passed = sum(e["pass"] for e in per_file.values())
    applicable = passed + len(failing)
    na = sum(sum(e["na"].values()) for e in per_file.values())
    lines = [
        f"## {suite.title}\n",
        f"`{suite.command}` on {run['date']} ({run['nproc']} gloo ranks, "
        f"{run['elapsed_s']} s): {suite.tests} with **only their imports of the "
        "ported modules rewritten to mc**, everything else (parallel_state, configs, models, "
        f"test utilities) Megatron's: **{passed}/{applicable} pass** ({na} not applicable: "
        "they fail against Megatron-Core itself on CPU). Recorded in "
        f"`records/{suite.record.name}` (a measured record, kept beside the code); "
        f"regenerate with `python scripts/gen_compatibility.py {suite.flag} RUN.json`.\n",
        "| upstream file | pass | fail | not applicable (why) |",
        "|---|---|---|---|",
    ]
    for name, entry in sorted(per_file.items()):
        why = ", ".join(f"{n} {cause}" for cause, n in sorted(entry["na"].items())) or "—"
        lines.append(f"| `{name}` | {entry['pass']} | {entry['fail']} | {why} |")
    lines += ["", "Failing against mc, each with its reason:", ""]
    previous = ""
    for test in sorted(failing):
        reason = UPSTREAM_FAILING[test]
        shown = "as the test above" if reason == previous else reason
        lines.append(f"- `{test}`: {shown}")
        previous = reason
    if not failing:
        lines.append("- none")
    return "\n".join(lines) + "\n"
