"""The fork launcher's parent: ``python -m pytest_ltconform.world.zygote REQUEST_FD REPLY_FD``.

It imports the preload modules once, in two steps: the first (Lightning: what validating a
target needs) before it says it is ready, the others (DeepSpeed when its tier runs, the plugin's
rank-side modules) when the first rank is asked for, so that a session stopped by a usage error
or ``--collect-only`` never pays them. The supervisor may ask for some of the second step ahead
(``("import", token, names)``, answered by ``("imported", token, {name: why it failed or None},
refusal)``): whether DeepSpeed imports decides which items are collected.
After each step it checks that forking is safe (one thread, CUDA not initialised, no process
group). It forks a rank process for each request of the supervisor (``launch.fork.ForkLauncher``)
and reports each one's exit status.
A forked rank becomes what a spawned one is: its own session, environment, working folder, log
file and ``sys.path``, then ``rank.main()``. The user's code never runs here. This module never
imports the pytest plugin.

Under pytest-xdist one parent serves every worker of the session on this machine
(``python -m pytest_ltconform.world.zygote --listen FD``): it accepts each worker on a Unix socket
of the session folder (``world.share``), answers each on its own connection, kills the processes
it forked for a worker when that worker's connection closes, and stops when the last worker has
gone or the session's owner (the xdist controller) is gone. With pipes (one supervisor) it stops
when its supervisor closes them, and dies with it.

Messages both ways are length-prefixed pickles (see :func:`send`): to the parent
``("fork", token, env, log_path, cwd)`` and ``("fresh", request_path)``; from it
``("ready", pid, refusal, env_added)``, ``("forked", token, pid)``, ``("refused", token, refusal)``
(the second step's imports made forking unsafe; the parent exits; token 0 tells the other workers of a
shared parent) and ``("exit", pid, returncode)``.
``("store", token, port, secret)`` forks the keeper of a world's store (``kept_store``), answered
by ``("kept", token, pid)``.

A forked rank may ask the parent for a *fresh process* (:func:`run_fresh`): a sibling forked
from the same parent, so it has torch and Lightning imported and none of the user's code, which
calls one named function and returns its JSON. That is what importing a module the way a spawned
process would costs a fork instead of an interpreter.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

from . import protocol, rank
from .protocol import send, take
from .share import SESSION_OWNER_ENV

# In a rank this parent forked: the pipe on which it asks for a fresh process (see run_fresh).
_ASK_FD: int | None = None


def unsafe_to_fork() -> str | None:
    """Why this process must not fork ranks, or None: a second thread (its locks would be copied
    held), CUDA initialised (a forked child cannot use it), or a process group open."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads > 1 or threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        return (f"it runs {threads} threads after its imports (Python threads: {names}); a forked rank would "
                f"inherit their locks held")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while importing the preloaded modules; a forked rank could not use it"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "a process group was opened while importing the preloaded modules"
    return None


# The name a store's keeper runs under (``/proc/PID/comm``).
KEEPER_NAME = "ltconform-store"


class _Refused(Exception):
    """The second step's imports made forking unsafe: the parent has said so and stops."""


class _Client:
    """One supervisor the parent serves: its connection (a pipe pair, or one socket for both ways),
    what it sent that is not a whole message yet, and the processes forked for it."""

    def __init__(self, in_fd: int, out_fd: int):
        self.in_fd, self.out_fd = in_fd, out_fd
        self.buffer = bytearray()
        self.children: set[int] = set()
        self.gone = False

    def send(self, message: tuple) -> None:
        """Send ``message``; a supervisor that is gone is marked so (its connection is closed later)."""
        if self.gone:
            return
        try:
            send(self.out_fd, message)
        except OSError:
            self.gone = True


class Zygote:
    """The parent's loop: fork on request, reap children, report their exits to the supervisor
    that asked. ``listen_fd`` (a listening Unix socket) serves several supervisors (the workers of
    one pytest-xdist session), else the one on the pipes ``request_fd`` and ``reply_fd``."""

    # Seconds a shared parent waits for its first supervisor, and checks the session's owner.
    FIRST_CLIENT_S = 60.0

    def __init__(self, request_fd: int = -1, reply_fd: int = -1, listen_fd: int = -1):
        self.listener = socket.socket(fileno=listen_fd) if listen_fd >= 0 else None
        self.listen_fd = listen_fd
        self.clients: list[_Client] = [] if listen_fd >= 0 else [_Client(request_fd, reply_fd)]
        self.owner: dict[int, _Client] = {}  # pid of a process forked for a supervisor -> that supervisor
        self.children: set[int] = set()
        self.base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        self.start_env = dict(os.environ)
        self.env_added: dict = {}
        self.wake_r, self.wake_w = os.pipe()
        self.ask_r, self.ask_w = os.pipe()  # ranks' requests for a fresh process: one path per line
        self.fresh: dict[int, tuple[str, int]] = {}  # pid of a fresh process -> (request file, asking rank)
        self.asks = bytearray()
        self.preloaded: list[str] = []
        self.later: list[str] = []  # the second step's modules, imported before the first rank
        self.failed: dict[str, str] = {}  # preload modules whose import failed -> why
        self.refusal: str | None = None
        self.session_owner = int(os.environ.get(SESSION_OWNER_ENV) or 0)
        self.started = time.monotonic()
        self.served = False  # a supervisor connected (a shared parent stops when the last one goes)

    def serve(self) -> int:
        names = [n for n in os.environ.get(protocol.PRELOAD_ENV, "").split(",") if n]
        self.later = names[1:]
        self.refusal = self._import(names[:1])
        for client in self.clients:
            client.send(self._ready())
        if self.refusal and self.listen_fd < 0:
            return 2
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select through the fd
        return self._loop()

    def _ready(self) -> tuple:
        return "ready", os.getpid(), self.refusal, self.env_added

    def _import(self, names: list[str]) -> str | None:
        """Import ``names``; the refusal to fork after them (None when forking is safe)."""
        # No collection while importing: each would walk every object imported so far, again and
        # again (a fifth of the import's CPU). Then the imports' objects go to the collector's
        # permanent generation: a rank's collections never walk the objects it inherited, nor copy
        # their pages by touching them (a sixth of a BoringModel session's CPU). Ranks are forked
        # with the collector on, and collect what they make, the user's objects among them, as usual.
        gc.disable()
        try:
            self.failed.update(rank.preload(names))
        finally:
            gc.freeze()
            gc.enable()
        self.preloaded += names
        # What the imports set in os.environ (Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK): a
        # spawned rank has it too, since its imports run after its environment is set.
        self.env_added = {k: v for k, v in os.environ.items() if self.start_env.get(k) != v}
        refusal = unsafe_to_fork()
        if refusal:
            refusal = (f"the fork launcher's parent (pid {os.getpid()}) refuses to fork ranks: {refusal} "
                       f"(preloaded: {', '.join(self.preloaded) or 'nothing'}). Start ranks as fresh "
                       f"interpreters instead: --ltconform-launcher=spawn.")
        return refusal

    def _loop(self) -> int:
        while True:
            fds = [self.wake_r, self.ask_r] + [c.in_fd for c in self.clients] + \
                ([self.listen_fd] if self.listen_fd >= 0 else [])
            try:
                ready, _, _ = select.select(fds, [], [], 1.0)
            except InterruptedError:
                ready = []
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self._reap()
            if self.ask_r in ready:
                self._asked()
            if self.listen_fd in ready:
                self._accept()
            for client in [c for c in self.clients if c.in_fd in ready]:
                if not self._read(client):
                    self._kill_all()
                    return 2
            for client in [c for c in self.clients if c.gone]:
                self._drop(client)
            if self._done():
                self._kill_all()
                return 0

    def _read(self, client: _Client) -> bool:
        """Handle what ``client`` sent; False when the parent must stop (a refusal to fork)."""
        try:
            data = os.read(client.in_fd, 65536)
        except OSError:
            data = b""
        if not data:  # the supervisor closed its end or died: take its processes down
            client.gone = True
            return True
        client.buffer += data
        for message in take(client.buffer):
            if message[0] == "fork":
                try:
                    self._fork(client, *message[1:])
                except _Refused:
                    return False
            elif message[0] == "fresh":
                self._fresh(message[1], client)
            elif message[0] == "store":
                self._keep_store(client, *message[1:])
            elif message[0] == "import":
                if not self._import_now(client, *message[1:]):
                    return False
        return True

    def _accept(self) -> None:
        """A worker of the session connects: it is told what the first import step told the others."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fd = conn.detach()
        client = _Client(fd, fd)
        self.clients.append(client)
        self.served = True
        client.send(self._ready())

    def _drop(self, client: _Client) -> None:
        """``client`` is gone: SIGKILL what was forked for it (its ranks, its store's keeper)."""
        for pid in client.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.clients.remove(client)
        with contextlib.suppress(OSError):
            os.close(client.in_fd)
            if client.out_fd != client.in_fd:
                os.close(client.out_fd)

    def _done(self) -> bool:
        """Whether the parent stops: its supervisor is gone (pipes); every worker is gone, none
        came in time, or the session's owner is gone (shared)."""
        if self.listen_fd < 0:
            return not self.clients
        if self.session_owner and not _alive(self.session_owner):
            return True
        if self.clients or not (self.served or time.monotonic() - self.started > self.FIRST_CLIENT_S):
            return False
        if select.select([self.listen_fd], [], [], 0)[0]:  # a worker is connecting as the last one left
            self._accept()
            return False
        return True

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            client = self.owner.get(pid)
            if client is not None:
                client.children.discard(pid)
            if pid in self.fresh:  # the asking rank reads its exit status from a file
                _write_atomic(self.fresh.pop(pid)[0] + ".exit", str(os.waitstatus_to_exitcode(status)))
                continue
            for fresh, (_, asker) in list(self.fresh.items()):
                if asker == pid:  # a rank killed while it waited: what it asked for goes with it
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(fresh, signal.SIGKILL)
            if client is not None:
                client.send(("exit", pid, os.waitstatus_to_exitcode(status)))

    def _kill_all(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def _import_now(self, client: _Client, token: int, names: list[str]) -> bool:
        """Import ``names`` of the second step ahead of it (the supervisor asks what a tier
        needs before any rank runs) and say which failed; False after a refusal (sent)."""
        now = [n for n in names if n not in self.preloaded]
        self.later = [n for n in self.later if n not in now]
        refusal = self._import(now)
        client.send(("imported", token, {n: self.failed.get(n) for n in names}, refusal))
        if refusal:
            self._refuse_others(client, refusal)
        return refusal is None

    def _fork(self, client: _Client, token: int, env: dict, log_path: str, cwd: str) -> None:
        if self.later:
            later, self.later = self.later, []
            refusal = self._import(later)
            if refusal:
                client.send(("refused", token, refusal))
                self._refuse_others(client, refusal)
                raise _Refused
        pid = self._fork_child(lambda: self._become_rank(env, log_path, cwd), client)
        client.send(("forked", token, pid))

    def _refuse_others(self, asker: _Client, refusal: str) -> None:
        """The other workers of a shared parent hear of a refusal too (token 0), not only that it stopped."""
        for client in self.clients:
            if client is not asker:
                client.send(("refused", 0, refusal))

    def _fork_child(self, body, client: _Client | None = None) -> int:
        """Fork a child that runs ``body()`` (its exit status) and exits; the child's pid. A
        child forked for ``client`` is killed when that supervisor goes."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            self.children.add(pid)
            if client is not None:
                self.owner[pid] = client
                client.children.add(pid)
            return pid
        code = 1
        try:
            code = body()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _become_rank(self, env: dict, log_path: str, cwd: str) -> int:
        """In the child: what a spawned rank's start gives it, then the rank's own main."""
        parent = os.getppid()
        self._leave_parent()
        global _ASK_FD
        _ASK_FD = self.ask_w
        self._take_over(env, log_path, cwd, parent)
        _rank_zero_from_env()
        return rank.main()

    def _leave_parent(self) -> None:
        """In a child: its own process group (the supervisor kills it with killpg), the parent's
        signal handling and pipes undone."""
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Every supervisor's connection and the listening socket: a child holding one would keep a
        # dead parent's socket answering, or a supervisor's connection open after the supervisor.
        fds = {self.wake_r, self.wake_w, self.ask_r, self.listen_fd} | \
            {fd for c in self.clients for fd in (c.in_fd, c.out_fd)}
        for fd in fds - {-1}:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _take_over(self, env: dict, log_path: str, cwd: str, parent: int | None) -> None:
        """In a child: what a spawned process's start gives it: its log as stdout and stderr, its
        folder, its environment and ``sys.path``."""
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(self.env_added)
        if parent is not None:
            os.environ[protocol.PARENT_PID_ENV] = str(parent)
        # sys.path as `python -m` in ``cwd`` with the rank's PYTHONPATH would have it.
        given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd] + given + [p for p in self.base_path if p not in given]
        importlib.invalidate_caches()  # files written since the parent listed their folders
        tempfile.tempdir = None  # the rank's TMPDIR, not the parent's

    def _asked(self) -> None:
        data = os.read(self.ask_r, 65536)
        self.asks += data
        while b"\n" in self.asks:
            line, _, rest = bytes(self.asks).partition(b"\n")
            self.asks[:] = rest
            self._fresh(line.decode())

    def _fresh(self, path: str, client: _Client | None = None) -> None:
        """Fork a fresh process for the request file at ``path`` (a rank's, or ``client``'s: a
        supervisor's)."""
        try:
            with open(path) as fh:
                request = json.load(fh)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                _write_atomic(path + ".exit", f"-1 {exc}")
            return
        self._fork_fresh(path, request, client)

    def _fork_fresh(self, request_path: str, request: dict, client: _Client | None) -> None:
        """Fork a fresh process for the request file a rank wrote (see :func:`run_fresh`)."""
        pid = self._fork_child(lambda: self._run_fresh(request_path, request), client)
        self.fresh[pid] = (request_path, request["asker"])
        _write_atomic(request_path + ".pid", str(pid))

    def _keep_store(self, client: _Client, token: int, port: int, secret: str) -> None:
        """Fork the keeper of a world's store (see ``kept_store``), which connects to the
        supervisor on loopback ``port``."""
        pid = self._fork_child(lambda: self._run_keeper(port, secret), client)
        client.send(("kept", token, pid))

    def _run_keeper(self, port: int, secret: str) -> int:
        """In the child: leave the parent's pipes and signals, die with the parent, serve."""
        self._leave_parent()
        os.close(self.ask_w)
        rank._set_death_signal()
        rank.name_process(KEEPER_NAME)  # told from the ranks in `ps` (the same command line)
        from . import kept_store

        return kept_store.serve(port, secret)

    def _run_fresh(self, request_path: str, request: dict) -> int:
        """In the child: a spawned process's start, then the requested function, its JSON written."""
        self._leave_parent()
        os.close(self.ask_w)
        rank._set_death_signal()
        self._take_over(request["env"], request_path + ".log", request["cwd"], None)
        module, _, name = request["entry"].partition(":")
        out = getattr(importlib.import_module(module), name)(*request["args"])
        _write_atomic(request_path + ".out", json.dumps(out, default=repr))
        return 0


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def run_fresh(entry: str, args: list, *, env: dict, cwd: str, folder: str, timeout_s: float) -> dict | None:
    """Call ``entry`` (``"pkg.module:function"``, returning JSON-able data) with ``args`` in a
    fresh process: forked from the fork launcher's parent, which imported the preloaded modules
    and never ran the user's code; with ``env`` as its environment, ``cwd`` as its folder and
    ``sys.path`` as ``python -m`` there with env's PYTHONPATH would have it.

    Returns the function's result, ``{"timeout": timeout_s}`` (the process is killed), or
    ``{"crashed": exit status, "tail": its output's last lines}``; None when this process was not
    forked by that parent (a spawned or attached rank): the caller starts an interpreter itself.
    The request, output and log files are written under ``folder``. The supervisor asks through
    ``launch.fork.ForkLauncher.fresh``."""
    if _ASK_FD is None:
        return None
    request = write_request(entry, args, env=env, cwd=cwd, folder=folder)
    os.write(_ASK_FD, (request + "\n").encode())  # under PIPE_BUF: one write, never interleaved
    return await_fresh(request, timeout_s, time.sleep)


def write_request(entry: str, args: list, *, env: dict, cwd: str, folder: str) -> str:
    """The request file of a fresh process (see :func:`run_fresh`); returns its path."""
    request = os.path.join(folder, f"fresh-{os.getpid()}-{time.monotonic_ns()}.json")
    _write_atomic(request, json.dumps({"entry": entry, "args": args, "env": env, "cwd": cwd,
                                       "asker": os.getpid()}))
    return request


def await_fresh(request: str, timeout_s: float, wait) -> dict:
    """What the fresh process of ``request`` returned (see :func:`run_fresh`); ``wait(seconds)``
    is called between looks (the supervisor reads its parent's messages there)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(request + ".exit"):
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError, ValueError):
                with open(request + ".pid") as fh:
                    os.killpg(int(fh.read()), signal.SIGKILL)
            return {"timeout": timeout_s}
        wait(0.02)
    if os.path.exists(request + ".out"):
        with open(request + ".out") as fh:
            return json.load(fh)
    with open(request + ".exit") as fh:
        code = int(fh.read().split()[0])
    tail = ""
    with contextlib.suppress(OSError), open(request + ".log", errors="replace") as fh:
        tail = fh.read()[-1500:]
    return {"crashed": code, "tail": tail}


def _rank_zero_from_env() -> None:
    """Lightning reads the rank from the environment when it is imported (``rank_zero_only.rank``);
    imported in the parent, it read none: give it what a rank importing it would have read."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    if module is None or not hasattr(module.rank_zero_only, "rank"):
        return
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key) is not None:
            module.rank_zero_only.rank = int(os.environ[key])
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> int:
    shared = sys.argv[1] == "--listen"
    supervisor = int(os.environ[protocol.SUPERVISOR_PID_ENV])
    if not shared:
        rank._set_death_signal()  # the parent dies with the supervisor (SIGKILL of pytest included)
    # A shared parent outlives the worker that started it; it stops when the workers or the session's owner go.
    if os.getppid() != supervisor:
        return 3
    faulthandler.enable(all_threads=True)
    try:
        zygote = Zygote(listen_fd=int(sys.argv[2])) if shared else Zygote(int(sys.argv[1]), int(sys.argv[2]))
        return zygote.serve()
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # the supervisor is gone
            return 0
        raise


if __name__ == "__main__":
    from pytest_ltconform.world import zygote as _zygote

    sys.exit(_zygote.main())
