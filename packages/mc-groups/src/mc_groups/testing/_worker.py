"""The rank process of a :class:`~mc_groups.testing.RankPool`.

Protocol over one pipe per rank (payloads pickled explicitly, so tensors travel by value):

    parent → rank   ("call", call_id, sys_path, (module, qualname, file), args, kwargs)
                    ("stop",)
    rank → parent   ("ready", rank, pid)
                    ("ok", call_id, result) | ("err", call_id, formatted traceback)

The worker joins the default process group once and keeps it for every call, so a test
suite pays the interpreter + torch start-up once per world size.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore  # type: ignore[attr-defined]

FunctionRef = tuple[str, str, str | None]


def _send(conn: Connection, message: tuple[object, ...]) -> None:
    conn.send_bytes(pickle.dumps(message))


def _load_by_file(module: str, path: str) -> ModuleType:
    alias = f"_mc_rank_pool_{abs(hash(path))}"
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(alias, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module!r} from {path!r}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[alias] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def resolve_function(ref: FunctionRef) -> Callable[..., Any]:
    """Import the function a parent named: by module name, else from its source file."""
    module, qualname, path = ref
    try:
        mod: ModuleType = importlib.import_module(module)
    except ImportError:
        if path is None:
            raise
        mod = _load_by_file(module, path)
    target: Any = mod
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{module}.{qualname} is not callable")
    return target  # type: ignore[no-any-return]


def _sync_sys_path(parent_path: list[str]) -> None:
    for entry in reversed(parent_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _init_process_group(
    rank: int, world_size: int, backend: str, store_path: str, pg_timeout_s: float
) -> None:
    torch.set_num_threads(1)
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    store = FileStore(store_path, world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
        device_id=device_id,
    )


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    conn: Connection,
    pg_timeout_s: float,
    env: dict[str, str],
) -> None:
    """Entry point of one rank process: join the world, then serve calls until "stop".

    ``env`` is the whole environment the rank runs with (the parent's, plus the pool's):
    a rank forked from the fork server would otherwise keep the server's.

    Every object the rank inherited from the fork server is frozen out of the garbage
    collector first (``gc.freeze()``, an O(1) move to the permanent generation): those
    module-level objects live as long as the rank anyway, and otherwise the rank's first
    full collection walks all of them (torch's and the preloaded modules', 0.1-0.3 s per
    rank) and copies every page it touches."""
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    try:
        _init_process_group(rank, world_size, backend, store_path, pg_timeout_s)
    except Exception:
        _send(conn, ("err", -1, f"rank {rank} could not join the world:\n{traceback.format_exc()}"))
        return
    _send(conn, ("ready", rank, os.getpid()))
    _serve(conn)


def _serve(conn: Connection) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent went away
        if message[0] == "stop":
            return
        _, call_id, parent_path, ref, args, kwargs = message
        try:
            _sync_sys_path(parent_path)
            result = resolve_function(ref)(*args, **kwargs)
            payload = pickle.dumps(("ok", call_id, result))
        except BaseException:  # a test's failure, reported to the parent, not fatal here
            payload = pickle.dumps(("err", call_id, traceback.format_exc()))
        conn.send_bytes(payload)
