"""The fork launcher (the default): ranks forked from one parent of our own (``zygote.py``) that
imported torch and Lightning once.

Why a parent of our own and not ``multiprocessing``'s forkserver: the forkserver is one per
process with one preload list, while a session needs a parent per list (Lightning, plus DeepSpeed
for its tier, nothing for the world machinery's own tests) and per import-time environment
(DeepSpeed picks its accelerator when imported); its children do not die with it, nor lead their
own process groups, and it drops preload errors. Ours does those in 200 lines.

Under pytest-xdist the workers of one session share one parent per preload list and import-time
environment (``share``, a ``world.share.SessionShare``): the first worker that needs it starts it
listening on a Unix socket of the session folder, the others connect to it, and each is served on
its own connection. One import then serves every worker's ranks: the parent holds nothing of a
worker's (it never runs the user's code, and every rank takes its environment, folder and
``sys.path`` from the worker that asked for it), so sharing it changes nothing a rank sees.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time

from .. import kept_store, protocol, zygote
from ..share import SESSION_OWNER_ENV
from .base import Launcher, LaunchError

# Rank variables the parent must not import with: it serves every rank (Lightning's rank-zero
# logging reads RANK when imported; the child sets it again, see zygote._rank_zero_from_env).
PER_RANK_ENV = ("RANK", "LOCAL_RANK", "ROLE_RANK", protocol.GENERATION_ENV)


class ForkedRank:
    """A rank the fork parent made: not this process's child, so its exit status comes from the
    parent (``ForkLauncher.pump``)."""

    def __init__(self, launcher: ForkLauncher, pid: int):
        self.launcher, self.pid = launcher, pid
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:  # kept once known: a later rank may get the same pid
            self._code = self.launcher.exits.get(self.pid)
        return self._code

    def poll(self) -> int | None:
        if self.returncode is None:
            self.launcher.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self.launcher.pump(0.1 if left is None else min(left, 0.1))
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


class ForkLauncher(Launcher):
    """Ranks forked from one parent (``zygote.py``) that imported ``preload`` once; started on the
    first rank, with that rank's environment less its per-rank variables, in that rank's world
    folder (its log there: it is read when the parent cannot start). A parent that died is started
    again on the next rank (one more import)."""

    kind = "fork"

    def __init__(self, preload: tuple[str, ...], start_timeout_s: float = 300.0, share=None, name: str = ""):
        self.preload = tuple(preload)
        # The session folder of a pytest-xdist session (world.share.SessionShare), whose workers
        # share the parent called ``name`` there; None: a parent of this process's own.
        self.share, self.name = share, name
        self._sock: socket.socket | None = None
        self.log_path = ""
        self.start_timeout_s = start_timeout_s
        self.imports = 0
        self.exits: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        self._to = self._from = -1
        self._buffer = bytearray()
        self._next_token = 0
        self._forked: dict[int, int] = {}
        self._refused: dict[int, str] = {}
        self._kept: dict[int, int] = {}  # token of a store request -> the keeper's pid
        self._imported: dict[int, tuple] = {}  # token of an import request -> (failures, refusal)
        self._complete = False  # the parent imported the whole preload (it does so for its first rank)
        self._live: set[int] = set()  # ranks forked whose exit was not reported yet
        self._ready: tuple | None = None
        self._refusal: str | None = None  # why a parent refused to fork: said again, not retried

    @property
    def pid(self) -> int | None:
        if self.share is not None:  # as the parent said when this process connected
            return self._ready[1] if self._from >= 0 and self._ready is not None else None
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, env: dict, log_path: str, cwd: str) -> ForkedRank:
        self._ensure_parent(env, cwd)
        token = self._next_token = self._next_token + 1
        try:
            zygote.send(self._to, ("fork", token, env, log_path, cwd))
        except OSError:
            pass  # the parent died: pump() below says so
        # The first rank waits for the parent's second step of imports too.
        pid = self._answer(token, self._forked, 60.0 + (0.0 if self._complete else self.start_timeout_s),
                           lambda: f"the fork launcher's parent stopped answering ({self._exit_text()}).\n"
                                   f"{self.log_tail()}")
        self._complete = True
        return ForkedRank(self, pid)

    def fresh(self, entry: str, args: list, *, env: dict, cwd: str, folder: str, timeout_s: float,
              parent_env: dict) -> dict:
        """Call ``entry`` with ``args`` in a fresh process forked from the parent (started with
        ``parent_env`` in ``folder`` if it is not running): what :func:`zygote.run_fresh` returns
        to a rank. Raises :class:`LaunchError` when the parent cannot start."""
        self._ensure_parent(parent_env, folder)
        request = zygote.write_request(entry, args, env=env, cwd=cwd, folder=folder)
        try:
            zygote.send(self._to, ("fresh", request))
        except OSError:
            pass  # the parent died: no answer comes, and the request times out
        return zygote.await_fresh(request, timeout_s, self.pump)

    def store(self, env: dict, folder: str) -> kept_store.KeptStore:
        """A ``TCPStore`` served by a keeper forked from the parent (started with ``env``, a
        rank's environment, in ``folder`` if it is not running), so this process need not import
        torch. Raises :class:`LaunchError` when the parent cannot start or no keeper connects."""
        self._ensure_parent(env, folder)
        server, secret = kept_store.listen()
        token = self._next_token = self._next_token + 1
        try:
            zygote.send(self._to, ("store", token, server.getsockname()[1], secret))
            return kept_store.accept(server, secret, lambda: self._kept.get(token), self._pump_or_raise, 60.0)
        except (OSError, kept_store.StoreLost) as exc:
            raise LaunchError(f"the fork launcher's parent gave no store ({exc}).\n{self.log_tail()}") from None
        finally:
            server.close()

    def import_now(self, names: list[str], parent_env: dict, folder: str) -> dict[str, str | None]:
        """Have the parent (started with ``parent_env`` in ``folder`` if it is not running)
        import ``names`` now rather than before its first rank: ``{name: why its import failed,
        or None}``. Raises :class:`LaunchError` when the parent cannot start, stops answering,
        or refuses to fork after the imports."""
        self._ensure_parent(parent_env, folder)
        token = self._next_token = self._next_token + 1
        try:
            zygote.send(self._to, ("import", token, list(names)))
        except OSError:
            pass  # the parent died: _pump_or_raise says so
        failed, refusal = self._answer(token, self._imported, self.start_timeout_s,
                                       lambda: f"the fork launcher's parent did not import {', '.join(names)} in time")
        if refusal:
            self._refuse(refusal)
        return failed

    def _answer(self, token: int, answers: dict, timeout_s: float, late):
        """The parent's answer to request ``token``, taken from ``answers`` (which :meth:`pump`
        fills). Raises :class:`LaunchError`: ``late()`` after ``timeout_s`` seconds, the refusal
        when the parent refused the request, and when the parent is gone."""
        deadline = time.monotonic() + timeout_s
        while token not in answers:
            if token in self._refused:
                self._refuse(self._refused.pop(token))
            if time.monotonic() > deadline:
                raise LaunchError(late())
            self._pump_or_raise(0.1)
        return answers.pop(token)

    def _refuse(self, refusal: str):
        """The parent refused to fork: said again by every later request, never retried."""
        self._refusal = refusal
        self.close()
        raise LaunchError(refusal)

    def _pump_or_raise(self, timeout: float) -> None:
        if self._from < 0:
            if self._refusal:  # a shared parent refused (another worker's request) and stopped
                raise LaunchError(self._refusal)
            raise LaunchError(f"the fork launcher's parent stopped answering ({self._exit_text()}).\n"
                              f"{self.log_tail()}")
        self.pump(timeout)

    def _ensure_parent(self, env: dict, folder: str) -> None:
        running = self.share is not None or (self._proc is not None and self._proc.poll() is None)
        if running and self._from >= 0:
            return
        if self._refusal:  # its imports decide it: a new parent would refuse again, after importing again
            raise LaunchError(self._refusal)
        self.close()
        # Rank variables are left out: the parent serves every rank; a shared one also stops with the session.
        parent_env = {k: v for k, v in env.items() if k not in PER_RANK_ENV}
        parent_env.update({protocol.PRELOAD_ENV: ",".join(self.preload), "PYTHONUNBUFFERED": "1"})
        for _attempt in range(2 if self.share is not None else 1):
            if self.share is not None:
                self._connect_shared(parent_env)
            else:
                self._start_own(parent_env, folder)
            if self._await_ready():
                break
            self.close()  # a shared parent that stopped as this worker connected (its last worker had gone)
        else:
            raise LaunchError(f"the session's fork launcher parent closed the connection before it was ready, "
                              f"twice.\n{self.log_tail()}")
        if self._ready[2]:
            self._refuse(self._ready[2])

    def _await_ready(self) -> bool:
        """Wait for the parent's "ready"; False when it closed the connection first. Raises
        :class:`LaunchError` when it did not finish its imports in time."""
        self._ready = None
        self._complete = False
        deadline = time.monotonic() + self.start_timeout_s
        while self._ready is None:
            if self._from < 0 and self.share is not None and self._proc is None:
                return False
            if self._from < 0 or time.monotonic() > deadline:
                why = "did not finish its imports in time" if self._from >= 0 else self._exit_text()
                if self._proc is not None and self._from >= 0:
                    self._proc.kill()  # stuck importing: no worker gets ranks from it
                self.close()
                preloading = ", ".join(self.preload) or "nothing"
                raise LaunchError(f"the fork launcher's parent {why} (preloading {preloading}).\n{self.log_tail()}")
            self.pump(0.1)
        return True

    def _start_own(self, parent_env: dict, folder: str) -> None:
        """Start a parent of this process's own, on a pair of pipes, logging to ``folder``."""
        self.log_path = os.path.join(folder, "launcher.log")
        request_r, self._to = os.pipe()
        self._from, reply_w = os.pipe()
        self._proc = self._popen([str(request_r), str(reply_w)], parent_env, (request_r, reply_w), folder)
        os.close(request_r)
        os.close(reply_w)

    def _connect_shared(self, parent_env: dict) -> None:
        """Connect to the session's shared parent, starting it when no worker has (or it died).
        Raises :class:`LaunchError` when it cannot be reached."""
        path = self.share.socket_path(self.name)
        self.log_path = os.path.join(self.share.path, f"parent-{self.name}.log")
        with self.share.starting(self.name):
            sock = _connect(path)
            if sock is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # the socket of a parent that died
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(path)
                listener.listen(64)  # workers connect before it has imported; it accepts them then
                parent_env[SESSION_OWNER_ENV] = str(self.share.owner_pid)
                self._proc = self._popen(["--listen", str(listener.fileno())], parent_env, (listener.fileno(),),
                                         self.share.path)
                listener.close()
                sock = _connect(path)
        if sock is None:
            raise LaunchError(f"could not connect to the session's fork launcher parent at {path}.\n{self.log_tail()}")
        self._sock = sock
        self._to = self._from = sock.fileno()

    def _popen(self, args: list[str], env: dict, fds: tuple, cwd: str) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pytest_ltconform.world.zygote", *args], env=env,
                                    pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=cwd, start_new_session=True)
        self.imports += 1
        return proc

    def pump(self, timeout: float) -> None:
        """Read what the parent said (waiting at most ``timeout`` seconds for the first word)."""
        if self._from < 0:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self._from], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self._from, 65536)
        except ConnectionResetError:
            data = b""
        if not data:  # the parent is gone; its ranks died with it (their death signal)
            if self._sock is not None:  # one socket both ways
                self._sock.close()
                self._sock, self._to = None, -1
            else:
                os.close(self._from)
            self._from = -1
            self._lost()
            return
        self._buffer += data
        for message in zygote.take(self._buffer):
            if message[0] == "exit":
                self.exits[message[1]] = message[2]
                self._live.discard(message[1])
            elif message[0] == "forked":
                self._forked[message[1]] = message[2]
                self.exits.pop(message[2], None)  # a reused pid
                self._live.add(message[2])
            elif message[0] == "ready":
                self._ready = message
            elif message[0] == "refused" and message[1] == 0:  # another worker's request was refused
                self._refusal = message[2]
            elif message[0] == "refused":
                self._refused[message[1]] = message[2]
            elif message[0] == "kept":
                self._kept[message[1]] = message[2]
            elif message[0] == "imported":
                self._imported[message[1]] = (message[2], message[3])

    def _lost(self) -> None:
        """The parent is gone: its ranks died with it (their death signal is SIGKILL)."""
        for pid in self._live:
            self.exits[pid] = -9
        self._live.clear()

    def _exit_text(self) -> str:
        code = self._proc.poll() if self._proc is not None else None
        if code is None and self.share is not None:
            return "it closed the connection"
        return "it is not running" if code is None else f"it exited with status {code}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the parent; closing its pipe makes it SIGKILL the ranks it forked first. A shared
        parent is left to the other workers (it kills the ranks forked for this one); the worker
        that started it waits for it to stop, so its processor time is counted as this session's."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        else:
            for fd in (self._to, self._from):
                if fd >= 0:
                    os.close(fd)
        self._to = self._from = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout=None if self.share is not None else 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._lost()
        self._proc = None


def _connect(path: str) -> socket.socket | None:
    """A connection to the Unix socket at ``path``; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock
