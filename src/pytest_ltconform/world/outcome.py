"""What a job did: one :class:`RankOutcome` per rank and the :class:`JobResult` that sums them up,
the same for local and attached worlds. Pure Python, no torch."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..sites import bounded_lines
from . import diagnose
from .causes import exit_words

# A job's status is its worst rank's.
SEVERITY = {"ok": 0, "skip": 1, "error": 2, "died": 3, "hung": 4}

# Lines a rank prints because of the plugin's own settings, not the user's: every DDP run of the
# plugin tolerates unused parameters (harness.tolerate_unused_parameters), and torch's reducer warns
# about that flag from C++, straight to stderr. unused-parameters judges the user's own flag.
_OWN_NOISE = ("find_unused_parameters=True was specified in DDP constructor",)


def without_own_noise(text: str) -> str:
    """``text`` (a rank's output) without the lines the plugin's own settings made the rank print."""
    return "\n".join(line for line in text.split("\n") if not any(n in line for n in _OWN_NOISE))


@dataclasses.dataclass
class RankOutcome:
    """What one rank did in one job.

    ``status`` is 'ok', 'error' (raised), 'skip', 'hung' (killed at the timeout) or 'died'
    (exited without a result: crash, segfault, ``os._exit``). ``trace`` is the list of events the
    rank recorded (see ``trace.py``); ``stack`` the faulthandler dump taken before a kill.
    """

    rank: int
    status: str
    value: Any = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    exit_code: int | None = None
    stack: str | None = None
    log_tail: str | None = None
    trace: list = dataclasses.field(default_factory=list)
    duration_s: float | None = None
    stage: str | None = None  # 'formation': it failed forming the process group, before the job's code

    @classmethod
    def from_wire(cls, wire: dict) -> RankOutcome:
        """The outcome of the result a rank posted (a ``protocol.RankResult``); ``trace`` is
        there only when the rank sent its events along (attached worlds)."""
        return cls(rank=wire["rank"], status=wire.get("status", "error"), value=wire.get("value"),
                   exc_type=wire.get("exc_type"), message=wire.get("message"),
                   traceback=wire.get("traceback"), duration_s=wire.get("duration_s"),
                   trace=wire.get("trace") or [], stage=wire.get("stage"))


@dataclasses.dataclass
class JobResult:
    """One job on every rank. ``status``: 'ok' when every rank returned, else the worst rank
    status ('hung' > 'died' > 'error' > 'skip'). ``diagnosis`` is the readable block naming every
    rank's position and the first point where their collective sequences diverged."""

    status: str
    ranks: list[RankOutcome]
    duration_s: float
    world_size: int
    diagnosis: str | None = None
    divergence: dict | None = None
    timeout_s: float | None = None
    job_dir: str | None = None
    early_stop: str | None = None
    timed_out_by: str | None = None  # the limit that stopped the world, e.g. '--ltconform-timeout=120'
    mismatch: dict | None = None  # the first collective the ranks issued differently (Flight Recorder)
    # Why ranks were killed before that limit: '40 s after rank(s) 0 failed, before the time limit (...)'.
    killed_early: str | None = None

    @classmethod
    def of(cls, ranks: list[RankOutcome], duration_s: float, *, timeout_s: float | None = None,
           job_dir: str | None = None, early_stop: str | None = None,
           timed_out_by: str | None = None, killed_early: str | None = None) -> JobResult:
        """The result of ``ranks`` (in rank order), diagnosed when any rank hung, died or raised."""
        status = max((r.status for r in ranks), key=SEVERITY.__getitem__)
        result = cls(status=status, ranks=ranks, duration_s=round(duration_s, 3), world_size=len(ranks),
                     timeout_s=timeout_s, job_dir=job_dir, early_stop=early_stop, timed_out_by=timed_out_by,
                     killed_early=killed_early)
        if status in ("hung", "died", "error"):
            result.divergence = diagnose.first_divergence([r.trace for r in ranks])
            result.mismatch = diagnose.collective_mismatch(ranks)
            result.diagnosis = diagnose.describe(result)
        return result

    @property
    def values(self) -> list:
        return [r.value for r in self.ranks]

    def diagnosis_after(self, cause) -> str:
        """The diagnosis for an item that already shows ``cause`` (a :class:`~.causes.Cause` or
        None): the peers' collective failures it names as consequences are not repeated."""
        if not self.diagnosis:
            return ""
        if cause is None or not (cause.consequences or cause.alike or cause.own):
            return self.diagnosis
        return diagnose.describe(self, consequences_named=True)

    def failure_text(self) -> str:
        """Every failed rank's traceback, rank-tagged, then the diagnosis."""
        parts = []
        for r in self.ranks:
            if r.status == "ok":
                continue
            head = f"--- rank {r.rank}: {r.status}"
            if r.exc_type:
                head += f" ({r.exc_type}: {r.message})"
            if r.exit_code is not None and r.status == "died":
                head += f" ({exit_words(r.exit_code)})"
            parts.append(head)
            if r.traceback or r.log_tail:
                parts.append("\n".join(f"[rank{r.rank}] {line}" for line in bounded_lines(r.traceback or r.log_tail)))
        if self.diagnosis:
            parts.append(self.diagnosis)
        return "\n".join(parts)



def read_trace(path: str) -> list[dict]:
    """Events of one rank's trace file; a torn last line (a killed rank) is dropped."""
    events = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    break
    except OSError:
        pass
    return events
