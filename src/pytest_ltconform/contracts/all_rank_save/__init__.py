"""all-rank-save: every collective-bearing call that user code makes happens on every rank, in
the same order.

Seed section "Sampling, metrics and writes" (and "FSDP" for sharded checkpoints):
``Trainer.save_checkpoint`` is collective (a barrier after the write; sharded strategies also
gather), so it belongs on every rank; a rank-zero guard is for plain file writes only.

Checked from the traced fit: every user-level call of ``Trainer.save_checkpoint``, the
strategy's ``barrier``/``broadcast``/``reduce``/``all_gather``, ``LightningModule.all_gather``
and raw ``torch.distributed`` collectives, from the module or a user callback, aligned across
ranks hook by hook. A call made on a subset of ranks fails with its call site, the rank guard
found in the source and per-rank counts.

Under the CPU sharded tier (FSDP on gloo ranks) a probe (``probe.py``) also saves a sharded checkpoint on every
rank after fit and resumes a short fit from that directory with the matching strategy, and every
``load_from_checkpoint`` call is recorded: one given a sharded checkpoint directory fails (that
path is unsupported; the fix is ``Trainer(ckpt_path=dir)`` with the same strategy, or
consolidating the directory first).
"""

from __future__ import annotations

import re
from collections import Counter

from ...sites import fmt_site, hook_label, plural
from ...world.diagnose import first_divergence
from ..base import Blame, Contract, Evidence, Run, Verdict, rank_guard
from .probe import ShardedSaveProbe

# Layouts of a checkpoint path that load_from_checkpoint cannot read.
SHARDED_LAYOUTS = {"fsdp": "an FSDP sharded checkpoint (torch.distributed.checkpoint: per-rank .distcp files "
                           "and .metadata)",
                   "deepspeed": "a DeepSpeed checkpoint directory (per-rank ZeRO shards)",
                   "directory": "a directory, not a checkpoint file"}


def user_call(event: dict) -> bool:
    return event.get("ev") == "call" and bool(event.get("user"))


def _counts(run: Run, label: str) -> dict[int, int]:
    return {r: sum(1 for e in t if user_call(e) and e.get("label") == label) for r, t in enumerate(run.traces)}


class AllRankSave(Contract):
    id = "all-rank-save"
    title = "Checkpoint saves and other collectives are called on every rank"
    seed = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp")
    probe_class = ShardedSaveProbe

    def blames(self, run: Run) -> int | None:
        """A collective-bearing call some ranks made and the others did not stopped the world;
        a load_from_checkpoint that raised on a sharded directory names this contract too."""
        return Blame.CALL if "call" in run.divergent_events() else super().blames(run)

    def judge(self, run: Run) -> Verdict:
        div = first_divergence(run.traces, select=user_call)
        if div is not None and div["kind"] == "calls":
            return self._diverged(run, div)
        loads = [(r, e) for r, t in enumerate(run.traces) for e in t
                 if e.get("ev") == "load" and e.get("layout") in SHARDED_LAYOUTS]
        if loads:
            return self._sharded_load(run, loads)
        round_trip = self._round_trip(run)
        if isinstance(round_trip, Verdict):
            return round_trip
        calls = Counter(e.get("label") for e in run.events(0, "call") if user_call(e))
        if calls:
            listing = ", ".join(f"{label} x{n}" for label, n in sorted(calls.items()))
            summary = ("every rank made the same collective-bearing calls from user code, in the same order "
                       f"({listing}).")
        else:
            summary = "user code makes no collective-bearing call (saves, barriers, collectives) of its own."
        if round_trip:
            summary = f"{summary} {round_trip}"
        return self.verdict("passed", summary)

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
                  if e.get("ev") == "raised" and e.get("in") == "load_from_checkpoint"}
        arg = re.search(r"load_from_checkpoint\((.*)\)", source)
        summary = (f"{first.get('label')}({arg.group(1) if arg else 'path'}) in {first.get('hook') or 'user code'} on "
                   f"{who} is given {layout}{made_by}: load_from_checkpoint reads one checkpoint file and does "
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
        fix = ("load a sharded checkpoint with the strategy that wrote it: Trainer(strategy=<the same strategy>)"
               ".fit/validate/test(model, ckpt_path=dir) on every rank; for a single weights file, consolidate "
               "the directory first (FSDP: `python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`; "
               "DeepSpeed: zero_to_fp32.py in the directory), or save with state_dict_type='full'.")
        return Verdict(contract=self.id, outcome="failed", summary=summary, evidence=evidence, fix=fix, seed="FSDP")

    def _round_trip(self, run: Run):
        """The CPU sharded tier's save-and-resume: a sentence for a passing verdict, a failed
        Verdict, or None when no sharded run was made."""
        data = [d.get("sharded") if d else None for d in run.probe(self.id)]
        done = [(r, d) for r, d in enumerate(data) if d]
        if not done:
            return None
        failures = [(r, d) for r, d in done if d.get("error") or not (d.get("restored_ok") or d.get("unchecked"))]
        first = done[0][1]
        files = ", ".join(first.get("files") or []) or "nothing"
        if not failures and first.get("unchecked"):
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}). Resuming the fit from "
                    f"it failed in Lightning 2.6.6 ({first.get('limitation')}) because the optimizer keeps no "
                    f"state (e.g. plain SGD), and the restored weights were not compared: "
                    f"{first['unchecked']}.")
        if not failures and first.get("limitation"):
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}), and every rank's "
                    f"parameter shard restored from it with the matching strategy (state_dict_type='sharded') "
                    f"through validate(ckpt_path=dir). Resuming the fit from it failed in Lightning 2.6.6 "
                    f"({first['limitation']}): the optimizer keeps no state (e.g. plain SGD), which the sharded "
                    f"format drops, so the optimizer is refused on resume; an optimizer with state (such as "
                    f"Adam) resumes.")
        if not failures:
            return (f"Under FSDP every rank saved a sharded checkpoint directory ({files}) and a fit resumed from "
                    f"it with the matching strategy (state_dict_type='sharded'): step {first.get('saved_step')} "
                    f"and every rank's parameter shard restored.")
        evidence = []
        for r, d in failures:
            if d.get("error"):
                evidence.append(Evidence(f"{d.get('phase', 'resume')} raised {d['error']}", rank=r))
            else:
                evidence.append(Evidence(
                    f"after resuming: step {d.get('restored_step')} (saved {d.get('saved_step')}), parameter "
                    f"checksum {d.get('restored_checksum')} (saved {d.get('saved_checksum')})", rank=r))
        summary = (f"a sharded checkpoint saved on every rank after fit ({files}) could not be resumed with the "
                   f"matching strategy (Trainer(ckpt_path=dir), FSDP state_dict_type='sharded').")
        fix = ("keep the sharded directory's files together and resume with the strategy that wrote it; make "
               "sure every rank builds the same modules (same names and shapes) before the checkpoint loads.")
        return Verdict(contract=self.id, outcome="failed", summary=summary, evidence=evidence, fix=fix, seed="FSDP")

    def _diverged(self, run: Run, div: dict) -> Verdict:
        events = div["events"]
        # The call some ranks made and the others did not make at this point.
        present = {r: evs for r, evs in events.items() if evs}
        first_rank, first_events = next(iter(present.items()))
        call = first_events[0]
        label = call.get("label")
        makers = sorted(r for r, evs in events.items() if any(e.get("label") == label for e in evs))
        missing = sorted(set(events) - set(makers))
        counts = _counts(run, label)
        guard = rank_guard(call.get("site"))
        hook = hook_label(div["hook"][first_rank])
        site = fmt_site(call.get("site"))
        count_text = ", ".join(f"rank {r}: {counts[r]}{'+' if not run.finished else ''} "
                               f"call{'s' if counts[r] != 1 else ''}" for r in sorted(counts))
        who = f"rank {makers[0]} only" if len(makers) == 1 else f"ranks {', '.join(map(str, makers))} only"
        if missing:
            summary = (f"{label} called on {who} ({count_text}) from {hook}"
                       + (f" under an `{guard}` guard" if guard else "")
                       + f", at {site}. The other rank(s) never enter the collective, so the world "
                       f"hangs or mismatches collectives.")
        else:
            summary = (f"the ranks made different collective-bearing calls in {hook} ({count_text}); "
                       f"collectives must pair up in the same order on every rank.")
        evidence = _call_evidence(div, label, counts)
        if guard:
            evidence.append(Evidence(f"the call is guarded by `{guard}`", site=site))
        fix = _FIXES.get(label) or (f"make {label}() on every rank, in the same order; if only one rank needs "
                                    f"the result, call it everywhere and use it on that rank.")
        notes = []
        if label == "Trainer.save_checkpoint" and run.strategy == "fsdp":
            notes.append("under FSDP the save is itself a gather: building the checkpoint's state dict collects "
                         "every rank's parameter shards, so the one-sided save ran that gather alone and it "
                         "met the other rank's next collectives (a crash, a hang or garbage, depending on timing).")
        if not run.finished:
            notes.append("the world did not finish: the one-sided call left the other ranks waiting "
                         "(see where each rank was, below).")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="deadlock", notes=notes)


_FIXES = {"Trainer.save_checkpoint": ("call trainer.save_checkpoint on every rank (Lightning writes the file from "
                                      "rank 0 only, and sharded strategies need every rank to gather); keep the "
                                      "rank-zero guard for plain side work such as printing or copying files.")}


def _call_evidence(div: dict, label: str, counts: dict[int, int]) -> list[Evidence]:
    """One line per call each rank made at the divergence, or the call it did not make."""
    events = div["events"]
    evidence = []
    for r in sorted(events):
        if events[r]:
            for e in events[r]:
                evidence.append(Evidence(f"{e.get('label')}() in {hook_label(div['hook'][r])}",
                                         rank=r, site=fmt_site(e.get("site"))))
        else:
            evidence.append(Evidence(f"no {label}() in {hook_label(div['hook'][r])} "
                                     f"(total: {plural(counts.get(r, 0), 'call')})", rank=r))
    return evidence


CONTRACT = AllRankSave()
