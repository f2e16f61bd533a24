"""A tripwire for target modules that start training when they are imported.

A training script without an ``if __name__ == "__main__":`` guard calls ``Trainer.fit`` at module
top level, so every process that imports it trains: a ddp_spawn child, a DataLoader worker under
the spawn start method, and this plugin (which imports the target to validate it, in pytest's
process or one forked for it, and in every rank). While :func:`armed` is active,
``Trainer.fit/validate/test/predict`` of both Lightning namespaces raise
:class:`TrainingAtImport` instead of training; :func:`import_module` imports a target with the
wire armed, keeps the module's partly executed namespace registered (everything defined above
the call is usable) and records where training was started in :data:`TRIPPED`. The spawn-safety
contract reports it; the other contracts still run.

No torch or lightning import at module level.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

from . import user_modules

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
ENTRY_POINTS = ("fit", "validate", "test", "predict")

#: module name -> {"method", "file", "line", "func"}: where importing it started training.
TRIPPED: dict[str, dict] = {}
# path -> its TRIPPED record, for a module that user_modules hands back without executing it again
_TRIPPED_AT: dict[str, dict] = {}


class TrainingAtImport(BaseException):
    """A Trainer entry point was called while a target module was being imported.

    A BaseException, so that a user's ``except Exception`` around the script part does not
    swallow it and go on training something else."""

    def __init__(self, method: str, site: dict | None):
        super().__init__(f"Trainer.{method} called while importing the target module")
        self.method = method
        self.site = site


def _caller_site(module_file: str | None) -> dict | None:
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        code = frame.f_code
        here = {"file": code.co_filename, "line": frame.f_lineno, "func": getattr(code, "co_qualname", code.co_name)}
        if module_file and os.path.abspath(code.co_filename) == module_file:
            return here
        if first is None and "pytest_ltconform" not in code.co_filename and \
                f"{os.sep}lightning" not in code.co_filename and "pytorch_lightning" not in code.co_filename:
            first = here
        frame = frame.f_back
    return first


def _namespaces_for(source: str | None) -> list[str]:
    """The Lightning namespaces whose Trainer must be armed: those already imported, and those
    the module's source names (imported now, before the module imports them itself)."""
    wanted = [ns for ns in NAMESPACES if ns in sys.modules]
    text = source or ""
    mentions = {"lightning.pytorch": ("import lightning", "from lightning"),
                "pytorch_lightning": ("pytorch_lightning",)}
    for ns, needles in mentions.items():
        if ns not in wanted and any(n in text for n in needles) and importlib.util.find_spec(ns.split(".")[0]):
            wanted.append(ns)
    return wanted


@contextlib.contextmanager
def armed(module_file: str | None = None, source: str | None = None):
    """While active, Trainer entry points raise :class:`TrainingAtImport` (see the module doc)."""
    patched = []
    for ns in _namespaces_for(source):
        try:
            trainer_cls = importlib.import_module(ns).Trainer
        except Exception:
            continue
        for name in ENTRY_POINTS:
            original = trainer_cls.__dict__.get(name)
            if original is None:
                continue

            def make(method):
                def entry(self, *args, **kwargs):
                    raise TrainingAtImport(method, _caller_site(module_file))

                return entry

            setattr(trainer_cls, name, make(name))
            patched.append((trainer_cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)


def _source_of(spec) -> tuple[str | None, str | None]:
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.isfile(origin):
        return None, None
    try:
        with open(origin, encoding="utf-8") as fh:
            return os.path.abspath(origin), fh.read()
    except (OSError, UnicodeDecodeError):
        return os.path.abspath(origin), None


def exec_guarded(name: str, spec) -> object:
    """Create, register and execute module ``name`` from ``spec`` with the wire armed; a module
    that trains at import stays registered with what it defined before the call."""
    path, source = _source_of(spec)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if isinstance(spec.loader, user_modules.ReuseLoader):  # executed once already: its record holds
        if path in _TRIPPED_AT:
            TRIPPED[name] = _TRIPPED_AT[path]
        return module
    # A rank runs the jobs of several targets: what an earlier module of this name did at import
    # (two folders each with model.py) is not this one's record.
    TRIPPED.pop(name, None)
    try:
        with armed(path, source):
            spec.loader.exec_module(module)
    except TrainingAtImport as trip:
        TRIPPED[name] = {"method": f"Trainer.{trip.method}", "module": name, "path": path, **(trip.site or {})}
        _TRIPPED_AT[path] = TRIPPED[name]
    except BaseException:
        sys.modules.pop(name, None)
        raise
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def import_module(name: str) -> object:
    """``importlib.import_module(name)`` with the tripwire armed for the module itself."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return importlib.import_module(name)  # raises the standard error
    return exec_guarded(name, spec)


def fresh_import_check(module: str, namespace: str, paths: list[str]) -> dict:
    """Run in a fresh interpreter: import ``module`` with both Trainers armed (``namespace``
    first, eagerly) and report whether importing it started training or built a Trainer."""
    import time

    sys.path[:0] = [p for p in paths if p not in sys.path]
    started = time.monotonic()
    result: dict = {"tripped": None, "trainers": [], "error": None}
    built: list[dict] = []
    for ns in (namespace,):
        try:
            trainer_cls = importlib.import_module(ns).Trainer
        except Exception:
            continue
        original = trainer_cls.__init__

        def __init__(self, *args, _original=original, **kwargs):
            built.append(_caller_site(None) or {})
            return _original(self, *args, **kwargs)

        trainer_cls.__init__ = __init__
    spec = importlib.util.find_spec(module)
    path, source = _source_of(spec) if spec is not None else (None, None)
    from .cuda_on_cpu import where_no_cuda

    try:
        # A module that names CUDA at import imports on a CPU-only torch as it does in the ranks.
        with armed(path, (source or "") + f"\nimport {namespace}"), where_no_cuda():
            if spec is None:
                importlib.import_module(module)
            else:
                mod = importlib.util.module_from_spec(spec)
                sys.modules[module] = mod
                spec.loader.exec_module(mod)
    except TrainingAtImport as trip:
        result["tripped"] = {"method": f"Trainer.{trip.method}", **(trip.site or {})}
    except BaseException as exc:
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if path and os.path.abspath(f.filename) == path]
        if frames:
            result["error_site"] = {"file": frames[-1].filename, "line": frames[-1].lineno, "func": frames[-1].name}
    result["trainers"] = [b for b in built if b]
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


if __name__ == "__main__":  # python -m pytest_ltconform.tripwire MODULE NAMESPACE PATHS_JSON
    import json

    out = fresh_import_check(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    sys.stdout.flush()
    print("LTCONFORM-IMPORT-CHECK " + json.dumps(out, default=repr), flush=True)
