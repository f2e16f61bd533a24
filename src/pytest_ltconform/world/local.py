"""A local world: rank processes this pytest process starts, supervises, reuses and kills.

The supervisor holds a ``torch.distributed.TCPStore`` server on port 0 (no free-port race, safe
under pytest-xdist); ranks connect to it as clients, take jobs from it and post results to it.
Rank processes stay up between jobs, so ``import lightning`` (the cold start) is paid once per
world; every job gets a fresh default process group. A job that errors, hangs or crashes tears
the world down and the next job starts a new generation of ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..sites import USER_CWD_ENV
from . import diagnose, kept_store, launch, protocol
from .job import Job, JobRequest
from .launch import DEFAULT_LAUNCHER
from .launch.base import Launcher, LaunchError
from .layout import Layout
from .outcome import JobResult, RankOutcome, read_trace, without_own_noise

# Each world folder names the process that owns it, so that a later session can remove the folders
# of a session that was killed (SIGKILL runs no clean-up) without touching a live one's.
WORLD_PREFIX = "ltconform-world-"
OWNER_FILE = "owner"


class WorldStartError(RuntimeError):
    """The ranks of a world could not be started; the message has every rank's log tail."""


class LocalWorld:
    """``world_size`` rank processes on this host, reused across jobs.

    ``run(JobRequest("pkg.mod:func", args))`` runs the importable function on every rank as
    ``func(ctx, *args)`` and returns a :class:`JobResult` (the ``World`` interface). Never raises
    for what happens in a rank; raises :class:`WorldStartError` when ranks cannot be started at
    all. With ``fresh_per_job`` its ranks are stopped after every job, so each job pays a cold
    start (what the benchmark of reuse compares against); the files stay until :meth:`close`.
    ``launcher`` starts the ranks (``launch.LAUNCHERS``): 'fork' from a parent that imported
    ``preload`` once (default), 'spawn' a fresh interpreter each, or a ``launch.base.Launcher`` to
    share. ``layout`` places the ranks on nodes (default: ``world_size`` ranks on one node); the
    ranks' torchrun variables and the job's node count come from it. ``gate()`` is held while a
    job runs (a pool's world slot; default: nothing).
    """

    # Seconds without trace progress, after a divergence, before a world is declared hung.
    EARLY_IDLE_S = 4.0

    def __init__(self, world_size: int = 2, *, layout: Layout | None = None, backend: str = "gloo",
                 pg_timeout_s: float = 30.0, preload: tuple[str, ...] = ("lightning.pytorch",),
                 start_timeout_s: float = 300.0, root: str | None = None, env: dict | None = None,
                 timeout_name: str = "timeout_s", fresh_per_job: bool = False,
                 launcher: str | Launcher = DEFAULT_LAUNCHER, gate=contextlib.nullcontext):
        self.layout = layout or Layout.single_node(world_size)
        self.world_size = self.layout.world_size
        self.env = dict(env or {})  # set in each rank's environment, over the inherited one
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.preload = preload
        self.start_timeout_s = start_timeout_s
        self._own_root = root is None
        self.timeout_name = timeout_name  # what a job killed at its time limit names (an option)
        self.fresh_per_job = fresh_per_job
        self.root = root or tempfile.mkdtemp(prefix=WORLD_PREFIX)
        if self._own_root:
            write_owner(self.root)
        if self.layout.nodes > 1:  # each node's storage: see nodes.py
            os.makedirs(protocol.node_mount(self.root), exist_ok=True)
            for node in range(self.layout.nodes):
                os.makedirs(protocol.node_dir(self.root, node), exist_ok=True)
        self._store = None
        # A launcher given by name is this world's own (closed with it); an object is shared (a pool's).
        self._own_launcher = isinstance(launcher, str)
        self.launcher = launch.launcher_for(launcher, preload, start_timeout_s) if self._own_launcher else launcher
        self._procs: list = []  # launch.base.RankProcess: subprocess.Popen or launch.fork.ForkedRank
        self.generation = -1
        self._next_job = 0
        self._jobs_total = 0
        self.cold_starts = 0
        self._tenant: str | None = None  # whose job these ranks ran last (JobRequest.tenant)
        self.closed = False
        self._gate = gate  # gate() -> a context held while a job runs (a world slot of the session)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def accelerator(self) -> str:
        return "gpu" if self.backend == "nccl" else "cpu"

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def _store_answers(self) -> bool:
        """False when the store's keeper is gone (killed, or dead with the fork parent): the
        ranks lost their store with it, and the next start gets a new one."""
        if isinstance(self._store, kept_store.KeptStore) and not self._store.alive:
            self._store = None
            return False
        return True

    def _has(self, key: str) -> bool:
        """Whether the store holds ``key``; False once the store's keeper is gone (the ranks,
        which lost it too, are then found dead or hung)."""
        try:
            return self._store.check([key])
        except kept_store.StoreLost:
            return False

    def _ensure_store(self):
        """The world's store: served by a keeper the fork parent forked (pytest's process need not
        import torch; see ``kept_store``), else held here. A keeper that died with its parent is
        replaced (see :meth:`_store_answers`). Raises WorldStartError when the fork parent cannot
        start."""
        if self._store is None and "torch" not in sys.modules:  # else holding it here costs nothing more
            try:
                self._store = self.launcher.store(self._rank_env(0), self.root)
            except LaunchError as exc:
                raise WorldStartError(f"could not start a world of {self.world_size} ranks: {exc}") from None
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=kept_store.STORE_TIMEOUT_S))
        return self._store

    def _rank_env(self, rank: int) -> dict:
        env = protocol.without_launcher_env(os.environ)
        layout = self.layout
        env.update(
            MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(self.world_size),
            RANK=str(rank), LOCAL_RANK=str(layout.local_rank(rank)), NODE_RANK=str(layout.node_rank(rank)),
            # The rest of torchrun's variables: with TORCHELASTIC_RUN_ID set, Lightning picks its
            # TorchElasticEnvironment first and never probes MPI (importing mpi4py where Open MPI
            # cannot start kills the rank: seen on a GPU host with mpi4py installed).
            GROUP_RANK=str(layout.node_rank(rank)), GROUP_WORLD_SIZE=str(layout.nodes),
            LOCAL_WORLD_SIZE=str(layout.ranks_per_node),
            ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(self.world_size), ROLE_NAME="default",
            TORCHELASTIC_RUN_ID=f"ltconform-{os.getpid()}", TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(self.generation),
            PYTHONUNBUFFERED="1",
            # Temp files of the ranks and their children (a DataLoader worker's pymp-* folder, left
            # when it is killed) live in the world folder, which goes with the world.
            TMPDIR=self._tmp_dir(),
        )
        if layout.nodes > 1:
            env.update(self._node_env(layout.node_rank(rank)))
        env.update({protocol.GENERATION_ENV: str(self.generation), protocol.WORLD_DIR_ENV: self.root,
                    protocol.SUPERVISOR_PID_ENV: str(os.getpid()), protocol.PARENT_PID_ENV: str(os.getpid()),
                    protocol.PRELOAD_ENV: ",".join(self.preload), USER_CWD_ENV: os.getcwd()})
        if self._store is not None:  # None: the fork parent's environment, before any rank starts
            env["MASTER_PORT"] = str(self._store.port)
        env.update(self.env)
        # Two ranks on a small machine: one intra-op thread each avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", "1")
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src, os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)])
        return env

    def fresh(self, entry: str, args: list, *, env: dict, cwd: str, timeout_s: float) -> dict | None:
        """Call ``entry`` with ``args`` in a fresh process forked from this world's fork parent
        (started now if it is not running), as ``zygote.run_fresh`` does for a rank; None when
        this world's ranks are not forked (the spawn launcher). Raises :class:`WorldStartError`
        when the parent cannot start."""
        if self.closed:
            return None
        try:
            return self.launcher.fresh(entry, args, env=env, cwd=cwd, folder=self.root, timeout_s=timeout_s,
                                       parent_env=self._rank_env(0))
        except LaunchError as exc:
            raise WorldStartError(f"could not start the fork launcher's parent: {exc}") from None

    def import_in_parent(self, names: list[str]) -> dict[str, str | None] | None:
        """Have this world's fork parent import ``names`` now (see
        ``launch.fork.ForkLauncher.import_now``): ``{name: why its import failed, or None}``; None when
        this world's ranks are not forked (the spawn launcher). Raises :class:`WorldStartError`
        when the parent cannot start."""
        if self.closed:
            return None
        try:
            return self.launcher.import_now(names, self._rank_env(0), self.root)
        except LaunchError as exc:
            raise WorldStartError(f"could not start the fork launcher's parent: {exc}") from None

    def _node_env(self, node: int) -> dict:
        """What a rank of node ``node`` needs to take its node's own storage (``nodes.enter_node``):
        the mount point every node's tmpfs shares, the node's folder on the shared disk, where its
        namespace is published, and how isolation is asked for (``LTCONFORM_NODE_ISOLATION`` in
        this process's environment, else a mount namespace)."""
        asked = os.environ.get(protocol.NODE_ISOLATION_ENV, protocol.NODE_ISOLATIONS[0])
        asked = asked if asked in protocol.NODE_ISOLATIONS else protocol.NODE_ISOLATIONS[0]
        own = protocol.node_dir(self.root, node)
        return {protocol.NODE_MOUNT_ENV: protocol.node_mount(self.root), protocol.NODE_DIR_ENV: own,
                protocol.NODE_NS_ENV: protocol.node_ns_file(self.root, self.generation, node),
                protocol.NODE_ISOLATION_ENV: asked,
                "TMPDIR": own, "SLURM_TMPDIR": own}

    def _tmp_dir(self) -> str:
        path = os.path.join(self.root, "tmp")
        os.makedirs(path, exist_ok=True)
        return path

    def start(self) -> None:
        if self.closed:
            raise WorldStartError("this world was closed")
        self._ensure_store()
        self.generation += 1
        self._next_job = 0
        self.cold_starts += 1
        self._procs = []
        for rank in range(self.world_size):
            log = protocol.log_file(self.root, self.generation, rank)
            try:
                self._procs.append(self.launcher.start(self._rank_env(rank), log, self.root))
            except LaunchError as exc:
                self.kill()
                raise WorldStartError(f"could not start a world of {self.world_size} ranks: {exc}") from None
        deadline = time.monotonic() + self.start_timeout_s
        keys = [protocol.ready_key(self.generation, r) for r in range(self.world_size)]
        while not all(map(self._has, keys)):
            dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- rank {r} (exit {self._procs[r].poll()}):\n{self._log_tail(r)}"
                                  for r in range(self.world_size))
                self.kill()
                why = f"rank(s) {dead} exited during start-up" if dead else \
                    f"ranks were not ready after {self.start_timeout_s:.0f} s"
                raise WorldStartError(f"could not start a world of {self.world_size} ranks: {why}.\n{tails}")
            time.sleep(0.02)

    def _log_tail(self, rank: int, gen: int | None = None, chars: int = 3000) -> str:
        gen = self.generation if gen is None else gen
        path = protocol.log_file(self.root, gen, rank)
        try:
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL every rank (SIGTERM does not free a rank stuck in a collective)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []

    def _stop_ranks(self) -> None:
        """Stop idle ranks politely (a stop message), then SIGKILL what is left."""
        if self.alive and self._store is not None:
            try:
                self._store.set(protocol.job_key(self.generation, self._next_job), protocol.STOP)
                # Idle ranks exit at once; interpreter teardown of torch is not worth waiting for.
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
                    time.sleep(0.02)
            except Exception:
                pass
        self.kill()

    def close(self, keep_files: bool = False) -> None:
        """Stop the ranks (politely if idle, else by SIGKILL) and remove the world's files,
        unless ``keep_files`` (a later job, e.g. a reference run, reads what this one wrote)."""
        if self.closed:
            return
        self._stop_ranks()
        if self._own_launcher:
            self.launcher.close()
        self.closed = True
        if isinstance(self._store, kept_store.KeptStore):
            self._store.close()
        self._store = None
        if self._own_root and not keep_files:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- jobs -----------------------------------------------------------------------------------
    def run(self, request: JobRequest) -> JobResult:
        """Run ``request.fn`` on every rank, stopped after ``request.timeout_s`` seconds; a world
        killed at that limit names it as ``timeout_name=<value>`` (default: the world's own).

        ``request.progress``, when given, is called about every ``_JobWatch.PROGRESS_EVERY_S`` seconds while
        ranks are still running, as ``progress(elapsed_s, {rank: seconds since its trace last
        grew})`` (float seconds; only the ranks still running). An exception it raises is ignored.

        A world whose process group fails to form (before ``fn_ref`` runs) is started once more; a
        second failure raises :class:`WorldStartError` with what each failing rank said.

        The job, its ranks' start included, runs while the world holds ``gate()`` (a world slot
        of the session, so that the ranks of all its worlds fit the machine's cores)."""
        with self._gate():
            return self._run(request)

    def _run(self, request: JobRequest) -> JobResult:
        timeout_s, first_failure = request.timeout_s, None
        if request.tenant != self._tenant and self.alive:
            self._stop_ranks()  # another target's process state stays with it
        self._tenant = request.tenant
        while True:
            answers = self._store_answers()  # first: a dead keeper is dropped even when the ranks died too
            if not self.alive or not answers:
                if self._procs:
                    self.kill()
                self.start()
            job = self._submit(request.fn, request.args, request.kwargs, request.seed, request.seeding)
            watch = _JobWatch(self, job, timeout_s, request.progress)
            hung, early = watch.wait()
            failure = watch.formation_failure()
            if failure is None:
                break
            # Nothing of the job ran: a world whose process group did not form is started once more.
            self.kill()
            if first_failure is not None:
                said = failure if failure == first_failure else f"first {first_failure}; then {failure}"
                raise WorldStartError(
                    f"the process group of a world of {self.world_size} {self.backend} ranks did not form, in two "
                    f"fresh worlds, before the job's code ran: {said}")
            first_failure = failure
        limit = f"{request.timeout_name or self.timeout_name}={timeout_s:g}"
        result = self._assemble(job, watch, hung, early, timeout_s, limit)
        if self.fresh_per_job:
            self.kill()
        return result

    def _submit(self, fn_ref: str, args: tuple, kwargs: dict, seed: int, seeding: str = "same") -> Job:
        """Post the next job of this generation to the store, in a new job folder."""
        n = self._next_job
        self._next_job += 1
        self._jobs_total += 1
        job_dir = os.path.join(self.root, f"job{self._jobs_total:04d}")
        os.makedirs(job_dir, exist_ok=True)
        job = Job(fn=fn_ref, dir=job_dir, n=n, args=args, kwargs=kwargs, seed=seed, seeding=seeding,
                  backend=self.backend, pg_timeout_s=self.pg_timeout_s, num_nodes=self.layout.nodes)
        self._store.set(protocol.job_key(self.generation, n), job.wire())
        return job

    def _assemble(self, job: Job, watch: _JobWatch, hung: list[int], early: str | None,
                  timeout_s: float, limit: str) -> JobResult:
        """The job's result once every rank reported or was declared hung: hung and dead ranks
        get their stacks and log tails, every rank its trace; a failed world is killed."""
        gen, outcomes = self.generation, watch.outcomes
        stacks = self._collect_stacks(hung + [r for r, o in outcomes.items() if o.status == "died"])
        for r in hung:
            outcomes[r] = RankOutcome(rank=r, status="hung")
        duration = time.monotonic() - watch.started
        ranks = [outcomes[r] for r in range(self.world_size)]
        for r in ranks:
            r.stack = stacks.get(r.rank)
            r.trace = read_trace(protocol.trace_file(job.dir, r.rank))
            if r.status in ("died", "hung", "error"):
                r.log_tail = without_own_noise(self._log_tail(r.rank, gen))
        # A world stopped by a heuristic below names the time limit it did not wait for.
        killed_early = f"{watch.gave_up}, before the time limit ({limit})" if hung and watch.gave_up else None
        result = JobResult.of(ranks, duration, timeout_s=timeout_s, job_dir=job.dir, early_stop=early,
                              timed_out_by=limit if watch.at_deadline else None, killed_early=killed_early)
        if result.status != "ok" and not all(r.status == "skip" for r in ranks):
            self.kill()
        return result

    def _collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each live listed rank for a faulthandler dump (SIGUSR1) and read every listed
        rank's stack file (a crashed rank's fatal-error dump is there too)."""
        if not ranks:
            return {}
        paths = {r: protocol.stack_file(self.root, self.generation, r) for r in ranks}
        sizes = {r: _size(paths[r]) for r in ranks}
        signalled = []
        for r in ranks:
            p = self._procs[r] if r < len(self._procs) else None
            if p is not None and p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                    signalled.append(r)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0
        while signalled and time.monotonic() < deadline:
            if all(_size(paths[r]) > sizes[r] for r in signalled):
                time.sleep(0.1)  # let the dump finish
                break
            time.sleep(0.02)
        stacks = {}
        for r in ranks:
            try:
                with open(paths[r], encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                continue
            stacks[r] = text[sizes[r]:] if r in signalled else text
        return stacks


class _JobWatch:
    """The supervisor's wait for one job: collects the ranks' results as they arrive and decides
    when the ranks still running are hung (the heuristics below, checked every poll)."""

    POLL_S = 0.02
    LOOK_EVERY_S = 0.5  # how often trace growth is measured
    PROGRESS_EVERY_S = 1.0  # how often the progress callback is called
    FORMATION_GRACE_S = 2.0  # how long the other ranks may take to report a failed group formation

    def __init__(self, world: LocalWorld, job: Job, timeout_s: float, progress=None):
        self.world = world
        self.progress = progress
        self.next_progress = time.monotonic() + self.PROGRESS_EVERY_S
        self.started = time.monotonic()
        self.keys = {r: protocol.result_key(world.generation, job.n, r) for r in range(world.world_size)}
        self.outcomes: dict[int, RankOutcome] = {}
        self.first_error_at = self.first_done_at = self.first_dead_at = self.formation_failed_at = None
        # Ranks that finished wait for the others for at most this long: a rank stuck in a
        # collective gets the process group's own timeout plus slack before we call it hung.
        self.straggler_s = world.pg_timeout_s + 10.0
        self.deadline = self.started + timeout_s
        self.trace_paths = {r: protocol.trace_file(job.dir, r) for r in range(world.world_size)}
        self.sizes = {r: (-1, self.started) for r in range(world.world_size)}  # (trace size, when it last grew)
        self.next_look = self.started + 1.0
        self.at_deadline = False  # the job's own time limit stopped it (not a heuristic below)
        self.gave_up: str | None = None  # why a heuristic below stopped it: '40 s after rank(s) 0 failed'

    def wait(self) -> tuple[list[int], str | None]:
        """Poll until every rank reported or the rest are hung: (hung ranks, early-stop reason)."""
        while True:
            now = time.monotonic()
            self._collect_results(now)
            self._collect_deaths(now)
            waiting = [r for r in range(self.world.world_size) if r not in self.outcomes]
            if not waiting:
                return [], None
            if self.formation_failure() is not None:
                # The rest are still forming the group (none runs the job's code); a peer's own
                # error comes a moment later: wait for it briefly, so every failing rank is named.
                self.formation_failed_at = self.formation_failed_at or now
                if now - self.formation_failed_at > self.FORMATION_GRACE_S:
                    return waiting, None
            if now >= self.next_look:
                self.next_look = now + self.LOOK_EVERY_S
                early = self._stuck_after_divergence(now, waiting)
                if early:
                    return waiting, early
            if self.progress is not None and now >= self.next_progress:
                self.next_progress = now + self.PROGRESS_EVERY_S
                self._report_progress(now, waiting)
            if self._past_deadline(now) or self._waited_out(now):
                return waiting, None
            time.sleep(self.POLL_S)

    def formation_failure(self) -> str | None:
        """What the ranks that failed to form the job's process group said (the first rank whose
        own error it was leads; a peer that only heard of it comes last); None when none failed."""
        failed = sorted((o for o in self.outcomes.values() if o.stage == protocol.FORMATION and o.status == "error"),
                        key=lambda o: (o.exc_type == "FormationError", o.rank))
        said: dict[str, list[int]] = {}
        for o in failed:  # gloo's own messages put the reason after an "[enforce fail at ...]" sentence
            said.setdefault(f"{o.exc_type}: {' '.join((o.message or '').split())[:300]}", []).append(o.rank)
        return "; ".join(f"rank(s) {', '.join(map(str, ranks))} raised {text}" for text, ranks in said.items()) or None

    def _report_progress(self, now: float, waiting: list[int]) -> None:
        try:
            self.progress(now - self.started, {r: now - self.sizes[r][1] for r in waiting})
        except Exception:  # a progress display must never change how a job ends
            pass

    def _collect_results(self, now: float) -> None:
        for r, key in self.keys.items():
            if r not in self.outcomes and self.world._has(key):
                self.outcomes[r] = RankOutcome.from_wire(protocol.read_result(self.world._store.get(key)))
                self.first_done_at = self.first_done_at or now
                if self.outcomes[r].status != "ok":
                    self.first_error_at = self.first_error_at or now

    def _collect_deaths(self, now: float) -> None:
        for r, p in enumerate(self.world._procs):
            if r not in self.outcomes and p.poll() is not None and not self.world._has(self.keys[r]):
                self.outcomes[r] = RankOutcome(rank=r, status="died", exit_code=p.returncode)
                self.first_dead_at = self.first_dead_at or now

    def _stuck_after_divergence(self, now: float, waiting: list[int]) -> str | None:
        """Ranks whose traces stopped growing after their collective calls diverged will only
        leave the mismatched collective at the process-group timeout: stop them now."""
        for r in waiting:
            size = _size(self.trace_paths[r])
            if size != self.sizes[r][0]:
                self.sizes[r] = (size, now)
        idle = min(now - self.sizes[r][1] for r in waiting)
        if idle < self.world.EARLY_IDLE_S:
            return None
        traces = [read_trace(self.trace_paths[r]) for r in range(self.world.world_size)]
        if diagnose.first_divergence(traces) is not None:
            return f"stuck for {idle:.0f} s after their collective calls diverged"
        parted = diagnose.collectives_parted(traces, waiting)
        if parted is not None:
            # Calls no tap names (a Lightning property's broadcast, a metric's sync) that torch's
            # Flight Recorder shows paired with a different collective: gloo waits out its timeout.
            return (f"stuck for {idle:.0f} s after their collectives stopped pairing up (collective #{parted[1]} is "
                    f"not the same operation and size on every rank in torch's Flight Recorder)")
        return None

    def _past_deadline(self, now: float) -> bool:
        """The job's own wall-clock limit."""
        self.at_deadline = now > self.deadline
        return self.at_deadline

    def _waited_out(self, now: float) -> bool:
        """Whether the ranks still running are waited out (see the three rules below); sets
        ``gave_up`` to how long after what."""
        for since, rule, what, statuses in (
                (self.first_dead_at, self._dead_peer_waited_out, "died", ("died",)),
                (self.first_error_at, self._failed_peer_waited_out, "failed", ("error",)),
                (self.first_done_at, self._finished_peer_waited_out, "finished", ("ok", "skip"))):
            if rule(now):
                ranks = ", ".join(str(r) for r, o in sorted(self.outcomes.items()) if o.status in statuses)
                self.gave_up = f"{now - since:.0f} s after rank(s) {ranks} {what}"
                return True
        return False

    def _dead_peer_waited_out(self, now: float) -> bool:
        """A dead rank never joins another collective: its peers get a few seconds to report."""
        return bool(self.first_dead_at) and now - self.first_dead_at > min(self.straggler_s, 5.0)

    def _failed_peer_waited_out(self, now: float) -> bool:
        """A rank that raised left its peers waiting in a collective until the group times out."""
        return bool(self.first_error_at) and now - self.first_error_at > self.straggler_s

    def _finished_peer_waited_out(self, now: float) -> bool:
        """A rank that returned cannot match a collective its peers are still waiting in."""
        return bool(self.first_done_at) and now - self.first_done_at > self.straggler_s


def _process_identity(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a live process from /proc; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError):
        return None


def write_owner(root: str) -> None:
    """Name this process as the owner of the folder ``root`` (its pid and start time)."""
    identity = _process_identity(os.getpid())
    with open(os.path.join(root, OWNER_FILE), "w", encoding="ascii") as fh:
        fh.write(f"{os.getpid()} {identity[1] if identity else '-'}\n")


def _owner_alive(root: str) -> bool:
    """Whether the process that made the world folder ``root`` still runs; True when unsure (no
    owner file yet, unreadable, another user's process) so that a live world is never removed. A
    recorded start time tells a reused pid apart from the owner."""
    try:
        with open(os.path.join(root, OWNER_FILE), encoding="ascii") as fh:
            pid_text, started = fh.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    identity = _process_identity(pid)
    if identity is None:
        return not os.path.isdir("/proc")  # no /proc: the pid's existence is all we know
    state, start = identity
    return state != "Z" and (started == "-" or start == started)


def remove_stale_worlds(base: str | None = None) -> list[str]:
    """Remove the world folders under ``base`` (default: the temp dir) whose owner process is
    gone, e.g. a pytest killed with SIGKILL; returns the removed paths. Folders of live owners,
    of other users, and without an owner file are left alone."""
    base = base or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for name in entries:
        root = os.path.join(base, name)
        if not name.startswith(WORLD_PREFIX) or os.path.islink(root) or not os.path.isdir(root):
            continue
        try:
            if os.stat(root).st_uid != os.getuid() or not os.path.exists(os.path.join(root, OWNER_FILE)):
                continue
        except OSError:
            continue
        if not _owner_alive(root):
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
