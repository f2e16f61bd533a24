"""Where each loader the trainer uses was constructed: the user's ``file:line`` of the call that
built the object a ``*_dataloader`` hook returned, a torch DataLoader or any other iterable (a
package's own loader class).

Shared by the contracts that name a loader in their evidence and fix (data-sharding,
eval-duplication). Lightning re-creates a DataLoader to inject its sampler, from a frame of its own,
so the site is taken from the object the hook returned and kept per hook, in the order the hook
returned its loaders.

Rank side, cheap by design: a profile function is active only while user code may build a loader
(the target factory, the ``setup`` hook and each ``*_dataloader`` hook call) and looks only at
``__init__`` calls of iterable objects. The site is the first frame outside torch, Lightning and the
plugin above the outermost ``__init__`` (a package's file counts as the user's). Imports nothing of
torch or Lightning at module level.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ..events import Recorded, declare


class LoaderBuiltEvent(Recorded):
    """The loaders a data hook (``hook``) returned, each with where the user's code built it (``loaders``)."""

    hook: str
    loaders: list


LOADER_BUILT = declare("loader_built", LoaderBuiltEvent)


MAX_OBJECTS = 2000  # iterables remembered per process: enough for any factory, bounded for a huge one


class _Registry:
    """Per process: id(object) -> (reference, site, class name), and hook name -> the loaders'
    (site, class name) in the order the hook returned them."""

    def __init__(self) -> None:
        self.objects: dict[int, tuple[Any, dict | None, str]] = {}
        self.by_hook: dict[str, list[dict]] = {}
        self.depth = 0
        self.emit = None

    def reset(self, emit=None) -> None:
        self.objects.clear()
        self.by_hook.clear()
        self.depth = 0
        self.emit = emit


_REG = _Registry()


def _site_above(frame, obj) -> dict | None:
    """The first user frame above ``frame`` (an ``__init__`` of ``obj``) that is not another
    ``__init__`` of ``obj`` itself (a subclass's ``super().__init__``)."""
    from ..sites import is_user_file

    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename) and not (code.co_name == "__init__" and frame.f_locals.get("self") is obj):
            func = getattr(code, "co_qualname", code.co_name)
            return {"file": code.co_filename, "line": frame.f_lineno, "func": func}
        frame = frame.f_back
    return None


def _profile(frame, event, arg) -> None:
    if event != "call" or frame.f_code.co_name != "__init__":
        return
    try:
        obj = frame.f_locals.get("self")
        if obj is None or id(obj) in _REG.objects or not hasattr(type(obj), "__iter__") \
                or len(_REG.objects) >= MAX_OBJECTS:
            return
        try:
            ref: Any = weakref.ref(obj)
        except TypeError:
            ref = obj
        _REG.objects[id(obj)] = (ref, _site_above(frame.f_back, obj), type(obj).__name__)
    except Exception:
        pass  # a frame that cannot be read records nothing; the user's call goes on


def _entry(obj) -> tuple[dict | None, str] | None:
    found = _REG.objects.get(id(obj))
    if found is None:
        return None
    ref, site, cls = found
    alive = ref() if isinstance(ref, weakref.ref) else ref
    return (site, cls) if alive is obj else None


class _Window:
    """Profile ``__init__`` calls while user code runs; nested windows share one profile, and a
    profile function someone else installed (a profiler, a debugger) is left alone."""

    def __enter__(self):
        self.active = _REG.depth > 0 or sys.getprofile() is None
        if self.active:
            _REG.depth += 1
            sys.setprofile(_profile)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            _REG.depth -= 1
            if _REG.depth == 0:
                sys.setprofile(None)


def _flatten(value, out: list, depth: int = 0) -> list:
    """The loaders a hook returned: a list, tuple or dict of loaders, or Lightning's CombinedLoader."""
    if depth > 3 or value is None:
        return out
    inner = getattr(value, "iterables", None) if type(value).__name__ == "CombinedLoader" else None
    if inner is not None:
        return _flatten(inner, out, depth + 1)
    if isinstance(value, (list, tuple)):
        for v in value:
            _flatten(v, out, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten(v, out, depth + 1)
    else:
        out.append(value)
    return out


def _record_hook(name: str, value) -> None:
    entries = []
    for loader in _flatten(value, []):
        found = _entry(loader)
        site, cls = found if found is not None else (None, type(loader).__name__)
        entries.append({"site": site, "cls": cls, "torch_loader": _is_torch_loader(loader)})
    _REG.by_hook[name] = entries
    if _REG.emit is not None:
        # In the trace too: a fit that stops in Lightning's sampler injection still names the line.
        _REG.emit({"ev": LOADER_BUILT, "hook": name, "loaders": entries})


def _is_torch_loader(obj) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


def _wrap_window(original):
    def wrapper(*args, **kwargs):
        with _Window():
            return original(*args, **kwargs)

    return wrapper


def _wrap_source(original):
    def dataloader(source, *args, **kwargs):
        with _Window():
            out = original(source, *args, **kwargs)
        try:
            _record_hook(str(getattr(source, "name", "") or ""), out)
        except Exception:
            pass  # a loader that cannot be read is named without a site
        return out

    return dataloader


def install(recorder) -> None:
    """Patch, through ``recorder`` (undone with it), the places user code builds loaders. Several
    probes of one run may call it; the patches and the registry are installed once per recorder."""
    import importlib

    from ..harness import UserObjects

    if getattr(recorder, "_ltconform_loader_sites", False):
        return
    recorder._ltconform_loader_sites = True
    _REG.reset(recorder.emit)
    recorder.patch(UserObjects, "new_model", _wrap_window)
    recorder.patch(UserObjects, "new_datamodule", _wrap_window)
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        if ns not in sys.modules:
            continue
        try:
            call = importlib.import_module(f"{ns}.trainer.call")
            connector = importlib.import_module(f"{ns}.trainer.connectors.data_connector")
        except ImportError:
            continue
        recorder.patch(call, "_call_setup_hook", _wrap_window)
        recorder.patch(connector._DataLoaderSource, "dataloader", _wrap_source)


def loaders_of(hook: str) -> list[dict]:
    """The loaders ``hook`` (``"val_dataloader"``...) last returned on this rank, in order: each
    ``{"site": {file, line, func} or None, "cls": class name, "torch_loader": bool}``."""
    return [dict(e) for e in _REG.by_hook.get(hook, [])]


def loader_of(hook: str, index: int = 0) -> dict | None:
    """The ``index``-th loader ``hook`` returned (see :func:`loaders_of`); None when not recorded."""
    entries = _REG.by_hook.get(hook) or []
    return dict(entries[index]) if index < len(entries) else None
