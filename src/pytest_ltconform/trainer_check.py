"""Check a target's Trainer kwargs in the pytest process, at start, with Lightning's own rules.

A bad value would otherwise pass every item (``strategy=42`` fell back to DDP), crash pytest
(``max_epochs="ten"``) or stop every rank at run time, where it reads as the user's code failing.
The rules are Lightning's, read rather than copied: the types ``Trainer.__init__`` declares (its
``precision`` Literal is ``_PRECISION_INPUT``), the strategy registry, the accumulation rule of
``GradientAccumulationScheduler``, and a Trainer built on a cheap CPU config from the same kwargs.
Imported only once a target is validated (torch and Lightning are loaded by then).
"""

from __future__ import annotations

import collections.abc
import contextlib
import difflib
import importlib
import logging
import numbers
import typing
import warnings
from typing import Any

# What the plugin replaces in every run (harness.build_trainer_kwargs): the cheap Trainer built
# here gets its own values; their types are still checked. deterministic and benchmark set torch's
# process-wide flags when a Trainer is built, which this process must not inherit.
_REPLACED = {"accelerator": "cpu", "devices": 1, "strategy": "auto", "logger": False, "default_root_dir": None}
_NOT_BUILT = ("deterministic", "benchmark")
# Values that train on nothing: every contract would pass having compared nothing.
_TRAINS_NOTHING = {"limit_train_batches": "trains on no batch", "max_steps": "stops before the first step"}


_LOGGERS = ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric")


class TrainerKwargsError(ValueError):
    """A value Lightning refuses; the message names the key, the value and the fix."""


def check_values(kwargs: dict, namespace: str, where: str) -> None:
    """Refuse, naming ``where`` (the option or declaration), the key, the value and the fix, a
    Trainer kwarg that Lightning (``namespace``: 'lightning.pytorch' or 'pytorch_lightning')
    would refuse, or one that trains on nothing. Raises :class:`TrainerKwargsError`."""
    try:
        _check_namespace(kwargs, namespace)
        _check_types(kwargs, namespace)
        _check_strategy(kwargs.get("strategy", "auto"), namespace)
        _check_accumulation(kwargs.get("accumulate_grad_batches", 1), namespace)
        _check_trains_something(kwargs)
        _check_builds(kwargs, namespace)
    except TrainerKwargsError as exc:
        raise TrainerKwargsError(f"{where}: {exc}") from None


def _trainer_class(namespace: str) -> type:
    return importlib.import_module(namespace).Trainer


# Each namespace's module prefixes, in the same order: pytorch_lightning's Trainer takes the
# environments and plugins of lightning_fabric, lightning.pytorch's those of lightning.fabric.
_PREFIXES = {"lightning.pytorch": ("lightning.pytorch.", "lightning.fabric."),
             "pytorch_lightning": ("pytorch_lightning.", "lightning_fabric.")}


def _check_namespace(kwargs: dict, namespace: str) -> None:
    """Refuse a callback, strategy, logger or plugin of the other Lightning package than the
    module's: its Trainer rejects it."""
    other = next(ns for ns in _PREFIXES if ns != namespace)
    for key, value in kwargs.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            where = type(item).__module__ + "."
            prefix = next((p for p in _PREFIXES[other] if where.startswith(p)), None)
            if prefix is None:
                continue
            name = type(item).__name__
            twin = _PREFIXES[namespace][_PREFIXES[other].index(prefix)] + where[len(prefix):-1]
            raise TrainerKwargsError(
                f"{key}={_short(value)}: {name} comes from {where[:-1]}, of the {other} package, but the module "
                f"derives from {namespace}, whose Trainer (the one its items run) rejects objects of the other "
                f"package. Import {name} from {twin}, the package the module uses (or build the module on {other}).")


def _check_types(kwargs: dict, namespace: str) -> None:
    hints = typing.get_type_hints(_trainer_class(namespace).__init__)
    for key, value in kwargs.items():
        hint = hints.get(key)
        if hint is not None and not _fits(value, hint):
            raise TrainerKwargsError(
                f"{key}={_short(value)} is not what Trainer({key}=...) takes: {namespace}.Trainer declares "
                f"{_describe(hint)}. Give {key} such a value, or leave it out.")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the declared type ``hint``; True for a form this does not read."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (list, tuple, set, collections.abc.Iterable, collections.abc.Sequence):
        if not isinstance(value, origin) or isinstance(value, (str, bytes)):
            return False
        # Only concrete containers are walked: a generator would be used up.
        walk = args and isinstance(value, (list, tuple, set)) and origin is not tuple
        return not walk or all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is int:
        return isinstance(value, numbers.Integral)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint: Any, article: bool = True) -> str:
    """A declared type in words: ``an int or None``, ``a list of Callback``, ``one of 32, 'bf16-mixed'``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        literals = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
        rest = [_describe(a, article) for a in args if typing.get_origin(a) is not typing.Literal]
        words = ([f"one of {', '.join(map(repr, literals))}"] if literals else []) + rest
        none = [w for w in words if w == "None"]
        return " or ".join(dict.fromkeys([w for w in words if w != "None"] + none))
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = f" of {_describe(args[0], article=False)}" if args and origin is not dict else ""
        return f"{_a(name) if article else name}{inner}"
    name = getattr(hint, "__name__", str(hint))
    return _a(name) if article else name


def _a(name: str) -> str:
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _check_strategy(strategy: Any, namespace: str) -> None:
    """A name in Lightning's strategy registry (or 'auto'); an instance is checked by type."""
    if not isinstance(strategy, str):
        return
    registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
    names = registry.available_strategies()
    if strategy.lower() == "auto" or strategy.lower() in names:
        return
    close = difflib.get_close_matches(strategy.lower(), names, n=1)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    some = [n for n in ("ddp", "ddp_find_unused_parameters_true", "fsdp", "deepspeed_stage_2") if n in names]
    raise TrainerKwargsError(
        f"strategy={strategy!r} is not a strategy Lightning knows (its StrategyRegistry has no such name). "
        f"{hint}Give a registered name ({', '.join(some)}, ... {len(names)} in all) or a Strategy instance "
        f"such as DDPStrategy(...).")


def _check_accumulation(value: Any, namespace: str) -> None:
    if not isinstance(value, numbers.Integral):
        return  # the type check names it
    callbacks = importlib.import_module(f"{namespace}.callbacks")
    try:
        callbacks.GradientAccumulationScheduler({0: value})  # Lightning's rule for a factor
    except Exception as exc:
        raise TrainerKwargsError(
            f"accumulate_grad_batches={value!r}: Lightning refuses it as an accumulation factor ({exc}) and "
            f"its training loop divides by it. Use 1 for no accumulation, or the number of batches per "
            f"optimizer step.") from None


def _check_trains_something(kwargs: dict) -> None:
    for key, what in _TRAINS_NOTHING.items():
        value = kwargs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise TrainerKwargsError(
                f"{key}={value!r} {what}, so no contract could see a training step and every item would "
                f"pass having compared nothing. Leave it out (conformance runs bound batches and epochs "
                f"themselves), or give at least 1.")


def _check_builds(kwargs: dict, namespace: str) -> None:
    """Build a Trainer of ``namespace`` on CPU from ``kwargs`` (with the replaced keys replaced):
    Lightning's own checks of precision, num_nodes, callbacks, clipping and the rest. When it
    refuses, the key is found by building with each key alone."""
    error = _build(kwargs, namespace)
    if error is None:
        return
    culprit = next((k for k in kwargs if k not in _REPLACED and _build({k: kwargs[k]}, namespace)), None)
    said = f"{culprit}={_short(kwargs[culprit])}" if culprit else \
        f"these Trainer kwargs together ({', '.join(k for k in kwargs if k not in _REPLACED)})"
    raise TrainerKwargsError(
        f"Lightning refuses {said}: building a Trainer with it raised {error.rstrip('.')}. Fix the "
        f"{'value' if culprit else 'combination'}: every rank builds its Trainer from the same kwargs and would "
        f"stop there.")


def _build(kwargs: dict, namespace: str) -> str | None:
    """``Type: message`` of what building the Trainer raised, or None when it was built."""
    values = {k: (list(v) if isinstance(v, list) else v) for k, v in kwargs.items() if k not in _NOT_BUILT}
    values.update(_REPLACED)
    try:
        with _quiet(namespace):
            _trainer_class(namespace)(**values)
    except Exception as exc:
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"
    return None


@contextlib.contextmanager
def _quiet(namespace: str):
    """No 'GPU available' lines or rank-zero warnings from a Trainer nobody runs. Both packages'
    loggers: with both installed, one namespace's Trainer can log under the other's name."""
    loggers = [logging.getLogger(n) for n in dict.fromkeys((namespace, *_LOGGERS))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
