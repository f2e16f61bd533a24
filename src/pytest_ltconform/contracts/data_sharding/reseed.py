"""data-sharding, pytest side: a train order that is drawn at random yet repeats every epoch.

Judged from the indices each epoch received (the dataset keys of each fetch, else the rows'
fingerprints), for batch samplers, samplers and shuffling IterableDatasets alike: every rank got
the same sequence in its first two recorded epochs, and the object that decides the order draws
at random (the global random state moved while its ``__iter__`` ran, its source shuffles or seeds
a generator, it is one of torch's random samplers). What reseeds it is then said from what was
recorded (:mod:`.order`): which of its epoch methods were called, by whom, and which objects
Lightning calls ``set_epoch`` on. An order that repeats and draws nothing is a fixed order, a
choice: the pass says so in a note.
"""

from __future__ import annotations

from ...outcomes import Outcome
from ...sites import fmt_site
from ..base import Evidence, Run, Verdict, class_site, user_classes
from .order import BATCH_SAMPLER, DS_EPOCH_CALL, LIGHTNING_SAMPLERS, RANDOM_SAMPLERS, WRAPPED
from .probe import DS_SAMPLER

# Where Lightning 2.x reseeds (lightning.fabric.utilities.data._set_sampler_epoch).
LIGHTNING_RESEEDS = ("Lightning calls set_epoch(epoch) at every epoch start on the DataLoader's sampler and on its "
                     "batch sampler's .sampler only")


def repeated_epochs(run: Run, per_rank: dict) -> tuple[list, dict, bool] | None:
    """(the first two epochs, rank -> the sequence both received, whether those are dataset keys)
    when every rank received the same non-empty sequence in both, not the dataset's own ascending
    order; None otherwise."""
    seqs, epochs, keys = {}, None, True
    for r in range(run.world_size):
        epochs = sorted(per_rank.get(r, {}))[:2]
        if len(epochs) < 2:
            return None
        first, second = ([h for e in per_rank[r][ep] for h in e.get("rows", [])] for ep in epochs)
        if not first or first != second:
            return None
        keys = keys and all(e.get("src") == "index" for ep in epochs for e in per_rank[r][ep])
        ids = [int(k) for k in first] if keys and all(str(k).lstrip("-").isdigit() for k in first) else None
        if ids is not None and ids == sorted(ids):
            return None  # the dataset's own order: nothing was shuffled
        seqs[r] = first
    return epochs, seqs, keys


def owners(loader: dict) -> list[dict]:
    """The loader's order owners as recorded (:func:`.order.owners`), or, for a trace without them,
    the batch sampler and sampler its ``ds_loader`` event names."""
    if loader.get("order_owners") is not None:
        return list(loader["order_owners"])
    found = []
    if loader.get("custom_batch_sampler"):
        found.append({"cls": loader["custom_batch_sampler"], "role": BATCH_SAMPLER, "user": True,
                      "random_words": ["shuffle"] if loader.get("batch_sampler_shuffles") else [],
                      "epoch_methods": None})
    sampler = loader.get("inner_sampler") or loader.get("sampler")
    if sampler and not loader.get("custom_batch_sampler"):
        found.append({"cls": sampler, "role": "sampler", "user": sampler not in RANDOM_SAMPLERS + ("SequentialSampler",)
                      + LIGHTNING_SAMPLERS, "shuffle": loader.get("shuffle"), "random_words": [],
                      "epoch_methods": None})
    return found


def random_because(run: Run, owner: dict) -> list[str]:
    """Why ``owner``'s order is drawn at random, each a recorded fact; empty when nothing shows it."""
    if owner.get("cls") in LIGHTNING_SAMPLERS:
        return []  # Lightning reseeds its own samplers
    why = []
    ranks = sorted({r for r in range(run.world_size) for e in run.events(r, DS_SAMPLER)
                    if e.get("cls") == owner.get("cls") and e.get("rng")})
    if ranks:
        why.append(f"the global random state moved while its __iter__ ran (rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))})")
    if owner.get("cls") in RANDOM_SAMPLERS:
        why.append(f"it is torch's {owner['cls']}")
    if owner.get("shuffle") is True:
        why.append("shuffle=True")
    if owner.get("random_words"):
        why.append(f"its source calls {', '.join(owner['random_words'][:4])}")
    return why


def epoch_calls(run: Run, cls: str) -> dict[str, list[dict]]:
    """method -> the ``ds_epoch_call`` events of class ``cls`` on rank 0 (every rank calls alike)."""
    out: dict[str, list[dict]] = {}
    for e in run.events(0, DS_EPOCH_CALL):
        if e.get("cls") == cls:
            out.setdefault(e.get("method"), []).append(e)
    return out


def reseeding(run: Run, owner: dict) -> str:
    """What was recorded of ``owner``'s reseeding, in one sentence: its epoch methods, whether
    anything called them, and where Lightning calls set_epoch."""
    name, role, methods = owner["cls"], owner.get("role"), owner.get("epoch_methods")
    if methods is None:
        return "nothing reseeds it."
    calls = epoch_calls(run, name)
    called = [m for m in methods if calls.get(m.split("(", 1)[0])]
    if called:
        first = calls[called[0].split("(", 1)[0]]
        epochs = ", ".join(str(e.get("epoch")) for e in first[:4])
        by = fmt_site(first[0].get("caller")) if first[0].get("caller") else "an unknown caller"
        return (f"its {called[0]} was called (epochs {epochs}; first from {by}), yet the order did not change: its "
                f"__iter__ does not draw from the epoch it was given.")
    where = {BATCH_SAMPLER: f"{LIGHTNING_RESEEDS}, never on a batch sampler itself",
             WRAPPED: f"{LIGHTNING_RESEEDS}: here that is Lightning's {owner.get('wrapper')}, which wraps {name} "
                      f"and does not pass the epoch on"}.get(role, LIGHTNING_RESEEDS)
    if not methods:
        return f"{name} has no set_epoch or other method that takes the epoch, and nothing reseeds it."
    named = " and ".join(methods)
    other = "" if any(m.startswith("set_epoch(") for m in methods) else " (Lightning calls set_epoch by that name only)"
    return f"{name} has {named}, which nothing called: {where}{other}."


def verdict(contract, run: Run, per_rank: dict, loader: dict) -> Verdict | None:
    """The failure of a train order drawn at random that repeats every epoch; None otherwise."""
    repeated = repeated_epochs(run, per_rank)
    if repeated is None:
        return None
    epochs, seqs, keys = repeated
    if loader.get("iterable"):
        return None if not loader.get("dataset_shuffles") else _dataset(contract, loader, epochs, seqs, keys)
    for owner in owners(loader):
        why = random_because(run, owner)
        if why:
            return _owner_verdict(contract, run, owner, why, epochs, seqs, keys)
    return None


def fixed_order_note(run: Run, per_rank: dict, loader: dict) -> str | None:
    """The note of a pass whose train order repeats every epoch while nothing draws it at random."""
    repeated = repeated_epochs(run, per_rank)
    if repeated is None or loader.get("iterable"):
        return None
    found = owners(loader)
    name = found[0]["cls"] if found else (loader.get("sampler") or "the sampler")
    a, b = repeated[0]
    return (f"the train order is the same in epoch {a} and epoch {b} on every rank, and {name} draws nothing at "
            f"random that this check saw: a fixed order, judged as your choice.")


def _what_received(seqs: dict, r: int, keys: bool) -> str:
    """What rank ``r`` received in each of the two epochs: dataset keys (the first few named), or
    the fingerprints of its samples where no key was recorded."""
    got = seqs[r]
    if keys:
        return f"the same {len(got)} dataset keys in the same order (starting {', '.join(map(str, got[:6]))})"
    return f"the same {len(got)} sample fingerprints in the same order"


def _owner_verdict(contract, run: Run, owner: dict, why: list[str], epochs: list, seqs: dict, keys: bool) -> Verdict:
    a, b = epochs
    name, role = owner["cls"], owner.get("role")
    what = {BATCH_SAMPLER: "the train batch sampler", WRAPPED: "the train sampler"}.get(role, "the train sampler")
    summary = (f"{what} {name} gives every rank the same sample order in epoch {a} and epoch {b}, though its order "
               f"is drawn at random ({why[0]}): {reseeding(run, owner)} So every epoch repeats the same batches.")
    evidence = [Evidence(f"epochs {a} and {b}: {_what_received(seqs, r, keys)}", rank=r) for r in sorted(seqs)]
    defined = owner.get("site") or _defined(run, name)
    if defined:
        evidence.append(Evidence(f"{name} is defined here ({'; '.join(why)})", site=fmt_site(defined)))
    for method, calls in epoch_calls(run, name).items():
        epochs_given = ", ".join(str(e.get("epoch")) for e in calls)
        evidence.append(Evidence(f"{name}.{method} called with epoch(s) {epochs_given}", rank=0,
                                 site=fmt_site(calls[0]["caller"]) if calls[0].get("caller") else None))
    return contract.verdict(Outcome.FAILED, summary, evidence=evidence, fix=_fix(owner), category="silent")


def _defined(run: Run, name: str) -> dict | None:
    """Where the module's or datamodule's file defines class ``name`` (found at validation)."""
    for which in ("model", "datamodule"):
        found = class_site(user_classes(run, which), name)
        if found:
            return found
    return None


def _fix(owner: dict) -> str:
    name, role = owner["cls"], owner.get("role")
    draw = "draw the order from a seed that changes every epoch (torch.Generator().manual_seed(seed + epoch))"
    if role == BATCH_SAMPLER:
        return (f"{draw} in {name}.__iter__, with the epoch counted by the batch sampler itself (self.epoch += 1 at "
                f"the end of each pass) or set from your LightningModule's on_train_epoch_start "
                f"(self.trainer.train_dataloader.batch_sampler.set_epoch(self.current_epoch)): Lightning never calls "
                f"a batch sampler's set_epoch. Or build the batches over a sampler Lightning reseeds (it calls "
                f"set_epoch on the batch sampler's .sampler).")
    if role == WRAPPED:
        return (f"{draw} in {name}.__iter__ and give it a set_epoch(epoch) that your LightningModule calls from "
                f"on_train_epoch_start, or pass use_distributed_sampler=False and make {name} the DataLoader's own "
                f"sampler (then Lightning calls its set_epoch), sharded by rank.")
    return (f"{draw} in {name}.__iter__ and name the method set_epoch(epoch): Lightning calls it on the DataLoader's "
            f"sampler at every epoch start. Or use DistributedSampler(shuffle=True).")


def _dataset(contract, loader: dict, epochs: list, seqs: dict, keys: bool) -> Verdict:
    a, b = epochs
    name = loader.get("dataset") or "the IterableDataset"
    summary = (f"IterableDataset {name} yields every rank the same sample order in epoch {a} and epoch {b}: its "
               f"__iter__ shuffles with a fixed seed, so every epoch repeats the same batches.")
    fix = ("shuffle with a seed that changes every epoch: keep an epoch counter on the dataset (incremented in "
           "__iter__, or a set_epoch(epoch) called from on_train_epoch_start) and draw from random.Random(seed + "
           "epoch) or torch.Generator().manual_seed(seed + epoch).")
    evidence = [Evidence(f"epochs {a} and {b}: {_what_received(seqs, r, keys)}", rank=r) for r in sorted(seqs)]
    site = loader.get("dataset_site")
    if site:
        evidence.append(Evidence(f"{name} is defined here: its __iter__ shuffles", site=fmt_site(site)))
    return contract.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="silent")
