"""The sweep's building blocks: value kinds, slots and cases, the worker's context, small
models, and the registry every section module adds its slots to."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import mc_buffers as _mb
import mc_ddp as _md
import mc_finalize as _mf
import mc_groups as _mg
import mc_tp_layers as _tpl
from mc_groups import collection as _collection
from mc_groups import device as _device
from mc_groups import testing as _testing
from mc_tp_layers.random import clear_cuda_rng_tracker

mg: Any = _mg
mb: Any = _mb
md: Any = _md
mf: Any = _mf
tpl: Any = _tpl
device: Any = _device
testing: Any = _testing

NAN, INF = math.nan, math.inf
HUGE = 2**40


class Ref(NamedTuple):
    """A value built in the worker: ``Ref("pgc")`` is the worker's default collection."""

    name: str

    def __repr__(self) -> str:
        return f"<{self.name}>"


KINDS: dict[str, tuple[object, ...]] = {
    "flag": ("no", 1, 0.0),
    "size": (0, -1, 2.0, True, "2"),
    "count": (-1, 1.5, True, "0"),
    "real": (NAN, INF, -INF, "1.0", True),
    "tensor": (None, [1.0, 2.0], "x"),
    "group": (None, "tp", 0, Ref("pgc")),
    "opt_group": ("tp", 0, Ref("pgc")),
    "dtype": ("float32", torch.int64, float),
    "opt_dtype": ("float32", torch.int64),
    "device": ("nope", 2.5),
    "text": (3, b"x"),
    "opt_text": (3, b"x"),
    "collection": ("tp", Ref("world"), {"tp": None}),
    "misuse": (None,),
}
"""The sweep's bad values per kind (a slot adds its own with ``values``)."""

GOOD: dict[str, object] = {
    "flag": False,
    "size": 1,
    "count": 0,
    "real": 1.0,
    "group": Ref("world"),
    "opt_group": Ref("world"),
    "dtype": torch.float32,
    "opt_dtype": None,
    "device": "cpu",
    "text": "label",
    "opt_text": "label",
    "collection": Ref("pgc"),
}
"""A value of each kind that the slots accept (the controls' default)."""


@dataclass(frozen=True)
class Slot:
    """One place for a bad value (see the module docstring)."""

    key: str
    package: str
    kind: str
    call: Callable[..., object]  # (ctx, value); extra parameters bind loop variables
    names: tuple[str, ...]
    values: tuple[object, ...] = ()
    only: bool = False  # ``values`` replace the kind's values
    world: int = 1
    good: object = None
    has_good: bool = False

    def sweep_values(self) -> tuple[object, ...]:
        """The values the sweep tries here."""
        return self.values if self.only else (*KINDS[self.kind], *self.values)


@dataclass(frozen=True)
class Case:
    """One case: a slot and one value."""

    id: str
    package: str
    slot: Slot
    value: object

    @property
    def names(self) -> tuple[str, ...]:
        return self.slot.names

    @property
    def world(self) -> int:
        return self.slot.world


class Opaque:
    """An object of no use to any API (a stable repr, unlike ``object()``)."""

    def __repr__(self) -> str:
        return "Opaque()"


def show(value: object) -> str:
    """A short, stable text for a value (used in case ids)."""
    if isinstance(value, dict):
        inner = ", ".join(f"{show(k)}: {show(v)}" for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, torch.Tensor):
        data = value.tolist() if value.numel() <= 4 else f"{value.numel()} elements"
        return f"tensor({data}, {str(value.dtype).removeprefix('torch.')})"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is float:
        return "float (the type)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the worker's context ------------------------------------------------------------------


class Ctx:
    """What a case runs against: this worker's world and small objects built on demand."""

    def __init__(self, rank: int, world: int, store_path: str) -> None:
        self.rank = rank
        self.world = world
        self._store_path = store_path
        self._pgc: Any = None
        self._restarts = 0
        self.made: list[Any] = []

    # the world and its groups
    @property
    def world_group(self) -> Any:
        return dist.group.WORLD

    @property
    def pgc(self) -> Any:
        if self._pgc is None:
            self._pgc = mg.initialize_model_parallel(timeout=timedelta(seconds=30))
        return self._pgc

    def fresh_pgc(self, **sizes: Any) -> Any:
        pgc = mg.initialize_model_parallel(timeout=timedelta(seconds=30), **sizes)
        self.made.append(pgc)
        return pgc

    def resolve(self, value: object) -> object:
        if isinstance(value, Ref):
            return getattr(self, f"ref_{value.name}")()
        return value

    def ref_pgc(self) -> Any:
        return self.pgc

    def ref_world(self) -> Any:
        return self.world_group

    def ref_module(self) -> Any:
        return mlp()

    def ref_ddp(self) -> Any:
        return ddp(self)

    def ref_params(self) -> Any:
        return list(mlp().parameters())

    def ref_non_leaf_params(self) -> Any:
        first, *rest = mlp().parameters()
        return [first * 2, *rest]

    def ref_meta_module(self) -> Any:
        return mlp().to("meta")

    def ref_lambda(self) -> Any:
        return lambda: 1

    def run(self, case: Case) -> BaseException | None:
        """Run the case; the exception it raised, or None."""
        try:
            result = case.slot.call(self, self.resolve(case.value))
        except BaseException as err:  # classified by the runner: every kind counts
            return err
        if isinstance(result, _mg.ProcessGroupCollection):
            self.made.append(result)
        return None

    def after_case(self) -> None:
        """Undo what a case left behind (groups, defaults, switches)."""
        os.environ.pop("MC_CHECK_COLLECTIVE_SCHEDULE", None)
        _collection.clear_default_collection()
        clear_cuda_rng_tracker()
        made, self.made = self.made, []
        if not dist.is_initialized():
            self._rejoin()
            return
        for pgc in made:
            with contextlib.suppress(Exception):
                _destroy_quietly(pgc)

    def _rejoin(self) -> None:
        """A case destroyed the world group: join a new one-rank world."""
        self._restarts += 1
        self._pgc = None
        store = f"{self._store_path}.{self._restarts}"
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, 1),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
        )


def _destroy_quietly(pgc: Any) -> None:
    seen: set[int] = set()
    for _, group in pgc.items():
        if id(group) in seen or group is dist.group.WORLD:
            continue
        seen.add(id(group))
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


# -- small models --------------------------------------------------------------------------


def mlp(hidden: int = 8) -> nn.Sequential:
    """Linear(4, hidden) → tanh → Linear(hidden, 2), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def mp_config(**fields: Any) -> Any:
    return mg.ModelParallelConfig(**fields)


def tp_config(**fields: Any) -> Any:
    tp = fields.pop("tensor_model_parallel_size", 1)
    return mg.ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, **fields
    )


def ddp(
    ctx: Ctx,
    *,
    config: Any = None,
    module: Any = None,
    pgc: Any = None,
    **ddp_fields: Any,
) -> Any:
    """A DDP over :func:`mlp` on the worker's collection."""
    return md.DistributedDataParallel(
        config if config is not None else mp_config(),
        md.DistributedDataParallelConfig(**ddp_fields),
        module if module is not None else mlp(),
        pg_collection=pgc if pgc is not None else ctx.pgc,
    )


def step(model: Any, rows: int = 3) -> None:
    """A forward and backward of a batch of ones."""
    model(torch.ones(rows, 4)).sum().backward()


def ddp_step(model: Any) -> None:
    model.zero_grad_buffer()
    step(model)
    model.finish_grad_sync()


def _finalize_ready(ctx: Ctx, per_token: bool = False) -> Any:
    model = ddp(ctx, config=mp_config(calculate_per_token_loss=per_token))
    model.zero_grad_buffer()
    step(model)
    return model


def buffer(**kw: Any) -> Any:
    return mb.ParamAndGradBuffer(list(mlp().parameters()), **kw)


def column(ctx: Ctx, **kw: Any) -> Any:
    args = {"config": tp_config(), "init_method": nn.init.zeros_, "pg_collection": ctx.pgc}
    args.update(kw)
    return tpl.ColumnParallelLinear(args.pop("input_size", 4), args.pop("output_size", 6), **args)


def row(ctx: Ctx, **kw: Any) -> Any:
    args = {
        "config": tp_config(),
        "init_method": nn.init.zeros_,
        "bias": True,
        "input_is_parallel": True,
        "skip_bias_add": False,
        "pg_collection": ctx.pgc,
    }
    args.update(kw)
    return tpl.RowParallelLinear(args.pop("input_size", 6), args.pop("output_size", 4), **args)


def embedding(ctx: Ctx, **kw: Any) -> Any:
    args = {"init_method": nn.init.zeros_, "config": tp_config(), "pg_collection": ctx.pgc}
    args.update(kw)
    return tpl.VocabParallelEmbedding(
        args.pop("num_embeddings", 8), args.pop("embedding_dim", 4), **args
    )


class Router(nn.Module):
    """A router's balancing state (expert bias and quantile balancing)."""

    def __init__(self, experts: int = 2, tokens: int | None = None) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.ones(tokens or experts))
        self.register_buffer("qb_beta", torch.zeros(experts))
        self.register_buffer("qb_beta_accum", torch.ones(tokens or experts))
        self.register_buffer("qb_beta_count", torch.ones(1))


class Chunk(nn.Module):
    """A hand-made model chunk for finalize's steps (grads in ``main_grad``)."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = mp_config(**config)
        self.weight = nn.Parameter(torch.zeros(3))
        self.weight.main_grad = torch.ones(3)  # type: ignore[attr-defined]
        self.router = Router()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        del force_all_reduce

    def scale_gradients(self, scaling_factor: float) -> None:
        self.weight.main_grad.mul_(scaling_factor)  # type: ignore[attr-defined]


def chunk_with(**attrs: Any) -> Any:
    """A :class:`Chunk` whose router holds ``attrs`` instead of its buffers."""
    chunk = Chunk()
    for name, value in attrs.items():
        chunk.router._buffers.pop(name, None)
        object.__setattr__(chunk.router, name, value)
    return chunk


# -- the registry ----------------------------------------------------------------------------

SLOTS: list[Slot] = []


def arg(
    package: str,
    key: str,
    kind: str,
    call: Callable[..., object],
    names: tuple[str, ...] | None = None,
    *,
    values: tuple[object, ...] = (),
    only: bool = False,
    good: object = ...,
    world: int = 1,
    control: bool = True,
) -> None:
    """Register a slot; ``names`` default to the argument in ``key`` (``fn(arg=)``).
    ``control=False``: the slot has no good value at this world size."""
    if names is None:
        names = (key.rsplit("(", 1)[1].split("=", maxsplit=1)[0],)
    has_good = control and (good is not ... or kind in GOOD)
    SLOTS.append(
        Slot(
            key,
            package,
            kind,
            call,
            names,
            values,
            only,
            world,
            GOOD.get(kind) if good is ... else good,
            has_good and kind != "misuse",
        )
    )


def misuse(package: str, key: str, call: Callable[[Ctx], object], names: tuple[str, ...]) -> None:
    """Register a misuse sequence (one case)."""
    SLOTS.append(Slot(key, package, "misuse", lambda c, _v: call(c), names))


def two_ranks(
    package: str, key: str, call: Callable[[Ctx], object], names: tuple[str, ...]
) -> None:
    """Register a case of two ranks that disagree (``call`` reads ``ctx.rank``)."""
    SLOTS.append(Slot(key, package, "misuse", lambda c, _v: call(c), names, world=2))


def z(n: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


G = "mc-groups"
B = "mc-buffers"
D = "mc-ddp"
T = "mc-tp-layers"
F = "mc-finalize"
