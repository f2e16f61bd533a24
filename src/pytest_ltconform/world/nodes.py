"""The nodes of a local world on this one host: what makes a rank's node-local storage its node's own.

A cluster node has storage no other node sees: ``/tmp``, ``/dev/shm``, ``$TMPDIR``, ``$SLURM_TMPDIR``.
A path that one node's rank writes there does not exist on another node, even though the path is
spelled the same. A local world of several nodes (``layout.Layout``) gives each node that, two ways:

- ``mountns`` (the default): the ranks of a node share a private mount namespace in which their
  node's own tmpfs is mounted at one path, the same on every node (``protocol.node_mount``), and a
  tmpfs of its own on ``/dev/shm``. A path handed from node 0 to node 1 (a broadcast checkpoint
  path) names nothing on node 1, as on a cluster. Local rank 0 of a node makes the namespace (a
  user namespace too where this process may not mount otherwise); its node's other ranks join it.
- ``tmpdir``: a folder per node on the shared disk (``protocol.node_dir``). A path computed on each
  node (``tempfile.gettempdir()``) differs per node; a path handed from one node to another still
  opens here, so only the record of who wrote what shows that fault (the contracts judge it so, in
  both modes). A rank falls back to it, saying why, where the kernel refuses namespaces.

Every job gets a fresh folder in its node's storage (:func:`job_storage`) as ``TMPDIR`` and
``SLURM_TMPDIR``: nothing a run left there is found by the next. Linux only; pure Python (ctypes).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time

from . import protocol

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
JOIN_TIMEOUT_S = 60.0


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None), f"mount {fstype or 'private'} on {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _new_namespace(libc) -> bool:
    """Enter a new mount namespace (a user namespace with it where a plain one is refused); True
    when a user namespace was needed. Raises OSError when both are refused."""
    if libc.unshare(_CLONE_NEWNS) == 0:
        return False
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return True


def _make_node(mount: str) -> None:
    """In local rank 0 of a node: a mount namespace whose tmpfs at ``mount`` and on /dev/shm are
    this node's alone. Raises OSError when the kernel refuses it."""
    libc = _libc()
    _new_namespace(libc)
    _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing mounted here leaks back
    _mount(libc, "ltconform-node", mount, "tmpfs", 0, "mode=1777")
    if os.path.isdir("/dev/shm"):
        _mount(libc, "ltconform-node-shm", "/dev/shm", "tmpfs", 0, "mode=1777")


def _join_node(holder: int) -> None:
    """In another rank of the node: join the namespaces of its local rank 0 (``holder``, a pid)."""
    libc = _libc()
    cwd = os.getcwd()
    own_user = os.readlink("/proc/self/ns/user")
    if os.readlink(f"/proc/{holder}/ns/user") != own_user:
        fd = os.open(f"/proc/{holder}/ns/user", os.O_RDONLY)
        try:
            _check(libc.setns(fd, _CLONE_NEWUSER), "setns(user)")
        finally:
            os.close(fd)
    fd = os.open(f"/proc/{holder}/ns/mnt", os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNS), "setns(mnt)")
    finally:
        os.close(fd)
    os.chdir(cwd)  # joining a mount namespace leaves the process at its root


def _publish(path: str, text: str) -> None:
    partial = f"{path}.{os.getpid()}"
    _write(partial, text)
    os.replace(partial, path)


def _await(path: str) -> str:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise OSError(f"local rank 0 of this node did not make its namespace within {JOIN_TIMEOUT_S:g} s")
        time.sleep(0.01)
    with open(path) as fh:
        return fh.read()


def _isolate(local_rank: int, mount: str, ns_file: str) -> str | None:
    """Make or join this node's namespace: None when in it, else why not (the rank then keeps its
    node's folder on the shared disk)."""
    if local_rank == 0:
        try:
            _make_node(mount)
        except OSError as exc:
            _publish(ns_file, f"refused {exc}")
            return str(exc)
        _publish(ns_file, f"pid {os.getpid()}")
        return None
    try:
        said = _await(ns_file)
        if not said.startswith("pid "):
            return said.removeprefix("refused ")
        _join_node(int(said.split()[1]))
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def enter_node() -> None:
    """At a rank's start, before it starts a thread (a namespace is made and joined by a process of
    one thread): in a world of several nodes, put this rank on its node's storage and say which in
    the environment (``protocol.NODE_ROOT_ENV``, ``protocol.NODE_STORAGE_ENV``: 'mountns', or
    'tmpdir' with why when it was asked for namespaces). Nothing in a world of one node."""
    mount = os.environ.get(protocol.NODE_MOUNT_ENV)
    if not mount:
        return
    storage, root = "tmpdir", os.environ[protocol.NODE_DIR_ENV]
    if os.environ.get(protocol.NODE_ISOLATION_ENV, "mountns") == "mountns":
        why = _isolate(int(os.environ.get("LOCAL_RANK", "0")), mount, os.environ[protocol.NODE_NS_ENV])
        if why is None:
            storage, root = "mountns", mount
        else:
            storage = f"tmpdir (a private mount namespace was refused: {why})"
    os.environ[protocol.NODE_ROOT_ENV] = root
    os.environ[protocol.NODE_STORAGE_ENV] = storage
    for name in protocol.NODE_TMP_VARS:
        os.environ[name] = root
    tempfile.tempdir = None


def job_storage(job_dir: str) -> str | None:
    """Give the job in ``job_dir`` a fresh folder in this node's storage as ``TMPDIR`` and
    ``SLURM_TMPDIR`` (the caller restores the environment after the job); returns the folder, or
    None outside a world of several nodes."""
    root = os.environ.get(protocol.NODE_ROOT_ENV)
    if not root:
        return None
    folder = os.path.join(root, os.path.basename(os.path.normpath(job_dir)))
    os.makedirs(folder, exist_ok=True)
    for name in protocol.NODE_TMP_VARS:
        os.environ[name] = folder
    tempfile.tempdir = None
    return folder
