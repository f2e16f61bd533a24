"""Which rank's failure came first, and which failures are only its consequences.

When one rank raises on its own (a ``ValueError`` in the user's step, an out-of-memory error, an
``os._exit``), its peers fail a moment later inside their next collective with a transport error
("Connection closed by peer", a recv timeout). Those peer errors are symptoms: the report leads
with the rank that failed for its own reason, at the user's line, and names the others in one line.
Pure Python over a :class:`~.local.JobResult`; imports nothing above the world layer.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal

from ..events import EXCEPTION
from ..sites import bounded_lines, first_sentence, fmt_frame, fmt_site, frame_owner, is_user_file

# Exception types and message fragments of a collective that failed because a peer went away or
# never came (gloo, NCCL and the c10d store); a rank failing this way is a consequence.
_TRANSPORT_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_TRANSPORT_TEXT = (
    "connection closed by peer", "connection reset by peer", "timed out waiting", "broken pipe",
    "gloo/transport", "socket timeout", "ncclremoteerror", "nccl communicator was aborted",
    "watchdog caught collective operation timeout", "recvbytes", "sendbytes",
    "application timeout caused pair closure",  # gloo, when the peer never came to the collective
)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)')
# A frame of a faulthandler dump (no comma before "in").
_STACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def exit_words(code: int | None) -> str:
    """'exit code 3', or for a negative code the signal: 'killed by SIGKILL (exit code -9; ...)'."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"exit code {code}"
    oom = "; the kernel's out-of-memory killer sends SIGKILL too" if name == "SIGKILL" else ""
    return f"killed by {name} (exit code {code}{oom})"


def is_transport_failure(outcome) -> bool:
    """True when ``outcome`` (a RankOutcome) failed inside a collective because a peer stopped:
    the consequence of another rank's failure, not a cause of its own."""
    if outcome.status != "error":
        return False
    if outcome.exc_type in _TRANSPORT_TYPES:
        return True
    text = f"{outcome.message or ''}".lower()
    return any(fragment in text for fragment in _TRANSPORT_TEXT)


# Library frames below the user's last frame that make a raise the library's, not the user's.
_OWNED_BELOW = (os.sep + "lightning" + os.sep, os.sep + "pytorch_lightning" + os.sep, os.sep + "torchmetrics" + os.sep,
                os.sep + "lightning_fabric" + os.sep, os.sep + "deepspeed" + os.sep)
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def raised_in_user_code(outcome) -> bool:
    """True when ``outcome`` (a RankOutcome) raised in the user's own code: not a peer's transport
    error, no torch.distributed frame on the way (not a collective that failed), and nothing of
    Lightning, TorchMetrics or DeepSpeed below the user's last frame (a check of theirs, which a
    contract may own). Such a rank leads; its peers' collective failures are consequences."""
    if outcome.status != "error" or is_transport_failure(outcome) or not outcome.traceback:
        return False
    frames = [m.group("file") for m in _FRAME.finditer(outcome.traceback)]
    if not frames or any(_DISTRIBUTED in f for f in frames):
        return False
    last_user = max((i for i, f in enumerate(frames) if is_user_file(f)), default=None)
    if last_user is None:
        return False
    return not any(part in f for f in frames[last_user + 1:] for part in _OWNED_BELOW)


def user_raise_site(traceback_text: str | None) -> dict | None:
    """The innermost user frame of a formatted traceback, as a site dict; None without one."""
    frames = [m.groupdict() for m in _FRAME.finditer(traceback_text or "")]
    for frame in reversed(frames):
        if is_user_file(frame["file"]):
            return {"file": frame["file"], "line": int(frame["line"]), "func": frame["func"].strip()}
    return None


def raise_frames(traceback_text: str | None) -> tuple[dict | None, dict | None]:
    """(the frame that raised, the innermost user frame) of a formatted traceback, as site dicts;
    either is None when the traceback has no such frame."""
    frames = [{"file": m["file"], "line": int(m["line"]), "func": m["func"].strip()}
              for m in _FRAME.finditer(traceback_text or "")]
    return (frames[-1] if frames else None), next((f for f in reversed(frames) if is_user_file(f["file"])), None)


# An error whose text names the CPU, gloo or the devices CPU ranks lack: particular to CPU ranks.
_CPU_WORDS = re.compile(r"\b(?:gloo|ProcessGroupGloo|cpu|CUDA|cuda|NCCL|nccl)\b|device_id|"
                        r"not implemented for '(?:Half|BFloat16)'|Torch not compiled with CUDA")


def cpu_specific(cause: Cause) -> str | None:
    """Why ``cause`` is particular to CPU ranks, from what was recorded: the plugin's own CPU
    stand-in raised it, or its text names the CPU, gloo or CUDA; None when nothing shows that."""
    raised, _user = raise_frames(cause.traceback)
    if raised is not None and frame_owner(raised["file"]) == "plugin":
        return f"the plugin's CPU stand-in raised it, in {fmt_frame(raised)}"
    found = _CPU_WORDS.search(f"{cause.exc_type or ''} {cause.message or ''}")
    return f"the error names {found.group(0)!r}" if found else None


def stopped_where(cause: Cause | None) -> str:
    """Where a run stopped, as a headline says it: 'in your code' only when a user frame raised
    (or a rank hung running the user's own code); else 'in library code', 'in the plugin's code',
    'while a rank waited in library code' or 'when a rank died'."""
    if cause is None:
        return "before it finished"
    if cause.kind == "died":
        return "when a rank died"
    if cause.kind == "hung":
        return "in your code" if cause.site and not cause.frame else "while a rank waited in library code"
    raised, _user = raise_frames(cause.traceback)
    owner = frame_owner(raised["file"]) if raised else ("user" if cause.site else "library")
    return {"user": "in your code", "plugin": "in the plugin's code"}.get(owner, "in library code")


def raised_words(cause: Cause) -> str:
    """``RuntimeError raised in torch/nn/modules/module.py:2593 (load_state_dict), from your code at
    case.py:31 (on_fit_end): <message>``: the exception, the frame that raised it (whose it is) and
    the user's frame it came from; for a rank that died or hung, how it stopped and where."""
    if cause.kind != "raised":
        return cause.headline()
    raised, user = raise_frames(cause.traceback)
    return exception_words(cause.exc_type, cause.message, raised, user or cause.site)


def exception_words(exc_type: str | None, message: str | None, raised: dict | None, user: dict | None) -> str:
    """An exception as one clause: its type, whose code raised it (``raised``, the innermost frame:
    yours, a library's or the plugin's), the user's frame it came from (``user``) and its message."""
    owner = frame_owner(raised["file"]) if raised else None
    if raised is None or owner == "user":
        where = f" in your code at {fmt_site(raised or user)}" if (raised or user) else ""
    else:
        whose = "the plugin's" if owner == "plugin" else "library"
        where = f" in {whose} code at {fmt_frame(raised)}" + (f", from your code at {fmt_site(user)}" if user else
                                                               ", with no frame of your code on the way")
    return f"{exc_type or 'an exception'}{where}" + (f": {first_sentence(message, 300)}" if message else "")


def stack_frames(stack: str | None) -> list[dict]:
    """The main thread's frames of a faulthandler dump, innermost first, as site dicts
    (``file``, ``line``, ``func``); [] without a dump."""
    if not stack:
        return []
    block = stack
    for part in re.split(r"\n(?=(?:Current )?[Tt]hread 0x)", stack):
        if "most recent call first" in part and ("Current thread" in part or "Thread" in part):
            if "ltconform-parent-watch" in part or "in watch" in part:
                continue
            block = part
            if "Current thread" in part:
                break
    frames = [m.groupdict() for m in map(_STACK_FRAME.match, block.splitlines()) if m]
    return [{"file": f["file"], "line": int(f["line"]), "func": f["func"]} for f in frames]


def stack_user_site(stack: str | None) -> tuple[dict | None, bool]:
    """``(site, in_user_code)``: the innermost user frame of a hung rank's dump, and whether the
    rank was running that code itself (its innermost frame is user code, e.g. a sleep or loop of
    its own) rather than waiting inside a library call such as a collective."""
    frames = stack_frames(stack)
    user = next((f for f in frames if is_user_file(f["file"])), None)
    return user, bool(frames) and user is frames[0]


@dataclasses.dataclass
class Cause:
    """The first failure of an unfinished job: ``rank`` and how it stopped (``kind``: 'raised',
    'died' or 'hung'), the user's frame it raised from (``site``), and one line for each other
    rank that stopped as a consequence."""

    rank: int
    kind: str
    exc_type: str | None
    message: str
    site: dict | None
    traceback: str | None
    consequences: list[str]
    # Ranks that raised the same exception at the same place on their own (each reached the code
    # that raised: none of them is a consequence of another), and others' own, different errors.
    alike: list[int] = dataclasses.field(default_factory=list)
    own: list[str] = dataclasses.field(default_factory=list)
    # A rank that hung or died: the exception it recorded first (``exception`` trace event: Lightning's
    # on_exception ran, then the teardown hung or crashed), the innermost frame of its stack when no
    # user frame is on it, and what a C++ abort printed (``what(): ...``).
    recorded: dict | None = None
    frame: dict | None = None
    abort: str | None = None

    def headline(self, alone: bool = False) -> str:
        """``rank 1 raised ValueError at case.py:42 (Model.training_step): bad value``; ``ranks 0 and 1
        each raised ...`` when every one of them raised it on its own (``alone``: this rank only); a
        rank that hung or died also names the exception it raised before (or what its abort printed)."""
        if self.kind == "raised":
            where = f" at {fmt_site(self.site)}" if self.site else ""
            ranks = sorted([self.rank] + ([] if alone else list(self.alike)))
            who = f"rank {self.rank}" if len(ranks) == 1 else \
                "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]} each"
            text = f"{who} raised {self.exc_type}{where}"
            return f"{text}: {self.message}" if self.message else text
        if self.kind == "died":
            text = f"rank {self.rank} died: {self.message}"
        else:
            where = f" at {fmt_site(self.site)}" if self.site else \
                f" in library code at {fmt_frame(self.frame)}" if self.frame else ""
            text = f"rank {self.rank} hung{where}: {self.message}"
        if self.recorded:
            r = self.recorded
            raised = exception_words(r.get("exc_type"), r.get("message"), r.get("raised"), r.get("user"))
            text += f", after it raised {raised}"
        if self.abort:
            text += f"; its output ends with {self.abort!r}"
        return text

    def consequence_line(self) -> str | None:
        """What the other failed ranks did: the same failure on their own, another of their own, or
        a consequence of this one (a collective whose peer had gone)."""
        parts = []
        if self.alike:
            who = "rank " + str(self.alike[0]) if len(self.alike) == 1 else \
                "ranks " + ", ".join(map(str, self.alike))
            parts.append(f"{who} raised the same {self.exc_type} at the same line on its own (every rank reached "
                         f"that code; no rank's failure caused another's).")
        if self.own:
            parts.append("Also on its own: " + "; ".join(self.own) + ".")
        if self.consequences:
            parts.append("Consequences, not causes: " + "; ".join(self.consequences) + ".")
        return " ".join(parts) or None


def _describe_other(outcome) -> str:
    if outcome.status == "error" and is_transport_failure(outcome):
        what = f"{outcome.exc_type}: {first_sentence(outcome.message, 160)}"
        return f"rank {outcome.rank} then failed in a collective ({what})"
    if outcome.status == "error":
        return f"rank {outcome.rank} raised {outcome.exc_type}: {first_sentence(outcome.message, 160)}"
    recorded = next((e for e in outcome.trace or () if EXCEPTION.of(e)), None)
    after = f", after it raised {recorded.get('exc_type')}: {first_sentence(recorded.get('message'), 160)}" \
        if recorded else ""
    if outcome.status == "hung":
        return f"rank {outcome.rank} was left waiting and was killed{after}"
    if outcome.status == "died":
        return f"rank {outcome.rank} exited (exit code {outcome.exit_code}){after}"
    return f"rank {outcome.rank}: {outcome.status}"


def first_cause(result) -> Cause | None:
    """The rank whose failure started the end of ``result`` (a JobResult that did not finish):
    a rank that raised for a reason of its own first, then a rank that died (crash, out of
    memory, ``os._exit``), then any failed rank; None when every rank finished."""
    failed = [r for r in result.ranks if r.status not in ("ok", "skip")]
    if not failed:
        return None
    own = [r for r in failed if r.status == "error" and not is_transport_failure(r)]
    died = [r for r in failed if r.status == "died"]
    # A rank still running at the timeout, when the others only failed in a collective, is what
    # they were waiting for.
    hung = [r for r in failed if r.status == "hung"]
    first = (own or died or hung or failed)[0]
    alike = [r for r in own if r is not first and _same_raise(r, first)]
    different = [r for r in own if r is not first and r not in alike]
    others = [_describe_other(r) for r in failed if r is not first and r not in own]
    recorded = next((e for e in first.trace or () if EXCEPTION.of(e)), None)
    if first.status == "died":
        return Cause(first.rank, "died", None, f"it exited without a result ({exit_words(first.exit_code)})",
                     None, first.log_tail, others, recorded=recorded, abort=_abort_text(first.log_tail))
    if first.status == "hung":
        limit, early = getattr(result, "timed_out_by", None), getattr(result, "killed_early", None)
        stuck = getattr(result, "early_stop", None)  # stopped once the ranks' collectives diverged
        when = f"at the timeout ({limit})" if limit else f"{early}," if early else \
            f"when it was {stuck}" if stuck else "at the timeout"
        site, _ = stack_user_site(first.stack)
        frames = stack_frames(first.stack)
        return Cause(first.rank, "hung", None, f"it was still running {when} and was killed", site, None, others,
                     recorded=recorded, frame=None if site or not frames else frames[0])
    return Cause(first.rank, "raised", first.exc_type, first_sentence(first.message),
                 user_raise_site(first.traceback), first.traceback, others,
                 alike=[r.rank for r in alike], own=[_describe_other(r) for r in different])


def _same_raise(a, b) -> bool:
    """Whether two ranks raised the same exception type with the same first sentence from the
    same innermost frame: the same failure reached on each rank, not one caused by another."""
    def last_frame(outcome):
        frames = [(m.group("file"), m.group("line")) for m in _FRAME.finditer(outcome.traceback or "")]
        return frames[-1] if frames else None

    return (a.exc_type == b.exc_type and first_sentence(a.message) == first_sentence(b.message)
            and last_frame(a) is not None and last_frame(a) == last_frame(b))


# What a C++ exception that aborts the process prints (gloo's EnforceNotMet, a c10::Error), and the
# fatal-error line of Python's faulthandler.
_ABORT = re.compile(r"what\(\):\s*(?P<what>[^\n]+)|(?P<fatal>Fatal Python error: [^\n]+)")


def _abort_text(log_tail: str | None) -> str | None:
    """The first ``what(): ...`` (or ``Fatal Python error: ...``) line a dead rank printed."""
    found = _ABORT.search(log_tail or "")
    if found is None:
        return None
    text = " ".join((found.group("what") or found.group("fatal")).split())
    return text if len(text) <= 240 else text[:240].rsplit(" ", 1)[0] + " ..."


def cause_text(cause: Cause) -> str:
    """The cause's own traceback (rank-tagged) and the consequence line: what one item shows."""
    lines = []
    if cause.traceback:
        lines.append(f"--- rank {cause.rank}: {cause.headline(alone=True)}")
        lines.extend(f"[rank{cause.rank}] {line}" for line in bounded_lines(cause.traceback))
    consequences = cause.consequence_line()
    if consequences:
        lines.append(consequences)
    return "\n".join(lines)
