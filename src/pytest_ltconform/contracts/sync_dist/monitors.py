"""Monitored metrics (pytest side): every value a callback read, compared across ranks where it read it.

EarlyStopping checks its monitor at ``on_train_epoch_end`` (Lightning's default when validation
runs every epoch, or ``check_on_train_epoch_end=True``) or at ``on_validation_end``;
ModelCheckpoint ranks its top k where ``check_monitor_top_k`` runs (after validation, at the
train epoch's end with no validation loop, or every n train steps); a ReduceLROnPlateau scheduler
reads its monitor at the epoch's learning-rate update. The probe records each of those reads with
the value it found (``reads``); the i-th read of one callback is compared across ranks. A run
recorded without reads (hand-made runs) falls back to the snapshots after every validation.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ...claims import Claim, claim
from ...sites import fmt_site


def fmt(value) -> str:
    return "missing" if value is None else f"{value:.6g}"


def differs(values: list, rel: float = 1e-5) -> bool:
    present = [v for v in values if v is not None and math.isfinite(v)]  # NaN or inf compares nothing
    if len(present) < 2:
        return False
    lo, hi = min(present), max(present)
    return hi - lo > rel * max(1.0, abs(hi))


def _recorded_reads(run) -> list[list[dict]] | None:
    """Each rank's reads outside the sanity check; None when a rank's probe has no ``reads``."""
    probes = run.probe("sync-dist")
    if any(p is None or "reads" not in p for p in probes):
        return None
    return [[r for r in p["reads"] if not r.get("sanity")] for p in probes]


def compared(run, key: str) -> list[dict]:
    """``[{"by", "epoch", "where", "values": [value per rank]}]``: every read of ``key`` by one
    callback that every rank made, in order (``by`` "read by EarlyStopping in on_train_epoch_end",
    ``where`` that and " at epoch 1"); from the snapshots after each validation ("after
    validation") where the run recorded no reads."""
    per_rank = _recorded_reads(run)
    if per_rank is None:
        return _after_validation(run, key)
    streams: list[dict] = []
    for reads in per_rank:
        by_callback = defaultdict(list)
        for read in reads:
            if read["key"] == key:
                by_callback[(read["owner"], read["cls"], read["n"])].append(read)
        streams.append(by_callback)
    rows = []
    for callback in dict.fromkeys(c for s in streams for c in s):
        lists = [s.get(callback, []) for s in streams]
        for i in range(min(len(x) for x in lists)):
            head = lists[0][i]
            rows.append(_row(f"read by {head['cls']} in {head.get('hook') or 'an unknown hook'}", head["epoch"],
                             [x[i]["value"] for x in lists]))
    return rows


def _row(by: str, epoch: int, values: list) -> dict:
    return {"by": by, "epoch": epoch, "where": f"{by} at epoch {epoch}", "values": values}


def _after_validation(run, key: str) -> list[dict]:
    per_rank = [[s for s in (v or {}).get("snapshots", []) if s["event"] == "validation_end"]
                for v in run.probe("sync-dist")]
    return [_row("after validation", per_rank[0][i]["epoch"], [s[i]["metrics"].get(key) for s in per_rank])
            for i in range(min((len(s) for s in per_rank), default=0))]


def read_anywhere(run, key: str) -> bool | None:
    """Whether some rank's callback read ``key`` at all; None where the run recorded no reads."""
    per_rank = _recorded_reads(run)
    return None if per_rank is None else any(r["key"] == key for reads in per_rank for r in reads)


def value_rows(key: str, rows: list[dict]) -> list[str]:
    return [f"{key!r} {row['where']}: " + " vs ".join(f"rank {r} {fmt(v)}" for r, v in enumerate(row["values"]))
            for row in rows]


def failure_texts(key: str, owners: list[str], logs: list[dict],
                  rows: list) -> tuple[str, list[str], list[Claim]] | None:
    """(summary, evidence lines, claims) of a monitored key that is not reduced across ranks (logged
    with rank_zero_only, or without sync_dist with values that differ where a callback read them);
    None when it is reduced, or unsynced but never seen to differ."""
    diff = [row for row in rows if differs(row["values"])]
    # The log call that published what the callbacks read: the last one of the key.
    last = logs[-1] if logs else {}
    made = []
    at = ""
    if last:
        where = fmt_site(last.get("site"))
        at = f" in {last.get('hook')} at {where}"
        if last.get("site"):
            made.append(claim("site", where, frame=last["site"], call="log_dict" if last.get("via") == "log_dict"
                              else "log"))
    owner_text = "/".join(owners) + " monitor"
    measured = ""
    if diff:
        differ = claim("differ", f"its value differs across ranks ({diff[0]['where']})",
                       values={f"rank {r}": v for r, v in enumerate(diff[0]["values"])})
        made.append(differ)
        measured = f", and {differ.text}"
    rzo = any(e.get("rank_zero_only") for e in logs)
    synced = any(e.get("sync_dist") for e in logs)
    if rzo and synced:
        summary = (f"monitored metric {key!r} ({owner_text}) logged with sync_dist=True and rank_zero_only=True{at}: "
                   f"in Lightning 2.6.6 rank_zero_only disables the sync, so each rank's {owners[0]} decides on its "
                   f"own shard's value{measured}.")
    elif rzo:
        summary = (f"monitored metric {key!r} ({owner_text}) logged with rank_zero_only=True and not synced{at}: "
                   f"Lightning never reduces it, so every rank's {owners[0]} decides on its own shard's value"
                   f"{measured}.")
    elif diff and not synced:
        as_float = (" as a Python float (e.g. .item()), for which Lightning gives no sync_dist warning,"
                    if any(e.get("vtype") == "float" for e in logs) else "")
        logged = f" is logged{as_float} without sync_dist{at}" if logs else " is never logged by the module"
        summary = f"monitored metric {key!r} ({owner_text}){logged}{measured}."
    else:
        return None
    evidence = value_rows(key, diff[:4])
    if not diff and rows:
        evidence.append(f"{key!r} happened to agree across ranks at the {len(rows)} values compared in this run; "
                        f"it is still not reduced")
    return summary, evidence, made


def pass_text(run, keys: list[str]) -> tuple[list[str], list[Claim], list[str]]:
    """(sentences, claims, keys not judged) for monitored keys that agree: each names the reads it
    compared; a key no callback read on every rank compared nothing and is said not judged."""
    parts, made, unjudged = [], [], []
    for key in keys:
        # A read where some rank had no value (or NaN, inf) compares nothing: it is not called equal.
        rows = [row for row in compared(run, key)
                if all(v is not None and math.isfinite(v) for v in row["values"])]
        if not rows:
            unjudged.append(key)
            continue
        bys = list(dict.fromkeys(row["by"] for row in rows))
        epochs = sorted({row["epoch"] for row in rows})
        span = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]}"
        text = (f"monitored {key!r} equal on every rank at each of the {len(rows)} value(s) compared "
                f"({'; '.join(bys)}, {span})")
        made.append(claim("equal", text, each=[{f"rank {r}": v for r, v in enumerate(row["values"])} for row in rows]))
        parts.append(text)
    return parts, made, unjudged


def not_finite(run, key: str) -> tuple[str, Claim] | None:
    """'is not judged, because the value is NaN on ranks 0 and 1 at 2 of its 2 reads' (and its
    claim, kind 'not-finite') for a monitored key some read of which is NaN or inf on a rank; None
    when every value read is finite or missing."""
    rows = compared(run, key)
    bad = [row for row in rows if any(v is not None and not math.isfinite(v) for v in row["values"])]
    if not bad:
        return None
    values = bad[0]["values"]
    ranks = [r for r, v in enumerate(values) if v is not None and not math.isfinite(v)]
    odd = [values[r] for r in ranks]
    word = "NaN" if all(math.isnan(v) for v in odd) else "inf" if not any(math.isnan(v) for v in odd) else "NaN/inf"
    where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    text = (f"is not judged, because the value is {word} on {where} at {len(bad)} of its {len(rows)} "
            f"read(s) ({bad[0]['where']}) and no read has a finite value on every rank")
    return text, claim("not-finite", text, values={f"rank {r}": v for r, v in enumerate(values)})
