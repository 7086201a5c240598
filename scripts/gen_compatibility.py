"""Generate ``docs/compatibility.md``: every public name of the three spec modules and every
field of ``DistributedDataParallelConfig``, with how mc matches Megatron-Core.

Usage: ``python scripts/gen_compatibility.py`` (writes the file) or ``--check`` (exit 1 when
the file is stale); ``--upstream-run RUN.json`` first records a run of Megatron-LM's own
tests against mc (``../shared/upstream/run --json RUN.json``) into ``docs/upstream_run.json``,
``--upstream-run-main RUN.json`` one of Megatron-LM main's (``../shared/upstream/run-main``)
into ``docs/upstream_run_main.json``
(per test: pass / fail / n.a. and the reason), from which the measured table is drawn.
``integration_tests/test_docs.py`` runs the same checks, so the document
cannot drift from the code:

- the names come from ``docs/spec/*.txt``, a copy of ``../shared/spec`` (Megatron-Core's API
  documentation; the copy travels with the repository so CI can read it); each
  module's mc counterpart must hold every name not marked absent, and none marked absent;
- a signature status is computed, not declared: ``same`` when mc's parameters equal the
  spec's (names and order), ``extended`` when the spec's are a prefix of mc's (mc adds
  keyword arguments after them); anything else must be declared ``differs`` with the
  reason in :data:`NOTES`, and a name declared ``differs`` must have a reason;
- config rows are probed: a field whose non-default value raises ``NotImplementedError``
  is reported absent (accepted at Megatron's default only);
- the measured table counts the recorded run; every upstream test that failed in it must
  have its reason in :data:`UPSTREAM_FAILING`, and every entry there must have failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mc_ddp import DistributedDataParallelConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
RUN = ROOT / "docs" / "upstream_run.json"
RUN_MAIN = ROOT / "docs" / "upstream_run_main.json"
SPEC_DIRS = (ROOT / "docs" / "spec", ROOT.parent / "shared" / "spec")

MODULES = {
    "core.distributed.distributed_data_parallel": (
        "distributed_data_parallel.txt",
        "mc_ddp.distributed_data_parallel",
    ),
    "core.distributed.finalize_model_grads": ("finalize_model_grads.txt", "mc_finalize"),
    "core.tensor_parallel.layers": ("tensor_parallel_layers.txt", "mc_tp_layers.layers"),
}

_DCP = (
    "returns DTensors for torch.distributed.checkpoint (a (tp) or (tp, gtp_remat) mesh), not "
    "Megatron's ShardedTensor dist-checkpointing objects: checkpoints load across TP and "
    "gtp_remat sizes through DCP"
)
_RNG = (
    "adds keyword-only `rng_tracker` (None: the default tracker that "
    "`model_parallel_cuda_manual_seed` registers, as Megatron reads its global one) and "
    "`device`"
)
_FLAGS = (
    "flags must be bools and `params_dtype` / `output_dtype` floating point (Megatron reads "
    "any truthy value: `bias='no'` made a bias)"
)
_FIRST_FORWARD = (
    "The first forward compares how the TP peers built their layers (one 8-byte exchange per "
    "group for every layer built since; `mc_tp_layers.check_tp_agreement`): a mismatch is "
    "`TensorParallelAgreementError` on every rank"
)
_DEFAULT_GROUPS = (
    "`pg_collection=None` reads the registered default collection (Megatron: parallel_state "
    "globals); without one it is an error naming the fix"
)

NOTES: dict[str, tuple[str | None, str]] = {
    # name: (declared status or None for the computed one, note)
    "logger": (None, "a `logging.Logger` named after the module"),
    "DistributedDataParallel": (
        None,
        "`config` is any object with a bool `calculate_per_token_loss`; "
        + _DEFAULT_GROUPS
        + "; refuses `average_in_collective` with gtp_remat and with per-token loss; the "
        "ranks of `dp_cp` (and `expt_dp`) compare how they built it, one 8-byte exchange per "
        "group before anything is allocated: a mismatch is `DataParallelAgreementError` on "
        "every rank naming the fields",
    ),
    "DistributedDataParallel.offload_grad_buffers": (
        "differs",
        "`synchronize` / `empty_cache` are no-ops on CPU; until `restore_grad_buffers()`, "
        "`main_grad` is an `mc_buffers.OffloadedView` (every op raises) and a backward, a "
        "forward with autograd on, `zero_grad_buffer`, `scale_gradients` and the grad sync "
        "are errors (Megatron writes into the freed storage); grads the iteration had "
        "accumulated are refused until `zero_grad_buffer()`",
    ),
    "DistributedDataParallel.scale_gradients": (
        "differs",
        "a second call in one iteration is an error (the grads would be scaled twice, e.g. "
        "after `finalize_model_grads(num_tokens=...)`); NaN/±inf factors are refused",
    ),
    "DistributedDataParallel.finish_grad_sync": (
        None,
        "`force_all_reduce=True` after a call without it in the same iteration is an error "
        "under the distributed optimizer (the shards are already final)",
    ),
    "DistributedDataParallel.free_overlap_buffers": (
        None,
        "also frees the gloo reduce-scatter buffers the bucket groups' communicators keep "
        "between steps (CPU)",
    ),
    "_allreduce_router_grads": (
        None,
        "adds `pp_group` (Megatron reads the global pipeline group)",
    ),
    "finalize_model_grads": (
        None,
        _DEFAULT_GROUPS
        + "; keyword-only `peer_checks=True`: the per-step status exchange that makes one "
        "rank's failed check every rank's error (`False` skips it); params marked "
        "`sum_gradients_across_tp_domain` (mc's mark) are summed over tp with or without "
        "sequence parallelism",
    ),
    "_allreduce_layernorm_grads": (
        None,
        "Megatron's alias of `_allreduce_non_tensor_model_parallel_grads`",
    ),
    "_update_router_qb_beta": (
        None,
        "finalize passes `dp_cp_gtp_remat` under gtp_remat (`dp_cp` otherwise)",
    ),
    "_grad_accum_fusion_available": (
        None,
        "True when apex's fused wgrad kernel imports; without it mc accumulates through "
        "torch's mixed-dtype GEMM (same numbers up to summation order) instead of raising",
    ),
    "copy_gtp_attributes": (
        "extended",
        "copies Megatron's four tags (is_gtp_weight_remat, allreduce, gtp_replica_group, "
        "pad_length) and mc's gtp_remat_rank, gtp_remat_size, gtp_unsharded_shape and group",
    ),
    "param_is_not_tensor_parallel_duplicate": (
        None,
        "with neither group given, the default collection's `expt_tp` (expert params) or "
        "`tp`; Megatron falls back to its global dense TP rank for both",
    ),
    "param_is_not_gtp_duplicate": (
        "differs",
        "reads the param's `gtp_remat_rank` tag (set by the layers) instead of the global "
        "gtp_remat rank: mc has no parallel_state globals",
    ),
    "set_tensor_model_parallel_attributes": (
        "differs",
        "setting the same values again is allowed and different values raise ValueError; "
        "Megatron asserts that none of its six attributes is set; `is_parallel` must be a "
        "bool and `dim` a dimension of the tensor",
    ),
    "_initialize_affine_weight_gpu": ("extended", _RNG.replace(" and `device`", "")),
    "_initialize_affine_weight_cpu": (
        None,
        "the full master weight is built with the CPU generator and sliced, so TP=N equals "
        "TP=1 sliced (stride honoured)",
    ),
    "VocabParallelEmbedding": ("extended", _RNG + "; " + _FLAGS),
    "VocabParallelEmbedding.forward": (
        "differs",
        "ids outside [0, num_embeddings) are an error at every TP size (CPU: ValueError "
        "before any collective; CUDA: an asynchronous device assert); Megatron embeds them "
        "to zeros at TP > 1 and raises torch's IndexError at TP = 1. " + _FIRST_FORWARD,
    ),
    "VocabParallelEmbedding.sharded_state_dict": ("differs", _DCP),
    "LinearWithFrozenWeight": (
        None,
        "a bias that requires grad gets `Σ dY` (Megatron returns None for it)",
    ),
    "linear_with_grad_accumulation_and_async_allreduce": (
        None,
        "gtp_remat wgrads are pre-scaled by 1/gtp_remat (1 under calculate_per_token_loss) "
        "before their SUM reduce-scatter, as Megatron's `_prescale_wgrads_for_mean_rs`",
    ),
    "ColumnParallelLinear": ("extended", _RNG + "; " + _FLAGS),
    "ColumnParallelLinear.forward": (None, _FIRST_FORWARD),
    "RowParallelLinear.forward": (None, _FIRST_FORWARD),
    "RowParallelLinear": (
        "differs",
        _RNG + "; " + _FLAGS + "; an expert layer's bias is not tagged `sequence_parallel`: "
        "Megatron tags it, and "
        "finalize then sums over the dense TP group an expert-bias grad that DDP already "
        "reduced (2.0× at TP = 2, ETP = 1; integration_tests/test_parity_experts.py)",
    ),
    "ColumnParallelLinear.backward_dw": (
        "differs",
        "`delay_wgrad_compute` is not supported by mc's layers: the wgrad is always computed "
        "in backward and this is a no-op",
    ),
    "RowParallelLinear.backward_dw": (
        "differs",
        "as `ColumnParallelLinear.backward_dw`",
    ),
    "ColumnParallelLinear.sharded_state_dict": ("differs", _DCP),
    "RowParallelLinear.sharded_state_dict": ("differs", _DCP),
}

CONFIG_NOTES = {
    "average_in_collective": "refused (ValueError) with gtp_remat and with per-token loss, "
    "as Megatron refuses both",
    "reduce_scatter_with_fp32_accumulation": "distributed optimizer, one instance; on gloo "
    "an all-to-all plus a local fp32 sum",
    "disable_symmetric_registration": "accepted at either value: mc never registers NCCL "
    "buffers, which is what True asks for",
    "delay_wgrad_compute": "DDP registers hooks through the owning module's "
    "`register_wgrad_accumulation_and_reduce_hooks`; mc's own layers do not delay wgrads",
}

DELIBERATE = """\
## Deliberate differences (all names)

- **Errors that are also asserts.** Bad input is a `TypeError` / `ValueError` naming the
  argument, the value and the fix, raised before any state changes or any collective
  (Megatron asserts, or fails later). The types are `mc_groups.InputTypeError` /
  `InputValueError` (and `InputStateError`, a `RuntimeError`, for a call the object's state
  forbids), each also an `AssertionError`, so code written for Megatron
  (`except AssertionError`, `pytest.raises(AssertionError)`) keeps working.
- **Megatron's objects by what they have.** A `ProcessGroupCollection` of another class
  (Megatron-Core's) is adopted by its group attributes; a `full_param_layout` / `param_layout`
  with Megatron-Core's fields (its own `FullParamLayout` from
  `DistributedOptimizer.compute_full_param_layout`, or main's
  `LayerWiseDistributedOptimizer.compute_full_param_layout`) is copied into mc's, and
  `BufferKey`s of either library are equal and hash alike; a group argument that
  is only read for its rank may be any object with `rank()`; finalize's step helpers take any
  chunk with `named_parameters()` (plain `nn.Module`s), `finalize_model_grads` also needs
  `finish_grad_sync`. Megatron's own optimizers build over mc's DDP: its
  `DistributedOptimizer` (`get_megatron_optimizer`) reads each buffer's `ddp_config`,
  `data_parallel_group`, layout and buckets, main's `LayerWiseDistributedOptimizer` the
  chunk's `full_param_layout` (`integration_tests/test_megatron_optimizer.py`, where
  megatron-core is installed: both train like one process within 1e-6).
- **No required globals.** Groups are passed explicitly (`tp_group=`, `pg_collection=`);
  `initialize_model_parallel(..., set_default=True)` and `model_parallel_cuda_manual_seed`
  register opt-in defaults that `None` arguments read, as Megatron's globals would.
- **Checkpoints through DCP.** `sharded_state_dict` returns DTensors for
  `torch.distributed.checkpoint`, not Megatron's `ShardedTensor` / dist_checkpointing.
- **Expert gtp_remat.** An expert layer's gtp_remat group must have `config.gtp_remat_size`
  ranks: mc's layers have no separate `expert_gtp_remat_size` (Megatron's
  `expert_gtp_weight_remat_size`), so the expert tag is
  `allreduce = not (is_expert and (ep > 1 or etp != tp))` without Megatron's third term.
- **gtp_remat padding.** A gtp_remat weight is padded to a multiple of the gtp_remat size;
  Megatron pads dim 0 to a multiple of `pad_for_alignment` (16) × the size (its global
  `GTP_CONFIG`). Grads and outputs are equal; shard shapes differ, and checkpoints (DCP,
  without padding) load across both.
- **Grad sync.** `DistributedDataParallel.finish_grad_sync` reduces once per iteration
  (a second call, e.g. `finalize_model_grads` after a manual one, returns: reducing again
  would double-scale the shards under the distributed optimizer); a bucket group's own
  `finish_grad_sync` is Megatron's (without overlap every call reduces again). Calling it
  with `overlap_grad_reduce` before a group's last grad is ready is an `InputStateError`
  (an `AssertionError`, as Megatron's) with one optimizer instance **and with several**:
  there Megatron returns and marks the sync finished although nothing was reduced, and the
  reduction the last grad later starts is never waited for (unreduced grads could reach the
  optimizer). `register_grad_ready` without `overlap_grad_reduce` is an `InputStateError`, as
  Megatron asserts. `overlap_param_gather` without the distributed optimizer (Megatron's
  legacy layer-wise setting, without a layout) is accepted: params are replicated, nothing
  is gathered; that legacy path's per-bucket param lists (`set_layerwise_params_list`,
  `layerwise_param_flat_sizes`) are a `NotImplementedError` naming the layout path. With
  the layout Megatron main's `LayerWiseDistributedOptimizer` computes (`full_param_layout=`,
  distributed optimizer on), its shard-aligned buffers are reduce-scattered and gathered as
  Megatron does.
- **Collectives.** Nothing is issued on one-rank groups; vocab-parallel cross-entropy
  issues two all-reduces (MAX, then one stacked SUM) where Megatron issues three; on gloo,
  reduce-scatters run as an all-to-all plus a local sum and all-gathers as point-to-point
  exchanges (recorded as reduce_scatter / all_gather).
- **Targets and ids out of range.** `vocab_parallel_cross_entropy` refuses a target outside
  [0, V) at every TP size (Megatron scores it as log Z, torch's -100 included) and takes a
  keyword-only `ignore_index` (loss 0 and no gradient there, as `F.cross_entropy`);
  `VocabParallelEmbedding` refuses ids outside [0, num_embeddings) (Megatron: zeros at
  TP > 1, torch's IndexError at TP = 1). CPU: ValueError; CUDA: asynchronous device assert.
- **Agreement across the TP group.** The first forward (or `check_tp_agreement`) compares
  how the TP peers built their layers, one 8-byte exchange per group; the cross-entropy's
  MAX all-reduce also compares the vocabulary slice, target, `label_smoothing` and
  `ignore_index`. Megatron compares nothing: disagreeing ranks hang, abort or train on
  wrong numbers.
- **Activation checkpointing and 1-D splits.** `checkpoint` is `mc_tp_layers.random.checkpoint`
  only (`mc_tp_layers.checkpoint` is mc's DTensor checkpoint module);
  `split_tensor_into_1d_equal_chunks` refuses a size not divisible by the TP size (Megatron
  floors it and the gather loses the rest); `CheckpointWithoutOutput` copies the recomputed
  outputs into their freed storage (Megatron shares storage through a C++ extension);
  `CudaRNGStatesTracker(use_cudagraphable_rng=True)` is a `NotImplementedError`.
- **No Megatron-FSDP, NCCL user buffers, Transformer Engine fp8/fp4 gathers, TE or
  CUDA-graph RNG trackers**: their switches exist at Megatron's defaults and any other value
  raises `NotImplementedError` naming the field.
"""


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
    "not applicable (no user code can depend on it): builds Megatron's private "
    "`_ParamAndGradBuffer(ddp_config=, params_with_names=, data_parallel_group=, ...)` and fakes "
    "NVFP4 params by patching `megatron.core.distributed.param_and_grad_buffer.is_nvfp4tensor` "
    "and friends. Only Megatron's own DDP constructs that class (Megatron main's optimizer/ and "
    "dist_checkpointing/ never do; they read a built buffer's fields, which mc's buffer has), so "
    "code that uses mc's DDP never reaches the constructor, and mc has no NVFP4 params for the "
    "patched functions to describe. The index values of plain params it checks are held by "
    "`mc_buffers_tests/test_layout_examples.py`"
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
    "test_non_nvfp4_exact_values_match_original": _NVFP4,
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


class Param(NamedTuple):
    """One parameter of a signature: its name and kind (``"*"`` var-positional, ``"kw"``
    keyword-only, ``""`` positional-or-keyword)."""

    name: str
    kind: str


class Row(NamedTuple):
    """One line of the document."""

    module: str
    name: str
    status: str
    note: str


def _spec_dir() -> Path:
    for folder in SPEC_DIRS:
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"no spec folder among {[str(p) for p in SPEC_DIRS]}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _parse_params(text: str | None) -> list[Param] | None:
    if text is None:
        return None
    params: list[Param] = []
    keyword_only = False
    for part in _split_top_level(text):
        name = re.split(r"[:=]", part, maxsplit=1)[0].strip()
        if name.startswith("**"):
            continue  # **kwargs: mc's side drops VAR_KEYWORD too
        if name == "*":
            keyword_only = True
        elif name.startswith("*"):
            params.append(Param(name.lstrip("*"), "*"))
            keyword_only = True
        elif name not in ("self", "ctx"):
            params.append(Param(name, "kw" if keyword_only else ""))
    return params


_METHOD = re.compile(r"^(?:static )?(\w+)\((.*?)\)(?: → [^#]*)?#")


def spec_names(spec_module: str) -> dict[str, list[Param] | None]:
    """``{name: parameters}`` of the spec module's API section (methods as ``Class.method``;
    parameters None for data)."""
    prefix = re.escape(spec_module)
    class_line = re.compile(rf"^class {prefix}\.(\w+)(?:\((.*)\))?#")
    func_line = re.compile(rf"^{prefix}\.(\w+)(?:\((.*?)\))?(?: → [^#]*)?#")
    text = (_spec_dir() / MODULES[spec_module][0]).read_text(encoding="utf-8")
    api = text.split("\nAPI#\n", 1)[1]
    names: dict[str, list[Param] | None] = {}
    owner: str | None = None
    for line in api.splitlines():
        if m := class_line.match(line):
            owner = m[1]
            names.setdefault(owner, _parse_params(m[2]))
        elif m := func_line.match(line):
            owner = None
            names.setdefault(m[1], _parse_params(m[2]))
        elif owner and (m := _METHOD.match(line)):
            names.setdefault(f"{owner}.{m[1]}", _parse_params(m[2]))
    return names


def _resolve(module: Any, name: str) -> Any:
    value = module
    for part in name.split("."):
        if not hasattr(value, part):
            return None
        value = getattr(value, part)
    return value


def _mc_params(obj: Any) -> list[Param] | None:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds: dict[inspect._ParameterKind, str] = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.KEYWORD_ONLY: "kw",
    }
    return [
        Param(p.name, kinds.get(p.kind, ""))
        for p in signature.parameters.values()
        if p.name not in ("self", "ctx") and p.kind != inspect.Parameter.VAR_KEYWORD
    ]


def signature_status(spec: list[Param] | None, mine: list[Param] | None) -> str:
    """``same`` (equal parameter lists), ``extended`` (the spec's are a prefix of mc's and the
    extra ones are keyword-only), else ``differs``; data and non-callables are ``same``."""
    if spec is None or mine is None or not spec:
        return "same"
    if [p.name for p in spec] == [p.name for p in mine]:
        return "same"
    if [p.name for p in mine[: len(spec)]] == [p.name for p in spec]:
        return "extended"
    return "differs"


def module_rows(spec_module: str) -> list[Row]:
    """Rows of one spec module, each checked against mc (``ValueError`` on any mismatch)."""
    mc_name = MODULES[spec_module][1]
    mc_module = importlib.import_module(mc_name)
    rows = []
    for name, spec_params in spec_names(spec_module).items():
        declared, note = NOTES.get(name, (None, ""))
        obj = _resolve(mc_module, name)
        if declared == "absent":
            if obj is not None:
                raise ValueError(f"{name} is marked absent but {mc_name} has it")
            rows.append(Row(spec_module, name, "absent", note))
            continue
        if obj is None:
            raise ValueError(f"{mc_name} lacks {name} (spec {spec_module}); add it or mark it")
        computed = signature_status(spec_params, _mc_params(obj))
        status = declared or computed
        if computed == "differs" and status != "differs":
            raise ValueError(f"{name}: the signature differs from the spec; explain it in NOTES")
        if status in ("differs", "extended") and not note:
            raise ValueError(f"{name} is '{status}' without a note saying how")
        if declared == "extended" and computed == "differs":
            raise ValueError(f"{name}: declared extended but the spec's parameters are no prefix")
        rows.append(Row(spec_module, name, status, note))
    return rows


def _check_notes() -> None:
    known = {name for module in MODULES for name in spec_names(module)}
    unknown = set(NOTES) - known
    if unknown:
        raise ValueError(f"NOTES names that no spec module has: {sorted(unknown)}")


def _other_value(name: str, default: object) -> object:
    """A value of the field's type other than Megatron's default."""
    if isinstance(default, tuple):
        return ("all",)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, str):
        return "optim"
    if "dtype" in name:
        return torch.bfloat16
    return 1


def config_rows() -> list[Row]:
    """One row per DistributedDataParallelConfig field, its status probed: a field whose
    other value raises ``NotImplementedError`` is absent; one whose other value is accepted,
    or refused only for a missing companion setting (ValueError), is implemented."""
    defaults = DistributedDataParallelConfig()
    rows = []
    for field in dataclasses.fields(DistributedDataParallelConfig):
        default = getattr(defaults, field.name)
        note = CONFIG_NOTES.get(field.name, "")
        status = "same"
        try:
            build: Any = DistributedDataParallelConfig  # values of every field type
            build(**{field.name: _other_value(field.name, default)})
        except NotImplementedError:
            status = "absent"
            note = (
                f"accepted at Megatron's default {default!r}; any other value raises "
                "NotImplementedError naming the field"
            )
        except ValueError:
            pass  # needs a companion setting (e.g. overlap_param_gather): implemented
        rows.append(Row("DistributedDataParallelConfig", field.name, status, note))
    return rows


CONFIG_MODULE = "core.distributed.distributed_data_parallel_config"


def megatron_name(row: Row) -> str:
    """The row's full Megatron-Core name (``megatron.core.<module>.<name>``)."""
    if row.module == "DistributedDataParallelConfig":
        return f"megatron.{CONFIG_MODULE}.DistributedDataParallelConfig.{row.name}"
    return f"megatron.{row.module}.{row.name}"


def _table(rows: list[Row]) -> list[str]:
    # Each row carries an HTML id, its Megatron name, in the status cell (the name cell stays
    # `name` alone): the API reference links every mc name to its row (docs/_ext/mc_api.py).
    lines = ["| name | status | how |", "|---|---|---|"]
    lines += [
        f'| `{r.name}` | <a id="{megatron_name(r)}"></a>{r.status} | {r.note} |' for r in rows
    ]
    return lines


def _counts(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("same", "extended", "differs")}
    counts["absent"] = sum(r.status == "absent" for r in rows)
    return ", ".join(f"{n} {s}" for s, n in counts.items())


_INTRO = """\
# Compatibility with Megatron-Core

<!-- Generated by `python scripts/gen_compatibility.py`; integration_tests/test_docs.py fails
when it disagrees with the code or the spec. Edit the script's NOTES, not this file. -->

One row per public name of the three spec modules (`docs/spec/`, a copy of the team's
`../shared/spec/`: Megatron-Core's API documentation) and per field of
`DistributedDataParallelConfig`. **same**: mc has the name
with the spec's parameters, in order; **extended**: the spec's parameters, then mc's
keyword additions; **differs**: a deliberate difference, said how and why; **absent**: not
implemented (config fields: accepted only at Megatron's default). Statuses of signatures are
computed from the code and the spec each time the document is generated; behaviour beyond
the signature is held by the conformance tests (`test_conformance_*.py` in each package,
each naming the Megatron-LM unit test it follows) and the end-to-end parity tests
(`integration_tests/test_parity*.py`).
"""


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


def _check_failing_reasons() -> None:
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
        f"`docs/{suite.record.name}`; regenerate with `python scripts/gen_compatibility.py "
        f"{suite.flag} RUN.json`.\n",
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


def render() -> str:
    """The whole document (raises ``ValueError`` when code, spec and notes disagree)."""
    _check_notes()
    parts = [_INTRO]
    for spec_module, (_, mc_name) in MODULES.items():
        rows = module_rows(spec_module)
        parts.append(f"## `{spec_module}` → `{mc_name}` ({_counts(rows)})\n")
        parts.append("\n".join(_table(rows)) + "\n")
    rows = config_rows()
    parts.append(f"## `DistributedDataParallelConfig` → `mc_ddp` ({_counts(rows)})\n")
    parts.append(f'<a id="megatron.{CONFIG_MODULE}.DistributedDataParallelConfig"></a>\n')
    parts.append("\n".join(_table(rows)) + "\n")
    parts.append(DELIBERATE)
    _check_failing_reasons()
    parts += [measured_section(suite) for suite in SUITES]
    parts.append(upstream_section())
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Write the document, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument(
        "--upstream-run",
        type=Path,
        help="record this harness --json run first (docs/upstream_run.json)",
    )
    parser.add_argument(
        "--upstream-run-main",
        type=Path,
        help="record this run-main --json run first (docs/upstream_run_main.json)",
    )
    args = parser.parse_args(argv)
    if args.upstream_run is not None:
        record_run(args.upstream_run)
    if args.upstream_run_main is not None:
        record_run(args.upstream_run_main, RUN_MAIN)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        print(f"{DOC.relative_to(ROOT)} is {'out of date' if current != text else 'up to date'}")
        return int(current != text)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
