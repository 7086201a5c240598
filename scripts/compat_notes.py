"""What ``docs/compatibility.md`` says about the names whose signature or behaviour differs
from Megatron-Core's: :data:`NOTES` (per spec name: a declared status and the note),
:data:`FSDP2_NOTES` (Megatron-Core main's FSDP2 wrapper, outside the spec pages: its
parameters, a declared status and the note), :data:`CONFIG_NOTES` (per
``DistributedDataParallelConfig`` field) and :data:`DELIBERATE` (the deliberate differences
that hold for every name). Data only: ``gen_compatibility.py``
checks each note against the code and the spec and renders the document."""

from __future__ import annotations

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
_AGREE = (
    "the constructor compares how the TP peers built the layer (one 8-byte exchange over its "
    "TP group; none in any forward): a mismatch is `TensorParallelAgreementError` on every "
    "rank"
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
        "every rank naming the fields; the same exchange compares a checksum of each param's "
        "values (an expert shard left without `allreduce=False` is refused by name), which "
        "keyword-only `check_param_values=False` skips (a model made equal by "
        "`broadcast_params()` after wrapping, Megatron's `data_parallel_random_init`)",
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
        + "; keyword-only `peer_checks=False`: `True` adds a per-step status exchange that "
        "makes one rank's failed check every rank's error (opt-in: a default call issues "
        "Megatron's collectives only); params marked "
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
    "VocabParallelEmbedding": ("extended", _RNG + "; " + _FLAGS + "; " + _AGREE),
    "VocabParallelEmbedding.forward": (
        "differs",
        "ids outside [0, num_embeddings) are an error at every TP size (CPU: ValueError "
        "before any collective; CUDA: an asynchronous device assert); Megatron embeds them "
        "to zeros at TP > 1 and raises torch's IndexError at TP = 1",
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
    "ColumnParallelLinear": ("extended", _RNG + "; " + _FLAGS + "; " + _AGREE),
    "RowParallelLinear": (
        "differs",
        _RNG
        + "; "
        + _FLAGS
        + "; "
        + _AGREE
        + "; an expert layer's bias is not tagged `sequence_parallel`: Megatron tags it, and "
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

# Megatron-Core main's core.distributed.torch_fully_sharded_data_parallel (not in the spec
# pages): name -> (Megatron's parameters as its source declares them, None for data;
# declared status or None for the computed one; note). The methods are the wrapper's own
# and the `_BaseDataParallel` ones it keeps.
_NO_HSDP = (
    "HSDP (`num_distributed_optimizer_instances` > 1) builds Megatron main's 2-D mesh "
    "(replicate: `inter_dist_opt`, shard: `intra_dp_cp`), its groups' layout checked as "
    "Megatron does. Expert-parallel params (`allreduce=False`) are sharded over an `expt_dp` "
    "mesh as in Megatron main (needing `reduce_scatter_unused_params=True`; under HSDP over "
    "`intra_expt_dp` × `inter_expt_dp`, where Megatron main uses `inter_dist_opt`). Refused "
    "by name, before anything changes: "
    "`config.gradient_accumulation_fusion` (FSDP2 has no `main_grad`), "
    "the DDP settings with no FSDP2 counterpart, and a `process_group` holding "
    "tensor-parallel peers"
)
FSDP2_NOTES: dict[str, tuple[str | None, str | None, str]] = {
    "TorchFullyShardedDataParallel": (
        "config, ddp_config, module, sub_modules_to_wrap, disable_bucketing, process_group, "
        "pg_collection",
        None,
        "`pg_collection` is keyword-only, with keyword-only `mp_policy` (FSDP2's "
        "`MixedPrecisionPolicy`; None: bf16 / fp16 compute from the config, fp32 reduction "
        "with `grad_reduce_in_fp32`); Megatron main refuses `process_group` with "
        "`pg_collection`, mc shards over `process_group` and reads `tp` from the collection "
        "to refuse a group holding TP peers. `sub_modules_to_wrap=None` is mc's structural "
        "default (the decoder layers, found as `sequence_parallel_plan` finds them, the "
        "embedding and the head; norms and tied modules stay with the root) where "
        "Megatron's default set is its own classes (`TransformerLayer`, "
        "`LanguageModelEmbedding`, `RotaryEmbedding`, `ColumnParallelLinear`); a set of "
        "classes and `_fsdp_modules` act as in Megatron. The marks are recorded per module "
        "by name and every mc reader restores them (Megatron copies `vars(param)` back once), "
        "so a later `fully_shard` by hand keeps them too. The mesh's device type is the "
        "params' (Megatron: cuda). Under `config.recompute_granularity` each wrapped module "
        "prefetches the one before it in forward order, as Megatron. With "
        "`calculate_per_token_loss` FSDP2 sums over dp, as Megatron's. " + _NO_HSDP,
    ),
    "TorchFullyShardedDataParallel.forward": ("*inputs, **kwargs", None, ""),
    "TorchFullyShardedDataParallel.no_sync": (
        "",
        None,
        "`gradient_accumulation_mode='classic'`: no reduce-scatter inside (FSDP2's "
        "`set_requires_gradient_sync(False)`), as Megatron main; `'partial_reduce_scatter'` "
        "reduce-scatters every backward and defers HSDP's all-reduce across replicas "
        "(`set_requires_all_reduce(False)`); both set "
        "`set_is_last_backward(False)` inside, and only the outermost of nested contexts "
        "changes and restores the controls (Megatron main's depth count)",
    ),
    "TorchFullyShardedDataParallel.start_grad_sync": (
        "*unused",
        None,
        "nothing to issue: FSDP2 reduce-scatters in backward, as in Megatron",
    ),
    "TorchFullyShardedDataParallel.scale_gradients": (
        "scaling_factor",
        None,
        "multiplies every local grad shard, as Megatron main (finalize's per-token scaling); "
        "a non-number is a TypeError",
    ),
    "TorchFullyShardedDataParallel.finish_grad_sync": (
        "force_all_reduce",
        None,
        "no reduction (FSDP2 finished in backward), as Megatron; with "
        "`ddp_config.check_for_nan_in_grad` it checks every local grad shard and raises "
        "`NonFiniteGradError` naming the param (Megatron checks nothing here)",
    ),
    "TorchFullyShardedDataParallel.zero_grad_buffer": (
        "",
        "differs",
        "sets every grad to None (FSDP2 accumulates into `param.grad`) and lets finalize run "
        "again; Megatron's is a no-op that leaves it to the optimizer's `zero_grad`, so a "
        "schedule that calls both gets the same numbers either way",
    ),
    "TorchFullyShardedDataParallel.broadcast_params": (
        "",
        None,
        "nothing to do, as in Megatron: each rank holds only its shard",
    ),
    "TorchFullyShardedDataParallel.state_dict": (
        "prefix, keep_vars, destination",
        "differs",
        "torch's parameter order `(destination, prefix, keep_vars)`, as mc's "
        "`DistributedDataParallel`; Megatron's base class takes `(prefix, keep_vars, "
        "destination)`: pass them by keyword. The values are FSDP2's DTensors, as in "
        "Megatron; `mc_tp_layers.full_state_dict` gives whole tensors with one-process names",
    ),
    "TorchFullyShardedDataParallel.load_state_dict": (
        "state_dict, strict",
        "differs",
        "loads (DTensor values, as `state_dict` returns; torch's `assign` added): Megatron's "
        "is a no-op (its checkpoints load in place through `dist_checkpointing`), which "
        "would drop a call silently; `mc_tp_layers.load_full_state_dict` loads whole tensors",
    ),
    "TorchFullyShardedDataParallel.state_dict_for_save_checkpoint": (
        "prefix, keep_vars",
        "absent",
        "checkpoints go through `mc_tp_layers.model_sharded_state_dict` and "
        "`mc_ddp.optimizer_sharded_state_dict` (DCP), or `mc_train.Checkpointer`",
    ),
    "TorchFullyShardedDataParallelConfig": (
        None,
        None,
        "Megatron main's four FSDP2 fields at its defaults, checked at construction",
    ),
    "TorchFullyShardedDataParallelConfig.gradient_accumulation_mode": (
        None,
        None,
        "`'classic'` or `'partial_reduce_scatter'` (see `no_sync`); another value is a ValueError",
    ),
    "TorchFullyShardedDataParallelConfig.reshard_after_forward": (
        None,
        None,
        "None (torch's automatic policy), a bool or an int >= 2, as Megatron main; 1 or "
        "another type is refused",
    ),
    "TorchFullyShardedDataParallelConfig.reduce_scatter_unused_params": (
        None,
        None,
        "FSDP2's `set_reduce_scatter_unused_params(True)` on every wrapped module",
    ),
    "TorchFullyShardedDataParallelConfig.clone_output_views": (
        None,
        "differs",
        "True is a NotImplementedError naming the field (Megatron main clones the root's "
        "and the embedding's output views before FSDP2's pre-backward hooks)",
    ),
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
  (Megatron asserts, or fails later). The types are `mc_groups.errors.InputTypeError` /
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
- **Agreement across the TP group.** Each layer's constructor compares how the TP peers
  built it, one 8-byte exchange over its TP group (no forward exchanges); the cross-entropy's
  MAX all-reduce also compares the vocabulary slice, target, `label_smoothing` and
  `ignore_index`. Megatron compares nothing: disagreeing ranks hang, abort or train on
  wrong numbers.
- **Activation checkpointing and 1-D splits.** `checkpoint` is `mc_tp_layers.random.checkpoint`
  (the DTensor checkpoint views are `mc_tp_layers.sharded_state`);
  `split_tensor_into_1d_equal_chunks` refuses a size not divisible by the TP size (Megatron
  floors it and the gather loses the rest); `CheckpointWithoutOutput` copies the recomputed
  outputs into their freed storage (Megatron shares storage through a C++ extension);
  `CudaRNGStatesTracker(use_cudagraphable_rng=True)` is a `NotImplementedError`.
- **No Megatron-FSDP, NCCL user buffers, Transformer Engine fp8/fp4 gathers, TE or
  CUDA-graph RNG trackers**: their switches exist at Megatron's defaults and any other value
  raises `NotImplementedError` naming the field.
"""
