"""spawn-safety: what ddp_spawn (and any spawn-started process) needs from the user's code:
picklable objects and a module that can be imported without starting training.

Seed section "Choose using measured memory": ddp_spawn requires picklable objects and an
import-safe main guard, and is not a generic fix for a distributed configuration bug.

Checked in a run of kind "spawn" on rank 0: the LightningModule, the LightningDataModule and
the Trainer kwargs are pickled the way the spawn launcher pickles them; when one fails, the
object graph is searched for the attribute path that does not pickle (a lambda, an open file, a
lock) and its definition site. Then the target's module is imported in a fresh interpreter with
``Trainer.fit/validate/test/predict`` armed (``tripwire.py``): training started at import time (no
``if __name__ == "__main__":`` guard) fails with the line that started it. A user config naming
ddp_spawn runs as ddp inside our worlds: Lightning keeps its own spawn launcher even in externally
started ranks, so spawning is judged here instead.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..runs import Probe, inspection
from ..sites import fmt_site
from .base import Contract, Evidence, Run, Verdict

MAX_DEPTH = 12
FRESH_IMPORT_TIMEOUT_S = 90.0


# -- rank side ---------------------------------------------------------------------------------

def _pickle_error(obj) -> str | None:
    import pickle

    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
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


def _fresh_import(targets) -> dict | None:
    import json
    import subprocess
    import sys

    spec = targets.model.module
    folder = os.path.dirname(targets.model.path) if targets.model.path else None
    paths = ([folder] if folder else []) + [p for p in sys.path if p]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                        "GROUP_RANK", "LOCAL_WORLD_SIZE") and not k.startswith(("TORCHELASTIC_", "LTCONFORM_"))}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest_ltconform.tripwire", spec, targets.namespace, json.dumps(paths)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=FRESH_IMPORT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        return {"timeout": FRESH_IMPORT_TIMEOUT_S}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("LTCONFORM-IMPORT-CHECK "):
            return json.loads(line.split(" ", 1)[1])
    return {"crashed": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}


class SpawnSafetyProbe(Probe):
    def inspect(self, run) -> dict | None:
        """Pickling, a fresh-interpreter import and the spawn config (rank 0 does the work; the
        other ranks wait for it and return None)."""
        ctx = run.ctx
        done_key = f"ltconform-spawn-done/{os.path.dirname(ctx.job_dir)}"
        if ctx.rank != 0:
            # Wait for rank 0 without a collective: its fresh interpreter can outlast the pg timeout.
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
    from .. import target as target_mod
    from .. import tripwire

    targets = run.targets
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
    names = (targets.model.module, target_mod.private_name(targets.model)) if targets.model.path else \
        (targets.model.module,)
    tripped = [dict(v) for v in tripwire.TRIPPED.values() if v.get("module") in names
               and (not targets.model.path or v.get("path") in (None, targets.model.path))]
    return {"pickling": pickling, "fresh": _fresh_import(targets), "spawn_config": spawn_config,
            "tripped_here": tripped[:1], "module": targets.model.module}


# -- pytest side -------------------------------------------------------------------------------

class SpawnSafety(Contract):
    id = "spawn-safety"
    title = "Objects pickle and the module imports without training (ddp_spawn, spawn workers)"
    rule_section = "Choose using measured memory"
    run_spec = inspection("spawn")
    probe_class = SpawnSafetyProbe
    strategies = ("ddp",)
    tiers = ("cpu",)  # pickling and importing do not depend on the hardware

    def judge(self, run: Run) -> Verdict:
        facts = run.probe(self.id)[0]
        if facts is None:
            r = run.job.ranks[0]
            return self.verdict("error", f"the spawn checks could not run: {r.exc_type}: {r.message}",
                                diagnosis=run.job.failure_text())
        fresh = facts.get("fresh") or {}
        module = facts["module"]
        failures = _import_failures(facts, fresh, module)
        import_problem = bool(failures)
        failures += [_pickling_failure(item) for item in facts.get("pickling", [])]
        notes = []
        if facts.get("spawn_config"):
            notes.append("the Trainer config asks for ddp_spawn; inside our worlds it runs as ddp (Lightning keeps "
                         "its spawn launcher even in externally started ranks), so spawning is judged here.")
        if not failures:
            return self._passed(fresh, module, notes)
        return self._failed(failures, notes, spawn_matters=import_problem or bool(facts.get("spawn_config")))

    def _passed(self, fresh: dict, module: str, notes: list[str]) -> Verdict:
        parts = ["the module, datamodule and Trainer kwargs pickle"]
        if fresh.get("seconds") is not None:
            parts.append(f"importing {module} in a fresh interpreter started no training "
                         f"({fresh['seconds']:.1f} s)")
        elif fresh.get("crashed") is not None:
            notes.append(f"the fresh-interpreter import check itself did not report (exit {fresh['crashed']}).")
        return self.verdict("passed", "; ".join(parts) + ".", notes=notes)

    def _failed(self, failures: list[_Failure], notes: list[str], spawn_matters: bool) -> Verdict:
        """The first failure leads; the others add their evidence, a note and their fix."""
        summary, evidence, fix = failures[0]
        for extra in failures[1:]:
            evidence += extra.evidence
            notes.insert(0, extra.summary)
        fixes = [fix] + [f.fix for f in failures[1:] if f.fix != fix]
        outcome = "failed"
        if not spawn_matters:
            # Pickling matters once something spawns; torchrun and plain ddp build objects per rank.
            outcome = "advisory"
            notes.append("the Trainer config does not ask for ddp_spawn, so today's launch is not affected; "
                         "any spawn-started run (ddp_spawn, notebooks, spawn DataLoader workers) would fail here.")
        return self.verdict(outcome, summary, evidence=evidence, fix=" Also: ".join(fixes), notes=notes)


class _Failure(NamedTuple):
    summary: str
    evidence: list[Evidence]
    fix: str


def _import_failures(facts: dict, fresh: dict, module: str) -> list[_Failure]:
    """What importing the module in a fresh interpreter showed: training started at import time,
    an import that never returned, or one that raised (at most one of them)."""
    trip = fresh.get("tripped") or (facts.get("tripped_here") or [None])[0]
    if trip:
        return [_trip_failure(trip, fresh, module)]
    if fresh.get("timeout"):
        return [_Failure(f"importing the module {module} in a fresh interpreter did not return within "
                         f"{fresh['timeout']:.0f} s: something at module top level runs (training, a "
                         f"collective, a server) that every spawn-started process would run again.", [],
                         "move side effects under `if __name__ == \"__main__\":`.")]
    if fresh.get("error"):
        where = fmt_site(fresh["error_site"]) if fresh.get("error_site") else None
        return [_Failure(f"the module {module} cannot be imported in a fresh interpreter ({fresh['error']}"
                         + (f" at {where}" if where else "") + "); a spawn-started process imports it first.",
                         [Evidence(fresh["error"], site=where)],
                         "make the module importable on its own (imports and sys.path set up at import time).")]
    return []


def _trip_failure(trip: dict, fresh: dict, module: str) -> _Failure:
    site = fmt_site(trip) if trip.get("file") else None
    summary = (f"importing the module {module} called {trip['method']} at import time (module top level, "
               f"no `if __name__ == \"__main__\":` guard) at {site}: a spawn-started rank (ddp_spawn, "
               f"DataLoader workers under spawn) re-imports it and starts training again, and so does "
               f"every tool that imports it.")
    evidence = [Evidence(f"{trip['method']} entered while importing {module} in a fresh interpreter", site=site)]
    for built in fresh.get("trainers", [])[:2]:
        evidence.append(Evidence("Trainer(...) constructed at import time", site=fmt_site(built)))
    return _Failure(summary, evidence, "put the script part (Trainer construction and fit) under "
                                       "`if __name__ == \"__main__\":`, or in a main() called from there.")


def _pickling_failure(item: dict) -> _Failure:
    where = fmt_site(item["site"]) if item.get("site") else None
    summary = (f"{item['path']} does not pickle: it is {item['what']} ({item['error']}); ddp_spawn pickles "
               f"the module, the datamodule and the Trainer with its callbacks to start every rank.")
    return _Failure(summary, [Evidence(f"{item['path']}: {item['what']}", site=where)],
                    "keep only picklable state on these objects: a module-level function instead of a "
                    "lambda or nested function, open files and locks created where they are used (or "
                    "dropped in __getstate__); or launch with torchrun/ddp instead of ddp_spawn.")


CONTRACT = SpawnSafety()
