"""The bad inputs and misuse sequences of the sweep (``scripts/sweep_bad_inputs.py``) and of
the fuzz test (``integration_tests/test_fuzz_bad_inputs.py``).

A :class:`Slot` is one place a bad value can go: an argument of a public function or
method (``mc_groups.all_reduce(async_op=)``), or a misuse sequence (``finalize twice in
one iteration``). Its ``kind`` names the family of bad values that fits there (``flag``:
non-bool values for a bool; ``size``: ints < 1, floats, bools, strings for a size; ...):
the sweep takes every value of :data:`KINDS` for the kind (plus the slot's own ``values``),
the fuzz test draws values of the same kind with hypothesis. A slot's ``names`` are the
words a clear error must contain (the argument's name, or words naming the misuse).

Everything runs in a worker process (see :mod:`integration_tests._sweep_runner`) that has
joined a gloo world of one rank (two for the slots with ``world=2``, where the ranks
disagree). The callables get a :class:`Ctx` (the worker's world, a default
``ProcessGroupCollection``, small models) and the value; values that must be built in the
worker are :class:`Ref` s. Each slot may name a ``good`` value: the same call with it must
succeed (``scripts/sweep_bad_inputs.py --controls``), which proves a case fails for its
bad value and not for a broken call around it.

Calls go through ``Any``-typed module handles: wrong types are the point.
"""

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
from mc_groups import device as _device
from mc_groups import testing as _testing

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
        os.environ.pop(mg.SCHEDULE_CHECK_ENV, None)
        mg.clear_default_collection()
        tpl.clear_cuda_rng_tracker()
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


# -- mc-groups: collectives ----------------------------------------------------------------


def w(ctx: Ctx) -> Any:
    """The worker's world group."""
    return ctx.world_group


# torch.distributed.ReduceOp members are accepted as the mc op of the same meaning (issue 20)
_OPS = ("sum", 0, None, dist.ReduceOp.BAND)


def _collective_slots() -> None:
    ops = _OPS
    # all_reduce
    arg(G, "all_reduce(tensor=)", "tensor", lambda c, v: mg.all_reduce(v, w(c)), good=z())
    arg(G, "all_reduce(group=)", "group", lambda c, v: mg.all_reduce(z(), v))
    arg(
        G,
        "all_reduce(op=)",
        "misuse",
        lambda c, v: mg.all_reduce(z(), w(c), op=v),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(G, "all_reduce(async_op=)", "flag", lambda c, v: mg.all_reduce(z(), w(c), async_op=v))
    arg(G, "all_reduce(label=)", "text", lambda c, v: mg.all_reduce(z(), w(c), label=v))
    arg(G, "all_reduce(detail=)", "text", lambda c, v: mg.all_reduce(z(), w(c), detail=v))
    # reduce_scatter
    arg(
        G,
        "reduce_scatter(output=)",
        "tensor",
        lambda c, v: mg.reduce_scatter(v, z(), w(c)),
        values=(z(3), z(4, torch.float64)),
        good=z(),
    )
    arg(
        G,
        "reduce_scatter(input=)",
        "tensor",
        lambda c, v: mg.reduce_scatter(z(), v, w(c)),
        values=(z(8),),
        good=z(),
    )
    arg(G, "reduce_scatter(group=)", "group", lambda c, v: mg.reduce_scatter(z(), z(), v))
    arg(
        G,
        "reduce_scatter(op=)",
        "misuse",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), op=v),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        G,
        "reduce_scatter(async_op=)",
        "flag",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), async_op=v),
    )
    arg(
        G,
        "reduce_scatter(received=)",
        "misuse",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), received=v),
        ("received",),
        values=("x", [0.0], z(3), z(4, torch.float64)),
        only=True,
        good=None,
    )
    arg(
        G, "reduce_scatter(label=)", "text", lambda c, v: mg.reduce_scatter(z(), z(), w(c), label=v)
    )
    arg(
        G,
        "reduce_scatter(accumulate_dtype=)",
        "opt_dtype",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), accumulate_dtype=v),
    )
    # the communicator
    arg(G, "Communicator(group=)", "group", lambda c, v: mg.Communicator(v))
    arg(
        G,
        "Communicator.reduce_scatter(pairs=)",
        "misuse",
        lambda c, v: mg.Communicator(w(c)).reduce_scatter(v),
        ("pairs",),
        values=(None, "x", [z()], [(z(3), z())], [(z(), z(), z())]),
        only=True,
        good=[(z(), z())],
    )
    arg(
        G,
        "Communicator.all_reduce(tensors=)",
        "misuse",
        lambda c, v: mg.Communicator(w(c)).all_reduce(v),
        ("tensors",),
        values=(None, z(), [None]),
        only=True,
        good=[z()],
    )
    # all_gather
    arg(
        G,
        "all_gather(output=)",
        "tensor",
        lambda c, v: mg.all_gather(v, z(), w(c)),
        values=(z(8), z(4, torch.float64)),
        good=z(),
    )
    arg(G, "all_gather(input=)", "tensor", lambda c, v: mg.all_gather(z(), v, w(c)), good=z())
    arg(G, "all_gather(group=)", "group", lambda c, v: mg.all_gather(z(), z(), v))
    arg(G, "all_gather(async_op=)", "flag", lambda c, v: mg.all_gather(z(), z(), w(c), async_op=v))
    arg(G, "all_gather(label=)", "text", lambda c, v: mg.all_gather(z(), z(), w(c), label=v))
    # broadcast
    arg(G, "broadcast(tensor=)", "tensor", lambda c, v: mg.broadcast(v, w(c)), good=z())
    arg(G, "broadcast(group=)", "group", lambda c, v: mg.broadcast(z(), v))
    arg(
        G,
        "broadcast(group_src=)",
        "misuse",
        lambda c, v: mg.broadcast(z(), w(c), group_src=v),
        ("group_src",),
        values=(-1, 1, True, 0.0, "0", None),
        only=True,
        good=0,
    )
    arg(G, "broadcast(async_op=)", "flag", lambda c, v: mg.broadcast(z(), w(c), async_op=v))
    arg(G, "broadcast(label=)", "text", lambda c, v: mg.broadcast(z(), w(c), label=v))
    # all_to_all
    splits = ("ab", [1.5], [-1], 4, [True], [5])
    arg(
        G,
        "all_to_all(output=)",
        "tensor",
        lambda c, v: mg.all_to_all(v, z(), w(c)),
        values=(z(8),),
        good=z(),
    )
    arg(G, "all_to_all(input=)", "tensor", lambda c, v: mg.all_to_all(z(), v, w(c)), good=z())
    arg(G, "all_to_all(group=)", "group", lambda c, v: mg.all_to_all(z(), z(), v))
    arg(
        G,
        "all_to_all(output_split_sizes=)",
        "misuse",
        lambda c, v: mg.all_to_all(z(), z(), w(c), output_split_sizes=v),
        ("output_split_sizes",),
        values=splits,
        only=True,
        good=[4],
    )
    arg(
        G,
        "all_to_all(input_split_sizes=)",
        "misuse",
        lambda c, v: mg.all_to_all(z(), z(), w(c), input_split_sizes=v),
        ("input_split_sizes",),
        values=splits,
        only=True,
        good=[4],
    )
    arg(G, "all_to_all(async_op=)", "flag", lambda c, v: mg.all_to_all(z(), z(), w(c), async_op=v))


def _other_collective_slots() -> None:
    ops = _OPS
    # point to point, barrier, objects
    peers = (0, 1, -1, True, "1", None)
    arg(
        G,
        "send(tensor=)",
        "tensor",
        lambda c, v: mg.send(v, w(c), group_dst=1),
        ("tensor", "group_dst"),
    )
    arg(
        G,
        "send(group=)",
        "group",
        lambda c, v: mg.send(z(), v, group_dst=1),
        ("group", "group_dst"),
        control=False,
    )
    arg(
        G,
        "send(group_dst=)",
        "misuse",
        lambda c, v: mg.send(z(), w(c), group_dst=v),
        ("group_dst",),
        values=peers,
        only=True,
    )
    arg(
        G,
        "recv(tensor=)",
        "tensor",
        lambda c, v: mg.recv(v, w(c), group_src=1),
        ("tensor", "group_src"),
    )
    arg(
        G,
        "recv(group=)",
        "group",
        lambda c, v: mg.recv(z(), v, group_src=1),
        ("group", "group_src"),
        control=False,
    )
    arg(
        G,
        "recv(group_src=)",
        "misuse",
        lambda c, v: mg.recv(z(), w(c), group_src=v),
        ("group_src",),
        values=peers,
        only=True,
    )
    arg(G, "barrier(group=)", "group", lambda c, v: mg.barrier(v))
    arg(G, "barrier(label=)", "text", lambda c, v: mg.barrier(w(c), label=v))
    arg(G, "all_gather_objects(group=)", "group", lambda c, v: mg.all_gather_objects(1, v))
    arg(
        G,
        "all_gather_objects(label=)",
        "text",
        lambda c, v: mg.all_gather_objects(1, w(c), label=v),
    )
    # coalesced batches
    arg(G, "coalesced(group=)", "group", lambda c, v: _batch(v))
    arg(G, "coalesced(async_op=)", "flag", lambda c, v: _batch(w(c), async_op=v))
    arg(
        G,
        "coalesced(device=)",
        "device",
        lambda c, v: _batch(w(c), device=v),
        values=([],),
        good=None,
    )
    arg(G, "coalesced(label=)", "text", lambda c, v: _batch(w(c), label=v))
    arg(
        G,
        "CoalescedBatch.all_reduce(tensor=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.all_reduce(v)),
        good=z(),
    )
    arg(
        G,
        "CoalescedBatch.all_reduce(op=)",
        "misuse",
        lambda c, v: _batch(w(c), lambda b: b.all_reduce(z(), op=v)),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        G,
        "CoalescedBatch.reduce_scatter(output=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.reduce_scatter(v, z())),
        values=(z(3),),
        good=z(),
    )
    arg(
        G,
        "CoalescedBatch.all_gather(input=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.all_gather(z(), v)),
        values=(z(3),),
        good=z(),
    )
    # group queries and handles
    for name in ("group_size", "group_rank", "group_ranks"):
        arg(G, f"{name}(group=)", "group", lambda c, v, n=name: getattr(mg, n)(v))
    arg(
        G,
        "CollectiveHandle.wait(timeout=)",
        "real",
        lambda c, v: mg.all_reduce(z(), w(c), async_op=True).wait(timeout=v),
        ("timeout",),
        values=(-1.0, 0.0),
    )
    arg(
        G,
        "check_collective_schedule(enabled=)",
        "flag",
        lambda c, v: _enter(mg.check_collective_schedule(v)),
    )
    arg(
        G,
        "MC_CHECK_COLLECTIVE_SCHEDULE (env)",
        "misuse",
        _switch,
        ("MC_CHECK_COLLECTIVE_SCHEDULE",),
        values=("maybe", "2", "enable"),
        only=True,
        good="1",
    )


def _batch(group: Any, add: Callable[[Any], object] | None = None, **kw: Any) -> None:
    with mg.coalesced(group, **kw) as batch:
        if add is None:
            batch.all_reduce(z())
        else:
            add(batch)
    batch.handle.wait()


def _enter(manager: Any) -> None:
    with manager:
        pass


def _switch(ctx: Ctx, value: str) -> None:
    os.environ[mg.SCHEDULE_CHECK_ENV] = value
    mg.all_reduce(z(), ctx.world_group)


# -- mc-groups: layouts, collections, config, pipeline, devices, harness ---------------------

_SIZE_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_remat_size",
    "expert_gtp_remat_size",
    "num_distributed_optimizer_instances",
)


def _layout_slots() -> None:
    for name in _SIZE_ARGS:
        extra = (HUGE,) if name == "tensor_model_parallel_size" else ()
        good = 2 if name == "virtual_pipeline_model_parallel_size" else 1
        arg(
            G,
            f"initialize_model_parallel({name}=)",
            "size",
            lambda c, v, n=name: mg.initialize_model_parallel(**{n: v}),
            values=extra,
            good=None if good == 2 else 1,
        )
        arg(
            G,
            f"validate_sizes({name}=)",
            "size",
            lambda c, v, n=name: mg.validate_sizes(8, **{n: v}),
            values=extra,
            good=None if good == 2 else 1,
        )
    arg(
        G,
        "validate_sizes(world_size=)",
        "size",
        lambda c, v: mg.validate_sizes(v),
        ("world_size",),
        values=(None, HUGE + 0.5),
        good=8,
    )
    orders = ("tp-xx", 3, None, "tp-tp", "")
    arg(
        G,
        "initialize_model_parallel(order=)",
        "misuse",
        lambda c, v: mg.initialize_model_parallel(order=v),
        ("order",),
        values=orders,
        only=True,
        good="tp-cp-ep-dp-pp",
    )
    arg(
        G,
        "initialize_model_parallel(timeout=)",
        "misuse",
        lambda c, v: mg.initialize_model_parallel(timeout=v),
        ("timeout",),
        values=(10, "10s", -1.0, timedelta(seconds=-1)),
        only=True,
        good=timedelta(seconds=30),
    )
    arg(
        G,
        "initialize_model_parallel(set_default=)",
        "flag",
        lambda c, v: mg.initialize_model_parallel(set_default=v),
    )
    # destroy
    arg(
        G,
        "destroy_model_parallel(collection=)",
        "misuse",
        lambda c, v: mg.destroy_model_parallel(v),
        ("collection",),
        values=(None, "tp", {"tp": None}, Ref("world"), 3),
        only=True,
    )
    misuse(G, "destroy_model_parallel twice", _destroy_twice, ("destroy",))
    misuse(
        G,
        "all_reduce on a destroyed collection's group",
        lambda c: _after_destroy(c, lambda p: mg.all_reduce(z(), p.tp)),
        ("destroy",),
    )
    misuse(
        G,
        "require on a destroyed collection",
        lambda c: _after_destroy(c, lambda p: p.require("dp", "a step")),
        ("destroy",),
    )
    # default collection, collections
    arg(
        G,
        "set_default_collection(collection=)",
        "misuse",
        lambda c, v: mg.set_default_collection(v),
        ("collection",),
        values=("tp", None, Ref("world"), {}),
        only=True,
        good=Ref("pgc"),
    )
    for field in ("tp", "dp", "world"):
        arg(
            G,
            f"ProcessGroupCollection({field}=)",
            "misuse",
            lambda c, v, f=field: mg.ProcessGroupCollection(**{f: v}),
            (field,),
            values=("x", 3, [Ref("world")]),
            only=True,
            good=None,
        )
    arg(
        G,
        "ProcessGroupCollection.require(name=)",
        "misuse",
        lambda c, v: c.pgc.require(v, "a step"),
        ("name",),
        values=(3, None, "nope", ""),
        only=True,
        good="tp",
    )
    arg(
        G,
        "ProcessGroupCollection.require(needed_for=)",
        "misuse",
        lambda c, v: mg.ProcessGroupCollection().require("tp", v),
        ("needed_for",),
        values=(3, None),
        only=True,
    )


def _destroy_twice(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    mg.destroy_model_parallel(pgc)
    mg.destroy_model_parallel(pgc)


def _after_destroy(ctx: Ctx, use: Callable[[Any], object]) -> None:
    pgc = ctx.fresh_pgc()
    mg.destroy_model_parallel(pgc)
    use(pgc)


def _generator_slots() -> None:
    base = {"tp": 1, "ep": 1, "dp": 1, "pp": 1, "cp": 1}

    def generate(**changes: Any) -> Any:
        return mg.RankGenerator(**{**base, **changes}).get_ranks("dp")

    for name in ("tp", "ep", "dp", "pp", "cp", "gtp_remat"):
        extra = (HUGE,) if name in ("tp", "dp") else ()
        arg(
            G,
            f"RankGenerator({name}=)",
            "size",
            lambda c, v, n=name: generate(**{n: v}),
            values=extra,
        )
    arg(
        G,
        "RankGenerator(rank_offset=)",
        "count",
        lambda c, v: generate(rank_offset=v),
        values=(None,),
    )
    arg(
        G,
        "RankGenerator(order=)",
        "misuse",
        lambda c, v: generate(order=v),
        ("order",),
        values=("tp-xx", 3, None, "tp-tp", ""),
        only=True,
        good="tp-dp",
    )
    arg(G, "RankGenerator(is_expert=)", "flag", lambda c, v: generate(is_expert=v))
    arg(
        G,
        "RankGenerator.get_ranks(token=)",
        "misuse",
        lambda c, v: mg.RankGenerator(**base).get_ranks(v),
        ("token",),
        values=(3, None, "", "tp-zz"),
        only=True,
        good="tp",
    )


_MPC_BOOLS = (
    "sequence_parallel",
    "perform_initialization",
    "use_cpu_initialization",
    "fp16",
    "bf16",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "calculate_per_token_loss",
    "delay_wgrad_compute",
    "tp_comm_overlap",
)


def _config_slots() -> None:
    for name in _SIZE_ARGS[:-1]:
        if name == "expert_gtp_remat_size":
            continue
        good = None if name.startswith(("virtual", "expert_tensor")) else 1
        arg(
            G,
            f"ModelParallelConfig({name}=)",
            "size",
            lambda c, v, n=name: mg.ModelParallelConfig(**{n: v}),
            good=good,
        )
    for name in _MPC_BOOLS:
        arg(
            G,
            f"ModelParallelConfig({name}=)",
            "flag",
            lambda c, v, n=name: mg.ModelParallelConfig(**{n: v}),
        )
    arg(
        G,
        "ModelParallelConfig(params_dtype=)",
        "dtype",
        lambda c, v: mg.ModelParallelConfig(params_dtype=v),
    )
    arg(
        G,
        "ModelParallelConfig(wgrad_deferral_limit=)",
        "count",
        lambda c, v: mg.ModelParallelConfig(wgrad_deferral_limit=v),
    )
    arg(
        G,
        "ModelParallelConfig.replace(sequence_parallel=)",
        "flag",
        lambda c, v: mg.ModelParallelConfig().replace(sequence_parallel=v),
    )


def _pipeline_slots() -> None:
    for name in (
        "pipeline_rank",
        "pipeline_size",
        "get_pipeline_next_rank",
        "get_pipeline_prev_rank",
        "is_pipeline_first_stage",
        "is_pipeline_last_stage",
    ):
        arg(
            G,
            f"{name}(pg_collection=)",
            "misuse",
            lambda c, v, n=name: getattr(mg, n)(v),
            ("pg_collection",),
            values=(None, "pp", Ref("world"), {}),
            only=True,
            good=Ref("pgc"),
        )
    for name in ("is_pipeline_first_stage", "is_pipeline_last_stage"):
        arg(
            G,
            f"{name}(vp_stage=)",
            "misuse",
            lambda c, v, n=name: getattr(mg, n)(c.pgc, vp_stage=v, vp_size=2),
            ("vp_stage",),
            values=(-1, 2, "0", True, 1.5),
            only=True,
            good=1,
        )
        arg(
            G,
            f"{name}(vp_size=)",
            "misuse",
            lambda c, v, n=name: getattr(mg, n)(c.pgc, vp_stage=0, vp_size=v),
            ("vp_size",),
            values=(0, -1, "2", True),
            only=True,
            good=2,
        )


def _device_slots() -> None:
    for name in ("current_stream", "side_stream", "synchronize", "empty_cache"):
        arg(
            G,
            f"device.{name}(device=)",
            "device",
            lambda c, v, n=name: getattr(device, n)(v),
            values=([],),
        )
    arg(
        G,
        "device.stream_scope(stream=)",
        "misuse",
        lambda c, v: _enter(device.stream_scope(v)),
        ("stream",),
        values=("x", 3),
        only=True,
        good=device.NullStream(),
    )


def _harness_slots() -> None:
    pool = testing.RankPool
    arg(G, "RankPool(world_size=)", "size", lambda c, v: pool(v), ("world_size",))
    arg(
        G,
        "RankPool(backend=)",
        "misuse",
        lambda c, v: pool(1, backend=v),
        ("backend",),
        values=("mpi", 3, None),
        only=True,
        good="gloo",
    )
    for name in ("pg_timeout_s", "call_deadline_s", "start_deadline_s", "failure_grace_s"):
        arg(G, f"RankPool({name}=)", "real", lambda c, v, n=name: pool(1, **{n: v}), values=(-1.0,))
    arg(
        G,
        "RankPool(env=)",
        "misuse",
        lambda c, v: pool(1, env=v),
        ("env",),
        values=("x", {1: "2"}, {"A": 1}),
        only=True,
        good={"A": "1"},
    )
    arg(
        G, "RankPools(pg_timeout_s=)", "real", lambda c, v: testing.RankPools(pg_timeout_s=v).get(1)
    )
    arg(
        G,
        "RankPool.run(fn=)",
        "misuse",
        lambda c, v: pool(1).run(v),
        ("fn",),
        values=(3, "fn", None, Ref("lambda")),
        only=True,
    )
    arg(G, "gpu_skip_reason(count=)", "size", lambda c, v: testing.gpu_skip_reason(v), ("count",))
    arg(
        G,
        "RankPool.run_with_deadline(deadline_s=)",
        "real",
        lambda c, v: pool(1).run_with_deadline(v, rank_of_pool),
        ("deadline_s",),
        values=(-1.0, 0.0),
        control=False,  # a good deadline starts a rank process
    )
    misuse(
        G,
        "RankPool.run with an argument that cannot travel",
        lambda c: pool(1).run(rank_of_pool, lambda: 1),
        ("picklable",),
    )
    misuse(G, "CoalescedBatch used after its with block", _batch_after_block, ("closed",))


def rank_of_pool(*args: object) -> int:
    """A function a RankPool could send to its ranks (the cases never get that far)."""
    del args
    return int(dist.get_rank())


def _batch_after_block(ctx: Ctx) -> None:
    with mg.coalesced(ctx.world_group) as batch:
        batch.all_reduce(z())
    batch.all_reduce(z())


def _argcheck_slots() -> None:
    check: Any = mg.argcheck
    arg(
        G,
        "argcheck.check_int(minimum=)",
        "misuse",
        lambda c, v: check.check_int("n", 3, minimum=v),
        ("minimum",),
        values=("1", 1.5, None),
        only=True,
        good=1,
    )
    arg(
        G,
        "argcheck.check_real(positive=)",
        "flag",
        lambda c, v: check.check_real("x", 1.0, positive=v),
    )
    arg(
        G,
        "argcheck.check_float_dtype(allow_none=)",
        "flag",
        lambda c, v: check.check_float_dtype("d", torch.float32, allow_none=v),
    )


# -- mc-finalize ----------------------------------------------------------------------------


def _finalize(ctx: Ctx, per_token: bool = False, **kw: Any) -> None:
    model = _finalize_ready(ctx, per_token)
    args = {"pg_collection": ctx.pgc}
    args.update(kw)
    mf.finalize_model_grads(args.pop("model", [model]), **args)


def _tokens(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _finalize_slots() -> None:
    arg(
        F,
        "finalize_model_grads(model=)",
        "misuse",
        lambda c, v: _finalize(c, model=v),
        ("model",),
        values=(None, "model", [None], [Ref("ddp"), "x"], Ref("ddp"), (), [Ref("module")]),
        only=True,
    )
    arg(
        F,
        "finalize_model_grads(num_tokens=)",
        "misuse",
        lambda c, v: _finalize(c, True, num_tokens=v),
        ("num_tokens",),
        values=(
            _tokens(NAN),
            _tokens(INF),
            _tokens(-INF),
            _tokens(-1, torch.int64),
            _tokens(-0.5),
            torch.tensor([]),
            [4],
            4.0,
            4,
            _tokens(4, torch.float16),
            torch.tensor([[4]]),
            None,
        ),
        only=True,
        good=_tokens(4, torch.int64),
    )
    arg(
        F,
        "finalize_model_grads(num_tokens=) without per-token loss",
        "misuse",
        lambda c, v: _finalize(c, False, num_tokens=v),
        ("num_tokens", "calculate_per_token_loss"),
        values=(_tokens(4, torch.int64),),
        only=True,
        good=None,
    )
    arg(
        F,
        "finalize_model_grads(pg_collection=)",
        "misuse",
        lambda c, v: _finalize(c, pg_collection=v),
        ("pg_collection",),
        values=("tp", Ref("world"), {"tp": None}, 3),
        only=True,
        good=Ref("pgc"),
    )
    arg(
        F,
        "finalize_model_grads(force_all_reduce=)",
        "flag",
        lambda c, v: _finalize(c, force_all_reduce=v),
    )
    arg(F, "finalize_model_grads(peer_checks=)", "flag", lambda c, v: _finalize(c, peer_checks=v))
    misuse(
        F,
        "finalize_model_grads twice in one iteration",
        _finalize_twice,
        ("finalize", "twice", "already"),
    )
    misuse(
        F, "finalize_model_grads([ddp, ddp])", _finalize_same_chunk, ("model[1]", "same", "twice")
    )
    misuse(
        F,
        "finalize_model_grads after destroy_model_parallel",
        _finalize_after_destroy,
        ("destroy",),
    )
    arg(
        F,
        "reset_model_temporary_tensors(config=)",
        "misuse",
        lambda c, v: mf.reset_model_temporary_tensors(v, [Chunk()]),
        ("config",),
        values=(None, "x", [Ref("ddp")]),
        only=True,
        good=mp_config(),
    )
    arg(
        F,
        "reset_model_temporary_tensors(model=)",
        "misuse",
        lambda c, v: mf.reset_model_temporary_tensors(mp_config(), v),
        ("model",),
        values=(None, "x", [None], Ref("module")),
        only=True,
        good=[Chunk()],
    )


def _finalize_twice(ctx: Ctx) -> None:
    model = _finalize_ready(ctx)
    mf.finalize_model_grads([model], pg_collection=ctx.pgc)
    mf.finalize_model_grads([model], pg_collection=ctx.pgc)


def _finalize_same_chunk(ctx: Ctx) -> None:
    model = _finalize_ready(ctx)
    mf.finalize_model_grads([model, model], pg_collection=ctx.pgc)


def _finalize_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    model = ddp(ctx, pgc=pgc)
    model.zero_grad_buffer()
    step(model)
    mg.destroy_model_parallel(pgc)
    mf.finalize_model_grads([model], pg_collection=pgc)


_GROUP_STEPS = (
    ("_allreduce_non_tensor_model_parallel_grads", 2),
    ("_allreduce_layernorm_grads", 2),
    ("_allreduce_conditional_embedding_grads", 2),
    ("_allreduce_router_grads", 2),
    ("_update_router_expert_bias", 2),
    ("_update_router_qb_beta", 2),
)


def _step_slots() -> None:
    config = mp_config
    for name, _ in _GROUP_STEPS:
        fn = getattr(mf, name)
        arg(
            F,
            f"{name}(model=)",
            "misuse",
            lambda c, v, f=fn: f(v, config(), c.world_group),
            ("model",),
            values=(None, "x", [None]),
            only=True,
            good=[Chunk()],
        )
        arg(
            F,
            f"{name}(config=)",
            "misuse",
            lambda c, v, f=fn: f([Chunk()], v, c.world_group),
            ("config",),
            values=(None, "x", Opaque()),
            only=True,
            good=config(),
        )
        arg(
            F,
            f"{name}(group=)",
            "opt_group",
            lambda c, v, f=fn: f([Chunk()], config(), v),
            ("group",),
        )
    gtp = mf._allreduce_replicated_grads_over_gtp_remat_group
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(gtp_remat_group=)",
        "opt_group",
        lambda c, v: gtp([Chunk()], v, None),
        ("gtp_remat_group",),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(egtp_remat_group=)",
        "opt_group",
        lambda c, v: gtp([Chunk()], None, v),
        ("egtp_remat_group",),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(calculate_per_token_loss=)",
        "flag",
        lambda c, v: gtp([Chunk()], c.world_group, None, v),
    )
    arg(
        F,
        "_allreduce_replicated_grads_over_gtp_remat_group(model=)",
        "misuse",
        lambda c, v: gtp(v, c.world_group, None),
        ("model",),
        values=(None, "x", [None]),
        only=True,
        good=[Chunk()],
    )
    tensors = mf._allreduce_tensors
    arg(
        F,
        "_allreduce_tensors(tensors=)",
        "misuse",
        lambda c, v: tensors(v, c.world_group, mg.ReduceOp.SUM, "x"),
        ("tensors",),
        values=(None, "x", [None], ["x"], z()),
        only=True,
        good=[z()],
    )
    arg(
        F,
        "_allreduce_tensors(group=)",
        "group",
        lambda c, v: tensors([z()], v, mg.ReduceOp.SUM, "x"),
    )
    arg(
        F,
        "_allreduce_tensors(op=)",
        "misuse",
        lambda c, v: tensors([z()], c.world_group, v, "x"),
        ("op",),
        values=("sum", None),
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        F,
        "_allreduce_tensors(label=)",
        "text",
        lambda c, v: tensors([z()], c.world_group, mg.ReduceOp.SUM, v),
    )
    embed = mf._allreduce_embedding_grad
    getter = mf._get_position_embedding_weight
    arg(
        F,
        "_allreduce_embedding_grad(embd_group=)",
        "opt_group",
        lambda c, v: embed([Chunk()], v, c.world_group, getter),
        ("embd_group",),
    )
    arg(
        F,
        "_allreduce_embedding_grad(pp_group=)",
        "opt_group",
        lambda c, v: embed([Chunk()], c.world_group, v, getter),
        ("pp_group",),
    )
    arg(
        F,
        "_allreduce_embedding_grad(weight_getter=)",
        "misuse",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, v),
        ("weight_getter",),
        values=(None, "x", 3),
        only=True,
        good=lambda m: None,
    )
    arg(
        F,
        "_allreduce_embedding_grad(skip_if_none=)",
        "flag",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, lambda m: None, v),
    )
    arg(
        F,
        "_allreduce_embedding_grad(config=)",
        "misuse",
        lambda c, v: embed([Chunk()], c.world_group, c.world_group, lambda m: None, True, v),
        ("config",),
        values=("x", 3),
        only=True,
        good=None,
    )
    words = mf._allreduce_word_embedding_grads
    arg(
        F,
        "_allreduce_word_embedding_grads(embd_group=)",
        "opt_group",
        lambda c, v: words([Chunk()], mp_config(), v, c.world_group),
        ("embd_group",),
    )
    arg(
        F,
        "_allreduce_word_embedding_grads(config=)",
        "misuse",
        lambda c, v: words([Chunk()], v, c.world_group, c.world_group),
        ("config",),
        values=(None, "x"),
        only=True,
        good=mp_config(),
    )
    positions = mf._allreduce_position_embedding_grads
    arg(
        F,
        "_allreduce_position_embedding_grads(pos_emb_group=)",
        "opt_group",
        lambda c, v: positions([Chunk()], mp_config(), v, c.world_group),
        ("pos_emb_group",),
    )
    arg(
        F,
        "_get_shared_word_embedding_weight(model_module=)",
        "misuse",
        lambda c, v: mf._get_shared_word_embedding_weight(v, mp_config()),
        ("model_module",),
        values=(None, "x", 3),
        only=True,
        good=Ref("module"),
    )
    arg(
        F,
        "_get_shared_word_embedding_weight(config=)",
        "misuse",
        lambda c, v: mf._get_shared_word_embedding_weight(_SharedModel(), v),
        ("config",),
        values=(None, "x"),
        only=True,
        good=mp_config(),
    )
    arg(
        F,
        "_get_position_embedding_weight(model_module=)",
        "misuse",
        lambda c, v: mf._get_position_embedding_weight(v),
        ("position_embeddings",),
        values=(None, "x"),
        only=True,
    )
    arg(
        F,
        "_get_main_grad_attr(param=)",
        "misuse",
        lambda c, v: mf._get_main_grad_attr(v),
        ("param",),
        values=(None, "x", 3),
        only=True,
        good=nn.Parameter(z()),
    )
    arg(
        F,
        "_unshard_if_dtensor(tensor=)",
        "misuse",
        lambda c, v: mf._unshard_if_dtensor(v),
        ("tensor",),
        values=(None, "x", 3),
        only=True,
        good=z(),
    )
    arg(
        F,
        "_reshard_if_dtensor(tensor_to_shard=)",
        "misuse",
        lambda c, v: mf._reshard_if_dtensor(v, z()),
        ("tensor_to_shard",),
        values=(None, "x"),
        only=True,
        good=z(),
    )
    arg(
        F,
        "_reshard_if_dtensor(reference_tensor=)",
        "misuse",
        lambda c, v: mf._reshard_if_dtensor(z(), v),
        ("reference_tensor",),
        values=(None, "x"),
        only=True,
        good=z(),
    )
    bias = mf._update_router_expert_bias
    qb = mf._update_router_qb_beta
    cfg = mp_config
    arg(
        F,
        "_update_router_expert_bias router state",
        "misuse",
        lambda c, v: bias([chunk_with(**v)], cfg(), c.world_group),
        ("local_tokens_per_expert", "expert_bias"),
        values=(
            {"local_tokens_per_expert": z(3)},
            {"local_tokens_per_expert": "x"},
            {"expert_bias": z(2, torch.int64)},
        ),
        only=True,
        good={},
    )
    arg(
        F,
        "_update_router_qb_beta router state",
        "misuse",
        lambda c, v: qb([chunk_with(**v)], cfg(), c.world_group),
        ("qb_beta_accum", "qb_beta_count", "qb_beta"),
        values=({"qb_beta_accum": z(3)}, {"qb_beta_count": "x"}, {"qb_beta": z(2, torch.int64)}),
        only=True,
        good={},
    )
    arg(
        F,
        "finalize config.moe_router_bias_update_rate",
        "misuse",
        lambda c, v: bias([Chunk()], _Cfg(moe_router_bias_update_rate=v), c.world_group),
        ("moe_router_bias_update_rate",),
        values=(NAN, -1.0, "x", True),
        only=True,
        good=0.1,
    )


class _Cfg:
    sequence_parallel = False
    calculate_per_token_loss = False

    def __init__(self, **attrs: Any) -> None:
        for key, value in attrs.items():
            setattr(self, key, value)


class _SharedModel(nn.Module):
    share_embeddings_and_output_weights = True

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(z())

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.weight


# -- mc-buffers ---------------------------------------------------------------------------


def _params() -> list[nn.Parameter]:
    return list(mlp().parameters())


def _buffer_slots() -> None:
    arg(B, "pad_to_divisor(n=)", "count", lambda c, v: mb.pad_to_divisor(v, 4))
    arg(B, "pad_to_divisor(d=)", "size", lambda c, v: mb.pad_to_divisor(4, v))
    arg(B, "pad_param_start(n=)", "count", lambda c, v: mb.pad_param_start(v))
    arg(
        B,
        "bucket_end_divisor(data_parallel_size=)",
        "size",
        lambda c, v: mb.bucket_end_divisor(v, False),
    )
    arg(
        B,
        "bucket_end_divisor(pad_for_high_nccl_busbw=)",
        "flag",
        lambda c, v: mb.bucket_end_divisor(2, v),
    )
    arg(B, "pad_bucket_end(n=)", "count", lambda c, v: mb.pad_bucket_end(v, 2, False))
    arg(
        B,
        "is_expert_parallel_param(param=)",
        "tensor",
        lambda c, v: mb.is_expert_parallel_param(v),
        ("param",),
        good=z(),
    )
    arg(
        B,
        "group_params_for_buffers(params=)",
        "misuse",
        lambda c, v: mb.group_params_for_buffers(v, False),
        ("params",),
        values=(None, "x", [None], 3),
        only=True,
        good=[],
    )
    arg(
        B,
        "group_params_for_buffers(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: mb.group_params_for_buffers(_params(), v),
    )
    arg(
        B,
        "compute_default_per_buffer_param_layout(bucket_size=)",
        "size",
        lambda c, v: mb.compute_default_per_buffer_param_layout(_params(), v),
    )
    arg(
        B,
        "compute_distributed_optimizer_param_layout(data_parallel_size=)",
        "size",
        lambda c, v: mb.compute_distributed_optimizer_param_layout(_params(), None, v),
    )
    arg(
        B,
        "compute_distributed_optimizer_param_layout(pad_buckets_for_high_nccl_busbw=)",
        "flag",
        lambda c, v: mb.compute_distributed_optimizer_param_layout(_params(), None, 2, v),
    )
    arg(
        B,
        "compute_full_param_layout(use_distributed_optimizer=)",
        "flag",
        lambda c, v: mb.compute_full_param_layout(
            _params(), None, 1, use_distributed_optimizer=v, grad_reduce_in_fp32=False
        ),
    )
    arg(
        B,
        "compute_full_param_layout(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: mb.compute_full_param_layout(
            _params(), None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=v
        ),
    )
    arg(
        B,
        "ParamAndGradBuffer(params=)",
        "misuse",
        lambda c, v: mb.ParamAndGradBuffer(v),
        ("params",),
        values=(None, "x", [None], [z()]),
        only=True,
        good=Ref("params"),
    )
    for name, kind in (
        ("param_dtype", "opt_dtype"),
        ("grad_dtype", "opt_dtype"),
        ("bucket_size", "size"),
        ("use_distributed_optimizer", "flag"),
        ("data_parallel_size", "size"),
        ("pad_buckets_for_high_nccl_busbw", "flag"),
        ("gradient_scaling_factor", "real"),
    ):
        arg(B, f"ParamAndGradBuffer({name}=)", kind, lambda c, v, n=name: buffer(**{n: v}))
    arg(
        B,
        "ParamAndGradBuffer(param_layout=)",
        "misuse",
        lambda c, v: buffer(param_layout=v),
        ("param_layout",),
        values=("x", {}),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer(param_to_name=)",
        "misuse",
        lambda c, v: buffer(param_to_name=v),
        ("param_to_name",),
        values=("x", [1]),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer(param_name_patterns_for_fp32_local_accumulation=)",
        "misuse",
        lambda c, v: buffer(param_name_patterns_for_fp32_local_accumulation=v),
        ("param_name_patterns_for_fp32_local_accumulation",),
        values=("all", [3]),
        only=True,
        good=(),
    )
    arg(
        B,
        "ParamAndGradBuffer(param_indices=)",
        "misuse",
        lambda c, v: buffer(param_indices=v),
        ("param_indices",),
        values=("x", [0]),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer.scale_gradients(scaling_factor=)",
        "real",
        lambda c, v: buffer().scale_gradients(v),
        ("scaling_factor",),
        values=(None,),
    )
    arg(
        B,
        "ParamAndGradBuffer.offload_to_cpu(move_params=)",
        "flag",
        lambda c, v: buffer().offload_to_cpu(move_params=v),
    )
    arg(
        B,
        "ParamAndGradBuffer.reload_from_cpu(move_grads=)",
        "flag",
        lambda c, v: buffer().reload_from_cpu(move_grads=v),
    )
    misuse(B, "write main_grad of an offloaded buffer", _write_offloaded, ("offload",))
    misuse(B, "read bucket grads of an offloaded buffer", _read_offloaded, ("offload",))
    arg(
        B,
        "ParamAndGradBucket.shard_range(shard_index=)",
        "misuse",
        lambda c, v: buffer().buckets[0].shard_range(v, 1),
        ("shard_index",),
        values=(-1, 1, True, "0"),
        only=True,
        good=0,
    )
    arg(
        B,
        "ParamAndGradBucket.shard_range(num_shards=)",
        "size",
        lambda c, v: buffer().buckets[0].shard_range(0, v),
        ("num_shards",),
    )
    arg(B, "shard_buffer(data_parallel_world_size=)", "size", lambda c, v: mb.shard_buffer(z(), v))
    arg(B, "shard_buffer(buffer=)", "tensor", lambda c, v: mb.shard_buffer(v, 1), good=z())
    arg(
        B,
        "build_param_and_grad_buffers(bucket_size=)",
        "size",
        lambda c, v: mb.build_param_and_grad_buffers(_params(), bucket_size=v),
    )
    arg(
        B,
        "build_param_and_grad_buffers(data_parallel_size=)",
        "size",
        lambda c, v: mb.build_param_and_grad_buffers(
            _params(), bucket_size=None, data_parallel_size=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(gradient_scaling_factor=)",
        "real",
        lambda c, v: mb.build_param_and_grad_buffers(
            _params(), bucket_size=None, gradient_scaling_factor=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(expert_gradient_scaling_factor=)",
        "real",
        lambda c, v: mb.build_param_and_grad_buffers(
            _params(), bucket_size=None, expert_gradient_scaling_factor=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: mb.build_param_and_grad_buffers(
            _params(), bucket_size=None, grad_reduce_in_fp32=v
        ),
    )


def _write_offloaded(ctx: Ctx) -> None:
    params = _params()
    buf = mb.ParamAndGradBuffer(params)
    buf.offload_to_cpu()
    params[0].main_grad.add_(1.0)  # type: ignore[attr-defined]


def _read_offloaded(ctx: Ctx) -> None:
    buf = buffer()
    buf.offload_to_cpu()
    float(buf.buckets[0].grad_data.sum())


# -- mc-ddp -------------------------------------------------------------------------------

_DDP_BOOLS = (
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "align_param_gather",
    "use_distributed_optimizer",
    "check_for_nan_in_grad",
    "check_for_large_grads",
    "pad_buckets_for_high_nccl_busbw",
    "reduce_scatter_with_fp32_accumulation",
    "average_in_collective",
    "delay_wgrad_compute",
    "disable_symmetric_registration",
    "fp8_param_gather",
    "nccl_ub",
)


def _ddp_config_slots() -> None:
    cfg = md.DistributedDataParallelConfig
    for name in _DDP_BOOLS:
        arg(
            D, f"DistributedDataParallelConfig({name}=)", "flag", lambda c, v, n=name: cfg(**{n: v})
        )
    arg(
        D,
        "DistributedDataParallelConfig(num_distributed_optimizer_instances=)",
        "size",
        lambda c, v: cfg(num_distributed_optimizer_instances=v),
    )
    for name in ("bucket_size", "num_buckets"):
        arg(
            D,
            f"DistributedDataParallelConfig({name}=)",
            "size",
            lambda c, v, n=name: cfg(**{n: v}),
            values=(HUGE + 0.5,),
        )
    arg(
        D,
        "DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=)",
        "misuse",
        lambda c, v: cfg(param_name_patterns_for_fp32_local_accumulation=v),
        ("param_name_patterns_for_fp32_local_accumulation",),
        values=("all", [3], None),
        only=True,
        good=(),
    )
    arg(
        D,
        "DistributedDataParallelConfig(data_parallel_sharding_strategy=)",
        "misuse",
        lambda c, v: cfg(data_parallel_sharding_strategy=v),
        ("data_parallel_sharding_strategy",),
        values=("optim", 3),
        only=True,
        good="no_shard",
    )


def _ddp_slots() -> None:
    d = md.DistributedDataParallel
    arg(
        D,
        "DistributedDataParallel(config=)",
        "misuse",
        lambda c, v: d(v, md.DistributedDataParallelConfig(), mlp(), pg_collection=c.pgc),
        ("config",),
        values=(None, "x", Opaque()),
        only=True,
        good=mp_config(),
    )
    arg(
        D,
        "DistributedDataParallel(ddp_config=)",
        "misuse",
        lambda c, v: d(mp_config(), v, mlp(), pg_collection=c.pgc),
        ("ddp_config",),
        values=(None, {"bucket_size": 4}),
        only=True,
        good=md.DistributedDataParallelConfig(),
    )
    arg(
        D,
        "DistributedDataParallel(module=)",
        "misuse",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), v, pg_collection=c.pgc),
        ("module",),
        values=(None, "x", [Ref("module")]),
        only=True,
        good=Ref("module"),
    )
    arg(
        D,
        "DistributedDataParallel(disable_bucketing=)",
        "flag",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), mlp(), v, c.pgc),
    )
    arg(
        D,
        "DistributedDataParallel(pg_collection=)",
        "collection",
        lambda c, v: ddp(c, pgc=v),
        ("pg_collection",),
    )
    arg(
        D,
        "DistributedDataParallel(full_param_layout=)",
        "misuse",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), mlp(), False, c.pgc, v),
        ("full_param_layout",),
        values=("x", {}),
        only=True,
        good=None,
    )
    arg(
        D,
        "DistributedDataParallel.finish_grad_sync(force_all_reduce=)",
        "flag",
        lambda c, v: _step_then(c, lambda m: m.finish_grad_sync(force_all_reduce=v)),
    )
    arg(
        D,
        "DistributedDataParallel.scale_gradients(scaling_factor=)",
        "real",
        lambda c, v: ddp(c).scale_gradients(v),
        ("scaling_factor",),
        values=(None,),
    )
    arg(
        D,
        "DistributedDataParallel.offload_grad_buffers(synchronize=)",
        "flag",
        lambda c, v: ddp(c).offload_grad_buffers(synchronize=v),
    )
    arg(
        D,
        "DistributedDataParallel.offload_grad_buffers(empty_cache=)",
        "flag",
        lambda c, v: ddp(c).offload_grad_buffers(empty_cache=v),
    )
    arg(
        D,
        "DistributedDataParallel.restore_grad_buffers(synchronize=)",
        "flag",
        lambda c, v: ddp(c).restore_grad_buffers(synchronize=v),
    )
    arg(
        D,
        "DistributedDataParallel.start_param_sync(force_sync=)",
        "flag",
        lambda c, v: ddp(c, use_distributed_optimizer=True).start_param_sync(force_sync=v),
    )
    arg(
        D,
        "DistributedDataParallel.disable_forward_pre_hook(param_sync=)",
        "flag",
        lambda c, v: ddp(
            c, use_distributed_optimizer=True, overlap_param_gather=True
        ).disable_forward_pre_hook(param_sync=v),
    )
    misuse(D, "offload_grad_buffers then backward", lambda c: _offloaded(c, step), ("offload",))
    misuse(
        D,
        "offload_grad_buffers then finish_grad_sync",
        lambda c: _offloaded(c, lambda m: m.finish_grad_sync()),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then scale_gradients",
        lambda c: _offloaded(c, lambda m: m.scale_gradients(0.5)),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then write main_grad",
        lambda c: _offloaded(c, lambda m: m.params_with_grad[0].main_grad.add_(1)),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then finalize_model_grads",
        lambda c: _offloaded(c, lambda m: mf.finalize_model_grads([m], pg_collection=c.pgc)),
        ("offload",),
    )
    misuse(D, "backward after destroy_model_parallel", _ddp_after_destroy, ("destroy",))
    misuse(
        D,
        "start_param_sync without the distributed optimizer",
        lambda c: ddp(c).start_param_sync(),
        ("use_distributed_optimizer",),
    )


def _step_then(ctx: Ctx, then: Callable[[Any], object]) -> None:
    model = ddp(ctx)
    model.zero_grad_buffer()
    step(model)
    then(model)


def _offloaded(ctx: Ctx, then: Callable[[Any], object]) -> None:
    model = ddp(ctx)
    model.zero_grad_buffer()
    model.offload_grad_buffers()
    then(model)


def _ddp_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    model = ddp(ctx, pgc=pgc)
    mg.destroy_model_parallel(pgc)
    model.zero_grad_buffer()
    step(model)
    model.finish_grad_sync()


def _optimizer(model: Any) -> Any:
    return md.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _optimizer_slots() -> None:
    arg(
        D,
        "ShardedOptimizer(optimizer=)",
        "misuse",
        lambda c, v: md.ShardedOptimizer(v, ddp(c)),
        ("optimizer",),
        values=(None, "sgd"),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer(model_chunks=)",
        "misuse",
        lambda c, v: md.ShardedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), v),
        ("model_chunks",),
        values=(None, [], "x", [Ref("module")]),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer(overlap_param_gather_with_optimizer_step=)",
        "flag",
        lambda c, v: _sharded(c, overlap_param_gather_with_optimizer_step=v),
    )
    arg(
        D,
        "ShardedOptimizer(max_grad_norm=)",
        "real",
        lambda c, v: _sharded(c, max_grad_norm=v),
        values=(0.0, -1.0, 0),
    )
    arg(
        D,
        "ShardedOptimizer(norm_type=)",
        "misuse",
        lambda c, v: _sharded(c, norm_type=v),
        ("norm_type",),
        values=("fro", "2", 0.5, 0, -2.0, NAN, True, None),
        only=True,
        good=float("inf"),
    )
    arg(
        D,
        "ShardedOptimizer(grad_scaler=)",
        "misuse",
        lambda c, v: _sharded(c, grad_scaler=v),
        ("grad_scaler",),
        values=("x", 2.0**16, Opaque()),
        only=True,
        good=None,
    )
    arg(
        D,
        "ShardedOptimizer(error_if_nonfinite=)",
        "flag",
        lambda c, v: _sharded(c, error_if_nonfinite=v),
    )
    arg(D, "ShardedOptimizer(peer_checks=)", "flag", lambda c, v: _sharded(c, peer_checks=v))
    arg(
        D,
        "ShardedOptimizer(pg_collection=)",
        "misuse",
        lambda c, v: _sharded(c, pg_collection=v),
        ("pg_collection",),
        values=("tp", Ref("world"), {"tp": None}, 3),
        only=True,
        good=Ref("pgc"),
    )
    arg(D, "ShardedOptimizer.clip_grad_norm(max_norm=)", "real", _clip, values=(0.0, -1.0))
    for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor"):
        arg(
            D,
            f"DynamicGradScaler({name}=)",
            "real",
            lambda c, v, n=name: md.DynamicGradScaler(**{n: v}),
            values={
                "initial_scale": (0.0, -1.0),
                "min_scale": (-1.0, 2.0**17),
                "growth_factor": (1.0, 0.5),
                "backoff_factor": (0.0, 1.0, 1.5),
            }[name],
            good={"initial_scale": 1024.0, "min_scale": 0.0}.get(
                name, 0.5 if "back" in name else 2.0
            ),
        )
    for name in ("growth_interval", "hysteresis"):
        arg(
            D,
            f"DynamicGradScaler({name}=)",
            "size",
            lambda c, v, n=name: md.DynamicGradScaler(**{n: v}),
        )
    arg(
        D,
        "DynamicGradScaler.update(found_inf=)",
        "flag",
        lambda c, v: md.DynamicGradScaler().update(v),
    )
    arg(
        D,
        "ShardedOptimizer.zero_grad(set_to_none=)",
        "flag",
        lambda c, v: _optimizer(ddp(c)).zero_grad(set_to_none=v),
    )
    arg(
        D,
        "ShardedOptimizer.load_state_dict(state_dict=)",
        "misuse",
        lambda c, v: _optimizer(ddp(c)).load_state_dict(v),
        ("state_dict",),
        values=(None, "x", {}, {"optimizer": {}, "master_params": "x"}),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer.load_sharded_state_dict(state_dict=)",
        "misuse",
        lambda c, v: _optimizer(ddp(c)).load_sharded_state_dict(v),
        ("state_dict",),
        values=(None, "x", {}),
        only=True,
    )
    misuse(
        D, "ShardedOptimizer.step before finish_grad_sync", _step_unsynced, ("finish_grad_sync",)
    )
    misuse(
        D,
        "ShardedOptimizer.step twice without a new backward",
        _step_twice,
        ("step", "twice", "already"),
    )
    misuse(D, "ShardedOptimizer.step after offload_grad_buffers", _step_offloaded, ("offload",))
    arg(
        D,
        "check_finite_grads(buckets=)",
        "misuse",
        lambda c, v: md.check_finite_grads(v, {}, "here"),
        ("buckets",),
        values=(None, "x", [None], []),
        only=True,
    )
    arg(
        D,
        "check_finite_grads(names=)",
        "misuse",
        lambda c, v: md.check_finite_grads(buffer().buckets, v, "here"),
        ("names",),
        values=(None, "x"),
        only=True,
        good={},
    )
    arg(
        D,
        "check_finite_grads(where=)",
        "text",
        lambda c, v: md.check_finite_grads(buffer().buckets, {}, v),
        ("where",),
    )
    arg(
        D,
        "check_finite_grads(groups=)",
        "misuse",
        lambda c, v: md.check_finite_grads(buffer().buckets, {}, "here", groups=v),
        ("groups",),
        values=("x", [None], Ref("world")),
        only=True,
        good=(),
    )
    arg(D, "LargeGradMonitor(num_buckets=)", "size", lambda c, v: md.LargeGradMonitor(v))
    arg(
        D,
        "LargeGradMonitor.check(buckets=)",
        "misuse",
        lambda c, v: md.LargeGradMonitor(1).check(v, "here"),
        ("buckets",),
        values=(None, "x", [None]),
        only=True,
    )
    rs = md.reduce_scatter_with_fp32_accumulation
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(output=)",
        "tensor",
        lambda c, v: rs(v, z(), c.world_group),
        values=(z(3),),
        good=z(),
    )
    arg(  # None is torch's default group there, as in Megatron (issue 20)
        D,
        "reduce_scatter_with_fp32_accumulation(group=)",
        "misuse",
        lambda c, v: rs(z(), z(), v),
        ("group",),
        values=("tp", 0, Ref("pgc")),
        only=True,
    )
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(op=)",
        "misuse",
        lambda c, v: rs(z(), z(), c.world_group, op=v),
        ("op",),
        values=("sum", None),
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(async_op=)",
        "flag",
        lambda c, v: rs(z(), z(), c.world_group, async_op=v),
    )
    arg(
        D,
        "ensure_params_ready(params=)",
        "misuse",
        lambda c, v: md.ensure_params_ready(v),
        ("params",),
        values=(None, 3, [None]),
        only=True,
        good=[],
    )
    arg(
        D,
        "partition_buckets(buffers=)",
        "misuse",
        lambda c, v: md.partition_buckets(v),
        ("buffers",),
        values=(None, "x", [None]),
        only=True,
        good=[],
    )
    arg(
        D,
        "partition_buckets(force_single_bucket_group=)",
        "flag",
        lambda c, v: md.partition_buckets([buffer()], v),
    )


def _clip(ctx: Ctx, max_norm: object) -> Any:
    model = ddp(ctx)
    opt = md.ShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, pg_collection=ctx.pgc
    )
    ddp_step(model)
    return opt.clip_grad_norm(max_norm)


def _sharded(ctx: Ctx, **kw: Any) -> Any:
    model = ddp(ctx)
    return md.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw)


def _step_unsynced(ctx: Ctx) -> None:
    model = ddp(ctx, overlap_grad_reduce=True)
    opt = _optimizer(model)
    model.zero_grad_buffer()
    step(model)
    opt.step()


def _step_twice(ctx: Ctx) -> None:
    model = ddp(ctx)
    opt = _optimizer(model)
    ddp_step(model)
    opt.step()
    opt.step()


def _step_offloaded(ctx: Ctx) -> None:
    model = ddp(ctx)
    opt = _optimizer(model)
    ddp_step(model)
    model.offload_grad_buffers()
    opt.step()


# -- mc-tp-layers ---------------------------------------------------------------------------

_COLUMN_FLAGS = (
    "bias",
    "gather_output",
    "keep_master_weight_for_test",
    "skip_bias_add",
    "skip_weight_param_allocation",
    "is_expert",
    "disable_grad_reduce",
)
_ROW_FLAGS = (
    "bias",
    "input_is_parallel",
    "skip_bias_add",
    "keep_master_weight_for_test",
    "is_expert",
)


def _layer_slots() -> None:
    for name in _COLUMN_FLAGS:
        arg(T, f"ColumnParallelLinear({name}=)", "flag", lambda c, v, n=name: column(c, **{n: v}))
    for name in _ROW_FLAGS:
        good = name == "input_is_parallel"
        arg(
            T,
            f"RowParallelLinear({name}=)",
            "flag",
            lambda c, v, n=name: row(c, **{n: v}),
            good=good,
        )
    for factory, layer in ((column, "ColumnParallelLinear"), (row, "RowParallelLinear")):
        f: Any = factory
        for name in ("input_size", "output_size", "stride"):
            arg(
                T,
                f"{layer}({name}=)",
                "size",
                lambda c, v, n=name, f=f: f(c, **{n: v}),
                values=(HUGE,) if name != "stride" else (),
            )
        arg(
            T,
            f"{layer}(config=)",
            "misuse",
            lambda c, v, f=f: f(c, config=v),
            ("config",),
            values=(None, "x", Opaque()),
            only=True,
            good=tp_config(),
        )
        arg(
            T,
            f"{layer}(init_method=)",
            "misuse",
            lambda c, v, f=f: f(c, init_method=v),
            ("init_method",),
            values=(None, "xavier", 3),
            only=True,
            good=nn.init.zeros_,
        )
        arg(T, f"{layer}(tp_group=)", "opt_group", lambda c, v, f=f: f(c, tp_group=v))
        arg(
            T,
            f"{layer}(pg_collection=)",
            "collection",
            lambda c, v, f=f: f(c, pg_collection=v),
            ("pg_collection",),
        )
        arg(
            T,
            f"{layer}(rng_tracker=)",
            "misuse",
            lambda c, v, f=f: f(c, rng_tracker=v),
            ("rng_tracker",),
            values=("x", 3),
            only=True,
            good=None,
        )
        arg(T, f"{layer}(device=)", "device", lambda c, v, f=f: f(c, device=v))
        arg(T, f"{layer}(name=)", "opt_text", lambda c, v, f=f: f(c, name=v))
        arg(
            T,
            f"{layer}(tp_comm_buffer_name=)",
            "opt_text",
            lambda c, v, f=f: f(c, tp_comm_buffer_name=v),
        )
        arg(
            T,
            f"{layer}(config.params_dtype=)",
            "misuse",
            lambda c, v, f=f: f(c, config=_NS(v)),
            ("params_dtype",),
            values=(torch.int64, "float32"),
            only=True,
            good=torch.float32,
        )
    arg(
        T,
        "ColumnParallelLinear(output_dtype=)",
        "opt_dtype",
        lambda c, v: column(c, output_dtype=v),
    )
    arg(
        T,
        "ColumnParallelLinear(embedding_activation_buffer=)",
        "misuse",
        lambda c, v: column(c, embedding_activation_buffer=v),
        ("embedding_activation_buffer",),
        values=("x", 3),
        only=True,
        good=None,
    )
    arg(
        T,
        "ColumnParallelLinear(grad_output_buffer=)",
        "misuse",
        lambda c, v: column(c, grad_output_buffer=v),
        ("grad_output_buffer",),
        values=("x", 3),
        only=True,
        good=None,
    )
    for name in ("num_embeddings", "embedding_dim"):
        arg(
            T,
            f"VocabParallelEmbedding({name}=)",
            "size",
            lambda c, v, n=name: embedding(c, **{n: v}),
            values=(HUGE,),
        )
    arg(
        T,
        "VocabParallelEmbedding(reduce_scatter_embeddings=)",
        "flag",
        lambda c, v: embedding(c, reduce_scatter_embeddings=v),
    )
    arg(
        T,
        "VocabParallelEmbedding(init_method=)",
        "misuse",
        lambda c, v: embedding(c, init_method=v),
        ("init_method",),
        values=(None, "x"),
        only=True,
        good=nn.init.zeros_,
    )
    arg(T, "VocabParallelEmbedding(tp_group=)", "opt_group", lambda c, v: embedding(c, tp_group=v))
    arg(T, "VocabParallelEmbedding(device=)", "device", lambda c, v: embedding(c, device=v))
    # forward calls
    arg(
        T,
        "ColumnParallelLinear.forward(input_=)",
        "tensor",
        lambda c, v: column(c)(v),
        ("input",),
        values=(torch.ones(2, 5), torch.ones(4), torch.ones(2, 4, dtype=torch.int64)),
        good=torch.ones(2, 4),
    )
    arg(
        T,
        "ColumnParallelLinear.forward(weight=)",
        "misuse",
        lambda c, v: column(c, skip_weight_param_allocation=True)(torch.ones(2, 4), weight=v),
        ("weight",),
        values=(None, "x", torch.ones(6, 5)),
        only=True,
        good=torch.ones(6, 4),
    )
    arg(
        T,
        "RowParallelLinear.forward(input_=)",
        "tensor",
        lambda c, v: row(c)(v),
        ("input",),
        values=(torch.ones(2, 5), torch.ones(6), torch.ones(2, 6, dtype=torch.int64)),
        good=torch.ones(2, 6),
    )
    ids = torch.tensor
    arg(
        T,
        "VocabParallelEmbedding.forward(input_=)",
        "misuse",
        lambda c, v: embedding(c)(v),
        ("input", "ids", "num_embeddings", "vocab"),
        values=(None, ids([8]), ids([-1]), ids([100]), ids([1.0]), [1]),
        only=True,
        good=ids([1]),
    )
    ce = tpl.vocab_parallel_cross_entropy
    logits = _logits
    arg(
        T,
        "vocab_parallel_cross_entropy(vocab_parallel_logits=)",
        "tensor",
        lambda c, v: ce(v, ids([0, 1, 2]), tp_group=c.world_group),
        ("logits",),
        values=(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(2, 8)),
        good=torch.zeros(3, 8),
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(target=)",
        "tensor",
        lambda c, v: ce(logits(), v, tp_group=c.world_group),
        ("target",),
        values=(ids([0, 1, 8]), ids([0, 1, -1]), ids([0, 1, -100]), ids([0.0, 1.0, 2.0]), ids([0])),
        good=ids([0, 1, 2]),
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(label_smoothing=)",
        "real",
        lambda c, v: ce(logits(), ids([0, 1, 2]), v, tp_group=c.world_group),
        ("label_smoothing",),
        values=(-0.1, 1.0),
        good=0.1,
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(vocab_size=)",
        "size",
        lambda c, v: ce(logits(), ids([0, 1, 2]), tp_group=c.world_group, vocab_size=v),
        ("vocab_size",),
        values=(16, 4),
        good=8,
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(tp_group=)",
        "opt_group",
        lambda c, v: ce(logits(), ids([0, 1, 2]), tp_group=v),
    )
    misuse(T, "layer forward after destroy_model_parallel", _layer_after_destroy, ("destroy",))


def _logits() -> torch.Tensor:
    return torch.zeros(3, 8, requires_grad=True)


class _NS:
    """A config whose ``params_dtype`` is the bad value (everything else valid)."""

    sequence_parallel = False
    use_cpu_initialization = True
    perform_initialization = True
    gradient_accumulation_fusion = False
    defer_embedding_wgrad_compute = False
    wgrad_deferral_limit = 0
    expert_model_parallel_size = 1
    tensor_model_parallel_size = 1
    expert_tensor_parallel_size = None
    gtp_remat_size = 1
    calculate_per_token_loss = False

    def __init__(self, params_dtype: object) -> None:
        self.params_dtype = params_dtype


def _layer_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    layer = column(ctx, pg_collection=pgc)
    mg.destroy_model_parallel(pgc)
    layer(torch.ones(2, 4, requires_grad=True))[0].sum().backward()


_MAPPINGS = (
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "all_to_all_sp2hp",
    "all_to_all_hp2sp",
)


def _function_slots() -> None:
    for name in _MAPPINGS:
        fn = getattr(tpl, name)
        arg(
            T,
            f"{name}(input_=)",
            "tensor",
            lambda c, v, f=fn: f(v, group=c.world_group),
            ("input",),
            good=torch.ones(2, 4),
        )
        arg(T, f"{name}(group=)", "opt_group", lambda c, v, f=fn: f(torch.ones(2, 4), group=v))
    for name in ("tensor_parallel_output_grad", "use_global_buffer"):
        arg(
            T,
            f"gather_from_sequence_parallel_region({name}=)",
            "flag",
            lambda c, v, n=name: tpl.gather_from_sequence_parallel_region(
                torch.ones(2, 4), group=c.world_group, **{n: v}
            ),
        )
    arg(T, "mappings.all_to_all(group=)", "group", lambda c, v: tpl.all_to_all(v, torch.ones(4)))
    arg(
        T,
        "mappings.all_to_all(input_=)",
        "tensor",
        lambda c, v: tpl.all_to_all(c.world_group, v),
        ("input",),
        good=torch.ones(4),
    )
    arg(
        T,
        "gather_from_sequence_parallel_region(output_split_sizes=)",
        "misuse",
        lambda c, v: tpl.gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=c.world_group, output_split_sizes=v
        ),
        ("output_split_sizes",),
        values=([3], "x", [1.5], [-2]),
        only=True,
        good=[2],
    )
    lin = tpl.linear_with_grad_accumulation_and_async_allreduce

    def linear(c: Ctx, **kw: Any) -> Any:
        args: dict[str, Any] = {
            "input": torch.ones(2, 4, requires_grad=True),
            "weight": torch.ones(6, 4),
            "bias": None,
            "gradient_accumulation_fusion": False,
            "allreduce_dgrad": False,
            "sequence_parallel": False,
            "tp_group": c.world_group,
        }
        args.update(kw)
        return lin(**args)

    for name in ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"):
        arg(
            T,
            f"linear_with_grad_accumulation_and_async_allreduce({name}=)",
            "flag",
            lambda c, v, n=name: linear(c, **{n: v}),
        )
    for name, values in (
        ("input", (torch.ones(2, 5), torch.ones(2, 4, dtype=torch.int64))),
        ("weight", (torch.ones(6, 5), torch.ones(6))),
        ("bias", (torch.ones(5), "x")),
    ):
        arg(
            T,
            f"linear_with_grad_accumulation_and_async_allreduce({name}=)",
            "misuse",
            lambda c, v, n=name: linear(c, **{n: v}),
            (name,),
            values=values,
            only=True,
        )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(wgrad_deferral_limit=)",
        "count",
        lambda c, v: linear(c, wgrad_deferral_limit=v),
        values=(NAN,),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(gtp_remat_size=)",
        "size",
        lambda c, v: linear(c, gtp_remat_size=v),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(output_dtype=)",
        "opt_dtype",
        lambda c, v: linear(c, output_dtype=v),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(tp_group=)",
        "opt_group",
        lambda c, v: linear(c, tp_group=v),
    )
    frozen = tpl.linear_with_frozen_weight
    for name in ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"):
        arg(
            T,
            f"linear_with_frozen_weight({name}=)",
            "flag",
            lambda c, v, n=name: frozen(**{**_FROZEN, n: v, "tp_group": c.world_group}),
        )
    arg(
        T,
        "linear_with_frozen_weight(tp_group=)",
        "opt_group",
        lambda c, v: frozen(**{**_FROZEN, "tp_group": v}),
    )
    arg(
        T,
        "linear_with_frozen_weight(weight=)",
        "misuse",
        lambda c, v: frozen(**{**_FROZEN, "weight": v, "tp_group": c.world_group}),
        ("weight",),
        values=(torch.ones(6, 5), None),
        only=True,
    )
    # utilities and attributes
    arg(
        T,
        "divide(numerator=)",
        "count",
        lambda c, v: tpl.divide(v, 2),
        ("numerator",),
        values=(5,),
        good=4,
    )
    arg(T, "divide(denominator=)", "size", lambda c, v: tpl.divide(4, v), ("denominator",), good=2)
    arg(
        T,
        "split_tensor_along_last_dim(num_partitions=)",
        "size",
        lambda c, v: tpl.split_tensor_along_last_dim(torch.ones(2, 4), v),
        ("num_partitions",),
        values=(3,),
    )
    arg(
        T,
        "split_tensor_along_last_dim(tensor=)",
        "tensor",
        lambda c, v: tpl.split_tensor_along_last_dim(v, 2),
        ("tensor",),
        good=torch.ones(2, 4),
    )
    arg(
        T,
        "split_tensor_along_last_dim(contiguous_split_chunks=)",
        "flag",
        lambda c, v: tpl.split_tensor_along_last_dim(torch.ones(2, 4), 2, v),
    )
    vu = tpl.VocabUtility
    for name, call in (
        ("global_vocab_size", lambda v: vu.vocab_range_from_global_vocab_size(v, 0, 2)),
        ("rank", lambda v: vu.vocab_range_from_global_vocab_size(8, v, 2)),
        (
            "per_partition_vocab_size",
            lambda v: vu.vocab_range_from_per_partition_vocab_size(v, 0, 2),
        ),
    ):
        arg(
            T,
            f"VocabUtility.vocab_range_*({name}=)",
            "count",
            lambda c, v, f=call: f(v),
            (name,),
            values=(-8, 2) if name == "rank" else (-8,),
            good=0 if name == "rank" else 8,
        )
    sta = tpl.set_tensor_model_parallel_attributes
    arg(
        T,
        "set_tensor_model_parallel_attributes(tensor=)",
        "tensor",
        lambda c, v: sta(v, True, 0, 1),
        ("tensor",),
        good=nn.Parameter(torch.ones(2, 2)),
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(is_parallel=)",
        "flag",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), v, 0, 1),
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(dim=)",
        "misuse",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), True, v, 1),
        ("dim",),
        values=(5, -3, "0", True, 1.0),
        only=True,
        good=1,
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(stride=)",
        "size",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), True, 0, v),
        ("stride",),
    )
    for name in (
        "set_defaults_if_not_set_tensor_model_parallel_attributes",
        "param_is_not_gtp_duplicate",
    ):
        arg(
            T,
            f"{name}(tensor=)",
            "tensor",
            lambda c, v, n=name: getattr(tpl, n)(v),
            ("tensor", "param"),
            good=nn.Parameter(z()),
        )
    arg(
        T,
        "param_is_not_tensor_parallel_duplicate(param=)",
        "tensor",
        lambda c, v: tpl.param_is_not_tensor_parallel_duplicate(v, c.world_group),
        ("param",),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "param_is_not_tensor_parallel_duplicate(tp_group=)",
        "opt_group",
        lambda c, v: tpl.param_is_not_tensor_parallel_duplicate(nn.Parameter(z()), v),
    )
    arg(
        T,
        "copy_tensor_model_parallel_attributes(source_tensor=)",
        "tensor",
        lambda c, v: tpl.copy_tensor_model_parallel_attributes(nn.Parameter(z()), v),
        ("source", "tensor"),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "copy_gtp_attributes(destination=)",
        "tensor",
        lambda c, v: tpl.copy_gtp_attributes(v, nn.Parameter(z())),
        ("destination",),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "gtp_local_pad_zero_count(range_start=)",
        "misuse",
        lambda c, v: tpl.gtp_local_pad_zero_count(z(), v, 4),
        ("range_start",),
        values=(-1, 5, "0", 1.5),
        only=True,
        good=0,
    )
    arg(
        T,
        "gtp_local_pad_zero_count(gtp_shard=)",
        "tensor",
        lambda c, v: tpl.gtp_local_pad_zero_count(v, 0, 4),
        ("gtp_shard",),
        good=z(),
    )
    arg(
        T,
        "shard_weight_for_gtp(group=)",
        "group",
        lambda c, v: tpl.shard_weight_for_gtp(nn.Parameter(torch.ones(4, 2)), v),
    )
    arg(
        T,
        "shard_weight_for_gtp(weight=)",
        "tensor",
        lambda c, v: tpl.shard_weight_for_gtp(v, c.world_group),
        ("weight",),
        good=nn.Parameter(torch.ones(4, 2)),
    )
    arg(
        T,
        "shard_weight_for_gtp(calculate_per_token_loss=)",
        "flag",
        lambda c, v: tpl.shard_weight_for_gtp(
            nn.Parameter(torch.ones(4, 2)), c.world_group, calculate_per_token_loss=v
        ),
    )
    arg(
        T,
        "tp_sharded_tensor(partition_dim=)",
        "misuse",
        lambda c, v: tpl.tp_sharded_tensor(torch.ones(2, 2), c.world_group, v),
        ("partition_dim",),
        values=(5, -3, "0", None),
        only=True,
        good=0,
    )
    arg(
        T,
        "tp_sharded_tensor(stride=)",
        "size",
        lambda c, v: tpl.tp_sharded_tensor(torch.ones(2, 2), c.world_group, 0, v),
        ("stride",),
    )
    arg(
        T,
        "tp_sharded_tensor(tp_group=)",
        "group",
        lambda c, v: tpl.tp_sharded_tensor(torch.ones(2, 2), v, 0),
    )
    arg(
        T,
        "drain_embedding_wgrad_compute(weight=)",
        "misuse",
        lambda c, v: tpl.drain_embedding_wgrad_compute(
            tp_config(), [torch.ones(2, 4)], [torch.ones(2, 6)], v, c.world_group
        ),
        ("weight", "main_grad"),
        values=(None, torch.ones(6, 4)),
        only=True,
    )
    misuse(
        T,
        "drain_embedding_wgrad_compute keeps its buffers when it fails",
        _drain_keeps,
        ("weight", "main_grad"),
    )


_FROZEN: dict[str, Any] = {
    "input": torch.ones(2, 4),
    "weight": torch.ones(6, 4),
    "bias": None,
    "gradient_accumulation_fusion": False,
    "allreduce_dgrad": False,
    "sequence_parallel": False,
}


def _drain_keeps(ctx: Ctx) -> None:
    acts, grads = [torch.ones(2, 4)], [torch.ones(2, 6)]
    try:
        tpl.drain_embedding_wgrad_compute(
            tp_config(), acts, grads, torch.ones(6, 4), ctx.world_group
        )
    except (TypeError, ValueError):
        if len(acts) == 1 and len(grads) == 1:
            raise
        raise AttributeError(
            "drain_embedding_wgrad_compute emptied its buffers, then failed"
        ) from None


def _rng_slots() -> None:
    tracker = tpl.RNGStatesTracker
    arg(T, "RNGStatesTracker(device=)", "device", lambda c, v: tracker(v), values=(None,))
    arg(
        T,
        "RNGStatesTracker.add(name=)",
        "misuse",
        lambda c, v: tracker().add(v, 1),
        ("name",),
        values=(3, None, ""),
        only=True,
        good="a",
    )
    arg(
        T,
        "RNGStatesTracker.add(seed=)",
        "misuse",
        lambda c, v: tracker().add("a", v),
        ("seed",),
        values=("1", 1.5, True, None, -1, 2**70),
        only=True,
        good=1,
    )
    arg(
        T,
        "RNGStatesTracker.set_states(states=)",
        "misuse",
        lambda c, v: tracker().set_states(v),
        ("states",),
        values=(None, "x", {"a": z()}, {3: torch.get_rng_state()}),
        only=True,
        good={},
    )
    arg(
        T,
        "RNGStatesTracker.fork(name=)",
        "misuse",
        lambda c, v: _enter(tracker().fork(v)),
        ("name", "stream"),
        values=(3, None, "nope"),
        only=True,
    )
    arg(
        T,
        "set_cuda_rng_tracker(tracker=)",
        "misuse",
        lambda c, v: tpl.set_cuda_rng_tracker(v),
        ("tracker",),
        values=(None, "x"),
        only=True,
        good=tracker(),
    )
    seed = tpl.model_parallel_cuda_manual_seed
    arg(
        T,
        "model_parallel_cuda_manual_seed(seed=)",
        "misuse",
        lambda c, v: seed(v, pg_collection=c.pgc),
        ("seed",),
        values=("1", 1.5, True, None, -1),
        only=True,
        good=1,
    )
    for name in (
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "force_reset_rng",
        "set_default",
    ):
        arg(
            T,
            f"model_parallel_cuda_manual_seed({name}=)",
            "flag",
            lambda c, v, n=name: seed(1, **{n: v}, pg_collection=c.pgc),
        )
    for name in ("tp_rank", "ep_rank", "etp_rank"):
        arg(
            T,
            f"model_parallel_cuda_manual_seed({name}=)",
            "count",
            lambda c, v, n=name: seed(1, **{n: v}, pg_collection=c.pgc),
            good=0,
        )
    arg(
        T,
        "model_parallel_cuda_manual_seed(device=)",
        "device",
        lambda c, v: seed(1, device=v, pg_collection=c.pgc),
    )
    arg(
        T,
        "model_parallel_cuda_manual_seed(pg_collection=)",
        "collection",
        lambda c, v: seed(1, pg_collection=v),
        ("pg_collection",),
    )


# -- two ranks that disagree ------------------------------------------------------------------


def _two_rank_world(**sizes: Any) -> Any:
    return mg.initialize_model_parallel(timeout=timedelta(seconds=8), **sizes)


def _ddp_disagree(ctx: Ctx, field: str, mine: object, theirs: object, **same: Any) -> None:
    """Rank 0 builds its DDP with ``field=mine``, rank 1 with ``theirs`` (``same`` on both;
    a bucket size of 4 elements with overlap makes several buckets, so a disagreement
    changes the collectives; bf16 params make grad_reduce_in_fp32 change the grad dtype)."""
    pgc = _two_rank_world()
    fields = {"overlap_grad_reduce": True, "bucket_size": 4, **same}
    fields[field] = mine if ctx.rank == 0 else theirs
    module = mlp().to(torch.bfloat16) if field == "grad_reduce_in_fp32" else None
    model = ddp(ctx, pgc=pgc, module=module, **fields)
    model.zero_grad_buffer()
    model(torch.ones(3, 4, dtype=next(model.parameters()).dtype)).sum().backward()
    model.finish_grad_sync()


def _ddp_hidden(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, module=mlp(8 if ctx.rank == 0 else 6))
    ddp_step(model)


def _ddp_per_token(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, config=mp_config(calculate_per_token_loss=ctx.rank == 0))
    ddp_step(model)
    mf.finalize_model_grads([model], pg_collection=pgc)


def _tokens_on_one_rank(ctx: Ctx) -> None:
    pgc = _two_rank_world()
    model = ddp(ctx, pgc=pgc, config=mp_config(calculate_per_token_loss=True))
    model.zero_grad_buffer()
    step(model)
    tokens = _tokens(3, torch.int64) if ctx.rank == 0 else None
    mf.finalize_model_grads([model], num_tokens=tokens, pg_collection=pgc)


def _tp_disagree(ctx: Ctx) -> None:
    mg.initialize_model_parallel(
        tensor_model_parallel_size=2 if ctx.rank == 0 else 1, timeout=timedelta(seconds=8)
    )


def _init_disagree(ctx: Ctx, **sizes: Any) -> None:
    mine = {k: v[ctx.rank] for k, v in sizes.items()}
    mg.initialize_model_parallel(timeout=timedelta(seconds=8), **mine)


def _tp2(ctx: Ctx) -> tuple[Any, Any]:
    pgc = _two_rank_world(tensor_model_parallel_size=2)
    return pgc, tp_config(tensor_model_parallel_size=2)


def _column_input(ctx: Ctx) -> None:
    pgc, cfg = _tp2(ctx)
    size = 4 if ctx.rank == 0 else 6
    layer = tpl.ColumnParallelLinear(
        size, 4, config=cfg, init_method=nn.init.ones_, pg_collection=pgc, gather_output=True
    )
    layer(torch.ones(2, size, requires_grad=True))[0].sum().backward()


def _row_output(ctx: Ctx, equal_numel: bool) -> None:
    pgc, cfg = _tp2(ctx)
    out = 6 if ctx.rank == 0 else 4
    rows = (2 if ctx.rank == 0 else 3) if equal_numel else 2
    layer = tpl.RowParallelLinear(
        4,
        out,
        config=cfg,
        init_method=nn.init.ones_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
        pg_collection=pgc,
    )
    layer(torch.ones(rows, 2, requires_grad=True))[0].sum().backward()


def _embeddings(ctx: Ctx) -> None:
    pgc, cfg = _tp2(ctx)
    vocab = 8 if ctx.rank == 0 else 10
    layer = tpl.VocabParallelEmbedding(
        vocab, 4, init_method=nn.init.ones_, config=cfg, pg_collection=pgc
    )
    layer(torch.tensor([[1, 5]])).sum().backward()


def _cross_entropy(ctx: Ctx) -> None:
    pgc, _ = _tp2(ctx)
    slice_size = 4 if ctx.rank == 0 else 5
    logits = torch.zeros(3, slice_size, requires_grad=True)
    tpl.vocab_parallel_cross_entropy(
        logits, torch.tensor([0, 1, 2]), tp_group=pgc.tp
    ).sum().backward()


def _checked(fn: Callable[[Ctx], object]) -> Callable[[Ctx], object]:
    def run(ctx: Ctx) -> object:
        os.environ[mg.SCHEDULE_CHECK_ENV] = "1"
        return fn(ctx)

    return run


_DISAGREEMENTS: tuple[tuple[str, str, Callable[[Ctx], object], tuple[str, ...]], ...] = (
    (G, "initialize_model_parallel: tp differs", _tp_disagree, ("tensor_model_parallel_size",)),
    (
        G,
        "initialize_model_parallel: pp differs",
        lambda c: _init_disagree(c, pipeline_model_parallel_size=(2, 1)),
        ("pipeline_model_parallel_size",),
    ),
    (
        G,
        "initialize_model_parallel: order differs",
        lambda c: _init_disagree(
            c, tensor_model_parallel_size=(2, 2), order=("tp-dp-pp", "dp-tp-pp")
        ),
        ("order",),
    ),
    (
        G,
        "initialize_model_parallel: optimizer instances differ",
        lambda c: _init_disagree(c, num_distributed_optimizer_instances=(2, 1)),
        ("num_distributed_optimizer_instances",),
    ),
    (
        G,
        "initialize_model_parallel: cp differs",
        lambda c: _init_disagree(c, context_parallel_size=(2, 1)),
        ("context_parallel_size",),
    ),
    (F, "finalize_model_grads: num_tokens on one rank only", _tokens_on_one_rank, ("num_tokens",)),
    (
        D,
        "DDP: bucket_size differs",
        lambda c: _ddp_disagree(c, "bucket_size", 4, None),
        ("bucket_size",),
    ),
    (D, "DDP: hidden sizes differ", _ddp_hidden, ("shape", "param", "numel")),
    (
        D,
        "DDP: overlap_grad_reduce differs",
        lambda c: _ddp_disagree(c, "overlap_grad_reduce", True, False),
        ("overlap_grad_reduce",),
    ),
    (
        D,
        "DDP: grad_reduce_in_fp32 differs",
        lambda c: _ddp_disagree(c, "grad_reduce_in_fp32", True, False),
        ("grad_reduce_in_fp32",),
    ),
    (
        D,
        "DDP: use_distributed_optimizer differs",
        lambda c: _ddp_disagree(c, "use_distributed_optimizer", True, False),
        ("use_distributed_optimizer",),
    ),
    (
        D,
        "DDP: check_for_nan_in_grad differs",
        lambda c: _ddp_disagree(c, "check_for_nan_in_grad", True, False),
        ("check_for_nan_in_grad",),
    ),
    (D, "DDP: calculate_per_token_loss differs", _ddp_per_token, ("calculate_per_token_loss",)),
    (T, "ColumnParallelLinear: input_size differs", _column_input, ("input_size",)),
    (
        T,
        "RowParallelLinear: output_size differs",
        lambda c: _row_output(c, False),
        ("output_size",),
    ),
    (
        T,
        "RowParallelLinear: output_size differs at equal numel",
        lambda c: _row_output(c, True),
        ("output_size",),
    ),
    (T, "VocabParallelEmbedding: num_embeddings differs", _embeddings, ("num_embeddings",)),
    (T, "vocab_parallel_cross_entropy: vocab slice differs", _cross_entropy, ("vocab", "logits")),
)


def _two_rank_slots() -> None:
    for package, key, fn, names in _DISAGREEMENTS:
        two_ranks(package, key, fn, names)
    for package, key, fn, names in _DISAGREEMENTS:
        if key.startswith("initialize_model_parallel: ") and "tp" not in key:
            continue
        two_ranks(package, f"{key} (schedule check on)", _checked(fn), names)


for _register in (
    _collective_slots,
    _other_collective_slots,
    _layout_slots,
    _generator_slots,
    _config_slots,
    _pipeline_slots,
    _device_slots,
    _harness_slots,
    _argcheck_slots,
    _finalize_slots,
    _step_slots,
    _buffer_slots,
    _ddp_config_slots,
    _ddp_slots,
    _optimizer_slots,
    _layer_slots,
    _function_slots,
    _rng_slots,
    _two_rank_slots,
):
    _register()

SLOT_BY_KEY: dict[str, Slot] = {s.key: s for s in SLOTS}
if len(SLOT_BY_KEY) != len(SLOTS):  # a key names one slot (the fuzz test sends keys)
    raise RuntimeError(f"duplicate slot keys: {len(SLOTS) - len(SLOT_BY_KEY)}")


def all_cases() -> list[Case]:
    """Every case of the sweep, in a stable order."""
    cases = []
    for slot in SLOTS:
        for value in slot.sweep_values():
            cid = (
                slot.key
                if slot.kind == "misuse" and value is None and not slot.values
                else (f"{slot.key} <- {show(value)}")
            )
            cases.append(Case(cid, slot.package, slot, value))
    return cases


_BY_ID: dict[str, Case] = {}


def case_by_id(case_id: str) -> Case:
    """The case named ``case_id`` (ids are unique)."""
    if not _BY_ID:
        every = [*all_cases(), *control_cases()]
        _BY_ID.update({c.id: c for c in every})
        if len(_BY_ID) != len(every):
            raise RuntimeError(f"duplicate case ids: {len(every) - len(_BY_ID)}")
    return _BY_ID[case_id]


def case_for(slot_key: str, value: object) -> Case:
    """A case for a drawn value (the fuzz test)."""
    slot = SLOT_BY_KEY[slot_key]
    return Case(f"{slot_key} <- {show(value)}", slot.package, slot, value)


def control_cases() -> list[Case]:
    """Each slot with its good value: must succeed (checks the sweep itself)."""
    return [
        Case(f"{s.key} <- (good) {show(s.good)}", s.package, s, s.good)
        for s in SLOTS
        if s.has_good and s.world == 1
    ]
