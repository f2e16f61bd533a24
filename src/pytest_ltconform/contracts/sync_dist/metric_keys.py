"""sync-dist: TorchMetrics objects logged under keys that differ by rank.

A Metric object logged with ``self.log(key, metric)`` is computed by Lightning at the end of the
epoch on every rank that logged ``key``, and computing it all-gathers its state (seed section
"Sampling, metrics and writes": metric states are synced across ranks). When the batch's content
chooses which metric object a step updates and logs, each rank logs the keys its own batches chose:
the ranks then compute (and sync) different metrics at epoch end, whose gathers meet the wrong
partner (a size mismatch, a hang, or one metric's state reduced into another's). Pure data over
the trace's ``log`` events (``vtype`` "metric"); the source is read for the line that chose.
"""

from __future__ import annotations

import ast
import linecache
from collections import defaultdict

from ...events import HOOK, HOOK_EXIT, LOG
from ...sites import fmt_site, hook_label


def metric_key_divergence(run) -> dict | None:
    """The first (hook, epoch) whose epoch-level Metric-object keys differ across ranks:
    ``{"hook", "epoch", "sanity", "keys": {rank: [key, ...]}, "sites": {rank: site}}``; None when
    every rank logged the same keys (or a rank logged none where it never ran the hook)."""
    groups: list[dict[tuple, dict[str, dict]]] = []
    order: list[tuple] = []
    for trace in run.traces:
        mine: dict[tuple, dict[str, dict]] = defaultdict(dict)
        for e in trace:
            if not LOG.of(e) or e.get("vtype") != "metric" or not e.get("on_epoch") or e.get("rank_zero_only"):
                continue
            group = (e.get("hook"), bool(e.get("sanity")), e.get("epoch"))
            mine[group].setdefault(str(e.get("name")), e.get("site"))
            if group not in order:
                order.append(group)
        groups.append(mine)
    for group in order:
        keys = {r: list(g.get(group, {})) for r, g in enumerate(groups)}
        if len({frozenset(k) for k in keys.values()}) == 1:
            continue
        if any(not k and not _ran(run, r, group) for r, k in keys.items()):
            continue  # a rank that never got to the hook (it stopped before) logged nothing there
        sites = {r: next(iter(g[group].values()), None) for r, g in enumerate(groups) if g.get(group)}
        return {"hook": group[0], "sanity": group[1], "epoch": group[2], "keys": keys, "sites": sites}
    return None


def _ran(run, rank: int, group: tuple) -> bool:
    """Whether ``rank`` ran ``group``'s hook to its end at least once (a rank that raised inside it
    logged nothing by accident, not by choice)."""
    hook, sanity, epoch = group
    entered = {e.get("i") for e in run.traces[rank] if HOOK.of(e) and
               str(e.get("name", "")).endswith(f".{hook}") and bool(e.get("sanity")) == sanity and
               e.get("epoch") == epoch}
    return any(HOOK_EXIT.of(e) and e.get("i") in entered for e in run.traces[rank])


def choosing_lines(site: dict | None) -> list[dict]:
    """Where the user's code chose the metric object logged at ``site``: the assignment of the
    logged name before the log call and, when that indexes a container by a name (``metrics[name]``),
    the assignment of that name. Each ``{"site", "text"}``; [] when the source cannot be read."""
    if not site or not site.get("file"):
        return []
    source = "".join(linecache.getlines(site["file"]))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    line = site.get("line") or 0
    fn = max((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.lineno <= line <= (n.end_lineno or n.lineno)), key=lambda n: n.lineno, default=None)
    call = next((n for n in ast.walk(fn) if isinstance(n, ast.Call) and n.lineno == line and
                 isinstance(n.func, ast.Attribute) and n.func.attr == "log" and len(n.args) > 1), None) \
        if fn is not None else None
    out: list[dict] = []
    name = call.args[1].id if call is not None and isinstance(call.args[1], ast.Name) else None
    while name and len(out) < 3:
        assign = _last_assignment(fn, name, line)
        if assign is None:
            break
        out.append({"site": {"file": site["file"], "line": assign.lineno, "func": site.get("func")},
                    "text": ast.unparse(assign).strip()})
        value = assign.value
        index = value.slice if isinstance(value, ast.Subscript) else None
        name, line = (index.id, assign.lineno) if isinstance(index, ast.Name) else (None, line)
    return out


def _last_assignment(fn, name: str, before: int):
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < before and
             any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return max(found, key=lambda n: n.lineno, default=None)


def metric_key_texts(run, found: dict) -> tuple[str, list, str, str]:
    """(summary, [(detail, rank, site)], fix, category) of a Metric-key divergence."""
    keys, hook = found["keys"], hook_label(found["hook"])
    when = "the sanity check" if found["sanity"] else f"epoch {found['epoch']}"
    sets = ", ".join(f"rank {r} {{{', '.join(k) or 'none'}}}" for r, k in sorted(keys.items()))
    site = next(iter(found["sites"].values()), None)
    chose = choosing_lines(site)
    chose_text = f"; the object logged is chosen at {fmt_site(chose[0]['site'])} (`{chose[0]['text']}`)" \
        if chose else ""
    if len(chose) > 1:
        chose_text += f", by a key decided at line {chose[-1]['site']['line']} (`{chose[-1]['text']}`)"
    mm = getattr(run.job, "mismatch", None)
    parted = ""
    if mm and not run.finished:
        ops = "; ".join(f"rank {r}: {c.get('op')} of sizes {c.get('sizes')}" for r, c in sorted(mm["calls"].items()))
        parted = f" The first collective that differed was #{mm['broke_at']} ({ops})."
    summary = (f"TorchMetrics objects logged in {hook} under keys that differ by rank in {when}: {sets}, at "
               f"{fmt_site(site)}{chose_text}. Lightning computes each logged metric at the epoch's end on the "
               f"ranks that logged its key, and computing it all-gathers its state, so the ranks sync different "
               f"metrics against each other.{parted}")
    evidence = [(f"Metric objects logged in {hook} ({when}): {k or 'none'}", r, found["sites"].get(r))
                for r, k in sorted(keys.items())]
    evidence += [(f"chooses the metric: `{c['text']}`", None, c["site"]) for c in chose]
    fix = ("update and log every metric object on every rank (update each with the rows of the batch that are "
           "its own, an empty update where there are none), or log one metric per key whatever the batch holds; "
           "never let a batch's content decide which metric keys a rank logs.")
    category = "deadlock" if not run.finished else "silent"
    return summary, evidence, fix, category
