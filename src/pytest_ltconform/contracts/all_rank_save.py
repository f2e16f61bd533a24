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
"""

from __future__ import annotations

from collections import Counter

from ..world.diagnose import first_divergence, fmt_site, hook_label
from .base import Contract, Evidence, Run, Verdict, rank_guard


def user_call(event: dict) -> bool:
    return event.get("ev") == "call" and bool(event.get("user"))


def _counts(run: Run, label: str) -> dict[int, int]:
    return {r: sum(1 for e in t if user_call(e) and e.get("label") == label) for r, t in enumerate(run.traces)}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class AllRankSave(Contract):
    id = "all-rank-save"
    title = "Checkpoint saves and other collectives are called on every rank"
    seed = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp")

    def judge(self, run: Run) -> Verdict:
        div = first_divergence(run.traces, select=user_call)
        if div is not None and div["kind"] == "calls":
            return self._diverged(run, div)
        calls = Counter(e.get("label") for e in run.events(0, "call") if user_call(e))
        if calls:
            listing = ", ".join(f"{label} x{n}" for label, n in sorted(calls.items()))
            summary = ("every rank made the same collective-bearing calls from user code, in the same order "
                       f"({listing}).")
        else:
            summary = "user code makes no collective-bearing call (saves, barriers, collectives) of its own."
        return self.verdict("passed", summary)

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
        evidence = []
        for r in sorted(events):
            if events[r]:
                for e in events[r]:
                    evidence.append(Evidence(f"{e.get('label')}() in {hook_label(div['hook'][r])}",
                                             rank=r, site=fmt_site(e.get("site"))))
            else:
                evidence.append(Evidence(f"no {label}() in {hook_label(div['hook'][r])} "
                                         f"(total: {_plural(counts.get(r, 0), 'call')})", rank=r))
        if guard:
            evidence.append(Evidence(f"the call is guarded by `{guard}`", site=site))
        if label == "Trainer.save_checkpoint":
            fix = ("call trainer.save_checkpoint on every rank (Lightning writes the file from rank 0 "
                   "only, and sharded strategies need every rank to gather); keep the rank-zero "
                   "guard for plain side work such as printing or copying files.")
        else:
            fix = (f"make {label}() on every rank, in the same order; if only one rank needs the "
                   f"result, call it everywhere and use it on that rank.")
        notes = []
        if not run.finished:
            notes.append("the world did not finish: the one-sided call left the other ranks waiting "
                         "(see where each rank was, below).")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="deadlock", notes=notes)


CONTRACT = AllRankSave()
