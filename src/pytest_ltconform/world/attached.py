"""An attached world: pytest itself is one rank of a world that torchrun or SLURM started.

Nothing is spawned. Every rank runs the same pytest items in the same order; each contract run
is a job that every rank executes in-process, through the same rank-side job runner as a
:class:`~.local.LocalWorld` rank (fresh process group per job, job directory, trace file,
isolation of environment and modules). Outcomes and traces travel to rank 0 through a
``TCPStore`` (torchrun's agent store, or one rank 0 holds on the launcher's MASTER_PORT under
SLURM), never through the process group, so a job that broke the group still reports. Rank 0
assembles the :class:`~.local.JobResult` and publishes it, so every rank judges the same data and
reaches the same verdicts; only rank 0 prints them.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time

from . import protocol
from .devices import cuda_device_count
from .job import Job, JobRequest
from .launch.attached import AttachedLauncher
from .launch.base import LaunchError
from .local import WorldStartError
from .outcome import JobResult, RankOutcome, read_trace
from .rank import keep_library_roots, run_job


class CollectionMismatch(RuntimeError):
    """The ranks of an attached world collected different items (the message says how)."""


class AttachedWorld:
    """The launched world this pytest process is rank ``info.rank`` of (see ``tiers.Attached``).

    ``run(request)`` is the ``World`` interface, as ``LocalWorld.run``: it runs ``fn(ctx, *args)``
    on every rank (each rank runs it here, in its own process) and returns the same
    :class:`JobResult` on every rank. Call it on every rank in the same order.
    """

    def __init__(self, info, *, pg_timeout_s: float = 30.0, connect_timeout_s: float = 300.0,
                 backend: str = "gloo", accelerator: str = "cpu"):
        self.info = info
        self.rank = info.rank
        self.world_size = info.world_size
        self.pg_timeout_s = pg_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backend = backend
        self.accelerator = accelerator
        self.num_nodes: int | None = None
        self._root: str | None = None
        self._next_job = 0
        self._store = None
        self.launcher = AttachedLauncher(info, connect_timeout_s)
        self.closed = False

    @property
    def store(self):
        """The shared store, connected on first use (see ``launch.attached.AttachedLauncher``)."""
        if self._store is None:
            try:
                self._store = self.launcher.store()
            except LaunchError as exc:
                raise WorldStartError(str(exc)) from None
        return self._store

    @property
    def root(self) -> str:
        """The world's work folder, the same path on every rank (rank 0 names it), so that job
        folders line up as in a local world. It lives under $LTCONFORM_SHARED_DIR when set (a
        file system every node sees: sharded checkpoints need one), else the temp dir."""
        if self._root is None:
            if self.rank == 0:
                base = os.environ.get("LTCONFORM_SHARED_DIR") or tempfile.gettempdir()
                os.makedirs(base, exist_ok=True)
                self._root = tempfile.mkdtemp(prefix="ltconform-attached-", dir=base)
            (root,) = {p for p in self.exchange("root", self._root, self.connect_timeout_s) if p}
            self._root = root
            os.makedirs(root, exist_ok=True)
        return self._root

    # -- collection ---------------------------------------------------------------------------------
    def exchange(self, key: str, payload, timeout_s: float) -> list:
        """Post ``payload`` under ``key`` and return every rank's, in rank order. Raises
        ``TimeoutError`` naming the ranks that did not post within ``timeout_s``."""
        store = self.store
        store.set(f"{key}/{self.rank}", pickle.dumps(payload))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if time.monotonic() > deadline:
                late = [r for r in range(self.world_size) if not store.check([f"{key}/{r}"])]
                raise TimeoutError(f"rank(s) {', '.join(map(str, late))} did not reach '{key}' within "
                                   f"{timeout_s:.0f} s (did they fail to start pytest, or exit early?)")
            time.sleep(0.05)
        return [pickle.loads(store.get(k)) for k in keys]

    def agree_collection(self, nodeids: list[str], facts: dict, timeout_s: float = 300.0) -> None:
        """Check that every rank collected the same items in the same order, and settle the
        world's layout (nodes, accelerator) from every rank's ``facts``.

        ``facts``: ``node_rank``, ``cuda`` (CUDA devices visible), ``host``, ``errors`` (collection
        errors). Raises :class:`CollectionMismatch` with the first difference.
        """
        mine = {"items": list(nodeids), **facts}
        try:
            every = self.exchange("collect", mine, timeout_s)
        except TimeoutError as exc:
            raise CollectionMismatch(f"collection could not be compared across ranks: {exc}") from None
        ref = every[0]
        for r, other in enumerate(every):
            problem = _collection_difference(ref, other, r)
            if problem:
                raise CollectionMismatch(
                    f"the ranks of this {self.info.launcher} world collected different tests: {problem}. "
                    f"Every rank must run the same pytest command line (same -m, -k, paths, options and "
                    f"files), or the contract runs would pair collectives of different items and hang."
                )
        self.num_nodes = len({p["node_rank"] for p in every})
        per_node = {}
        for p in every:
            per_node[p["node_rank"]] = per_node.get(p["node_rank"], 0) + 1
        if all(p.get("cuda", 0) >= per_node[p["node_rank"]] for p in every):
            self.backend, self.accelerator = "nccl", "gpu"
        else:
            self.backend, self.accelerator = "gloo", "cpu"

    # -- jobs ---------------------------------------------------------------------------------------
    def run(self, request: JobRequest) -> JobResult:
        if self.closed:
            raise WorldStartError("this attached world was closed")
        keep_library_roots()  # as a spawned rank does: the job runner must spare the stdlib and us
        store = self.store
        n = self._next_job
        self._next_job += 1
        job_dir = os.path.join(self.root, f"job{n:04d}")
        os.makedirs(job_dir, exist_ok=True)
        timeout_s = request.timeout_s
        job = Job(fn=request.fn, dir=job_dir, n=n, args=request.args, kwargs=request.kwargs, seed=request.seed,
                  seeding=request.seeding,
                  backend=self.backend, pg_timeout_s=self.pg_timeout_s, accelerator=self.accelerator,
                  num_nodes=self.num_nodes or 1, world_kind="attached")
        # Every job gets a fresh folder in this node's own temp storage (nodes.job_storage), named
        # alike on every rank, so a node's ranks share it and nothing a run left there is found again.
        os.environ.setdefault(protocol.NODE_ROOT_ENV, self._node_local_root())
        started = time.monotonic()
        # Last resort for a job stuck outside any collective: dump every thread and exit, so the
        # launcher tears the world down instead of everyone waiting forever.
        faulthandler.dump_traceback_later(timeout_s + self.pg_timeout_s + 60.0, exit=True, file=sys.stderr)
        try:
            outcome = run_job(job, self.rank, self.world_size, self.info.local_rank, store, 0)
            outcome["trace"] = read_trace(protocol.trace_file(job_dir, self.rank))
            store.set(protocol.attached_result_key(n, self.rank), protocol.result_payload(outcome))
            if self.rank == 0:
                result = self._assemble(n, started, timeout_s, job_dir)
                store.set(protocol.final_key(n), pickle.dumps(result))
                return result
            return self._await_final(n, timeout_s)
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _node_local_root(self) -> str:
        """This world's folder in the node's temp storage (the launcher's TMPDIR, else /tmp): the
        same name on every rank (the agreed root's), each node's own on a cluster."""
        return os.path.join(tempfile.gettempdir(), os.path.basename(self.root.rstrip(os.sep)) + "-node-local")

    def _assemble(self, n: int, started: float, timeout_s: float, job_dir: str) -> JobResult:
        store = self.store
        keys = {r: protocol.attached_result_key(n, r) for r in range(self.world_size)}
        outcomes: dict[int, RankOutcome] = {}
        # Rank 0 has finished; a peer stuck in a collective gets the group's timeout plus slack.
        deadline = max(started + timeout_s, time.monotonic() + self.pg_timeout_s + 10.0)
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            for r, key in keys.items():
                if r not in outcomes and store.check([key]):
                    outcomes[r] = RankOutcome.from_wire(protocol.read_result(store.get(key)))
            time.sleep(0.02)
        for r in range(self.world_size):
            outcomes.setdefault(r, RankOutcome(rank=r, status="hung"))
        ranks = [outcomes[r] for r in range(self.world_size)]
        return JobResult.of(ranks, time.monotonic() - started, timeout_s=timeout_s, job_dir=job_dir)

    def _await_final(self, n: int, timeout_s: float) -> JobResult:
        store = self.store
        key = protocol.final_key(n)
        deadline = time.monotonic() + timeout_s + self.pg_timeout_s + 30.0
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise WorldStartError(f"{self.info.describe()}: rank 0 did not publish the result of job {n}")
            time.sleep(0.02)
        return pickle.loads(store.get(key))

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave together: rank 0 keeps serving the store until every rank has finished with it."""
        if self.closed:
            return
        self.closed = True
        if self._store is not None:
            try:
                # Others only say they left; rank 0 (the server) waits for that before it exits,
                # so no rank is cut off in the middle of a store call.
                self._store.set(protocol.left_key(self.rank), b"1")
                if self.rank == 0:
                    keys = [protocol.left_key(r) for r in range(self.world_size)]
                    deadline = time.monotonic() + timeout_s
                    while not self._store.check(keys) and time.monotonic() < deadline:
                        time.sleep(0.05)
            except Exception:
                pass
        self._store = None
        if self._root is not None:  # after every rank has left it (node-local copies too)
            shutil.rmtree(self._root, ignore_errors=True)
            if os.environ.get(protocol.NODE_ROOT_ENV) == self._node_local_root():
                shutil.rmtree(os.environ.pop(protocol.NODE_ROOT_ENV), ignore_errors=True)


def _collection_difference(ref: dict, other: dict, rank: int) -> str | None:
    """How rank ``rank``'s collection differs from rank 0's, or None."""
    a, b = ref["items"], other["items"]
    if ref.get("errors", 0) != other.get("errors", 0):
        return (f"rank 0 had {ref.get('errors', 0)} collection error(s), rank {rank} had "
                f"{other.get('errors', 0)}")
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"item {i + 1} is {x!r} on rank 0 but {y!r} on rank {rank}"
    longer, extra = (0, a[len(b)]) if len(a) > len(b) else (rank, b[len(a)])
    return (f"rank 0 collected {len(a)} items and rank {rank} {len(b)}; the first one only rank {longer} "
            f"has is {extra!r}")


def host_facts(node_rank: int) -> dict:
    """What a rank tells the others at collection time."""
    return {"node_rank": node_rank, "cuda": cuda_device_count(), "host": socket.gethostname()}
