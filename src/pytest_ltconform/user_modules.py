"""The user's modules (target files and what they import) run once per process.

The pytest process and every rank forget the user modules a target (or a job) imported, so the
next target's ``model.py`` is not this one's. Executing the same file again would make new
classes while a package's process-global registry (GraphGym's ``register.loader_dict``, any
``@register_x("name")`` at import time) keeps the first execution's: instances built through the
registry then no longer pickle ("not the same object"), or the second import raises KeyError
"already defined". So a forgotten module is kept aside, and an import that resolves to the same,
unchanged file gets it back, while a target loads, instead of executing the file again.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.abc
import importlib.machinery
import os
import sys
import types

# (module name, real path) -> (module, the file's mtime when it was forgotten)
_FORGOTTEN: dict[tuple[str, str], tuple[types.ModuleType, int]] = {}
_NAMES: set[str] = set()
# Only while a target loads: a job function's own modules (ltconform_world) are executed afresh.
_LOADING = 0


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def forget(name: str) -> None:
    """Remove ``name`` from ``sys.modules``, kept aside for an import of the same file."""
    module = sys.modules.pop(name, None)
    file = getattr(module, "__file__", None)
    if module is None or not file:
        return
    real = os.path.realpath(file)
    mtime = _mtime(real)
    if mtime is not None:
        _FORGOTTEN[(name, real)] = (module, mtime)
        _NAMES.add(name)


def reused(name: str, path: str) -> types.ModuleType | None:
    """The module forgotten as ``name`` that was executed from ``path``, when the file has not
    changed since; None otherwise."""
    real = os.path.realpath(path)
    entry = _FORGOTTEN.get((name, real))
    if entry is None or _mtime(real) != entry[1]:
        return None
    return entry[0]


class ReuseLoader(importlib.abc.Loader):
    """Hands back a module executed before; executing it again is what this module prevents."""

    def __init__(self, module: types.ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if not _LOADING or name not in _NAMES:
            return None
        found = importlib.machinery.PathFinder.find_spec(name, path)
        module = reused(name, found.origin) if found is not None and found.origin else None
        if module is None:
            return None
        spec = copy.copy(getattr(module, "__spec__", None) or found)
        spec.loader = ReuseLoader(module)
        return spec


@contextlib.contextmanager
def reusing():
    """Inside, an import of a forgotten, unchanged file gets its module back (a target's loading)."""
    global _LOADING
    install()
    _LOADING += 1
    try:
        yield
    finally:
        _LOADING -= 1


def install() -> None:
    """Serve forgotten modules to later imports in this process (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
