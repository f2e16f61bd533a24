"""all-rank-save: every collective-bearing call that user code makes happens on every rank, in
the same order.

Seed section "Sampling, metrics and writes" (and "FSDP" for sharded checkpoints):
``Trainer.save_checkpoint`` is collective (a barrier after the write; sharded strategies also
gather), so it belongs on every rank; a rank-zero guard is for plain file writes only.

Checked from the traced fit: every user-level call of ``Trainer.save_checkpoint``, the
strategy's ``barrier``/``broadcast``/``reduce``/``all_gather``/``reduce_boolean_decision``,
``LightningModule.all_gather`` and raw ``torch.distributed`` collectives, from the module or a user
callback, and the library calls that make collectives for user code (a syncing TorchMetrics
compute, a DDP forward that broadcasts buffers, ModelCheckpoint called by user code; ``taps.py``),
aligned across ranks hook by hook. The first call made on a subset of ranks (the first cause, not
a later call where the other ranks waited) fails with its call site, the guard found in the source
(a rank test or rank-local state) and per-rank counts. Hyperparameters that torch's weights_only
loading refuses are a note on a passed verdict: a resume problem on one device too.

Under the CPU sharded tier (FSDP on gloo ranks) a probe (``probe.py``) also saves a sharded checkpoint on every
rank after fit and resumes a short fit from that directory with the matching strategy, and every
``load_from_checkpoint`` call is recorded: one given a sharded checkpoint directory fails (that
path is unsupported; the fix is ``Trainer(ckpt_path=dir)`` with the same strategy, or
consolidating the directory first).
"""

from __future__ import annotations

import ast
import linecache
import os
import re
from collections import Counter

from ... import releases
from ...claims import claim
from ...events import CALL, EXIT, HOOK, LOG, RAISED, STRATEGY
from ...outcomes import Outcome
from ...sites import fmt_site, hook_label, plural
from ...vocabulary import unnamed_tier
from ...world.diagnose import first_divergence
from ..base import Blame, Contract, Evidence, Run, Verdict, defined_as_property, rank_guard
from .loops import SHARDING, loop_mismatch
from .probe import LOAD, ShardedSaveProbe

_REFUSED_CLASS = re.compile(r"refused ([\w.]+?)\.?$")
# Layouts of a checkpoint path that load_from_checkpoint cannot read.
SHARDED_LAYOUTS = {"fsdp": "an FSDP sharded checkpoint (torch.distributed.checkpoint: per-rank .distcp files "
                           "and .metadata)",
                   "deepspeed": "a DeepSpeed checkpoint directory (per-rank ZeRO shards)",
                   "directory": "a directory, not a checkpoint file"}
# What a save writes, by sharded.saved_layout: the plugin's run against the user's own strategy.
SAVED_FORMATS = {"file": "one checkpoint file",
                 "fsdp": "an FSDP sharded checkpoint directory",
                 "deepspeed": "a DeepSpeed checkpoint directory (per-rank ZeRO shards)"}
_STRATEGY_WORDS = {"fsdp": "FSDP", "deepspeed": "DeepSpeed", "ddp": "DDP"}


def user_call(event: dict) -> bool:
    return CALL.of(event) and bool(event.get("user"))


def member_syncs(run: Run) -> dict[str, set[str]]:
    """Per label, the member metrics whose syncs a collection's call made (``MetricCollection.compute``
    traces one event per member metric that syncs: the count is of those syncs, not of the calls)."""
    found: dict[str, set[str]] = {}
    for t in run.traces:
        for e in t:
            label, metric = str(e.get("label") or ""), e.get("metric")
            if user_call(e) and e.get("kind") == "metric" and metric and label.split(".", 1)[0] != metric:
                found.setdefault(label, set()).add(metric)
    return found


def _counts(run: Run, label: str) -> dict[int, int]:
    return {r: sum(1 for e in t if user_call(e) and e.get("label") == label) for r, t in enumerate(run.traces)}


class AllRankSave(Contract):
    id = "all-rank-save"
    title = "Checkpoint saves and other collectives are called on every rank"
    rule_section = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp", "deepspeed")
    tiers = ("cpu", "nodes", "gpu", "multinode")  # nodes: ranks laid out as nodes on this host
    probe_class = ShardedSaveProbe

    def blames(self, run: Run) -> int | None:
        """A collective-bearing call some ranks made and the others did not stopped the world;
        a load_from_checkpoint that raised on a sharded directory names this contract too."""
        if CALL in run.divergent_events() and not stopped_first(run, run.job.divergence):
            return Blame.CALL
        if mismatch_cause(run) is not None and not run.raised_in_user_code():
            return Blame.CALL
        if skipped_backward(run) is not None and not run.raised_in_user_code():
            return Blame.CALL
        if run.raised_owner() == self.id and run.strategy in ("fsdp", "deepspeed") and _sharded_load(run) and \
                not any(e.get("configured") for e in run.events(0, STRATEGY)):
            # A sharded directory given to a one-file loader under a sharded strategy the config does not
            # name: what moving to it would break, said by the session for every item of the run (never a
            # failed contract on a strategy the user's config does not name).
            return None
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        skipped = skipped_backward(run) if not run.raised_in_user_code() else None
        if skipped is not None:
            return self._skipped_backward(run, skipped)
        div = first_divergence(run.traces, select=user_call)
        if div is not None and div["kind"] == "calls" and not stopped_first(run, div):
            return self._diverged(run, div)
        looped = loop_mismatch(run) if not run.finished and not run.raised_in_user_code() else None
        if looped is not None:
            return self._loop_mismatched(run, looped)
        if not run.finished and not run.raised_in_user_code() and mismatch_cause(run) is not None:
            return self._mismatched(run)
        loads = [(r, e) for r, t in enumerate(run.traces) for e in t
                 if LOAD.of(e) and e.get("layout") in SHARDED_LAYOUTS]
        if loads:
            chosen = self.plugin_choice(run)
            if chosen is not None:
                return _plugin_chose(self, run, chosen[0], [chosen[1]], chosen[2])
            return self._sharded_load(run, loads)
        round_trip = self._round_trip(run)
        if isinstance(round_trip, Verdict):
            return round_trip
        summary = self._same_calls(run)
        if round_trip:
            summary = f"{summary} {round_trip}"
        note = weights_only_note(run, self.id)
        return self.verdict(Outcome.PASSED, summary, notes=[note] if note else [])

    def plugin_choice(self, run: Run) -> tuple[str, str, list] | None:
        """(reason, advisory) when every sharded checkpoint a loader of the user's was given is one
        the plugin's own run of this strategy saved in a format the user's Trainer config never
        saves (the DeepSpeed tier of a DDP config writes a ZeRO directory where the user's config
        writes one file): what follows is the plugin's choice, not judged; the advisory says what
        breaks once the user's strategy saves that format. None otherwise."""
        loads = [(r, e) for r, t in enumerate(run.traces) for e in t
                 if LOAD.of(e) and e.get("layout") in SHARDED_LAYOUTS]
        if not loads or not all(e.get("layout") == run.strategy and e.get("user_saves") in SAVED_FORMATS
                                and e["user_saves"] != e["layout"] for _, e in loads):
            return None
        r, first = loads[0]
        name = _STRATEGY_WORDS.get(run.strategy, run.strategy)
        saved, theirs = SAVED_FORMATS[first["layout"]], SAVED_FORMATS[first["user_saves"]]
        raised = next((e.get("exc") for e in run.traces[r]
                       if RAISED.of(e) and e.get("in") in ("load_from_checkpoint", "torch.load")), None)
        call = f"{first.get('label')} at {fmt_site(first.get('site'))}"
        said = claim("plugin-format", f"the plugin's {name} run saved {saved} where your config saves {theirs}",
                     saved=first["layout"], theirs=first["user_saves"], strategy=run.strategy)
        reason = (f"{said.text}, and {call} was given it" + (f" (it raised {raised})" if raised else "")
                  + ": that follows from the plugin's choice of strategy, not from your config")
        advisory = (f"advisory: {call} reads one checkpoint file, so it breaks once your strategy saves {saved}; "
                    f"then load the directory with the strategy that wrote it "
                    f"(Trainer(strategy=...).fit/validate/test(model, ckpt_path=dir)) or convert it to one file "
                    f"first ({'zero_to_fp32' if first['layout'] == 'deepspeed' else 'consolidate_checkpoint'}).")
        return reason, advisory, [said]

    def _skipped_backward(self, run: Run, skipped: dict) -> Verdict:
        """Some ranks left a training step without the backward the others ran in it: under a
        data-parallel strategy the backward is a collective (DDP all-reduces the gradients, FSDP
        reduce-scatters them), so the ranks whose collective sequence is short are the cause."""
        short, ran, pos = skipped["short"], skipped["ran"], skipped["position"]
        where = f"epoch {pos.get('epoch')}, training step {skipped['batch']}"
        returns = early_returns(run)
        at = f" at {', '.join(fmt_site(r['site']) for r in returns)}" if returns else ""
        summary = (f"{_ranks(short)} left training_step without the backward that {_ranks(ran)} ran in the same step "
                   f"({where}): the backward is a collective (the strategy reduces the gradients across ranks), so "
                   f"{_ranks(ran)} waited in a gradient reduction {_ranks(short)} never made: {_ranks(short)} "
                   f"returned{at} and the world hangs.")
        evidence = [Evidence(f"{where}: went from training_step to {skipped['hooks'][r]} (no backward)", rank=r)
                    for r in short]
        evidence += [Evidence(f"{where}: ran {skipped['hooks'][r]} and waited in the gradient reduction", rank=r)
                     for r in ran]
        for r in returns:  # one return: the one the short ranks took; several: one of them
            guard = f" under `{r['guard']}`" if r.get("guard") else ""
            evidence.append(Evidence(f"training_step returns{guard} before {r['before']}",
                                     rank=short[0] if len(returns) == len(short) == 1 else None,
                                     site=fmt_site(r["site"])))
        fix = ("run the backward on every rank in every step: instead of returning early, make the skipped batch "
               "contribute nothing (a loss of 0 * loss, or masking its bad samples), or decide to skip on every rank "
               "together (trainer.strategy.reduce_boolean_decision(skip) with all=False, then every rank skips the "
               "same step).")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="deadlock",
                            notes=["the world did not finish: the item's report says where each rank was."])

    @staticmethod
    def _same_calls(run: Run) -> str:
        """What a pass compared: the collective-bearing calls user code made itself, and the library
        calls of its own that made collectives inside (a property such as ``trainer.log_dir``, a
        synced ``self.log``), the same on every rank in the same order; or that there were none."""
        own = Counter(e.get("label") for e in run.events(0, CALL) if user_call(e))
        made = [_made_for(run, r) for r in range(run.world_size)]
        inside = Counter(made[0]) if made[0] and all(m == made[0] for m in made) else Counter()
        if not own and not inside:
            return "user code makes no collective-bearing call (saves, barriers, collectives) of its own."
        members = member_syncs(run)
        listing = [f"{label} x{n}" if label not in members else
                   f"{label} ({plural(n, 'sync')} of its member metrics {', '.join(sorted(members[label]))})"
                   for label, n in sorted(own.items())]
        listing += [f"{words} at {site} x{n}" for (words, site), n in sorted(inside.items())[:4]]
        more = len(inside) - 4
        return ("every rank made the same collective-bearing calls from user code, in the same order ("
                + ", ".join(listing) + (f", and {more} more" if more > 0 else "") + ").")

    # -- sharded checkpoints ----------------------------------------------------------------------
    def _sharded_load(self, run: Run, loads: list) -> Verdict:
        import linecache

        r0, first = loads[0]
        ranks = sorted({r for r, _ in loads})
        who = "every rank" if len(ranks) == run.world_size else f"rank(s) {', '.join(map(str, ranks))}"
        site = first.get("site") or {}
        source = linecache.getline(site.get("file", ""), site.get("line", 0)).strip() if site else ""
        layout = SHARDED_LAYOUTS[first["layout"]]
        made_by = f" (written under {first['strategy']})" if first.get("strategy") else ""
        raised = {r: e.get("exc") for r, t in enumerate(run.traces) for e in t
                  if RAISED.of(e) and e.get("in") in ("load_from_checkpoint", "torch.load")}
        arg = re.search(r"load(?:_from_checkpoint)?\((.*)\)", source)
        reader = str(first.get("label", "")).rsplit(".", 1)[-1] if "load_from" in str(first.get("label")) else \
            first.get("label")
        summary = (f"{first.get('label')}({arg.group(1) if arg else 'path'}) in {first.get('hook') or 'user code'} on "
                   f"{who} is given {layout}{made_by}: {reader} reads one checkpoint file and does "
                   f"not support sharded checkpoints"
                   + (f"; it raised {next(iter(raised.values()))} on {plural(len(raised), 'rank')}" if raised
                      else "") + ".")
        evidence = []
        for r, e in loads:
            shown = "/".join(str(e.get("path") or "").split("/")[-2:])
            detail = f"{e.get('label')}('.../{shown}') in {e.get('hook') or 'user code'}"
            if e.get("files"):
                detail += f"; the directory holds {', '.join(e['files'])}"
            if r in raised:
                detail += f"; raised {raised[r]}"
            evidence.append(Evidence(detail, rank=r, site=fmt_site(e.get("site"))))
        if source:
            evidence.append(Evidence(f"the call: `{source}`", site=fmt_site(site)))
        if first["layout"] == "deepspeed":
            fix = ("load a DeepSpeed checkpoint with the strategy that wrote it: Trainer(strategy=<the same "
                   "DeepSpeedStrategy>).fit/validate/test(model, ckpt_path=dir) on every rank; for one state dict, "
                   "convert the directory first with DeepSpeed's zero_to_fp32 utility (lightning.pytorch.utilities."
                   "deepspeed.convert_zero_checkpoint_to_fp32_state_dict(dir, 'model.pt'), or the zero_to_fp32.py "
                   "that the save put in the directory), then torch.load that file.")
        else:
            fix = ("load a sharded checkpoint with the strategy that wrote it: Trainer(strategy=<the same strategy>)"
                   ".fit/validate/test(model, ckpt_path=dir) on every rank; for a single weights file, consolidate "
                   "the directory first (FSDP: `python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`; "
                   "DeepSpeed: zero_to_fp32.py in the directory), or save with state_dict_type='full'.")
        return Verdict(contract=self.id, outcome=Outcome.FAILED, summary=summary, evidence=evidence, fix=fix,
                       rule_section="DeepSpeed" if first["layout"] == "deepspeed" else "FSDP")

    def _round_trip(self, run: Run):
        """The CPU sharded tier's save-and-resume: a sentence for a passing verdict, a failed
        Verdict, or None when no sharded run was made."""
        data = [d.get("sharded") if d else None for d in run.probe(self.id)]
        done = [(r, d) for r, d in enumerate(data) if d]
        if not done:
            return None
        refused = [r for r, d in done if d.get("weights_only")]
        failures = [(r, d) for r, d in done if r not in refused and
                    (d.get("error") or not (d.get("restored_ok") or d.get("unchecked") or d.get("nonfinite")))]
        first = done[0][1]
        lightning = _lightning(run.probe(self.id))
        files = ", ".join(first.get("files") or []) or "nothing"
        if failures and not _reaches_sharded_save(run, run.probe(self.id)):
            reason, advisory, said = _not_configured(failures, files, _user_saves(run.probe(self.id)))
            return _plugin_chose(self, run, reason, [advisory, f"on the fit itself: {self._same_calls(run)}"], said)
        after = next((d["after_restore"] for _, d in done if d.get("after_restore")), None)
        after = (f" The resumed fit then stopped ({after}) after the checkpoint had loaded: that is the run's "
                 f"own doing, judged by the fit's items, not the checkpoint's.") if after else ""
        if not failures and first.get("nonfinite"):
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}) and a fit resumed from "
                    f"it, but the weights after fit are not finite (nan or inf), so the restored ones could not be "
                    f"compared with them.{after}")
        if refused and not failures:
            return _refused_resume(lightning, files)
        if not failures and first.get("unchecked"):
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}). Resuming the fit from "
                    f"it failed in Lightning {lightning} ({first.get('limitation')}) because the optimizer "
                    f"keeps no state (e.g. plain SGD), and the restored weights were not compared: "
                    f"{first['unchecked']}.")
        if not failures and first.get("limitation"):
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}), and every rank's "
                    f"parameter shard restored from it with the matching strategy (state_dict_type='sharded') "
                    f"through validate(ckpt_path=dir). Resuming the fit from it failed in Lightning "
                    f"{lightning} "
                    f"({first['limitation']}): the optimizer keeps no state (e.g. plain SGD), which the sharded "
                    f"format drops, so the optimizer is refused on resume; an optimizer with state (such as "
                    f"Adam) resumes.")
        if not failures:
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}) and a fit resumed from "
                    f"it with the matching strategy (state_dict_type='sharded'): step {first.get('saved_step')} "
                    f"and every rank's parameter shard restored.{after}")
        return self._round_trip_failed(failures, files)

    def _round_trip_failed(self, failures: list, files: str) -> Verdict:
        """The round trip failed where the user's config saves FSDP sharded checkpoints itself: the
        save raised (no directory, no resume), or the resume raised or restored other values."""
        evidence = []
        for r, d in failures:
            if d.get("error") and d.get("phase") == "save":
                evidence.append(Evidence(f"the sharded save raised {_save_failed(d)}", rank=r))
            elif d.get("error"):
                evidence.append(Evidence(f"{d.get('phase', 'resume')} raised {d['error']}", rank=r))
            else:
                evidence.append(Evidence(
                    f"after resuming: step {d.get('restored_step')} (saved {d.get('saved_step')}), parameter "
                    f"checksum {d.get('restored_checksum')} (saved {d.get('saved_checksum')})", rank=r))
        if all(d.get("phase") == "save" for _, d in failures):
            summary = (f"the sharded save after fit (trainer.save_checkpoint under your FSDP config, "
                       f"state_dict_type='sharded') raised on {plural(len(failures), 'rank')}, so no checkpoint "
                       f"directory was saved and resuming from one was not tried.")
            fix = ("fix what the sharded save raised on (the exception and frame above), or save with "
                   "state_dict_type='full' (one checkpoint file, gathered on rank 0).")
            return Verdict(contract=self.id, outcome=Outcome.FAILED, summary=summary, evidence=evidence, fix=fix,
                           rule_section="FSDP")
        summary = (f"a sharded checkpoint saved on every rank after fit ({files}) could not be resumed with "
                   f"the matching strategy (Trainer(ckpt_path=dir), FSDP state_dict_type='sharded').")
        fix = ("keep the sharded directory's files together and resume with the strategy that wrote it; make "
               "sure every rank builds the same modules (same names and shapes) before the checkpoint loads.")
        return Verdict(contract=self.id, outcome=Outcome.FAILED, summary=summary, evidence=evidence, fix=fix,
                       rule_section="FSDP")

    def _diverged(self, run: Run, div: dict) -> Verdict:
        events = div["events"]
        # The first call that some ranks made and the others did not: the first cause; the calls
        # the other ranks made meanwhile (say a barrier after it) are where they waited.
        first_rank, call, at = first_cause(events)
        label = call.get("label")
        makers = sorted(r for r, evs in events.items() if any(e.get("label") == label for e in evs))
        missing = sorted(set(events) - set(makers))
        counts = _counts(run, label)
        guard, rank_based = call_guard(call.get("site"))
        hook = hook_label(div["hook"][first_rank])
        site = fmt_site(call.get("site"))
        named = label + (f" ({call['effect']})" if call.get("effect") else "")
        unit = "member-metric sync" if label in member_syncs(run) else "call"
        count_text = ", ".join(f"rank {r}: {counts[r]}{'+' if not run.finished else ''} "
                               f"{unit}{'s' if counts[r] != 1 or not run.finished else ''}" for r in sorted(counts))
        who = f"rank {makers[0]} only" if len(makers) == 1 else f"ranks {', '.join(map(str, makers))} only"
        if missing:
            summary = (f"{named} called on {who} ({count_text}) from {hook}{_guard_text(guard, rank_based)}, "
                       f"at {site}. The other rank(s) never enter the collective, so the world "
                       f"hangs or mismatches collectives.")
        else:
            summary = (f"the ranks made different collective-bearing calls in {hook} ({count_text}); "
                       f"collectives must pair up in the same order on every rank.")
        evidence = _call_evidence(div, label, counts)
        if guard and rank_based:
            evidence.append(Evidence(f"the call is guarded by `{guard}`", site=site))
        elif guard:
            evidence.append(Evidence(f"the call is guarded by `{guard}`, a condition on rank-local state: it held "
                                     f"on {_ranks(makers)} and not on {_ranks(missing)}", site=site))
        fix = fix_for(call)
        told = re.search(r"\bcall ([\w.]+)\(\) on every rank", fix)
        # The traced call is a function the recorder wrapped (never a property): it is called.
        claims = [claim("call-form", told.group(0), func=told.group(1), property=False)] if told else []
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, claims=claims,
                            category="deadlock", notes=self._notes(run, div, call, makers, at))

    def _mismatched(self, run: Run) -> Verdict:
        """The world stopped on a collective the ranks issued differently (torch's Flight Recorder):
        name the one-sided call at the user's line, each rank's collective at that number, and
        the guard that split them."""
        mm = run.job.mismatch
        cause_rank, call = mismatch_cause(run)
        call = dict(call, via=_traced_via(run, cause_rank, call))
        guard, rank_based = call_guard(call.get("site"))
        site = fmt_site(call.get("site"))
        named = _collective_name(call)
        others = sorted(r for r in range(run.world_size) if r != cause_rank)
        summary = (f"{named} called on rank {cause_rank}{_guard_text(guard, rank_based)}, at {site}, was met by a "
                   f"different call on {_ranks(others)} (collective #{mm['seq']} of the process group): "
                   f"the ranks' collectives no longer pair up, so the world hangs or mixes values.")
        evidence = []
        for r in range(run.world_size):
            theirs = call if r == cause_rank else mm["calls"].get(r)
            if theirs is None:
                evidence.append(Evidence(f"no collective #{mm['seq']} (it stopped before issuing one)", rank=r))
            else:
                evidence.append(Evidence(f"collective #{mm['seq']}: {_collective_name(theirs)}", rank=r,
                                         site=fmt_site(theirs.get("site")) if theirs.get("site") else None))
        if guard:
            evidence.append(Evidence(f"the call is guarded by `{guard}`" if rank_based else
                                     f"the call is guarded by `{guard}`, a condition on rank-local state", site=site))
        synced = _synced_keys(run, cause_rank) if "metrics" in str((call.get("via") or {}).get("func")) else []
        if synced:
            evidence.append(Evidence(f"reading the trainer's metrics computes the epoch values, and syncing a value "
                                     f"logged with sync_dist=True is a collective: {', '.join(map(repr, synced))}",
                                     rank=cause_rank))
        notes = ["every collective was recorded by torch's Flight Recorder on each rank; the first one the ranks "
                 "issued from different places in your code is named (a library call such as "
                 "trainer.callback_metrics or summon_full_params makes collectives inside it)."]
        via = call.get("via") or {"func": call.get("op"), "property": False}
        getter = via.get("property") if via.get("property") is not None else defined_as_property(via)
        what = "its getter makes" if getter else "it makes"
        told = f"{call_words(via, site=call.get('site'))} on every rank"
        fix = (f"{told}, in the same order ({what} a collective every rank must enter); keep only the rank-local "
               f"side work (printing, writing a file) under the rank guard.")
        if f"{os.sep}torchmetrics{os.sep}" in str(via.get("file")):
            fix += (" For a TorchMetrics metric, sync_on_compute=False (a constructor argument) makes compute() "
                    "skip this collective and return the value of the calling rank's own state only.")
        said = claim("call-form", told, func=via.get("func"), property=bool(getter))
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="deadlock", notes=notes,
                            claims=[said])

    def _loop_mismatched(self, run: Run, found: dict) -> Verdict:
        """A loop of the user's that stops on a per-rank condition made its ranks gather parameters a
        different number of times (``loops.loop_mismatch``): name the loop, the forward inside it,
        each rank's gather count up to the collective where they parted, and the synced stop."""
        rank, call, loop, counts = found["rank"], found["call"], found["loop"], found["counts"]
        loop_site, call_site = fmt_site(loop["site"]), fmt_site(call.get("site"))
        via = (call.get("via") or {}).get("func") or "the call"
        upto, seq = found["upto"], found["seq"]
        listed = ", ".join(f"rank {r} {plural(n, 'gather')}" for r, n in sorted(counts.items()))
        said = claim("gather-counts", f"the ranks made different numbers of gathers (of collectives #1 to #{upto} of "
                                      f"the process group, {listed})",
                     counts=counts, upto=upto)
        others = ", ".join(f"rank {r} issued {_collective_name(c)}" for r, c in sorted(found["others"].items())) or \
            f"{_ranks(sorted(r for r in counts if r != rank))} made no collective #{seq}"
        summary = (f"the loop `{loop['source']}` at {loop_site} stops on a condition each rank tests on its "
                   f"own, and under {SHARDING[run.strategy]} each forward inside it (`{found['call_source']}` at "
                   f"{call_site}, through {via}) made a collective ({call.get('op')}): the strategy gathers the "
                   f"parameters it shards from every rank. In torch's Flight Recorder {said.text}: "
                   f"at collective #{seq} rank {rank} was still gathering inside the loop while {others}, so the "
                   f"ranks' collectives no longer pair up and the world hangs or mixes values.")
        evidence = [Evidence(f"the loop `{loop['source']}` stops on each rank's own condition", site=loop_site)]
        for r in sorted(counts):
            theirs = call if r == rank else found["others"].get(r)
            at = f"collective #{seq}: {_collective_name(theirs)}" if theirs else f"no collective #{seq}"
            evidence.append(Evidence(f"{plural(counts[r], 'gather')} ({call.get('op')} and the like) in collectives "
                                     f"#1 to #{upto}; {at}", rank=r,
                                     site=fmt_site(theirs.get("site")) if theirs and theirs.get("site") else None))
        fix = ("decide the loop's stop on every rank together, so every rank keeps running the forward until all "
               "ranks are done: reduce the per-rank flag before testing it, e.g. `flag = (~done).any().float()` then "
               "`torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)` (or "
               "`self.trainer.strategy.reduce(flag, reduce_op=\"max\")`) and `while flag > 0:`; a rank that is "
               "already done runs the extra steps and ignores their output (or masks it).")
        notes = ["every collective was recorded by torch's Flight Recorder on each rank; the counts are of the "
                 "gather operations among the collectives each rank issued up to the one where the ranks parted."]
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="deadlock", notes=notes,
                            claims=[said])

    def _notes(self, run: Run, div: dict, call: dict, makers: list[int], at: int) -> list[str]:
        label = call.get("label")
        notes = []
        if label == "Trainer.save_checkpoint" and run.strategy == "fsdp":
            notes.append("under FSDP the save is itself a gather: building the checkpoint's state dict collects "
                         "every rank's parameter shards, so the one-sided save ran that gather alone and it "
                         "met the other rank's next collectives (a crash, a hang or garbage, depending on timing).")
        elif label == "Trainer.save_checkpoint" and run.strategy == "deepspeed":
            notes.append("under DeepSpeed the save is itself a collective: the engine's save_checkpoint gathers "
                         "state across ranks (every ZeRO-3 parameter, and a barrier), so the one-sided save "
                         "waited in that gather for a rank that never joined it.")
        # What a rank without the call made in its place: where it waited, not a cause.
        waited = [(r, evs[at]) for r, evs in div["events"].items() if r not in makers and len(evs) > at]
        for r, e in waited:
            notes.append(f"rank {r} went on to {e.get('label')}() at {fmt_site(e.get('site'))}: that is where it "
                         f"waited for the others, a consequence of the one-sided call above, not its cause.")
        if call.get("kind") in ("metric", "ddp") or call.get("effect"):
            notes.append(f"{label} is collective-bearing because the library makes collectives inside it "
                         f"({call.get('effect') or 'collectives'}); the call is attributed to the line in "
                         f"your code that made it.")
        if not run.finished:
            notes.append("the world did not finish: the one-sided call left the other ranks waiting "
                         "(the item's report says where each rank was).")
        return notes


def _refused_resume(lightning: str, files: str) -> str:
    """The sentence for a sharded resume that torch's weights_only loading refused. From Lightning
    2.6.0 one device refuses the same checkpoint: a resume matter, not a sharded-checkpoint finding;
    before, only the sharded resume reads with torch's default."""
    alike = (f"which a one-device or DDP resume does not refuse on Lightning {lightning} (it loads with "
             f"weights_only=False before {releases.text(releases.LOAD_USES_TORCH_DEFAULT)}): the FSDP resume "
             f"reads the checkpoint's metadata with torch's default" if _loads_unrestricted(lightning)
             else "as it is on one device")
    return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}); resuming from it was refused "
            f"by torch's weights_only loading of the checkpoint's pickled objects, {alike}, so the sharded resume "
            f"itself was not checked (see the note).")


def _lightning(data: list) -> str:
    """The Lightning release the ranks ran (the probe's record), else the rules' release."""
    return next((d["lightning"] for d in data if d and d.get("lightning")), None) or releases.RULES_RELEASE


def _loads_unrestricted(lightning: str) -> bool:
    """Whether Lightning's resume and load_from_checkpoint pass weights_only=False (before 2.6.0)."""
    return releases.before(lightning, releases.LOAD_USES_TORCH_DEFAULT)


def weights_only_note(run: Run, contract_id: str) -> str | None:
    """One advisory sentence when a checkpoint of this module cannot be loaded with
    ``torch.load(weights_only=True)`` (Lightning's default on resume from 2.6.0): the refused
    classes per hparams key, or those a resume refused; None when nothing was refused."""
    data = [d for d in run.probe(contract_id) if d]
    entries = next((d.get("weights_only") for d in data if d.get("weights_only")), None) or []
    refused = list(dict.fromkeys(name for entry in entries for name in entry["refused"]))
    if not refused:
        resumes = [d.get("sharded") or {} for d in data]
        errors = [r.get("error") or "" for r in resumes if r.get("weights_only")]
        refused = list(dict.fromkeys(m.group(1) for m in map(_REFUSED_CLASS.search, errors) if m))
        if not errors:
            return None
    keys = [e["key"] for e in entries if e["owner"] == "model"]
    ignore = f"save_hyperparameters(ignore={keys!r})" if keys else "save_hyperparameters(ignore=[...])"
    own = next((d.get("own_loader") for d in data if d.get("own_loader")), None)
    lightning = _lightning(data)
    what = (f"{', '.join(refused) if refused else 'an object pickled in the checkpoint'}"
            + (f" ({_held(entries)})" if entries else ""))
    fix = (f"{ignore} and store a class by its name (resolve it in configure_optimizers or __init__), or pass "
           f"weights_only=False when loading a checkpoint you trust.")
    if _loads_unrestricted(lightning):
        since = releases.text(releases.LOAD_USES_TORCH_DEFAULT)
        return (f"a checkpoint of this module cannot be loaded with torch.load(weights_only=True), torch's default "
                f"from 2.6: it refuses {what}. Lightning {lightning} passes weights_only=False to its own resume "
                f"(fit/validate(ckpt_path=...) of a checkpoint file) and load_from_checkpoint, so these load it; "
                f"an FSDP sharded resume does not (it reads the checkpoint's metadata with torch's default), nor "
                f"does a torch.load of your own, and from Lightning {since} on neither do Lightning's. Fix: {fix}")
    affected = ("Lightning's resume and load_from_checkpoint are" if own is None else
                f"Lightning's resume is; {own}.load_from_checkpoint is the module's own, so whether a load through "
                f"it is depends on what it passes to torch.load")
    return (f"a checkpoint of this module cannot be resumed or loaded with torch.load(weights_only=True), the "
            f"default in torch 2.6+ that Lightning uses for fit/validate(ckpt_path=...) and load_from_checkpoint, "
            f"on any strategy and on one device alike: it refuses {what}. This is not a distributed fault. Fix: "
            f"{fix} A loader of your package's own that already "
            f"passes weights_only=False is not affected; {affected}.")


def _sharded_load(run: Run) -> bool:
    """Whether a rank gave a sharded checkpoint directory to a loader that reads one file."""
    return any(LOAD.of(e) and e.get("layout") in SHARDED_LAYOUTS for t in run.traces for e in t)


def _held(entries: list[dict]) -> str:
    """Which hparams hold which refused classes, the keys that hold the same ones said together."""
    groups: dict[tuple, list[str]] = {}
    for e in entries:
        label = f"{'datamodule.' if e['owner'] == 'datamodule' else ''}hparams[{e['key']!r}]"
        groups.setdefault(tuple(e["refused"]), []).append(label)
    return "; ".join(f"{', '.join(labels)} {'hold' if len(labels) > 1 else 'holds'} {', '.join(classes)}"
                     for classes, labels in groups.items())


def _plugin_chose(contract, run: Run, reason: str, notes: list[str], said: list) -> Verdict:
    """Not judged for ``reason`` (what the plugin's own run chose: no period at its end); skipped, with
    the tier sentence, under a strategy the user's config does not name (as a sharded stop is)."""
    if not any(e.get("configured") for e in run.events(0, STRATEGY)):
        return contract.verdict(Outcome.SKIPPED, f"{reason}, so this item is not judged; the Trainer config does "
                                                 f"not name {unnamed_tier(run.strategy)}.", notes=notes, claims=said)
    return contract.not_judged(f"{reason}.", notes=notes, claims=said)


def _reaches_sharded_save(run: Run, data: list) -> bool:
    """Whether the user's Trainer config saves FSDP sharded checkpoints itself (FSDP with
    state_dict_type='sharded'), as the plugin's round trip does; a record without the user's save
    layout falls back to whether the config names the strategy."""
    saves = _user_saves(data)
    if saves is None:
        return any(e.get("configured") for e in run.events(0, STRATEGY))
    return saves == "fsdp"


def _user_saves(data: list) -> str | None:
    """What the user's own strategy saves (a key of SAVED_FORMATS), as the probe recorded it."""
    return next((d["user_saves"] for d in data if d and d.get("user_saves") in SAVED_FORMATS), None)


def _save_failed(d: dict) -> str:
    """The round trip's sharded save raised: the exception and the frame that raised it."""
    frame = d.get("frame")
    return f"{d['error']}" + (f" (raised at {fmt_site(frame)})" if frame else "")


def _not_configured(failures: list, files: str, saves: str | None) -> tuple[str, str, list]:
    """(reason, advisory, claims): the plugin's own FSDP round trip (a sharded save after fit, then a
    resume from it) failed where the user's config saves no sharded checkpoint: not judged, and
    what would break once it does, never a failed contract."""
    r, d = failures[0]
    saves = saves or "file"  # a record without it: the config names no sharded strategy (the caller checked)
    theirs = SAVED_FORMATS.get(saves, saves)
    if d.get("error") and d.get("phase") == "save":
        said = claim("plugin-format", f"the plugin's FSDP run saved with state_dict_type='sharded' where your "
                                      f"config saves {theirs}", saved="fsdp", theirs=saves, strategy="fsdp")
        reason = (f"{said.text}, and that sharded save raised on rank {r}: {_save_failed(d)}; no directory "
                  f"was saved and resuming from one was not tried")
        advisory = ("advisory: trainer.save_checkpoint breaks for this module once your strategy is FSDP with "
                    "state_dict_type='sharded' (the error above); a full state dict (FSDP's default) is not "
                    "affected (FSDP section).")
        return reason, advisory, [said]
    what = f"resuming raised {d['error']}" if d.get("error") else \
        f"the restored shard differs (checksum {d.get('restored_checksum')}, saved {d.get('saved_checksum')})"
    said = claim("plugin-format", f"the plugin's FSDP run saved a sharded checkpoint directory ({files}) where "
                                  f"your config saves {theirs}", saved="fsdp", theirs=saves, strategy="fsdp")
    reason = (f"{said.text}, and resuming from it does not work for this module (rank {r}: {what})")
    advisory = ("advisory: resuming this module from an FSDP sharded checkpoint breaks once your strategy saves "
                "with state_dict_type='sharded' (the error above); a full state dict (FSDP's default) is not "
                "affected (FSDP section).")
    return reason, advisory, [said]


_AFTER_RAISE = ("on_exception", "teardown")
_COLLECTIVE_ERRORS = ("gloo", "Connection closed by peer", "Connection reset by peer", "Timed out", "NCCL")


def _made_for(run: Run, rank: int) -> list[tuple[str, str]]:
    """(what the user's code called, its site) of every outermost traced collective that a library
    call of user code made inside it (``via``, see ``sites.library_call``), in order."""
    out = []
    for e in run.events(rank, CALL):
        via = e.get("via")
        if e.get("parent") is None and not e.get("user") and via and e.get("site"):
            words = call_words(via, with_verb=False, site=e["site"])
            out.append((f"{words} (its {e.get('label')})", fmt_site(e["site"])))
    return out


def call_words(via: dict, with_verb: bool = True, site: dict | None = None) -> str:
    """How the user makes the library call ``via`` (``{"file", "line", "func"[, "property"]}``): "read
    trainer.log_dir" for a property (reading it runs the getter; there is nothing to call), "call
    Trainer.save_checkpoint()" otherwise; without the verb, "trainer.log_dir" / "Trainer.save_checkpoint()".
    ``site``: the user's line that made the call, whose spelling of the attribute is used when it has one."""
    func = str(via.get("func") or "the call")
    getter = via.get("property")
    if getter is None:
        getter = defined_as_property(via)
    if getter:
        name = func.rsplit(".", 1)[-1]
        line = linecache.getline(site["file"], site.get("line") or 0) if site and site.get("file") else ""
        written = re.search(rf"([A-Za-z_][\w.]*)\.{re.escape(name)}\b(?!\s*\()", line)
        func = f"{written.group(1)}.{name}" if written else func
        return f"read {func}" if with_verb else func
    return f"call {func}()" if with_verb else f"{func}()"


def _collective_name(call: dict) -> str:
    """``all_reduce inside callback_metrics (trainer.py:1714)``, or ``torch.distributed.all_reduce``
    when user code called the collective itself."""
    via = call.get("via")
    op = call.get("op") or "a collective"
    if not call.get("site"):
        return f"{op} (made by Lightning or torch, no frame of your code on its stack)"
    if not via:
        return f"torch.distributed.{op}"
    return f"{via['func']} ({os.path.basename(via['file'])}:{via['line']}; its {op} was this collective)"


def _traced_via(run: Run, rank: int, call: dict) -> dict | None:
    """A mismatched call's library function, named by the metric call the recorder traced on that
    rank at the same user line (``MeanSquaredError.compute``) when there is one: Flight Recorder's
    frames name only the function the user's frame ran into, TorchMetrics' ``wrapped_func``."""
    via, site = call.get("via"), call.get("site") or {}
    for e in run.events(rank, CALL):
        at = e.get("site") or {}
        if via and e.get("kind") == "metric" and e.get("label") and \
                (at.get("file"), at.get("line")) == (site.get("file"), site.get("line")):
            return dict(via, func=e["label"], property=False)
    return via


def _synced_keys(run: Run, rank: int) -> list[str]:
    """The keys rank ``rank`` logged with sync_dist=True (what a read of the trainer's metrics syncs)."""
    return list(dict.fromkeys(str(e.get("name")) for e in run.events(rank, LOG)
                              if e.get("sync_dist") and not e.get("rank_zero_only")))


def mismatch_cause(run: Run) -> tuple[int, dict] | None:
    """``(rank, call)`` of the first mismatched collective (``JobResult.mismatch``) that starts
    it: a call under a guard in user code, else the call of a rank whose peers issued nothing at
    that number, else the lowest rank's; None without a mismatch or a user frame to name."""
    mm = getattr(run.job, "mismatch", None)
    calls = {r: c for r, c in (mm or {}).get("calls", {}).items() if c.get("site")}
    if not calls:
        return None
    guarded = [r for r, c in sorted(calls.items()) if call_guard(c["site"])[0]]
    rank = guarded[0] if guarded else min(calls)
    return rank, calls[rank]


# Hooks of a training step's backward, and the hook that ends a training step (Lightning 2.x).
_BACKWARD_HOOKS = ("on_before_backward", "on_after_backward", "backward")
_STEP_END = ("on_train_batch_end",)


def skipped_backward(run: Run) -> dict | None:
    """The ranks that ended a training step where the others went on into its backward, at the
    first point where the ranks' hooks differ: ``{"short": [ranks], "ran": [ranks], "hooks": {rank:
    hook}, "position": {...}, "batch": k}`` (``batch``: the step's index in its epoch on the first
    short rank), or None. Only an unfinished run is claimed: that backward never paired up."""
    div = run.job.divergence
    if run.finished or not div or div.get("kind") != "hooks":
        return None
    hooks = {r: str(name or "").rsplit(".", 1)[-1] for r, name in div["hook"].items()}
    short = sorted(r for r, h in hooks.items() if h in _STEP_END)
    ran = sorted(r for r, h in hooks.items() if h in _BACKWARD_HOOKS)
    epochs = {(div["position"].get(r) or {}).get("epoch") for r in short + ran}
    if not short or not ran or len(epochs) != 1:
        return None
    epoch = next(iter(epochs))
    # The module's own hook (Lightning calls it once per batch; each callback's has its own name).
    starts = [e for e in run.events(short[0], HOOK) if e.get("i", 0) < div["h"] and e.get("epoch") == epoch
              and str(e.get("name", "")).startswith("[LightningModule]")
              and str(e.get("name", "")).endswith(".on_train_batch_start")]
    return {"short": short, "ran": ran, "hooks": hooks, "position": div["position"].get(short[0]) or {},
            "batch": max(0, len(starts) - 1)}


def early_returns(run: Run) -> list[dict]:
    """The ``return`` statements of the user's ``training_step`` that come before its first
    backward call (``manual_backward``/``backward``; with none, the returns of no value): where a
    rank can leave the step without the backward. Each ``{"site", "before", "guard"}``."""
    from ..base import method_site, user_classes

    site = method_site(user_classes(run), "training_step")
    tree = _parse_file(site["file"]) if site else None
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == "training_step"
               and min([n.lineno] + [d.lineno for d in n.decorator_list]) == site["line"]), None) if tree else None
    if fn is None:
        return []
    backward = min((n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("manual_backward", "backward")), default=None)
    out = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Return):
            continue
        if backward is not None and node.lineno >= backward:
            continue
        if backward is None and node.value is not None and not (isinstance(node.value, ast.Constant)
                                                                 and node.value.value is None):
            continue
        ifs = [i for i in ast.walk(fn) if isinstance(i, ast.If) and any(node in ast.walk(b) for b in i.body)]
        guard = f"if {ast.unparse(max(ifs, key=lambda i: i.lineno).test)}:" if ifs else None
        before = f"the backward at line {backward}" if backward else "any backward"
        out.append({"site": {"file": site["file"], "line": node.lineno, "func": site["func"]},
                    "before": before, "guard": guard})
    return sorted(out, key=lambda r: r["site"]["line"])


def stopped_first(run: Run, div: dict | None) -> bool:
    """Whether every rank without the divergent call raised on its own inside that hook (outside
    any traced collective, not a peer's connection error): then the others' call is where they
    waited for it, a consequence, and the first cause is that rank's own exception."""
    if not div or div.get("kind") != "calls":
        return False
    _, call, _ = first_cause(div["events"])
    missing = [r for r, evs in div["events"].items() if not any(e.get("label") == call.get("label") for e in evs)]
    return bool(missing) and all(_raised_on_its_own(run, r, div["h"]) for r in missing)


def _raised_on_its_own(run: Run, rank: int, h: int) -> bool:
    outcome = run.job.ranks[rank]
    if outcome.status != "error" or any(word in (outcome.message or "") for word in _COLLECTIVE_ERRORS):
        return False
    trace = outcome.trace or []
    calls = {e.get("seq") for e in trace if CALL.of(e)}
    exits = [e for e in trace if EXIT.of(e)]
    if calls - {e.get("of") for e in exits} or any(e.get("raised") for e in exits):
        return False  # it stopped in (or because of) a collective
    later = [e.get("name") or "" for e in trace if HOOK.of(e) and e.get("i", 0) > h]
    return all(name.endswith(_AFTER_RAISE) for name in later)


def first_cause(events: dict[int, list[dict]]) -> tuple[int, dict, int]:
    """``(rank, call, position)``: at the first position where the ranks' call sequences differ, the call
    made by some ranks only. A call that the other ranks make later in the same hook is not
    one-sided (they made a one-sided call before it); among the rest a call under a guard wins,
    then the lowest rank."""
    seqs = {r: [e.get("label") for e in evs] for r, evs in events.items()}
    i = 0
    while all(len(s) > i for s in seqs.values()) and len({s[i] for s in seqs.values()}) == 1:
        i += 1
    candidates = [(r, evs[i]) for r, evs in sorted(events.items()) if len(evs) > i]

    def one_sided(r: int, e: dict) -> bool:
        return not all(e.get("label") in seqs[o][i:] for o in seqs if o != r)

    rank, call = min(candidates, key=lambda c: (not one_sided(*c), call_guard(c[1].get("site"))[0] is None, c[0]))
    return rank, call, i


def call_guard(site: dict | None) -> tuple[str | None, bool]:
    """``(guard, rank_based)``: the rank guard around the call at ``site`` (``rank_based`` True),
    else the innermost ``if`` around it in its function, or an earlier ``if ...: return``, whose
    outcome then differed across ranks (rank-local state); ``(None, False)`` without one."""
    guard = rank_guard(site)
    if guard:
        return guard, True
    tree = _parse_file(site.get("file")) if site else None
    if tree is None:
        return None, False
    line = site.get("line", 0)
    func, best = None, None
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if end is None or not (node.lineno <= line <= end):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (func is None or node.lineno > func.lineno):
            func = node
        elif isinstance(node, ast.If) and (best is None or node.lineno > best.lineno):
            best = node
    if func is None:
        return None, False
    if best is not None and best.lineno > func.lineno:
        text = ast.unparse(best.test)
        in_body = any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in best.body)
        return (f"if {text}:" if in_body else f"else branch of `if {text}:`"), False
    for node in ast.walk(func):
        if isinstance(node, ast.If) and node.lineno < line and any(isinstance(s, ast.Return) for s in node.body):
            return f"if {ast.unparse(node.test)}: return", False
    return None, False


def _parse_file(path: str | None):
    source = "".join(linecache.getlines(path)) if path else ""
    try:
        return ast.parse(source) if source else None
    except SyntaxError:
        return None


def _guard_text(guard: str | None, rank_based: bool) -> str:
    if not guard:
        return ""
    if guard.startswith("else branch"):
        return f" in the {guard}" + ("" if rank_based else " (a condition on rank-local state)")
    if rank_based:
        return f" under an `{guard}` guard"
    return f" under `{guard}`, a condition on rank-local state that differed across ranks"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_FIXES = {"Trainer.save_checkpoint": ("call trainer.save_checkpoint on every rank (Lightning writes the file from "
                                      "rank 0 only, and sharded strategies need every rank to gather); keep the "
                                      "rank-zero guard for plain side work such as printing or copying files."),
          "strategy.reduce_boolean_decision": (
              "call trainer.strategy.reduce_boolean_decision(decision) on every rank, each with its own value: it "
              "all-reduces the decision, so every rank must enter it; then act on the reduced result everywhere.")}


def fix_for(call: dict) -> str:
    """The fix for a call made on some ranks only, by what the call is."""
    label = call.get("label") or "the call"
    method = label.rsplit(".", 1)[-1]
    if call.get("kind") == "metric":
        return (f"call {method}() on every rank, whatever the rank's own metric state holds ({label} all-gathers "
                f"the state; a rank without updates contributes an empty one, so let compute() return a defined "
                f"value for it); decide what to log from the synced value, never from rank-local state.")
    if call.get("op") == "ddp_forward":
        return ("run rank-0-only inference on the unwrapped module (pl_module or trainer.model.module), or run it "
                "on every rank: a forward through the DistributedDataParallel wrapper broadcasts the module's "
                "buffers from rank 0, a collective every rank must enter.")
    if call.get("kind") == "save" and label != "Trainer.save_checkpoint":
        return (f"call {label}() on every rank, or leave it to Lightning, which calls it on every rank: it reduces "
                f"its save decision across ranks and saves through trainer.save_checkpoint, which writes the file "
                f"from rank 0 only; keep a rank-zero guard for plain side work only.")
    return _FIXES.get(label) or (f"make {label}() on every rank, in the same order; if only one rank needs "
                                 f"the result, call it everywhere and use it on that rank.")


def _call_evidence(div: dict, label: str, counts: dict[int, int]) -> list[Evidence]:
    """One line per call each rank made at the divergence, and the call a rank did not make."""
    events = div["events"]
    evidence = []
    for r in sorted(events):
        hook = hook_label(div["hook"][r])
        if not any(e.get("label") == label for e in events[r]):
            evidence.append(Evidence(f"no {label}() in {hook} (total: {plural(counts.get(r, 0), 'call')})", rank=r))
        for e in events[r]:
            evidence.append(Evidence(f"{e.get('label')}() in {hook}", rank=r, site=fmt_site(e.get("site"))))
    return evidence


CONTRACT = AllRankSave()
