"""node-local-files, rank side: every access a rank makes to node-local storage, with the user's line.

A process-wide ``sys.addaudithook`` dispatcher (installed once per rank process, routed to the
current job's probe) sees ``open`` (read or write by its mode and flags), ``os.mkdir``,
``os.rename`` (``os.replace`` too), ``shutil.copyfile``, ``os.remove``, ``os.listdir``,
``os.scandir`` and ``glob.glob``; ``torch.save(obj, path)`` writes through C++ and raises no event,
so its zip writer is wrapped. A path counts when :func:`..node_storage.locate` places it on a node's
own storage and either user code is on the stack or a checkpoint is being saved or loaded (a
library's checkpoint writes are what a node-local checkpoint folder is made of). Each distinct
(operation, path, line) is one ``node_file`` trace event; the rank's storage layout is one
``node_storage`` event, where ModelCheckpoint folders ended up one ``node_ckpt_dir`` event each,
and a ``default_root_dir`` the user's Trainer kwargs put on node-local storage a ``node_root_dir``.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

from ...events import Recorded, declare
from ...runs import Probe
from ...sites import is_installed, is_user_file, user_site
from ...world.rank import current_context
from .. import node_storage


class FileEvent(Recorded):
    """One access ``op`` (read, write, mkdir, rename, list, remove) of a node-local ``path`` (as
    shown, the same on every node) on node ``storage``'s storage; ``raw`` the path as spelled,
    ``site`` the user's line, ``ckpt`` the checkpoint save or load it was part of, ``hook``."""

    op: str
    path: str
    storage: int
    raw: str
    site: dict | None
    ckpt: str | None
    hook: str | None


class CheckpointDirEvent(Recorded):
    """Where a checkpoint ``callback``'s folder ended up (``raw``; ``path``, ``storage`` when it is
    node-local, else None), whether the user ``given`` it, and where it was built (``site``)."""

    callback: str
    raw: str
    path: str | None
    storage: int | None
    given: bool
    site: dict | None


class RootDirEvent(Recorded):
    """The user's ``default_root_dir`` (``raw``) on node ``storage``'s storage, shown as ``path``."""

    path: str
    storage: int
    raw: str


class PrepareEvent(Recorded):
    """``per_node``: ``{class name: prepare_data_per_node}`` of the module and the datamodule."""

    per_node: dict


FILE_EVENT = declare("node_file", FileEvent)
CKPT_DIR_EVENT = declare("node_ckpt_dir", CheckpointDirEvent)
ROOT_DIR_EVENT = declare("node_root_dir", RootDirEvent)
PREPARE_EVENT = declare("node_prepare", PrepareEvent)
# Distinct accesses a rank records; more are counted in the run's last event.
MAX_EVENTS = 400

_SAVING = ("save_checkpoint", "_save_checkpoint", "_save_topk_checkpoint", "_save_last_checkpoint")
_LOADING = ("load_checkpoint", "_load_from_checkpoint", "resume_start", "_restore_modules_and_callbacks",
            "_run_sanity_check")
# Libraries' own caches, built on each node as needed: a second node rebuilds them, it never reads ours.
_CACHE_PARTS = ("torchinductor_", "__pycache__", ".triton", "triton_cache", "torch_extensions", "pymp-",
                "ltconform-logs")
_EVENTS = frozenset(("open", "os.mkdir", "os.rename", "shutil.copyfile", "os.remove", "os.listdir", "os.scandir",
                     "glob.glob"))
_ACTIVE: NodeLocalFilesProbe | None = None
_INSTALLED = False
_LOCAL = threading.local()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _on_audit(event: str, args) -> None:
    if event not in _EVENTS:
        return
    probe = _ACTIVE
    if probe is None or getattr(_LOCAL, "busy", False):
        return
    _LOCAL.busy = True
    try:
        for op, path in _accesses(event, args):
            probe.access(op, path)
    except Exception:
        pass  # recording must never break the user's file access
    finally:
        _LOCAL.busy = False


def _accesses(event: str, args) -> list[tuple[str, object]]:
    """(operation, path) pairs of one audit event."""
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else \
            isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        return [("write" if writes else "read", path)]
    if event == "os.mkdir":
        return [("mkdir", args[0])]
    if event == "os.rename":
        return [("read", args[0]), ("write", args[1])]
    if event == "shutil.copyfile":
        return [("read", args[0]), ("write", args[1])]
    if event == "os.remove":
        return [("remove", args[0])]
    if event == "glob.glob":
        fixed = str(args[0]).split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
        return [("list", fixed if fixed.endswith(os.sep) or not fixed else os.path.dirname(fixed))]
    return [("list", args[0] if args and args[0] is not None else ".")]  # os.listdir(), os.scandir()


def install_dispatcher() -> None:
    """Add the audit hook once per process; it does nothing while no probe is active."""
    global _INSTALLED
    if not _INSTALLED:
        sys.addaudithook(_on_audit)
        _INSTALLED = True


def _frames(start) -> tuple[dict | None, str | None]:
    """The first user frame above ``start`` and whether a checkpoint is being saved or loaded."""
    site, ckpt, frame = None, None, start
    while frame is not None:
        code = frame.f_code
        if ckpt is None and code.co_name in _SAVING:
            ckpt = "save"
        elif ckpt is None and code.co_name in _LOADING:
            ckpt = "load"
        if site is None and is_user_file(code.co_filename):
            site = {"file": code.co_filename, "line": frame.f_lineno,
                    "func": getattr(code, "co_qualname", code.co_name)}
        frame = frame.f_back
    return site, ckpt


def _prepare_flags(objects) -> dict:
    """Which ranks Lightning runs each ``prepare_data`` on: ``{class name: prepare_data_per_node}``
    of the module and the datamodule (True: local rank 0 of every node; False: global rank 0)."""
    flags = {}
    for obj in (objects.datamodule, objects.model):
        if obj is not None:
            flags[type(obj).__name__] = bool(getattr(obj, "prepare_data_per_node", True))
    return {"per_node": flags}


class NodeLocalFilesProbe(Probe):
    """Routes this rank's node-local file accesses into ``node_file`` trace events."""

    def __init__(self):
        self.recorder = None
        self.pid = os.getpid()
        self.storage: dict | None = None
        self.quick: tuple[str, ...] = ()
        self.seen: set = set()
        self.dropped = 0
        self.built_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def install(self, recorder) -> None:
        global _ACTIVE
        ctx = current_context()
        if ctx is None:
            return
        self.recorder = recorder
        self.storage = node_storage.rank_storage(ctx)
        self.quick = tuple(p for p, _, _ in self.storage["local"]) + tuple(self.storage["system"])
        recorder.emit({"ev": node_storage.EVENT, **self.storage})
        self._tap_saves(recorder)
        self._tap_checkpoint_dirs(recorder)
        install_dispatcher()
        _ACTIVE = self

    def _tap_saves(self, recorder) -> None:
        import torch.serialization

        probe = self

        def factory(original):
            def _open_zipfile_writer(name_or_buffer, *args, **kwargs):
                if isinstance(name_or_buffer, (str, bytes, os.PathLike)) and _ACTIVE is probe:
                    probe.access("write", name_or_buffer)
                return original(name_or_buffer, *args, **kwargs)

            return _open_zipfile_writer

        recorder.patch(torch.serialization, "_open_zipfile_writer", factory)

    def _tap_checkpoint_dirs(self, recorder) -> None:
        """Where user code built each ModelCheckpoint (its dirpath is set in ``__init_ckpt_dir``)."""
        import importlib

        built_at = self.built_at

        def factory(original):
            def init_dir(callback, *args, **kwargs):
                try:
                    site, _ = user_site()
                    if site is not None:
                        built_at.setdefault(callback, (site, args[0] if args else kwargs.get("dirpath")))
                except Exception:
                    pass
                return original(callback, *args, **kwargs)

            return init_dir

        for ns in ("lightning.pytorch", "pytorch_lightning"):
            if ns in sys.modules or ns == "lightning.pytorch":
                try:
                    cls = importlib.import_module(f"{ns}.callbacks").ModelCheckpoint
                except ImportError:
                    continue
                recorder.patch(cls, "_ModelCheckpoint__init_ckpt_dir", factory)

    def access(self, op: str, path) -> None:
        """Record ``op`` ('read', 'write', 'mkdir', 'list', 'remove') of ``path`` when it is on
        node-local storage and user code (or a checkpoint's save or load) made it."""
        recorder, storage = self.recorder, self.storage
        if recorder is None or recorder.closed or os.getpid() != self.pid or storage is None:
            return
        raw = os.path.abspath(os.fsdecode(path))
        if not raw.startswith(self.quick) or any(part in raw for part in _CACHE_PARTS):
            return
        located = node_storage.locate(raw, storage)
        if located is None or node_storage.stdlib_own(sys._getframe(2)):
            return
        site, ckpt = _frames(sys._getframe(2))
        if ckpt is not None and site is not None and is_installed(site["file"]):
            site = None  # a library's own checkpoint I/O (fsspec): the user's line is where the folder was set
        if site is None and ckpt is None:
            return
        key = (op, raw, (site or {}).get("file"), (site or {}).get("line"))
        if key in self.seen:
            return
        if len(self.seen) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.seen.add(key)
        recorder.emit({"ev": FILE_EVENT, "op": op, "path": located[1], "storage": located[0], "raw": raw,
                       "site": site, "ckpt": ckpt, "hook": recorder.current_hook()})

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        if self.storage is None:
            return
        self._user_root_dir(objects, recorder)
        recorder.emit({"ev": PREPARE_EVENT, **_prepare_flags(objects)})
        probe = self

        class _CheckpointDirs(objects.ns.Callback):
            def on_fit_start(self, trainer, pl_module):
                probe._checkpoint_dirs(trainer)

        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + [_CheckpointDirs()]

    def _user_root_dir(self, objects, recorder) -> None:
        """A ``default_root_dir`` of the user's Trainer kwargs on node-local storage (the run itself
        uses a folder of its own, shared by its ranks)."""
        root = objects.user_kwargs.get("default_root_dir")
        located = node_storage.locate(os.fspath(root), self.storage) if isinstance(root, (str, os.PathLike)) else None
        if located is not None:
            recorder.emit({"ev": ROOT_DIR_EVENT, "path": located[1], "storage": located[0], "raw": os.fspath(root)})

    def _checkpoint_dirs(self, trainer) -> None:
        """Where each checkpoint callback's folder is, once Lightning resolved it (in setup)."""
        for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
            dirpath = getattr(cb, "dirpath", None)
            if not isinstance(dirpath, (str, os.PathLike)):
                continue
            located = node_storage.locate(os.fspath(dirpath), self.storage)
            site, given = self.built_at.get(cb, (None, None))
            self.recorder.emit({"ev": CKPT_DIR_EVENT, "callback": type(cb).__name__, "raw": os.fspath(dirpath),
                                "path": located[1] if located else None, "storage": located[0] if located else None,
                                "given": given is not None, "site": site})

    def collect(self, objects, trainer, recorder):
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        return {"dropped": self.dropped}
