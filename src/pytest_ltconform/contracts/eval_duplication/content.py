"""eval-duplication for loaders that hand out no dataset indices: an IterableDataset, or a loader
without a sampler (a package's own loader class). Their samples are told apart by content: the
batches each rank's evaluation loop received, fingerprinted by the probe (``content_fingerprint``).

Seed section "Sampling, metrics and writes": evaluation must count every sample once. The same
batches on every rank (in any order) are the whole set evaluated on every rank, the fault the
sampler path reports for an unsplit DataLoader; a batch whose content reached two ranks is a
duplicate. Judged only when the content tells the batches apart: a tensor leaf that differs from
batch to batch within a rank (so that a constant mask or label vector never reads as "the same
stream"), and, for the "same stream" finding, equal on every rank batch for batch. A leaf drawn at
random per rank (negative samples) may differ across ranks without hiding the leaf that does not.
"""

from __future__ import annotations

from collections import defaultdict

from ..base import Evidence
from ..rank_reads import describe, selecting_reads
from . import statements

FIX_UNSPLIT_STREAM = ("Split evaluation across ranks: build the loader as a torch DataLoader over a map-style "
                      "dataset so that Lightning adds its DistributedSampler, or make the stream yield only this "
                      "rank's share (items rank, rank + world, ... from torch.distributed.get_rank() and "
                      "get_world_size()), or compute the published metric with Trainer(accelerator=\"cpu\", "
                      "devices=1).")
FIX_SHARED_BATCHES = ("Evaluate each batch once: give every rank its own share of the stream (items rank, "
                      "rank + world, ...), without repeating items to even out the ranks.")
_STEP_HOOK = {"validate": ("validation_step",), "test": ("test_step",), "predict": ("predict_step",)}


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def source_words(info: dict) -> str:
    """What hands out the batches, in the user's words: "IterableDataset Stream", "DictLoader
    without a sampler"."""
    if info.get("iterable"):
        return f"IterableDataset {info.get('dataset') or ''}".rstrip()
    loader = info.get("loader") or info.get("dataset") or "the loader"
    return f"{loader} without a sampler" if not info.get("sampler") else f"{loader} ({info['sampler']})"


def identifying_leaf(streams: list[list[dict]]) -> int | None:
    """The position of a tensor leaf that tells a rank's batches apart and holds the same values on
    every rank, batch for batch in any order; None when there is none (the streams differ)."""
    n = len(streams[0])
    if not n or any(len(s) != n for s in streams):
        return None
    width = min(len(b["leaves"]) for s in streams for b in s)
    for k in range(width):
        cols = [sorted(b["leaves"][k][0] for b in s) for s in streams]
        if any(c != cols[0] for c in cols[1:]):
            continue
        first = streams[0][0]["leaves"][k]
        if n >= 2 and len(set(cols[0])) < n:
            continue  # repeats within a rank (a mask, a label vector): does not identify batches
        if n == 1 and not (first[2] or first[1] >= 8):
            continue  # one short integer leaf: too little to call two ranks' batches the same
        return k
    return None


class ContentCheck:
    """One loader of one evaluation stage (``stage_check``: the sampler path's ``_StageCheck``),
    judged by content. ``check`` records a finding and returns True, or returns False with
    ``why`` (None when no content was recorded) when the content cannot tell batches apart."""

    def __init__(self, stage_check, tag: str, index: int, infos: list[dict], built: dict | None):
        self.sc, self.tag, self.i, self.infos, self.built = stage_check, tag, index, infos, built
        self.why: str | None = None
        self.source = source_words(infos[0])

    def check(self) -> bool:
        streams = [(rec.get("contents") or {}).get(str(self.i)) for rec in self.sc.recs]
        if any(not s for s in streams):
            return False
        if any(b is None for s in streams for b in s):
            self.why = "its batches hold no tensor to compare"
            return False
        k = identifying_leaf(streams)
        if k is not None:
            self._same_stream(streams, k)
            return True
        if any(len({b["fp"] for b in s}) < len(s) for s in streams):
            self.why = "its batches repeat within a rank, so their content does not tell them apart"
            return False
        self._different(streams)
        return True

    def _how(self, streams, k) -> str:
        leaf = streams[0][0]["leaves"][k]
        kind = "floating-point" if leaf[2] else "integer"
        return (f"established by content: {self.source} hands out no dataset indices, so the batches were "
                f"fingerprinted as the loop received them, and tensor {k} of each batch ({kind}, {leaf[1]} "
                f"values) is the same on every rank, batch for batch")

    def _same_stream(self, streams, k) -> None:
        sc, n = self.sc, len(streams[0])
        reads = selecting_reads([rec.get("rank_reads") or [] for rec in sc.recs], _STEP_HOOK[sc.stage])
        if reads:
            sc.found.good.append(f"{self.tag}: every rank's loop receives the same {_batches(n)} and "
                                 f"{reads[0].get('hook')} selects each rank's rows by rank, so no sample is "
                                 f"counted twice by the loader ({self._how(streams, k)}).")
            sc.found.notes.append(f"{self.tag}: every rank evaluates the same batches by design: "
                                  f"{describe(reads[0])}.")
            return
        same, moved = sc._same(self.i), sc._compare(self.i)
        if n < sc.world and same and not moved:
            sc.found.good.append(f"{self.tag}: every rank evaluates the same {_batches(n)}, fewer than the "
                                 f"{sc.world} ranks, and the published values equal the single-device ones "
                                 f"({self._how(streams, k)}).")
            sc.found.notes.append(f"{self.tag}: the stream is not split, so each of the {sc.world} ranks repeats "
                                  f"the whole evaluation: wasted work, but no sample weighs more than another.")
            return
        equal = ""
        if same:
            values, made = statements.published_equal(same, sc.world, limit=3)
            equal = f"; {values}, only because each copy weighs the same"
            sc.found.claims += made
        sc.found.fail(f"{self.tag}: every rank evaluates the same stream: the {_batches(n)} each rank's {sc.word} "
                      f"loop received are the same on all {sc.world} ranks, so each sample is evaluated "
                      f"{sc.world} times and nothing splits the {sc.word} set across ranks ({self._how(streams, k)})"
                      f"{equal}.", FIX_UNSPLIT_STREAM, "silent" if moved else "repeated")
        self._evidence(streams, f"tensor {k} of each batch the same as on every other rank", leaf=k)
        sc._moved_evidence(moved, [[]])

    def _different(self, streams) -> None:
        sc = self.sc
        where: dict[str, set] = defaultdict(set)
        for r, s in enumerate(streams):
            for b in s:
                where[b["fp"]].add(r)
        shared = [fp for fp, ranks in where.items() if len(ranks) > 1]
        sizes = ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(streams))
        if shared:
            equal = bool(sc._same(self.i)) and not sc._compare(self.i)
            sc.found.fail(f"{self.tag}: {len(shared)} batch(es) reached more than one rank with the same content "
                          f"({sizes} batches; established by content: {self.source} hands out no dataset "
                          f"indices, so the batches were fingerprinted as the loop received them).",
                          FIX_SHARED_BATCHES, "repeated" if equal else "silent")
            sc._moved_evidence(sc._compare(self.i), [[]])
            self._evidence(streams, "batches whose content another rank also evaluated", only=set(shared))
            return
        sc.found.good.append(f"{self.tag}: no batch reached two ranks ({sizes} batches, compared by content: "
                             f"{self.source} hands out no dataset indices).")
        sc.found.notes.append(f"{self.tag}: batches were compared whole, by content; a sample repeated inside "
                              f"otherwise different batches would not be seen.")
        per_rank = [[b["fp"] for b in s] for s in streams]
        sc._shard_metrics(self.tag, per_rank, None, sc._compare(self.i),
                          share=f"rank 0's {len(per_rank[0])} of {sum(map(len, per_rank))} {sc.word} batches")

    def _evidence(self, streams, what: str, only: set | None = None, leaf: int | None = None) -> None:
        """The loader's site, and per rank the fingerprints that match: of tensor ``leaf`` when
        given, else of whole batches (those in ``only`` when given)."""
        if self.built:
            self.sc.found.evidence.append(Evidence(f"the {self.sc.word} loader ({self.source}) is built here",
                                                   frame=self.built))
        for r, s in enumerate(streams):
            fps = [b["leaves"][leaf][0] if leaf is not None else b["fp"] for b in s
                   if only is None or b["fp"] in only]
            shown = ", ".join(fps[:4]) + (", ..." if len(fps) > 4 else "")
            self.sc.found.evidence.append(Evidence(f"this rank's {self.sc.word} loop received {_batches(len(s))}, "
                                                   f"{what}: content fingerprints [{shown}]", rank=r))
