"""spawn-safety, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

import os

from ...events import RAISED, Recorded, declare
from ...runs import Probe

MAX_DEPTH = 12

FRESH_IMPORT_TIMEOUT_S = 90.0

PICKLE_LIMIT = 64 * 2**20  # bytes of pickle written before a check gives up (a large in-memory dataset)


class _TooLarge(Exception):
    pass


class _Sink:
    """A file that counts what pickle writes and keeps none of it (past ``limit``: _TooLarge)."""

    def __init__(self, limit: int):
        self.left = limit

    def write(self, data) -> int:
        self.left -= len(data)
        if self.left < 0:
            raise _TooLarge
        return len(data)


def _pickle_error(obj) -> str | None:
    """How pickling ``obj`` fails (``"Type: message"``), or None when it pickles (or when its pickle
    outgrows PICKLE_LIMIT before failing: a big array pickles, and it is not kept)."""
    import pickle

    try:
        pickle.Pickler(_Sink(PICKLE_LIMIT), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return None
    except _TooLarge:
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]

def _children(obj):
    """(path suffix, child) pairs that pickling ``obj`` would pickle too."""
    import torch

    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
        return
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, torch.nn.Module):
        for name, value in vars(obj).items():
            if name in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
                for key, sub in value.items():
                    yield f".{key}", sub
            else:
                yield f".{name}", value
        return
    state = None
    try:
        state = obj.__getstate__() if hasattr(obj, "__getstate__") else None
    except Exception:
        state = None
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}
    if not isinstance(state, dict):
        state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for name, value in state.items():
            yield f".{name}", value

def _describe_leaf(obj) -> tuple[str, dict | None]:
    import inspect

    site = None
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        func = getattr(obj, "__func__", obj)
        code = func.__code__
        site = {"file": code.co_filename, "line": code.co_firstlineno, "func": func.__qualname__}
        what = "a lambda" if func.__name__ == "<lambda>" else (
            f"a function defined inside {func.__qualname__.rsplit('.<locals>', 1)[0]}"
            if "<locals>" in func.__qualname__ else f"the function {func.__qualname__}")
        return what, site
    name = getattr(obj, "name", None)
    kind = type(obj).__name__
    if hasattr(obj, "read") or hasattr(obj, "write"):
        return f"an open file ({kind}{f' {name!r}' if isinstance(name, str) else ''})", None
    if "lock" in kind.lower() or "RLock" in kind or "Condition" in kind or "Semaphore" in kind:
        return f"a lock ({type(obj).__module__}.{kind})", None
    if kind in ("generator", "coroutine"):
        return f"a {kind}", None
    return f"a {type(obj).__module__}.{kind}", None

def find_unpicklable(obj, path: str, depth: int = 0, seen: set | None = None) -> dict | None:
    """The deepest attribute path under ``obj`` that does not pickle: ``{"path", "what", "error",
    "site"}``; None when ``obj`` pickles."""
    seen = seen if seen is not None else set()
    error = _pickle_error(obj)
    if error is None:
        return None
    if depth < MAX_DEPTH and id(obj) not in seen:
        seen.add(id(obj))
        for suffix, child in _children(obj):
            if _pickle_error(child) is not None:
                return find_unpicklable(child, path + suffix, depth + 1, seen) or \
                    {"path": path + suffix, "what": _describe_leaf(child)[0], "error": error,
                     "site": _describe_leaf(child)[1]}
    what, site = _describe_leaf(obj)
    return {"path": path, "what": what, "error": error, "site": site}

def _fresh_import(targets, folder: str) -> dict | None:
    """What importing the target's module in a process that never imported it showed (see
    :func:`tripwire.fresh_import_check`): forked from the fork launcher's parent (torch and
    Lightning imported, none of the user's code), or a fresh interpreter where ranks are not
    forked from one. ``how`` says which."""
    import json
    import subprocess
    import sys

    from ...world import zygote

    spec = targets.model.module
    folder_of_model = os.path.dirname(targets.model.path) if targets.model.path else None
    paths = ([folder_of_model] if folder_of_model else []) + [p for p in sys.path if p]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                        "GROUP_RANK", "LOCAL_WORLD_SIZE") and not k.startswith(("TORCHELASTIC_", "LTCONFORM_"))}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    args = [spec, targets.namespace, paths]
    forked = zygote.run_fresh("pytest_ltconform.tripwire:fresh_import_check", args, env=env, cwd=os.getcwd(),
                              folder=folder, timeout_s=FRESH_IMPORT_TIMEOUT_S)
    if forked is not None:
        return {**forked, "how": "process"}
    cmd = [sys.executable, "-m", "pytest_ltconform.tripwire", spec, targets.namespace, json.dumps(paths)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=FRESH_IMPORT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        return {"timeout": FRESH_IMPORT_TIMEOUT_S, "how": "interpreter"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("LTCONFORM-IMPORT-CHECK "):
            return {**json.loads(line.split(" ", 1)[1]), "how": "interpreter"}
    return {"crashed": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:], "how": "interpreter"}

class SpawnWorkersEvent(Recorded):
    """A DataLoader of the traced fit started its worker processes: its ``hook``, how they start
    (``start``; ``explicit``: its own multiprocessing_context), how many (``workers``), the
    attribute paths of what they receive that do not pickle (``unpicklable``), and where the
    loader was built (``built``)."""

    hook: str
    start: str
    explicit: bool
    workers: int
    unpicklable: list
    built: dict | None


SPAWN_WORKERS = declare("spawn_workers", SpawnWorkersEvent)

# What a DataLoader hands each worker process it starts (torch's _MultiProcessingDataLoaderIter:
# the worker loop's arguments); the sampler stays in the main process.
WORKER_RECEIVES = ("dataset", "collate_fn", "worker_init_fn")
_STAGE_HOOKS = {"train": "train_dataloader", "validate": "val_dataloader", "sanity_check": "val_dataloader",
                "test": "test_dataloader", "predict": "predict_dataloader"}


def start_method(loader) -> tuple[str, bool]:
    """(how ``loader``'s workers start: 'fork', 'spawn' or 'forkserver'; whether the loader says so
    itself through ``multiprocessing_context``, else it is this platform's default)."""
    import multiprocessing

    ctx = getattr(loader, "multiprocessing_context", None)
    if ctx is not None:
        return (ctx if isinstance(ctx, str) else ctx.get_start_method()), True
    return multiprocessing.get_context().get_start_method(), False


class _WorkerTap:
    """Pickles what each DataLoader of the traced fit hands its worker processes, once per loader
    contents, when the workers start (``spawn_workers`` events: the hook, the start method, the
    attribute paths that do not pickle). Where workers start by spawn or forkserver and one does
    not pickle, their start raises: a ``raised`` event names spawn-safety as the owner."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.seen: set = set()

    def install(self) -> None:
        from torch.utils.data import dataloader

        self.recorder.patch(dataloader._MultiProcessingDataLoaderIter, "__init__", self._wrap)

    def _wrap(self, original):
        tap = self

        def __init__(it, loader, *args, **kwargs):
            found = None
            try:
                found = tap.check(loader)
            except Exception:
                pass  # a check that cannot be made is no finding; the workers start as they would
            try:
                return original(it, loader, *args, **kwargs)
            except Exception as exc:
                if found:
                    tap.recorder.emit({"ev": RAISED, "owner": "spawn-safety", "in": "DataLoader workers",
                                       "exc": f"{type(exc).__name__}: {exc}"[:300]})
                raise

        return __init__

    def check(self, loader) -> list | None:
        """The unpicklable things ``loader``'s workers receive, where they start by pickling."""
        from .. import loader_sites

        start, explicit = start_method(loader)
        received = [(name, getattr(loader, name, None)) for name in WORKER_RECEIVES]
        key = (start, *(id(obj) for _, obj in received))
        if key in self.seen:
            return None
        self.seen.add(key)
        stage = getattr(getattr(self.recorder.trainer, "state", None), "stage", None)
        hook = _STAGE_HOOKS.get(getattr(stage, "value", None), "the DataLoader")
        found = [f for f in (find_unpicklable(obj, f"{hook}().{name}") for name, obj in received
                             if obj is not None) if f]
        built = loader_sites.loader_of(hook) if hook.endswith("_dataloader") else None
        self.recorder.emit(SPAWN_WORKERS.new(hook=hook, start=start, explicit=explicit,
                                             workers=int(getattr(loader, "num_workers", 0) or 0), unpicklable=found,
                                             built=(built or {}).get("site")))
        return found if start in ("spawn", "forkserver") else None


class SpawnSafetyProbe(Probe):
    def install(self, recorder) -> None:
        """In the traced fit (spawn-safety observes it): where each loader is built."""
        from .. import loader_sites

        loader_sites.install(recorder)

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        """In the traced fit: pickle what DataLoader workers receive when they start."""
        if recorder is not None:
            _WorkerTap(recorder).install()

    def inspect(self, run) -> dict | None:
        """Pickling, a fresh-interpreter import and the spawn config (rank 0 does the work; the
        other ranks wait for it and return None)."""
        ctx = run.ctx
        done_key = f"ltconform-spawn-done/{os.path.dirname(ctx.job_dir)}"
        if ctx.rank != 0:
            # Wait for rank 0 without a collective: its fresh import can outlast the pg timeout.
            import time

            deadline = time.monotonic() + FRESH_IMPORT_TIMEOUT_S + 60
            while time.monotonic() < deadline and not ctx.store.check([done_key]):
                time.sleep(0.1)
            return None
        try:
            return _observe_rank0(run)
        finally:
            ctx.store.set(done_key, "1")

def _observe_rank0(run) -> dict:
    from ... import tripwire
    from ...target import loading as target_loading

    targets = run.target
    loaded = run.objects
    objects = [(loaded.model, type(loaded.model).__qualname__)]
    if loaded.datamodule is not None:
        objects.append((loaded.datamodule, type(loaded.datamodule).__qualname__))
    if loaded.user_kwargs:
        objects.append((loaded.user_kwargs, "trainer_kwargs"))
    pickling = []
    for obj, name in objects:
        found = find_unpicklable(obj, name)
        if found is not None:
            pickling.append(found)
    user_strategy = loaded.user_kwargs.get("strategy")
    spawn_config = (isinstance(user_strategy, str) and "spawn" in user_strategy) or \
        getattr(user_strategy, "_start_method", "popen") == "spawn"
    names = (targets.model.module, target_loading.private_name(targets.model)) if targets.model.path else \
        (targets.model.module,)
    tripped = [dict(v) for v in tripwire.TRIPPED.values() if v.get("module") in names
               and (not targets.model.path or v.get("path") in (None, targets.model.path))]
    return {"pickling": pickling, "fresh": _fresh_import(targets, run.ctx.job_dir), "spawn_config": spawn_config,
            "tripped_here": tripped[:1], "module": targets.model.module}
