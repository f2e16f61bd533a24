"""eval-duplication: in validation, test and predict every sample is counted exactly once, and
what is published (a logged epoch metric, a predictions file) covers the whole set.

Seed section "Sampling, metrics and writes": DistributedSampler pads repeated indices when the
sample count does not divide by the world size, validation and test included; published metrics
need a single-device Trainer or a validated non-duplicating distributed evaluator; rank zero alone
sees only its shard of the predictions.

Checked on the "eval" run (see ``eval_runs.py``): per rank and stage, the dataset indices the
loader's sampler hands each rank (read from the sampler, so the dataset need not return ids), the
samples each TorchMetrics object was updated with, the stage's metrics, and files written by user
code; then a one-rank ``Trainer(accelerator="cpu", devices=1)`` run on the same weights. Fails on
indices evaluated more than once (with the metrics that moved because of it), on samples never
evaluated, on an unsynced epoch metric that rank 0 publishes from its own shard, and on a file
rank 0 alone writes during an evaluation stage without gathering the other ranks' outputs.
Lightning's "Using DistributedSampler" warning is not used: it fires on every multi-rank run.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..sites import fmt_site
from .base import Contract, Evidence, Run, Verdict, method_site, rank_guard, user_class

_STAGE_WORDS = {"validate": "validation", "test": "test", "predict": "prediction"}
_GATHERS = ("all_gather", "gather", "all_gather_object", "gather_object", "all_gather_into_tensor")


def _ids(values: list[int], limit: int = 12, keep_order: bool = False) -> str:
    values = list(values) if keep_order else sorted(values)
    text = ", ".join(map(str, values[:limit]))
    return f"[{text}{', ...' if len(values) > limit else ''}]"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 1e-4 * abs(b)


def _fmt(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.4g}"


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


class EvalDuplication(Contract):
    id = "eval-duplication"
    title = "Evaluation counts every sample exactly once and publishes the whole set"
    seed = "Sampling, metrics and writes"
    run_kind = "eval"
    strategies = ("ddp",)

    def judge(self, run: Run) -> Verdict:
        data = [(v or {}).get("eval") for v in run.values()]
        if any(d is None for d in data):
            return self.verdict("passed", "no evaluation was recorded on every rank.")
        ref_run = getattr(run, "reference", None)
        ref = None
        if ref_run is not None and ref_run.finished:
            ref = (ref_run.values()[0] or {}).get("eval")
        limited = data[0].get("limited")
        stages = [s for s in data[0].get("driver", []) if s in data[0]["stages"]]
        if not stages:
            return self.verdict("passed", "the target has no validation, test or predict dataloader to check.")
        failures: list[str] = []
        evidence: list[Evidence] = []
        fixes: set[str] = set()
        good: list[str] = []
        notes: list[str] = []
        if ref is None:
            notes.append("the one-device reference run did not finish, so no value was compared with it"
                         + (f": {ref_run.job.failure_text()[:600]}" if ref_run is not None else "."))
        if ref is not None and ref.get("load_problems"):
            keys = ref["load_problems"]
            notes.append(f"the one-device run could not load every weight ({', '.join(keys[:6])}"
                         f"{', ...' if len(keys) > 6 else ''}), so no value was compared with it.")
            ref = None
        if limited:
            notes.append("the user's limit_*_batches makes worlds of different sizes evaluate different samples: "
                         "values were not compared and unevaluated samples are not reported.")
        for stage in stages:
            recs = [d["stages"][stage] for d in data]
            ref_rec = (ref or {}).get("stages", {}).get(stage) if ref else None
            self._stage(run, stage, recs, ref_rec, limited, failures, evidence, fixes, good, notes)
        if failures:
            summary = " ".join(failures)
            fix = " ".join(sorted(fixes))
            return self.verdict("failed", summary, evidence=evidence, fix=fix, category="silent", notes=notes)
        return self.verdict("passed", " ".join(good), evidence=evidence, notes=notes)

    # -- one stage ------------------------------------------------------------------------------
    def _stage(self, run, stage, recs, ref_rec, limited, failures, evidence, fixes, good, notes) -> None:
        word = _STAGE_WORDS[stage]
        world = len(recs)
        n_loaders = max(len(r.get("loaders", [])) for r in recs)
        for i in range(n_loaders):
            infos = [r["loaders"][i] if i < len(r.get("loaders", [])) else {} for r in recs]
            tag = f"{word}" + (f" (dataloader {i})" if n_loaders > 1 else "")
            if any(info.get("iterable") for info in infos):
                notes.append(f"{tag}: an IterableDataset has no indices to compare; not checked.")
                continue
            if any(info.get("indices") is None for info in infos):
                notes.append(f"{tag}: the sampler's indices could not be read "
                             f"({next((x.get('error') for x in infos if x.get('error')), 'no sampler')}).")
                continue
            per_rank = [info["indices"] for info in infos]
            n = infos[0].get("dataset_len")
            counts = Counter(i for idx in per_rank for i in idx)
            dups = {k: c for k, c in counts.items() if c > 1}
            total = sum(len(x) for x in per_rank)
            sampler = infos[0].get("sampler") or "sampler"
            shard_text = ", ".join(f"rank {r}: {len(x)}" for r, x in enumerate(per_rank))
            moved = self._compare(stage, i, recs, ref_rec)
            if dups:
                where = defaultdict(list)
                for r, idx in enumerate(per_rank):
                    for k in idx:
                        if k in dups:
                            where[k].append(r)
                first = sorted(dups)[:6]
                named = "; ".join(f"index {k} on {_ranks(where[k])}" for k in first)
                pad = ""
                if infos[0].get("total_size") and n is not None and infos[0]["total_size"] > n:
                    pad = (f" {sampler} pads {n} indices to {infos[0]['total_size']} ({n} % {world} = {n % world}) "
                           f"by repeating the first ones.")
                several = "indices" if len(dups) > 1 else "index"
                failures.append(f"{tag}: {len(dups)} sample {several} evaluated more than once across ranks: "
                                f"{total} evaluations for {len(counts)} distinct samples.{pad}")
                evidence.append(Evidence(f"{word} sample {named} ({sampler})"))
                built = _loader_site(run, stage)
                if built:
                    evidence.append(Evidence(f"the {word} DataLoader is built here, and Lightning wraps it in "
                                             f"{sampler}", site=fmt_site(built)))
                for r, idx in enumerate(per_rank):
                    shown = _ids(idx, keep_order=True)
                    evidence.append(Evidence(f"{sampler} gave this rank {len(idx)} {word} indices {shown}", rank=r))
                for name, samples in self._metric_counts(recs).items():
                    fed = sum(samples["per_rank"])
                    if fed > len(counts):
                        evidence.append(Evidence(
                            f"{samples['type']} `{name}` was updated with {fed} samples for {len(counts)} distinct "
                            f"{word} samples (" + ", ".join(f"rank {r}: {k}" for r, k in enumerate(samples["per_rank"]))
                            + "): its synced state holds the duplicates"))
                for key, dist, single, _ in moved:
                    evidence.append(Evidence(f"{key} {_fmt(dist)} on {world} ranks vs {_fmt(single)} on 1 device "
                                             f"with the same weights (difference {dist - single:+.4g})"))
                fixes.add("Evaluate each sample once: shard evaluation with a sampler that does not pad (each rank "
                          "takes indices rank, rank + world, ...; use_distributed_sampler=False), or drop duplicates "
                          "by a stable sample id before computing, or publish metrics from a "
                          "Trainer(accelerator=\"cpu\", devices=1) run.")
            elif n is not None and not limited and len(counts) < n:
                missing = sorted(set(range(n)) - set(counts))
                failures.append(f"{tag}: {len(missing)} of {n} samples were never evaluated on any rank "
                                f"{_ids(missing)} ({shard_text}; {sampler}).")
                fixes.add("Evaluate every sample: a sampler without drop_last that covers every index across ranks.")
            else:
                span = f"every index 0..{n - 1}" if n is not None and len(counts) == n else f"{len(counts)} indices"
                text = f"{tag}: {span} evaluated exactly once across ranks ({shard_text})"
                same = self._same(stage, i, recs, ref_rec)
                if same:
                    text += "; " + ", ".join(f"{k} {_fmt(v)} on {world} ranks = {_fmt(s)} on 1 device"
                                             for k, v, s in same[:4])
                good.append(text + ".")
            if not dups:
                self._shard_metrics(run, stage, tag, per_rank, n, moved, recs, failures, evidence, fixes)
        self._rank_zero_writes(run, stage, recs, failures, evidence, fixes)

    def _metric_counts(self, recs) -> dict:
        out: dict[str, dict] = {}
        for r, rec in enumerate(recs):
            for name, c in (rec.get("metric_samples") or {}).items():
                entry = out.setdefault(name, {"type": c["type"], "per_rank": [0] * len(recs)})
                entry["per_rank"][r] = c["n"]
        return {k: v for k, v in out.items() if sum(v["per_rank"])}

    def _values(self, stage, i, rec) -> dict:
        if stage == "predict":
            return {}
        returned = rec.get("returned") or []
        return returned[i] if i < len(returned) else {}

    def _compare(self, stage, i, recs, ref_rec) -> list[tuple[str, float, float, list[float]]]:
        """Metrics whose published (rank 0) value differs from the one-device value."""
        if ref_rec is None:
            return []
        ref_vals = self._values(stage, i, ref_rec)
        per_rank = [self._values(stage, i, r) for r in recs]
        out = []
        for key, dist in per_rank[0].items():
            single = ref_vals.get(key)
            if single is None or _close(dist, single):
                continue
            out.append((key, dist, single, [pr.get(key) for pr in per_rank]))
        return out

    def _same(self, stage, i, recs, ref_rec) -> list[tuple[str, float, float]]:
        if ref_rec is None:
            return []
        ref_vals = self._values(stage, i, ref_rec)
        return [(k, v, ref_vals[k]) for k, v in self._values(stage, i, recs[0]).items()
                if k in ref_vals and _close(v, ref_vals[k])]

    def _shard_metrics(self, run, stage, tag, per_rank, n, moved, recs, failures, evidence, fixes) -> None:
        """An unsynced epoch metric: each rank holds its own shard's value and rank 0's is published."""
        word = _STAGE_WORDS[stage]
        for key, dist, single, values in moved:
            others = [v for v in values[1:] if v is not None]
            if not others or all(_close(v, dist) for v in others):
                continue  # synced: equal on every rank (a different value is sync-dist's business)
            log = self._log_event(run, key)
            how = ""
            if log is not None:
                flags = [f for f in ("rank_zero_only", "sync_dist") if log.get(f)]
                how = f" (logged in {log.get('hook')} with " + (
                    ", ".join(f"{f}=True" for f in flags) if flags else "no sync") + ")"
            covered = len(per_rank[0])
            total = n if n is not None else len({i for idx in per_rank for i in idx})
            failures.append(f"{tag}: {key} published from rank 0 is computed from rank 0's shard alone: "
                            f"{covered} of {total} {word} samples{how}.")
            evidence.append(Evidence(
                f"{key} {_fmt(dist)} on rank 0 (" + ", ".join(f"rank {r}: {_fmt(v)}" for r, v in enumerate(values)
                                                        if r and v is not None)
                + f") vs {_fmt(single)} on 1 device with the same weights (difference {dist - single:+.4g})",
                rank=0, site=fmt_site(log.get("site")) if log else None))
            fixes.add("Publish a metric over the whole set: a TorchMetrics object (synced across ranks), "
                      "self.log(..., sync_dist=True) for a plain mean, or all-gather predictions with sample ids "
                      "before computing; or compute it with Trainer(accelerator=\"cpu\", devices=1).")

    def _log_event(self, run, key) -> dict | None:
        for e in reversed(run.events(0, "log")):
            if e.get("name") == key and e.get("user"):
                return e
        return None

    def _rank_zero_writes(self, run, stage, recs, failures, evidence, fixes) -> None:
        word = _STAGE_WORDS[stage]
        if len(recs) < 2:
            return
        by_rank = [{w["path"]: w for w in rec.get("writes") or []} for rec in recs]
        others = set().union(*[set(b) for b in by_rank[1:]])
        gathered = self._gathered(run, stage)
        infos = recs[0].get("loaders") or []
        if not infos or any(i.get("indices") is None for i in infos):
            return
        own = sorted({k for k in infos[0]["indices"]})
        rest = sorted({k for rec in recs[1:] for info in (rec.get("loaders") or [])[:1]
                       for k in (info.get("indices") or [])} - set(own))
        if not rest:
            return
        n = infos[0].get("dataset_len") or len(set(own) | set(rest))
        for path, w in by_rank[0].items():
            if path in others or gathered:
                continue
            site = w.get("site")
            guard = rank_guard(site)
            lines = f"; the file has {w['lines']} line(s)" if w.get("lines") is not None else ""
            failures.append(f"{word}: {path} is written by rank 0 alone"
                            + (f" under `{guard}`" if guard else "")
                            + f" from rank 0's shard: it covers {len(own)} of {n} {word} samples; nothing "
                              f"gathers the other ranks' outputs first.")
            evidence.append(Evidence(f"{path} written in {stage} from {len(own)} of {n} samples: ids {_ids(own)} "
                                     f"(rank 0){lines}", rank=0, site=fmt_site(site)))
            evidence.append(Evidence(f"ids {_ids(rest)} were {word} inputs on other ranks and never reached the "
                                     f"file (trainer.{stage} returns only each rank's own shard)"))
            fixes.add("Collect rank outputs with their sample ids before writing: self.all_gather (or "
                      "torch.distributed.gather_object) then write on rank 0, or a BasePredictionWriter that writes "
                      "one file per rank and a merge by id; or run this stage on one device.")

    def _gathered(self, run, stage) -> bool:
        inside = False
        for e in run.events(0):
            if e.get("ev") == "eval_stage" and e.get("name") == stage:
                inside = e.get("at") == "start"
            elif inside and e.get("ev") == "call" and e.get("user") and e.get("op") in _GATHERS:
                return True
        return False


CONTRACT = EvalDuplication()


def _loader_site(run: Run, stage: str) -> dict | None:
    """Where the user's module or datamodule defines the ``<stage>_dataloader`` hook."""
    hook = {"validate": "val", "validation": "val", "val": "val"}.get(stage, stage) + "_dataloader"
    for which in ("datamodule", "model"):
        cls = user_class(run, which)
        site = method_site(cls, hook) if cls is not None else None
        if site:
            return site
    return None
