"""sync-dist: values that ranks reduce, monitor or decide on agree across ranks.

Seed section "Sampling, metrics and writes": ``self.log(..., sync_dist=True)`` all-reduces, so
every rank must make the same synced log calls; nonlinear metrics need TorchMetrics objects;
rank-zero-only logging does not suit monitored metrics that every rank needs.

Checked from the traced fit (rank side: ``probe.py``):

1. deadlocks: the per-rank sequences of synced log calls (name, hook), aligned hook by hook; a
   call on a subset of ranks, different key sets or a different order fails;
2. silent mixing: every metric monitored by ModelCheckpoint, EarlyStopping or a
   ReduceLROnPlateau scheduler must be logged on every rank without ``rank_zero_only`` (in
   Lightning 2.6.6 it disables ``sync_dist``) and have the same value on every rank after every
   validation; a monitored key logged on some ranks only (under a rank guard, say) makes a
   rank that never logged it raise in its callback, and that stop is claimed (:attr:`Blame.LOG`);
3. decisions every rank needs must agree: ``trainer.should_stop`` is watched as it is set, so a
   flag one rank sets (in ``on_train_batch_end``, say) fails at the global step and hook where
   the ranks first differ, with the assignment's file:line, even when the world then hangs
   (:attr:`Blame.DECISION`); the learning rates of every optimizer's param groups, best
   checkpoint path and score (a path that differs while the monitored score agrees names the
   unsynced metric interpolated in ModelCheckpoint's filename) and EarlyStopping's stopped epoch;
4. per-batch values of a nonlinear metric (a TorchMetrics function's or ``Metric.forward``'s
   return value, or the sum or mean of a few of one step's such values) mean-reduced over
   batches and ranks are recomputed part by part over the epoch's samples of all ranks; a logged
   value that differs fails when a part is nonlinear (linear parts such as accuracy never do);
5. an epoch-mean log without ``batch_size`` on batches whose first tensor is not one row per
   sample (graph node features, a collated graph) fails when Lightning's inferred weights change
   the epoch value.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections import defaultdict

from ...claims import Claim, claim, reduced_across_ranks
from ...events import LOG
from ...outcomes import Outcome
from ...sites import fmt_site, hook_label
from ...world.diagnose import first_divergence
from ..base import Blame, Contract, Evidence, Run, Verdict, merged, rank_guard
from . import monitors, nonlinear
from .decisions import STOP_FIX, lr_divergence, lr_texts, stop_divergence, stop_texts, unsynced_filename_metric
from .metric_keys import metric_key_divergence, metric_key_texts
from .missing import missing_monitor, missing_texts
from .probe import SyncDistProbe


def synced_log(event: dict) -> bool:
    return LOG.of(event) and bool(event.get("sync_dist")) and not event.get("rank_zero_only")


def _fmt(value) -> str:
    return "missing" if value is None else f"{value:.6g}"


def _per_rank(values: list) -> dict:
    """A claim's ``values``: one per rank, keyed "rank <r>"."""
    return {f"rank {r}": v for r, v in enumerate(values)}


def _differs(values: list, rel: float = 1e-5) -> bool:
    present = [v for v in values if v is not None and math.isfinite(v)]  # NaN or inf compares nothing
    if len(present) < 2:
        return False
    lo, hi = min(present), max(present)
    return hi - lo > rel * max(1.0, abs(hi))


class SyncDist(Contract):
    id = "sync-dist"
    needs_finite_loss = True
    title = "Synced logging, monitored metrics and shared decisions agree across ranks"
    rule_section = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp", "deepspeed")
    tiers = ("cpu", "nodes", "gpu", "multinode")  # nodes: ranks laid out as nodes on this host
    probe_class = SyncDistProbe

    def blames(self, run: Run) -> int | None:
        """A decision every rank needs (``should_stop``) taken differently on some ranks, or a
        synced log call some ranks made and the others did not, stopped the world; so did a
        monitored key some ranks logged when a rank that never logged it raised for want of it."""
        if stop_divergence(run) is not None:
            return Blame.DECISION
        if LOG in run.divergent_events() or missing_monitor(run) is not None:
            return Blame.LOG
        if not run.finished and metric_key_divergence(run) is not None:
            return Blame.LOG
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        stop = stop_divergence(run)
        div = first_divergence(run.traces, select=synced_log)
        if div is not None and div["kind"] == "calls" and stop is None:
            return self._sequence_failure(run, div)
        failures = [self._stop_failure(run, stop)] if stop is not None else []
        if div is not None and div["kind"] == "calls":
            failures.append(self._sequence_failure(run, div))
        failures += self._missing_failures(run)
        failures += self._metric_key_failures(run)
        failures += self._monitor_failures(run)
        failures += self._decision_failures(run, stop_seen=stop is not None)
        seen: dict[str, str] = {}  # per-batch keys the nonlinear check looked at -> what it found
        failures += self._nonlinear_failures(run, seen)
        failures += self._weight_failures(run)
        if failures:
            return merged(failures)
        return self._passed(run, seen)

    # -- 1. synced log sequences ----------------------------------------------------------------
    def _sequence_failure(self, run: Run, div: dict) -> Verdict:
        events = div["events"]
        hook = hook_label(next(iter(div["hook"].values())))
        keys = {r: [e.get("name") for e in evs] for r, evs in events.items()}
        some = _diverging_call(events)
        site = fmt_site(some.get("site"))
        guard = rank_guard(some.get("site"))
        via = "log_dict" if some.get("via") == "log_dict" else "self.log"
        made = [claim("site", site, frame=some["site"], call="log_dict" if via == "log_dict" else "log")] \
            if some.get("site") else []
        evidence = []
        for r in sorted(keys):
            own = _diverging_call({r: events[r]}, keys) if events[r] else None
            evidence.append(Evidence(f"synced log calls in {hook}: {keys[r] or 'none'}", rank=r,
                                     frame=(own or {}).get("site"),
                                     call="log_dict" if (own or {}).get("via") == "log_dict" else "log"))
        evidence += _count_evidence(run, keys)
        empty = [r for r, k in keys.items() if not k]
        callers = sorted(r for r, k in keys.items() if k)
        name_text = ", ".join(repr(n) for n in sorted({n for r in callers for n in keys[r]}))
        where = (via, hook, site, guard)
        if empty:
            summary = _one_sided_summary(keys, empty, callers, name_text, where)
        elif sorted(map(str, keys[0])) == sorted(map(str, next(iter(keys.values())))) and \
                len({tuple(sorted(map(str, k))) for k in keys.values()}) == 1:
            order = "; ".join(f"rank {r} {k}" for r, k in sorted(keys.items()))
            summary = (f"{via}(sync_dist=True) in {hook} logs the same keys in a different order per "
                       f"rank ({order}) at {site}: each key is an all-reduce, so the values are "
                       f"reduced with the wrong partners.")
        else:
            sets = ", ".join(f"rank {r} {{{', '.join(map(str, k))}}}" for r, k in sorted(keys.items()))
            summary = (f"{via}(sync_dist=True) in {hook} logs different key sets per rank: {sets}, at "
                       f"{site}. Each key is an all-reduce, so the ranks' collectives no longer pair up.")
        fix = _sequence_fix(bool(empty), name_text, where)
        notes = [] if run.finished else ["the world did not finish; the item's report says where each rank was."]
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="deadlock", notes=notes,
                            claims=made)

    # -- 2. monitored metrics -------------------------------------------------------------------
    def _missing_failures(self, run: Run) -> list[Verdict]:
        """A rank's callback raised for a monitored key that only other ranks log."""
        found = None if run.finished else missing_monitor(run)
        if found is None:
            return []
        summary, evidence, fix = missing_texts(found)
        return [self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix,
                             notes=["the world did not finish; the item's report says where each rank was."])]

    def _metric_key_failures(self, run: Run) -> list[Verdict]:
        """TorchMetrics objects logged under keys that differ by rank (see :mod:`.metric_keys`)."""
        found = metric_key_divergence(run)
        if found is None:
            return []
        summary, evidence, fix, category = metric_key_texts(run, found)
        notes = [] if run.finished else ["the world did not finish; the item's report says where each rank was."]
        return [self.verdict(Outcome.FAILED, summary, fix=fix, category=category, notes=notes,
                             evidence=[Evidence(d, rank=r, site=fmt_site(s) if s else None) for d, r, s in evidence])]

    def _monitors(self, run: Run) -> list[dict]:
        seen, monitors = set(), []
        for v in run.probe(self.id):
            for m in (v or {}).get("final", {}).get("monitors", []):
                if m["key"] and (m["key"], m["owner"]) not in seen:
                    seen.add((m["key"], m["owner"]))
                    monitors.append(m)
        return monitors

    def _snapshot_values(self, run: Run, key: str) -> list[tuple[dict, list]]:
        """[(snapshot meta, [value per rank])] for every validation end all ranks reached."""
        per_rank = [[s for s in (v or {}).get("snapshots", []) if s["event"] == "validation_end"]
                    for v in run.probe(self.id)]
        rows = []
        for i in range(min((len(s) for s in per_rank), default=0)):
            rows.append((per_rank[0][i], [s[i]["metrics"].get(key) for s in per_rank]))
        return rows

    def _monitor_failures(self, run: Run) -> list[Verdict]:
        """Each monitored key that is not reduced across ranks, judged on the values its callbacks
        read where they read them (``monitors.compared``)."""
        failures = []
        by_key = defaultdict(list)
        for m in self._monitors(run):
            by_key[m["key"]].append(m["owner"])
        for key, owners in by_key.items():
            logs = [e for r in range(run.world_size) for e in run.events(r, LOG) if e.get("name") == key]
            found = monitors.failure_texts(key, owners, logs, monitors.compared(run, key))
            if found is None:
                continue
            summary, lines, made = found
            fix = f"{_sync_remedy(key, logs)}; never rank_zero_only for a metric a callback monitors."
            failures.append(self.verdict(Outcome.FAILED, summary, evidence=[Evidence(x) for x in lines], fix=fix,
                                         category="silent", claims=made))
        return failures

    # -- 3. decisions ---------------------------------------------------------------------------
    def _stop_failure(self, run: Run, div: dict) -> Verdict:
        summary, evidence, made = stop_texts(run, div)
        notes = [] if run.finished else ["the world did not finish; the item's report says where each rank was."]
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, category="deadlock", notes=notes, claims=made,
                            fix=f"at {fmt_site(div['event'].get('site'))}: {STOP_FIX}")

    def _decision_failures(self, run: Run, stop_seen: bool = False) -> list[Verdict]:
        values = run.probe(self.id)
        if not run.finished or any(v is None for v in values):
            return []
        finals = [v["final"] for v in values]
        failures = [f for i in range(len(finals[0]["checkpoints"])) if (f := self._checkpoint_failure(run, finals, i))]
        stops = [f["should_stop"] for f in finals]
        epochs = [f["current_epoch"] for f in finals]
        if not stop_seen and (len(set(stops)) > 1 or len(set(epochs)) > 1):
            differ = claim("differ", "trainer.should_stop / the final epoch differ across ranks",
                           values=_per_rank([[s, e] for s, e in zip(stops, epochs)]))
            failures.append(self.verdict(
                Outcome.FAILED, f"{differ.text}: one rank decided to stop and the others did not.", claims=[differ],
                evidence=[Evidence(f"should_stop={s}, current_epoch={e}", rank=r)
                          for r, (s, e) in enumerate(zip(stops, epochs))],
                category="deadlock", fix=STOP_FIX))
        for i, es in enumerate(finals[0]["early_stopping"]):
            stopped = [f["early_stopping"][i]["stopped_epoch"] for f in finals]
            if len(set(stopped)) > 1:
                differ = claim("differ", f"EarlyStopping(monitor={es['monitor']!r}) stopped at different epochs "
                                         f"per rank", values=_per_rank(stopped))
                failures.append(self.verdict(
                    Outcome.FAILED, f"{differ.text}.", claims=[differ],
                    evidence=[Evidence(f"stopped_epoch={s}", rank=r) for r, s in enumerate(stopped)],
                    category="silent", fix=f"monitor a value every rank shares: "
                                           f"{_sync_remedy(es['monitor'], _logs_of(run, es['monitor']))}."))
        found = lr_divergence([v.get("lr_changes") or [] for v in values])
        if found is not None:
            summary, evidence, made = lr_texts(*found)
            failures.append(self.verdict(
                Outcome.FAILED, summary, evidence=evidence, category="silent", claims=made,
                fix="step every scheduler on every rank from a value all ranks share: monitor a metric logged "
                    "with sync_dist=True (or a TorchMetrics object), and never step a scheduler under a rank "
                    "condition."))
        return failures

    def _checkpoint_failure(self, run: Run, finals: list[dict], i: int) -> Verdict | None:
        ckpt = finals[0]["checkpoints"][i]
        paths = [f["checkpoints"][i]["best_model_path"] for f in finals]
        scores = [f["checkpoints"][i]["best_model_score"] for f in finals]
        if len(set(paths)) <= 1 and not _differs(scores):
            return None
        evidence = [Evidence(f"best_model_path {p!r}, best_model_score {_fmt(s)}", rank=r)
                    for r, (p, s) in enumerate(zip(paths, scores))]
        culprit = None if _differs(scores) else unsynced_filename_metric(run, ckpt.get("filename"))
        if culprit is None and not _differs(scores):
            return self._path_built_per_rank(finals, i, scores, evidence)
        if culprit is None:
            return self._scores_differ(finals, ckpt, paths, scores, evidence, _logs_of(run, ckpt["monitor"]))
        name, site = culprit["name"], fmt_site(culprit.get("site"))
        evidence += [Evidence(f"{name!r} after validation at epoch {meta['epoch']}: "
                              + " vs ".join(f"rank {r} {_fmt(v)}" for r, v in enumerate(vals)))
                     for meta, vals in self._snapshot_values(run, name) if _differs(vals)][:4]
        monitored = (f"although the monitored {ckpt['monitor']!r} agrees" if ckpt["monitor"]
                     else "(it monitors nothing, so the last checkpoint is the best)")
        differ = claim("differ", "different best_model_path on each rank", values=_per_rank(paths))
        summary = (f"ModelCheckpoint(monitor={ckpt['monitor']!r}, filename={ckpt['filename']!r}) ends with a "
                   f"{differ.text} {monitored}: the filename interpolates {name!r}, "
                   f"logged without sync_dist in {hook_label(culprit.get('hook'))} at {site}, so each rank "
                   f"formats the path with the value of its own shard. Lightning writes rank 0's file only; "
                   f"the other ranks' best_model_path names a file that does not exist.")
        fix = (f"at {site}, {_sync_remedy(name, _logs_of(run, name))}; or keep {name!r} out of the ModelCheckpoint "
               f"filename: every rank must build the same checkpoint path.")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, category="silent", fix=fix, claims=[differ])

    def _scores_differ(self, finals: list[dict], ckpt: dict, paths: list, scores: list,
                       evidence: list[Evidence], logs: list[dict]) -> Verdict:
        """The ranks' best scores differ: say what differs (the score; the path too where it does)
        and what that does: each rank ranks its top-k checkpoints on its own numbers."""
        monitor = ckpt["monitor"]
        made = [claim("differ", "a different best_model_score on each rank", values=_per_rank(scores))]
        if len(set(paths)) > 1:
            made.append(claim("differ", "a different best_model_path", values=_per_rank(paths)))
            what = f"{made[0].text} and {made[1].text}"
        else:
            same = claim("equal", f"the same best_model_path on every rank ({paths[0]!r})", values=_per_rank(paths))
            made.append(same)
            what = f"{made[0].text}, with {same.text}"
        stoppers = sorted({es["monitor"] for f in finals for es in f["early_stopping"]} & {monitor})
        also = (f"; EarlyStopping(monitor={monitor!r}) decides on the same rank-local numbers" if stoppers else "")
        summary = (f"ModelCheckpoint(monitor={monitor!r}) ends with {what}: the monitored value is not the same on "
                   f"every rank, so each rank ranks its top-k checkpoints (which to keep, which is best) on different "
                   f"numbers{also}.")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, category="silent", claims=made,
                            fix=f"make the monitored value identical on every rank: {_sync_remedy(monitor, logs)}; "
                                f"decisions must be taken from values every rank shares.")

    def _path_built_per_rank(self, finals: list[dict], i: int, scores: list, evidence: list) -> Verdict:
        """The ranks agree on the best score but not on its path, and no unsynced metric in the
        filename explains it: the filename itself is made per rank (a run counter, a pid, a time).
        (Lightning broadcasts rank 0's dirpath, so only the filename can differ.)"""
        ckpts = [f["checkpoints"][i] for f in finals]
        monitor = ckpts[0]["monitor"]
        score = next((_fmt(s) for s in scores if s is not None), None)
        agree = (f"although the best score is the same on every rank ({score})" if score is not None
                 else "(it monitors nothing, so the last checkpoint is the best)")
        names = [c.get("filename") for c in ckpts]
        if len(set(names)) > 1:
            evidence += [Evidence(f"ModelCheckpoint filename {v!r}"
                                  + (f", built at {fmt_site(c['site'])}" if c.get("site") else ""), rank=r)
                         for r, (v, c) in enumerate(zip(names, ckpts))]
            why = "its filename is not the same on every rank (" + ", ".join(
                f"rank {r} {v!r}" for r, v in enumerate(names)) + ")"
        else:
            why = "the path is built from something that is not the same on every rank"
        paths = claim("differ", "a different best_model_path on each rank",
                      values=_per_rank([c["best_model_path"] for c in ckpts]))
        summary = (f"ModelCheckpoint(monitor={monitor!r}) ends with {paths.text} "
                   f"{agree}: {why}, so each rank names the best checkpoint its own way. Lightning writes rank "
                   f"0's file only; the other ranks' best_model_path names a file that does not exist (a later "
                   f"ckpt_path='best', or loading the best checkpoint on every rank, fails there).")
        fix = ("give ModelCheckpoint the same filename on every rank: nothing made per process in it (a run "
               "counter, a process id, a time, a random id). Make such a name once and share it (set it in the "
               "config, or broadcast rank 0's before building the Trainer).")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, category="silent", fix=fix, claims=[paths])

    # -- 4. nonlinear per-batch metrics ---------------------------------------------------------
    def _nonlinear_failures(self, run: Run, seen: dict | None = None) -> list[Verdict]:
        """The failures of per-batch metric values averaged into a nonlinear epoch value; ``seen``
        gets, for each key looked at that does not fail, what was found (said by a pass)."""
        values = run.probe(self.id)
        if not run.finished or any(v is None for v in values):
            return []
        seen = {} if seen is None else seen
        failures = []
        for key, record in (values[0].get("per_batch") or {}).items():
            records = [(v.get("per_batch") or {}).get(key) for v in values]
            if any(r is None or r["run"] != record["run"] or not r["batches"] for r in records):
                seen[key] = "not compared: its metric calls were not recorded in the same loop on every rank"
                continue
            logged = _published(values[0], key, record)
            scope = _Scope.of(record, records) if logged is not None else None
            if scope is None or scope.found is None:
                seen[key] = ("not compared: the inputs of the metric calls it is made of do not join into one "
                             "epoch" if logged is not None else "not compared: no epoch value of its loop was recorded")
                continue
            if not any(p["nonlinear"] for p in scope.found["parts"]) or \
                    not nonlinear.differs(logged, scope.found["truth"]):
                # linear parts (accuracy, MSE) average correctly over batches
                seen[key] = (f"compared: its epoch value equals {', '.join(p['label'] for p in scope.found['parts'])}"
                             f" recomputed over {scope.samples_text}")
                continue
            evidence = [Evidence(_calls_text(r), rank=i, frame=r.get("site"),
                                 call="log_dict" if r.get("via") == "log_dict" else "log")
                        for i, r in enumerate(records)]
            if scope.found["mode"] == "single":
                summary, fix, made = _single_texts(key, record, scope, logged)
            else:
                summary, fix, made = _combination_texts(key, record, scope, logged)
                each = "per-rank" if scope.per_epoch else "per-batch"
                evidence += [Evidence(f"{p['label']}: mean of its {each} values {_fmt4(p['batch_mean'])}, over "
                                      f"{scope.samples_text} {p['truth']:.4f}"
                                      + ("" if p["nonlinear"] else " (linear: the same either way)"))
                             for p in scope.found["parts"]]
            failures.append(self.verdict(Outcome.FAILED, summary, category="silent", fix=fix, evidence=evidence,
                                         claims=made))
        return failures

    # -- 5. Lightning's batch-size inference ----------------------------------------------------
    def _weight_failures(self, run: Run) -> list[Verdict]:
        values = run.probe(self.id)
        if not run.finished or any(v is None for v in values):
            return []
        failures = []
        for key, record in (values[0].get("weights") or {}).items():
            records = [(v.get("weights") or {}).get(key) for v in values]
            if record["sync_dist"]:
                if any(r is None or r["run"] != record["run"] for r in records):
                    continue
            else:
                records = [record]
            batches = [b for r in records for b in r["batches"]]
            wrong = [b for b in batches if b["inferred"] != b["samples"]]
            if not wrong:
                continue
            by_inferred = _weighted(batches, "inferred")
            by_samples = _weighted(batches, "samples")
            metrics = values[0]["final"]["callback_metrics"]
            logged = metrics.get(f"{key}_epoch", metrics.get(key))
            if by_inferred is None or by_samples is None or not _apart(by_inferred, by_samples):
                continue  # the wrong count changes no epoch value here
            if logged is not None and _apart(logged, by_inferred):
                continue  # Lightning's value is not the one this explains
            failures.append(self._weight_failure(key, record, wrong[0], (by_inferred, by_samples, len(wrong),
                                                                         len(batches))))
        return failures

    def _weight_failure(self, key: str, record: dict, example: dict, numbers: tuple) -> Verdict:
        by_inferred, by_samples, n_wrong, n_batches = numbers
        site = fmt_site(record.get("site"))
        first, shape = example["first"]
        summary = (f"{key!r} is logged with on_epoch=True and without batch_size in {record['hook']} at {site}: "
                   f"Lightning weights each batch of the epoch mean by the first dimension of the first tensor "
                   f"in the batch, {first} (shape {shape}: {example['inferred']}), but the batch holds "
                   f"{example['samples']} samples ({example['sample_path']}). The epoch value is "
                   f"{by_inferred:.4f} instead of the per-sample mean {by_samples:.4f} "
                   f"({n_wrong} of {n_batches} batches weighted by the wrong count).")
        count = "batch.num_graphs" if example["sample_path"] == "batch.num_graphs" else f"len({example['sample_path']})"
        fix = (f"pass the number of samples to the log call at {site}: self.log({key!r}, ..., batch_size={count}); "
               f"Lightning cannot tell samples from rows of the first tensor it finds.")
        return self.verdict(Outcome.FAILED, summary, category="silent", fix=fix)

    def _passed(self, run: Run, seen: dict | None = None) -> Verdict:
        synced = sorted({e.get("name") for e in run.events(0, LOG) if synced_log(e)})
        keys = sorted({m["key"] for m in self._monitors(run)})
        parts = [f"synced log keys identical on every rank ({', '.join(synced)})" if synced
                 else "no synced log calls"]
        compared, made, unjudged = monitors.pass_text(run, keys)
        parts += compared
        notes = []
        for key in unjudged:
            odd = monitors.not_finite(run, key)
            if odd:
                parts.append(f"monitored {key!r} {odd[0]}")
                made.append(odd[1])
                continue
            read = monitors.read_anywhere(run, key)
            why = ("a rank had no value at every read of it" if monitors.compared(run, key) else
                   "no callback read it on every rank in this run" if read else "no callback read it in this run")
            parts.append(f"monitored {key!r} not judged: {why}")
        parts.append("shared decisions agree")
        others, said = _other_keys(run, set(synced) | set(keys), seen or {})
        parts += others
        made += said
        # A synced key the per-batch check looked at: what it found (a pass must not hide "not compared").
        parts += [f"{k!r} (synced) {(seen or {})[k]}" for k in synced if k in (seen or {})]
        floats = sorted({e.get("name") for e in run.events(0, LOG)
                         if e.get("vtype") == "float" and e.get("on_epoch") and not reduced_across_ranks(log_facts(e))})
        if floats:
            notes.append(f"{', '.join(floats)} logged as Python floats without sync_dist: Lightning gives no "
                         f"warning for these; the logged value is rank 0's alone.")
        logged = any(run.events(r, LOG) for r in range(run.world_size))
        if unjudged and not compared and not synced:
            return self.not_judged("; ".join(parts[1:-1]) + ", and no synced log call was made, so nothing was "
                                   "compared across ranks.", notes=notes)
        return self.verdict(Outcome.PASSED, "; ".join(parts) + ".", notes=notes, claims=made,
                            empty=not logged and not keys)


# -- the pass: every logged key, compared or said why not -------------------------------------------

def _other_keys(run: Run, judged: set, seen: dict) -> tuple[list[str], list[Claim]]:
    """Clauses for the logged keys no cross-rank or monitor check compared: what the per-batch check
    found for each (``seen``), or why nothing compared it, keys with the same reason together; with
    the claims those reasons make (whose values are rank 0's own, whose a Metric synced)."""
    last: dict[str, dict] = {}
    for e in run.events(0, LOG):
        last[str(e.get("name"))] = e
    by_reason: dict[str, list[str]] = {}
    made: dict[str, Claim] = {}
    for key, e in last.items():
        if key in judged:
            continue
        reason, said = (seen.get(key), None) if seen.get(key) else _why_not_compared(e)
        by_reason.setdefault(reason, []).append(repr(key))
        if said is not None:
            made[reason] = said
    return [f"{', '.join(keys)} {reason}" for reason, keys in by_reason.items()], list(made.values())


def log_facts(e: dict) -> dict:
    """The recorded facts of a log call that say whether its value was synced over the ranks: its
    flags and, for the value of a Metric's compute(), whether that compute() gathered the state."""
    facts = {k: e.get(k) for k in ("sync_dist", "rank_zero_only", "vtype")}
    computed = e.get("metric_compute")
    if isinstance(computed, dict):
        facts.update(metric=computed.get("metric"), metric_synced=bool(computed.get("synced")))
    return facts


def _why_not_compared(e: dict) -> tuple[str, Claim | None]:
    if e.get("vtype") == "metric":
        return ("not compared: TorchMetrics objects, which Lightning computes over the epoch and which sync "
                "themselves"), None
    computed = e.get("metric_compute")
    if isinstance(computed, dict) and not e.get("sync_dist"):
        name = computed.get("metric")
        if computed.get("synced"):
            text = "synced over the ranks by the Metric (its compute() was recorded gathering the state first)"
            return f"not compared: the value {name}.compute() returned, {text}", claim("reduced", text,
                                                                                        log=log_facts(e))
        text = (f"not synced: {name}.compute() did not gather the metric's state over the ranks, and the log "
                f"call has no sync_dist, so Lightning publishes rank 0's own value")
        return f"not compared: {text}", claim("local", text, log=log_facts(e))
    if not e.get("on_epoch"):
        return "not compared: logged per step only (no epoch value is averaged)", None
    if e.get("reduce_fx") not in ("mean", "avg"):
        return f"not compared: reduced with {e.get('reduce_fx')}, not averaged over batches", None
    if not e.get("sync_dist"):
        text = "Lightning publishes rank 0's own mean"
        return ("not compared: logged without sync_dist from values no recorded metric call (TorchMetrics, "
                f"scikit-learn) produced, so whether their per-batch mean is the metric over the epoch could not be "
                f"recomputed; {text}"), claim("local", text, log=log_facts(e))
    return "not compared: not logged with sync_dist on every rank alike", None


# -- 1. helpers for a diverged sequence of synced log calls -----------------------------------------

def _diverging_call(events: dict, keys: dict | None = None) -> dict:
    """The synced log call where the ranks' sequences part (``events``: rank -> that hook's synced
    log events): the first call of a key that not every rank logs, else the first position whose
    key differs between ranks, else the first call. Its site is the line named (a log_dict above
    the self.log of the diverging key is not that line). ``keys``: every rank's key list, when
    ``events`` holds one rank's."""
    names = keys or {r: [e.get("name") for e in evs] for r, evs in events.items()}
    common = set.intersection(*(set(map(str, k)) for k in names.values())) if names else set()
    for evs in events.values():
        for e in evs:
            if str(e.get("name")) not in common:
                return e
    for i in range(max((len(k) for k in names.values()), default=0)):
        at = {r: (k[i] if i < len(k) else None) for r, k in names.items()}
        holders = [r for r in events if i < len(events[r])]
        if len({str(v) for v in at.values()}) > 1 and holders:
            return events[holders[0]][i]
    return next(e for evs in events.values() for e in evs)


def _count_evidence(run: Run, keys: dict) -> list[Evidence]:
    """Per-rank totals over the run of the keys that diverged, where they differ."""
    totals = defaultdict(dict)
    for r, trace in enumerate(run.traces):
        for e in trace:
            if synced_log(e):
                totals[e.get("name")][r] = totals[e.get("name")].get(r, 0) + 1
    diverged = {str(n) for k in keys.values() for n in k}
    evidence = []
    for name, per_rank in sorted(totals.items()):
        if str(name) not in diverged:
            continue  # after a hang, other keys' counts only show how far each rank got
        counts = [per_rank.get(r, 0) for r in range(run.world_size)]
        if len(set(counts)) > 1:
            evidence.append(Evidence(f"synced log calls of {name!r} over the run: "
                                     + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))))
    return evidence


def _one_sided_summary(keys: dict, empty: list, callers: list, name_text: str, where: tuple) -> str:
    via, hook, site, guard = where
    who = f"rank {callers[0]} only" if len(callers) == 1 else f"ranks {callers} only"
    missing = ", ".join(f"rank {r}: 0 calls" for r in empty)
    return (f"{via}({name_text}, sync_dist=True) called on {who} ({missing}), in {hook}"
            + (f" under `{guard}`" if guard else "") + f" at {site}. The sync is an "
            f"all-reduce that only some ranks enter: the world hangs or pairs it with an "
            f"unrelated collective.")


def _sequence_fix(one_sided: bool, name_text: str, where: tuple) -> str:
    via, _, site, guard = where
    if one_sided and guard:
        return (f"remove the `{guard}` gate around {via}({name_text}, ...) at {site} so that every rank "
                f"makes the call (keep sync_dist=True; choose reduce_fx, e.g. \"max\" for a time). If only "
                f"rank 0 has the value, log it with rank_zero_only=True and without sync_dist instead, and "
                f"do not monitor it.")
    if one_sided:
        return (f"make {via}({name_text}, sync_dist=True) at {site} run on every rank, the same number of "
                f"times; if only some ranks have the value, log it with rank_zero_only=True and without "
                f"sync_dist, and do not monitor it.")
    return (f"log the same keys in the same order on every rank at {site}: build the key set from "
            f"what all ranks share (e.g. every class, with a NaN-safe or count-weighted value), or "
            f"use a TorchMetrics per-class metric.")


def _published(value: dict, key: str, record: dict) -> float | None:
    """The epoch value of ``key`` that Lightning published for the loop of a per_batch ``record``
    (its ``run``: stage, epoch, sanity, validation runs): the final callback_metrics, else the
    snapshot taken where that loop ended (a later stage, a validate or test after fit, resets
    callback_metrics, so the final ones may lack a validation key)."""
    metrics = value["final"]["callback_metrics"]
    logged = metrics.get(key, metrics.get(f"{key}_epoch"))
    if logged is not None or not isinstance(record.get("run"), list) or len(record["run"]) != 4:
        return logged
    stage, epoch, sanity, runs = record["run"]
    snaps = value.get("snapshots") or []
    if "VALIDAT" in str(stage).upper() and not sanity:  # "validate", "RunningStage.VALIDATING"
        ends = [s for s in snaps if s["event"] == "validation_end"]
        snap = ends[runs - 1] if isinstance(runs, int) and 0 < runs <= len(ends) else None
    elif "TRAIN" in str(stage).upper():
        snap = next((s for s in reversed(snaps) if s["event"] == "train_epoch_end" and s["epoch"] == epoch), None)
    else:
        snap = None
    found = (snap or {}).get("metrics") or {}
    return found.get(key, found.get(f"{key}_epoch"))


def _logs_of(run: Run, key: str | None) -> list[dict]:
    return [e for r in range(run.world_size) for e in run.events(r, LOG) if e.get("name") == key]


def _sync_remedy(key: str | None, logs: list[dict]) -> str:
    """How to make ``key`` the same on every rank, from its log calls ``logs``: sync_dist=True
    averages the ranks' values, which is the value of the whole set only for a plain mean; a value
    computed once per epoch from a rank's own outputs (an RMSE, an AP) needs those outputs gathered."""
    hook = next((e.get("hook") for e in reversed(logs) if epoch_level_hook(e.get("hook"))), None)
    if hook is not None:
        return (f"compute {key!r} over every rank's outputs: self.all_gather the predictions and targets in {hook} "
                f"before computing it, or use a TorchMetrics object (its states are synced before compute); "
                f"sync_dist=True averages the ranks' values, which is the value of the whole set only for a plain "
                f"mean")
    return (f"log {key!r} on every rank with sync_dist=True (and batch_size=...) where it is a plain mean (a loss, "
            f"an accuracy), or a TorchMetrics object where it is not (F1, AUROC, RMSE)")


def epoch_level_hook(hook: str | None) -> bool:
    """Whether ``hook`` runs once per epoch or stage (``on_validation_epoch_end``, ``on_train_start``),
    not once per batch: a value logged there is each rank's one value, not a per-batch value."""
    return bool(hook) and "batch" not in hook and hook.endswith(("_epoch_end", "_epoch_start", "_start"))


def _calls_text(record: dict) -> str:
    """How often a rank logged a per_batch ``record``'s key in the last epoch, in the hook's terms."""
    n = len(record["batches"])
    if epoch_level_hook(record.get("hook")):
        return (f"{n} value{'' if n == 1 else 's'} logged in {record['hook']} of the last epoch, over this rank's "
                f"own outputs")
    return f"{n} per-batch value{'' if n == 1 else 's'} logged in the last epoch"


def _fmt4(value) -> str:
    return "unknown" if value is None else f"{value:.4f}"


def _apart(a: float, b: float) -> bool:
    """Different beyond float32 accumulation (the same values, weighted two ways)."""
    return abs(a - b) > 1e-5 * max(1.0, abs(a), abs(b))


def _weighted(batches: list[dict], weight: str) -> float | None:
    total = sum(b[weight] for b in batches)
    return sum(b["value"] * b[weight] for b in batches) / total if total else None


@dataclasses.dataclass
class _Scope:
    """Over which values Lightning's epoch value of a per-batch metric is a mean: every rank's batches
    when the log call synced it, rank 0's own otherwise (``found``: ``nonlinear.analyse`` over those
    ranks; ``whole``: over every rank's, for an unsynced value). ``over``: the claim that says which."""

    log: dict
    found: dict | None
    whole: dict | None
    over: Claim
    per_epoch: bool = False

    @classmethod
    def of(cls, record: dict, records: list[dict]) -> _Scope:
        log = {"sync_dist": bool(record.get("sync_dist")), "rank_zero_only": bool(record.get("rank_zero_only")),
               "vtype": record.get("vtype", "tensor")}
        per_epoch = epoch_level_hook(record.get("hook"))
        if reduced_across_ranks(log):
            # An epoch-level hook logs each rank's value once: the sync averages the ranks' values.
            over = ("computed over each rank's own outputs and mean-reduced over ranks"
                    + (" by sync_dist" if log["sync_dist"] else "") if per_epoch
                    else "mean-reduced over batches and ranks")
            return cls(log, nonlinear.analyse(records), None, claim("reduced", over, log=log), per_epoch)
        flags = "rank_zero_only=True" if log["rank_zero_only"] else "no sync_dist"
        local = (f"not synced ({flags}), so Lightning publishes rank 0's value, computed over rank 0's own outputs"
                 if per_epoch else f"not synced ({flags}), so Lightning averages its per-batch values over each "
                                   f"rank's own batches and publishes rank 0's")
        return cls(log, nonlinear.analyse(records[:1]), nonlinear.analyse(records),
                   claim("local", local, log=log), per_epoch)

    @property
    def samples_text(self) -> str:
        if self.whole is None:
            return f"the epoch's {self.found['samples']} samples of all ranks"
        return f"rank 0's {self.found['samples']} samples of the epoch"

    def values_text(self, logged: float, what: str) -> str:
        """The logged value against the metric over the samples it averaged; for an unsynced value,
        the part of the difference that is rank 0's shard alone, where there is one."""
        whose = "rank 0's" if self.whole is not None else "the"
        text = (f"{whose} logged epoch value {logged:.4f} is not {what} over {self.samples_text} "
                f"({self.found['truth']:.4f})")
        if self.whole is not None and nonlinear.differs(self.found["truth"], self.whole["truth"]):
            text += (f"; over the epoch's {self.whole['samples']} samples of all ranks it is "
                     f"{self.whole['truth']:.4f}, a further difference that is rank 0's shard alone")
        return text


def _single_texts(key: str, record: dict, scope: _Scope, logged: float) -> tuple[str, str, list[Claim]]:
    """(summary, fix, claims) for one nonlinear metric output logged per batch."""
    part = scope.found["parts"][0]
    if part["kind"] == "functional":
        cls = _metric_class_for(part["fn"].rsplit(".", 1)[-1])
        fix = (f"keep a torchmetrics {cls or 'Metric'} object on the module, update it every step and "
               f"log the object itself (self.log({key!r}, self.metric)); Lightning then computes it "
               f"over the whole epoch and all ranks.")
        if scope.per_epoch:
            fix += (f" Or self.all_gather the inputs of {part['name']} in {record['hook']} and compute it once over "
                    f"every rank's samples: the mean of the ranks' values is not the metric of the whole set.")
        what = f"from {part['label']} " + ("once per epoch" if scope.per_epoch else "on each batch")
    else:
        fix = (f"log the Metric object itself, self.log({key!r}, self.<metric>), or log "
               f"self.<metric>.compute() at epoch end; " + (
                   "the value its call returns is over this rank's inputs only." if scope.per_epoch else
                   "its per-batch return value is the metric of that batch only."))
        what = f"via {record['via']} from {part['label']}"
    summary = (f"{key!r} logged {what} in {record['hook']} and {scope.over.text} (nonlinear metric): "
               f"{scope.values_text(logged, 'the same metric')}.")
    return summary, fix, [scope.over]


def _combination_texts(key: str, record: dict, scope: _Scope, logged: float) -> tuple[str, str, list[Claim]]:
    """(summary, fix, claims) for a value computed from several metric outputs of each batch."""
    found = scope.found
    labels = [p["label"] for p in found["parts"]]
    bad = [p for p in found["parts"] if p["nonlinear"]]
    bad_text = " and ".join(p["label"] for p in bad)
    verb = "is" if len(bad) == 1 else "are"
    via = "log_dict" if record["via"] == "log_dict" else "self.log"
    whole = f"the {found['mode']} of the same metrics"
    of = "each rank's epoch outputs" if scope.per_epoch else "each batch"
    summary = (f"{key!r} logged with {via} in {record['hook']} is the {found['mode']} of "
               f"{', '.join(labels[:-1])} and {labels[-1]} of {of}, {scope.over.text}: "
               f"{bad_text} {verb} nonlinear, so {scope.values_text(logged, whole)}.")
    classes = []
    for p in bad:
        name = p["name"] if p["kind"] == "metric" else _metric_class_for(p["fn"].rsplit(".", 1)[-1])
        classes.append(name or "Metric")
    fix = (f"keep a torchmetrics object per nonlinear part ({', '.join(dict.fromkeys(classes))}) on the module, "
           f"update it every step, and log the objects separately, or log the {found['mode']} of their "
           f".compute() values at epoch end; " + (
               "a value derived from each rank's metrics is still each rank's own." if scope.per_epoch else
               "a value derived from per-batch metrics is still a per-batch metric."))
    return summary, fix, [scope.over]


def _metric_class_for(fn_name: str) -> str | None:
    try:
        import torchmetrics
    except ImportError:
        return None
    wanted = fn_name.replace("_", "").lower()
    for module in (torchmetrics, importlib.import_module("torchmetrics.classification")):
        for name in dir(module):
            if name.lower() == wanted:
                return name
    return None


CONTRACT = SyncDist()
