"""spawn-safety: what ddp_spawn (and any spawn-started process) needs from the user's code:
picklable objects and a module that can be imported without starting training.

Seed section "Choose using measured memory": ddp_spawn requires picklable objects and an
import-safe main guard, and is not a generic fix for a distributed configuration bug.

Checked in a run of kind "spawn" on rank 0: the LightningModule, the LightningDataModule and
the Trainer kwargs are pickled the way the spawn launcher pickles them; when one fails, the
object graph is searched for the attribute path that does not pickle (a lambda, an open file, a
lock) and its definition site. Then the target's module is imported, as a spawned process
imports it, in a fresh process with ``Trainer.fit/validate/test/predict`` armed (``tripwire.py``):
forked from the fork launcher's parent, which imported torch and Lightning and none of the
user's code, or a fresh interpreter under ``--ltconform-launcher spawn`` and in attached worlds.
Training started at import time (no ``if __name__ == "__main__":`` guard) fails with the line
that started it. A user config naming
ddp_spawn runs as ddp inside our worlds: Lightning keeps its own spawn launcher even in externally
started ranks, so spawning is judged here instead.
"""

from __future__ import annotations

from typing import NamedTuple

from ...outcomes import Outcome
from ...runs import FIT, inspection
from ...sites import fmt_site
from ..base import Blame, Contract, Evidence, Run, Verdict
from .probe import SPAWN_WORKERS, WORKER_RECEIVES, SpawnSafetyProbe


class SpawnSafety(Contract):
    id = "spawn-safety"
    title = "Objects pickle and the module imports without training (ddp_spawn, spawn workers)"
    rule_section = "Choose using measured memory"
    run_spec = inspection("spawn")
    probe_class = SpawnSafetyProbe
    observes = (FIT,)  # what the fit's DataLoader workers receive
    strategies = ("ddp",)
    tiers = ("cpu",)  # pickling and importing do not depend on the hardware

    def blames(self, run: Run) -> int | None:
        """A fit whose DataLoader workers could not start because what they receive does not
        pickle (this contract's probe named itself the owner); only where this contract has an
        item (its strategies), so the item named as the cause exists."""
        return Blame.RAISED if run.strategy in self.strategies and run.raised_owner() == self.id else None

    def judge(self, run: Run) -> Verdict:
        facts = run.probe(self.id)[0]
        if facts is None:
            r = run.job.ranks[0]
            return self.verdict(Outcome.ERROR, f"the spawn checks could not run: {r.exc_type}: {r.message}",
                                diagnosis=run.job.failure_text())
        fresh = facts.get("fresh") or {}
        module = facts["module"]
        failures = _import_failures(facts, fresh, module)
        import_problem = bool(failures)
        workers = _worker_records(run.observed.get(FIT.name))
        spawned = [w for w in workers if w["unpicklable"] and w["start"] in ("spawn", "forkserver")]
        failures += [_worker_failure(w) for w in spawned]
        failures += [_pickling_failure(item) for item in facts.get("pickling", [])]
        failures += [_worker_failure(w) for w in workers if w["unpicklable"] and w not in spawned]
        notes = []
        if facts.get("spawn_config"):
            notes.append("the Trainer config asks for ddp_spawn; inside our worlds it runs as ddp (Lightning keeps "
                         "its spawn launcher even in externally started ranks), so spawning is judged here.")
        if not failures:
            return self._passed(fresh, module, notes, workers, run.observed.get(FIT.name))
        return self._failed(failures, notes, spawn_matters=import_problem or bool(facts.get("spawn_config"))
                            or bool(spawned))

    def _passed(self, fresh: dict, module: str, notes: list[str], workers: list[dict], fit: Run | None) -> Verdict:
        parts = ["the module, datamodule and Trainer kwargs pickle"]
        if workers:
            started = ", ".join(f"{w['hook']} ({w['workers']} started by {w['start']})" for w in workers)
            parts.append(f"what the DataLoader workers of the fit receive ({', '.join(WORKER_RECEIVES)}) pickles: "
                         f"{started}")
        elif fit is not None and fit.finished:
            parts.append("no DataLoader of the fit starts worker processes (num_workers=0)")
        elif fit is not None:
            notes.append("what DataLoader workers receive was not checked: the fit stopped before any loader "
                         "started its workers.")
        if fresh.get("seconds") is not None:
            parts.append(f"importing {module} in {_fresh(fresh)} started no training "
                         f"({fresh['seconds']:.1f} s)")
        elif fresh.get("crashed") is not None:
            notes.append(f"the import check in {_fresh(fresh)} itself did not report (exit {fresh['crashed']}).")
        return self.verdict(Outcome.PASSED, "; ".join(parts) + ".", notes=notes)

    def _failed(self, failures: list[_Failure], notes: list[str], spawn_matters: bool) -> Verdict:
        """The first failure leads; the others add their evidence, a note and their fix."""
        summary, evidence, fix = failures[0]
        for extra in failures[1:]:
            evidence += extra.evidence
            notes.insert(0, extra.summary)
        fixes = [fix] + [f.fix for f in failures[1:] if f.fix != fix]
        outcome = Outcome.FAILED
        if not spawn_matters:
            # Pickling matters once something spawns; torchrun and plain ddp build objects per rank.
            outcome = Outcome.ADVISORY
            notes.append("nothing in this launch starts processes by spawn (no ddp_spawn, no DataLoader with a "
                         "spawn or forkserver multiprocessing_context), so it is not affected here; any "
                         "spawn-started run (ddp_spawn, notebooks, DataLoader workers on macOS or Windows) would fail.")
        return self.verdict(outcome, summary, evidence=evidence, fix=" Also: ".join(fixes), notes=notes)

class _Failure(NamedTuple):
    summary: str
    evidence: list[Evidence]
    fix: str

def _fresh(fresh: dict) -> str:
    """Where the module was imported: forked before any user code, or a new interpreter."""
    if fresh.get("how") == "process":
        return "a fresh process (forked before any of your code was imported)"
    return "a fresh interpreter"

def _import_failures(facts: dict, fresh: dict, module: str) -> list[_Failure]:
    """What importing the module in a fresh process showed: training started at import time,
    an import that never returned, or one that raised (at most one of them)."""
    trip = fresh.get("tripped") or (facts.get("tripped_here") or [None])[0]
    if trip:
        return [_trip_failure(trip, fresh, module)]
    if fresh.get("timeout"):
        return [_Failure(f"importing the module {module} in {_fresh(fresh)} did not return within "
                         f"{fresh['timeout']:.0f} s: something at module top level runs (training, a "
                         f"collective, a server) that every spawn-started process would run again.", [],
                         "move side effects under `if __name__ == \"__main__\":`.")]
    if fresh.get("error"):
        where = fmt_site(fresh["error_site"]) if fresh.get("error_site") else None
        return [_Failure(f"the module {module} cannot be imported in {_fresh(fresh)} ({fresh['error']}"
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
    evidence = [Evidence(f"{trip['method']} entered while importing {module} in {_fresh(fresh)}", site=site)]
    for built in fresh.get("trainers", [])[:2]:
        evidence.append(Evidence("Trainer(...) constructed at import time", site=fmt_site(built)))
    return _Failure(summary, evidence, "put the script part (Trainer construction and fit) under "
                                       "`if __name__ == \"__main__\":`, or in a main() called from there.")

def _worker_records(fit: Run | None) -> list[dict]:
    """The fit's ``spawn_workers`` events (rank 0's, else any rank's), once per hook and start method."""
    if fit is None:
        return []
    out: dict = {}
    for r in range(fit.world_size):
        for e in fit.events(r, SPAWN_WORKERS):
            key = (e.get("hook"), e.get("start"))
            if key not in out or (e.get("unpicklable") and not out[key].get("unpicklable")):
                out[key] = e
    return list(out.values())


def _worker_failure(w: dict) -> _Failure:
    """What a loader's workers receive does not pickle: where the workers start by spawn or
    forkserver the fit stops when they start; by fork (Linux's default) only macOS and Windows
    (spawn by default) would stop."""
    item = w["unpicklable"][0]
    where = fmt_site(item["site"]) if item.get("site") else None
    if w["start"] in ("spawn", "forkserver"):
        how = f"multiprocessing_context={w['start']!r}" if w.get("explicit") else "this platform's default"
        when = (f"the {w['hook']} DataLoader's {w['workers']} worker(s) start by {w['start']} ({how}) and each "
                f"receives a pickled copy of its {', '.join(WORKER_RECEIVES)}, so the fit stops as soon as they "
                f"start")
    else:
        when = (f"the {w['hook']} DataLoader's {w['workers']} worker(s) start by {w['start']} here (this "
                f"platform's default), which pickles nothing, but by spawn on macOS and Windows, where each "
                f"receives a pickled copy of its {', '.join(WORKER_RECEIVES)} and the fit stops when they start")
    summary = f"{item['path']} does not pickle: it is {item['what']} ({item['error']}); {when}."
    evidence = [Evidence(f"{item['path']}: {item['what']}", site=where)]
    if w.get("built"):
        evidence.append(Evidence(f"the {w['hook']} DataLoader is built here", site=fmt_site(w["built"])))
    fix = ("give DataLoader workers only picklable things: define worker_init_fn and collate_fn at module level "
           "(or as instances of a module-level class; functools.partial of a module-level function for "
           "arguments), and keep lambdas, open files and locks out of the dataset (open files in the worker, in "
           "worker_init_fn or on first use).")
    return _Failure(summary, evidence, fix)


def _pickling_failure(item: dict) -> _Failure:
    where = fmt_site(item["site"]) if item.get("site") else None
    summary = (f"{item['path']} does not pickle: it is {item['what']} ({item['error']}); ddp_spawn pickles "
               f"the module, the datamodule and the Trainer with its callbacks to start every rank.")
    return _Failure(summary, [Evidence(f"{item['path']}: {item['what']}", site=where)],
                    "keep only picklable state on these objects: a module-level function instead of a "
                    "lambda or nested function, open files and locks created where they are used (or "
                    "dropped in __getstate__); or launch with torchrun/ddp instead of ddp_spawn.")

CONTRACT = SpawnSafety()
