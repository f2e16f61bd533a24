"""Validating one target in this process: import it, build the module (with ``init``), the
datamodule and the Trainer kwargs, and check each against what Lightning accepts, before any rank
starts. :func:`validate` returns the :class:`~.spec.ResolvedTarget` that travels to the ranks, or
raises one :class:`~.spec.TargetError` paragraph naming the input and the fix.

Where it runs (a process forked from the launcher's parent, or pytest's own) is
``pytest_ltconform.validation``'s business.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pickle
import warnings
from typing import Any

from .. import releases
from .loading import defines, instantiate, namespace_of, short_repr, trainer_kwargs
from .spec import ObjectRef, ResolvedTarget, TargetError, parse


def _unpicklable(values: dict) -> list[str]:
    """The keys of ``values`` whose value does not pickle (it must travel to every rank)."""
    bad = []
    for key, value in values.items():
        try:
            pickle.dumps(value)
        except Exception:
            bad.append(str(key))
    return bad


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
    too_old = releases.unsupported(namespace)
    if too_old:
        raise TargetError(f"{model_spec.option} {model_spec.text!r} derives from {namespace}: {too_old}")
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
    from ..sites import is_user_file

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
    from .. import trainer_check

    try:
        trainer_check.check_values(kwargs, namespace, f"{where} (the Trainer kwargs of {model!r})")
    except trainer_check.TrainerKwargsError as exc:
        raise TargetError(str(exc)) from None
    return tuple(sorted(kwargs))


def _check_plain_dict(values: Any, where: str, what: str) -> None:
    """A dict with string keys whose values pickle: it travels to every rank."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise TargetError(f"{where}: expected a dict of {what} with string keys, got {short_repr(values)}.")
    bad = _unpicklable(values)
    if bad:
        raise TargetError(
            f"{where}: the value of {', '.join(map(repr, bad))} does not pickle, and every rank receives the "
            f"{what} pickled. Use plain values, or a target string naming a zero-argument callable that "
            f"builds them inside each rank."
        )
