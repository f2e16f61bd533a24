"""Entry point of one rank process: ``python -m pytest_ltconform.world.rank``.

Started by the supervisor the way torchrun starts ranks (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK, NODE_RANK set; TORCHELASTIC_USE_AGENT_STORE so every rank connects to the
supervisor's TCPStore as a client). It imports torch and lightning once, then takes jobs from the
store until told to stop. Each job gets a fresh default process group, its own directory and
trace file, and is isolated from the next one (environment, working directory, user modules,
seeds). This module never imports the pytest plugin.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import faulthandler
import importlib
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback

from .. import user_modules
from . import nodes, protocol
from .job import Job, resolve
from .protocol import FORMATION, formed_keys

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


_LIBC = None
_FORKED_BY = 0  # the pid of the process that forked this one last (see _children_die_with_rank)


def _set_death_signal() -> None:
    """SIGKILL this process when its parent (the thread that started it) ends."""
    global _LIBC
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6", use_errno=True)
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def name_process(name: str) -> None:
    """Set this process's name as ``ps`` and ``/proc/PID/comm`` show it (at most 15 bytes)."""
    global _LIBC
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6", use_errno=True)
        _LIBC.prctl(PR_SET_NAME, name.encode()[:15])
    except OSError:
        pass


def _children_die_with_rank() -> None:
    """Processes a rank forks (DataLoader workers) die with it, as the rank dies with pytest: a
    death signal is not inherited across fork, and a rank killed by SIGKILL cannot stop them."""
    def before() -> None:
        global _FORKED_BY
        _FORKED_BY = os.getpid()

    def in_child() -> None:
        _set_death_signal()
        if os.getppid() != _FORKED_BY:  # the parent died before the signal was set
            os._exit(3)

    os.register_at_fork(before=before, after_in_child=in_child)


def _die_with_parent(parent_pid: int) -> None:
    """Make sure no rank, nor a process it forked, outlives the pytest process (Ctrl-C, crash,
    SIGKILL of pytest)."""
    _set_death_signal()
    if os.getppid() != parent_pid:
        os._exit(3)
    _children_die_with_rank()

    def watch() -> None:  # portable fallback for platforms without prctl
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="ltconform-parent-watch", daemon=True).start()


@dataclasses.dataclass
class RankContext:
    """What a job function gets: ``rank``, ``world_size``, its own ``job_dir``, the path of the
    per-rank ``trace_path`` (JSON lines), and the world it runs in: ``accelerator`` ('cpu' or
    'gpu'), ``num_nodes`` the ranks span, and ``world_kind`` ('local' for ranks the plugin started,
    'attached' inside a torchrun or SLURM world). ``run_dir`` is the job's folder that its ranks
    share, as processes of one node share theirs: the working directory of the job and the
    Trainer's ``default_root_dir``. ``node_rank`` is the node the rank sits on; in a local world of
    several nodes ``node_local`` is the job's fresh folder in that node's own storage (its ``TMPDIR``
    and ``SLURM_TMPDIR``) and ``node_storage`` how that storage is kept apart from the other nodes'
    (``world.nodes``: 'mountns', or 'tmpdir' and why); both None on one node or when attached."""

    rank: int
    world_size: int
    local_rank: int
    job_dir: str
    trace_path: str
    store: object
    accelerator: str = "cpu"
    num_nodes: int = 1
    world_kind: str = "local"
    run_dir: str = ""
    seed: int = 0  # what this rank's generators were seeded with at the job's start
    seeding: str = "same"  # the job's seeding (world.job.JobRequest.seeding)
    base_seed: int = 0  # the job's seed, which "both" gives every rank once training starts
    node_rank: int = 0
    node_local: str | None = None
    node_storage: str | None = None


_CURRENT: RankContext | None = None


def current_context() -> RankContext | None:
    """The context of the job running on this rank now; None outside a job (for instance in
    the pytest process)."""
    return _CURRENT


_KEEP_ROOTS: tuple[str, ...] = ()


def keep_library_roots() -> None:
    """Keep modules under the stdlib and this package loaded between jobs (besides installed
    packages); every process that runs jobs calls this once before the first one."""
    global _KEEP_ROOTS
    import sysconfig

    import pytest_ltconform

    paths = sysconfig.get_paths()
    package_root = os.path.dirname(os.path.realpath(pytest_ltconform.__file__))
    _KEEP_ROOTS = tuple(os.path.realpath(p) for p in {paths["stdlib"], paths["platstdlib"], package_root})


def _library_module(mod) -> bool:
    """Modules that stay loaded between jobs: installed packages and the stdlib."""
    path = getattr(mod, "__file__", None)
    if not path:
        return True
    path = os.path.realpath(path)
    return path.startswith(_KEEP_ROOTS) or "site-packages" in path or "dist-packages" in path


@contextlib.contextmanager
def _isolated(job_dir: str):
    """Undo what a job may leave behind: env vars, cwd, newly imported user modules, sys.path."""
    env = dict(os.environ)
    cwd = os.getcwd()
    modules = set(sys.modules)
    path = list(sys.path)
    os.chdir(job_dir)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            mod = sys.modules.get(name)
            if mod is not None and not _library_module(mod):
                user_modules.forget(name)  # a later job's target loading gets it back


def rank_seed(seed: int, seeding: str, rank: int) -> int:
    """The seed rank ``rank`` starts a job with: ``seed`` under "same", ``seed + rank`` otherwise."""
    return seed if seeding == "same" else seed + rank


def seed_generators(seed: int) -> None:
    """Seed random, numpy and torch with ``seed`` (what seed_everything does, without its side effects)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _seed(seed: int = 0) -> None:
    import torch

    seed_generators(seed)
    torch.set_grad_enabled(True)


def _leading_error(exc: BaseException) -> BaseException:
    """The exception a report leads with: the root of an implicit chain ("During handling of the
    above exception, another exception occurred") whose later exceptions a library raised while
    cleaning up (Lightning's teardown after a DataLoader's workers failed to start raises "Please
    call `iter(combined_loader)` first"); an exception raised from user code, or chained on purpose
    (``raise ... from``), is kept."""
    from ..sites import is_user_file

    seen = set()
    while exc.__cause__ is None and exc.__context__ is not None and not exc.__suppress_context__ \
            and id(exc) not in seen:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or is_user_file(tb.tb_frame.f_code.co_filename):
            break
        seen.add(id(exc))
        exc = exc.__context__
    return exc


def _context(job: Job, rank: int, world_size: int, local_rank: int, store) -> RankContext:
    """Rank ``rank``'s context: its folder, its trace file and the world's parameters (the only
    thing that differs between the CPU, GPU and multi-node tiers on the rank side)."""
    node_rank = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or os.environ.get("SLURM_NODEID") or "0"
    return RankContext(rank, world_size, local_rank, protocol.rank_dir(job.dir, rank),
                       protocol.trace_file(job.dir, rank), store,
                       accelerator=job.accelerator or ("gpu" if job.backend == "nccl" else "cpu"),
                       num_nodes=int(job.num_nodes), world_kind=job.world_kind, run_dir=job.dir,
                       seed=rank_seed(job.seed, job.seeding, rank), seeding=job.seeding, base_seed=job.seed,
                       node_rank=int(node_rank) if node_rank.isdigit() else 0,
                       node_storage=os.environ.get(protocol.NODE_STORAGE_ENV))


class FormationError(RuntimeError):
    """A peer could not form the job's process group (its own error is in its result)."""


def _form_group(job: Job, rank: int, world_size: int, store, gen: int) -> None:
    """Create the job's default process group, then wait until every rank has it.

    Gloo's rendezvous (connectFullMesh) returns on one rank while a peer may still be reading
    the handshake; a rank that ran a short job and destroyed its group at that moment closed the
    socket under its peer ("Connection closed by peer"). No rank starts the job, so none can
    leave it, before every rank is connected. A rank that cannot form the group says so, so its
    peers stop waiting at once."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=job.pg_timeout_s)
    keys = formed_keys(gen, job.n, world_size)
    try:
        dist.init_process_group(job.backend, store=dist.PrefixStore(protocol.group_prefix(gen, job.n), store),
                                rank=rank, world_size=world_size, timeout=timeout)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            store.set(keys[rank], f"{type(exc).__name__}: {exc}"[:500])
        raise
    store.set(keys[rank], protocol.FORMED)
    store.wait(keys, timeout)
    failed = [r for r, key in enumerate(keys) if store.get(key) != protocol.FORMED]
    if failed:
        raise FormationError(f"rank(s) {failed} could not form the process group")


def run_job(job: Job, rank: int, world_size: int, local_rank: int, store, gen: int) -> protocol.RankResult:
    """Run ``job`` as rank ``rank`` in this process, in a fresh default process group built on
    ``store`` (keys under ``protocol.group_prefix``), isolated from the jobs before and after it.

    Returns the rank's :class:`~.protocol.RankResult`. Never raises for what the job does;
    SystemExit from user code is reported like any exception.
    """
    import torch
    import torch.distributed as dist

    global _CURRENT
    ctx = _context(job, rank, world_size, local_rank, store)
    os.makedirs(ctx.job_dir, exist_ok=True)
    result: protocol.RankResult = {"rank": rank, "status": "ok"}
    started = time.monotonic()
    with _isolated(ctx.run_dir):
        ctx.node_local = nodes.job_storage(job.dir)  # a fresh node-local folder per job (several nodes)
        _seed(ctx.seed)
        if job.backend == "nccl":
            torch.cuda.set_device(local_rank)
        default_dtype = torch.get_default_dtype()
        # init_process_group wraps sys.excepthook in a "[rankN]:" prefixer each time: a persistent
        # rank would print its Nth job's crash with N prefixes.
        excepthook = sys.excepthook
        _CURRENT = ctx
        stage = FORMATION
        try:
            _form_group(job, rank, world_size, store, gen)
            stage = "job"
            result["value"] = resolve(job.fn)(ctx, *job.args, **job.kwargs)
        except BaseException as exc:  # report everything, including SystemExit from user code
            skip = type(exc).__name__ in ("Skipped", "SkipTest")
            lead = _leading_error(exc)
            result.update(status="skip" if skip else "error", exc_type=type(lead).__name__,
                          message=str(lead)[:2000], traceback=traceback.format_exc()[-12000:])
            if stage == FORMATION:
                result["stage"] = FORMATION
        finally:
            _CURRENT = None
            sys.excepthook = excepthook
            tempfile.tempdir = None  # the environment's TMPDIR is put back below
            torch.set_default_dtype(default_dtype)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
    result["duration_s"] = round(time.monotonic() - started, 3)
    return result


def preload(names: list[str]) -> dict[str, str]:
    """Import ``names``; returns ``{name: "ExceptionType: message"}`` for those that failed. A
    module that is not installed, or whose import raises (a DeepSpeed build broken on this
    machine), is left out, not fatal: each rank imports it itself, as a spawned rank does, and
    fails there if it uses it. What the failed import left of its package is forgotten, so a
    rank's own import starts from nothing, as in a fresh interpreter."""
    failed = {}
    for name in names:
        if not name:
            continue
        before = set(sys.modules)
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken build raises all sorts of things at import
            package = name.partition(".")[0]
            for key in set(sys.modules) - before:
                if key == package or key.startswith(package + "."):
                    del sys.modules[key]
            failed[name] = f"{type(exc).__name__}: {exc}"
            missing = isinstance(exc, ModuleNotFoundError) and name.startswith(str(exc.name))
            if not missing:
                print(f"pytest-ltconform: preloading {name} raised {failed[name]}; each rank imports it "
                      f"itself", file=sys.stderr)
    return failed


def _connect(gen: int, rank: int):
    """The supervisor's store, once this rank has paid the cold start (the imports) and said
    it is ready."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(days=7), wait_for_workers=False,
    )
    # The cold-start cost is paid here, once per rank process (nothing left to import when forked).
    preload(os.environ.get(protocol.PRELOAD_ENV, "lightning.pytorch").split(","))
    store.set(protocol.ready_key(gen, rank), str(os.getpid()))
    return store


def stack_path() -> str | None:
    """The faulthandler file the supervisor asks this rank to dump its stack into (SIGUSR1);
    None outside a rank process of a local world."""
    workdir, gen = os.environ.get(protocol.WORLD_DIR_ENV), os.environ.get(protocol.GENERATION_ENV)
    rank = os.environ.get("RANK")
    if not (workdir and gen and rank):
        return None
    return protocol.stack_file(workdir, int(gen), int(rank))


def main() -> int:
    nodes.enter_node()  # first: a node's namespace is made and joined by a process of one thread
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    gen = int(os.environ[protocol.GENERATION_ENV])
    _die_with_parent(int(os.environ.get(protocol.PARENT_PID_ENV) or os.environ[protocol.SUPERVISOR_PID_ENV]))
    # torch's Flight Recorder (every collective, with its Python frames) is what finds a mismatch
    # no tap knows; a user's environment that switched it off would leave it blind. 1000 entries
    # (torch's default is 2000) reach back over several steps and halve the cost of a dump.
    if os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip() in ("", "0"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "1000"

    stack_file = open(stack_path(), "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    keep_library_roots()
    store = _connect(gen, rank)
    n = 0
    while True:
        job = Job.from_wire(store.get(protocol.job_key(gen, n)))
        if job is None:
            return 0
        result = run_job(job, rank, world_size, local_rank, store, gen)
        sys.stdout.flush()
        sys.stderr.flush()
        store.set(protocol.result_key(gen, n, rank), protocol.result_payload(result))
        n += 1


if __name__ == "__main__":
    # Run the importable copy of this module, not __main__: current_context() and the job
    # classes must be the ones the job functions import.
    from pytest_ltconform.world import rank as _rank

    sys.exit(_rank.main())
