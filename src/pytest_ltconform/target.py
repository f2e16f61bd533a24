"""Turn the strings users pass (``pkg.mod.Class``, ``pkg.mod:factory``, ``path/to/file.py:Name``)
into validated, picklable target specs.

A :class:`TargetSpec` is plain data: it travels to every rank, which loads the object again with
:func:`load_object`. :func:`validate` runs in the pytest process and turns every way a target can
be wrong into one :class:`TargetError` paragraph that names the input and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any

from . import tripwire  # Trainer.fit at import time trips instead of training

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


class TargetError(Exception):
    """A target string that cannot be used; the message is one paragraph with the fix."""


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """Where to find a user object.

    ``text`` is what the user wrote, ``option`` the flag or ini key it came from, ``module`` the
    importable module name, ``attr`` the (possibly dotted) attribute inside it, and ``path`` the
    file when the user named one (its folder is put on ``sys.path`` so that the module has its
    real, picklable name).
    """

    text: str
    option: str
    module: str
    attr: str
    path: str | None = None

    @property
    def display(self) -> str:
        return self.text


def parse(text: str, option: str) -> TargetSpec:
    """Parse a target string; raises :class:`TargetError` for a malformed one."""
    text = text.strip()
    if not text:
        raise TargetError(f"{option}: empty target. Pass pkg.mod.Class, pkg.mod:factory or path/to/file.py:Name.")
    if text.endswith(".py") and ":" not in text:
        raise TargetError(
            f"{option} {text!r}: a file target needs the object's name after a colon, e.g. {text}:Model "
            f"(or {text}:make_model for a factory)."
        )
    file_part, sep, attr = text.rpartition(":")
    if sep and (file_part.endswith(".py") or os.sep in file_part or "/" in file_part):
        path = os.path.abspath(file_part)
        if not os.path.isfile(path):
            raise TargetError(
                f"{option} {text!r}: the file {file_part!r} does not exist (looked for {path}). "
                f"Give a path relative to the directory you run pytest from, or an importable "
                f"name such as pkg.mod:{attr or 'Name'}."
            )
        if not attr:
            raise TargetError(f"{option} {text!r}: name the object after the colon, e.g. {file_part}:Model.")
        module = os.path.splitext(os.path.basename(path))[0]
        return TargetSpec(text=text, option=option, module=module, attr=attr, path=path)
    if sep:
        if not file_part or not attr:
            raise TargetError(f"{option} {text!r}: expected pkg.mod:factory with both parts present.")
        return TargetSpec(text=text, option=option, module=file_part, attr=attr)
    module, dot, attr = text.rpartition(".")
    if not dot or not module:
        raise TargetError(
            f"{option} {text!r}: a bare name cannot be imported. Use pkg.mod.Class, pkg.mod:factory "
            f"or path/to/file.py:Name."
        )
    return TargetSpec(text=text, option=option, module=module, attr=attr)


def _import_file_module(spec: TargetSpec):
    folder = os.path.dirname(spec.path)
    existing = sys.modules.get(spec.module)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == spec.path:
        return existing
    if existing is None:
        # Register under its real name from its own folder, so that pickling (ddp_spawn) and
        # re-imports inside ranks find the same module.
        if folder not in sys.path:
            sys.path.insert(0, folder)
        found = importlib.util.find_spec(spec.module)
        if found is not None and found.origin and os.path.abspath(found.origin) == spec.path:
            return tripwire.import_module(spec.module)
    # The name is taken by another module: load under a private, registered name.
    name = f"ltconform_target_{spec.module}"
    loader_spec = importlib.util.spec_from_file_location(name, spec.path)
    return tripwire.exec_guarded(name, loader_spec)


def _user_frame(tb) -> str:
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if "importlib" not in frame.filename and "pytest_ltconform" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def import_module(spec: TargetSpec):
    """Import the module a spec names; raises :class:`TargetError` with the cause."""
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
    except Exception as exc:
        raise TargetError(
            f"{spec.option} {spec.text!r}: importing {spec.module!r} raised {type(exc).__name__}: {exc} "
            f"(at {_user_frame(exc.__traceback__)}). Fix the module so that importing it has no "
            f"side effects that fail."
        ) from None


def load_object(spec: TargetSpec) -> Any:
    """Import and return the object a spec names (not yet called)."""
    module = import_module(spec)
    obj = module
    for part in spec.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            import difflib

            modules = sorted(n for n, v in vars(module).items() if inspect.isclass(v)
                             and getattr(v, "__module__", None) == module.__name__
                             and namespace_of(v) is not None)
            close = difflib.get_close_matches(part, [n for n in dir(module) if not n.startswith("_")], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            if modules:
                hint += f" LightningModules defined there: {', '.join(modules[:12])}."
            raise TargetError(
                f"{spec.option} {spec.text!r}: module {module.__name__!r} has no attribute "
                f"{spec.attr!r}.{hint}"
            ) from None
    return obj


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


def instantiate(spec: TargetSpec, base_name: str, what: str) -> Any:
    """Load ``spec`` and return an instance of a class named ``base_name`` (a LightningModule or
    LightningDataModule of either namespace): the class is constructed without arguments, or the
    factory is called without arguments. Raises :class:`TargetError`.
    """
    obj = load_object(spec)
    if inspect.isclass(obj):
        if namespace_of(obj, base_name) is None:
            raise TargetError(
                f"{spec.option} {spec.text!r}: {obj.__module__}.{obj.__qualname__} is a class but not a "
                f"{base_name} subclass (of lightning.pytorch or pytorch_lightning). Point it at your "
                f"{what}, or at a zero-argument factory returning one."
            )
        required = _required_params(obj.__init__)[1:]
        if required:
            raise TargetError(
                f"{spec.option} {spec.text!r}: {obj.__qualname__}() cannot be constructed without "
                f"arguments (__init__ requires {', '.join(required)}). Write a zero-argument factory "
                f"that returns a configured instance and pass it as {spec.module}:make_{what.split()[0]}."
            )
        factory, label = obj, f"{obj.__qualname__}()"
    elif callable(obj):
        required = _required_params(obj)
        if required:
            raise TargetError(
                f"{spec.option} {spec.text!r}: the factory requires arguments ({', '.join(required)}); "
                f"it must be callable without arguments."
            )
        factory, label = obj, f"{spec.attr}()"
    else:
        raise TargetError(
            f"{spec.option} {spec.text!r}: it is a {type(obj).__name__}, not a {base_name} class or a "
            f"zero-argument factory returning one."
        )
    try:
        instance = factory()
    except Exception as exc:
        raise TargetError(
            f"{spec.option} {spec.text!r}: calling {label} raised {type(exc).__name__}: {exc} "
            f"(at {_user_frame(exc.__traceback__)}). It must build the {what} without arguments."
        ) from None
    if namespace_of(type(instance), base_name) is None:
        raise TargetError(
            f"{spec.option} {spec.text!r}: {label} returned a {type(instance).__name__}, not a {base_name}."
        )
    return instance


def trainer_kwargs(spec: TargetSpec) -> dict:
    """Load a Trainer-kwargs target: a dict or a zero-argument callable returning one."""
    from .sharded import deepspeed_stand_in

    with deepspeed_stand_in():  # a DeepSpeedStrategy(...) stays readable where deepspeed is absent
        return _trainer_kwargs(spec)


def _trainer_kwargs(spec: TargetSpec) -> dict:
    obj = load_object(spec)
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
    """Whether ``obj`` overrides a data hook such as ``train_dataloader`` of its Lightning base."""
    method = getattr(type(obj), hook, None)
    if method is None:
        return False
    for klass in inspect.getmro(type(obj)):
        if klass.__name__ in ("LightningModule", "LightningDataModule") and klass.__module__.startswith(namespace):
            return method is not getattr(klass, hook, None)
    return True


@dataclasses.dataclass(frozen=True)
class Targets:
    """Everything one session checks: the module, optional datamodule and trainer kwargs."""

    model: TargetSpec
    datamodule: TargetSpec | None
    trainer: TargetSpec | None
    namespace: str
    model_name: str
    trainer_keys: tuple[str, ...] = ()
    # "module:qualname" of the classes the targets built, for pointing evidence at their source.
    model_class: str | None = None
    datamodule_class: str | None = None


def validate(model: str, datamodule: str | None, trainer: str | None) -> Targets:
    """Resolve and check all targets in this process; raises :class:`TargetError`."""
    model_spec = parse(model, "--ltconform")
    dm_spec = parse(datamodule, "--ltconform-datamodule") if datamodule else None
    tr_spec = parse(trainer, "--ltconform-trainer") if trainer else None
    module = instantiate(model_spec, "LightningModule", "LightningModule")
    namespace = namespace_of(type(module))
    dm = None
    if dm_spec is not None:
        dm = instantiate(dm_spec, "LightningDataModule", "LightningDataModule")
        dm_ns = namespace_of(type(dm), "LightningDataModule")
        if dm_ns != namespace:
            raise TargetError(
                f"--ltconform-datamodule {dm_spec.text!r} derives from {dm_ns} but the module "
                f"{model_spec.text!r} from {namespace}: a Trainer of one namespace rejects objects of "
                f"the other. Use the same Lightning package for both."
            )
    if not defines(module, "train_dataloader", namespace) and not (
        dm is not None and defines(dm, "train_dataloader", namespace)
    ):
        where = f" or {dm_spec.text}" if dm_spec else ""
        raise TargetError(
            f"--ltconform {model_spec.text!r}: no train_dataloader is defined on "
            f"{type(module).__qualname__}{where}, so there is nothing to train on. Define "
            f"train_dataloader (and val_dataloader) on the module, or pass the LightningDataModule "
            f"that provides them with --ltconform-datamodule pkg.mod.DataModule."
        )
    keys: tuple[str, ...] = ()
    if tr_spec is not None:
        kwargs = trainer_kwargs(tr_spec)
        trainer_cls = importlib.import_module(namespace).Trainer
        accepted = set(inspect.signature(trainer_cls.__init__).parameters) - {"self"}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TargetError(
                f"--ltconform-trainer {tr_spec.text!r}: {', '.join(unknown)} "
                f"{'is not a Trainer argument' if len(unknown) == 1 else 'are not Trainer arguments'} "
                f"of {namespace} (check the spelling against Trainer.__init__)."
            )
        keys = tuple(sorted(kwargs))
    return Targets(
        model=model_spec, datamodule=dm_spec, trainer=tr_spec, namespace=namespace,
        model_name=type(module).__qualname__, trainer_keys=keys,
        model_class=f"{type(module).__module__}:{type(module).__qualname__}",
        datamodule_class=f"{type(dm).__module__}:{type(dm).__qualname__}" if dm is not None else None,
    )
