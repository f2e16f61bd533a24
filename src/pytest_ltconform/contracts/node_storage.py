"""Which node's own storage a path is on, as a cluster would see it.

On a cluster, ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``$TMPDIR``, ``$SLURM_TMPDIR`` and
``tempfile.gettempdir()`` are each node's own: a file one node writes there does not exist on
another, even where the path is spelled the same. On this host they may be one folder, so the
storage of every path a rank touches is worked out from the layout its world gave it
(``world.nodes``): the node's own folder or tmpfs, the other nodes' folders (seen through the shared
disk only here), the system temp folders (the accessing node's own), and the folders every node
shares (the run's folder, the world's folder, the folder pytest runs in) which are not node-local
although they may lie under /tmp here.

Shared by the contracts that judge files across nodes (node-local-files, shared-writes). Rank side:
:func:`rank_storage` describes this rank's storage as plain data, which its probe emits once as a
``node_storage`` trace event; both sides then place a path with :func:`locate`. Imports nothing of
torch or Lightning.
"""

from __future__ import annotations

import os
import tempfile

from ..events import Recorded, declare

# Folders that are each node's own on a cluster, whoever spells them.
SYSTEM_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")
# How a path under the job's node-local folder is shown: the same on every node.
TEMP_LABEL = "<gettempdir>"


class StorageEvent(Recorded):
    """This rank's node storage (see :func:`rank_storage`): ``node``, ``nodes``, ``storage`` (how
    it is kept apart), ``local`` ([path, node or -1, label] each), ``shared`` (paths)."""

    node: int
    nodes: int
    storage: str | None
    local: list
    shared: list


# What a rank emits once per run.
EVENT = declare("node_storage", StorageEvent)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _unique(paths) -> list[str]:
    return list(dict.fromkeys(p for p in paths if p))


def rank_storage(ctx, extra_shared=()) -> dict:
    """This rank's node storage as plain data: ``node`` (its node), ``nodes`` (how many),
    ``storage`` (how node storage is kept apart, ``world.nodes``; None on one node or attached),
    ``local``: ``[prefix, owner, label]`` for each node-local root, most specific first (``owner``
    the node it belongs to, -1: the accessing rank's own), ``shared``: prefixes every node sees
    (``extra_shared``: more of them, e.g. the Trainer's root). ``ctx`` is the job's rank context."""
    from ..sites import USER_CWD_ENV
    from ..world import protocol

    local: list[list] = []
    job_name = os.path.basename(os.path.normpath(ctx.run_dir or ctx.job_dir))
    if ctx.node_local:
        # A folder per node on this host's disk is its node's; a tmpfs per node, or a launcher's node,
        # holds what the accessing rank's node wrote.
        own = ctx.node_rank if str(ctx.node_storage).startswith("tmpdir") else -1
        local.append([_real(ctx.node_local), own, TEMP_LABEL])
        world = os.environ.get(protocol.WORLD_DIR_ENV)
        for node in range(ctx.num_nodes) if world else ():
            if node != ctx.node_rank or not str(ctx.node_storage).startswith("mountns"):
                local.append([_real(os.path.join(protocol.node_dir(world, node), job_name)), node, TEMP_LABEL])
                local.append([_real(protocol.node_dir(world, node)), node, f"<node {node}'s temp folder>"])
        if world:
            local.append([_real(protocol.node_mount(world)), -1, "<node-local tmpfs>"])
    for name in ("SLURM_TMPDIR", "TMPDIR"):  # a real launch's scratch (attached worlds): each node's own
        value = os.environ.get(name)
        if value and not any(_real(value) == entry[0] for entry in local):
            local.append([_real(value), -1, f"${name}"])
    shared = _unique(_real(p) for p in (ctx.run_dir, ctx.job_dir, os.environ.get(protocol.WORLD_DIR_ENV),
                                        os.environ.get(USER_CWD_ENV), *extra_shared) if p)
    # The world's own folders under it are node-local: they are listed first, so they win.
    system = _unique([*SYSTEM_LOCAL, _real(tempfile.gettempdir())] if not ctx.node_local else SYSTEM_LOCAL)
    return {"node": ctx.node_rank, "nodes": ctx.num_nodes, "storage": ctx.node_storage, "local": local,
            "shared": shared, "system": [_real(p) for p in system]}


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip(os.sep) + os.sep)


def locate(path: str, storage: dict, node: int | None = None) -> tuple[int, str] | None:
    """``(node whose storage holds it, the path as shown)`` for ``path`` accessed by a rank on
    ``node`` (default: the rank that described ``storage``, see :func:`rank_storage`); None when
    it is not node-local (a folder every node shares, or anywhere else)."""
    node = storage["node"] if node is None else node
    real = _real(path)
    for prefix, owner, label in storage["local"]:
        if _under(real, prefix):
            return (node if owner == -1 else owner), label + real[len(prefix):]
    if any(_under(real, prefix) for prefix in storage["shared"]):
        return None
    for prefix in storage["system"]:
        if _under(real, prefix):
            return node, real
    return None


def on(storage_node: int, shown: str) -> str:
    """``shown`` with the node whose storage holds it: ``<gettempdir>/x on node 0's local storage``."""
    return f"{shown} on node {storage_node}'s local storage"


def stdlib_own(frame) -> bool:
    """Whether ``frame``, the one opening or removing a file, is the standard library on its own: the first
    ``tempfile.gettempdir()`` of a process writes (and removes) a file of a random name to test that the
    folder is writable (field trial tnodes F5-F7: those names were listed as the user's files)."""
    return frame.f_code.co_name == "_get_default_tempdir" and frame.f_globals.get("__name__") == "tempfile"
