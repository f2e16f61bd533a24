"""unused-parameters: every parameter DDP registered gets a gradient on every backward pass, unless
``find_unused_parameters=True`` says usage is dynamic; and that flag is not paid for when nothing
is ever unused.

Seed section "Choose using measured memory": find_unused_parameters=False only when every relevant
parameter takes part in every backward; True supports unused parameters at the price of a graph
traversal after every forward.

Checked from the traced fit. The rank-side probe hooks every parameter that requires grad when
training starts (a gradient hook per parameter, a forward hook per module owning parameters) and
wraps ``strategy.backward``, which both automatic optimization and ``manual_backward`` go through.
After every backward it writes one trace event naming the parameters that got no gradient, which
modules did not run or ran under ``torch.no_grad()``, and which parameters had requires_grad
switched off at that moment (``toggle_optimizer``). The events are written as the run goes, so a
world that DDP's reducer stopped ("Expected to have finished reduction ...", which Lightning
re-raises without parameter names) is still judged; DDP's own message is kept too and its
parameter indices are mapped back to names. A ``training_step`` that returns None under DDP (no
backward on that rank for that batch, so no parameter gets a gradient and DDP's gradient
all-reduce is skipped there) fails with its ``return None`` line, and claims the world's stop
when its peers were left waiting.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from ...claims import claim
from ...outcomes import Outcome
from ...sites import first_sentence, fmt_site, plural
from ..base import Blame, Contract, Evidence, Findings, Run, Verdict, definition_evidence, target_site
from .probe import DDP_ERROR, GRAD_CONFIG, GRAD_SETUP, GRAD_USE, STEP_NONE, UnusedParametersProbe

_INDEX_RE = re.compile(r"Parameter indices which did not receive grad for rank (\d+):\s*([\d ]+)")

_FIX_STEP_NONE = ("Keep every rank's step: mask the unusable samples out of the loss and return a loss that still "
                  "depends on the parameters when nothing is left (e.g. (self(x) * 0).sum()), so that every rank "
                  "runs backward.")

def _skipped_steps(run: Run) -> dict[int, dict]:
    """Each rank's first ``step_none`` event (its training_step returned None under DDP)."""
    out = {}
    for r, trace in enumerate(run.traces):
        first = next((e for e in trace or [] if STEP_NONE.of(e)), None)
        if first is not None:
            out[r] = first
    return out

def _rank_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))

def _group(names: list[str]) -> str:
    """'teacher.0.weight, teacher.0.bias' style list, shortened to module prefixes when long."""
    if len(names) <= 6:
        return ", ".join(names)
    prefixes: dict[str, int] = defaultdict(int)
    for n in names:
        prefixes[n.split(".")[0]] += 1
    return ", ".join(f"{p}.* ({k} tensors)" for p, k in prefixes.items())

class UnusedParameters(Contract):
    id = "unused-parameters"
    title = "Every trainable parameter gets a gradient on every backward, or DDP is told otherwise"
    rule_section = "Choose using measured memory"
    strategies = ("ddp",)
    probe_class = UnusedParametersProbe

    def blames(self, run: Run) -> int | None:
        """A rank whose training_step returned None skipped DDP's gradient all-reduce that its peers
        made: a collective-bearing step on some ranks only, the first divergence of the world."""
        if not run.finished and _skipped_steps(run):
            return Blame.CALL
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        skipped = _skipped_steps(run)
        if skipped:
            return self._step_none(run, skipped)
        setup = {r: next((e for e in t if GRAD_SETUP.of(e)), None) for r, t in enumerate(run.traces)}
        records = {r: [e for e in t if GRAD_USE.of(e)] for r, t in enumerate(run.traces)}
        ddp_errors = {r: next((e["message"] for e in t if DDP_ERROR.of(e)), None)
                      for r, t in enumerate(run.traces)}
        any_setup = next((s for s in setup.values() if s), None)
        total = sum(len(v) for v in records.values())
        if any_setup is None or (total == 0 and not any(ddp_errors.values())):
            return self.verdict(Outcome.PASSED, "no backward pass was recorded (Lightning's backward and the "
                                                "backward calls of your own code are both watched), so no parameter "
                                                "could miss a gradient.",
                                empty=True)
        if not any_setup.get("ddp"):
            return self.verdict(Outcome.SKIPPED, "the model was not wrapped in DistributedDataParallel, so "
                                                 "find_unused_parameters does not apply.")
        use = _GradUse.of(run, any_setup, records, ddp_errors)
        if not use.missing:
            return self._all_used(run, use.records, use.find_unused, use.names)
        return self._unused(run, use)

    # -- verdicts -------------------------------------------------------------------------------
    def _step_none(self, run: Run, skipped: dict[int, dict]) -> Verdict:
        """training_step returned None under DDP: no backward on that rank for that batch, so DDP's
        gradient all-reduce runs on the other ranks only (or, on every rank, nowhere)."""
        first = min(skipped.values(), key=lambda e: (e.get("epoch", 0), e.get("batch", 0)))
        when = (first.get("epoch"), first.get("batch"))
        none_ranks = sorted(r for r, e in skipped.items() if (e.get("epoch"), e.get("batch")) == when)
        others = [r for r in range(run.world_size) if r not in none_ranks]
        site = first.get("site")
        at = f"epoch {when[0]}, batch {when[1]}"
        if others:
            what = (f"training_step returned None on {_rank_words(none_ranks)} only ({at}, at {_site(site)}): "
                    f"Lightning skips backward for that batch on {'that rank' if len(none_ranks) == 1 else 'those'}, "
                    f"so DDP's gradient all-reduce runs on {_rank_words(others)} alone and pairs with nothing (the "
                    f"world hangs, or gradients of different steps are averaged)")
        else:
            what = (f"training_step returned None on every rank ({at}, at {_site(site)}): under DDP Lightning "
                    f"skips backward and DDP's gradient all-reduce for that batch")
        refused = any("returning None in distributed training" in (rk.message or "") for rk in run.job.ranks)
        if refused:
            what += "; Lightning refuses a skipped training_step in distributed training and stopped the run"
        evidence = [Evidence(f"training_step returned None at {at}: no backward, no gradient all-reduce on this rank"
                             + (f" (training_step also returns None at line(s) {', '.join(map(str, site['also']))})"
                                if site and site.get("also") else ""), rank=r, site=_site(site)) for r in none_ranks]
        for r in others:
            rk = next((x for x in run.job.ranks if x.rank == r), None)
            after = (f"; it then failed in a collective whose peer had gone ({rk.exc_type}: "
                     f"{first_sentence(rk.message, 160)})" if rk is not None and rk.status == "error" else "")
            evidence.append(Evidence(f"this rank did not skip {at}: its backward takes part in DDP's gradient "
                                     f"all-reduce for that batch, with no partner on {_rank_words(none_ranks)}{after}",
                                     rank=r))
        return self.verdict(Outcome.FAILED, what + ".", evidence=evidence, fix=_FIX_STEP_NONE)

    def _all_used(self, run, records, find_unused, names) -> Verdict:
        counts = ", ".join(f"rank {r}: {plural(len(v), 'backward')}" for r, v in records.items())
        if find_unused:
            return self.verdict(
                Outcome.ADVISORY,
                f"find_unused_parameters=True, but every one of the {len(names)} trainable parameters got a "
                f"gradient in every backward pass on every rank ({counts}). DDP still walks the autograd "
                f"graph after each forward looking for unused parameters that do not exist: wasted time that "
                f"grows with the graph. Training is correct; this is not a correctness bug.",
                evidence=[Evidence(f"{len(v)} backward pass{'' if len(v) == 1 else 'es'}, none left a trainable "
                                   f"parameter without gradient", rank=r) for r, v in records.items()]
                + [Evidence("the Trainer config that sets find_unused_parameters=True",
                            site=_site(target_site(run.target.trainer if run.target else None)))],
                fix="remove the flag (DDPStrategy(find_unused_parameters=False) is the default; use "
                    "strategy='ddp'); keep it only if some steps really skip parameters.",
                category="waste")
        outside = sorted({fmt_site(e["site"]) for v in records.values() for e in v
                          if e.get("outside") and e.get("site")})
        plain = (f"; the backward passes at {', '.join(outside)} ran outside Lightning's backward (your code "
                 f"called backward itself) and were recorded by their gradients all the same") if outside else ""
        manual = [e for v in records.values() for e in v if e.get("outside") and e.get("manual")]
        return self.verdict(
            Outcome.PASSED, f"every one of the {len(names)} trainable parameters got a gradient in every backward "
                            f"pass ({counts}){plain}; find_unused_parameters=False is right.",
            notes=[_unprepared(False)] if manual else [], claims=_unprepared_claim(len(manual)) if manual else [])

    def _unused(self, run: Run, use: _GradUse) -> Verdict:
        always, sometimes = use.always_and_sometimes()
        found = Findings()
        for r, recs in use.records.items():
            _pattern_evidence(r, recs, found)
        _ddp_error_evidence(use, found)
        if use.static and not use.find_unused and always and not sometimes:
            # A static graph records the unused set once and reuses it: correct, but they still cost memory.
            return self.verdict(
                Outcome.ADVISORY,
                f"static_graph=True lets DDP skip the same unused parameters every step, so training is correct, but "
                f"{plural(len(always), 'parameter')} ({_group(always)}) never got a gradient: they only cost "
                f"memory. Not a correctness bug.",
                evidence=found.evidence, fix="freeze them (module.requires_grad_(False)) or delete them.",
                category="waste", claims=found.claims)
        if use.find_unused:
            verdict = self._dynamic(always, sometimes, found.evidence)
            verdict.claims = found.claims if verdict.evidence else []
            return verdict
        return self._failed(run, use, always, sometimes, found)

    def _dynamic(self, always: list[str], sometimes: list[str], evidence: list[Evidence]) -> Verdict:
        """find_unused_parameters=True: right for usage that changes, waste for parameters that never train."""
        if always:
            return self.verdict(
                Outcome.ADVISORY,
                f"find_unused_parameters=True keeps the run going, but {plural(len(always), 'parameter')} "
                f"({_group(always)}) never got a gradient in any backward pass: DDP searches the graph for them "
                f"after every forward, and they only cost memory. Not a correctness bug.",
                evidence=evidence,
                fix="freeze them (module.requires_grad_(False)) or delete them, then drop "
                    "find_unused_parameters=True if nothing else needs it.",
                category="waste")
        return self.verdict(
            Outcome.PASSED,
            f"{plural(len(sometimes), 'parameter')} ({_group(sometimes)}) skip some backward passes, and "
            f"find_unused_parameters=True is set, which is what dynamic usage needs.")

    def _failed(self, run: Run, use: _GradUse, always: list[str], sometimes: list[str], found: Findings) -> Verdict:
        """find_unused_parameters=False with parameters that miss a gradient."""
        missed = [e for recs in use.records.values() for e in recs if e.get("unused")]
        unprepared = bool(missed) and all(e.get("outside") and e.get("manual") for e in missed)
        if unprepared:
            stopped = f" {_unprepared(True)}"
            found.claims += _unprepared_claim(len(missed))
        elif not run.finished:
            stopped = (" DDP's reducer then stopped the run at the next step (the reduction of the previous "
                       "backward never finished).")
        else:
            stopped = (" With this setting DDP's reducer raises 'Expected to have finished reduction in the prior "
                       "iteration' at the step after the first such backward, which Lightning re-raises as 'It "
                       "looks like your LightningModule has parameters that were not used in producing the loss' "
                       "without naming them.")
        evidence = found.evidence + _built_evidence(run, list(always) + list(sometimes))
        waits = "" if unprepared else \
            " DDP waits for a gradient of every registered parameter in every backward."
        summary = f"under DDP with find_unused_parameters=False, {_what_missed(always, sometimes)}.{waits}{stopped}"
        notes = []
        if use.forced:
            notes.append("the conformance run kept DDP going with find_unused_parameters=True so every backward "
                         "could be observed; the verdict is about your setting, find_unused_parameters=False.")
        fix = _fix(always, sometimes, "toggled" in found.causes)
        if unprepared:
            fix = "call self.manual_backward(loss) instead of backward() so DDP averages the gradients, and " + fix
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, notes=notes, claims=found.claims)

@dataclasses.dataclass
class _GradUse:
    """What the traced fit says about gradients, as the verdicts read it."""

    records: dict[int, list[dict]]                # rank -> its grad_use events, one per backward
    missing: dict[str, list[tuple[int, dict]]]    # parameter -> (rank, event) of each backward it missed
    names: list[str]                              # parameters in DDP's registration order
    ddp_errors: dict[int, str | None]             # rank -> DDP's own reducer message
    find_unused: bool                             # the user's find_unused_parameters
    forced: bool                                  # the run turned the flag on to keep observing
    static: bool                                  # static_graph=True

    @classmethod
    def of(cls, run: Run, setup: dict, records: dict, ddp_errors: dict) -> _GradUse:
        config = next((e for t in run.traces for e in t if GRAD_CONFIG.of(e)), None)
        find_unused = bool(config["user_find_unused"] if config else setup.get("find_unused"))
        names = setup.get("names", [])
        missing: dict[str, list[tuple[int, dict]]] = defaultdict(list)
        for r, recs in records.items():
            for e in recs:
                for n in e.get("unused", []):
                    missing[n].append((r, e))
        for msg in ddp_errors.values():  # DDP's own report can name a backward we did not see end
            for m in _INDEX_RE.finditer(msg or ""):
                for idx in m.group(2).split():
                    i = int(idx)
                    if i < len(names) and not missing.get(names[i]):
                        missing[names[i]].append((int(m.group(1)), {"n": None}))
        return cls(records, missing, names, ddp_errors, find_unused, bool(config and config.get("forced")),
                   bool(setup.get("static_graph")))

    def always_and_sometimes(self) -> tuple[list[str], list[str]]:
        """Parameters that miss a gradient in every recorded backward on every rank that recorded
        some, and those that miss only some, in registration order."""
        per_rank_total = {r: len(v) for r, v in self.records.items()}
        always = [n for n in self.names if n in self.missing and all(
            per_rank_total[r] == 0 or sum(1 for rr, _ in self.missing[n] if rr == r) >= per_rank_total[r]
            for r in self.records)]
        sometimes = [n for n in self.names if n in self.missing and n not in always]
        return always, sometimes

def _pattern_evidence(rank: int, recs: list[dict], found: Findings) -> None:
    """One evidence line per (backward within the step, unused set) pattern of one rank."""
    patterns: dict[tuple, list[dict]] = defaultdict(list)
    for e in recs:
        if e.get("unused"):
            patterns[(e.get("k"), tuple(e["unused"]))].append(e)
    for (k, unused), evs in patterns.items():
        first = evs[0]
        steps = sorted({(ev.get("epoch"), ev.get("batch")) for ev in evs})
        step_text = ", ".join(f"epoch {ep} batch {b}" for ep, b in steps[:6]) + (
            f" (+{len(steps) - 6} more)" if len(steps) > 6 else "")
        many = max(1, max(e.get("k", 1) for e in recs))
        which = f"backward {k} of each training step" if many > 1 else "the backward"
        code = _source(first.get("site"))
        if code:
            which += f" (`{code}`)"
        why = _why_unused(first, unused, found)
        detail = (f"{which} left {plural(len(unused), 'parameter')} without gradient: {_group(list(unused))}"
                  f" ({'; '.join(why) or 'their output did not reach the loss'}); "
                  f"in {len(steps)} of {len({(e.get('epoch'), e.get('batch')) for e in recs})} "
                  f"training steps: {step_text}")
        found.evidence.append(Evidence(detail, rank=rank, frame=first.get("site")))

def _why_unused(event: dict, unused: tuple, found: Findings) -> list[str]:
    """The reasons one grad_use event gives for its unused parameters, each from what the probe
    recorded (a module ran when its parameters were used; where requires_grad was switched off);
    notes each cause and the claims behind the sentences."""
    why = []
    usage = event.get("usage")
    if event.get("no_grad"):
        text = f"{', '.join(event['no_grad'])} ran only under torch.no_grad()"
        for m in event["no_grad"]:  # from parameter use, or (an older record) its hook under no_grad
            u = (usage or {}).get(m) or {"used": True, "grad": False}
            found.claims.append(claim("no-grad", text, module=m, used=u["used"], grad_enabled=u["grad"]))
        why.append(text)
        found.causes.add("no_grad")
    if event.get("not_run") and usage is not None:
        text = f"{', '.join(event['not_run'])} never ran in forward, none of its parameters used"
        found.claims += [claim("not-run", text, module=m, used=usage[m]["used"], hooks=usage[m]["hooks"])
                         for m in event["not_run"]]
        why.append(text)
        found.causes.add("not_run")
    elif event.get("not_run"):
        why.append(f"the forward hook of {', '.join(event['not_run'])} never fired (whether its parameters were "
                   f"used was not recorded)")
        found.causes.add("not_run")
    if event.get("off"):
        why += _switched_off(event, unused, found)
        found.causes.add("toggled")
    return why


def _switched_off(event: dict, unused: tuple, found: Findings) -> list[str]:
    """Where requires_grad was switched off for the unused parameters that had it off: the user's
    line and the library call it went through, as recorded; or said unknown."""
    groups: dict = defaultdict(list)
    for name in event["off"]:
        at = (event.get("off_at") or {}).get(name) or {}
        groups[(fmt_site(at["site"]) if at.get("site") else None, at.get("via"))].append((name, at))
    texts = []
    for (where, via), entries in groups.items():
        names = [n for n, _ in entries]
        off = "all of them" if 1 < len(names) == len(unused) and len(groups) == 1 else _group(names)
        through = f" (through {via})" if via else ""
        if where:
            text = f"requires_grad was switched off for {off} at {where}{through}"
        elif via:
            text = f"requires_grad was switched off for {off} by {via}, with no frame of your code above it"
        else:
            text = f"requires_grad was switched off for {off} before this backward (where was not recorded)"
        found.claims.append(claim("switched-off", text, params=names, site=entries[0][1].get("site"), via=via))
        texts.append(text)
    return texts

def _built_evidence(run: Run, names: list[str]) -> list[Evidence]:
    """Where the user's code built the parameters ``names``: the innermost user frame that
    registered each (``Encoder.__init__``'s ``self.fc = nn.Linear(...)``, not the parent's
    ``self.encoder = Encoder()``), one line per site; names without a recorded site fall back to the
    ``self.<attr> = ...`` of their top-level submodule."""
    built = next((e.get("built") for t in run.traces for e in t if GRAD_SETUP.of(e) and e.get("built")),
                 None) or {}
    by_site: dict = defaultdict(list)
    for n in names:
        if built.get(n):
            by_site[fmt_site(built[n])].append(n)
    out = [Evidence(f"{_group(group)} built here", frame=built[group[0]]) for group in by_site.values()]
    return out + definition_evidence(run, [n for n in names if not built.get(n)])


def _ddp_error_evidence(use: _GradUse, found: Findings) -> None:
    """DDP's own reducer message per rank, with its parameter indices mapped back to names."""
    for r, msg in use.ddp_errors.items():
        if msg:
            first_line = msg.strip().splitlines()[0][:300]
            idx = [m.group(0) for m in _INDEX_RE.finditer(msg)]
            named = []
            for m in _INDEX_RE.finditer(msg):
                named += [use.names[int(i)] for i in m.group(2).split() if int(i) < len(use.names)]
            extra = f"; {idx[0].strip()} = {_group(named)}" if idx and named else ""
            found.evidence.append(Evidence(f"DDP's reducer raised: \"{first_line}\"{extra} (Lightning re-raises it "
                                           f"as 'It looks like your LightningModule has parameters that were not "
                                           f"used' without names)", rank=r))

def _what_missed(always: list[str], sometimes: list[str]) -> str:
    if always and not sometimes:
        return (f"{plural(len(always), 'parameter')} that require grad got no gradient in any backward pass "
                f"on any rank: {_group(always)}")
    if sometimes and not always:
        return (f"{plural(len(sometimes), 'parameter')} got no gradient in some backward passes "
                f"(usage changes from backward to backward): {_group(sometimes)}")
    return (f"{plural(len(always), 'parameter')} never got a gradient ({_group(always)}) and "
            f"{plural(len(sometimes), 'more')} missed some backward passes ({_group(sometimes)})")


_OUTSIDE_MANUAL = ("ran outside Lightning's manual_backward (your code called backward itself, under manual "
                   "optimization)")


def _unprepared(missing: bool) -> str:
    """What a backward of the user's own under manual optimization means to DDP (Lightning's DDP
    strategy turns DDP's own reducer preparation off under manual optimization)."""
    waits = " and does not wait for the missing gradients there either (no error is raised)" if missing else ""
    return (f"Those backward passes {_OUTSIDE_MANUAL}, and under manual optimization only manual_backward "
            f"prepares DDP's reducer for a backward: DDP does not average their gradients over the ranks{waits}; "
            f"self.manual_backward(loss) is the call that does.")


def _unprepared_claim(count: int) -> list:
    return [claim("unprepared-backward", _OUTSIDE_MANUAL, outside=True, manual=True, count=count)]


def _fix(always: list[str], sometimes: list[str], toggled: bool) -> str:
    fixes = []
    if always:
        fixes.append("freeze what never trains (self.<module>.requires_grad_(False), and eval() for a teacher "
                     "run under torch.no_grad()) or delete modules the forward no longer calls")
    if sometimes or toggled:
        fixes.append("when usage really changes per backward (alternating GAN losses, optional branches), set "
                     "strategy='ddp_find_unused_parameters_true' (DDPStrategy(find_unused_parameters=True)) "
                     "or give each part its own DDP unit")
    fix = "; ".join(fixes) + "."
    if always:
        fix += " Turning on find_unused_parameters to hide parameters that never train costs a graph traversal " \
               "every step and keeps them in memory."
    return fix

def _source(site: dict | None) -> str | None:
    import linecache

    if not site or not site.get("file"):
        return None
    return linecache.getline(site["file"], site.get("line", 0)).strip() or None

def _site(site: dict | None) -> str | None:
    if not site:
        return None
    from ...sites import fmt_site

    return fmt_site(site)

CONTRACT = UnusedParameters()
