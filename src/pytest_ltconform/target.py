"""Turn the strings users pass (``pkg.mod.Class``, ``pkg.mod:factory``, ``path/to/file.py:Name``)
into validated, picklable target specs.

A :class:`Target` is what a user declares (``pytest_ltconform.Target`` in ``conftest.py``, or one
``--ltconform`` value); an :class:`ObjectRef` is plain data: it travels to every rank, which loads
the object again with :func:`load_object`. :func:`validate` runs in the pytest process and turns
every way a target can be wrong into one :class:`TargetError` paragraph that names the input and
the fix.

No torch or lightning import at module level: ``pytest_ltconform.Target`` is imported by conftest
files of sessions that never start a world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import re
import sys
import sysconfig
import traceback
import warnings
from typing import Any

from . import tripwire, user_modules  # tripwire: Trainer.fit at import time trips instead of training

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


class TargetError(Exception):
    """A target string that cannot be used; the message is one paragraph with the fix."""


class Target:
    """A declaration: one target to check, as declared by ``pytest_ltconform_targets(config)`` in
    ``conftest.py`` (or parsed from one ``--ltconform`` value / ``ltconform_target`` line).

    ``model``: the LightningModule target string (``pkg.mod.Class``, ``pkg.mod:factory`` or
    ``path/to/file.py:Name``). ``datamodule``: a LightningDataModule target string, or None (then
    ``--ltconform-datamodule`` applies). ``trainer``: a Trainer-kwargs target string or a plain dict
    of Trainer kwargs, or None (then ``--ltconform-trainer`` applies). ``init``: keyword arguments
    for the module's constructor (every rank builds ``Class(**init)``, so they must pickle).
    ``id``: the name in item ids (``ltconform::<id>::<contract>[...]``); default: the target as
    written (:attr:`written`).

    Nothing is imported or checked here; :func:`validate` does that at start-up and raises
    :class:`TargetError`.
    """

    __slots__ = ("model", "datamodule", "trainer", "init", "_id", "source")

    def __init__(self, model: str, *, datamodule: str | None = None, trainer: str | dict | None = None,
                 init: dict | None = None, id: str | None = None):
        self.model = model
        self.datamodule = datamodule
        self.trainer = trainer
        self.init = init
        self._id = id
        # Where it was declared, for messages: the caller's file:line (the plugin overwrites it
        # with the option or ini key for targets it parsed).
        caller = sys._getframe(1)
        self.source = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    @property
    def written(self) -> str:
        """The target in the ``--ltconform`` form: ``MODEL [datamodule=DM] [trainer=TR]`` (a trainer
        dict and ``init`` have no written form)."""
        parts = [str(self.model)]
        if isinstance(self.datamodule, str):
            parts.append(f"datamodule={self.datamodule}")
        if isinstance(self.trainer, str):
            parts.append(f"trainer={self.trainer}")
        return " ".join(parts)

    @property
    def id(self) -> str:
        return self._id if self._id is not None else self.written

    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("datamodule", "trainer", "init")
                        if getattr(self, k) is not None)
        given = f", id={self._id!r}" if self._id is not None else ""
        return f"Target({self.model!r}{extra}{given})"


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    """A reference to one user object: where to find it.

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


def parse(text: str, option: str) -> ObjectRef:
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
        return ObjectRef(text=text, option=option, module=module, attr=attr, path=path)
    if sep:
        if not file_part or not attr:
            raise TargetError(f"{option} {text!r}: expected pkg.mod:factory with both parts present.")
        return ObjectRef(text=text, option=option, module=file_part, attr=attr)
    module, dot, attr = text.rpartition(".")
    if not dot or not module:
        raise TargetError(
            f"{option} {text!r}: a bare name cannot be imported. Use pkg.mod.Class, pkg.mod:factory "
            f"or path/to/file.py:Name."
        )
    return ObjectRef(text=text, option=option, module=module, attr=attr)


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
        f"{spec.option} {spec.text!r}: init={_short(init)} does not fit {name}{sig}: {'; '.join(problems)}. "
        f"Use the constructor's parameter names in init."
    )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _unpicklable(values: dict) -> list[str]:
    """The keys of ``values`` whose value does not pickle (it must travel to every rank)."""
    bad = []
    for key, value in values.items():
        try:
            pickle.dumps(value)
        except Exception:
            bad.append(str(key))
    return bad


def trainer_kwargs(spec: ObjectRef) -> dict:
    """Load a Trainer-kwargs target: a dict or a zero-argument callable returning one."""
    from .sharded import deepspeed_stand_in

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


@dataclasses.dataclass(frozen=True)
class ResolvedTarget:
    """A resolved target: one :class:`Target` validated, with its module, optional datamodule and
    trainer kwargs (each an :class:`ObjectRef`, or ``trainer_dict`` for a dict given to
    :class:`Target`), the constructor's ``init`` and the ``id`` its items carry. What the
    ``ltconform_target`` fixture returns (``pytest_ltconform.ResolvedTarget``)."""

    model: ObjectRef
    datamodule: ObjectRef | None
    trainer: ObjectRef | None
    namespace: str
    model_name: str
    trainer_keys: tuple[str, ...] = ()
    # "module:qualname" of the classes the targets built, for pointing evidence at their source.
    model_class: str | None = None
    datamodule_class: str | None = None
    id: str | None = None
    init: dict | None = None
    trainer_dict: dict | None = None
    declared_at: str | None = None  # "file:line" of a Target() declared in conftest.py
    # The configured strategy: its class and base class names, or the string given, lower-cased.
    strategy_names: tuple[str, ...] = ()
    # Where the module's class is defined (absolute path, 1-based line): the items' location.
    model_source: tuple[str, int] | None = None
    # The user's classes in the module's (and the datamodule's) MRO, most derived first, as
    # (class name, absolute source path): evidence points into them without importing the
    # user's code in pytest's process (the target is validated in another).
    model_classes: tuple[tuple[str, str], ...] = ()
    datamodule_classes: tuple[tuple[str, str], ...] = ()

    def configures(self, strategy: str) -> bool:
        """Whether the Trainer config names ``strategy`` (a vocabulary id such as 'deepspeed'):
        a string such as 'deepspeed_stage_3', or a strategy object of a class such as
        DeepSpeedStrategy or a subclass of it."""
        return any(name.startswith(strategy) for name in self.strategy_names)

    @property
    def label(self) -> str:
        """The id, or the module's target text when there is none."""
        return self.id or self.model.text


# The names before 0.2, kept for code written against them.
TargetSpec = ObjectRef
Targets = ResolvedTarget


def user_trainer_kwargs(targets: ResolvedTarget) -> dict:
    """The user's Trainer kwargs of ``targets`` (a copy): the dict given to :class:`Target`, what
    the trainer target returns, or ``{}``. Raises :class:`TargetError` for a bad trainer target."""
    if targets.trainer_dict is not None:
        return dict(targets.trainer_dict)
    return trainer_kwargs(targets.trainer) if targets.trainer else {}


DEFAULT_OPTIONS = ("--ltconform", "--ltconform-datamodule", "--ltconform-trainer")


def validate(model: str, datamodule: str | None = None, trainer: str | dict | None = None, *,
             init: dict | None = None, id: str | None = None, declared_at: str | None = None,
             options: tuple[str, str, str] = DEFAULT_OPTIONS) -> ResolvedTarget:
    """Resolve and check one target in this process: import it, build the module (with ``init``),
    the datamodule, and the Trainer kwargs (``trainer`` a target string or a dict). ``options``
    name where the model, datamodule and trainer came from, for messages. Raises
    :class:`TargetError` (one paragraph naming the input and the fix)."""
    model_spec = parse(model, options[0])
    dm_spec = parse(datamodule, options[1]) if datamodule else None
    tr_spec = parse(trainer, options[2]) if isinstance(trainer, str) and trainer else None
    if init is not None:
        _check_plain_dict(init, f"{options[0]} {model_spec.text!r}: init", "constructor arguments")
    module = instantiate(model_spec, "LightningModule", "LightningModule", init)
    namespace = namespace_of(type(module))
    dm = None
    if dm_spec is not None:
        dm = instantiate(dm_spec, "LightningDataModule", "LightningDataModule")
        dm_ns = namespace_of(type(dm), "LightningDataModule")
        if dm_ns != namespace:
            raise TargetError(
                f"{dm_spec.option} {dm_spec.text!r} derives from {dm_ns} but the module "
                f"{model_spec.text!r} from {namespace}: a Trainer of one namespace rejects objects of "
                f"the other. Use the same Lightning package for both."
            )
    if not defines(module, "train_dataloader", namespace) and not (
        dm is not None and defines(dm, "train_dataloader", namespace)
    ):
        where = f" or {dm_spec.text}" if dm_spec else ""
        raise TargetError(
            f"{model_spec.option} {model_spec.text!r}: no train_dataloader is defined on "
            f"{type(module).__qualname__}{where}, so there is nothing to train on. Define "
            f"train_dataloader (and val_dataloader) on the module, or pass the LightningDataModule "
            f"that provides them with --ltconform-datamodule pkg.mod.DataModule."
        )
    _check_train_batches(module, dm if dm is not None and defines(dm, "train_dataloader", namespace) else None,
                         model_spec)
    trainer_dict = dict(trainer) if isinstance(trainer, dict) else None
    keys: tuple[str, ...] = ()
    kwargs: dict = {}
    if tr_spec is not None or trainer_dict is not None:
        where = f"{tr_spec.option} {tr_spec.text!r}" if tr_spec else options[2]
        kwargs = trainer_kwargs(tr_spec) if tr_spec else trainer_dict
        if trainer_dict is not None:
            _check_plain_dict(trainer_dict, where, "Trainer kwargs")
        keys = _check_trainer_keys(kwargs, namespace, where, model_spec.text)
    return ResolvedTarget(
        model=model_spec, datamodule=dm_spec, trainer=tr_spec, namespace=namespace,
        model_name=type(module).__qualname__, trainer_keys=keys,
        model_class=f"{type(module).__module__}:{type(module).__qualname__}",
        datamodule_class=f"{type(dm).__module__}:{type(dm).__qualname__}" if dm is not None else None,
        id=id, init=dict(init) if init is not None else None, trainer_dict=trainer_dict, declared_at=declared_at,
        strategy_names=_strategy_names(kwargs.get("strategy")),
        model_source=_source_of(type(module)),
        model_classes=user_classes_of(type(module)),
        datamodule_classes=user_classes_of(type(dm)) if dm is not None else (),
    )


def _check_train_batches(module: Any, dm: Any, spec: ObjectRef) -> None:
    """Refuse a training DataLoader with no batches: Lightning then skips training with a warning,
    and every contract would pass having compared nothing. Only a loader that ``train_dataloader``
    returns here, before any ``setup`` or Trainer, is measured; one that needs them is left to the
    ranks."""
    from torch.utils.data import DataLoader

    owner = dm if dm is not None else module
    try:
        with contextlib.redirect_stdout(None), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = owner.train_dataloader()
        empty = isinstance(loader, DataLoader) and len(loader) == 0
    except Exception:
        return  # it needs setup() or a Trainer: the ranks call it and report what it raises
    if not empty:
        return
    dataset = loader.dataset
    size = f"{len(dataset)} sample(s)" if hasattr(dataset, "__len__") else "no samples"
    drop = ", drop_last=True" if loader.drop_last else ""
    raise TargetError(
        f"{spec.option} {spec.text!r}: {type(owner).__qualname__}.train_dataloader() returned an empty "
        f"DataLoader ({size}, batch_size={loader.batch_size}{drop}), so no training step would run and every "
        f"contract would pass having compared nothing. Give it at least one batch per rank.")


def user_classes_of(klass: type) -> tuple[tuple[str, str], ...]:
    """(class name, absolute source path) of each class in ``klass``'s MRO defined in user code
    (see ``sites.is_user_file``), most derived first."""
    from .sites import is_user_file

    found = []
    for base in getattr(klass, "__mro__", ()):
        try:
            path = inspect.getsourcefile(base)
        except TypeError:
            continue
        if path and is_user_file(path):
            found.append((base.__name__, os.path.abspath(path)))
    return tuple(found)


def _source_of(klass: type) -> tuple[str, int] | None:
    try:
        return os.path.abspath(inspect.getsourcefile(klass) or ""), inspect.getsourcelines(klass)[1]
    except (OSError, TypeError):
        return None  # defined in a notebook cell or built by type(): no file to name


def _strategy_names(strategy: Any) -> tuple[str, ...]:
    if strategy is None:
        return ()
    if isinstance(strategy, str):
        return (strategy.lower(),)
    return tuple(k.__name__.lower() for k in type(strategy).__mro__ if k is not object)


def _check_trainer_keys(kwargs: dict, namespace: str, where: str, model: str) -> tuple[str, ...]:
    """The sorted keys of ``kwargs`` once each is a Trainer argument whose value Lightning accepts
    (see :mod:`.trainer_check`); raises :class:`TargetError` naming ``where``, the target
    ``model``, the key, the value and the fix."""
    trainer_cls = importlib.import_module(namespace).Trainer
    accepted = set(inspect.signature(trainer_cls.__init__).parameters) - {"self"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        import difflib

        hints = [f"{close[0]!r} for {k!r}" for k in unknown
                 if (close := difflib.get_close_matches(k, sorted(accepted), n=1, cutoff=0.75))]
        raise TargetError(
            f"{where}: {', '.join(unknown)} "
            f"{'is not a Trainer argument' if len(unknown) == 1 else 'are not Trainer arguments'} "
            f"of {namespace}" + (f"; did you mean {', '.join(hints)}?" if hints else
                                 " (check the spelling against Trainer.__init__).")
        )
    from . import trainer_check

    try:
        trainer_check.check_values(kwargs, namespace, f"{where} (the Trainer kwargs of {model!r})")
    except trainer_check.TrainerKwargsError as exc:
        raise TargetError(str(exc)) from None
    return tuple(sorted(kwargs))


def _check_plain_dict(values: Any, where: str, what: str) -> None:
    """A dict with string keys whose values pickle: it travels to every rank."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise TargetError(f"{where}: expected a dict of {what} with string keys, got {_short(values)}.")
    bad = _unpicklable(values)
    if bad:
        raise TargetError(
            f"{where}: the value of {', '.join(map(repr, bad))} does not pickle, and every rank receives the "
            f"{what} pickled. Use plain values, or a target string naming a zero-argument callable that "
            f"builds them inside each rank."
        )


@contextlib.contextmanager
def own_imports():
    """Forget, on exit, the user modules imported and the ``sys.path`` entries added inside: the
    next target of the session imports its own ``model.py`` or ``utils.py``, not this one's.
    Installed packages, the standard library and this plugin stay loaded; a later import of the
    same file gets the module back (see :mod:`.user_modules`)."""
    before = set(sys.modules)
    path = list(sys.path)
    keep = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
                                               os.path.dirname(os.path.realpath(__file__))})
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
