"""Checks of :class:`~mc_ddp.DistributedDataParallel`'s inputs, run before anything is built
or communicated; each error names the argument, the value and the fix."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_groups import config as mc_config
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError

Param = torch.nn.Parameter
# What DDP cannot do without (the grads' scaling before the collective).
_CONFIG_FIELDS = ("calculate_per_token_loss",)


def check_config(config: object) -> None:
    """``config`` must carry a bool ``calculate_per_token_loss``; every other field mc
    reads that it has must have the field's type (:func:`mc_groups.config.check_config`)."""
    mc_config.check_config(config, "DistributedDataParallel", required=_CONFIG_FIELDS)


def check_ddp_config(ddp_config: object) -> DistributedDataParallelConfig:
    """A :class:`DistributedDataParallelConfig`, re-validated (fields may have been set
    after construction)."""
    if not isinstance(ddp_config, DistributedDataParallelConfig):
        raise InputTypeError(
            f"ddp_config={type_name(ddp_config)} must be a mc_ddp.DistributedDataParallelConfig"
        )
    ddp_config.validate()  # also refuses the Megatron fields mc does not implement
    return ddp_config


def trainable_params(module: object) -> list[tuple[str, Param]]:
    """``(name, param)`` of the params that require grad, in registration order: plain
    tensors on one device. A DTensor param (torch's ``parallelize_module`` or
    ``distribute_tensor``, FSDP2's ``fully_shard``) is refused: DDP reduces every local
    tensor over its data-parallel groups, which would average different shards (a
    DTensor's experts sharded over ranks that DDP treats as replicas) or fail in
    backward (its grad a DTensor, ``main_grad`` not)."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module={type_name(module)} must be a torch.nn.Module")
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    for name, param in named:
        if dtensors.is_dtensor(param):
            raise InputTypeError(
                f"module param '{name}' is a DTensor ({param.placements} on "  # type: ignore[attr-defined]
                f"{param.device_mesh}); mc DDP reduces plain tensors: build TP layers with "  # type: ignore[attr-defined]
                "mc_tp_layers.parallelize and experts with mc_moe.parallelize (plain local "
                "tensors, marked), or train a DTensor model under "
                "mc_ddp.TorchFullyShardedDataParallel (FSDP2)"
            )
    if not named:
        raise InputValueError(
            f"module={type_name(module)} has no parameter with requires_grad=True: DDP "
            "has no gradient to reduce; unfreeze some params or do not wrap the module"
        )
    first_name, first = named[0]
    for name, param in named[1:]:
        if param.device != first.device:
            raise InputValueError(
                f"module params are on mixed devices: '{name}' is on {param.device} but "
                f"'{first_name}' is on {first.device}; move the module to one device "
                "(module.to(device)) before wrapping it"
            )
    return named


def check_materialised(named: list[tuple[str, Param]], group: dist.ProcessGroup) -> None:
    """Params on the meta device only over torch's ``"fake"`` backend (a dry run counts
    memory and collectives without data); over a real one the first reduction of a meta
    buffer fails inside the backend, after the step began."""
    name, first = named[0]
    if first.device.type == "meta" and dist.get_backend(group) != "fake":
        raise InputValueError(
            f"module has its params on the meta device ('{name}' and the rest) and the data-"
            f"parallel group runs {dist.get_backend(group)!r}: there is nothing to reduce "
            "or train; materialise them first (module.to_empty(device=...), then load the "
            "weights, e.g. mc_tp_layers.load_full_state_dict)"
        )


PARAM_FLAGS = (
    param_attrs.SKIP_BACKWARD_POST_HOOK,
    param_attrs.GRAD_ADDED_TO_MAIN_GRAD,
    param_attrs.ZERO_OUT_WGRAD,
)
"""Bool attributes of a param that DDP reads (set by layers or by the user)."""


def check_param_flags(named: list[tuple[str, Param]]) -> None:
    """Every :data:`PARAM_FLAGS` attribute a param carries is a bool."""
    for name, param in named:
        for attr in PARAM_FLAGS:
            param_attrs.bool_attr(param, attr, False, name)


def find_wgrad_hook_owner(module: torch.nn.Module, param: Param, name: str) -> torch.nn.Module:
    """The submodule owning ``param`` that offers ``register_wgrad_accumulation_and_reduce_hooks``
    (needed for a ``skip_backward_post_hook`` param under ``delay_wgrad_compute``)."""
    for sub in module.modules():
        if not hasattr(sub, "register_wgrad_accumulation_and_reduce_hooks"):
            continue
        if any(p is param for p in sub.parameters(recurse=False)):
            return sub
    raise InputValueError(
        f"param '{name}' has skip_backward_post_hook=True and delay_wgrad_compute=True, but "
        "no module owning it has register_wgrad_accumulation_and_reduce_hooks(); use a layer "
        "that computes its wgrad in backward_dw(), or clear skip_backward_post_hook"
    )


def check_compiled_modules(
    module: torch.nn.Module, ddp_config: DistributedDataParallelConfig
) -> None:
    """With ``overlap_param_gather`` (distributed optimizer), no module compiled in place.

    DDP waits for a module's param all-gather in a forward pre-hook. A block compiled with
    ``torch.compile(block)`` (a wrapper) or ``block.forward = torch.compile(block.forward)``
    keeps its own pre-hook outside the graph, which waits for the whole block; one compiled
    in place (``block.compile()``) runs its own hooks inside the graph, where nothing can
    wait for a gather, so its params would be read before they arrived.
    """
    if not (ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
        return
    for name, sub in module.named_modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            raise InputValueError(
                f"module '{name or '(the root)'}' was compiled in place ({type_name(sub)}"
                ".compile()), so DDP's param-gather pre-hook would run inside its graph "
                "(overlap_param_gather=True); compile it as torch.compile(module) or "
                "module.forward = torch.compile(module.forward) before wrapping (its hooks "
                "run outside the graph), or set overlap_param_gather=False"
            )
