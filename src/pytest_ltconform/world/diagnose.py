"""Where ranks diverged, and where each rank was when the world stopped.

Ranks are aligned by hook: every rank records each hook it enters with a running index
(``h``), and in a healthy data-parallel run the k-th hook is the same on every rank. Two ranks
diverge at the first hook index where their hook names differ, or where the user's
collective-bearing calls (or synced log calls) made inside that hook differ. A rank that was
still inside a hook when it stopped is compared as a prefix, so "not there yet" is never
mistaken for "never called". Pure Python: runs in the pytest process on plain trace data.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

from ..events import CALL, EXIT, FLIGHT_RECORD, HOOK, HOOK_EXIT, LOG
from ..sites import first_sentence, fmt_site, hook_label, is_user_file
from .causes import exit_words, is_transport_failure, raised_in_user_code, stack_frames, user_raise_site


def is_collective_bearing(event: dict) -> bool:
    """A user-level call that the other ranks must match: saves, strategy and raw collectives,
    and self.log calls that Lightning will all-reduce."""
    if CALL.of(event):
        return bool(event.get("user"))
    if LOG.of(event):
        return bool(event.get("sync_dist")) and not event.get("rank_zero_only")
    return False


def signature(event: dict) -> tuple:
    if LOG.of(event):
        return (LOG, event.get("name"))
    return (CALL, event.get("label"))


def describe_event(event: dict) -> str:
    if LOG.of(event):
        how = "log_dict" if event.get("via") == "log_dict" else "self.log"
        return f"{how}({event.get('name')!r}, sync_dist=True) at {fmt_site(event.get('site'))}"
    return f"{event.get('label')}() at {fmt_site(event.get('site'))}"


def _hooks(trace: list[dict]) -> tuple[dict[int, str], set[int]]:
    names, exited = {}, set()
    for e in trace:
        if HOOK.of(e):
            names[e["i"]] = e["name"]
        elif HOOK_EXIT.of(e):
            exited.add(e["i"])
    return names, exited


def first_divergence(traces: list[list[dict]], select=is_collective_bearing) -> dict | None:
    """The first hook index at which the ranks' selected events differ.

    Returns None when every rank agrees as far as they all got, else a dict with ``kind``
    ('calls' or 'hooks'), ``h``, ``hook`` and ``events`` per rank, ``position`` per rank
    (epoch, step) and ``counts`` (selected-event signature -> count, per rank, whole run).
    """
    if len(traces) < 2:
        return None
    hooks = [_hooks(t) for t in traces]
    by_hook: list[dict[int, list[dict]]] = []
    for t in traces:
        grouped: dict[int, list[dict]] = defaultdict(list)
        for e in t:
            if select(e):
                grouped[e.get("h", 0)].append(e)
        by_hook.append(grouped)
    common = min(max(names, default=0) for names, _ in hooks)
    counts = {r: dict(Counter(" ".join(map(str, signature(e))) for e in t if select(e)))
              for r, t in enumerate(traces)}
    for k in range(0, common + 1):
        names = {r: hooks[r][0].get(k) for r in range(len(traces))}
        if k and len(set(names.values())) > 1:
            return _divergence("hooks", k, names, by_hook, traces, counts)
        lists = {r: [signature(e) for e in by_hook[r].get(k, [])] for r in range(len(traces))}
        if len({tuple(v) for v in lists.values()}) == 1:
            continue
        complete = {r: (k == 0 or k in hooks[r][1]) for r in range(len(traces))}
        longest = max(lists.values(), key=len)
        # A rank still inside hook k may just not have got as far as the others.
        if all(complete[r] or longest[: len(v)] == v for r, v in lists.items()) and \
                all(v == longest for r, v in lists.items() if complete[r]):
            continue
        return _divergence("calls", k, names, by_hook, traces, counts)
    return None


def _position(trace: list[dict], h: int) -> dict:
    for e in trace:
        if e.get("h") == h and "epoch" in e:
            return {"epoch": e.get("epoch"), "step": e.get("step"), "sanity": e.get("sanity")}
    return {}


def _divergence(kind, k, names, by_hook, traces, counts) -> dict:
    return {
        "kind": kind, "h": k,
        "hook": {r: hook_label(n) for r, n in names.items()},
        "events": {r: by_hook[r].get(k, []) for r in range(len(traces))},
        "position": {r: _position(traces[r], k) for r in range(len(traces))},
        "counts": counts,
    }




def stack_summary(stack: str | None) -> str | None:
    """The innermost frame and the innermost user frame of a faulthandler dump (main thread)."""
    frames = stack_frames(stack)
    if not frames:
        return None
    inner = frames[0]
    user = next((f for f in frames if is_user_file(f["file"])), None)
    text = f"{inner['func']}() in {os.path.basename(inner['file'])}:{inner['line']}"
    if user and user is not inner:
        text += f" <- {fmt_site({'file': user['file'], 'line': user['line'], 'func': user['func']})}"
    return text


def _call_chain(calls: dict[int, dict], innermost: dict) -> str:
    chain = [innermost]
    while chain[-1].get("parent") in calls:
        chain.append(calls[chain[-1]["parent"]])
    outer = chain[-1]
    text = f"in {innermost['label']}"
    if outer is not innermost:
        text += f" from {outer['label']}"
    return text + (f" <- {fmt_site(outer['site'])}" if outer.get("site") else "")


def _hooks_text(names: list[str]) -> str:
    hooks = [hook_label(n) for n in names]
    module_hooks = [h for h in hooks if "Strategy" not in h.split(".")[0]] or hooks
    text = f"inside {module_hooks[-1]}"
    if hooks[-1] != module_hooks[-1]:
        text += f" ({hooks[-1]})"
    return text


def rank_position(trace: list[dict]) -> str:
    """Where a rank was when it stopped: the traced call it was in (or that raised), the hook it
    was in, and its epoch and global step."""
    calls: dict[int, dict] = {}
    open_calls: dict[int, dict] = {}
    open_hooks: dict[int, str] = {}
    raised = None
    last = {}
    for e in trace:
        if CALL.of(e):
            calls[e["seq"]] = open_calls[e["seq"]] = e
        elif EXIT.of(e):
            done = open_calls.pop(e.get("of"), None)
            if e.get("raised") and raised is None and done is not None:
                raised = (done, e)
        elif HOOK.of(e):
            open_hooks[e["i"]] = e["name"]
        elif HOOK_EXIT.of(e):
            open_hooks.pop(e.get("i"), None)
        if "epoch" in e:
            last = e
    parts = []
    if open_calls:
        innermost = max(open_calls.values(), key=lambda e: e["seq"])
        parts.append(_call_chain(calls, innermost))
        if open_hooks:
            parts.append(_hooks_text([open_hooks[i] for i in sorted(open_hooks)]))
    elif raised is not None:
        call, exit_event = raised
        parts.append(f"{exit_event['raised']} raised {_call_chain(calls, call)}")
        if exit_event.get("hooks"):
            parts.append(_hooks_text(exit_event["hooks"]))
    elif open_hooks:
        parts.append(_hooks_text([open_hooks[i] for i in sorted(open_hooks)]))
    elif trace:
        parts.append("between hooks")
    if last:
        where = "sanity check" if last.get("sanity") else f"epoch {last.get('epoch')}"
        parts.append(f"{where}, global step {last.get('step')}")
    return ", ".join(parts) if parts else "no trace recorded"


def _rank_place(outcome) -> str:
    """:func:`rank_position`, except that a rank which raised in its own code was where it raised
    (the trace records hooks, not every step call, so it would read "between hooks")."""
    position = rank_position(outcome.trace)
    site = user_raise_site(outcome.traceback) if raised_in_user_code(outcome) else None
    if site is None or not position.startswith("between hooks"):
        return position
    return f"raised {outcome.exc_type} at {fmt_site(site)}" + position[len("between hooks"):]


def describe(result, *, consequences_named: bool = False) -> str:
    """The readable hang/crash block for a :class:`~.local.JobResult`. ``consequences_named``: the
    caller already names the peers' collective failures (a cause's consequence line), so they are
    not said a second time."""
    lines = []
    statuses = Counter(r.status for r in result.ranks)
    if statuses.get("hung"):
        stuck = [r.rank for r in result.ranks if r.status == "hung"]
        ranks = ", ".join(map(str, stuck))
        if getattr(result, "early_stop", None):
            lines.append(f"The world did not finish: rank(s) {ranks} were {result.early_stop}, and were killed "
                         f"(SIGKILL) after {result.duration_s:.1f} s.")
        else:
            limit, early = getattr(result, "timed_out_by", None), getattr(result, "killed_early", None)
            limit = f" at the time limit ({limit}; raise it if the run is only slow)" if limit else \
                f" {early}" if early else ""
            lines.append(f"The world did not finish: rank(s) {ranks} were still running after "
                         f"{result.duration_s:.1f} s and were killed (SIGKILL){limit}.")
    if statuses.get("died"):
        for r in result.ranks:
            if r.status == "died":
                lines.append(f"Rank {r.rank} exited without a result ({exit_words(r.exit_code)}).")
    transport = [r for r in result.ranks if is_transport_failure(r)]
    for r in result.ranks:
        # A named cause already shows every failed rank (its traceback, the others in one line).
        if r.status == "error" and r not in transport and not consequences_named:
            lines.append(f"Rank {r.rank} raised {r.exc_type}: {first_sentence(r.message, 300)}")
    if transport and not consequences_named:
        ranks = ", ".join(str(r.rank) for r in transport)
        lines.append(f"Rank(s) {ranks} then failed inside a collective whose peer had stopped or gone "
                     f"({transport[0].exc_type}: {first_sentence(transport[0].message, 120)}): a consequence, "
                     f"not a cause.")
    div = result.divergence
    # After a rank raised in user code, where the others' calls parted is only what followed it.
    if div and not any(raised_in_user_code(r) for r in result.ranks):
        if div["kind"] == "hooks":
            lines.append(f"Ranks ran different hooks at hook #{div['h']} (different numbers of batches or "
                         f"a rank-dependent branch):")
            for r, name in div["hook"].items():
                lines.append(f"  rank {r}: {name}")
        else:
            pos = next(iter(div["position"].values()), {}) or {}
            when = "sanity check" if pos.get("sanity") else f"epoch {pos.get('epoch')}, step {pos.get('step')}"
            hook = next(iter(div["hook"].values()))
            lines.append(f"First divergence: inside {hook} ({when}) the ranks made different collective-bearing calls:")
            for r, events in div["events"].items():
                if events:
                    lines.append(f"  rank {r}: " + "; ".join(describe_event(e) for e in events))
                else:
                    lines.append(f"  rank {r}: none (it went on past this hook)")
    where = []
    for r in result.ranks:
        stack = stack_summary(r.stack) if r.status in ("hung", "died") else None
        parts = ([_rank_place(r)] if r.trace else []) + ([f"stack: {stack}"] if stack else [])
        if parts:
            where.append(f"  rank {r.rank} ({r.status}): {'; '.join(parts)}")
    if where:
        lines.append("Where each rank was:")
        lines.extend(where)
    return "\n".join(lines)


# -- every collective: torch's Flight Recorder ---------------------------------------------------
# Frames of the standard library between the user's call and a collective (contextlib's
# __enter__) do not name the call; the library function the user called does.
_NAMING_SKIP = ("contextlib.py", "functools.py")
# This plugin's own wrappers (the recorder's taps) are not the call either.
_PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _collectives(outcome) -> dict[tuple, dict]:
    """``{(pg, seq): entry}`` of the rank's collectives (not point-to-point), from its last
    ``collectives`` event with frames, else its last one; the entry the rank was blocked in when it
    was stuck gets the frames of its faulthandler dump."""
    entries = trace_collectives(outcome.trace)
    stack = stack_frames(outcome.stack)
    if entries and not any(e.get("frames") for e in entries.values()) and stack:
        last = max(entries, key=lambda k: k[1] or 0)
        entries[last]["frames"] = [[f["file"], f["line"], f["func"]] for f in stack]
    return entries


def trace_collectives(trace: list[dict] | None) -> dict[tuple, dict]:
    """``{(pg, seq): entry}`` of one rank's collectives (not point-to-point) from its trace: its
    last ``collectives`` event with frames, else its last one; {} without one."""
    dumps = FLIGHT_RECORD.find(trace)
    if not dumps:
        return {}
    dump = next((d for d in reversed(dumps) if d.get("frames")), dumps[-1])
    return {(e.get("pg"), e.get("seq")): dict(e) for e in dump.get("entries") or [] if not e.get("is_p2p")}


def first_break(per_rank: dict[int, dict[tuple, dict]]) -> tuple | None:
    """The first ``(pg, seq)`` at which two ranks' collectives differ in operation or tensor sizes
    (collectives pair up by sequence number within a process group, so the world broke there);
    None when they agree as far as each rank got."""
    keys = sorted({k for entries in per_rank.values() for k in entries}, key=lambda k: (str(k[0]), k[1] or 0))
    for key in keys:
        present = {r: e[key] for r, e in per_rank.items() if key in e}
        if len(present) > 1 and len({(e.get("op"), json_key(e.get("sizes"))) for e in present.values()}) > 1:
            return key
    return None


def collectives_parted(traces: list[list[dict]], waiting: list[int]) -> tuple | None:
    """While ranks ``waiting`` still run: the ``(pg, seq)`` at which the collectives the ranks
    recorded so far no longer pair up, when every waiting rank is blocked in a collective (its
    watch thread wrote its Flight Recorder entries once it had been blocked for a second, and it
    recorded nothing since); None otherwise. A collective whose operation or sizes differ across
    ranks never completes on gloo: its ranks would wait out the process group's timeout."""
    if any(not traces[r] or not FLIGHT_RECORD.of(traces[r][-1]) or traces[r][-1].get("why") != "blocked"
           for r in waiting):
        return None
    per_rank = {r: trace_collectives(t) for r, t in enumerate(traces)}
    if len(per_rank) < 2 or not all(per_rank.values()):
        return None
    return first_break(per_rank)


def call_of(frames: list) -> dict:
    """``{"site", "via"}`` of a collective's frames (innermost first): the first user frame, and
    the library function that user frame called (what the user sees as the call, e.g.
    ``callback_metrics``, ``summon_full_params``, ``all_reduce``)."""
    site, via = None, None
    for file, line, func in frames or []:
        if is_user_file(file):
            site = {"file": file, "line": line, "func": func}
            break
        if not file.endswith(_NAMING_SKIP) and not os.path.abspath(file).startswith(_PLUGIN_DIR):
            via = {"file": file, "line": line, "func": func}
    return {"site": site, "via": via if site else None}


def _user_path(frames: list) -> tuple:
    return tuple((f, ln) for f, ln, _ in frames or [] if is_user_file(f))


def _different_calls(entries: dict) -> bool:
    """Whether the ranks made this collective from different places in user code *and* through
    different calls (another operation, or another library function): two branches that each
    broadcast from their own line are the same call, paired as the user meant."""
    paths = {_user_path(e.get("frames")) for e in entries.values()}
    calls = {(e.get("op"), (call_of(e.get("frames"))["via"] or {}).get("func")) for e in entries.values()}
    return len(paths) > 1 and len(calls) > 1


def collective_mismatch(ranks: list) -> dict | None:
    """The first collective the ranks issued differently, from torch's Flight Recorder.

    Collectives pair up by sequence number within a process group; the first number at which the
    ranks' operations (or tensor sizes) differ is where the world broke. Calls made from different
    places in user code may still have paired up silently before that (an all-gather of the same
    size): the first such number, at or before the break, is the first mismatched call. Returns
    None without a break, else ``{"pg", "seq", "broke_at", "calls": {rank: {"op", "sizes", "site",
    "via"}}}``; a rank without that collective has no key in ``calls``."""
    per_rank = {r.rank: _collectives(r) for r in ranks}
    if len(per_rank) < 2 or not all(per_rank.values()):
        return None
    keys = sorted({k for entries in per_rank.values() for k in entries}, key=lambda k: (str(k[0]), k[1] or 0))
    broke = first_break(per_rank)
    if broke is None:
        return None
    first = broke
    for key in keys:
        if key[0] != broke[0] or (key[1] or 0) > (broke[1] or 0):
            continue
        present = {r: e[key] for r, e in per_rank.items() if key in e}
        if len(present) > 1 and all(e.get("frames") for e in present.values()) and _different_calls(present):
            first = key
            break
    calls = {}
    for r, entries in per_rank.items():
        if first in entries:
            e = entries[first]
            calls[r] = {"op": e.get("op"), "sizes": e.get("sizes"), **call_of(e.get("frames"))}
    return {"pg": first[0], "seq": first[1], "broke_at": broke[1], "calls": calls}


def json_key(value) -> str:
    return repr(value)
