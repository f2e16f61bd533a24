"""The pytest-side session: one per target of an ltconform pytest process. It owns the run
cache and turns (contract, strategy, tier) into a verdict.

Runs are made once per :class:`~.runs.RunKey` (target, run spec, strategy, tier, layout) and
shared by every contract that declares that spec, so the items stay one per contract while the
cost is one run; under pytest-xdist once across the session's workers (``run_cache``). What a run
means for an item (it finished, a contract claims its stop, a rank failed on its own, ...) is
decided by one ordered list of policies (``policies.POLICIES``), read by the contract items
(:meth:`LtconformSession.verdict`) and by the run's own item (:meth:`LtconformSession.run_failure`)
alike. The session knows no contract: it asks the registry which run a contract needs, which
probes that run loads and which contract an unfinished run's failure belongs to
(``contracts.blamed``).
"""

from __future__ import annotations

import contextlib
import time

from . import contracts, policies, tiers
from .contracts.base import Run, Verdict
from .run_cache import LocalRuns
from .runs import FIT, RunArgs, RunKey, RunSpec, seeding_for
from .settings import Settings
from .world import JobRequest, WorldPool, WorldStartError
from .world.causes import first_cause, stack_user_site


class LtconformSession:
    """Makes and caches runs, and judges contracts on them."""

    def __init__(self, settings: Settings, target, pool: WorldPool | None = None, runs=None,
                 reporters: dict | None = None):
        self.settings = settings
        self.target = target  # a target.spec.ResolvedTarget (None in tests that make no run)
        self.pool = pool or WorldPool()
        # RunKey -> Run | WorldStartError: this process's (run_cache.LocalRuns), or the xdist workers' (SharedRuns).
        self._runs = runs if runs is not None else LocalRuns()
        # (kind, strategy, tier) -> the item that reports that run's own failure, decided from the
        # collection (the same in every xdist worker): its run item, else the first item judged on it.
        self.reporters = dict(reporters or {})
        # The launched world pytest runs in (world.attached.AttachedWorld), for the multinode tier.
        self.attached = None
        # progress(label) -> a callback for LocalWorld.run's progress (label: "fit[ddp]"), or None.
        self.progress = None

    def run_for(self, spec: RunSpec, strategy: str, tier: str = "cpu") -> Run:
        """The run ``spec`` (a contract's ``run_spec``) under ``strategy`` in ``tier``'s world (see
        tiers.py): a local gloo world for 'cpu', a local NCCL world for 'gpu'/'deepspeed', the
        attached world for 'multinode'. Made once and cached; raises WorldStartError when no world
        could run it."""
        made, _ = self.run_or_hung(spec, strategy, tier, hang_check=False)
        if isinstance(made, Exception):
            raise made
        return made

    def run_or_hung(self, spec: RunSpec, strategy: str, tier: str, probes_of: RunSpec | None = None,
                    hang_check: bool = True) -> tuple[Run | WorldStartError | None, Run | None]:
        """(the run of ``spec``, or the WorldStartError that stopped it; None), made now unless
        made already (by any xdist worker); or (None, the earlier hung run) when ``hang_check``
        finds that this run would reach the same hang (:meth:`hung_before`), without starting it.
        A training run is checked and made only while no other one of the target is (``serial``:
        across the xdist workers), so the check sees every earlier run."""
        key = self._key(spec.name, strategy, tier)
        # Fresh-world mode (the benchmark's baseline) shares nothing between items.
        made = None if self.pool.fresh_per_job else self._runs.get(key)
        if made is None:
            with self._runs.serial(key) if spec.trains else contextlib.nullcontext():
                hung = self.hung_before(spec, strategy, tier) if hang_check else None
                if hung is not None:
                    return None, hung
                def make():
                    return self._make_or_error(spec, strategy, tier, probes_of)

                made = self._runs.remake(key, make) if self.pool.fresh_per_job else self._runs.once(key, make)
        return self._named(made, key), None

    def _make_or_error(self, spec: RunSpec, strategy: str, tier: str, probes_of: RunSpec | None) -> Run | Exception:
        try:
            return self._make(spec, strategy, tier, probes_of)
        except WorldStartError as exc:
            return exc

    def _named(self, made, key: RunKey):
        """``made`` with the item that reports its own failure, as decided from the collection, so
        that every worker names the same item whichever of them made the run."""
        reporter = self.reporters.get((key.kind, key.strategy, key.tier))
        if isinstance(made, Run) and reporter is not None and made.cause_item is None:
            made.cause_item = made.first_item = reporter
        return made

    def runs_made(self) -> list[RunKey]:
        """The runs this process made for this session, in order (under xdist, not those another
        worker made and handed over)."""
        return list(self._runs.made_here)

    def run_failure(self, contract_id: str, strategy: str, tier: str, item: str) -> policies.RunRecord:
        """Make (or take from the cache) the run that ``contract_id`` and others need, for the item
        named after it (``item``, e.g. ``fit[ddp]``), and say what that item reports, by the same
        policies as the contract items (``policies.POLICIES``): (PASSED, why) when the run finished
        or a contract claims its stop (that contract's item reports it); (SKIPPED, reason) when it
        cannot apply or would run into an earlier hang; (ERROR, text) when a rank failed on its own
        (raised, died, hung), with that rank's exception at the user's line, once. Items judged on
        the run later point at ``item``. Raises WorldStartError."""
        case = policies.Case(contracts.get_contract(contract_id), strategy, tier, session=self, item=item)
        return policies.run_record(case)

    def _key(self, kind: str, strategy: str, tier: str) -> RunKey:
        target = (self.target.id or self.target.model_name) if self.target is not None else "-"
        layout = tiers.get(tier).layout(self.settings.world_size, self.settings.nodes)
        return RunKey(target, kind, strategy, tier, layout)

    def ddp_run(self, run: Run, tier: str) -> Run | None:
        """The ddp run already made of ``run``'s kind (else the traced fit) in the same tier: what a
        sharded run's failure is compared with before the sharded strategy is blamed."""
        for kind in (run.kind, FIT.name):
            key = self._key(kind, "ddp", tier)
            made = self._named(self._runs.get(key), key)
            if isinstance(made, Run):
                return made
        return None

    def _make(self, spec: RunSpec, strategy: str, tier: str, probes_of: RunSpec | None = None) -> Run:
        settings, tier_of = self.settings, tiers.get(tier)
        args = RunArgs(self.target, strategy, tuple(contracts.probes_for(probes_of or spec)), settings.pg_timeout_s,
                       tier_of.layout(settings.world_size, settings.nodes))
        world = tier_of.world(self.pool, self.attached, args.layout, settings.pg_timeout_s)
        job = world.run(JobRequest(spec.fn, (args,), timeout_s=settings.timeout_s,
                                   progress=self._progress(spec.name, tier_of.run_label(strategy, settings.nodes)),
                                   tenant=self._tenant(strategy), seed=settings.seed,
                                   seeding=seeding_for(spec, settings.seeding)))
        run = Run(job, strategy, spec.name, self.target)
        run.label = tier_of.item_label(strategy, settings.nodes)
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
        """Judge one contract under one strategy in one tier (``policies.item_verdict``); returns
        (verdict, seconds spent). The first item that needs a run pays for it; later items only
        for their judgement."""
        started = time.monotonic()
        case = policies.Case(contracts.get_contract(contract_id), strategy, tier, session=self)
        return policies.item_verdict(case), time.monotonic() - started

    def made_run(self, kind: str, strategy: str, tier: str) -> Run | None:
        """The run of ``kind`` already made under ``strategy`` in ``tier``; None when it was not
        made, or its world did not start."""
        key = self._key(kind, strategy, tier)
        made = self._named(self._runs.get(key), key)
        return made if isinstance(made, Run) else None

    def second_run(self, spec: RunSpec, strategy: str, tier: str, probes_of: RunSpec) -> Run | None:
        """The run ``spec`` with the probes of ``probes_of`` (a second fit judged for the first's
        contracts), made once unless an earlier run hung where it would; None when it could not
        be made."""
        run, _ = self.run_or_hung(spec, strategy, tier, probes_of=probes_of)
        return run if isinstance(run, Run) else None

    def hung_before(self, spec: RunSpec, strategy: str, tier: str) -> Run | None:
        """An earlier run of this target that was killed for a hung rank with no contract claiming
        why (at its time limit, or before it once the peers had failed or finished), when the run
        ``spec`` would run into the same hang; None otherwise.

        It holds for every later run that trains under the same strategy in the same tier, and
        under any strategy when the hung rank was running the user's own code (a sleep or loop of
        theirs runs the same under every strategy); a rank stuck inside a library call (a
        collective, a strategy's gather) may be that strategy's doing, so other strategies still
        run. Inspection runs train nothing and always run."""
        own_key = self._key(spec.name, strategy, tier)
        if not spec.trains or self._runs.get(own_key) is not None:
            return None  # made already: its items are judged on it
        for key, run in self._runs.made(own_key.target):
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
