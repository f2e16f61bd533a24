"""The pytest-side session: one per ltconform pytest process. It owns the world pool and the
run cache, and turns (contract, strategy) into a verdict.

Runs are made once per (run kind, strategy, world size) and shared by every contract that
declares that kind, so the items stay one per contract while the cost is one run.
"""

from __future__ import annotations

import time

from . import contracts
from .contracts.base import Run, Verdict
from .settings import Settings
from .vocabulary import backend_for
from .world import WorldPool, WorldStartError

RUN_FUNCTIONS = {"fit": "pytest_ltconform.runs:traced_fit"}
RUN_FUNCTIONS["eval"] = "pytest_ltconform.eval_runs:traced_eval"
# Run kinds whose contracts compare with a one-rank run on the weights the world saved.
REFERENCE_RUNS = {"eval": "pytest_ltconform.eval_runs:reference_eval"}
RUN_FUNCTIONS["launch"] = "pytest_ltconform.contracts.launch_env:observe"
RUN_FUNCTIONS["config"] = "pytest_ltconform.contracts.strategy_config:observe"
RUN_FUNCTIONS["spawn"] = "pytest_ltconform.contracts.spawn_safety:observe"
RUN_FUNCTIONS["ebatch"] = "pytest_ltconform.contracts.effective_batch:observe"
REFERENCE_RUNS["ebatch"] = "pytest_ltconform.contracts.effective_batch:reference"


def owner_of(divergence: dict | None) -> str | None:
    """The contract whose rule the first divergence breaks."""
    if not divergence:
        return None
    if divergence["kind"] == "hooks":
        return "data-sharding"
    kinds = {e.get("ev") for evs in divergence["events"].values() for e in evs}
    if "call" in kinds:
        return "all-rank-save"
    if "log" in kinds:
        return "sync-dist"
    return None


def raised_owner(run: Run) -> str | None:
    """The contract owning a failure that every failed rank raised inside a recorded user call
    (trace event ``{"ev": "raised", "owner": ...}``, e.g. load_from_checkpoint on a sharded directory)."""
    owners = set()
    for rank in run.job.ranks:
        if rank.status == "ok":
            continue
        found = [e.get("owner") for e in rank.trace or [] if e.get("ev") == "raised" and e.get("owner")]
        if not found:
            return None
        owners.add(found[-1])
    return owners.pop() if len(owners) == 1 else None


class LtconformSession:
    """Makes and caches runs, and judges contracts on them."""

    def __init__(self, settings: Settings, targets, pool: WorldPool | None = None):
        self.settings = settings
        self.targets = targets
        self.pool = pool or WorldPool()
        self._runs: dict[tuple, Run | Exception] = {}
        # The launched world pytest runs in (world.attached.AttachedWorld), for the multinode tier.
        self.attached = None

    def run_for(self, kind: str, strategy: str, tier: str = "cpu") -> Run:
        """The run of ``kind`` under ``strategy`` in ``tier``'s world (see tiers.py): a local gloo
        world for 'cpu', a local NCCL world for 'gpu'/'deepspeed', the attached world for
        'multinode'. Made once and cached."""
        key = (kind, strategy, self.settings.world_size) + (() if tier == "cpu" else (tier,))
        # Fresh-world mode (the benchmark's baseline) shares nothing between items.
        cached = None if self.pool.fresh_per_job else self._runs.get(key)
        if cached is None:
            ids = [cid for cid in contracts.ids() if contracts.get_contract(cid).run_kind == kind]
            try:
                if tier == "multinode":
                    if self.attached is None:
                        raise WorldStartError("the multinode tier runs only inside a torchrun or SLURM world")
                    job = self.attached.run(RUN_FUNCTIONS[kind], self.targets, strategy, ids,
                                            self.settings.pg_timeout_s, timeout_s=self.settings.timeout_s)
                else:
                    job = self.pool.run(
                        self.settings.world_size, RUN_FUNCTIONS[kind], self.targets, strategy, ids,
                        self.settings.pg_timeout_s, timeout_s=self.settings.timeout_s,
                        pg_timeout_s=self.settings.pg_timeout_s,
                        backend=backend_for(tier),
                    )
                cached = Run(job, strategy, kind, self.targets)
                if kind in REFERENCE_RUNS and tier != "multinode":
                    cached.reference = self._reference(kind, job, strategy)
            except WorldStartError as exc:
                cached = exc
            self._runs[key] = cached
        if isinstance(cached, Exception):
            raise cached
        return cached

    def _reference(self, kind: str, job, strategy: str) -> Run | None:
        """The one-rank reference run for ``kind``, on what rank 0 of ``job`` saved; None when the
        world did not finish."""
        value = job.ranks[0].value if job.status == "ok" and job.ranks else None
        args = (value or {}).get("reference_args") if isinstance(value, dict) else None
        if not args:
            return None
        try:
            ref = self.pool.run(1, REFERENCE_RUNS[kind], self.targets, *args, self.settings.pg_timeout_s,
                                timeout_s=self.settings.timeout_s, pg_timeout_s=self.settings.pg_timeout_s)
        except WorldStartError:
            return None
        return Run(ref, strategy, f"{kind}-reference", self.targets)

    def verdict(self, contract_id: str, strategy: str, tier: str = "cpu") -> tuple[Verdict, float]:
        """Judge one contract under one strategy in one tier; returns (verdict, seconds spent)."""
        started = time.monotonic()
        contract = contracts.get_contract(contract_id)
        try:
            run = self.run_for(contract.run_kind, strategy, tier)
        except WorldStartError as exc:
            return contract.verdict("error", f"could not start a world: {exc}"), time.monotonic() - started
        verdict = judge(contract, run)
        if verdict.outcome == "error" and contract.run_kind != "fit":
            verdict = self._explained_by_fit(contract, strategy) or verdict
        # The first item that needs a run pays for it; later items only for their judgement.
        return verdict, time.monotonic() - started

    def _explained_by_fit(self, contract, strategy: str) -> Verdict | None:
        """A run of another kind that failed on a module whose traced fit already hung because of
        a named contract: say so in one line instead of repeating the tracebacks."""
        fit = self._runs.get(("fit", strategy, self.settings.world_size))
        if not isinstance(fit, Run) or fit.finished:
            return None
        owner = owner_of(fit.job.divergence) or raised_owner(fit)
        if owner is None or owner == contract.id:
            return None
        return contract.verdict(
            "error", f"its own run did not finish either; the module's fit does not finish because "
                     f"of the {owner}[{strategy}] failure (see that item).")

    def close(self) -> None:
        self.pool.close()


def judge(contract, run: Run) -> Verdict:
    """Apply ``contract`` to ``run``, deciding what an unfinished world means for it."""
    job = run.job
    if job.status == "skip":
        reason = next((r.message for r in job.ranks if r.message), "skipped inside the ranks")
        return contract.verdict("skipped", reason)
    try:
        verdict = contract.judge(run)
    except Exception as exc:  # a bug of ours must not look like a verdict on the user's code
        import traceback

        return contract.verdict("error", f"the {contract.id} verdict itself failed: {type(exc).__name__}: {exc}",
                                diagnosis=traceback.format_exc())
    # What ran in place of the user's strategy (e.g. their FSDP/DeepSpeed config as CPU FSDP).
    tier_note = next((e.get("text") for e in run.events(0, "note") if e.get("text")), None)
    if tier_note and tier_note not in verdict.notes:
        verdict.notes.insert(0, tier_note)
    if run.finished:
        return verdict
    if verdict.failed:
        verdict.diagnosis = job.diagnosis
        return verdict
    owner = owner_of(job.divergence) or raised_owner(run)
    if owner is not None and owner != contract.id and verdict.outcome == "passed":
        verdict.partial = True
        verdict.notes.append(
            f"the world stopped early because of the {owner}[{run.strategy}] failure, so this contract was "
            f"judged on what every rank recorded up to that point, where it found nothing wrong."
        )
        return verdict
    if owner is not None and owner != contract.id:
        # A consequence of another contract's failure: say so in one line, without tracebacks.
        return contract.verdict(
            "error", f"the shared {run.kind} run did not finish because of the "
                     f"{owner}[{run.strategy}] failure (see that item), and this contract needs the run's end.")
    first_bad = next(r for r in job.ranks if r.status != "ok")
    if run.strategy == "fsdp" and tier_note is None and owner is None:
        # The user's config does not ask for sharding; a module that cannot run under FSDP is
        # information for them, not a verdict on this contract.
        where = _raise_site(first_bad)
        return contract.verdict(
            "skipped", f"the module does not run under FSDP on CPU ({first_bad.exc_type or first_bad.status}"
                       f"{': ' + where if where else ''}); the Trainer config does not name a sharded strategy, "
                       f"so the sharded tier does not apply (--ltconform-strategies ddp hides it).")
    what = {"error": f"rank {first_bad.rank} raised {first_bad.exc_type}: "
                     f"{(first_bad.message or '').splitlines()[0][:300] if first_bad.message else ''}",
            "hung": f"rank {first_bad.rank} hung", "died": f"rank {first_bad.rank} died "
            f"(exit code {first_bad.exit_code})"}.get(first_bad.status, first_bad.status)
    return contract.verdict("error", f"the run did not finish ({what}).",
                            diagnosis=job.failure_text())


def _raise_site(rank) -> str | None:
    """The last user frame of a rank's traceback, as ``file:line``."""
    import re

    from .sites import is_user_file

    frames = re.findall(r'File "([^"]+)", line (\d+)', rank.traceback or "")
    for path, line in reversed(frames):
        if is_user_file(path):
            return f"{path}:{line}"
    return None
