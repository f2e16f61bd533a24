"""What the pytest-xdist workers of one session share on this machine: one folder, made by the
xdist controller and named to every worker (``workerinput``), in which

- a value is made once (:meth:`SessionShare.once`): the first worker to ask makes it under an
  exclusive ``flock`` and writes it (pickled); a worker asking meanwhile waits on the lock and
  reads it. The kernel releases a lock whose holder died, so a worker that crashed while making a
  value leaves it to the next one to ask, never a wait without end;
- world slots (:meth:`SessionShare.slot`) bound how many worlds run jobs at once on the machine's
  cores, whichever worker starts them;
- the fork launcher's shared parent listens (:meth:`SessionShare.socket_path`).

Plain files and ``fcntl`` only: no torch, nothing of the plugin's upper layers. Values are
pickled: they are read by the same plugin version in a process of the same session.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import tempfile
import time

# Environment of a shared fork parent: the pid of the process that owns the session folder (the
# xdist controller). The parent stops when it is gone, whoever started it.
SESSION_OWNER_ENV = "LTCONFORM_SESSION_OWNER"
# A Unix socket's path must fit in sun_path (108 bytes on Linux).
_SOCKET_PATH_MAX = 100


def key_name(*parts) -> str:
    """A file name for a value's key (any parts with a stable ``repr``: strings, RunKeys)."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:20]


def make_folder(prefix: str) -> str:
    """A new session folder (mode 0700: only this user's processes reach the shared fork parent's
    socket in it), under the temp dir, or under /tmp where the temp dir's path is too long for a
    socket in it."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, prefix + "x" * 8, "parent-" + "x" * 20 + ".sock")) > _SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


class SessionShare:
    """The session folder at ``path`` (see the module doc); ``owner_pid`` the process that made it."""

    def __init__(self, path: str, owner_pid: int):
        self.path = path
        self.owner_pid = owner_pid
        self._read: dict[str, object] = {}  # values this process made or read: each is read once

    # -- values made once --------------------------------------------------------------------------
    def once(self, name: str, make):
        """The value ``make()`` returned in whichever worker asked for ``name`` first (this one
        when none did): made under the lock, so a second asker waits for it instead of making it
        again. An exception ``make`` raises propagates and leaves the value unmade (the next
        asker makes it); a value meant for every worker, an error included, is returned."""
        if name in self._read:
            return self._read[name]
        with self._locked(name, fcntl.LOCK_EX):
            found, value = self._load(name)
            if not found:
                value = make()
                self._store(name, value)
        self._read[name] = value
        return value

    def peek(self, name: str) -> tuple[bool, object]:
        """(True, value) when some worker made ``name`` (waiting while one is making it now);
        (False, None) when none has begun to."""
        if name in self._read:
            return True, self._read[name]
        if not os.path.exists(self._file(name, ".lock")):
            return False, None
        with self._locked(name, fcntl.LOCK_SH):
            found, value = self._load(name)
        if found:
            self._read[name] = value
        return found, value

    def names(self, prefix: str) -> list[str]:
        """The names of the values made so far whose name starts with ``prefix``, oldest first."""
        try:
            entries = [e for e in os.scandir(self.path) if e.name.startswith(prefix) and e.name.endswith(".pkl")]
        except OSError:
            return []
        return [e.name[:-4] for e in sorted(entries, key=lambda e: e.stat().st_mtime_ns)]

    @contextlib.contextmanager
    def holding(self, name: str):
        """Hold ``name``'s lock (exclusive) meanwhile, without a value: what serialises one kind of
        work across the workers (the training runs of one target)."""
        with self._locked(name, fcntl.LOCK_EX):
            yield

    # -- world slots -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def slot(self, slots: int, poll_s: float = 0.05):
        """Hold one of ``slots`` world slots meanwhile (waiting for a free one): at most ``slots``
        worlds of the session run jobs at once, whichever worker runs them."""
        fds = [os.open(self._file(f"slot-{n}", ".lock"), os.O_CREAT | os.O_RDWR, 0o600) for n in range(slots)]
        held = None
        try:
            while held is None:
                for fd in fds:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    held = fd
                    break
                else:
                    time.sleep(poll_s)
            yield
        finally:
            for fd in fds:
                os.close(fd)  # closing the held one releases it

    # -- the shared fork parent --------------------------------------------------------------------
    def socket_path(self, name: str) -> str:
        return os.path.join(self.path, f"parent-{name}.sock")

    @contextlib.contextmanager
    def starting(self, name: str):
        """Held while one worker connects to the shared parent ``name`` or starts it."""
        with self._locked(f"parent-{name}", fcntl.LOCK_EX):
            yield

    # -- files -------------------------------------------------------------------------------------
    def _file(self, name: str, suffix: str) -> str:
        return os.path.join(self.path, name + suffix)

    @contextlib.contextmanager
    def _locked(self, name: str, how: int):
        fd = os.open(self._file(name, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, how)  # blocks while another worker holds it; released if that worker dies
            yield
        finally:
            os.close(fd)

    def _load(self, name: str) -> tuple[bool, object]:
        try:
            with open(self._file(name, ".pkl"), "rb") as fh:
                return True, pickle.load(fh)
        except FileNotFoundError:
            return False, None

    def _store(self, name: str, value) -> None:
        path = self._file(name, ".pkl")
        with open(path + ".tmp", "wb") as fh:
            pickle.dump(value, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)
