"""A monitored key that some ranks log and others never do (pytest side).

Each rank's ModelCheckpoint, EarlyStopping or ReduceLROnPlateau scheduler reads the monitored key
from its own rank's metrics; a rank that never logged it raises, and its peers then fail in their
next collective. The raise is the symptom: the first cause is the one-sided log call, which the
log taps recorded with its user site on the ranks that made it.
"""

from __future__ import annotations

import re

from ...events import LOG
from ...sites import first_sentence, fmt_site, hook_label
from ..base import Evidence, Run, rank_guard

# Lightning 2.6.6's messages for a monitored key missing from a rank's metrics, per callback.
_MISSING = (
    ("ModelCheckpoint", re.compile(r"ModelCheckpoint\(monitor=(['\"])(?P<key>.+?)\1\)` could not find the monitored")),
    ("EarlyStopping", re.compile(r"Early stopping conditioned on metric `(?P<key>.+?)` which is not available")),
    ("ReduceLROnPlateau", re.compile(r"ReduceLROnPlateau conditioned on metric (?P<key>\S+) which is not available")),
)


def _logged_as(event: dict, key: str) -> bool:
    # on_step and on_epoch together publish the key with _step and _epoch suffixes.
    return event.get("name") in (key, key.removesuffix("_epoch"), key.removesuffix("_step"))


def missing_monitor(run: Run) -> dict | None:
    """The first rank that raised because a monitored key was not among its metrics while another
    rank logged that key: ``{"rank", "callback", "key", "exc_type", "message", "logs": {rank: [log
    events]}}``; None otherwise (a key no rank logged is a typo in ``monitor=``, not a sync fault)."""
    for outcome in run.job.ranks:
        if outcome.status != "error":
            continue
        for callback, pattern in _MISSING:
            found = pattern.search(outcome.message or "")
            if found is None:
                continue
            key = found["key"]
            logs = {r: [e for e in run.events(r, LOG) if _logged_as(e, key)] for r in range(run.world_size)}
            if any(logs.values()) and not logs[outcome.rank]:
                return {"rank": outcome.rank, "callback": callback, "key": key, "exc_type": outcome.exc_type,
                        "message": outcome.message, "logs": logs}
    return None


def missing_texts(found: dict) -> tuple[str, list[Evidence], str]:
    """(summary, evidence, fix) for :func:`missing_monitor`'s finding."""
    key, logs, callback = found["key"], found["logs"], found["callback"]
    loggers = [r for r, evs in logs.items() if evs]
    silent = [r for r, evs in logs.items() if not evs]
    first = logs[loggers[0]][0]
    site, guard = fmt_site(first.get("site")), rank_guard(first.get("site"))
    under = f" under `{guard}`" if guard else ""
    summary = (f"monitored key {key!r} is logged on {_ranks(loggers)} only and never on {_ranks(silent)}, in "
               f"{hook_label(first.get('hook'))}{under} at {site}: rank {found['rank']}'s {callback} reads the key "
               f"from its own rank's metrics, did not find it and raised {found['exc_type']}, so the world stopped.")
    evidence = [Evidence(f"{key!r} logged {len(evs)} time{'s' if len(evs) != 1 else ''}"
                         + (" (sync_dist=True)" if any(e.get("sync_dist") for e in evs) else "")
                         + (" (rank_zero_only=True)" if any(e.get("rank_zero_only") for e in evs) else ""),
                         rank=r, site=None if evs[0].get("site") else fmt_site(None), frame=evs[0].get("site"),
                         call="log_dict" if evs[0].get("via") == "log_dict" else "log")
                for r, evs in logs.items() if evs]
    evidence += [Evidence(f"{key!r} never logged", rank=r) for r in silent]
    evidence.append(Evidence(f"{callback} raised {found['exc_type']}: {first_sentence(found['message'], 200)}",
                             rank=found["rank"]))
    ungate = f"remove the `{guard}` gate and " if guard else ""
    fix = (f"{ungate}log {key!r} on every rank at {site}, with sync_dist=True (or log a TorchMetrics object), so "
           f"that every rank's {callback} monitors the same reduced value. rank_zero_only=True is not enough: "
           f"every rank's callback needs a monitored metric.")
    return summary, evidence, fix


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
