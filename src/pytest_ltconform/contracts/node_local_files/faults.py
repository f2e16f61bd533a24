"""node-local-files, judge side: what every rank recorded, placed on the nodes' storage, and the
faults a cluster would show (a read of what only another node wrote, a checkpoint on node-local
storage). Pure functions over the run's trace events (see ``probe.py``)."""

from __future__ import annotations

import dataclasses
import os
import re

from ...events import CALL
from ...sites import fmt_site, hook_label
from .. import node_storage
from ..base import rank_decorator
from .probe import CKPT_DIR_EVENT, FILE_EVENT, MAX_EVENTS, PREPARE_EVENT, ROOT_DIR_EVENT

__all__ = ["MAX_EVENTS", "Access", "Record", "cross_node_reads", "grouped", "local_checkpoints", "prepare_words"]

_CREATES = ("write", "mkdir")
_READS = ("read", "list")
_OS_ERRORS = ("FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError", "OSError")


@dataclasses.dataclass
class Access:
    """One recorded access: ``op`` by global rank ``rank`` on node ``node`` of ``path`` (as shown)
    on node ``storage``'s own storage, at the user's ``site`` (or None: a checkpoint's save or
    load, ``ckpt``), inside ``hook``. ``writers`` is filled for reads by :func:`cross_node_reads`."""

    op: str
    rank: int
    node: int
    storage: int
    path: str
    raw: str
    site: dict | None
    ckpt: str | None
    hook: str | None
    config: dict | None = None  # where the checkpoint folder it lies in was configured, if known
    writers: list = dataclasses.field(default_factory=list)

    @property
    def reader(self) -> int:
        return self.rank

    @property
    def reader_node(self) -> int:
        return self.node

    def op_words(self) -> str:
        if self.ckpt == "save":
            return "saved checkpoint file"
        return {"write": "wrote", "mkdir": "created the folder", "read": "opened", "list": "listed",
                "remove": "removed"}.get(self.op, self.op)

    def is_checkpoint(self) -> bool:
        return self.ckpt is not None or any(w.ckpt for w in self.writers)

    def config_site(self) -> str | None:
        return fmt_site(self.config) if self.config else None

    def folder(self, record: Record) -> dict | None:
        """The checkpoint callback folder this checkpoint write lies in (its ``node_ckpt_dir`` event)."""
        return next((d for d in record.ckpt_dirs if d.get("path") and
                     (self.path == d["path"] or self.path.startswith(d["path"].rstrip("/") + "/"))), None)


@dataclasses.dataclass
class Record:
    """Every rank's node-local accesses and storage as the probe recorded them."""

    storage: dict | None
    nodes: dict  # rank -> node
    accesses: list
    ckpt_dirs: list
    root_dirs: list
    prepare: dict | None
    saves: list  # (rank, path, site) of each Trainer.save_checkpoint call
    dropped: int = 0
    storages: dict = dataclasses.field(default_factory=dict)  # rank -> its storage description

    @classmethod
    def of(cls, run) -> Record:
        storages, nodes, accesses, dirs, roots, prepare, saves = {}, {}, [], [], [], None, []
        for r in range(run.world_size):
            events = run.events(r)
            described = next((e for e in events if node_storage.EVENT.of(e)), None)
            if described is None:
                continue
            storages[r], nodes[r] = described, int(described.get("node", 0))
            for e in events:
                kind = e.get("ev")
                if kind == FILE_EVENT:
                    accesses.append(Access(e["op"], r, nodes[r], int(e["storage"]), e["path"], e.get("raw", ""),
                                           e.get("site"), e.get("ckpt"), e.get("hook")))
                elif kind == CKPT_DIR_EVENT and r == 0:
                    dirs.append(e)
                elif kind == ROOT_DIR_EVENT and r == 0:
                    roots.append(e)
                elif kind == PREPARE_EVENT and prepare is None:
                    prepare = e
                elif CALL.of(e) and e.get("kind") == "save" and e.get("path"):
                    saves.append((r, e["path"], e.get("site")))
        dropped = sum((v or {}).get("dropped", 0) for v in run.probe("node-local-files") if isinstance(v, dict))
        record = cls(storages.get(0) or next(iter(storages.values()), None), nodes, accesses, dirs, roots, prepare,
                     saves, dropped, storages)
        record._link_configs()
        return record

    def _link_configs(self) -> None:
        """Give each checkpoint access the site where its folder's callback was built."""
        for a in self.accesses:
            for d in self.ckpt_dirs:
                if d.get("path") and d.get("site") and (a.path == d["path"] or a.path.startswith(d["path"] + "/")):
                    a.config = d["site"]

    def storage_note(self) -> str:
        """How node storage was kept apart on this run, from what the ranks recorded: the nodes and
        their ranks, the storage kind, and the folders rank 0 recorded as node-local and as shared."""
        storage = self.storage or {}
        how = str(storage.get("storage") or "")
        nodes = len(self.nodes and set(self.nodes.values()))
        if how.startswith("mountns"):
            kept = "each node had a private tmpfs at the same path (a mount namespace per node), as on a cluster"
        elif how.startswith("tmpdir"):
            kept = f"each node had its own temp folder on the shared disk ({how.removeprefix('tmpdir').strip(' ()')})" \
                if "(" in how else "each node had its own temp folder on the shared disk"
        else:
            kept = f"the launcher's nodes (storage recorded as {how!r})" if how else "the launcher's nodes"
        by_node: dict = {}
        for rank, node in sorted(self.nodes.items()):
            by_node.setdefault(node, []).append(str(rank))
        ranks = "; ".join(f"node {n}: rank{'s' if len(rs) > 1 else ''} {', '.join(rs)}"
                          for n, rs in sorted(by_node.items()))
        own = [*(storage.get("system") or []), *(e[2] for e in storage.get("local") or [] if len(e) > 2)]
        own = list(dict.fromkeys(own))
        shared = list(dict.fromkeys(storage.get("shared") or []))
        return (f"node-local storage on this run of {nodes} nodes ({ranks}): {kept}; recorded as each node's own: "
                f"{', '.join(own) or 'none'}; as shared: {', '.join(shared) or 'none'}.")

    def passed_summary(self) -> str:
        used = sorted({(a.storage, a.path) for a in self.accesses})
        if not used:
            return ("no rank read, listed or wrote node-local storage (/tmp, /dev/shm, $TMPDIR, $SLURM_TMPDIR, "
                    "tempfile.gettempdir()), and no checkpoint went there.")
        paths = sorted({p for _, p in used})
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        nodes = sorted({n for n, _ in used})
        return (f"every node-local file was read only on the node whose ranks wrote it ({shown}, used on node"
                f"{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}), and no checkpoint went to node-local "
                f"storage.")


def _created_on(record: Record, storage: int, path: str, node: int | None = None) -> list[Access]:
    """The accesses that created ``path`` (or something under it) on node ``storage``'s storage,
    by ranks of ``node`` when given."""
    return [a for a in record.accesses if a.op in _CREATES and a.storage == storage
            and (node is None or a.node == node)
            and (a.path == path or a.path.startswith(path.rstrip("/") + "/"))]


def cross_node_reads(record: Record) -> list[Access]:
    """Reads and listings of node-local paths that no rank of the reader's node created, while
    ranks of another node did: the reader's node has no such file on a cluster. Each has its
    ``writers`` (the other node's creating accesses)."""
    out = []
    for a in record.accesses:
        if a.op not in _READS:
            continue
        if a.storage != a.node:
            # Another node's storage, reached through this host's shared disk: a cluster has no such path.
            writers = _created_on(record, a.storage, a.path)
        elif _created_on(record, a.node, a.path, a.node):
            continue
        else:
            writers = [w for n in sorted(set(record.nodes.values())) if n != a.node
                       for w in _created_on(record, n, a.path)]
        if writers:
            out.append(dataclasses.replace(a, writers=_files_first(writers, a.path)))
    return out


def _files_first(writers: list[Access], path: str) -> list[Access]:
    """The writers of ``path`` itself first, then of what lies under it, then its folders."""
    return sorted(writers, key=lambda w: (w.path != path, w.op == "mkdir", w.rank))


def grouped(reads: list[Access]) -> list[list[Access]]:
    """Reads of one path written by one node, together (one finding each), in order found."""
    groups: dict = {}
    for read in reads:
        groups.setdefault((read.path, read.writers[0].node), []).append(read)
    return list(groups.values())


def raised_on(read: Access, outcome) -> bool:
    """Whether the rank of ``outcome`` raised an OS error that names ``read``'s path (its node had
    no such file)."""
    message = outcome.message or ""
    return outcome.exc_type in _OS_ERRORS and (read.raw in message or os.path.basename(read.raw) in message)


def raised_text(read: Access, outcome) -> str:
    """``: FileNotFoundError`` when the reader then raised for that path, else ''."""
    if outcome.status in ("error", "died") and raised_on(read, outcome):
        return f": {outcome.exc_type}"
    return ""


def written_words(record: Record, writers: list[Access]) -> str:
    """What wrote the file, as the summary's first clause: ``ModelCheckpoint(dirpath=<gettempdir>/ckpts)
    saved epoch=1-step=8.ckpt from global rank 0 (node 0) onto node 0's local storage``, or
    ``global rank 0 (node 0) wrote <path> on node 0's local storage``."""
    first = writers[0]
    ranks = who(sorted({(w.rank, w.node) for w in writers if w.path == first.path} or {(first.rank, first.node)}))
    folder = first.folder(record) if first.ckpt == "save" else None
    if folder is not None:
        return (f"{folder.get('callback')}(dirpath={folder['path']}) saved {os.path.basename(first.path)} from {ranks} "
                f"onto node {first.node}'s local storage{in_hooks([first])}")
    if first.ckpt == "save":
        return f"{ranks} saved the checkpoint {first.path} onto node {first.node}'s local storage{in_hooks([first])}"
    return f"{prepare_words(record, writers)}{ranks} wrote {first.path} on node {first.node}'s local storage" \
           f"{in_hooks(writers)}"


def who(ranks: list[tuple[int, int]]) -> str:
    """``global rank 0 (node 0)`` / ``global ranks 0 (node 0) and 2 (node 1)``."""
    parts = [f"{r} (node {n})" for r, n in ranks]
    return ("global rank " if len(parts) == 1 else "global ranks ") + " and ".join(parts)


def reader_words(readers: list[tuple[int, int]], reads: list[Access]) -> str:
    verb = {"list": "listed"}.get(reads[0].op, "opened")
    return f"{who(readers)} {verb}"


def hook_name(hook: str | None) -> str:
    """A recorded hook as a user reads it: a callback's state key dropped
    (``ModelCheckpoint{'monitor': ...}.on_train_epoch_end`` -> ``ModelCheckpoint.on_train_epoch_end``)."""
    return re.sub(r"\{.*\}", "", hook_label(hook))


def in_hook(a: Access) -> str:
    return f" in {hook_name(a.hook)}" if a.hook else ""


def in_hooks(accesses: list[Access], reading: bool = False) -> str:
    hooks = list(dict.fromkeys(hook_name(a.hook) for a in accesses if a.hook))
    if not hooks:
        return ""
    return f" in {' and '.join(hooks[:3])}"


def prepare_words(record: Record, writers: list[Access]) -> str:
    """``prepare_data (prepare_data_per_node=False: global rank 0 only) ``, when ``prepare_data``
    wrote it: the flag that decided which ranks Lightning runs it on."""
    hook = next((w.hook for w in writers if w.hook and w.hook.endswith(".prepare_data")), None)
    if hook is None:
        return ""
    flags = (record.prepare or {}).get("per_node") or {}
    per_node = flags.get(hook.rsplit(".", 1)[0])
    if per_node is None:
        return "prepare_data: "
    ranks = "local rank 0 of every node" if per_node else "global rank 0 only"
    guard = prepare_guard(record, writers)
    if guard is not None:
        ranks += f", but {guard['text']} at {fmt_site(guard)} lets only global rank 0 run it"
    return f"prepare_data (prepare_data_per_node={per_node}: {ranks}): "


def per_node_prepare(record: Record, writers: list[Access]) -> list[Access]:
    """The writers inside a prepare_data the run recorded with ``prepare_data_per_node=True``."""
    flags = (record.prepare or {}).get("per_node") or {}
    return [w for w in writers if w.hook and w.hook.endswith(".prepare_data") and flags.get(w.hook.rsplit(".", 1)[0])]


def prepare_guard(record: Record, writers: list[Access]) -> dict | None:
    """The rank decorator (``@rank_zero_only``) on the prepare_data that wrote, where Lightning was set to
    run it on every node (``prepare_data_per_node=True`` recorded): what kept the other nodes from writing."""
    return next((g for g in (rank_decorator(w.site) for w in per_node_prepare(record, writers)) if g), None)




@dataclasses.dataclass
class LocalCheckpoint:
    """A checkpoint (a ModelCheckpoint folder, or a ``save_checkpoint`` path) on node-local storage."""

    path: str
    storage: int | None
    callback: str | None
    site: dict | None
    writes: list  # the checkpoint files' write accesses under it
    readers: list  # reads of them from another node

    def summary(self) -> str:
        what = f"{self.callback}(dirpath={self.path})" if self.callback else f"save_checkpoint({self.path})"
        nodes = sorted({w.node for w in self.writes})
        files = sorted({os.path.basename(w.path) for w in self.writes if w.op == "write"})
        named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        if not self.writes:
            saved = "puts its checkpoints on node-local storage (none was saved in this run)"
        elif len(nodes) == 1:
            ranks = sorted({w.rank for w in self.writes})
            saved = (f"saved {named} from {who([(r, nodes[0]) for r in ranks])} onto node {nodes[0]}'s local storage: "
                     f"no other node has it")
        else:
            saved = (f"wrote its files ({named}) from nodes {', '.join(map(str, nodes))} each onto its own local "
                     f"storage: no node holds the whole checkpoint")
        tail = (" A resume, trainer.test(ckpt_path='best'), a best-weights reload or a later job on another node "
                "finds nothing there.")
        return f"{what} {saved}.{tail}"

    def evidence(self) -> list[tuple[str, int | None, dict | None, str | None]]:
        out = []
        if self.site:
            out.append((f"{self.callback} built here with dirpath on node-local storage", None, self.site, None))
        for w in self.writes[:3]:
            out.append((f"saved {w.path} on node {w.node}'s local storage{in_hook(w)}", w.rank, w.site,
                        fmt_site(self.site) if self.site else None))
        return out


def local_checkpoints(record: Record) -> list[LocalCheckpoint]:
    """Checkpoint folders and paths on node-local storage, each with the files saved under it."""
    out, seen = [], set()
    for d in record.ckpt_dirs:
        if d.get("path") is None:
            continue
        seen.add(d["path"])
        writes = [a for a in record.accesses if a.ckpt == "save" and a.op == "write"
                  and a.path.startswith(d["path"].rstrip("/") + "/")]
        out.append(LocalCheckpoint(d["path"], d.get("storage"), d.get("callback"), d.get("site"), writes, []))
    storage = record.storage
    for rank, path, site in record.saves:
        located = node_storage.locate(path, record.storages.get(rank, storage), record.nodes.get(rank))
        if located is None or any(located[1].startswith(p.rstrip("/") + "/") for p in seen) or located[1] in seen:
            continue
        seen.add(located[1])
        writes = [a for a in record.accesses if a.ckpt == "save" and a.op == "write"
                  and (a.path == located[1] or a.path.startswith(located[1].rstrip("/") + "/"))]
        out.append(LocalCheckpoint(located[1], located[0], None, site, writes, []))
    return out
