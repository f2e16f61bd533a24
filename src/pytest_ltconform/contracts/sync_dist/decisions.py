"""Decisions every rank needs (pytest side): where ``should_stop`` first differs, learning rates
that part ways, and checkpoint paths built from a metric that is not synced."""

from __future__ import annotations

import math
import re

from ...claims import Claim, claim
from ...events import LOG
from ...sites import fmt_site, hook_label
from ..base import Evidence, Run
from .probe import DECISION

STOP_FIX = ("set trainer.should_stop from a value every rank shares (reduce it with "
            "trainer.strategy.reduce_boolean_decision) or use EarlyStopping on a synced metric.")
_TEMPLATE_KEY = re.compile(r"\{([^{}:]+)(?::[^{}]*)?\}")
_NOT_METRICS = ("epoch", "step")


def stop_events(run: Run, rank: int) -> list[dict]:
    return [e for e in run.events(rank, DECISION) if e.get("name") == "should_stop"]


def _last_step(run: Run, rank: int) -> int:
    return max((e.get("step", -1) for e in run.job.ranks[rank].trace if isinstance(e.get("step"), int)),
               default=-1)


def stop_divergence(run: Run) -> dict | None:
    """The first change of ``trainer.should_stop`` that not every rank made at the same epoch and
    global step: ``{"setter": rank, "event": e, "others": {rank: event or None}}``; None when the
    ranks agree as far as they all got."""
    per_rank = [stop_events(run, r) for r in range(run.world_size)]
    for i in range(max((len(p) for p in per_rank), default=0)):
        row = {r: (p[i] if i < len(p) else None) for r, p in enumerate(per_rank)}
        marks = {r: (e["value"], e.get("epoch"), e.get("step")) if e else None for r, e in row.items()}
        if len(set(marks.values())) == 1:
            continue
        present = [(e.get("epoch", 0), e.get("step", 0), r) for r, e in row.items() if e]
        _, step, setter = min(present)
        event = row[setter]
        # A rank that never got as far as that step has not disagreed yet.
        if any(e is None and _last_step(run, r) < step for r, e in row.items()):
            return None
        return {"setter": setter, "event": event, "others": {r: e for r, e in row.items() if r != setter}}
    return None


def stop_texts(run: Run, div: dict) -> tuple[str, list[Evidence], list[Claim]]:
    """(summary, evidence, claims) of a should_stop divergence."""
    event, setter = div["event"], div["setter"]
    step, epoch = event.get("step"), event.get("epoch")
    hook = hook_label(event.get("hook") or event.get("action"))
    site = fmt_site(event.get("site"))
    others = []
    evidence = [Evidence(f"trainer.should_stop = {event['value']} in {hook} at epoch {epoch}, global step {step}",
                         rank=setter, site=site)]
    for r, e in sorted(div["others"].items()):
        if e is None:
            others.append(f"rank {r} did not (still {not event['value']} at that step)")
            evidence.append(Evidence(f"trainer.should_stop still {not event['value']} at global step {step} "
                                     f"(got as far as step {_last_step(run, r)})", rank=r))
        else:
            where = f"epoch {e.get('epoch')}, global step {e.get('step')}"
            others.append(f"rank {r} only at {where}")
            evidence.append(Evidence(f"trainer.should_stop = {e['value']} in "
                                     f"{hook_label(e.get('hook') or e.get('action'))} at {where}", rank=r,
                                     site=None if e.get("site") else fmt_site(None), frame=e.get("site")))
    at_step = {f"rank {setter}": event["value"]}
    at_step.update({f"rank {r}": (not event["value"]) if e is None or e.get("step") != step else e["value"]
                    for r, e in sorted(div["others"].items())})
    differ = claim("differ", f"trainer.should_stop differs across ranks from global step {step}", values=at_step)
    summary = (f"{differ.text} (epoch {epoch}): rank {setter} "
               f"set it to {event['value']} in {hook} at {site}, {'; '.join(others)}. Each rank leaves the "
               f"training loop at a different batch, so the next collective of one rank pairs with a different "
               f"one, or with none, on the others.")
    return summary, evidence, [differ]


def _lrs_close(a: list, b: list) -> bool:
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False
    return all(math.isclose(u, v, rel_tol=1e-6, abs_tol=1e-12) for x, y in zip(a, b) for u, v in zip(x, y))


def _lrs_at(changes: list[dict], step: int):
    last = None
    for change in changes:
        if change["step"] <= step:
            last = change["lrs"]
    return last


def lr_divergence(changes: list[list[dict]]) -> tuple[dict, list] | None:
    """The first learning-rate change the ranks do not share: (the earliest such change, [each
    rank's learning rates at its global step]); None when they agree as far as they all got."""
    for i in range(max((len(c) for c in changes), default=0)):
        row = [c[i] for c in changes if i < len(c)]
        head = min(row, key=lambda x: x["step"])
        if len(row) == len(changes) and all(x["step"] == head["step"] and _lrs_close(x["lrs"], head["lrs"])
                                            for x in row):
            continue
        lrs = [_lrs_at(c, head["step"]) for c in changes]
        if any(x is None or not _lrs_close(x, lrs[0]) for x in lrs):
            return head, lrs
    return None


def lr_texts(head: dict, lrs: list) -> tuple[str, list[Evidence], list[Claim]]:
    differ = claim("differ", "the optimizers' learning rates differ across ranks",
                   values={f"rank {r}": x for r, x in enumerate(lrs)}, rel=1e-6)
    summary = (f"{differ.text} from global step {head['step']} (epoch "
               f"{head['epoch']}, seen at {head['hook']}): a scheduler stepped on a rank-local value (e.g. "
               f"ReduceLROnPlateau on an unsynced metric) or on some ranks only, so the ranks apply different "
               f"learning rates to the gradients DDP averaged.")
    evidence = [Evidence(f"learning rates per optimizer and param group at global step {head['step']}: "
                         f"{_fmt_lrs(x)}", rank=r) for r, x in enumerate(lrs)]
    return summary, evidence, [differ]


def _fmt_lrs(lrs) -> str:
    if lrs is None:
        return "unchanged"
    return "; ".join("[" + ", ".join(f"{v:.6g}" for v in groups) + "]" for groups in lrs)


def filename_metrics(template: str | None) -> list[str]:
    """The metric names a ModelCheckpoint filename template interpolates (``{epoch}`` and
    ``{step}`` excluded): ``"{epoch}-{val_acc:.3f}"`` -> ``["val_acc"]``."""
    names = [m.strip() for m in _TEMPLATE_KEY.findall(template or "")]
    return [n for n in dict.fromkeys(names) if n and n not in _NOT_METRICS]


def unsynced_filename_metric(run: Run, template: str | None) -> dict | None:
    """The first metric of a filename template that is logged without a cross-rank reduction
    (no sync_dist, or rank_zero_only; a TorchMetrics object syncs itself): its first log event."""
    for name in filename_metrics(template):
        logs = [e for e in run.events(0, LOG) if e.get("name") == name]
        if logs and not any(e.get("vtype") == "metric" or (e.get("sync_dist") and not e.get("rank_zero_only"))
                            for e in logs):
            return logs[0]
    return None
