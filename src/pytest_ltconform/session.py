"""The pytest-side session: one per ltconform pytest process. It owns the world pool and the
run cache, and turns (contract, strategy) into a verdict.

Runs are made once per (run spec, strategy, world size) and shared by every contract that
declares that spec, so the items stay one per contract while the cost is one run. The session
knows no contract: it asks the registry which run a contract needs, which probes that run loads
and which contract an unfinished run's failure belongs to (``contracts.blamed``).
"""

from __future__ import annotations

import time

from . import contracts, tiers
from .claims import claim
from .contracts.base import Run, Verdict
from .events import HOOK, HOOK_EXIT, NONFINITE, NOTE, STAGE, STAGE_ERROR, STRATEGY
from .outcomes import Outcome
from .runs import FIT, FIT_WITHOUT_VALIDATION, WITHOUT_VALIDATION, RunArgs, RunKey, RunSpec, seeding_for
from .settings import Settings
from .sites import fmt_site
from .vocabulary import SHARDED_STRATEGIES, STRATEGY_NAMES
from .world import JobRequest, WorldPool, WorldStartError
from .world.causes import cause_text, first_cause, stack_user_site


class LtconformSession:
    """Makes and caches runs, and judges contracts on them."""

    def __init__(self, settings: Settings, target, pool: WorldPool | None = None):
        self.settings = settings
        self.target = target  # a target.spec.ResolvedTarget (None in tests that make no run)
        self.pool = pool or WorldPool()
        self._runs: dict[RunKey, Run | Exception] = {}
        # The launched world pytest runs in (world.attached.AttachedWorld), for the multinode tier.
        self.attached = None
        # progress(label) -> a callback for LocalWorld.run's progress (label: "fit[ddp]"), or None.
        self.progress = None

    def run_for(self, spec: RunSpec, strategy: str, tier: str = "cpu") -> Run:
        """The run ``spec`` (a contract's ``run_spec``) under ``strategy`` in ``tier``'s world (see
        tiers.py): a local gloo world for 'cpu', a local NCCL world for 'gpu'/'deepspeed', the
        attached world for 'multinode'. Made once and cached; raises WorldStartError when no world
        could run it."""
        key = self._key(spec.name, strategy, tier)
        # Fresh-world mode (the benchmark's baseline) shares nothing between items.
        cached = None if self.pool.fresh_per_job else self._runs.get(key)
        if cached is None:
            try:
                cached = self._make(spec, strategy, tier)
            except WorldStartError as exc:
                cached = exc
            self._runs[key] = cached
        if isinstance(cached, Exception):
            raise cached
        return cached

    def run_failure(self, contract_id: str, strategy: str, tier: str, item: str) -> tuple[str, str]:
        """Make (or take from the cache) the run that ``contract_id`` and others need, for the item
        named after it (``item``, e.g. ``fit[ddp]``), and say what that item reports: ("passed",
        why) when the run finished or a contract claims its stop (that contract's item reports it); ("skipped",
        reason) when it cannot apply or would run into an earlier hang; ("error", text) when a rank
        failed on its own (raised, died, hung), with that rank's exception at the user's line,
        once. Items judged on the run later point at ``item``. Raises WorldStartError."""
        contract = contracts.get_contract(contract_id)
        hung = self._hung_before(contract.run_spec, strategy, tier)
        if hung is not None:
            return Outcome.SKIPPED, hung_verdict(contract, hung).summary
        run = self.run_for(contract.run_spec, strategy, tier)
        if run.job.status == "skip":
            return Outcome.SKIPPED, next((r.message for r in run.job.ranks if r.message), "skipped inside the ranks")
        if run.finished:
            return Outcome.PASSED, f"{_what_ran(run)}. This item records the run; the contract items judge it."
        owner = contracts.blamed(run)
        if owner is not None:
            # The stop is a contract's finding: its item fails, once; this record does not fail again.
            return Outcome.PASSED, (f"the run stopped because of the {owner}[{strategy}] failure (see that item); "
                                    f"this item only records the run.")
        configured = any(e.get("configured") for e in run.events(0, STRATEGY))
        skipped = _not_a_sharded_module(contract, run, self._ddp_run(run, tier)) \
            if strategy in SHARDED_STRATEGIES and not configured else None
        if skipped is not None:  # the same words as the contract items judged on this run
            return Outcome.SKIPPED, skipped.summary
        cause = first_cause(run.job)
        headline = cause.headline() if cause is not None else "the run did not finish"
        run.cause_item = item
        run.first_item = run.first_item or item
        parts = [cause_text(cause), run.job.diagnosis_after(cause)] if cause is not None else [run.job.failure_text()]
        return Outcome.ERROR, "\n".join([f"[{item}] the run did not finish: {headline}."] + [p for p in parts if p])

    def _key(self, kind: str, strategy: str, tier: str) -> RunKey:
        target = (self.target.id or self.target.model_name) if self.target is not None else "-"
        return RunKey(target, kind, strategy, tier, tiers.get(tier).layout(self.settings.world_size))

    def _ddp_run(self, run: Run, tier: str) -> Run | None:
        """The ddp run already made of ``run``'s kind (else the traced fit) in the same tier: what a
        sharded run's failure is compared with before the sharded strategy is blamed."""
        for kind in (run.kind, FIT.name):
            made = self._runs.get(self._key(kind, "ddp", tier))
            if isinstance(made, Run):
                return made
        return None

    def _make(self, spec: RunSpec, strategy: str, tier: str, probes_of: RunSpec | None = None) -> Run:
        settings, tier_of = self.settings, tiers.get(tier)
        args = RunArgs(self.target, strategy, tuple(contracts.probes_for(probes_of or spec)), settings.pg_timeout_s,
                       tier_of.layout(settings.world_size))
        world = tier_of.world(self.pool, self.attached, args.layout, settings.pg_timeout_s)
        job = world.run(JobRequest(spec.fn, (args,), timeout_s=settings.timeout_s,
                                   progress=self._progress(spec.name, tier_of.run_label(strategy)),
                                   tenant=self._tenant(strategy), seed=settings.seed,
                                   seeding=seeding_for(spec, settings.seeding)))
        run = Run(job, strategy, spec.name, self.target)
        run.settings = settings  # what a verdict may weigh against (e.g. a stated device memory)
        if spec.reference:
            run.reference = self._reference(spec, job, args, tier)
        return run

    def _reference(self, spec: RunSpec, job, args: RunArgs, tier: str) -> Run | None:
        """The one-rank reference run of ``spec``, on what rank 0 of ``job`` saved; None when the
        world did not finish, or where no reference world runs (see ``Tier.reference_world``)."""
        value = job.ranks[0].value if job.status == "ok" and job.ranks else None
        saved = (value or {}).get("reference_args") if isinstance(value, dict) else None
        world = tiers.get(tier).reference_world(self.pool, self.settings.pg_timeout_s) if saved else None
        if world is None:
            return None
        request = JobRequest(spec.reference, (args.for_reference(), *saved), timeout_s=self.settings.timeout_s,
                             progress=self._progress(f"{spec.name}-reference", args.strategy),
                             tenant=self._tenant(args.strategy), seed=self.settings.seed,
                             seeding=seeding_for(spec, self.settings.seeding))
        try:
            ref = world.run(request)
        except WorldStartError:
            return None
        return Run(ref, args.strategy, f"{spec.name}-reference", self.target)

    def _tenant(self, strategy: str) -> str:
        """Whose process state a run is (world.job.JobRequest.tenant): this target under this
        strategy. Ranks that ran another target's or strategy's jobs are replaced first, so the
        module never sees what another run left in a rank (a library's process-wide flag, threads)."""
        target = self.target
        name = (target.id or target.model_name) if target is not None else "-"
        return f"{name}@{id(self):x}/{strategy}"

    def _progress(self, run: str, label: str):
        return self.progress(f"{run}[{label}]") if self.progress is not None else None

    def verdict(self, contract_id: str, strategy: str, tier: str = "cpu") -> tuple[Verdict, float]:
        """Judge one contract under one strategy in one tier; returns (verdict, seconds spent)."""
        started = time.monotonic()
        contract = contracts.get_contract(contract_id)
        hung = self._hung_before(contract.run_spec, strategy, tier)
        if hung is not None:
            return hung_verdict(contract, hung), time.monotonic() - started
        try:
            run = self.run_for(contract.run_spec, strategy, tier)
        except WorldStartError as exc:
            return contract.verdict(Outcome.ERROR, f"could not start a world: {exc}"), time.monotonic() - started
        if run.first_item is None:
            run.first_item = f"{contract_id}[{strategy}]"  # what a later item names when this run hung
        for spec in contract.observes:
            try:
                run.observed[spec.name] = self.run_for(spec, strategy, tier)
            except WorldStartError:
                pass  # the contract judges its own run without it
        verdict = judge(contract, run, self._ddp_run(run, tier) if strategy in SHARDED_STRATEGIES else None)
        if contract.run_spec == FIT:
            verdict = self._judged_without_validation(contract, run, verdict, tier) or verdict
        if verdict.outcome is Outcome.ERROR and contract.run_spec != FIT:
            verdict = self._explained_by_fit(contract, strategy, tier) or verdict
        verdict = self._on_nonfinite_loss(contract, run, strategy, tier) or verdict
        # The first item that needs a run pays for it; later items only for their judgement.
        return verdict, time.monotonic() - started

    def _judged_without_validation(self, contract, fit: Run, verdict: Verdict, tier: str) -> Verdict | None:
        """The verdict on a fit with validation switched off, when the shared fit stopped inside
        validation (or its sanity check) because of another contract's failure and this contract
        was left not judged or judged on a part only; None when that fit does not judge it either.

        Only a failure, or a pass that recorded what the contract judges on a finished fit, is
        taken: a stop of the second fit is never blamed on the user."""
        if fit.finished or not _stopped_in_validation(fit):
            return None
        owner = contracts.blamed(fit)
        if owner is None or owner == contract.id or not (verdict.category == "consequence" or verdict.partial):
            return None
        key = self._key(FIT_WITHOUT_VALIDATION.name, fit.strategy, tier)
        run = self._runs.get(key)
        if run is None and self._hung_before(FIT_WITHOUT_VALIDATION, fit.strategy, tier) is None:
            try:
                run = self._make(FIT_WITHOUT_VALIDATION, fit.strategy, tier, probes_of=FIT)
            except WorldStartError as exc:
                run = exc
            self._runs[key] = run
        if not isinstance(run, Run):
            return None
        second = judge(contract, run)
        if not (second.finding or (run.finished and second.outcome is Outcome.PASSED and not second.empty)):
            return None
        switched = ", ".join(f"{k}={v}" for k, v in WITHOUT_VALIDATION.items())
        second.notes.append(f"judged on a second fit with validation switched off ({switched}): the shared fit "
                            f"stopped in validation because of the {owner}[{fit.strategy}] failure (see that item).")
        return second

    def _on_nonfinite_loss(self, contract, run: Run, strategy: str, tier: str) -> Verdict | None:
        """Not judged, naming the loss, its rank, step and the user's line, when a contract that
        compares values (``needs_finite_loss``) is judged on a run (or a traced fit of the same
        strategy) whose training loss was nan or inf: nothing compared on top of it means anything."""
        if not contract.needs_finite_loss:
            return None
        for made in (run, self._runs.get(self._key(FIT.name, strategy, tier))):
            found = first_nonfinite(made) if isinstance(made, Run) else None
            if found is not None:
                rank, e = found
                return not_judged(contract, (
                    f"the training loss was {e.get('loss')} on rank {rank} at step {e.get('step')} (epoch "
                    f"{e.get('epoch')}, batch {e.get('batch_idx')}), returned at {fmt_site(e.get('site'))}: "
                    f"values compared across ranks or runs mean nothing on top of a non-finite loss, so "
                    f"{contract.id} judged none. Fix the loss first (a log or division of zero, an overflow, a "
                    f"learning rate too high), then run again."))
        return None

    def _hung_before(self, spec: RunSpec, strategy: str, tier: str) -> Run | None:
        """An earlier run of this target that was killed for a hung rank with no contract claiming
        why (at its time limit, or before it once the peers had failed or finished), when the run
        ``spec`` would run into the same hang; None otherwise.

        It holds for every later run that trains under the same strategy in the same tier, and
        under any strategy when the hung rank was running the user's own code (a sleep or loop of
        theirs runs the same under every strategy); a rank stuck inside a library call (a
        collective, a strategy's gather) may be that strategy's doing, so other strategies still
        run. Inspection runs train nothing and always run."""
        own_key = self._key(spec.name, strategy, tier)
        if not spec.trains or own_key in self._runs:
            return None  # made already: its items are judged on it
        for key, run in self._runs.items():
            # Killed at the time limit, or before it once its peers had failed or finished: a rank
            # was still running either way (a divergence stopped early is not a hang of this kind).
            if not isinstance(run, Run) or run.finished or not (run.job.timed_out_by or run.job.killed_early):
                continue
            if key.tier != tier:
                continue
            cause = first_cause(run.job)
            if cause is None or cause.kind != "hung":
                continue
            if run.strategy != strategy and not stack_user_site(run.job.ranks[cause.rank].stack)[1]:
                continue
            if contracts.blamed(run) is None:
                return run
        return None

    def _explained_by_fit(self, contract, strategy: str, tier: str) -> Verdict | None:
        """A run of another kind that failed on a module whose traced fit (in the same tier)
        already stopped because of a named contract: say so in one line instead of repeating the
        tracebacks."""
        fit = self._runs.get(self._key(FIT.name, strategy, tier))
        if not isinstance(fit, Run) or fit.finished:
            return None
        owner = contracts.blamed(fit)
        if owner is None:
            return self._same_failure_as_fit(contract, strategy, tier, fit)
        if owner == contract.id:
            return None
        return not_judged(contract, f"its own run did not finish either; the module's fit does not finish "
                                    f"because of the {owner}[{strategy}] failure (see that item).",
                          f"{owner}[{strategy}]")

    def _same_failure_as_fit(self, contract, strategy: str, tier: str, fit: Run) -> Verdict | None:
        """This item's own run stopped the way the traced fit did (the same rank failure at the same
        user line): one fault shows one traceback, on the fit's first item; this one names it."""
        own = self._runs.get(self._key(contract.run_spec.name, strategy, tier))
        mine, theirs = (first_cause(own.job) if isinstance(own, Run) else None), first_cause(fit.job)
        item = fit.cause_item
        if mine is None or theirs is None or item is None or \
                (mine.kind, mine.exc_type, mine.site) != (theirs.kind, theirs.exc_type, theirs.site):
            return None
        return not_judged(contract, f"its own run stopped the same way as the fit: {mine.headline()} (see {item}).",
                          item)


def not_judged(contract, reason: str, item: str | None = None) -> Verdict:
    """The verdict of an item that cannot be judged because of another item's failure (``item``,
    when one is named): not judged, with the reason in one line naming that item, and no traceback
    of its own."""
    return contract.not_judged(reason, depends_on=item, category="consequence")


def first_nonfinite(run: Run) -> tuple[int, dict] | None:
    """(rank, event) of the earliest non-finite training loss a rank recorded (lowest step,
    then rank); None when every loss was finite."""
    found = [(e.get("step", 0), r, e) for r, trace in enumerate(run.traces) for e in trace
             if NONFINITE.of(e)]
    if not found:
        return None
    _, rank, event = min(found, key=lambda f: (f[0], f[1]))
    return rank, event


def hung_verdict(contract, hung: Run) -> Verdict:
    """Not judged, without starting a run, because an earlier run of the target hung (one line
    naming the first item judged on it and where the hung rank was)."""
    cause = first_cause(hung.job)
    where = f"rank {cause.rank} at {fmt_site(cause.site)}" if cause and cause.site else \
        f"rank {cause.rank}" if cause else "a rank"
    item = hung.cause_item or hung.first_item or f"{hung.kind}[{hung.strategy}]"
    until = f"until {hung.job.timed_out_by}" if hung.job.timed_out_by else f"and was killed {hung.job.killed_early}"
    return not_judged(contract, f"not started: the {hung.kind}[{hung.strategy}] run of this target hung "
                                f"({where} stopped making progress {until}), and this run "
                                f"would reach the same code (see {item}).", item)


def judge(contract, run: Run, ddp: Run | None = None) -> Verdict:
    """Apply ``contract`` to ``run``, deciding what an unfinished world means for it; ``ddp`` is
    the same module's ddp run, when ``run`` is a sharded one (see :func:`_not_a_sharded_module`)."""
    job = run.job
    if job.status == "skip":
        reason = next((r.message for r in job.ranks if r.message), "skipped inside the ranks")
        return contract.verdict(Outcome.SKIPPED, reason)
    try:
        verdict = contract.judge(run)
    except Exception as exc:  # a bug of ours must not look like a verdict on the user's code
        import traceback

        return contract.verdict(Outcome.ERROR, f"the {contract.id} verdict itself failed: {type(exc).__name__}: {exc}",
                                diagnosis=traceback.format_exc())
    # What ran in place of the user's strategy (e.g. their FSDP/DeepSpeed config as CPU FSDP).
    # Every distinct note, in order: the tier's, then each optimizer substituted on CPU.
    tier_notes = [t for t in dict.fromkeys(e.get("text") for e in run.events(0, NOTE)) if t]
    verdict.notes[:0] = [t for t in tier_notes if t not in verdict.notes]
    if run.finished:
        return verdict
    owner = contracts.blamed(run)
    # A rank that raised in the user's code leads: what its peers did next is no finding.
    if verdict.finding and (owner == contract.id or not run.raised_in_user_code()):
        verdict.diagnosis = job.diagnosis
        return verdict
    if owner is not None and owner != contract.id:
        return _after_owned_failure(contract, run, verdict, owner)
    # Whether the user's config asks for what this item ran (traced runs say; others never do).
    configured = any(e.get("configured") for e in run.events(0, STRATEGY))
    if run.strategy in SHARDED_STRATEGIES and not configured and owner is None:
        skipped = _not_a_sharded_module(contract, run, ddp)
        if skipped is not None:
            return skipped
    return _after_own_failure(contract, run)


def _after_owned_failure(contract, run: Run, verdict: Verdict, owner: str) -> Verdict:
    """The run stopped because of ``owner``'s failure: a contract that found nothing on what every
    rank recorded passes on that part; one that needs the run's end, or that recorded nothing of
    what it judges (``Verdict.empty``), is not judged."""
    item = f"{owner}[{run.strategy}]"
    if verdict.outcome is Outcome.PASSED and not _reached_a_step(run):
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


def _stopped_in_validation(run: Run) -> bool:
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


def _reached_a_step(run: Run) -> bool:
    """Whether any rank entered a step (training, validation, test or predict) before the stop."""
    return any(HOOK.of(e) and str(e.get("name", "")).endswith("_step") for t in run.traces for e in t)


def _not_a_sharded_module(contract, run: Run, ddp: Run | None = None) -> Verdict | None:
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
    where = f" at {_short_site(cause.site)}" if cause.site else ""
    what = f"{cause.exc_type or cause.kind}{where}: {cause.message}" if cause.message else \
        f"{cause.exc_type or cause.kind}{where}"
    name = "FSDP" if run.strategy == "fsdp" else STRATEGY_NAMES.get(run.strategy, run.strategy)
    said = claim("cpu-only", f"does not run under {name} on CPU",
                 ddp="not run" if ddp is None else "finished" if ddp.finished else "stopped differently")
    if run.strategy == "fsdp":
        return contract.verdict(
            Outcome.SKIPPED, f"the module does not run under FSDP on CPU ({what}); the Trainer config does not name a "
                       f"sharded strategy, so the sharded tier does not apply (--ltconform-strategies ddp hides it).",
            claims=[said])
    return contract.verdict(
        Outcome.SKIPPED, f"the module does not run under {name} on CPU ({what}); the Trainer config does not name "
                   f"{name}, so the {run.strategy} tier does not apply (--ltconform-strategies without "
                   f"{run.strategy} hides it).", claims=[said])


def _after_own_failure(contract, run: Run) -> Verdict:
    """No contract's rule explains why the run stopped: a rank failed on its own (the user's
    code raised, a rank died or hung). The first item judged on the run leads with that rank's
    own exception at the user's line and shows its traceback once; the peers' transport errors
    are named in one line as consequences; every later item says in one line where to look."""
    cause = first_cause(run.job)
    item = f"{contract.id}[{run.strategy}]"
    headline = cause.headline() if cause is not None else "the run did not finish"
    if run.cause_item in (None, item):
        run.cause_item = item
        # failure_text() already ends with the diagnosis; a cause's text needs it, less what it named.
        parts = [cause_text(cause), run.job.diagnosis_after(cause)] if cause is not None \
            else [run.job.failure_text()]
        return contract.verdict(Outcome.ERROR, f"the run did not finish: {headline}.", category="crash",
                                diagnosis="\n".join(p for p in parts if p))
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
    return f"{owner}[{ddp.strategy}]" if owner else ddp.cause_item or f"fit[{ddp.strategy}]"


def _short_site(site: dict) -> str:
    return f"{site['file']}:{site['line']}"


def _what_ran(run) -> str:
    """What a finished run did, from rank 0's trace: ``the run finished on 2 ranks: fit (8 training
    step(s) over 2 epoch(s) on rank 0), then test``; a later stage that raised is named with its
    exception type."""
    trace = run.job.ranks[0].trace if run.job.ranks else []
    stepped = [e for e in trace if HOOK.of(e) and str(e.get("name", "")).endswith(".training_step")]
    stages = []
    for e in trace:
        if STAGE.of(e) and e.get("name") not in stages:
            stages.append(e["name"])
    errors = {e.get("name"): e.get("exc_type") for e in trace if STAGE_ERROR.of(e)}
    if stepped:
        epochs = len({e.get("epoch") for e in stepped})
        fit = f"fit ({len(stepped)} training step(s) over {epochs} epoch(s) on rank 0)"
    else:
        fit = "fit"
    words = [fit if name == "fit" else name + (f" (it raised {errors[name]})" if name in errors else "")
             for name in stages] or [fit]
    text = words[0] + (", then " + ", ".join(words[1:]) if len(words) > 1 else "")
    return f"the run finished on {len(run.job.ranks)} ranks: {text}"

