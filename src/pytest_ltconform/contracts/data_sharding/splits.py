"""data-sharding: a train or validation split that differs by rank.

A DistributedSampler splits *one* dataset between the ranks: it assumes every rank holds the same
one. A split drawn from the global generator (``random_split`` without a generator, a shuffled index
list, a subsample) is the same on every rank only when every rank's generator was seeded alike, which
the user's launch script decides (``seed_everything``), not the module: processes that torchrun or
SLURM start without it draw different splits, so training sets overlap across ranks, validation
samples of one rank are trained on by another, and some samples are never used. The plugin's ranks
draw under per-rank seeds until training starts (seeding "both" or "per-rank"), and each loader's
dataset is recorded as what it selects from its whole (``split``, from the probe's ``split_info``):
the resolved Subset indices and a digest of the dataset underneath. Pure data over the trace.
"""

from __future__ import annotations

import linecache

from ...events import SEEDING
from ...sites import fmt_site
from .probe import BATCH, DS_GLOBAL_DRAW, DS_LOADER

_STAGES = (("train", "training"), ("val", "validation"))


def _splits(run, stage: str) -> dict[int, dict]:
    """rank -> the ``split`` of that rank's first loader event of ``stage`` (every rank, or {})."""
    out = {}
    for r in range(run.world_size):
        event = next((e for e in run.events(r, DS_LOADER) if e.get("stage") == stage and e.get("split")), None)
        if event is not None:
            out[r] = event["split"]
    return out if len(out) == run.world_size else {}


def _content_rows(run, rank: int, stage: str) -> set:
    """The per-sample content hashes of ``rank``'s recorded ``stage`` batches in its first epoch."""
    events = [e for e in run.events(rank, BATCH) if e.get("stage") == stage and e.get("dl", 0) == 0]
    first = min((e.get("epoch", 0) for e in events), default=0)
    return {h for e in events if e.get("epoch", 0) == first for h in e.get("rows") or []}


def split_difference(run) -> dict | None:
    """The first stage whose split differs by rank while the ranks' data overlaps: ``{"stage",
    "how": "indices" | "content", "splits": {rank: split}, "shared": n, "of": n, "cross": [(val rank,
    train rank, n, of)]}``; None when every rank selects the same samples (or data that never
    overlaps: synthetic random data drawn per rank is no split).

    Two recorded facts make a split: Subsets whose index lists differ by rank over the same data
    ("indices"), or datasets whose data (their digest, which leaves out numeric attributes such as a
    stored rank) differs by rank while user code drew from a global generator outside the steps
    (``ds_global_draw``) and the ranks' batches share samples ("content"). Datasets that differ only
    without such a draw are no split: what else is wrong with them is judged by the batches."""
    train = _splits(run, "train")
    drawn = drawing_line(run) is not None
    for stage, _ in _STAGES:
        splits = _splits(run, stage)
        if not splits:
            continue
        digests = {(s.get("base"), s.get("base_digest")) for s in splits.values()}
        hashes = {s.get("indices_hash") for s in splits.values()}
        if len(digests) == 1 and None not in hashes and len(hashes) > 1:
            found = _by_indices(splits)
        elif len(digests) > 1 and hashes == {None} and drawn:
            found = _by_content(run, stage)
        else:
            continue
        if found is None:
            continue
        found.update(stage=stage, splits=splits)
        found["cross"] = _cross(splits, train) if stage == "val" else _cross(_splits(run, "val"), train)
        return found
    return None


def _by_indices(splits: dict[int, dict]) -> dict | None:
    """Overlap of the ranks' index lists (recorded whole up to the probe's limit)."""
    lists = [set(s["indices"]) for s in splits.values() if s.get("indices") is not None]
    if len(lists) != len(splits):
        return {"how": "indices", "shared": None, "of": splits[0].get("n")}
    shared = set.intersection(*lists)
    return {"how": "indices", "shared": len(shared), "of": len(lists[0])}


def _by_content(run, stage: str) -> dict | None:
    """Overlap of the samples (by content) the ranks' recorded batches held; None without any."""
    rows = [_content_rows(run, r, stage) for r in range(run.world_size)]
    if not all(rows):
        return None
    shared = set.intersection(*rows)
    if not shared:
        return None  # data that differs by rank and never overlaps: drawn per rank, not split
    return {"how": "content", "shared": len(shared), "of": len(rows[0])}


def _cross(val: dict[int, dict], train: dict[int, dict]) -> list[tuple]:
    """(validation rank, training rank, shared, validation size) where one rank's validation
    samples are in another rank's training split (index lists only)."""
    out = []
    for v, vs in sorted(val.items()):
        for t, ts in sorted(train.items()):
            if v == t or vs.get("indices") is None or ts.get("indices") is None:
                continue
            if (vs.get("base"), vs.get("base_digest")) != (ts.get("base"), ts.get("base_digest")):
                continue
            shared = len(set(vs["indices"]) & set(ts["indices"]))
            if shared:
                out.append((v, t, shared, len(vs["indices"])))
    return out


def _never_trained(run) -> str | None:
    """How many samples of the whole dataset are in no rank's training split (index lists only)."""
    train = _splits(run, "train")
    if not train or any(s.get("indices") is None or s.get("whole") is None for s in train.values()):
        return None
    whole = next(iter(train.values()))["whole"]
    used = set().union(*(set(s["indices"]) for s in train.values()))
    val = _splits(run, "val")
    held = set().union(*(set(s.get("indices") or ()) for s in val.values())) if val else set()
    never = [i for i in range(whole) if i not in used and i not in held]
    if not never:
        return None
    return f"{len(never)} of the {whole} samples are in no rank's training or validation split"


def _built_site(run, stage: str) -> dict | None:
    """Where the user's code built ``stage``'s DataLoader (rank 0's first loader event)."""
    event = next((e for e in run.events(0, DS_LOADER) if e.get("stage") == stage), {})
    return (event.get("built") or {}).get("site") or event.get("created_at")


def drawing_line(run) -> dict | None:
    """Where the split was drawn: the first draw user code made from a global generator outside the
    steps (``ds_global_draw``), preferring one in setup or a loader hook; ``{"site", "fn", "call"}``."""
    draws = [e for e in run.events(0, DS_GLOBAL_DRAW) if e.get("site")]
    if not draws:
        return None
    best = next((e for e in draws if "setup" in str(e.get("hook")) or "dataloader" in str(e.get("hook"))), draws[0])
    site = best["site"]
    line = linecache.getline(site.get("file", ""), site.get("line") or 0)
    call = "random_split" if "random_split" in line else best.get("fn")
    return {"site": site, "fn": best.get("fn"), "call": call}


def split_texts(run, found: dict) -> tuple[str, list, str]:
    """(summary, [(detail, rank, site)], fix) for a split that differs by rank."""
    word = dict(_STAGES)[found["stage"]]
    started = {r: next((e.get("seed") for e in run.events(r, SEEDING) if e.get("at") == "start"), None)
               for r in range(run.world_size)}
    seeded = (" (the ranks' generators were seeded per rank: " + ", ".join(f"rank {r}: {s}" for r, s in
                                                                          started.items()) + ")") \
        if len(set(started.values())) > 1 else ""
    drawn = drawing_line(run)
    where = f" by {drawn['call']} at {fmt_site(drawn['site'])}" if drawn else ""
    if found["shared"] is None:
        overlap = f"the ranks' {word} splits differ (their index lists hash differently)"
    elif found["how"] == "indices":
        overlap = f"rank 0's and the other ranks' {word} splits share {found['shared']} of {found['of']} samples"
    else:
        overlap = (f"the ranks' recorded {word} batches share {found['shared']} of rank 0's {found['of']} samples "
                   f"(by content), while their datasets differ")
    cross = "; ".join(f"{n} of rank {v}'s {m} validation samples are in rank {t}'s training split"
                      for v, t, n, m in found["cross"])
    never = _never_trained(run)
    if drawn:
        cause = (f"the split was drawn{where} from the global generator, which gives each rank its own split "
                 f"unless every rank is seeded alike{seeded}")
    else:  # Subsets that differ by rank, chosen without a recorded global draw
        cause = "each rank's Subset selects different samples of the same dataset"
    summary = (f"the {word} data differs by rank: {cause}: {overlap}"
               + (f"; {cross}" if cross else "") + (f"; {never}" if never else "")
               + ". A DistributedSampler shares one dataset out between the ranks; here each rank takes its "
                 "share of a different one, so the world does not train once on one training set.")
    evidence = []
    for r, s in sorted(found["splits"].items()):
        shown = s.get("indices")
        detail = (f"{word} split: {s.get('n')} of {s.get('base')}'s samples, indices starting {shown[:8]}"
                  if shown is not None else f"{word} data: {s.get('base')} digest {s.get('base_digest')}")
        evidence.append((detail, r, None))
    if drawn:
        evidence.append((f"{drawn['fn']} drew from the global generator here, before training", None, drawn["site"]))
    built = _built_site(run, found["stage"])
    if built:
        evidence.append((f"the {word} DataLoader over the split is built here", None, built))
    if not drawn:
        return summary, evidence, ("build the same Subset on every rank (indices that do not depend on the rank, "
                                   "or made once in prepare_data and saved) and leave dividing it between the "
                                   "ranks to the DistributedSampler.")
    fix = ("draw the split with a generator of its own, seeded the same on every rank: random_split(dataset, "
           "lengths, generator=torch.Generator().manual_seed(42)) (a permutation: torch.randperm(n, "
           "generator=...)); or call lightning.seed_everything(seed) in the launch script on every rank before "
           "the datamodule's setup runs; or make the split once in prepare_data and save it.")
    return summary, evidence, fix
