"""eval-duplication: in validation, test and predict every sample is counted exactly once, and
what is published (a logged epoch metric, a predictions file) covers the whole set.

Seed section "Sampling, metrics and writes": DistributedSampler pads repeated indices when the
sample count does not divide by the world size, validation and test included; published metrics
need a single-device Trainer or a validated non-duplicating distributed evaluator; rank zero alone
sees only its shard of the predictions.

Checked on the "eval" run (rank side: ``probe.py``): per rank and stage, the dataset indices each
fetch of the real evaluation loop received (read at source, so the dataset need not return ids), the
samples each TorchMetrics object was updated with, the stage's metrics, and files written by user
code; then a one-rank ``Trainer(accelerator="cpu", devices=1)`` run on the same weights. Fails on
indices evaluated more than once (with the metrics that moved because of it), on samples never
evaluated, on an unsynced epoch metric that rank 0 publishes from its own shard, and on a file
rank 0 alone writes during an evaluation stage without gathering the other ranks' outputs.
Lightning's "Using DistributedSampler" warning is not used: it fires on every multi-rank run.
A loader that hands out no indices (an IterableDataset, a loader without a sampler) is judged by
the content of the batches each rank's loop received (``content.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

from ...claims import claim
from ...events import CALL, LOG
from ...outcomes import Outcome
from ...runs import RunSpec
from ...sites import fmt_site
from ..base import Contract, Evidence, Findings, Run, Verdict, method_site, rank_guard, user_classes
from ..rank_reads import describe, selecting_reads
from . import statements
from .content import ContentCheck
from .probe import EVAL_STAGE, EvalDuplicationProbe
from .probe import STAGES as STAGES_ORDER

_STAGE_WORDS = {"validate": "validation", "test": "test", "predict": "prediction"}
_STEP_HOOK = {"validate": ("validation_step",), "test": ("test_step",), "predict": ("predict_step",)}
_GATHERS = ("all_gather", "gather", "all_gather_object", "gather_object", "all_gather_into_tensor")
_FIX_DUPLICATES = ("Evaluate each sample once: shard evaluation with a sampler that does not pad (each rank "
                   "takes indices rank, rank + world, ...; use_distributed_sampler=False), or drop duplicates "
                   "by a stable sample id before computing, or publish metrics from a "
                   "Trainer(accelerator=\"cpu\", devices=1) run.")
_FIX_UNSPLIT = ("Split evaluation across ranks: keep use_distributed_sampler=True for the evaluation loaders (own "
               "only the training sampler), or give the loader a sampler that takes indices rank, rank + world, "
               "... without padding.")
_FIX_MISSING = "Evaluate every sample: a sampler without drop_last that covers every index across ranks."
_FIX_SHARD_METRIC = ("Publish a metric over the whole set: a TorchMetrics object (synced across ranks), "
                     "self.log(..., sync_dist=True) for a plain mean, or all-gather predictions with sample ids "
                     "before computing; or compute it with Trainer(accelerator=\"cpu\", devices=1).")
_FIX_WRITES = ("Collect rank outputs with their sample ids before writing: self.all_gather (or "
               "torch.distributed.gather_object) then write on rank 0, or a BasePredictionWriter that writes "
               "one file per rank and a merge by id; or run this stage on one device.")


def _ids(values: list[int], limit: int = 12, keep_order: bool = False) -> str:
    values = list(values) if keep_order else sorted(values)
    text = ", ".join(map(str, values[:limit]))
    return f"[{text}{', ...' if len(values) > limit else ''}]"


def _close(value: float, reference: float) -> bool:
    return math.isclose(value, reference, rel_tol=1e-4, abs_tol=1e-6)


def _finite(v) -> bool:
    """A recorded value a comparison can use: a number that is neither NaN nor inf (None: missing)."""
    return v is None or math.isfinite(v)


def _fmt(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.4g}"


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


@dataclasses.dataclass
class StageFindings(Findings):
    """What the stages found, in order (:class:`~..base.Findings`), and what held: passing sentences,
    and the loaders whose samples could not be told apart."""

    good: list[str] = dataclasses.field(default_factory=list)
    unread: list[str] = dataclasses.field(default_factory=list)

    def fail(self, text: str, fix: str, category: str = "silent") -> None:
        """A finding; ``category`` 'repeated' where samples are evaluated more than once and no
        published value was measured wrong (a duplicated or missing sample raises nothing)."""
        self.add(category, text, fix=fix)


class EvalDuplication(Contract):
    id = "eval-duplication"
    needs_finite_loss = True
    title = "Evaluation counts every sample exactly once and publishes the whole set"
    rule_section = "Sampling, metrics and writes"
    run_spec = RunSpec("eval", "pytest_ltconform.contracts.eval_duplication.probe:evaluate",
                       reference="pytest_ltconform.contracts.eval_duplication.probe:reference",
                       what="the plugin's evaluation run (a fit, then validate and test on every rank, then the "
                            "same weights on one device)")
    probe_class = EvalDuplicationProbe
    strategies = ("ddp",)

    def judge(self, run: Run) -> Verdict:
        data = [(v or {}).get("eval") for v in run.values()]
        if any(d is None for d in data):
            return self.verdict(Outcome.PASSED, "no evaluation was recorded on every rank.", empty=True)
        limited = data[0].get("limited")
        stages = [s for s in data[0].get("driver", []) if s in data[0]["stages"]]
        if not stages:
            # Nothing was evaluated, so nothing was compared: not a pass.
            return self.not_judged("the target has no validation, test or predict dataloader, so "
                                           "no evaluation ran to count samples in.")
        found = StageFindings()
        ref = _reference(run, found.notes)
        if limited:
            found.notes.append("the user's limit_*_batches makes worlds of different sizes evaluate different "
                               "samples: values were not compared and unevaluated samples are not reported.")
        judged = []
        for stage in stages:
            recs = [d["stages"].get(stage) for d in data]
            if any(r is None or r.get("error") for r in recs):
                found.notes.append(_stage_error_note(stage, recs, data[0].get("driver", []), stages))
                break
            ref_rec = (ref or {}).get("stages", {}).get(stage) if ref else None
            if ref_rec is not None and ref_rec.get("error"):
                found.notes.append(f"the one-device run's {stage} stage raised {ref_rec['error']['exc_type']}, so "
                                   f"its values were not compared.")
                ref_rec = None
            _StageCheck(run, stage, recs, ref_rec, limited, found).check()
            judged.append(stage)
            _production_note(recs[0].get("production"), stage, found)
        if not judged:
            return self.not_judged(found.notes[-1], notes=found.notes[:-1])
        if found.items:
            # The label follows from what was measured: wrong values if any finding measured or implies them.
            category = "silent" if any(f.category == "silent" for f in found.items) else found.lead.category
            summary = found.summary(every=True)
            return self.verdict(Outcome.FAILED, summary, evidence=found.evidence, fix=found.fixes(), category=category,
                                notes=found.notes, claims=_said(found, summary))
        if found.unread and not found.good:  # nothing compared: never a pass
            return self.not_judged("cannot tell samples apart in " + "; ".join(found.unread)
                                + " (no dataset indices to read).", notes=found.notes)
        summary = " ".join(found.good)
        return self.verdict(Outcome.PASSED, summary, evidence=found.evidence, notes=found.notes,
                            claims=_said(found, summary))


def _said(found: StageFindings, summary: str) -> list:
    """The claims of the sentences the verdict says (a failed verdict leaves the stages' passing
    sentences out, and their claims with them)."""
    said = "\n".join([summary, *found.notes, *(e.detail for e in found.evidence)])
    return [c for c in found.claims if c.text in said]


def _stage_error_note(stage: str, recs: list, driver: list, stages: list) -> str:
    """One line for an evaluation stage that raised: which ranks, the exception at the user's
    line, and the stages that therefore did not run; what came before it is still judged."""
    from ...world.causes import exception_words, raise_frames

    failed = [(r, rec["error"]) for r, rec in enumerate(recs) if rec and rec.get("error")]
    if not failed:
        return f"the {stage} stage did not record on every rank, so it was not judged."
    rank, err = failed[0]
    raised, user = raise_frames(err.get("traceback"))
    ranks = _ranks([r for r, _ in failed])
    later = [s for s in driver if s in STAGES_ORDER and STAGES_ORDER.index(s) > STAGES_ORDER.index(stage)]
    after = f"; {', '.join(later)} did not run" if later else ""
    # The exception, the frame that raised it (yours, a library's) and your frame on the way.
    what = exception_words(err["exc_type"], err.get("message"), raised, user)
    return f"the {stage} stage raised {what} on {ranks}, so it was not judged{after}."


def _production_note(plan: dict | None, stage: str, found) -> None:
    """What every rank of the production world would evaluate of ``stage`` (rank 0 computed it from
    its sampler), beside the verdict on this run's ranks."""
    from ..production import sentences

    note, _ = sentences(plan, stage)
    if note:
        found.notes.append(note)


def _reference(run: Run, notes: list[str]) -> dict | None:
    """The one-device run's observations; None (with a note saying why) when they cannot be compared."""
    ref_run = run.reference
    ref = None
    if ref_run is not None and ref_run.finished:
        ref = (ref_run.values()[0] or {}).get("eval")
    if ref is None:
        notes.append("the one-device reference run did not finish, so no value was compared with it"
                     + (f": {ref_run.job.failure_text()[:600]}" if ref_run is not None else "."))
    if ref is not None and ref.get("load_problems"):
        keys = ref["load_problems"]
        notes.append(f"the one-device run could not load every weight ({', '.join(keys[:6])}"
                     f"{', ...' if len(keys) > 6 else ''}), so no value was compared with it.")
        ref = None
    return ref


class _StageCheck:
    """One evaluation stage of the world (``recs``: each rank's record) against the one-device
    record ``ref_rec`` (None: not compared); adds what it finds to ``found``."""

    def __init__(self, run: Run, stage: str, recs: list[dict], ref_rec: dict | None, limited: bool,
                 found: StageFindings):
        self.run, self.stage, self.recs, self.ref_rec = run, stage, recs, ref_rec
        self.limited, self.found = limited, found
        self.word = _STAGE_WORDS[stage]
        self.world = len(recs)

    def check(self) -> None:
        n_loaders = max(len(r.get("loaders", [])) for r in self.recs)
        for i in range(n_loaders):
            self._loader(i, n_loaders)
        self._rank_zero_writes()

    def _loader(self, i: int, n_loaders: int) -> None:
        infos = [r["loaders"][i] if i < len(r.get("loaders", [])) else {} for r in self.recs]
        tag = f"{self.word}" + (f" (dataloader {i})" if n_loaders > 1 else "")
        content = None
        if any(info.get("iterable") or info.get("indices") is None for info in infos):
            content = ContentCheck(self, tag, i, infos, _loader_site(self.run, self.stage))
            if content.check():
                return
        why = f", {content.why}" if content is not None and content.why else ""
        if any(info.get("iterable") for info in infos):
            self.found.unread.append(f"{tag}: IterableDataset {infos[0].get('dataset') or ''}".rstrip() + why)
            self.found.notes.append(f"{tag}: an IterableDataset has no indices to compare; not checked.")
            return
        built = infos[0].get("built") or {}
        if any(info.get("indices") is None for info in infos) and built.get("torch_loader") is False:
            where = f" (built at {fmt_site(built['site'])})" if built.get("site") else ""
            self.found.unread.append(f"{tag}: {built.get('cls')}, not a torch DataLoader, over "
                                     f"{infos[0].get('dataset') or 'its data'}{why}")
            self.found.notes.append(f"{tag}: {built.get('cls')}{where} is not a torch DataLoader, so Lightning injects "
                                    f"no DistributedSampler into it and no fetch hands its dataset keys to read: every "
                                    f"rank evaluates what it yields unless it splits by rank itself (split it by rank "
                                    f"inside {built.get('cls')}, or return a torch DataLoader over the same dataset).")
            return
        if any(info.get("indices") is None for info in infos):
            self.found.unread.append(f"{tag}: {infos[0].get('dataset') or 'a dataset'} behind "
                                     f"{infos[0].get('sampler') or 'no sampler'}{why}")
            self.found.notes.append(f"{tag}: its indices could not be read "
                                    f"({next((x.get('error') for x in infos if x.get('error')), 'no sampler')}).")
            return
        per_rank = [info["indices"] for info in infos]
        n = infos[0].get("dataset_len")
        counts = Counter(i for idx in per_rank for i in idx)
        dups = {k: c for k, c in counts.items() if c > 1}
        sampler = infos[0].get("sampler") or "sampler"
        moved = self._compare(i)
        split = self._split_in_step(per_rank) if dups else None
        if split is not None:
            self._in_step(tag, per_rank, split, moved)
        elif dups and self._whole_set_unsplit(tag, i, infos, per_rank, n, moved):
            pass
        elif dups and self._whole_set_unchanged(tag, i, per_rank, n, moved):
            pass
        elif dups:
            self._duplicates(tag, infos, per_rank, counts, dups, moved, i)
        elif n is not None and not self.limited and len(counts) < n:
            missing = sorted(set(range(n)) - set(counts))
            shard_text = ", ".join(f"rank {r}: {len(x)}" for r, x in enumerate(per_rank))
            self.found.fail(f"{tag}: {len(missing)} of {n} samples were never evaluated on any rank "
                            f"{_ids(missing)} ({shard_text}; {sampler}).", _FIX_MISSING)
        else:
            self._exactly_once(tag, i, per_rank, n, counts)  # names the keys not judged itself
        if dups or (n is not None and not self.limited and len(counts) < n):
            self._unjudged_note(tag, i)
        if not dups:
            self._shard_metrics(tag, per_rank, n, moved)

    def _whole_set_unsplit(self, tag, i, infos, per_rank, n, moved) -> bool:
        """Every rank evaluates the whole set although it has a batch or more for each rank: no
        sampler splits it, so each sample is evaluated world-size times (seed section "Sampling,
        metrics and writes"). A set with fewer batches than ranks, left whole on purpose, is
        :meth:`_whole_set_unchanged`'s. Records a failure; True when it did."""
        full = sorted(per_rank[0])
        if any(sorted(idx) != full for idx in per_rank[1:]) or (n is not None and len(set(full)) != n):
            return False
        batches = [info.get("batches") or 0 for info in infos]
        if min(batches) < self.world:
            return False
        sampler = infos[0].get("sampler") or "no sampler"
        same = self._same(i)
        equal = ""
        if same:
            values, made = statements.published_equal(same, self.world, limit=3)
            equal = f"; {values}, only because each copy weighs the same"
            self.found.claims += made
        self.found.fail(f"{tag}: every rank evaluates the whole set: all {len(set(full))} samples on each of the "
                        f"{self.world} ranks ({min(batches)} batches per rank, {sampler}), so each sample is "
                        f"evaluated {self.world} times and no sampler splits the {self.word} set across "
                        f"ranks{equal}.", _FIX_UNSPLIT, "silent" if moved else "repeated")
        self._moved_evidence(moved, [per_rank[0]], synced_only=False)
        for r, idx in enumerate(per_rank):
            self.found.evidence.append(Evidence(f"this rank's {self.word} loader yields all {len(idx)} indices "
                                                f"{_ids(idx, keep_order=True)} in {batches[r]} batches", rank=r))
        built = _built_evidence(self.run, self.stage, infos[0], "no sampler splits it across ranks")
        if built is not None:
            self.found.evidence.append(built)
        return True

    def _whole_set_unchanged(self, tag, i, per_rank, n, moved) -> bool:
        """Every rank evaluates the whole set (the same indices, all of them), and every value the
        stage publishes equals the single-device value: each sample weighs the same on every rank,
        so nothing published is wrong; only the work is repeated. Records a pass and a note."""
        full = sorted(per_rank[0])
        if moved or any(sorted(idx) != full for idx in per_rank[1:]) or (n is not None and len(set(full)) != n):
            return False
        same = self._same(i)
        if not same:
            return False  # nothing compared: duplicates are judged as such
        values, made = statements.published_equal(same, self.world)
        self.found.claims += made
        self.found.good.append(f"{tag}: every rank evaluates all {len(full)} samples and {values}.")
        self.found.notes.append(f"{tag}: the loader is not sharded, so each of the {self.world} ranks repeats the "
                                f"whole evaluation: wasted work, but no sample weighs more than another.")
        return True

    def _split_in_step(self, per_rank) -> dict | None:
        """Rank 0's read of its rank in this stage's step, when every rank's loader gave it the same
        indices and every rank's step uses its rank to select data (the split is inside the step)."""
        if any(sorted(idx) != sorted(per_rank[0]) for idx in per_rank[1:]):
            return None
        reads = selecting_reads([rec.get("rank_reads") or [] for rec in self.recs], _STEP_HOOK[self.stage])
        return reads[0] if reads else None

    def _in_step(self, tag, per_rank, read, moved) -> None:
        """Every rank evaluates the same indices and its step keeps its own rows: not duplicates."""
        hook = read.get("hook")
        self.found.good.append(f"{tag}: every rank's loader gives it the same {len(per_rank[0])} indices and "
                               f"{hook} selects each rank's rows by rank, so no sample is counted twice by the "
                               f"loader.")
        self.found.notes.append(f"{tag}: every rank evaluates the same batches by design: {describe(read)}, so the "
                                f"split between ranks happens inside the step, which this check does not see (it "
                                f"reads the indices each fetch received, not the rows each rank then keeps).")
        share = f"rank 0's rows of each batch ({hook} selects them by rank at {fmt_site(read.get('site'))})"
        self._shard_metrics(tag, per_rank, None, moved, share=share)

    def _duplicates(self, tag, infos, per_rank, counts, dups, moved, i) -> None:
        word, world, n = self.word, self.world, infos[0].get("dataset_len")
        sampler = infos[0].get("sampler") or "sampler"
        where = defaultdict(list)
        for r, idx in enumerate(per_rank):
            for k in idx:
                if k in dups:
                    where[k].append(r)
        named = "; ".join(f"index {k} on {_ranks(where[k])}" for k in sorted(dups)[:6])
        pad = ""
        if infos[0].get("total_size") and n is not None and infos[0]["total_size"] > n:
            pad = (f" {sampler} pads {n} indices to {infos[0]['total_size']} ({n} % {world} = {n % world}) "
                   f"by repeating the first ones.")
        several = "indices" if len(dups) > 1 else "index"
        total = sum(len(x) for x in per_rank)
        measured_equal = bool(self._same(i)) and not moved
        self.found.fail(f"{tag}: {len(dups)} sample {several} evaluated more than once across ranks: "
                        f"{total} evaluations for {len(counts)} distinct samples.{pad}", _FIX_DUPLICATES,
                        "repeated" if measured_equal else "silent")
        evidence = self.found.evidence
        evidence.append(Evidence(f"{word} sample {named} ({sampler})"))
        built = _built_evidence(self.run, self.stage, infos[0], f"Lightning wraps it in {sampler}")
        if built is not None:
            evidence.append(built)
        for r, idx in enumerate(per_rank):
            evidence.append(Evidence(f"{sampler} gave this rank {len(idx)} {word} indices "
                                     f"{_ids(idx, keep_order=True)}", rank=r))
        for name, samples in _metric_counts(self.recs).items():
            evidence.append(_metric_evidence(name, samples, per_rank, len(counts), word))
        self._moved_evidence(moved, per_rank)

    def _moved_evidence(self, moved, per_rank, synced_only: bool = False) -> None:
        """One line per published value that differs from the one-device value: whose value it is
        (every rank's, or rank 0's own) and, for duplicates, what part of the run the difference
        comes from (``statements.difference_origin``)."""
        for key, dist, single, values in moved:
            text, made = statements.versus(key, values, single, self.world)
            origin = statements.difference_origin(values, per_rank[0], statements.agree(values)) \
                if len(per_rank) > 1 else ""
            self.found.claims += made
            self.found.evidence.append(Evidence(f"{text} with the same weights (difference {dist - single:+.4g})"
                                                + (f": {origin}" if origin else "")))

    def _exactly_once(self, tag, i, per_rank, n, counts) -> None:
        span = f"every index 0..{n - 1}" if n is not None and len(counts) == n else f"{len(counts)} indices"
        shard_text = ", ".join(f"rank {r}: {len(x)}" for r, x in enumerate(per_rank))
        text = f"{tag}: {span} evaluated exactly once across ranks ({shard_text})"
        same, unjudged = self._same(i), self._not_finite(i)
        why = None if same else self._not_compared(i)
        if same:
            values, made = statements.equal_list(same, self.world)
            text += "; " + values
            self.found.claims += made
        else:
            text += f"; no value was compared with the one-device run: {why}"
        if unjudged:
            values, made = statements.not_finite(unjudged, self.world)
            text += ("; " if same else ": ") + values
            self.found.claims += made
        self.found.good.append(text + ".")
        self.found.claims.append(claim("one-device", text, compared={k: [v, s] for k, v, s in same}, why=why))

    def _unjudged_note(self, tag, i) -> None:
        """A note naming the published keys not compared with the one-device run because a value is
        NaN or inf (a verdict sentence other than the exactly-once one says nothing of them)."""
        unjudged = self._not_finite(i)
        if unjudged:
            values, made = statements.not_finite(unjudged, self.world)
            self.found.notes.append(f"{tag}: {values}.")
            self.found.claims += made

    def _not_compared(self, i) -> str:
        """Why no published value of loader ``i`` was compared with the one-device run."""
        if self.ref_rec is None:
            return "the one-device run gave no values for this stage (see the notes)"
        if self._not_finite(i):
            return "every metric the stage published that has a one-device value is NaN or inf somewhere"
        if self.stage == "predict":
            return "a prediction stage publishes no metric (its outputs are judged by the files written)"
        if not self._values(i, self.recs[0]):
            return f"the {self.word} stage published no metric"
        return "no metric the stage published has a one-device value"

    def _values(self, i, rec) -> dict:
        if self.stage == "predict":
            return {}
        returned = rec.get("returned") or []
        return returned[i] if i < len(returned) else {}

    def _not_finite(self, i) -> list[tuple[str, list, float]]:
        """[(key, [value per rank], one-device value)] of the published keys with a one-device value
        that is NaN or inf on some rank or on the one device: such a comparison compares nothing, so
        the key is not judged (neither equal nor different)."""
        if self.ref_rec is None:
            return []
        ref_vals = self._values(i, self.ref_rec)
        per_rank = [self._values(i, r) for r in self.recs]
        out = []
        for key in per_rank[0]:
            if ref_vals.get(key) is None:
                continue
            values = [pr.get(key) for pr in per_rank]
            if not all(_finite(v) for v in [*values, ref_vals[key]]):
                out.append((key, values, ref_vals[key]))
        return out

    def _compare(self, i) -> list[tuple[str, float, float, list[float]]]:
        """Metrics whose published (rank 0) value differs from the one-device value (every value of
        the key finite, see :meth:`_not_finite`)."""
        if self.ref_rec is None:
            return []
        ref_vals = self._values(i, self.ref_rec)
        per_rank = [self._values(i, r) for r in self.recs]
        skipped = {k for k, _, _ in self._not_finite(i)}
        out = []
        for key, dist in per_rank[0].items():
            single = ref_vals.get(key)
            if single is None or key in skipped or _close(dist, single):
                continue
            out.append((key, dist, single, [pr.get(key) for pr in per_rank]))
        return out

    def _same(self, i) -> list[tuple[str, list, float]]:
        """[(key, [value per rank], one-device value)] of the published (rank 0) values equal to the
        one-device ones."""
        if self.ref_rec is None:
            return []
        ref_vals = self._values(i, self.ref_rec)
        per_rank = [self._values(i, r) for r in self.recs]
        skipped = {k for k, _, _ in self._not_finite(i)}
        return [(k, [pr.get(k) for pr in per_rank], ref_vals[k]) for k, v in per_rank[0].items()
                if k in ref_vals and k not in skipped and _close(v, ref_vals[k])]

    def _shard_metrics(self, tag, per_rank, n, moved, share: str | None = None) -> None:
        """An unsynced epoch metric: each rank holds its own shard's value and rank 0's is published
        (``share``: what rank 0's shard is, when the step splits the batches)."""
        for key, dist, single, values in moved:
            others = [v for v in values[1:] if v is not None]
            if not others or all(_close(v, dist) for v in others):
                continue  # synced: equal on every rank (a different value is sync-dist's business)
            log = _log_event(self.run, key)
            how = ""
            if log is not None:
                flags = [f for f in ("rank_zero_only", "sync_dist") if log.get(f)]
                how = f" (logged in {log.get('hook')} with " + (
                    ", ".join(f"{f}=True" for f in flags) if flags else "no sync") + ")"
            covered = len(per_rank[0])
            total = n if n is not None else len({i for idx in per_rank for i in idx})
            share_text = share or f"{covered} of {total} {self.word} samples"
            local = f"{key} published from rank 0 is computed from rank 0's shard alone"
            if log is not None:
                self.found.claims.append(claim("local", local, log=log))
            self.found.fail(f"{tag}: {local}: {share_text}{how}.", _FIX_SHARD_METRIC)
            text, made = statements.versus(key, values, single, self.world)
            self.found.claims += made
            self.found.evidence.append(Evidence(
                f"{text} with the same weights (difference {dist - single:+.4g})", rank=0,
                frame=log.get("site") if log else None, call="log_dict" if log and log.get("via") == "log_dict"
                else "log" if log else None))

    def _rank_zero_writes(self) -> None:
        recs, word, stage = self.recs, self.word, self.stage
        if len(recs) < 2:
            return
        by_rank = [{w["path"]: w for w in rec.get("writes") or []} for rec in recs]
        others = set().union(*[set(b) for b in by_rank[1:]])
        gathered = _gathered(self.run, stage)
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
            if path in others or gathered or _publishes_synced_metrics(self.run, stage, w.get("site")):
                continue
            if w.get("outputs") is False:
                continue  # written before the stage's first batch (in setup) and not after: no outputs in it
            site = w.get("site")
            guard = rank_guard(site)
            lines = f"; the file has {w['lines']} line(s)" if w.get("lines") is not None else ""
            self.found.fail(f"{word}: {path} is written by rank 0 alone"
                            + (f" under `{guard}`" if guard else "")
                            + f" from rank 0's shard: it covers {len(own)} of {n} {word} samples; nothing "
                              f"gathers the other ranks' outputs first.", _FIX_WRITES)
            self.found.evidence.append(Evidence(f"{path} written in {stage} from {len(own)} of {n} samples: ids "
                                                f"{_ids(own)} (rank 0){lines}", rank=0,
                                                site=None if site else fmt_site(None), frame=site))
            self.found.evidence.append(Evidence(f"ids {_ids(rest)} were {word} inputs on other ranks and never "
                                                f"reached the file (trainer.{stage} returns only each rank's own "
                                                f"shard)"))


def _metric_evidence(name: str, samples: dict, per_rank: list, distinct: int, word: str) -> Evidence:
    """What a TorchMetrics object was updated with. Its updates hold tensor rows; they are samples
    only where each rank's rows equal the samples its loader handed it (a padded sequence or a
    graph has several rows per sample), else no count is given."""
    rows = samples["per_rank"]
    if rows == [len(idx) for idx in per_rank]:
        return Evidence(f"{samples['type']} `{name}` was updated with {sum(rows)} samples for {distinct} distinct "
                        f"{word} samples (" + ", ".join(f"rank {r}: {k}" for r, k in enumerate(rows))
                        + "): its synced state holds the duplicates")
    return Evidence(f"{samples['type']} `{name}` was updated with every {word} batch of every rank, the duplicated "
                    f"samples included (its updates hold tensor rows, not one row per sample, so they are not "
                    f"counted as samples): its synced state holds the duplicates")


def _metric_counts(recs) -> dict:
    out: dict[str, dict] = {}
    for r, rec in enumerate(recs):
        for name, c in (rec.get("metric_samples") or {}).items():
            entry = out.setdefault(name, {"type": c["type"], "per_rank": [0] * len(recs)})
            entry["per_rank"][r] = c["n"]
    return {k: v for k, v in out.items() if sum(v["per_rank"])}


def _log_event(run, key) -> dict | None:
    """Rank 0's last user ``self.log`` of ``key`` (recorded by the harness's trace). A call with
    on_step=True and on_epoch=True publishes ``<name>_epoch``, so that key names the call too."""
    for e in reversed(run.events(0, LOG)):
        if not e.get("user"):
            continue
        name = e.get("name")
        both = e.get("on_step") and e.get("on_epoch")
        if key == name or (both and key in (f"{name}_epoch", f"{name}_step")):
            return e
    return None


def _publishes_synced_metrics(run, stage, site) -> bool:
    """Whether rank 0's write publishes Lightning's reduced metrics: the writing function reads
    ``trainer.callback_metrics`` (or ``logged_metrics``) and every value the stage logged on rank 0
    was reduced across ranks (``sync_dist=True`` or a TorchMetrics metric), so the file holds
    whole-set values, not rank 0's shard (shared case ok_callback_metrics_read_before_guard)."""
    import ast

    from ..base import _parse

    tree = _parse(site["file"]) if site and site.get("file") else None
    line = (site or {}).get("line", 0)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.lineno <= line <= (n.end_lineno or n.lineno)] if tree is not None else []
    text = ast.unparse(max(funcs, key=lambda n: n.lineno)) if funcs else ""
    if "callback_metrics" not in text and "logged_metrics" not in text:
        return False
    logs, inside = [], False
    for e in run.events(0):
        if EVAL_STAGE.of(e) and e.get("name") == stage:
            inside = e.get("at") == "start"
        elif inside and LOG.of(e) and e.get("user"):
            logs.append(e)
    return bool(logs) and all(e.get("sync_dist") or e.get("vtype") == "metric" for e in logs)


def _gathered(run, stage) -> bool:
    inside = False
    for e in run.events(0):
        if EVAL_STAGE.of(e) and e.get("name") == stage:
            inside = e.get("at") == "start"
        elif inside and CALL.of(e) and e.get("user") and e.get("op") in _GATHERS:
            return True
    return False


CONTRACT = EvalDuplication()


def _built_evidence(run: Run, stage: str, info: dict, then: str) -> Evidence | None:
    """Where the stage's loader object was constructed (recorded on the rank when the hook
    returned it); where that was not recorded, the hook that returns it, said as such."""
    built = info.get("built") or {}
    what = f"{_STAGE_WORDS[stage]} {built.get('cls') or 'DataLoader'}"
    if built.get("site"):
        return Evidence(f"the {what} is built here, and {then}", frame=built["site"])
    hook = _loader_site(run, stage)
    if hook:
        return Evidence(f"the {what} is returned by this hook (where it was built was not recorded), and {then}",
                        frame=hook)
    return None


def _loader_site(run: Run, stage: str) -> dict | None:
    """Where the user's module or datamodule defines the ``<stage>_dataloader`` hook."""
    hook = {"validate": "val", "validation": "val", "val": "val"}.get(stage, stage) + "_dataloader"
    for which in ("datamodule", "model"):
        site = method_site(user_classes(run, which), hook)
        if site:
            return site
    return None
