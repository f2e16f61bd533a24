"""data-sharding: every rank trains on its own share of the data, in a fresh order each epoch,
with the same number of batches per epoch.

Seed section "Sampling, metrics and writes": Lightning swaps ordinary map-style samplers for a
DistributedSampler, but an IterableDataset is not sharded for you, a sampler you own
(``use_distributed_sampler=False``) must shard by rank and worker and be reseeded every epoch,
and Lightning must be able to re-create your DataLoader to inject its sampler.

Checked from the traced fit: every train and validation batch is fingerprinted per rank and
epoch (a hash per sample row and per batch, recorded into the trace so that a hung world keeps
them). It fails when ranks draw identical batches, when one rank sees the same samples several
times in an epoch (DataLoader workers replaying a stream), when a user-owned shuffling sampler
gives the same order every epoch, when ranks' DataLoaders differ in length (the next collective
pairs the wrong steps or hangs; a rank that stopped early or hangs is not the data's fault), when
random inputs drawn in training_step are the same on every rank, and when Lightning could not
re-create the DataLoader with its DistributedSampler (the cause and the DataLoader's file:line, not
a raw traceback). Samplers that draw with replacement may repeat samples.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from ...claims import claim
from ...events import HOOK, SEEDING
from ...outcomes import Outcome
from ...sites import first_sentence, fmt_site
from ..base import Blame, Contract, Evidence, Run, Verdict, merged
from ..loader_sites import LOADER_BUILT
from ..rank_reads import RANK_READ, describe, gating_reads, local_rank_reads, selecting_reads
from . import reseed, seeds
from .probe import (
    BATCH,
    DS_CREATED,
    DS_DRAW,
    DS_DRAW_USE,
    DS_INDEX,
    DS_ITEM,
    DS_LOADER,
    DS_PLACE,
    DS_STREAM,
    ROWS_PER_BATCH,
    DataShardingProbe,
)
from .splits import split_difference, split_texts


def _user_frames(tb_text: str) -> list[dict]:
    from ...sites import is_user_file

    frames = []
    for m in re.finditer(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', tb_text or ""):
        if is_user_file(m["file"]):
            frames.append({"file": m["file"], "line": int(m["line"]), "func": m["func"]})
    return frames


def _n_batches(n: int) -> str:
    return f"{n} batch{'' if n == 1 else 'es'}"


def _ranges(ids: list) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    parts, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif isinstance(i, int) and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


def _injection_failures(run: Run) -> list:
    """The ranks whose fit raised inside Lightning's re-creation of the DataLoader, or later in a
    sampler that expected attributes the injected DistributedSampler lacks (empty otherwise)."""
    if run.finished:
        return []
    failed = [r for r in run.job.ranks if r.status == "error" and r.traceback]
    if not failed:
        return []
    tb = failed[0].traceback
    message = failed[0].message or ""
    inside = any(fn in tb for fn in ("_update_dataloader", "_dataloader_init_kwargs_resolve_sampler",
                                     "_get_dataloader_init_args_and_kwargs", "_reinstantiate_wrapped_cls"))
    missing_attr = "DistributedSampler" in message and "has no attribute" in message
    return failed if inside or missing_attr else []


def _missing_attribute(first, stage: str, message: str, frames: list[dict]):
    """(where, cause, fix, evidence) for a sampler reading what the DistributedSampler lacks."""
    where = fmt_site(frames[-1])
    cause = (f"a sampler or batch sampler of the {stage} DataLoader reads an attribute that the "
             f"DistributedSampler Lightning injects does not have ({first.exc_type}: {message})")
    evidence = [Evidence(f"{first.exc_type}: {message}", rank=first.rank, site=where)]
    fix = ("read only what every sampler offers (a DistributedSampler keeps the dataset as .dataset, not "
           ".data_source; use len(sampler) and iteration), or own the sampling: "
           "Trainer(use_distributed_sampler=False) with a batch sampler that shards by rank itself.")
    return where, cause, fix, evidence


def _not_recreatable(first, stage: str, message: str, created: list[dict]) -> tuple[str, str]:
    """(cause, fix) for a DataLoader Lightning could not re-create with its sampler."""
    cause = (f"Lightning could not re-create the {stage} DataLoader with its DistributedSampler "
             f"({first.exc_type}: {message})")
    positional = [c for c in created if (c.get("positional") or 0) >= 4]
    if positional:
        # DataLoader(dataset, batch_size, shuffle, sampler, ...): the sampler is its 4th argument.
        cause += (f"; the DataLoader gets its sampler positionally (its 4th argument, of "
                  f"{positional[0]['positional']} given by position), so the re-created DataLoader would receive "
                  f"it twice")
    fix = ("pass DataLoader arguments by keyword (DataLoader(dataset, batch_size=..., sampler=...)), "
           "and keep a DataLoader subclass's __init__ arguments stored as attributes of the same name; "
           "or own the sampling with Trainer(use_distributed_sampler=False) and a rank-aware sampler.")
    return cause, fix


def _compare_fingerprints(per_rank: dict, world_size: int) -> tuple[int, int, set]:
    """(steps with the same batch on every rank, steps compared, sample hashes of the same ones),
    step by step over rank 0's epochs."""
    same = compared = 0
    samples = set()
    if world_size < 2:
        return 0, 0, samples  # one rank has nobody to repeat
    for epoch in sorted(per_rank[0]):
        lists = [per_rank[r].get(epoch, []) for r in range(world_size)]
        for k in range(min(len(x) for x in lists)):
            fps = [lst[k].get("fp") for lst in lists]
            if None in fps:
                continue
            compared += 1
            if len(set(fps)) == 1:
                same += 1
                samples.update(lists[0][k].get("rows", []))
    return same, compared, samples


def _completed_epochs(run: Run) -> dict[int, set]:
    """rank -> the epochs whose train loop that rank finished: every epoch of a rank that finished,
    else those before the last epoch it recorded and those it reached on_train_epoch_end in."""
    out = {}
    for r in range(run.world_size):
        events = [e for e in run.events(r) if "epoch" in e and not e.get("sanity")]
        seen = {e["epoch"] for e in events}
        if run.job.ranks[r].status == "ok":
            out[r] = seen
            continue
        last = max(seen, default=-1)
        ended = {e["epoch"] for e in events if HOOK.of(e) and str(e.get("name", "")).endswith(
            "on_train_epoch_end")}
        out[r] = {ep for ep in seen if ep < last} | ended
    return out


def _draw_uses(run: Run) -> dict[str, dict]:
    """user file:line -> {"use": "input" | "combined", "op": the op that decided}: how the draws
    made there are used. "input" only when every decided draw of that line, on every rank, reached
    an op with weights alone (the draw is itself the sample, a GAN's latent); one draw combined
    with the rank's data (noise on a VAE's mean, a dropout mask) makes the line "combined"."""
    out: dict = {}
    for r in range(run.world_size):
        sites = {e.get("id"): fmt_site(e["site"]) for e in run.events(r, DS_DRAW) if e.get("site")}
        for e in run.events(r, DS_DRAW_USE):
            where = sites.get(e.get("id"))
            if where is None:
                continue
            known = out.setdefault(where, {"use": e.get("use"), "op": e.get("op")})
            if e.get("use") == "combined":
                known.update(use="combined", op=e.get("op"))
    return out


def _draws_by_site(run: Run) -> dict[str, dict[int, dict[tuple, list]]]:
    """user file:line -> rank -> (epoch, batch_idx) -> value hashes of the draws made there."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in range(run.world_size):
        for e in run.events(r, DS_DRAW):
            if e.get("site") and e.get("key"):
                out[fmt_site(e["site"])][r][tuple(e["key"])].append(e.get("hash"))
    return out


def _index_groups(run: Run, rank: int) -> dict[tuple, list[list]]:
    """(stage, epoch) -> the key groups ``rank``'s fetches received, of the first dataset that
    stage fetched from (a second loader of the stage is not dataloader 0's)."""
    first: dict = {}
    out: dict = defaultdict(list)
    for e in run.events(rank, DS_INDEX):
        stage = e.get("stage")
        if first.setdefault(stage, e.get("ds")) == e.get("ds"):
            out[(stage, e.get("epoch", 0))].append(e.get("keys") or [])
    return out


def _items_into_batches(run: Run, rank: int, out: dict) -> None:
    """Give ``rank``'s batches of an IterableDataset the items its iterators yielded: batch k
    came from worker k % workers, as its (k // workers)-th chunk of batch_size items (the order
    in which a DataLoader hands out the workers' batches)."""
    import hashlib

    per: dict = defaultdict(lambda: defaultdict(list))
    workers: dict = {}
    for e in run.events(rank, DS_ITEM):
        key = (e.get("stage"), e.get("epoch", 0))
        per[key][e.get("w", 0)].append(e.get("h"))
        workers[key] = max(1, int(e.get("nw") or 1))
    sizes = {e.get("stage"): e.get("batch_size") or 1 for e in run.events(rank, DS_LOADER)}
    for (stage, epoch), by_worker in per.items():
        nw, bs = workers[(stage, epoch)], sizes.get(stage, 1)
        for k, event in enumerate(out.get(stage, {}).get(rank, {}).get(epoch, [])):
            chunk = by_worker.get(k % nw, [])[(k // nw) * bs:(k // nw + 1) * bs]
            if chunk:
                event.update(n=len(chunk), rows=chunk[:ROWS_PER_BATCH], src="item",
                             fp=hashlib.blake2b(repr(chunk).encode(), digest_size=8).hexdigest())
                event.pop("ids", None)  # integers in an item are not its identity


def _from_keys(keys: list) -> dict:
    """The fields of a batch event whose samples are the dataset keys ``keys``."""
    import hashlib

    out = {"n": len(keys), "rows": [str(k) for k in keys[:ROWS_PER_BATCH]], "src": "index",
           "fp": hashlib.blake2b(repr(keys).encode(), digest_size=8).hexdigest()}
    if all(isinstance(k, int) for k in keys):
        out["ids"] = keys[:ROWS_PER_BATCH]
    return out


_STEP_OF = {"train": ("training_step",), "val": ("validation_step",)}


def _split_note(stage: str, read: dict) -> str:
    """The note of a stage whose identical batches are split by rank inside the step."""
    return (f"every rank draws the same {stage} batches by design: {describe(read)}, so the split between ranks "
            f"happens inside the step, which this check does not see (it fingerprints the DataLoader's batches, "
            f"not the rows each rank then keeps).")


def _gate_evidence(read: dict, reads: list[list[dict]]) -> Evidence:
    """A rank read that only decides what runs, on the ranks that made it (None: all)."""
    ranks = [r for r, events in enumerate(reads)
             if any(e.get("site") == read.get("site") and e.get("hook") == read.get("hook") for e in events)]
    return Evidence(f"{describe(read, where=False)}, so it does not split the batch",
                    rank=ranks[0] if len(ranks) == 1 else None,
                    site=None if read.get("site") else fmt_site(None), frame=read.get("site"))


def _counted_as(events: list[dict], loader: dict | None) -> tuple[str, str]:
    """What a batch's count is, as (unit of the distinct count, template of the sizes): the
    dataset keys its fetches received are samples; an iterable dataset's items are what it yields
    (with batch_size=None each is a ready-made batch); tensor rows are not samples."""
    srcs = {e.get("src") for e in events}
    if srcs == {"index"}:
        return "samples", "of sizes {}"
    if srcs == {"item"}:
        whole = loader is not None and "batch_size" in loader and loader.get("batch_size") is None
        return "dataset items", ("of {} dataset items (each a ready-made batch the dataset yields: batch_size=None)"
                                 if whole else "of {} dataset items")
    where = f" in {loader['type']}" if loader and loader.get("type") else ""
    return f"tensor rows (dataset items cannot be counted{where})", "of {} tensor rows (not samples)"


def _returned_site(run: Run, hook: str) -> dict | None:
    """Where the loader ``hook`` returned was constructed (a loader built before the hooks ran,
    in the target factory or ``setup``), from the ranks' ``loader_built`` events."""
    for r in range(run.world_size):
        for e in run.events(r, LOADER_BUILT):
            if e.get("hook") == hook and e.get("loaders") and e["loaders"][0].get("site"):
                return e["loaders"][0]["site"]
    return None


def _not_torch_loader(loader: dict | None) -> bool:
    """The stage's loader is not a torch DataLoader (a package's own loader class)."""
    built = (loader or {}).get("built") or {}
    return bool(loader) and "dataset" not in loader and built.get("torch_loader") is False


def _batch_fp(train: dict, rank: int, key: tuple) -> str | None:
    """The fingerprint of ``rank``'s train batch ``key`` = (epoch, batch_idx), if recorded."""
    epoch, idx = key
    return next((e.get("fp") for e in train.get(rank, {}).get(epoch, []) if e.get("idx") == idx), None)


class DataSharding(Contract):
    id = "data-sharding"
    title = "Each rank trains on its own share of the data, reshuffled every epoch"
    rule_section = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp", "deepspeed")
    tiers = ("cpu", "nodes", "gpu", "multinode")  # nodes: ranks laid out as nodes on this host
    probe_class = DataShardingProbe

    def blames(self, run: Run) -> int | None:
        """The ranks ran different hooks first because their own dataloaders give them different
        numbers of batches; hooks that differ because a rank stopped or hangs are not claimed. A fit
        that Lightning's sampler injection stopped (a DataLoader it cannot re-create) is this
        contract's failure on every strategy, not the user's code stopping nor a sharded tier's."""
        if _injection_failures(run):
            return Blame.RAISED
        if run.divergence_kind() == "hooks" and self._uneven_counts(run, self._batches(run), self._loaders(run)):
            return Blame.DATA
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        recreate = self._recreate_failure(run)
        if recreate is not None:
            return recreate
        batches = self._batches(run)
        loaders = self._loaders(run)
        findings: list[Verdict] = []
        split: dict[str, dict] = {}
        findings += self._split_by_rank(run)
        findings += self._identical_across_ranks(run, batches, loaders, split)
        if not findings:
            findings += self._overlapping_across_ranks(run, batches, loaders, split)
        findings += self._replayed_within_rank(run, batches, loaders)
        findings += self._uneven_counts(run, batches, loaders)
        findings += self._same_order_every_epoch(run, batches, loaders)
        findings += self._identical_noise(run, batches)
        at_size, sized = self._at_production(run, loaders)
        findings += sized
        if at_size and findings:
            findings[0].notes.append(at_size)
        if findings:
            first = merged(findings, [_split_note(stage, read) for stage, read in split.items()])
            if not run.finished:
                first.notes.append("the world did not finish; the batches each rank recorded up to then are "
                                   "the evidence (the item's report says where each rank was).")
            return first
        unread = self._unreadable(run, batches, loaders)
        if unread is not None:
            return unread
        verdict = self._passed(run, batches, loaders, split)
        if at_size:
            verdict.notes.append(at_size)
        return verdict

    def _at_production(self, run: Run, loaders: dict) -> tuple[str | None, list[Verdict]]:
        """The training split at the config's production size (rank 0 computed every rank's
        indices from its sampler): a note, and a failure for a class no rank reads there, with the
        user's line that built the training DataLoader (its drop_last and batch size)."""
        from ..production import sentences

        plan = next((d.get("production") for d in run.probe(self.id) if d and d.get("production")), None)
        note, found = sentences(plan, "train")
        train = loaders.get("train") or {}
        site = (train.get("built") or {}).get("site") or train.get("created_at")
        built_at = fmt_site(site) if site else None
        evidence = [Evidence("the training DataLoader (its drop_last and batch size) is built here",
                             site=built_at)] if built_at else []
        verdicts = [self.verdict(Outcome.FAILED, f"{text}.", category="silent", evidence=evidence,
                                 fix="use drop_last=False on the training DataLoader (Lightning's sampler pads "
                                     "the last round instead), or a batch size that divides each rank's share")
                    for text in found]
        return note, verdicts

    def _unreadable(self, run: Run, batches, loaders) -> Verdict | None:
        """Not judged when train batches ran but no rank's samples could be told apart: no dataset
        key was read at the source and no batch had a tensor to fingerprint."""
        train = batches.get("train", {})
        events = [e for r in train.values() for ep in r.values() for e in ep]
        if not events or any(e.get("fp") for e in events):
            return None
        loader = loaders.get("train") or {}
        what = f"{loader.get('type') or 'the train loader'} over {self._what(loader)}"
        return self.not_judged(f"cannot tell samples apart in {what}: its fetches hand the "
                                       f"dataset no keys this check can read and its batches hold no tensors, "
                                       f"so nothing was compared across ranks.")

    # -- data ----------------------------------------------------------------------------------
    @staticmethod
    def _batches(run: Run) -> dict[str, dict[int, dict[int, list[dict]]]]:
        """stage -> rank -> epoch -> batch events (dataloader 0), in order. Where the rank recorded
        the dataset keys of its fetches, a batch's samples are those keys (``src`` "index"), not
        rows of its tensors: a collated graph's atoms or a loader's positions are not samples."""
        out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        for r in range(run.world_size):
            for e in run.events(r, BATCH):
                if e.get("dl", 0) == 0:
                    out[e["stage"]][r][e.get("epoch", 0)].append(dict(e))
            for (stage, epoch), groups in _index_groups(run, r).items():
                for event, keys in zip(out.get(stage, {}).get(r, {}).get(epoch, []), groups):
                    event.update(_from_keys(keys))
            _items_into_batches(run, r, out)
        return out

    @staticmethod
    def _loaders(run: Run) -> dict[str, dict]:
        """stage -> the first loader event of rank 0 (or any rank)."""
        out = {}
        for r in range(run.world_size):
            for e in run.events(r, DS_LOADER):
                out.setdefault(e["stage"], e)
        return out

    @staticmethod
    def _what(loader: dict | None) -> str:
        if _not_torch_loader(loader):
            return f"{loader['type']} (not a torch DataLoader)"
        if not loader or not loader.get("dataset"):
            return "the DataLoader"
        kind = "IterableDataset" if loader.get("iterable") else "dataset"
        return f"{kind} {loader['dataset']}"

    @staticmethod
    def _dataset_site(loader: dict | None) -> str | None:
        if not loader:
            return None
        site = (loader.get("built") or {}).get("site") or loader.get("created_at") or loader.get("dataset_site")
        return fmt_site(site) if site else None

    def _fix_for(self, loader: dict | None) -> str:
        if _not_torch_loader(loader):
            site = self._dataset_site(loader)
            return (f"{loader['type']}{f' (built at {site})' if site else ''} is not a torch DataLoader, so "
                    f"Lightning injects no DistributedSampler into it: split the samples by rank inside "
                    f"{loader['type']} (each rank takes indices rank, rank + world_size, ... from "
                    f"torch.distributed, reshuffled per epoch), or return a torch DataLoader over the same dataset "
                    f"from the hook so that Lightning shards it.")
        if loader and loader.get("iterable"):
            return (f"shard the stream inside {loader.get('dataset')}.__iter__: keep item i only when "
                    f"i % (world_size * num_workers) == rank * num_workers + worker_id (rank and world size "
                    f"from torch.distributed, worker_id and num_workers from torch.utils.data.get_worker_info()), "
                    f"or use a map-style Dataset so that Lightning injects a DistributedSampler.")
        if loader and not loader.get("use_distributed_sampler", True):
            return ("with use_distributed_sampler=False the sampler is yours: give it the rank and world size "
                    "(e.g. DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank)) "
                    "or drop use_distributed_sampler=False so that Lightning injects one.")
        return "make each rank draw a disjoint share of the samples (a DistributedSampler or rank-aware sampler)."

    # -- 1. DataLoader Lightning cannot re-create ------------------------------------------------
    def _recreate_failure(self, run: Run) -> Verdict | None:
        failed = _injection_failures(run)
        if not failed:
            return None
        tb = failed[0].traceback
        message = first_sentence(failed[0].message) or "no message"
        m = re.search(r"(train|val|test|predict)_dataloader", tb)
        stage = m.group(1) if m else "train"
        created = [e for e in self._creation_events(run) if (e.get("hook") or "").endswith(f"{stage}_dataloader")] \
            or self._creation_events(run)
        built = created[0]["site"] if created else _returned_site(run, f"{stage}_dataloader")
        built_at = fmt_site(built) if built else None
        frames = _user_frames(tb)
        if "has no attribute" in (failed[0].message or "") and frames:
            where, cause, fix, evidence = _missing_attribute(failed[0], stage, message, frames)
        else:
            where = built_at or (fmt_site(frames[-1]) if frames else None)
            cause, fix = _not_recreatable(failed[0], stage, message, created)
            evidence = []
        for r in failed:
            evidence.append(Evidence(f"fit raised {r.exc_type} inside Lightning's sampler injection "
                                     f"({stage}_dataloader), before the first {stage} batch", rank=r.rank))
        if built_at:
            evidence.append(Evidence(f"the {stage} DataLoader is built here", site=built_at))
        ranks = "every rank" if len(failed) == run.world_size else f"rank(s) {[r.rank for r in failed]}"
        summary = f"{cause}. Fit fails on {ranks} at {where or 'the DataLoader construction'}."
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix)

    def _creation_events(self, run: Run) -> list[dict]:
        return [e for r in range(run.world_size) for e in run.events(r, DS_CREATED)][:4]

    # -- 2. a split drawn per rank ---------------------------------------------------------------
    def _split_by_rank(self, run: Run) -> list[Verdict]:
        """The train or validation data differs by rank (a split drawn from the global generator
        under per-rank seeds) while the ranks' data overlaps: see :mod:`.splits`."""
        found = split_difference(run)
        if found is None:
            return []
        summary, evidence, fix = split_texts(run, found)
        return [self.verdict(Outcome.FAILED, summary, fix=fix, category="silent",
                             evidence=[Evidence(d, rank=r, site=fmt_site(s) if s else None) for d, r, s in evidence])]

    # -- 2. identical data on every rank ---------------------------------------------------------
    def _identical_across_ranks(self, run, batches, loaders, split: dict) -> list[Verdict]:
        """Stages whose batches are the same on every rank; a stage whose step selects its rows by
        rank on every rank (``split``: stage -> rank 0's read) is split inside the step instead."""
        out = []
        reads = [run.events(r, RANK_READ) for r in range(run.world_size)]
        # Training only: validation batches repeated on every rank are duplicated evaluation,
        # judged by eval-duplication against the single-device values (often harmless: a set
        # smaller than the world is evaluated whole on every rank on purpose).
        for stage in ("train",):
            per_rank = batches.get(stage, {})
            if len(per_rank) < run.world_size:
                continue
            same, compared, samples = _compare_fingerprints(per_rank, run.world_size)
            if compared and same == compared:
                selecting = selecting_reads(reads, _STEP_OF[stage])
                if selecting:
                    split[stage] = selecting[0]
                    continue
                verdict = self._identical(run, stage, per_rank, loaders.get(stage), same, compared, samples)
                gates = gating_reads(reads, _STEP_OF[stage])[:2]
                if gates:
                    verdict.evidence += [_gate_evidence(read, reads) for read in gates]
                    verdict.fix += (f" If every rank is meant to get the same batches, select this rank's rows "
                                    f"inside {gates[0].get('hook')} (e.g. rows[self.global_rank::world_size]).")
                out.append(verdict)
        return out

    def _identical(self, run, stage, per_rank, loader, same, compared, samples) -> Verdict:
        """Every rank drew the same batches of ``stage``: which, and why the loader is not sharded."""
        steps = {r: {ep: len(v) for ep, v in per_rank[r].items()} for r in range(run.world_size)}
        first_ep = min(per_rank[0])
        firsts = {r: per_rank[r].get(first_ep, [])[:4] for r in range(run.world_size)}
        ranks = " and ".join(f"rank {r}" for r in range(run.world_size))
        every = "in every step" if same == compared else f"in {same} of {compared} steps"
        ids = [i for e in per_rank[0][first_ep] for i in e.get("ids", [])]
        id_text = f"; sample ids {_ranges(ids)} in the same order on every rank" if ids else ""
        srcs = {e.get("src") for e in per_rank[0][first_ep]}
        how = {"index": "batches compared by the dataset indices they fetched",
               "item": "batches compared by the items the dataset's iterator yielded"}.get(
            srcs.pop() if len(srcs) == 1 else None, "fingerprinted batches")
        unit, sizes = _counted_as(per_rank[0][first_ep], loader)
        summary = (f"{ranks} drew identical {stage} batches {every} ({compared} {how}, "
                   f"{len(samples)} distinct {unit}{id_text}), so the world trains on one rank's data "
                   f"{run.world_size} times; {self._what(loader)} is not sharded by rank.")
        evidence = [Evidence(f"{stage} epoch {first_ep}: {_n_batches(steps[r].get(first_ep, 0))} "
                             + sizes.format([e.get('n') for e in per_rank[r].get(first_ep, [])]) + ", batch hashes "
                             f"{[(e.get('fp') or 'none')[:8] for e in firsts[r]]}"
                             + (f", sample ids {[e.get('ids') for e in firsts[r]]}" if ids else ""), rank=r)
                    for r in range(run.world_size)]
        evidence += self._loader_evidence(run, stage, loader, steps[0][first_ep])
        fix = self._fix_for(loader)
        shared_seed = seeds.collision(run)
        fed_seed = seeds.seed_lines(shared_seed)
        local_reads = [read for read in local_rank_reads([run.events(r, RANK_READ) for r in range(run.world_size)])
                       if ((read.get("site") or {}).get("file"), (read.get("site") or {}).get("line")) not in fed_seed]
        # A split by the local rank rests on a read of it while the data is built that did not feed a seed:
        # without one, ranks on different nodes are identical because nothing splits the data.
        across = _same_local_rank_on_nodes(run, local_reads) if local_reads else None
        claims = [across] if across else []
        if across:
            summary += f" {across.text}"
            evidence += [Evidence(f"{read['what']} is read in {read['hook']} while the data is built; it repeats on "
                                  f"every node", frame=read.get("site"))
                         for read in local_reads[:2]]
            fix = ("shard by the global rank (self.trainer.global_rank of self.trainer.world_size shards), or let "
                   "Lightning's DistributedSampler split a map-style dataset; keep local_rank for picking the local "
                   "device only. " + fix)
        if shared_seed:
            said = seeds.sentence(shared_seed)
            summary += f" {said.text}"
            evidence += seeds.evidence(shared_seed)
            claims.append(said)
            fix = f"{seeds.FIX} Where the data is not drawn from those generators: {fix}"
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="silent", claims=claims)

    def _loader_evidence(self, run, stage, loader, have: int) -> list[Evidence]:
        """For a stream: the items every rank yields against the steps a sharded stream would give."""
        stream = self._stream_len(run, stage)
        if loader and loader.get("iterable") and stream and loader.get("batch_size"):
            size = loader["batch_size"]
            full, want = math.ceil(stream / size), math.ceil(stream / (size * run.world_size))
            # The run's own step count is bounded by its limit on batches per epoch, so it is said
            # apart from the stream's length (computed from the recorded item count).
            capped = f", fewer than {full} because the run limits the batches of an epoch" if have < full else ""
            evidence = [Evidence(
                f"{self._what(loader)} yields all {stream} items on each rank: {full} batches of {size} per rank "
                f"per epoch, where a split by rank gives {stream} items / ({size} per batch x {run.world_size} "
                f"ranks) = {want}; this run took {have} steps per rank per epoch{capped}",
                site=self._dataset_site(loader))]
            if loader.get("dataset_site"):
                evidence.append(Evidence(f"{loader['dataset']} is defined here; its __iter__ yields the "
                                         f"same items on every rank" if not loader.get("num_workers")
                                         else f"{loader['dataset']} is defined here",
                                         site=fmt_site(loader["dataset_site"])))
            return evidence
        if _not_torch_loader(loader):
            return [Evidence(f"the {stage} {loader['type']} is built here; it is not a torch DataLoader, so Lightning "
                             f"injects no DistributedSampler into it", site=self._dataset_site(loader))]
        if loader:
            return [Evidence(f"{self._what(loader)}, sampler {loader.get('sampler')}, "
                             f"use_distributed_sampler={loader.get('use_distributed_sampler')}",
                             site=self._dataset_site(loader))]
        return []

    @staticmethod
    def _stream_len(run: Run, stage: str) -> int | None:
        for data in run.probe("data-sharding"):
            if data and data.get("stream_len", {}).get(stage):
                return data["stream_len"][stage]
        return None

    def _overlapping_across_ranks(self, run, batches, loaders, split: dict) -> list[Verdict]:
        """Ranks that read some of the same train samples in one epoch, beyond what a padding
        DistributedSampler repeats (world size - 1): the loader does not split the dataset between
        the ranks. Under per-rank seeds an unsharded shuffling sampler gives each rank its own order
        over the whole dataset, so the batches differ yet overlap. Samples are the dataset keys the
        fetches received (never tensor rows, nor items compared by content: equal rows are not one sample)."""
        loader = loaders.get("train") or {}
        per_rank = batches.get("train", {})
        if "train" in split or loader.get("replacement") or len(per_rank) < run.world_size:
            return []
        done = _completed_epochs(run)
        for epoch in sorted(set.intersection(*(set(per_rank[r]) for r in range(run.world_size)))):
            if not all(epoch in done[r] for r in range(run.world_size)):
                continue
            events = [per_rank[r][epoch] for r in range(run.world_size)]
            if any({e.get("src") for e in evs} != {"index"} for evs in events):
                continue
            seen = [{k for e in evs for k in e.get("rows") or []} for evs in events]
            shared = set.intersection(*seen) if run.world_size == 2 else \
                {k for k in set().union(*seen) if sum(k in s for s in seen) > 1}
            if len(shared) > run.world_size - 1:
                return [self._overlap(run, epoch, events, seen, shared, loader)]
        return []

    def _overlap(self, run, epoch: int, events: list, seen: list, shared: set, loader: dict) -> Verdict:
        unit, _ = _counted_as(events[0], loader)
        how = "by the dataset indices they fetched"
        ranks = " and ".join(f"rank {r}" for r in range(run.world_size))
        summary = (f"{ranks} read {len(shared)} of the same train {unit} in epoch {epoch} ({how}; "
                   + ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(seen)) + " distinct): "
                   f"{self._what(loader)} is not split between the ranks, so the world trains on some samples "
                   f"several times per epoch and on others not at all (a DistributedSampler gives each rank a "
                   f"disjoint share).")
        evidence = []
        for r, evs in enumerate(events):
            ids = sorted({i for e in evs for i in e.get("ids") or []})
            named = f"sample ids {_ranges(ids[:32])}" if ids else f"{len(seen[r])} {unit}"
            evidence.append(Evidence(f"train epoch {epoch}: {_n_batches(len(evs))}, {named}; {len(shared & seen[r])} "
                                     f"of them also read by another rank", rank=r))
        evidence += self._loader_evidence(run, "train", loader, len(events[0]))
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=self._fix_for(loader), category="silent")

    # -- 3. the same samples several times on one rank -------------------------------------------
    def _replayed_within_rank(self, run, batches, loaders) -> list[Verdict]:
        """The first epoch in which a rank sees a quarter or more of its own train rows again, with
        every rank that shows it in that epoch (a stream each DataLoader worker replays does so on
        every rank)."""
        if (loaders.get("train") or {}).get("replacement"):
            return []  # sampling with replacement repeats samples by design
        per_epoch: dict = defaultdict(dict)  # epoch -> rank -> (repeats, rows, distinct)
        for r, epochs in sorted(batches.get("train", {}).items()):
            for epoch, events in sorted(epochs.items()):
                rows = [h for e in events for h in e.get("rows", [])]
                repeats = len(rows) - len(set(rows))
                if len(rows) >= 2 and repeats * 4 >= len(rows):  # a quarter or more of the rows seen before
                    per_epoch[epoch][r] = (repeats, len(rows), len(set(rows)), events)
        if not per_epoch:
            return []
        epoch = min(per_epoch)
        found = per_epoch[epoch]
        loader = loaders.get("train") or {}
        workers = loader.get("num_workers", 0)
        why = (f" (DataLoader num_workers={workers}: each worker replays the stream)"
               if workers and loader.get("iterable") else "")
        unit = _counted_as(next(iter(found.values()))[3], loader)[0]
        ranks = sorted(found)
        who = claim("ranks", _rank_list(ranks, run.world_size), ranks=ranks, world_size=run.world_size)
        counts = ", ".join(f"rank {r}: {found[r][0]} of {found[r][1]}" for r in ranks)
        if len(ranks) == 1:
            r = ranks[0]
            what = f"{who.text} saw {found[r][0]} of its {found[r][1]} train {unit} more than once in epoch {epoch}"
        else:
            what = f"{who.text} saw its own train {unit} more than once in epoch {epoch} ({counts})"
        summary = f"{what}{why}; {self._what(loader)} does not split the work between workers/ranks."
        evidence = [Evidence(f"epoch {epoch}: {found[r][1]} {unit}, {found[r][2]} distinct", rank=r,
                             site=self._dataset_site(loader)) for r in ranks]
        return [self.verdict(Outcome.FAILED, summary, category="silent", fix=self._fix_for(loader), evidence=evidence,
                             claims=[who])]

    # -- 4. different numbers of batches ---------------------------------------------------------
    def _uneven_counts(self, run, batches, loaders) -> list[Verdict]:
        """Ranks whose train DataLoaders differ in length (len() per rank, or the counted stream),
        or, without either, differ in the batches they ran over epochs every rank completed. A
        rank that stopped early or hangs in a collective is not a data fault."""
        streams = self._stream_batches(run)
        if len(set(streams.values())) > 1:
            return [self._uneven(run, loaders, 0, streams, "stream")]
        for epoch in sorted({e.get("epoch", 0) for r in range(run.world_size) for e in run.events(r, DS_LOADER)}):
            lengths = self._lengths(run, epoch)
            if len(set(lengths.values())) > 1:
                return [self._uneven(run, loaders, epoch, lengths, "len")]
        per_rank = batches.get("train", {})
        done = _completed_epochs(run)
        for epoch in sorted({ep for r in per_rank for ep in per_rank[r]}):
            if not all(epoch in done[r] for r in range(run.world_size)):
                continue  # a rank still running, stuck or dead in this epoch may only be behind
            counts = {r: len(per_rank.get(r, {}).get(epoch, [])) for r in range(run.world_size)}
            if len(set(counts.values())) > 1 and not streams and not self._lengths(run, epoch):
                return [self._uneven(run, loaders, epoch, counts, "ran")]
        return []

    @staticmethod
    def _stream_batches(run: Run) -> dict[int, int]:
        """rank -> batches per epoch of a train IterableDataset, from the items counted on each
        rank before training; {} unless every rank has one."""
        streams = {}
        for r in range(run.world_size):
            n = next((e.get("n") for e in run.events(r, DS_STREAM) if e.get("stage") == "train"), None)
            loader = next(iter(run.events(r, DS_LOADER)), {})
            if n is not None and loader.get("batch_size"):
                bs = loader["batch_size"]
                streams[r] = n // bs if loader.get("drop_last") else math.ceil(n / bs)
        return streams if len(streams) == run.world_size else {}

    @staticmethod
    def _lengths(run: Run, epoch: int) -> dict[int, int]:
        """rank -> len(train DataLoader) recorded at the start of ``epoch``; {} unless every rank has one."""
        out = {}
        for r in range(run.world_size):
            for e in run.events(r, DS_LOADER):
                if e.get("stage") == "train" and e.get("epoch", 0) == epoch and e.get("length") is not None:
                    out[r] = e["length"]
        return out if len(out) == run.world_size else {}

    def _uneven(self, run, loaders, epoch: int, counts: dict, how: str) -> Verdict:
        loader = loaders.get("train") or {}
        text = ", ".join(f"rank {r}: {_n_batches(c)}" for r, c in counts.items())
        measured = {"ran": f"ranks ran different numbers of train batches in epoch {epoch} ({text})",
                    "len": f"len(train DataLoader) differs across ranks in epoch {epoch} ({text})",
                    "stream": f"the train IterableDataset yields a different number of batches on each rank "
                              f"({text}: the items each rank's stream yields, divided by the batch size)"}[how]
        capped = (" The conformance run caps an epoch at 4 batches, which hides the difference in the run "
                  "itself; production runs every batch." if how != "ran" and min(counts.values()) >= 4 else "")
        summary = (f"{measured}; each training step all-reduces gradients, so the extra step pairs "
                   f"with another rank's next collective or waits forever. {self._what(loader)} gives the "
                   f"ranks unequal shares.{capped}")
        site = self._dataset_site(loader)
        evidence = [Evidence(f"epoch {epoch}: {_n_batches(c)}" + (" per epoch" if how != "ran" else ""),
                             rank=r, site=site) for r, c in counts.items()]
        fix = ("give every rank the same number of batches: drop or pad the remainder "
               "(DistributedSampler(drop_last=True), or stop an IterableDataset on every rank after the "
               "smallest rank's item count), or let Lightning inject its sampler.")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="deadlock")

    # -- 5. an order drawn at random that repeats every epoch (see .reseed) ------------------------
    def _same_order_every_epoch(self, run, batches, loaders) -> list[Verdict]:
        found = reseed.verdict(self, run, batches.get("train", {}), loaders.get("train") or {})
        return [found] if found is not None else []

    # -- 6. random inputs drawn identically on every rank -----------------------------------------
    def _identical_noise(self, run, batches) -> list[Verdict]:
        """A user line in training_step whose torch random draws are the same on every rank at
        every recorded step (two or more) while the ranks' batches differ."""
        ws = run.world_size
        train = batches.get("train", {})
        uses = _draw_uses(run)
        for where, per_rank in _draws_by_site(run).items():
            if len(per_rank) < ws or uses.get(where, {}).get("use") != "input":
                continue  # noise combined with each rank's own data, or never fed on: not a sample
            steps = sorted(set.intersection(*(set(per_rank[r]) for r in range(ws))))
            if len(steps) < 2 or any(len({tuple(per_rank[r][k]) for r in range(ws)}) > 1 for k in steps):
                continue
            batch_fps = [{_batch_fp(train, r, k) for r in range(ws)} for k in steps]
            if any(len(fps) == 1 and None not in fps for fps in batch_fps) \
                    or not any(len(fps) == ws and None not in fps for fps in batch_fps):
                continue  # identical batches are judged as such; unknown batches prove nothing
            return [self._noise(run, where, steps, train)]
        return []

    def _noise(self, run, where: str, steps: list, train) -> Verdict:
        first = {r: next(e for e in run.events(r, DS_DRAW) if fmt_site(e["site"]) == where)
                 for r in range(run.world_size)}
        fn, shape = first[0]["fn"], first[0]["shape"]
        op = _draw_uses(run).get(where, {}).get("op")
        summary = (f"{fn} at {where} in training_step draws the same values on every rank at every recorded step "
                   f"({len(steps)} steps compared, identical {shape} tensors on ranks "
                   f"{', '.join(str(r) for r in range(run.world_size))}) while the ranks' batches differ, and the "
                   f"draw is itself the model's input (it reaches {op} with only weights, no data of the rank): every "
                   f"rank's global RNG starts from the same seed and is consumed the same way, so the world repeats "
                   f"one rank's random input {run.world_size} times and more ranks add no new random samples.")
        evidence = []
        for r in range(run.world_size):
            hashes = [e["hash"][:8] for e in run.events(r, DS_DRAW) if fmt_site(e["site"]) == where][:4]
            batch = [(_batch_fp(train, r, k) or "none")[:8] for k in steps[:4]]
            evidence.append(Evidence(f"{fn} value hashes {hashes} at steps {[tuple(k) for k in steps[:4]]} "
                                     f"(epoch, batch); batch hashes {batch}", rank=r, site=where))
        fix = ("draw the noise per rank: create a generator in setup(), e.g. self.noise = torch.Generator("
               "device=self.device).manual_seed(seed + self.global_rank), and pass generator=self.noise (for "
               "randn_like/rand_like: torch.randn(x.shape, generator=self.noise, device=x.device, dtype=x.dtype)); "
               "or reseed once with a rank offset, torch.manual_seed(seed + self.global_rank), in setup() after "
               "the model is built (DDP broadcasts the initial weights, so they stay identical).")
        shared_seed, claims = seeds.collision(run), []
        if shared_seed:
            said = seeds.sentence(shared_seed)
            summary, fix = f"{summary} {said.text}", f"{seeds.FIX} Or {fix}"
            evidence += seeds.evidence(shared_seed)
            claims.append(said)
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="silent", claims=claims)

    # -- passed ----------------------------------------------------------------------------------
    def _passed(self, run: Run, batches, loaders, split: dict) -> Verdict:
        parts, claims = [], []
        for stage in ("train", "val"):
            per_rank = batches.get(stage, {})
            if not per_rank:
                continue
            totals = {r: sum(len(v) for v in per_rank[r].values()) for r in sorted(per_rank)}
            counts = f"every rank ran {next(iter(totals.values()))}" if len(set(totals.values())) == 1 else \
                ", ".join(f"rank {r}: {n}" for r, n in totals.items())
            if stage in split:
                parts.append(f"{stage} batches are the same on every rank ({counts} batches) and "
                             f"{split[stage].get('hook')} selects each rank's rows by rank")
                continue
            same, compared, _ = _compare_fingerprints(per_rank, run.world_size) if len(per_rank) == run.world_size \
                else (0, 0, set())
            srcs = {e.get("src") for r in per_rank.values() for ep in r.values() for e in ep}
            how = {"index": "by the dataset indices they fetched", "item": "by the items the dataset yielded"}.get(
                srcs.pop() if len(srcs) == 1 else None, "by their content")
            if compared and same == compared:  # validation only: identical train batches fail above
                parts.append(f"{stage} batches are the same on every rank in all {compared} steps compared {how} "
                             f"(eval-duplication judges what that does to the published values); {counts} {stage} "
                             f"batches")
                continue
            if not compared:
                parts.append(f"{stage} batches were not compared across ranks; {counts} {stage} batches")
                continue
            parts.append(f"{stage} batches hold different samples on each rank in {compared - same} of {compared} "
                         f"steps compared {how}; {counts} {stage} batches")
            claims.append(claim("batches-differ", parts[-1], differed=compared - same, compared=compared,
                                counts={f"rank {r}": n for r, n in totals.items()}))
        loader = loaders.get("train")
        what = f" ({self._what(loader)}, sampler {loader.get('sampler')})" if loader else ""
        summary = ("; ".join(parts) or "no batches were recorded") + \
            f"{what}; the same number of train batches per epoch on every rank."
        fixed = reseed.fixed_order_note(run, batches.get("train", {}), loader or {})
        shared_seed = seeds.collision(run)
        if shared_seed:
            said = seeds.sentence(shared_seed)
            claims.append(said)
        notes = [_split_note(stage, read) for stage, read in split.items()] + _combined_noise_notes(run) + \
            ([fixed] if fixed else []) + _same_split_notes(run) + \
            ([f"{said.text} No identical batches or random inputs were seen here, but every draw from those generators "
              f"repeats across nodes; {seeds.FIX}"] if shared_seed else [])
        return self.verdict(Outcome.PASSED, summary, notes=notes, empty=not parts, claims=claims)


def _same_split_notes(run: Run) -> list[str]:
    """Under per-rank seeds, what showed that every rank's loaders select the same samples (a Subset
    with the same indices on every rank), so that a pass says what it compared."""
    from .splits import _splits

    seeds = {next((e.get("seed") for e in run.events(r, SEEDING) if e.get("at") == "start"), None)
             for r in range(run.world_size)}
    if len(seeds) < 2:
        return []
    notes = []
    for stage, word in (("train", "training"), ("val", "validation")):
        splits = _splits(run, stage)
        first = next(iter(splits.values()), {}) if splits else {}
        if first.get("indices_hash") and len({s.get("indices_hash") for s in splits.values()}) == 1:
            notes.append(f"the {word} loader's {first.get('base')} subset ({first.get('n')} samples) is the same on "
                         f"every rank although each rank's generators were seeded with its own seed until training "
                         f"started: the split does not depend on how the launch script seeds the ranks.")
    return notes


def _combined_noise_notes(run: Run) -> list[str]:
    """One note per user line whose draws are the same on every rank but meet each rank's own
    data: said, so that a pass does not hide what was seen."""
    notes = []
    for where, use in _draw_uses(run).items():
        per_rank = _draws_by_site(run).get(where, {})
        if use.get("use") != "combined" or len(per_rank) < run.world_size:
            continue
        steps = set.intersection(*(set(per_rank[r]) for r in range(run.world_size)))
        if steps and all(len({tuple(per_rank[r][k]) for r in range(run.world_size)}) == 1 for k in steps):
            notes.append(f"the random draws at {where} are the same on every rank, but each meets the rank's own "
                         f"data (in {use.get('op')}): noise on each rank's samples, not a sample of its own.")
    return notes


def _same_local_rank_on_nodes(run: Run, reads: list[dict]):
    """The claim for identical ranks that sit on different nodes with the same local rank, the data
    built after ``reads`` of the local rank (a split by the local rank, which repeats on every
    node); None otherwise or on one node."""
    places = [next(iter(run.events(r, DS_PLACE)), None) for r in range(run.world_size)]
    if not all(places) or len({p["node"] for p in places}) < 2 or len({p["local_rank"] for p in places}) != 1:
        return None
    who = " and ".join(f"global rank {r} (node {p['node']})" for r, p in enumerate(places))
    text = (f"They sit on different nodes with the same local rank ({who}, local rank {places[0]['local_rank']} on "
            f"each): the data is split by the local rank, which repeats on every node, so every node reads the same "
            f"shard and the others are never read.")
    return claim("local-split", text, reads=[fmt_site(read.get("site")) for read in reads],
                 places={str(r): p for r, p in enumerate(places)})


def _rank_list(ranks: list[int], world_size: int) -> str:
    """'rank 0', 'ranks 0 and 1', or 'every rank (0 and 1)' when all of them."""
    names = " and ".join(map(str, ranks)) if len(ranks) <= 2 else ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"every rank ({names})" if len(ranks) == world_size else f"ranks {names}"


CONTRACT = DataSharding()
