"""shared-writes, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

import os
import sys
import threading

from ...events import Recorded, declare
from ...world.rank import current_context
from .. import node_storage
from ..base import Probe


class WriteEvent(Recorded):
    """A file opened for writing (``path`` as shown, ``mode``) from user code at ``site`` in ``hook``,
    on node ``node``; ``storage``: the node whose local storage holds it (node_storage.locate), absent
    for a shared path."""

    path: str
    mode: str
    site: dict | None
    hook: str | None
    node: int
    storage: int
    to: str  # a rename's destination (its file name), for mode os.replace


WRITE = declare("write", WriteEvent)

ROOT = "<default_root_dir>"

RENAME = "os.replace"  # the mode of a rename's record (os.rename and os.replace raise one audit event)

_SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/")

# Caches that libraries share across processes on purpose (compiler caches, lock files).
_SHARED_CACHE_PARTS = ("torchinductor_", "__pycache__", ".triton", "triton_cache", "torch_extensions")

_SHARED_CACHE_SUFFIXES = (".pyc", ".lock")

_ACTIVE: SharedWritesProbe | None = None

_INSTALLED = False

_LOCAL = threading.local()

def _write_flags() -> int:
    return os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

def _on_audit(event: str, args) -> None:
    if event not in ("open", "os.rename"):  # os.rename: os.replace raises it too
        return
    probe = _ACTIVE
    if probe is None or getattr(_LOCAL, "busy", False):
        return
    _LOCAL.busy = True
    try:
        if event == "open":
            probe.on_open(args)
        else:
            probe.on_rename(args)
    except Exception:
        pass  # recording must never break the user's open()
    finally:
        _LOCAL.busy = False

def install_dispatcher() -> None:
    """Add the audit hook once per process; it does nothing while no probe is active."""
    global _INSTALLED
    if not _INSTALLED:
        sys.addaudithook(_on_audit)
        _INSTALLED = True

def _user_frame_and_checkpointing(start, own: tuple[str, ...] = ()) -> tuple[dict | None, bool]:
    """The write's site: the innermost frame of the user's own code (their project, or the installed
    package their LightningModule comes from, ``own``), with ``library``: the frame of the installed
    package it called (pandas' ``to_csv``) where the innermost user-rule frame is one; and whether a
    checkpoint is being saved."""
    from ...sites import is_installed, is_user_file

    first = mine = None
    inner = None  # the frame the current one called
    saving = False
    frame = start
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("save_checkpoint", "_save_checkpoint", "_save_last_checkpoint", "_save_topk_checkpoint"):
            saving = True
        if mine is None and is_user_file(code.co_filename):
            first = first or frame
            real = os.path.realpath(code.co_filename)
            if not is_installed(code.co_filename) or real.startswith(own):
                mine = (frame, inner)
        inner = frame
        frame = frame.f_back
    if mine is None:
        return (_site(first) if first is not None else None), saving
    site = _site(mine[0])
    if first is not mine[0] and mine[1] is not None:
        site["library"] = _site(mine[1])
    return site, saving


def _site(frame) -> dict:
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno,
            "func": getattr(frame.f_code, "co_qualname", frame.f_code.co_name)}


def own_roots(loaded) -> tuple[str, ...]:
    """The folders of the installed packages the user's LightningModule and DataModule come from
    (their own code even when pip installed it)."""
    from ...sites import is_installed

    roots = []
    for obj in (getattr(loaded, "model", None), getattr(loaded, "datamodule", None)):
        top = sys.modules.get(type(obj).__module__.split(".")[0]) if obj is not None else None
        path = getattr(top, "__file__", None)
        if path and is_installed(path):
            roots.append(os.path.dirname(os.path.realpath(path)) + os.sep)
    return tuple(roots)


def _describe_mode(mode, flags) -> str:
    if isinstance(mode, str):
        return mode
    if not isinstance(flags, int):
        return "write"
    if flags & os.O_APPEND:
        return "append (os.open)"
    if flags & os.O_TRUNC:
        return "truncate (os.open)"
    return "write (os.open)"

class SharedWritesProbe(Probe):
    """Routes this rank's write opens and ``torch.save`` calls into ``write`` trace events."""

    def __init__(self):
        self.recorder = None
        self.pid = os.getpid()
        self.roots: tuple[str, ...] = ()
        self.node = 0
        self.storage: dict | None = None
        self.own: tuple[str, ...] = ()

    def before_trainer(self, loaded, trainer_kwargs, recorder) -> None:
        import torch

        global _ACTIVE
        self.recorder = recorder
        self.own = own_roots(loaded)
        ctx = current_context()
        self.node = ctx.node_rank if ctx is not None else 0
        self.storage = node_storage.rank_storage(ctx, (trainer_kwargs.get("default_root_dir"),)) if ctx else None
        roots = {os.path.realpath(os.getcwd())}
        if trainer_kwargs.get("default_root_dir"):
            roots.add(os.path.realpath(str(trainer_kwargs["default_root_dir"])))
        self.roots = tuple(sorted(roots, key=len, reverse=True))
        probe = self

        def factory(original):
            def save(obj, f, *args, **kwargs):
                if isinstance(f, (str, bytes, os.PathLike)) and _ACTIVE is probe:
                    try:
                        site, saving = _user_frame_and_checkpointing(sys._getframe(1), probe.own)
                        probe._record(os.fsdecode(f), "torch.save", site, saving)
                    except Exception:
                        pass
                _LOCAL.busy = True  # the Python-level open inside torch.save is the same write
                try:
                    return original(obj, f, *args, **kwargs)
                finally:
                    _LOCAL.busy = False

            return save

        recorder.patch(torch, "save", factory)
        recorder.patch(torch.serialization, "save", factory)
        install_dispatcher()
        _ACTIVE = self

    def on_open(self, args) -> None:
        global _ACTIVE
        recorder = self.recorder
        if recorder is None or recorder._fh.closed:
            if _ACTIVE is self:
                _ACTIVE = None
            return
        if os.getpid() != self.pid:
            return  # a forked DataLoader worker: its trace handle belongs to the parent
        path, mode, flags = (list(args) + [None, None, None])[:3]
        if isinstance(path, int) or path is None:
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            (not isinstance(mode, str) and isinstance(flags, int) and bool(flags & _write_flags()))
        if not writes or node_storage.stdlib_own(sys._getframe(2)):
            return
        site, saving = _user_frame_and_checkpointing(sys._getframe(2), self.own)
        self._record(os.fsdecode(path), _describe_mode(mode, flags), site, saving)

    def on_rename(self, args) -> None:
        """``os.rename``/``os.replace(src, dst)`` from user code: recorded as a write of ``src``
        (mode ``os.replace``, ``to`` the destination): the rank moves that file away."""
        if self.recorder is None or self.recorder._fh.closed or os.getpid() != self.pid:
            return
        src, dst = (list(args) + [None, None])[:2]
        if not isinstance(src, (str, bytes, os.PathLike)) or not isinstance(dst, (str, bytes, os.PathLike)):
            return
        site, saving = _user_frame_and_checkpointing(sys._getframe(2), self.own)
        self._record(os.fsdecode(src), RENAME, site, saving, to=os.path.basename(os.fsdecode(dst)))

    def _record(self, path: str, mode: str, site, saving: bool, **extra) -> None:
        if site is None or saving:
            return  # written by a library on its own, or part of checkpoint saving
        absolute = os.path.realpath(os.path.abspath(path))
        if absolute.startswith(_SKIP_PREFIXES) or absolute.endswith(_SHARED_CACHE_SUFFIXES) or \
                any(part in absolute for part in _SHARED_CACHE_PARTS) or \
                absolute.startswith(os.path.expanduser("~/.cache") + os.sep):
            return
        shown = absolute
        for root in self.roots:
            if absolute == root or absolute.startswith(root + os.sep):
                shown = os.path.join(ROOT, os.path.relpath(absolute, root))
                break
        event = {"ev": WRITE, "path": shown, "mode": mode, "site": site, "hook": self.recorder.current_hook(),
                 "node": self.node, **extra}
        located = node_storage.locate(absolute, self.storage) if self.storage is not None else None
        if located is not None:  # each node's own: the same path on two nodes is two files
            event.update(path=located[1], storage=located[0])
        self.recorder.emit(event)

    def collect(self, loaded, trainer, recorder):
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        return None
