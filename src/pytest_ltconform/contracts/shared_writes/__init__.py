"""shared-writes: an ordinary file that every rank would write on a shared filesystem is
written by one rank only (a rank-zero guard); checkpoint saving is the exception.

Seed section "Sampling, metrics and writes": rank-zero guards are for plain shared-file writes
that need no collectives (and ``trainer.save_checkpoint`` must *not* be guarded).

Checked from the traced fit: a process-wide ``sys.addaudithook`` dispatcher (audit hooks cannot
be removed, so it is installed once per rank process and routed to the current job) records
every "open" event with a write mode or write flags, and ``torch.save(obj, path)``, which writes
through C++ and raises no "open" event, is recorded by a wrapper. Only writes with a user frame
on the stack count, and none made while a checkpoint is being saved. Paths under a rank's own
root directory are compared relative to it (on a cluster every rank has the same
``default_root_dir``), so the same file opened for writing by more than one rank fails, naming
the path, the ranks, the hooks and the call sites.
"""

from __future__ import annotations

import os

from ...events import STAGE, STAGE_ERROR
from ...outcomes import Outcome
from ...sites import fmt_library, fmt_site
from ..base import Blame, Contract, Evidence, Run, Verdict, merged, rank_guard
from .probe import RENAME, WRITE, SharedWritesProbe


def _mode_words(modes: set[str]) -> str:
    if RENAME in modes:
        return "renamed with os.replace" if modes == {RENAME} else "written and renamed with os.replace"
    if any(m.startswith("a") or m.startswith("append") for m in modes):
        return "opened for appending"
    if "torch.save" in modes and len(modes) == 1:
        return "written with torch.save"
    return "opened for writing"

def site_words(site: dict | None) -> str:
    """Where a write was made: the user's own line first, then the installed package's function it
    called (``..., in pandas/core/generic.py:3967 (NDFrame.to_csv)``) where the probe recorded one."""
    library = (site or {}).get("library")
    return fmt_site(site) + (f", in {fmt_library(library)}" if library else "")

def _staged_writes(events: list[dict]) -> list[dict]:
    """A rank's ``write`` events, each with the stage it was made in ("fit", "test", "predict",
    from the run's ``stage`` events) when the run recorded stages."""
    out, stage = [], None
    for e in events:
        if STAGE.of(e):
            stage = e.get("name")
        elif WRITE.of(e):
            out.append({**e, "stage": stage} if stage else e)
    return out

def _stage_error_notes(run: Run) -> list[str]:
    """A later stage (test, predict) that raised on some rank: what it wrote after that point was
    not recorded, so say so rather than pass in silence."""
    notes = []
    for r in range(run.world_size):
        for e in run.events(r, STAGE_ERROR):
            notes.append(f"the {e.get('name')} stage, which the plugin runs after fit on the same Trainer, raised "
                         f"{e.get('exc_type')} on rank {r} ({e.get('message')}), so writes after that point were "
                         f"not recorded.")
    return notes[:2]

def _writes_by_path(run: Run) -> dict[tuple, dict[int, list[dict]]]:
    """{(storage, path): {rank: its write events}}. A node-local path (``storage``: the node it is
    on) is one file per node: the same path written on two nodes is two files, on one node one
    (node_storage)."""
    by_path: dict[tuple, dict[int, list[dict]]] = {}
    for r in range(run.world_size):
        for e in _staged_writes(run.events(r)):
            by_path.setdefault((e.get("storage"), e["path"]), {}).setdefault(r, []).append(e)
    return by_path

def _shared_paths(by_path: dict) -> dict:
    return {p: ranks for p, ranks in by_path.items() if len(ranks) > 1}

_OS_ERRORS = ("FileNotFoundError", "FileExistsError", "PermissionError", "IsADirectoryError", "OSError")

def _raise_on(outcome, ranks: dict[int, list[dict]], path: str) -> bool:
    """Whether ``outcome``'s rank raised an OS error naming ``path`` (its file name) after writing it."""
    return outcome.status in ("error", "died") and outcome.exc_type in _OS_ERRORS and outcome.rank in ranks \
        and os.path.basename(path) in (outcome.message or "")

def _raised_on_shared(run: Run, shared: dict) -> dict[int, tuple]:
    """{rank: (storage, path)} for every rank that failed on its own (not in a collective its failed
    peer left) when each raised an OS error naming a path it shares with another rank; {} when any
    such rank did not."""
    from ...world.causes import is_transport_failure

    failed = [o for o in run.job.ranks if o.status in ("error", "died") and not is_transport_failure(o)]
    found = {}
    for o in failed:
        key = next((k for k, ranks in sorted(shared.items(), key=lambda kv: str(kv[0]))
                    if _raise_on(o, ranks, k[1])), None)
        if key is None:
            return {}
        found[o.rank] = key
    return found

def _raised_words(run: Run, key: tuple, ranks: dict[int, list[dict]], who) -> str:
    """`` Global rank 0 (node 0) renamed it without error; global rank 1 (node 1) then raised ...`` for
    the ranks that raised an OS error naming it (a run that did not finish)."""
    raised = [o for o in run.job.ranks if not run.finished and _raise_on(o, ranks, key[1])]
    if not raised:
        return ""
    gone = {o.rank for o in raised}
    renamed = sorted(r for r, evs in ranks.items() if r not in gone and any(e["mode"] == RENAME for e in evs))
    first = f"{who(renamed)} renamed it without error, and " if renamed else ""
    parts = "; ".join(f"{who([o.rank])} raised {o.exc_type} ({o.message})" for o in raised[:2])
    return f" {(first + parts)[:1].upper()}{(first + parts)[1:]}."

def _guard_note(guard: str | None, spans: bool, ranks: dict) -> str | None:
    if guard and spans and "local_rank" in guard:
        return (f"the write sits under `{guard}`: the local rank is 0 on the first rank of every node, so "
                f"that condition holds once per node (global ranks {', '.join(map(str, sorted(ranks)))} "
                f"here), and every node writes the same file on the shared filesystem.")
    if guard:
        return f"the write sits under `{guard}`, but that condition is true on more than one rank."
    return None

def _fix(modes: set[str], guard: str | None) -> str:
    fix = ("guard ordinary file writes so that one rank writes: `if self.trainer.is_global_zero:` (or "
           "@rank_zero_only on the function), or give each rank its own file name (e.g. with "
           "self.global_rank in it); never guard trainer.save_checkpoint, which every rank must call.")
    if "torch.save" in modes:
        fix = ("save the file from one rank: `if self.trainer.is_global_zero: torch.save(...)`, or use "
               "trainer.save_checkpoint on every rank (Lightning writes it once); " + fix.split("; ", 1)[1])
    if guard and "local_rank" in guard:
        fix = (f"a file in a shared folder needs the global rank zero: replace `{guard}` with "
               f"`if self.trainer.is_global_zero:` (global_rank == 0; @rank_zero_only guards the same); a local "
               f"rank-zero guard is right only for a file on each node's own storage. Or give each rank its own file "
               f"name (with self.global_rank in it).")
    return fix

class SharedWrites(Contract):
    id = "shared-writes"
    title = "Plain shared-file writes happen on one rank (rank-zero guard), checkpoints on all"
    rule_section = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp", "deepspeed")
    tiers = ("cpu", "nodes", "gpu", "multinode")  # nodes: ranks laid out as nodes on this host
    probe_class = SharedWritesProbe

    def blames(self, run: Run) -> int | None:
        """Every rank that failed raised an OS error (FileNotFoundError, ...) naming a file that more
        than one rank wrote or renamed (two node leaders renaming one shared file: the second finds
        it gone): this contract's finding, not the user's crash."""
        if not run.finished and _raised_on_shared(run, _shared_paths(_writes_by_path(run))):
            return Blame.RAISED
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        by_path = _writes_by_path(run)
        shared = _shared_paths(by_path)
        if not shared:
            verdict = self._passed(run, by_path)
            verdict.notes += _stage_error_notes(run)
            return verdict
        verdicts = [self._shared(run, key, ranks) for key, ranks in sorted(shared.items(), key=lambda kv: str(kv[0]))]
        return merged(verdicts, _stage_error_notes(run))

    def _shared(self, run: Run, key: tuple, ranks: dict[int, list[dict]]) -> Verdict:
        storage, path = key
        name = os.path.basename(path)
        modes = {e["mode"] for evs in ranks.values() for e in evs}
        hooks = sorted({e.get("hook") or "outside any hook" for evs in ranks.values() for e in evs})
        first = next(iter(ranks.values()))[0]
        site = site_words(first.get("site"))
        nodes = {r: evs[0].get("node") for r, evs in ranks.items()}
        spans = len({n for n in nodes.values() if n is not None}) > 1
        def named(rs) -> str:
            return " and ".join(f"global rank {r} (node {nodes[r]})" if spans else f"rank {r}" for r in sorted(rs))

        who = named(ranks)
        total = sum(len(v) for v in ranks.values())
        per_rank = ", ".join(f"rank {r}: {len(v)}" for r, v in sorted(ranks.items()))
        epochs = sorted({e.get("epoch") for evs in ranks.values() for e in evs if e.get("epoch") is not None})
        how = _mode_words(modes)
        stages = sorted({e["stage"] for evs in ranks.values() for e in evs if e.get("stage")})
        during = f" during {' and '.join(stages)}" if stages else ""
        summary = (f"{name} {how} by {who} in {', '.join(hooks)}{during} at {site}, outside checkpoint saving "
                   f"({total} writes: {per_rank}")
        if len(epochs) > 1:
            summary += f"; {len(epochs)} epoch{'s' if len(epochs) != 1 else ''}"
        where = f" on node {storage}'s local storage" if storage is not None else ""
        same = "writes and renames the same file" if RENAME in modes else "writes the same file"
        summary += f"). On a shared filesystem every rank {same}: " if not where else \
            f"). That file is on node {storage}'s local storage, which its ranks share: "
        if RENAME in modes:
            summary += "once one rank has renamed it, nothing is left at that path for the others' rename."
        elif how == "opened for appending":
            # Only the opens are recorded, not what each rank meant the file to hold: the harm said is
            # the one path every rank appends to, never a row count.
            summary += (f"{len(ranks)} ranks append to this one file ({total} appends), so it holds what every "
                        f"rank wrote, and concurrent appends can interleave.")
        else:
            summary += "the ranks overwrite each other (last writer wins, or a torn file if they overlap)."
        evidence = []
        for r, evs in sorted(ranks.items()):
            sites = sorted({site_words(e.get("site")) for e in evs})
            evidence.append(Evidence(f"{path} {_mode_words({e['mode'] for e in evs})} ({', '.join(sorted(modes))}) "
                                     f"{len(evs)} time{'s' if len(evs) != 1 else ''} in "
                                     f"{', '.join(sorted({e.get('hook') or '?' for e in evs}))}"
                                     + (f", also at {', '.join(sites[1:])}" if len(sites) > 1 else ""),
                                     rank=r, site=sites[0]))
        guard = rank_guard(first.get("site"))
        notes = [n for n in (_guard_note(guard, spans, ranks),) if n]
        crashed = _raised_words(run, key, ranks, named)
        summary += crashed
        fix = _fix(modes, guard)
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix,
                            category="crash" if crashed else "silent", notes=notes)

    def _passed(self, run: Run, by_path) -> Verdict:
        if not by_path:
            stages = [e.get("name") for e in run.events(0, STAGE) if e.get("name")] or ["fit"]
            # A later stage that raised was watched only up to its exception (see the notes).
            raised = {e.get("name") for r in range(run.world_size) for e in run.events(r, STAGE_ERROR)}
            words = [f"{s} (until it raised)" if s in raised else s for s in stages]
            return self.verdict(Outcome.PASSED, f"user code opened no file for writing during {' and '.join(words)} "
                                                f"(outside checkpoint saving) on any rank.")
        parts = []
        for (storage, path), ranks in sorted(by_path.items(), key=lambda kv: str(kv[0]))[:5]:
            r = min(ranks)
            evs = ranks[r]
            guard = rank_guard(evs[0].get("site"))
            own = f" on node {storage}'s local storage" if storage is not None else ""
            parts.append(f"{os.path.basename(path)}{own} by rank {r} only"
                         + (f" (under `{guard}`)" if guard else ""))
        more = f" and {len(by_path) - 5} more" if len(by_path) > 5 else ""
        return self.verdict(Outcome.PASSED,
                            f"every file user code writes is written by one rank: {', '.join(parts)}{more}.")

CONTRACT = SharedWrites()
