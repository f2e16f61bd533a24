"""Launch helpers for the multi-node test tier.

Two ways to put a Lightning script into a real two-node ``torch.distributed``
world on this one host:

* :class:`SlurmCluster`: Debian's real ``slurmctld`` plus two ``slurmd``
  daemons posing as nodes ``n1`` and ``n2``, driven with real ``srun``.
* :func:`torchrun_two_agents`: two ``torch.distributed.run`` agents with
  ``--nnodes 2`` and a static rendezvous on 127.0.0.1.

Every process started here runs in its own session and is killed on timeout
or exit, so a hang or a failing test never leaves daemons or workers behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

SBIN_DIRS = ("/usr/sbin", "/sbin")
REQUIRED_PROGRAMS = ("slurmctld", "slurmd", "srun", "sinfo", "scancel", "munged")
NODES = ("n1", "n2")

# Variables through which an outer launcher (a SLURM job, torchrun, or an
# in-process Lightning run that exported MASTER_PORT) would leak into the
# world under test; they are dropped before launching anything.
_LAUNCHER_VARS = frozenset(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK "
    "ROLE_WORLD_SIZE NODE_RANK MASTER_ADDR MASTER_PORT".split()
)
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_")


class RunResult(subprocess.CompletedProcess):
    """A :class:`subprocess.CompletedProcess` that also records wall time and timeout."""

    def __init__(
        self,
        args: Sequence[str],
        returncode: int,
        stdout: str,
        stderr: str,
        duration: float,
        timed_out: bool,
    ) -> None:
        super().__init__(list(args), returncode, stdout, stderr)
        self.duration = duration
        self.timed_out = timed_out

    def __repr__(self) -> str:
        return (
            f"RunResult(rc={self.returncode}, duration={self.duration:.1f}s, "
            f"timed_out={self.timed_out}, args={self.args!r})"
        )


def _which(name: str) -> str | None:
    """Find ``name`` on PATH or in the sbin dirs, which non-login root shells may lack."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN_DIRS))


def slurm_available() -> str | None:
    """Return None when the SLURM and munge programs exist, else why not."""
    missing = [name for name in REQUIRED_PROGRAMS if _which(name) is None]
    if missing:
        return (
            f"not found on PATH or in {', '.join(SBIN_DIRS)}: {', '.join(missing)} "
            "(install with .ci/install-slurm)"
        )
    return None


def launcher_free_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without launcher variables, updated with ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARS and not key.startswith(_LAUNCHER_PREFIXES)
    }
    env.update(extra or {})
    return env


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports that are free right now (on all interfaces)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))  # slurm daemons bind to 0.0.0.0
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL whatever is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    # Even after the leader exits, its children may linger in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_concurrently(
    cmds: Sequence[Sequence[str]],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    peer_grace: float | None = 60.0,
    kill_grace: float = 5.0,
) -> list[RunResult]:
    """Run ``cmds`` at once, each in its own session, and wait for all of them.

    When ``timeout`` seconds pass, every process group still running is killed
    and its result has ``timed_out=True``. When one command fails and
    ``peer_grace`` is not None, the others get that long to finish before being
    killed the same way: a peer of a dead rank usually blocks in a collective
    for the whole (long) default process-group timeout. Output goes to
    temporary files, so a killed run still returns what it printed.
    """
    start = time.monotonic()
    deadline = start + timeout
    outs, errs, procs = [], [], []
    try:
        for cmd in cmds:
            outs.append(tempfile.TemporaryFile())
            errs.append(tempfile.TemporaryFile())
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    stdin=subprocess.DEVNULL,
                    stdout=outs[-1],
                    stderr=errs[-1],
                    env=dict(env) if env is not None else None,
                    cwd=cwd,
                    start_new_session=True,
                )
            )
        durations: list[float | None] = [None] * len(procs)
        timed_out = [False] * len(procs)
        while True:
            now = time.monotonic()
            for i, proc in enumerate(procs):
                if durations[i] is None and proc.poll() is not None:
                    durations[i] = now - start
            running = [i for i, d in enumerate(durations) if d is None]
            if not running:
                break
            failed_at = [d for i, d in enumerate(durations) if d is not None and procs[i].returncode != 0]
            if now >= deadline or (
                peer_grace is not None and failed_at and now - start >= min(failed_at) + peer_grace
            ):
                for i in running:
                    timed_out[i] = True
                    _kill_group(procs[i], kill_grace)
                    durations[i] = time.monotonic() - start
                break
            time.sleep(0.05)
    finally:
        # Reached with procs still running only if this function itself failed
        # or was interrupted: never leave them behind.
        for proc in procs:
            if proc.returncode is None:
                _kill_group(proc, kill_grace)
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # orphans left in the group
                except (ProcessLookupError, PermissionError):
                    pass

    results = []
    for cmd, proc, out, err, duration, tout in zip(cmds, procs, outs, errs, durations, timed_out):
        out.seek(0)
        err.seek(0)
        results.append(
            RunResult(
                cmd,
                proc.returncode,
                out.read().decode(errors="replace"),
                err.read().decode(errors="replace"),
                duration,
                tout,
            )
        )
        out.close()
        err.close()
    return results


def torchrun_two_agents(
    cmd: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> list[RunResult]:
    """Run ``cmd`` (a script and its arguments, as torchrun takes them) under two
    torchrun agents, node ranks 0 and 1, with a static rendezvous on 127.0.0.1.

    Returns the agents' results in node-rank order; see :func:`run_concurrently`
    for what happens on timeout or when one agent fails.
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)[0])]
    agents = [[*launcher, "--node-rank", str(rank), *rendezvous, *cmd] for rank in (0, 1)]
    return run_concurrently(agents, timeout, env=launcher_free_env(env), cwd=cwd)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"    <{exc}>"
    return "\n".join("    " + line for line in text[-lines:]) or "    <empty>"


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` where Python has it (3.11+); the project supports 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The state follows the parenthesised command name, which may hold spaces.
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


class SlurmCluster:
    """A real two-node SLURM cluster (nodes n1, n2) on this host, as a context manager.

    It runs a private munged (own key and socket in the temp dir, so a system
    munged is neither needed nor touched), one slurmctld and one slurmd per node,
    each on its own free port. On exit every job is cancelled, the daemons are
    stopped by their pid files, and any process still carrying this cluster's
    ``SLURM_CONF`` (slurmstepd, tasks) is killed. The temp dir, with all logs,
    is removed only when the body succeeded (or never, with ``keep_dir=True``).
    """

    def __init__(self, start_timeout: float = 60.0, keep_dir: bool = False) -> None:
        self.start_timeout = start_timeout
        self.keep_dir = keep_dir
        self.dir: Path | None = None
        self.conf: Path | None = None
        self.env: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        reason = slurm_available()
        if reason:
            raise RuntimeError(f"cannot start a SLURM cluster: {reason}")
        self.dir = Path(tempfile.mkdtemp(prefix="ltconform-slurm-"))
        try:
            self._start_munged()
            self._write_conf()
            self._start_slurm()
            self._wait_idle()
        except BaseException as exc:
            self._stop()
            _add_note(exc, f"SLURM cluster files kept in {self.dir}")
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop()
        if exc_type is None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif exc is not None:
            _add_note(exc, f"SLURM cluster files kept in {self.dir}")

    # -- use ---------------------------------------------------------------

    def srun(
        self,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> RunResult:
        """Run ``srun *args`` against this cluster and return its result.

        The environment is ``os.environ`` without launcher variables, plus
        :attr:`env`, plus ``env``. On timeout srun's group is killed and every
        job is cancelled, so the tasks on the nodes die too.
        """
        full_env = launcher_free_env({**self.env, **(env or {})})
        srun = [_which("srun"), *args]
        (result,) = run_concurrently([srun], timeout, env=full_env, cwd=cwd, peer_grace=None)
        if result.timed_out:
            self._cancel_jobs()
        return result

    def log_tails(self, lines: int = 25) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for log in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {log}\n{_tail(log, lines)}")
        return "\n".join(parts)

    # -- start -------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> None:
        """Start a daemon in the foreground (-D/-F) so we hold its pid from the start."""
        log = open(self.dir / f"{name}.out.log", "wb")
        with log:
            self._procs[name] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=launcher_free_env(self.env),
                cwd=self.dir,
                start_new_session=True,
            )

    def _start_munged(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        self._munge_pidfile = munge / "munged.pid"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                # Without it munged rejects a socket under a dir that is not
                # world-executable, as a private temp dir is.
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self._munge_pidfile}",
                f"--log-file={self.dir / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start\n{self.log_tails()}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        d = self.dir
        (d / "state").mkdir()
        for node in NODES:
            (d / "spool" / node).mkdir(parents=True)
        lines = [
            "ClusterName=ltconform",
            # Lightning's SLURMEnvironment takes MASTER_PORT = 15000 + the job id's
            # last 4 digits; a random first id keeps clusters in parallel (or one
            # soon after another) off each other's port.
            f"FirstJobId={1000 + secrets.randbelow(9000)}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Points slurm (daemons and clients alike) at our private munged.
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        # Each slurmd needs its own port: two on one port fail to bind.
        for node, port in zip(NODES, node_ports):
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 "
                f"CPUs={cpus} RealMemory=1000 Port={port}"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE"
        )
        self.conf = d / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        # n1/n2 do not resolve as hosts, and Lightning's SLURMEnvironment would
        # derive MASTER_ADDR from SLURM_NODELIST; an explicit MASTER_ADDR wins.
        self.env = {"SLURM_CONF": str(self.conf), "MASTER_ADDR": "127.0.0.1"}

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node])

    def _sinfo(self) -> str:
        try:
            proc = subprocess.run(
                [_which("sinfo"), "-h", "-N", "-o", "%N %T"],
                env=launcher_free_env(self.env),
                capture_output=True,
                text=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            return "<sinfo timed out>"
        return (proc.stdout + proc.stderr).strip()

    def _wait_idle(self) -> None:
        """Block until sinfo shows every node idle, or fail with the daemon logs."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            out = self._sinfo()
            states = dict(line.split(None, 1) for line in out.splitlines() if " " in line)
            if all(states.get(node) == "idle" for node in NODES):
                return
            dead = [name for name, proc in self._procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"exited: {', '.join(dead)}" if dead else f"not idle after {self.start_timeout}s"
                raise RuntimeError(
                    f"SLURM cluster failed to start ({why}); last sinfo:\n{out}\n{self.log_tails()}"
                )
            time.sleep(0.5)

    # -- stop --------------------------------------------------------------

    def _cancel_jobs(self) -> None:
        if self._procs.get("slurmctld") is None or self._procs["slurmctld"].poll() is not None:
            return
        try:
            subprocess.run(
                [_which("scancel"), "--quiet", "--partition=debug"],
                env=launcher_free_env(self.env),
                capture_output=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            pass

    def _pidfile_pids(self) -> dict[int, str]:
        """Daemon pids from the pid files, keyed to the program name they must run."""
        files = [(self._munge_pidfile, "munged")] if hasattr(self, "_munge_pidfile") else []
        files.append((self.dir / "slurmctld.pid", "slurmctld"))
        files += [(self.dir / f"slurmd-{node}.pid", "slurmd") for node in NODES]
        pids = {}
        for path, program in files:
            try:
                pids[int(path.read_text().split()[0])] = program
            except (OSError, ValueError, IndexError):
                pass
        return pids

    def _stop(self) -> None:
        """Cancel jobs, stop the daemons, and kill anything left of this cluster."""
        if self.dir is None:
            return
        self._cancel_jobs()
        pidfile_pids = self._pidfile_pids()
        # slurmd first (it reports to slurmctld), munged last (the others use it).
        order = [f"slurmd-{node}" for node in NODES] + ["slurmctld", "munged"]
        for name in order:
            proc = self._procs.get(name)
            if proc is None:
                continue
            pidfile_pids.pop(proc.pid, None)
            _kill_group(proc, grace=10.0)  # also reaps children left in its group
        # A pid file naming a process we did not spawn (should not happen):
        # stop it too, if it still runs the program the file belongs to.
        for pid, program in pidfile_pids.items():
            if _alive(pid) and program.encode() in _read_proc(pid, "cmdline"):
                os.kill(pid, signal.SIGKILL)
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL every process whose environment or command line names this cluster.

        slurmstepd and the tasks it forks are reparented to init, outside every
        process group started here; they all carry our SLURM_CONF.
        """
        if self.conf is None:
            return
        env_marker = b"\0SLURM_CONF=" + str(self.conf).encode() + b"\0"
        cmd_marker = str(self.dir).encode()
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            pid = int(entry)
            environ = b"\0" + _read_proc(pid, "environ")
            if env_marker in environ or cmd_marker in _read_proc(pid, "cmdline"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
