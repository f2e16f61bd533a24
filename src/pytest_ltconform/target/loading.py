"""Loading a target's objects: importing the user's module (once per process, see
:mod:`..user_modules`), finding the named object, building the module or datamodule, reading the
Trainer kwargs. Used in the process that validates a target and on every rank, which loads the
objects again from the :class:`~.spec.ObjectRef` it received. Every failure is a
:class:`~.spec.TargetError` naming the input and the fix.

No torch or lightning import at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import traceback
from typing import Any

from .. import tripwire, user_modules  # tripwire: Trainer.fit at import time trips instead of training
from .spec import ObjectRef, ResolvedTarget, TargetError


def private_name(spec: ObjectRef) -> str:
    """The module name a file target is registered under when its own name is taken by another
    file (two folders each with ``model.py``): unique per path, so a third such file cannot
    replace the second's module (and the classes pickle finds by name) either."""
    digest = hashlib.sha1(spec.path.encode()).hexdigest()[:10]
    return f"ltconform_target_{spec.module}_{digest}"


def _same_file(module, path: str) -> bool:
    return module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == path


def _import_file_module(spec: ObjectRef):
    folder = os.path.dirname(spec.path)
    existing = sys.modules.get(spec.module)
    if _same_file(existing, spec.path):
        return existing
    if existing is None:
        # Register under its real name from its own folder, so that pickling (ddp_spawn) and
        # re-imports inside ranks find the same module.
        if folder not in sys.path:
            sys.path.insert(0, folder)
        found = importlib.util.find_spec(spec.module)
        if found is not None and found.origin and os.path.abspath(found.origin) == spec.path:
            return tripwire.import_module(spec.module)
    # The name is taken by another file: load under a private name of this path, once (a second
    # execution would make new classes that no longer match the instances built from the first).
    name = private_name(spec)
    if _same_file(sys.modules.get(name), spec.path):
        return sys.modules[name]
    loaded = user_modules.reused(name, spec.path)
    if loaded is not None:
        sys.modules[name] = loaded
        return loaded
    loader_spec = importlib.util.spec_from_file_location(name, spec.path)
    return tripwire.exec_guarded(name, loader_spec)


def trainer_file(targets: ResolvedTarget) -> str | None:
    """The file that defines the user's Trainer kwargs: the module of the trainer target once it
    is imported, or, for a dict given to :class:`Target`, the file that declared it; else None."""
    spec = targets.trainer
    if spec is None:
        declared = targets.declared_at if targets.trainer_dict is not None else None
        return declared.rpartition(":")[0] if declared else None
    if spec.path:
        return spec.path
    module = sys.modules.get(spec.module)
    return getattr(module, "__file__", None)


def _user_frame(tb) -> str:
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if "importlib" not in frame.filename and "pytest_ltconform" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def import_module(spec: ObjectRef):
    """Import the module a spec names (once per process, see :mod:`.user_modules`); raises
    :class:`TargetError` with the cause."""
    with user_modules.reusing():
        return _import_module(spec)


def _import_module(spec: ObjectRef):
    try:
        if spec.path:
            return _import_file_module(spec)
        try:
            return tripwire.import_module(spec.module)
        except ModuleNotFoundError as exc:
            # The `pytest` script does not put the working directory on sys.path; `python -m` does.
            if os.getcwd() in sys.path or not (exc.name and spec.module.split(".")[0] == exc.name.split(".")[0]):
                raise
            sys.path.insert(0, os.getcwd())
            return tripwire.import_module(spec.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or spec.module
        if spec.module == missing or spec.module.startswith(missing + "."):
            raise TargetError(
                f"{spec.option} {spec.text!r}: cannot import module {spec.module!r} (no module named "
                f"{missing!r}). Check the spelling, install your package (pip install -e .), or run "
                f"pytest from the folder that contains it; a file can be named directly as "
                f"path/to/file.py:{spec.attr}."
            ) from None
        raise TargetError(
            f"{spec.option} {spec.text!r}: importing {spec.module!r} failed because it imports "
            f"{missing!r}, which is not installed ({_user_frame(exc.__traceback__)}). Install it in "
            f"this environment."
        ) from None
    except SyntaxError as exc:
        # The message already names the file and line; the traceback has no user frame.
        raise TargetError(
            f"{spec.option} {spec.text!r}: {spec.module!r} cannot be imported: {type(exc).__name__} at "
            f"{exc.filename}:{exc.lineno}: {exc.msg}. Fix the syntax there."
        ) from None
    except Exception as exc:
        raise TargetError(
            f"{spec.option} {spec.text!r}: importing {spec.module!r} raised {type(exc).__name__}: {exc} "
            f"(at {_user_frame(exc.__traceback__)}). Fix the module so that importing it has no "
            f"side effects that fail."
        ) from None


def load_object(spec: ObjectRef, kind: str = "LightningModule") -> Any:
    """Import and return the object a spec names (not yet called). ``kind`` says what the target
    should name, for the message of a missing name: ``"LightningModule"``, ``"LightningDataModule"``
    or ``"trainer"`` (a dict of Trainer kwargs, or a callable returning one)."""
    module = import_module(spec)
    obj = module
    for part in spec.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(
                f"{spec.option} {spec.text!r}: module {module.__name__!r} has no attribute "
                f"{spec.attr!r}.{_missing_hint(module, part, kind)}"
            ) from None
    return obj


def _candidates(module, kind: str) -> tuple[list[str], str]:
    """The names defined in ``module`` that could be a target of ``kind``, and how to call them."""
    own = {n: v for n, v in vars(module).items() if not n.startswith("_")}
    if kind == "trainer":
        names = [n for n, v in own.items() if isinstance(v, dict) or (
            callable(v) and not inspect.isclass(v) and getattr(v, "__module__", None) == module.__name__)]
        return sorted(names), "dicts and functions defined there"
    names = [n for n, v in own.items() if inspect.isclass(v) and getattr(v, "__module__", None) == module.__name__
             and namespace_of(v, kind) is not None]
    return sorted(names), f"{kind}s defined there"


def _missing_hint(module, name: str, kind: str) -> str:
    """' Did you mean ...? <kind>s defined there: ...' for a name ``module`` lacks: the close name
    among the candidates of ``kind`` first, else among all its public names."""
    import difflib

    names, label = _candidates(module, kind)
    close = difflib.get_close_matches(name, names, n=1) or \
        difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if names:
        more = f" (and {len(names) - 12} more)" if len(names) > 12 else ""
        hint += f" {label[0].upper()}{label[1:]}: {', '.join(names[:12])}{more}."
    return hint


def _factory_advice(spec: ObjectRef, cls: type, required: list[str], base_name: str) -> str:
    """How to target a class whose constructor needs ``required``: a factory named after it, or
    (for a LightningModule) a conftest Target with ``init``."""
    where = spec.text.rpartition(":")[0] if spec.path else spec.module
    advice = (f"Write a zero-argument factory that returns a configured instance and pass it as "
              f"{where}:make_{_snake(cls.__name__)}")
    if base_name != "LightningModule":  # Target(init=...) builds the module only
        return advice + "."
    init = ", ".join(f"{name!r}: ..." for name in required)
    return (f"{advice}, or declare the target in conftest.py as pytest_ltconform.Target({spec.text!r}, "
            f"init={{{init}}}) (see docs/configuration.md, Several targets).")


def _snake(name: str) -> str:
    """``WideNet`` -> ``wide_net``, for the suggested factory name of a class."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def namespace_of(cls: type, base_name: str = "LightningModule") -> str | None:
    """The Lightning namespace ``cls`` derives from: 'lightning.pytorch' or 'pytorch_lightning'."""
    for klass in inspect.getmro(cls):
        if klass.__name__ == base_name:
            mod = klass.__module__
            if mod.startswith("pytorch_lightning"):
                return "pytorch_lightning"
            if mod.startswith("lightning.pytorch"):
                return "lightning.pytorch"
    return None


def _required_params(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        name for name, p in sig.parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def instantiate(spec: ObjectRef, base_name: str, what: str, init: dict | None = None) -> Any:
    """Load ``spec`` and return an instance of a class named ``base_name`` (a LightningModule or
    LightningDataModule of either namespace): the class is constructed, or the factory called,
    with ``init`` as keyword arguments (none when ``init`` is None). Raises :class:`TargetError`.
    """
    obj = load_object(spec, base_name)
    if inspect.isclass(obj):
        if namespace_of(obj, base_name) is None:
            raise TargetError(
                f"{spec.option} {spec.text!r}: {obj.__module__}.{obj.__qualname__} is a class but not a "
                f"{base_name} subclass (of lightning.pytorch or pytorch_lightning). Point it at your "
                f"{what}, or at a zero-argument factory returning one."
            )
        factory, label = obj, f"{obj.__qualname__}()"
        if init is None:
            required = _required_params(obj.__init__)[1:]
            if required:
                raise TargetError(
                    f"{spec.option} {spec.text!r}: {obj.__qualname__}() cannot be constructed without "
                    f"arguments (__init__ requires {', '.join(required)}). "
                    f"{_factory_advice(spec, obj, required, base_name)}"
                )
    elif callable(obj):
        factory, label = obj, f"{spec.attr}()"
        required = _required_params(obj) if init is None else []
        if required:
            raise TargetError(
                f"{spec.option} {spec.text!r}: the factory requires arguments ({', '.join(required)}); "
                f"it must be callable without arguments."
            )
    else:
        raise TargetError(
            f"{spec.option} {spec.text!r}: it is a {type(obj).__name__}, not a {base_name} class or a "
            f"zero-argument factory returning one."
        )
    if init is not None:
        _check_binds(spec, factory, init)
        label = label[:-1] + "**init)"
    try:
        instance = factory(**(init or {}))
    except Exception as exc:
        raise TargetError(
            f"{spec.option} {spec.text!r}: calling {label} raised {type(exc).__name__}: {exc} "
            f"(at {_user_frame(exc.__traceback__)}). It must build the {what}"
            f"{' from init' if init is not None else ' without arguments'}."
        ) from None
    if namespace_of(type(instance), base_name) is None:
        raise TargetError(
            f"{spec.option} {spec.text!r}: {label} returned a {type(instance).__name__}, not a {base_name}."
        )
    return instance


def _check_binds(spec: ObjectRef, factory, init: dict) -> None:
    """``init`` must name parameters of ``factory`` and give every required one."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin without a signature: calling it says what is wrong
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [] if takes_any else [k for k in init if k not in named]
    missing = [n for n, p in params.items() if p.default is p.empty and n not in init
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
    if not unknown and not missing:
        return
    problems = []
    if unknown:
        problems.append(f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not a parameter")
    if missing:
        problems.append(f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} required but "
                        f"not given")
    name = getattr(factory, "__qualname__", spec.attr)
    raise TargetError(
        f"{spec.option} {spec.text!r}: init={short_repr(init)} does not fit {name}{sig}: {'; '.join(problems)}. "
        f"Use the constructor's parameter names in init."
    )


def short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def trainer_kwargs(spec: ObjectRef) -> dict:
    """Load a Trainer-kwargs target: a dict or a zero-argument callable returning one."""
    from ..sharded import deepspeed_stand_in

    with deepspeed_stand_in():  # a DeepSpeedStrategy(...) stays readable where deepspeed is absent
        return _trainer_kwargs(spec)


def _trainer_kwargs(spec: ObjectRef) -> dict:
    obj = load_object(spec, "trainer")
    if callable(obj) and not isinstance(obj, dict):
        required = _required_params(obj)
        if required:
            raise TargetError(
                f"{spec.option} {spec.text!r}: the callable requires arguments ({', '.join(required)}); "
                f"it must return the Trainer kwargs dict when called without arguments."
            )
        try:
            obj = obj()
        except Exception as exc:
            raise TargetError(
                f"{spec.option} {spec.text!r}: calling it raised {type(exc).__name__}: {exc} "
                f"(at {_user_frame(exc.__traceback__)})."
            ) from None
    if not isinstance(obj, dict):
        raise TargetError(
            f"{spec.option} {spec.text!r}: expected a dict of Trainer kwargs (or a callable returning "
            f"one), got {type(obj).__name__}."
        )
    return dict(obj)


def defines(obj: Any, hook: str, namespace: str) -> bool:
    """Whether ``obj`` overrides a data hook such as ``train_dataloader`` of its Lightning base, as
    Lightning decides it (``lightning_utilities``' ``is_overridden``): a ``functools.partial`` or
    method assigned to the instance in ``__init__`` counts, as it does for a Trainer."""
    from lightning_utilities.core.overrides import is_overridden

    for klass in inspect.getmro(type(obj)):
        if klass.__name__ in ("LightningModule", "LightningDataModule") and klass.__module__.startswith(namespace):
            return is_overridden(hook, obj, klass)
    return getattr(obj, hook, None) is not None


def user_trainer_kwargs(targets: ResolvedTarget) -> dict:
    """The user's Trainer kwargs of ``targets`` (a copy): the dict given to :class:`Target`, what
    the trainer target returns, or ``{}``. Raises :class:`TargetError` for a bad trainer target."""
    if targets.trainer_dict is not None:
        return dict(targets.trainer_dict)
    return trainer_kwargs(targets.trainer) if targets.trainer else {}


@contextlib.contextmanager
def own_imports():
    """Forget, on exit, the user modules imported and the ``sys.path`` entries added inside: the
    next target of the session imports its own ``model.py`` or ``utils.py``, not this one's.
    Installed packages, the standard library and this plugin stay loaded; a later import of the
    same file gets the module back (see :mod:`..user_modules`)."""
    before = set(sys.modules)
    path = list(sys.path)
    plugin = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the pytest_ltconform folder
    keep = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
                                               plugin})
    try:
        yield
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - before:
            file = getattr(sys.modules.get(name), "__file__", None)
            if not file:
                continue
            real = os.path.realpath(file)
            if not real.startswith(keep) and "site-packages" not in real and "dist-packages" not in real:
                user_modules.forget(name)
