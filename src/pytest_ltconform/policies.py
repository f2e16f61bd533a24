"""What a run means for the items judged on it: one ordered list of policies, read by the
contract items (``session.verdict``) and by the run's own item (``session.run_failure``).

Each :class:`Policy` answers for one situation (an earlier run hung, no world started, the ranks
skipped, the run finished, a contract claims its stop, ...) what a contract item's verdict is
(``item``), what the run item records (``record``), or how it refines a verdict already reached
(``refine``); a policy that does not apply answers None and the next one is asked. The first
answer decides; refinements after it may replace it. No contract is named here: a contract's
claim on a stop comes from the registry (``contracts.blamed``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from . import contracts
from .claims import Claim, claim
from .contracts.base import Run, Verdict
from .events import HOOK, HOOK_EXIT, NONFINITE, NOTE, STAGE, STAGE_ERROR, STRATEGY
from .outcomes import Outcome
from .runs import FIT, FIT_WITHOUT_VALIDATION, WITHOUT_VALIDATION
from .sites import fmt_site
from .vocabulary import SHARDED_STRATEGIES, STRATEGY_NAMES, unnamed_tier
from .world import WorldStartError
from .world.causes import cause_text, cpu_specific, exception_words, first_cause, raised_words, stopped_where


class Case:
    """One item's question about a run: ``contract`` under ``strategy`` in ``tier``, asked of
    ``session`` (which makes and caches the runs; None for a run judged on its own, ``run``).
    ``item`` names the run's own item (``fit[ddp]``) when that item asks. The facts the policies
    read are taken once each, when first read."""

    def __init__(self, contract, strategy: str, tier: str = "cpu", session: Any = None, run: Run | None = None,
                 ddp: Run | None = None, item: str | None = None):
        self.contract, self.strategy, self.tier, self.session, self.item = contract, strategy, tier, session, item
        self.judge_failed = False  # the contract's verdict raised (see :attr:`judged`)
        if run is not None:
            self.made = run
        if session is None:
            self.hung, self.ddp = None, ddp

    @functools.cached_property
    def _made_or_hung(self) -> tuple[Run | WorldStartError | None, Run | None]:
        # One question, so that no other run of the target (an xdist worker's) starts in between.
        return self.session.run_or_hung(self.contract.run_spec, self.strategy, self.tier)

    @functools.cached_property
    def hung(self) -> Run | None:
        """An earlier run of the target that hung where this one would (``session.hung_before``)."""
        return self._made_or_hung[1]

    @functools.cached_property
    def made(self) -> Run | WorldStartError:
        """The run (made once, by whichever xdist worker asked first), or the WorldStartError that
        stopped it; None when :attr:`hung` stopped it from starting."""
        return self._made_or_hung[0]

    @property
    def run(self) -> Run:
        return self.made

    @functools.cached_property
    def ddp(self) -> Run | None:
        """The same module's ddp run, when this one is sharded (see :func:`not_a_sharded_module`)."""
        return self.session.ddp_run(self.run, self.tier) if self.strategy in SHARDED_STRATEGIES else None

    @functools.cached_property
    def judged(self) -> Verdict:
        """The contract's own verdict on the run, with the notes of what ran in place of the user's
        settings; a bug of ours in the verdict is an error, never a verdict on the user's code."""
        contract, run = self.contract, self.run
        try:
            verdict = contract.judge(run)
        except Exception as exc:
            import traceback

            self.judge_failed = True
            return contract.verdict(Outcome.ERROR, f"the {contract.id} verdict itself failed: {type(exc).__name__}: "
                                                   f"{exc}", diagnosis=traceback.format_exc())
        # What ran in place of the user's strategy (e.g. their FSDP/DeepSpeed config as CPU FSDP).
        # Every distinct note, in order: the tier's, then each optimizer substituted on CPU.
        tier_notes = [t for t in dict.fromkeys(e.get("text") for e in run.events(0, NOTE)) if t]
        verdict.notes[:0] = [t for t in tier_notes if t not in verdict.notes]
        return verdict

    @functools.cached_property
    def owner(self) -> str | None:
        """The contract that claims why the unfinished run stopped (``contracts.blamed``)."""
        return contracts.blamed(self.run)

    @property
    def unconfigured_sharded(self) -> bool:
        """A sharded run the user's Trainer config does not ask for (traced runs say; others never do)."""
        configured = any(e.get("configured") for e in self.run.events(0, STRATEGY))
        return self.run.strategy in SHARDED_STRATEGIES and not configured


class RunRecord(NamedTuple):
    """What the run's own item (``fit[ddp]``) records: its outcome, its message, and the claims
    (:mod:`.claims`) the message's sentences rest on, so the report checks them as it checks a
    contract item's."""

    outcome: Outcome
    text: str
    claims: tuple[Claim, ...] = ()

    @classmethod
    def of(cls, outcome: Outcome, verdict: Verdict) -> RunRecord:
        """The record, as ``outcome``, that says what ``verdict`` says (its summary), with the claims
        made in it."""
        return cls(outcome, verdict.summary,
                   tuple(c for c in verdict.all_claims() if c.text and c.text in verdict.summary))


@dataclasses.dataclass(frozen=True)
class Policy:
    """One situation and what it means: ``item(case)`` a contract item's verdict, ``record(case)``
    the run item's ``(Outcome, text)``, ``refine(case, verdict)`` a better verdict than one an
    earlier policy gave; each None where the policy does not apply. ``before_run``: it is asked
    before there is a run to judge (and what it decides is final)."""

    name: str
    item: Callable[[Case], Verdict | None] | None = None
    record: Callable[[Case], RunRecord | None] | None = None
    refine: Callable[[Case, Verdict], Verdict | None] | None = None
    before_run: bool = False


def not_judged(contract, reason: str, item: str | None = None) -> Verdict:
    """The verdict of an item that cannot be judged because of another item's failure (``item``,
    when one is named): not judged, with the reason in one line naming that item, and no traceback
    of its own."""
    return contract.not_judged(reason, depends_on=item, category="consequence")


# -- before there is a run -------------------------------------------------------------------------

def hung_verdict(contract, hung: Run) -> Verdict:
    """Not judged, without starting a run, because an earlier run of the target hung (one line
    naming the first item judged on it and where the hung rank was)."""
    cause = first_cause(hung.job)
    where = f"rank {cause.rank} at {fmt_site(cause.site)}" if cause and cause.site else \
        f"rank {cause.rank}" if cause else "a rank"
    item = hung.cause_item or hung.first_item or f"{hung.kind}[{hung.label}]"
    until = f"until {hung.job.timed_out_by}" if hung.job.timed_out_by else f"and was killed {hung.job.killed_early}"
    return not_judged(contract, f"not started: the {hung.kind}[{hung.label}] run of this target hung "
                                f"({where} stopped making progress {until}), and this run "
                                f"would reach the same code (see {item}).", item)


def _hung_item(case: Case) -> Verdict | None:
    return hung_verdict(case.contract, case.hung) if case.hung is not None else None


def _hung_record(case: Case) -> RunRecord | None:
    return RunRecord.of(Outcome.SKIPPED, hung_verdict(case.contract, case.hung)) if case.hung is not None else None


def _no_world_item(case: Case) -> Verdict | None:
    if isinstance(case.made, WorldStartError):
        return case.contract.verdict(Outcome.ERROR, f"could not start a world: {case.made}")
    if case.run.first_item is None:
        case.run.first_item = f"{case.contract.id}[{case.run.label}]"  # what a later item names when this run hung
    for spec in case.contract.observes:  # the runs the contract reads besides its own
        try:
            case.run.observed[spec.name] = case.session.run_for(spec, case.strategy, case.tier)
        except WorldStartError:
            pass  # the contract judges its own run without it
    return None


def _no_world_record(case: Case) -> None:
    if isinstance(case.made, WorldStartError):
        raise case.made  # the run item says the machine could not start a world
    return None


# -- the run -----------------------------------------------------------------------------------------

def _skipped_reason(run: Run) -> str:
    return next((r.message for r in run.job.ranks if r.message), "skipped inside the ranks")


def _skipped_item(case: Case) -> Verdict | None:
    return case.contract.verdict(Outcome.SKIPPED, _skipped_reason(case.run)) if case.run.job.status == "skip" else None


def _skipped_record(case: Case) -> RunRecord | None:
    return RunRecord(Outcome.SKIPPED, _skipped_reason(case.run)) if case.run.job.status == "skip" else None


def _verdict_failed_item(case: Case) -> Verdict | None:
    verdict = case.judged
    return verdict if case.judge_failed else None


def _finished_item(case: Case) -> Verdict | None:
    return case.judged if case.run.finished else None


def _finished_record(case: Case) -> RunRecord | None:
    if not case.run.finished:
        return None
    return RunRecord(Outcome.PASSED, f"{what_ran(case.run)}. This item records the run; the contract items judge it.")


def _finding_item(case: Case) -> Verdict | None:
    """A finding on a run that stopped stands, with the hang diagnosis, when it is the stop's
    owner's or no rank raised in the user's code (else what its peers did next is no finding)."""
    verdict = case.judged
    if verdict.finding and (case.owner == case.contract.id or not case.run.raised_in_user_code()):
        verdict.diagnosis = case.run.job.diagnosis
        return verdict
    return None


def _owned_item(case: Case) -> Verdict | None:
    if case.owner is None or case.owner == case.contract.id:
        return None
    return after_owned_failure(case.contract, case.run, case.judged, case.owner)


def _owned_record(case: Case) -> RunRecord | None:
    if case.owner is None:
        return None
    # The stop is a contract's finding: its item fails, once; this record does not fail again.
    return RunRecord(Outcome.PASSED, f"the run stopped because of the {case.owner}[{case.run.label}] failure (see "
                                     f"that item); this item only records the run.")


def _owner_not_judged_item(case: Case) -> Verdict | None:
    """The contract that claims why the run stopped says why it could judge nothing (a call the
    plugin cannot run on CPU ranks, at the user's line): that verdict stands, not an error."""
    verdict = case.judged
    return verdict if case.owner == case.contract.id and verdict.not_judged is not None else None


def _sharded_item(case: Case) -> Verdict | None:
    if case.owner is not None or not case.unconfigured_sharded:
        return None
    return not_a_sharded_module(case.contract, case.run, case.ddp)


def _sharded_record(case: Case) -> RunRecord | None:
    skipped = _sharded_item(case)
    # The contract items' words, and the claims made in them.
    return RunRecord.of(Outcome.SKIPPED, skipped) if skipped is not None else None


def _plugin_choice_item(case: Case) -> Verdict | None:
    """The stop follows only from what the plugin's own run chose (a save format the user's config
    never writes): not judged, on every item of the run; the explaining contract's item adds the advisory."""
    if case.owner is not None or case.run.finished:
        return None
    found = contracts.plugin_choice(case.run)
    if found is None:
        return None
    cid, reason, advisory, said = found
    notes = [advisory] if cid == case.contract.id else []
    if case.unconfigured_sharded:  # a strategy the config does not name: skipped, as a sharded stop is
        return case.contract.verdict(Outcome.SKIPPED, f"{reason}, so this item is not judged; the Trainer config "
                                                      f"does not name {_tier_text(case.run)}.", notes=notes,
                                     claims=list(said))
    return case.contract.not_judged(f"{reason}.", notes=notes, claims=list(said))


def _plugin_choice_record(case: Case) -> RunRecord | None:
    verdict = _plugin_choice_item(case)
    return RunRecord.of(Outcome.SKIPPED, verdict) if verdict is not None else None


def _own_failure_item(case: Case) -> Verdict:
    return after_own_failure(case.contract, case.run)


def _own_failure_record(case: Case) -> RunRecord:
    run, item = case.run, case.item
    cause = first_cause(run.job)
    headline = cause.headline() if cause is not None else "the run did not finish"
    run.cause_item = item
    run.first_item = run.first_item or item
    parts = [cause_text(cause), run.job.diagnosis_after(cause)] if cause is not None else [run.job.failure_text()]
    lines = [f"[{item}] the run did not finish: {headline}."] + [p for p in parts if p]
    return RunRecord(Outcome.ERROR, "\n".join(lines))


def after_owned_failure(contract, run: Run, verdict: Verdict, owner: str) -> Verdict:
    """The run stopped because of ``owner``'s failure: a contract that found nothing on what every
    rank recorded passes on that part; one that needs the run's end, or that recorded nothing of
    what it judges (``Verdict.empty``), is not judged."""
    item = f"{owner}[{run.label}]"
    if verdict.outcome is Outcome.PASSED and not reached_a_step(run):
        # Nothing to judge: a pass on a run that stopped in its setup would be vacuous.
        return not_judged(contract, f"the shared {run.kind} run stopped before its first step because of the "
                                    f"{item} failure (see that item).", item)
    if verdict.outcome is Outcome.PASSED and verdict.empty:
        return not_judged(contract, f"the shared {run.kind} run stopped because of the {item} failure before "
                                    f"anything this contract judges was recorded (see that item).", item)
    if verdict.outcome is Outcome.PASSED:
        verdict.partial = True
        verdict.notes.append(
            f"the world stopped early because of the {item} failure, so this contract was "
            f"judged on what every rank recorded up to that point, where it found nothing wrong."
        )
        return verdict
    return not_judged(contract, f"the shared {run.kind} run did not finish because of the {item} failure "
                                f"(see that item), and this contract needs the run's end.", item)


def not_a_sharded_module(contract, run: Run, ddp: Run | None = None) -> Verdict | None:
    """The user's config does not ask for this sharded strategy; a module that cannot run under it
    is information for them, not a verdict on this contract. When ``ddp`` (the ddp run) stopped
    the same way (the same exception at the same user line), the strategy is not the cause: the
    item points at the ddp item instead."""
    cause = first_cause(run.job)
    if cause is None:
        return None
    same = _same_stop_under_ddp(cause, ddp)
    if same is not None:
        where = f"in your code under every strategy ({cause.exc_type} at {fmt_site(cause.site)}" if cause.site \
            else f"the same way under ddp, so not because of the strategy ({cause.exc_type}"
        return not_judged(contract, f"the fit run stops {where}: {cause.message}) (see {same}).", same)
    name = "FSDP" if run.strategy == "fsdp" else STRATEGY_NAMES.get(run.strategy, run.strategy)
    # "on CPU" only when the recorded failure is particular to CPU ranks; else the cause and its lines.
    cpu = cpu_specific(cause) if cause.kind == "raised" else None
    where = f"on CPU gloo ranks ({raised_words(cause)}; {cpu})" if cpu else f"({raised_words(cause)})"
    said = claim("cpu-only", f"does not run under {name} on CPU",
                 ddp="not run" if ddp is None else "finished" if ddp.finished else "stopped differently")
    return contract.verdict(Outcome.SKIPPED, f"the module does not run under {name} {where}; the Trainer config "
                                             f"does not name {_tier_text(run)}.", claims=[said] if cpu else [])


def _tier_text(run: Run) -> str:
    return unnamed_tier(run.strategy)


def after_own_failure(contract, run: Run) -> Verdict:
    """No contract's rule explains why the run stopped: a rank failed on its own (the user's
    code raised, a rank died or hung). The first item judged on the run leads with that rank's
    own exception at the user's line and shows its traceback once; the peers' transport errors
    are named in one line as consequences; every later item says in one line where to look."""
    cause = first_cause(run.job)
    item = f"{contract.id}[{run.label}]"
    headline = cause.headline() if cause is not None else "the run did not finish"
    if run.cause_item in (None, item):
        run.cause_item = item
        # failure_text() already ends with the diagnosis; a cause's text needs it, less what it named.
        parts = [cause_text(cause), run.job.diagnosis_after(cause)] if cause is not None \
            else [run.job.failure_text()]
        found = contract.verdict(Outcome.ERROR, f"the run did not finish: {headline}.", category="crash",
                                 diagnosis="\n".join(p for p in parts if p))
        found.stopped_in = stopped_where(cause)
        return found
    return not_judged(contract, f"the shared {run.kind} run did not finish because {headline} "
                                f"(see {run.cause_item}).", run.cause_item)


def _same_stop_under_ddp(cause, ddp: Run | None) -> str | None:
    """The item that reports ``ddp``'s stop when it raised ``cause``'s exception type at the same
    user line (so no strategy is to blame); None otherwise."""
    if ddp is None or ddp.finished or cause.kind != "raised":
        return None
    theirs = first_cause(ddp.job)
    if theirs is None or theirs.kind != "raised" or theirs.exc_type != cause.exc_type:
        return None
    if cause.site or theirs.site:
        if not (cause.site and theirs.site) or (theirs.site.get("file"), theirs.site.get("line")) != \
                (cause.site.get("file"), cause.site.get("line")):
            return None
    elif theirs.message != cause.message:  # no user frame raised: the same exception, word for word
        return None
    owner = contracts.blamed(ddp)
    return f"{owner}[{ddp.label}]" if owner else ddp.cause_item or f"fit[{ddp.label}]"


# -- refinements of a verdict reached -----------------------------------------------------------------

def _without_validation(case: Case, verdict: Verdict) -> Verdict | None:
    """The verdict on a fit with validation switched off, when the shared fit stopped inside
    validation (or its sanity check) because of another contract's failure and this contract
    was left not judged or judged on a part only; None when that fit does not judge it either.

    Only a failure, or a pass that recorded what the contract judges on a finished fit, is
    taken: a stop of the second fit is never blamed on the user."""
    contract, fit = case.contract, case.run
    if contract.run_spec != FIT or fit.finished or not stopped_in_validation(fit):
        return None
    owner = contracts.blamed(fit)
    if owner is None or owner == contract.id or not (verdict.category == "consequence" or verdict.partial):
        return None
    run = case.session.second_run(FIT_WITHOUT_VALIDATION, fit.strategy, case.tier, probes_of=FIT)
    if run is None:
        return None
    second = judge(contract, run)
    if not (second.finding or (run.finished and second.outcome is Outcome.PASSED and not second.empty)):
        return None
    switched = ", ".join(f"{k}={v}" for k, v in WITHOUT_VALIDATION.items())
    second.notes.append(f"judged on a second fit with validation switched off ({switched}): the shared fit "
                        f"stopped in validation because of the {owner}[{fit.label}] failure (see that item).")
    return second


def _explained_by_fit(case: Case, verdict: Verdict) -> Verdict | None:
    """A run of another kind that failed on a module whose traced fit (in the same tier)
    already stopped because of a named contract: say so in one line instead of repeating the
    tracebacks."""
    contract, strategy = case.contract, case.strategy
    if verdict.outcome is not Outcome.ERROR or contract.run_spec == FIT:
        return None
    fit = case.session.made_run(FIT.name, strategy, case.tier)
    if fit is None or fit.finished:
        return None
    owner = contracts.blamed(fit)
    if owner is None:
        return _same_failure_as_fit(case, fit)
    if owner == contract.id:
        return None
    return not_judged(contract, f"its own run did not finish either; the module's fit does not finish "
                                f"because of the {owner}[{fit.label}] failure (see that item).",
                      f"{owner}[{fit.label}]")


def _same_failure_as_fit(case: Case, fit: Run) -> Verdict | None:
    """This item's own run stopped the way the traced fit did (the same rank failure at the same
    user line): one fault shows one traceback, on the fit's first item; this one names it."""
    own = case.session.made_run(case.contract.run_spec.name, case.strategy, case.tier)
    mine, theirs = (first_cause(own.job) if own is not None else None), first_cause(fit.job)
    item = fit.cause_item
    if mine is None or theirs is None or item is None or \
            (mine.kind, mine.exc_type, mine.site) != (theirs.kind, theirs.exc_type, theirs.site):
        return None
    return not_judged(case.contract, f"its own run stopped the same way as the fit: {mine.headline()} (see "
                                     f"{item}).", item)


def _own_run_stopped(case: Case, verdict: Verdict) -> Verdict | None:
    """Not judged, when the plugin's own run (``RunSpec.own``: a replay, a reference, an
    inspection) stopped on its own: which run it was, the exception with the frame that raised
    it and the user's frame on the way, and whether the user's own config reaches that code
    (its traced fit of the strategy ran without it, or no traced fit ran). None when the run is
    the user's config, or the traced fit stopped too (that item reports it)."""
    contract = case.contract
    spec, cause = contract.run_spec, first_cause(case.run.job)
    if verdict.outcome is not Outcome.ERROR or spec == FIT or not spec.own or cause is None or \
            verdict.category != "crash":
        return None
    fit = case.session.made_run(FIT.name, case.strategy, case.tier) if case.session is not None else None
    if fit is not None and not fit.finished:
        return None
    label = case.run.label  # the item parameter (ddp, ddp-2nodes): the fit item of this tier is named so
    reach = (f"your config's traced fit[{label}] finished without it, so this stop is the plugin's own "
             f"run's, not a finding" if fit is not None else
             f"whether your config reaches that code is not known here (no traced fit[{label}] ran in "
             f"this session)")
    found = not_judged(contract, f"{spec.described()} stopped: {raised_words(cause)}; {reach}.")
    found.category = None
    found.diagnosis = verdict.diagnosis  # the traceback, once, on this item
    return found


def _nonfinite_loss(case: Case, verdict: Verdict) -> Verdict | None:
    """Not judged, naming the loss, its rank, step and the user's line, when a contract that
    compares values (``needs_finite_loss``) is judged on a run (or a traced fit of the same
    strategy) whose training loss was nan or inf: nothing compared on top of it means anything."""
    contract = case.contract
    if not contract.needs_finite_loss:
        return None
    for made in (case.run, case.session.made_run(FIT.name, case.strategy, case.tier)):
        found = first_nonfinite(made) if made is not None else None
        if found is not None:
            rank, e = found
            return not_judged(contract, (
                f"the training loss was {e.get('loss')} on rank {rank} at step {e.get('step')} (epoch "
                f"{e.get('epoch')}, batch {e.get('batch_idx')}), returned at {fmt_site(e.get('site'))}: "
                f"values compared across ranks or runs mean nothing on top of a non-finite loss, so "
                f"{contract.id} judged none. Fix the loss first (a log or division of zero, an overflow, a "
                f"learning rate too high), then run again."))
    return None


# -- the list ---------------------------------------------------------------------------------------

POLICIES: tuple[Policy, ...] = (
    Policy("an earlier run of the target hung where this one would", _hung_item, _hung_record, before_run=True),
    Policy("no world could start", _no_world_item, _no_world_record, before_run=True),
    Policy("the ranks skipped", _skipped_item, _skipped_record),
    Policy("the contract's verdict itself failed", _verdict_failed_item),
    Policy("the run finished", _finished_item, _finished_record),
    Policy("a finding on a run that stopped", _finding_item),
    Policy("a contract claims why the run stopped", _owned_item, _owned_record),
    Policy("the contract that claims the stop could judge nothing", _owner_not_judged_item),
    Policy("the stop follows from a format the plugin chose", _plugin_choice_item, _plugin_choice_record),
    Policy("a sharded run the config does not ask for stopped", _sharded_item, _sharded_record),
    Policy("a rank failed on its own", _own_failure_item, _own_failure_record),
    Policy("the fit stopped in validation: judged on a fit without it", refine=_without_validation),
    Policy("another kind of run stopped as the fit did", refine=_explained_by_fit),
    Policy("the plugin's own run stopped on its own", refine=_own_run_stopped),
    Policy("the training loss was not finite", refine=_nonfinite_loss),
)


def item_verdict(case: Case) -> Verdict:
    """A contract item's verdict: the first policy's that answers, refined by the later ones
    (a policy asked before the run decides for good)."""
    verdict = None
    for policy in POLICIES:
        if verdict is None and policy.item is not None:
            verdict = policy.item(case)
            if verdict is not None and policy.before_run:
                return verdict
        elif verdict is not None and policy.refine is not None:
            verdict = policy.refine(case, verdict) or verdict
    return verdict


def run_record(case: Case) -> RunRecord:
    """What the run's own item (``case.item``) records: the first policy's answer."""
    for policy in POLICIES:
        said = policy.record(case) if policy.record is not None else None
        if said is not None:
            return said
    raise AssertionError("a rank failed on its own answers for every run")  # the last policy always answers


def judge(contract, run: Run, ddp: Run | None = None) -> Verdict:
    """Apply ``contract`` to ``run`` by the policies that judge a made run, deciding what an
    unfinished world means for it; ``ddp`` is the same module's ddp run, when ``run`` is a
    sharded one (see :func:`not_a_sharded_module`)."""
    case = Case(contract, run.strategy, run=run, ddp=ddp)
    for policy in POLICIES:
        if not policy.before_run and policy.item is not None:
            verdict = policy.item(case)
            if verdict is not None:
                return verdict
    raise AssertionError("a rank failed on its own answers for every run")


# -- what the runs' traces say ---------------------------------------------------------------------

def first_nonfinite(run: Run) -> tuple[int, dict] | None:
    """(rank, event) of the earliest non-finite training loss a rank recorded (lowest step,
    then rank); None when every loss was finite."""
    found = [(e.get("step", 0), r, e) for r, trace in enumerate(run.traces) for e in trace if NONFINITE.of(e)]
    if not found:
        return None
    _, rank, event = min(found, key=lambda f: (f[0], f[1]))
    return rank, event


def stopped_in_validation(run: Run) -> bool:
    """Whether a rank stopped inside a validation hook or the sanity check."""
    for trace in run.traces:
        open_hooks: dict = {}
        sanity = False
        for e in trace:
            if HOOK.of(e):
                open_hooks[e.get("i")] = str(e.get("name", ""))
            elif HOOK_EXIT.of(e):
                open_hooks.pop(e.get("i"), None)
            if "sanity" in e:
                sanity = bool(e["sanity"])
        if sanity or any("validation" in name for name in open_hooks.values()):
            return True
    return False


def reached_a_step(run: Run) -> bool:
    """Whether any rank entered a step (training, validation, test or predict) before the stop."""
    return any(HOOK.of(e) and str(e.get("name", "")).endswith("_step") for t in run.traces for e in t)


def what_ran(run) -> str:
    """What a finished run did, from rank 0's trace: ``the run finished on 2 ranks: fit (8 training
    step(s) over 2 epoch(s) on rank 0), then test``; a later stage that raised is named with its
    exception type."""
    trace = run.job.ranks[0].trace if run.job.ranks else []
    stepped = [e for e in trace if HOOK.of(e) and str(e.get("name", "")).endswith(".training_step")]
    stages = []
    for e in trace:
        if STAGE.of(e) and e.get("name") not in stages:
            stages.append(e["name"])
    errors = {e.get("name"): exception_words(e.get("exc_type"), e.get("message"), e.get("raised"), e.get("user"))
              for e in trace if STAGE_ERROR.of(e)}
    if stepped:
        epochs = len({e.get("epoch") for e in stepped})
        fit = f"fit ({len(stepped)} training step(s) over {epochs} epoch(s) on rank 0)"
    else:
        fit = "fit"
    words = [fit if name == "fit" else name + (f" (it raised {errors[name]})" if name in errors else "")
             for name in stages] or [fit]
    text = words[0] + (", then " + ", ".join(words[1:]) if len(words) > 1 else "")
    return f"the run finished on {len(run.job.ranks)} ranks: {text}"
