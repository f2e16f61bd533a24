"""What a target is, before anything of it is imported: the strings users pass
(``pkg.mod.Class``, ``pkg.mod:factory``, ``path/to/file.py:Name``) parsed into plain data.

A :class:`Target` is what a user declares (``pytest_ltconform.Target`` in ``conftest.py``, or one
``--ltconform`` value); an :class:`ObjectRef` is plain data: it travels to every rank, which loads
the object again (``target.loading``). A :class:`ResolvedTarget` is one target once
``target.validation`` checked it; every way a target can be wrong is one :class:`TargetError`
paragraph that names the input and the fix.

No torch or lightning import, and no import of the user's code: ``pytest_ltconform.Target`` is
imported by conftest files of sessions that never start a world.
"""

from __future__ import annotations

import dataclasses
import os
import sys

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
