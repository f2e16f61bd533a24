"""A local world's ``torch.distributed.TCPStore``, served by a process the fork parent forked, so
that pytest's own process never imports torch for it.

The supervisor needs three store calls (``set``, ``get``, ``check``) and the store's port, which
the ranks are given as ``MASTER_PORT``. Under the fork launcher the ranks' parent has torch
imported already: a child of it (the *keeper*, forked for a world's first start) holds the
``TCPStore`` server and answers the supervisor's calls over a loopback connection, one call at a
time. Importing torch in pytest's process cost about 2 CPU seconds per session, a seventh of
a session's CPU on Lightning's BoringModel.

The supervisor listens on a loopback port of its own and asks the parent for a keeper
(``("store", token, port, secret)``); the keeper connects, says ``("store", secret, store_port)``
and then answers ``(op, *args)`` with ``("ok", value)`` or ``("error", text)``. The keeper exits
when the connection closes (the world closed, or pytest died) and dies with the parent. Under
the spawn launcher, and where pytest imported torch anyway, the world holds the store itself.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import time

from .protocol import send, take

# As the supervisor's own store had: a rank's call waits up to this long for the store.
STORE_TIMEOUT_S = 60.0


class StoreLost(RuntimeError):
    """The keeper stopped answering (it died with the fork parent, or was killed)."""


class KeptStore:
    """The supervisor's side: ``port``, ``set(key, value)``, ``get(key) -> bytes`` and
    ``check(keys) -> bool``, as ``torch.distributed.TCPStore`` has them. Raises
    :class:`StoreLost` when the keeper is gone."""

    def __init__(self, conn: socket.socket, port: int, pid: int):
        self._conn, self.port, self.pid = conn, port, pid
        self._buffer = bytearray()

    @property
    def alive(self) -> bool:
        if self._conn is None:
            return False
        try:
            return self._call("check", []) is True
        except StoreLost:
            return False

    def set(self, key: str, value) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def _call(self, op: str, *args):
        if self._conn is None:
            raise StoreLost("the store's keeper was closed")
        try:
            send(self._conn.fileno(), (op, *args))
            reply = self._read(STORE_TIMEOUT_S + 30.0)
        except OSError as exc:
            self.close()
            raise StoreLost(f"the store's keeper (pid {self.pid}) is gone: {exc}") from None
        if reply[0] == "error":
            raise RuntimeError(f"store {op}: {reply[1]}")
        return reply[1]

    def _read(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            messages = take(self._buffer)
            if messages:
                return messages[0]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._conn], [], [], left)[0]:
                raise OSError(f"no answer within {timeout_s:.0f} s")
            data = self._conn.recv(65536)
            if not data:
                raise OSError("connection closed")
            self._buffer += data

    def close(self) -> None:
        """Close the connection: the keeper exits, and its store with it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def listen() -> tuple[socket.socket, str]:
    """A loopback socket for one keeper to connect to, and the secret it must say first."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    return server, os.urandom(16).hex()


def accept(server: socket.socket, secret: str, pid_of, wait, timeout_s: float) -> KeptStore:
    """The keeper's connection on ``server`` once it said ``secret`` (another local process that
    connects is turned away); ``pid_of()`` the keeper's pid (None until the parent said it),
    ``wait(seconds)`` called between looks. Raises :class:`StoreLost` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not select.select([server], [], [], 0.0)[0]:
            wait(0.02)
            continue
        conn, _ = server.accept()
        store = KeptStore(conn, 0, pid_of() or -1)
        try:
            hello = store._read(10.0)
        except OSError:
            conn.close()
            continue
        if len(hello) == 3 and hello[0] == "store" and hello[1] == secret:
            store.port = int(hello[2])
            store.pid = pid_of() or store.pid
            return store
        conn.close()
    raise StoreLost(f"no store keeper connected within {timeout_s:.0f} s")


def serve(port: int, secret: str) -> int:
    """The keeper (in a child of the fork parent): hold a ``TCPStore`` server, tell the
    supervisor on loopback ``port`` its port, answer its calls until it closes the connection."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    conn = socket.create_connection(("127.0.0.1", port))
    fd, buffer = conn.fileno(), bytearray()
    send(fd, ("store", secret, store.port))
    calls = {"set": store.set, "get": store.get, "check": store.check}
    while True:
        data = conn.recv(65536)
        if not data:
            return 0
        buffer += data
        for op, *args in take(buffer):
            try:
                reply = ("ok", calls[op](*args))
            except Exception as exc:  # a timeout of get, a bad key: the supervisor raises it
                reply = ("error", f"{type(exc).__name__}: {exc}")
            send(fd, reply)
