"""What a layout check runs: the workload both runs train and the layout the ranks use,
checked once here, before any process starts."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mc_groups import validate_sizes
from mc_groups.argcheck import check_flag, check_int, check_real, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["LOSSES", "Layout", "Ref", "Workload", "function_ref", "resolve"]

LOSSES = ("auto", "vocab_parallel", "whole")
"""How the parallel run's loss reads the last stage's logits: ``auto`` (split over the
vocabulary when they are ``V/TP`` wide, whole when ``V`` wide), ``vocab_parallel``
(:func:`mc_tp_layers.vocab_parallel_cross_entropy`, always), ``whole``
(``F.cross_entropy``, always)."""

DATA_PARALLEL = ("ddp", "fsdp2")
"""The data-parallel wrappers ``build_pipeline`` puts the stages in for the check: mc DDP
(``mc_ddp.DistributedDataParallel``) or FSDP2 (``mc_ddp.TorchFullyShardedDataParallel``)."""

Ref = str | Callable[..., Any]
"""A function the ranks import by name: ``"module:function"`` or a module-level callable."""


def function_ref(name: str, value: object, *, optional: bool = False) -> str | None:
    """``value`` as ``"module:qualname"`` (a callable's file appended after ``@`` when its
    module is a script, ``__main__``, which the ranks load by path); a ``TypeError`` naming
    ``name`` for a lambda, a nested function or anything else."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        module, sep, qualname = value.partition(":")
        if not sep or not module or not qualname:
            raise InputValueError(
                f"{name}={value!r} must be 'module:function' (e.g. 'examples.hf_3d:build_model')"
            )
        return value
    if callable(value):
        where = getattr(value, "__module__", None)
        what = getattr(value, "__qualname__", None)
        if not isinstance(where, str) or not isinstance(what, str) or "<" in what:
            raise InputTypeError(
                f"{name}={value!r} must be a module-level function (the ranks import it by "
                "name); lambdas and nested functions cannot be sent"
            )
        if where == "__main__":
            path = getattr(sys.modules["__main__"], "__file__", None)
            if path is None:
                raise InputTypeError(
                    f"{name}={value!r} is defined in an interactive session; define it in a "
                    "module the ranks can import"
                )
            return f"{where}:{what}@{path}"
        return f"{where}:{what}"
    what = "'module:function' or a module-level function"
    raise InputTypeError(f"{name} must be {what}, got {type_name(value)}")


def resolve(ref: str) -> Callable[..., Any]:
    """The function ``ref`` names (:func:`function_ref`), imported in this process."""
    target, _, path = ref.partition("@")
    module_name, _, qualname = target.partition(":")
    if path:
        spec = importlib.util.spec_from_file_location("_mc_check_main", path)
        if spec is None or spec.loader is None:
            raise InputValueError(f"cannot load {ref!r} from {path!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise InputValueError(
                f"{ref!r}: cannot import {module_name!r} ({err}); run from the folder that "
                "holds it or add it to PYTHONPATH"
            ) from err
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise InputValueError(f"{ref!r}: {module_name} has no attribute {qualname!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputTypeError(f"{ref!r} names a {type_name(obj)}, not a function")
    return obj  # type: ignore[no-any-return]


def takes_layout(builder: Callable[..., Any]) -> bool:
    """The builder takes ``(config, pg_collection)`` (a model built from mc's layers for
    this rank's layout), not nothing (a whole model the check parallelizes)."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return len(required) > 0


@dataclass(frozen=True)
class Workload:
    """What the one-process run and the layout both train (the layout does not change it).

    Attributes:
        model: ``"module:function"`` returning a fresh model with the same weights on every
            call: either ``build()`` → the whole model (``nn.Linear`` / ``nn.Embedding``
            inside: a ``transformers`` or torchtitan model, your own), which the check
            converts with the plan and cuts into pipeline stages; or
            ``build(config, pg_collection)`` → this rank's model built from mc's layers
            for the layout (Megatron style: with pipeline stages, this rank's stage).
        batch: ``"module:function"``, ``batch(step) -> [B, S]`` token ids of the global
            batch of ``step`` (0-based), the same on every call; None: random ids in the
            model's vocabulary, ``B = DP · microbatches`` rows of ``seq_length``.
        forward: ``"module:function"``, a :class:`mc_train.StageForward`
            (``forward(module, x, stage) -> tensor``) calling the model (or a stage) on
            token ids or hidden states; None: :class:`mc_train.HFCausalLMForward` for a
            model whose ``forward`` takes ``input_ids`` (``transformers``), else
            :func:`mc_train.call_module`.
        sequence_first: the logits are ``[s, b, V]`` (Megatron-style models), not
            ``[b, s, V]``.
        steps: optimizer steps of both runs.
        lr: the learning rate of plain SGD (no momentum, no weight decay, no clipping), so
            that the first step moves each weight by exactly ``-lr · grad`` and the update a
            rank made is its gradient.
        seq_length: the default batch's sequence length (a multiple of TP under SP).
    """

    model: str
    batch: str | None = None
    forward: str | None = None
    sequence_first: bool = False
    steps: int = 3
    lr: float = 0.1
    seq_length: int = 16

    def __post_init__(self) -> None:
        function_ref("model", self.model)
        function_ref("batch", self.batch, optional=True)
        function_ref("forward", self.forward, optional=True)
        check_flag("sequence_first", self.sequence_first)
        check_int("steps", self.steps, minimum=1)
        check_real("lr", self.lr, positive=True, allow_zero=False)
        check_int("seq_length", self.seq_length, minimum=2)


@dataclass(frozen=True)
class Layout:
    """The parallel layout of the checked run (``tp · pp · dp`` ranks, mc's order
    ``tp-dp-pp``: TP fastest).

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline stages (a whole model is cut by :func:`mc_train.decoder_stages`).
        dp: data-parallel replicas (mc DDP).
        sequence_parallel: Megatron's sequence parallelism (``config.sequence_parallel``).
        distributed_optimizer: the optimizer state and the grad reduce-scatter sharded over
            DP (``use_distributed_optimizer``).
        overlap: ``overlap_grad_reduce`` (and with the distributed optimizer
            ``overlap_param_gather``).
        microbatches: micro-batches per step and DP rank (None: ``2 · pp``).
        loss: one of :data:`LOSSES`.
        data_parallel: one of ``DATA_PARALLEL``: ``"ddp"`` or ``"fsdp2"``.
        expert_parallel: expert-parallel size (a MoE model's experts split over ``ep``
            ranks by :func:`mc_moe.parallelize` with the model's ``ep_plan``).
        expert_tensor_parallel: expert tensor-parallel size (None: ``tp``, Megatron's
            default).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap: bool = True
    microbatches: int | None = None
    loss: str = "auto"
    data_parallel: str = "ddp"
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            check_int(name, getattr(self, name))
        for name in ("sequence_parallel", "distributed_optimizer", "overlap"):
            check_flag(name, getattr(self, name))
        if self.microbatches is not None:
            check_int("microbatches", self.microbatches)
            if self.microbatches < self.pp:
                raise InputValueError(
                    f"microbatches={self.microbatches} < pp={self.pp}: a pipeline needs at "
                    "least as many micro-batches as stages"
                )
        if self.loss not in LOSSES:
            raise InputValueError(f"loss={self.loss!r} must be one of {LOSSES}")
        if self.data_parallel not in DATA_PARALLEL:
            raise InputValueError(
                f"data_parallel={self.data_parallel!r} must be one of {DATA_PARALLEL}"
            )
        if self.data_parallel == "fsdp2" and self.distributed_optimizer:
            raise InputValueError(
                "data_parallel='fsdp2' with distributed_optimizer=True: FSDP2 shards the "
                "params and the optimizer state itself; drop the distributed optimizer"
            )
        check_int("expert_parallel", self.expert_parallel)
        validate_sizes(
            self.world_size,
            self.tp,
            self.pp,
            expert_model_parallel_size=self.expert_parallel,
            expert_tensor_parallel_size=self.expert_tensor_parallel,
        )
        if self.sequence_parallel and self.tp == 1:
            raise InputValueError(
                "sequence_parallel=True with tp=1: sequence parallelism splits activations "
                "over the TP ranks; use tp >= 2 or drop it"
            )

    @property
    def world_size(self) -> int:
        """The number of ranks the layout needs, ``tp · pp · dp``."""
        return self.tp * self.pp * self.dp

    @property
    def micro(self) -> int:
        """Micro-batches per step and DP rank."""
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    def describe(self) -> str:
        """One line: ``TP=2 × PP=2 × DP=2, SP, distributed optimizer, 4 micro-batches``."""
        parts = [f"TP={self.tp} × PP={self.pp} × DP={self.dp}"]
        if self.expert_parallel > 1 or self.expert_tensor_parallel is not None:
            etp = self.tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel
            parts.append(f"EP={self.expert_parallel} (expert TP={etp})")
        parts.append("SP" if self.sequence_parallel else "no SP")
        if self.data_parallel == "fsdp2":
            parts.append("FSDP2")
        if self.distributed_optimizer:
            parts.append("distributed optimizer")
        parts.append(f"overlap {'on' if self.overlap else 'off'}")
        parts.append(f"{self.micro} micro-batches per DP rank")
        if self.loss != "auto":
            parts.append(f"loss {self.loss}")
        return ", ".join(parts)


def check_plan(plan: object) -> Mapping[str, Any] | str | None:
    """A plan: None (the default), a mapping (sent by value) or a function reference."""
    if plan is None or isinstance(plan, Mapping):
        return plan
    ref = function_ref("plan", plan)
    assert ref is not None
    return ref
