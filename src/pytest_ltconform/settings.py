"""One resolver for every ltconform setting: command line first, then the ini file.

Nothing here imports torch or lightning: the plugin reads settings at start-up of every pytest
session, including sessions that never use ``--ltconform``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from .vocabulary import STRATEGIES, TIERS

# Option names are constants so tests and other plugins can refer to them.
OPT_TARGET = "ltconform"
OPT_DATAMODULE = "ltconform_datamodule"
OPT_TRAINER = "ltconform_trainer"
OPT_WORLD_SIZE = "ltconform_world_size"
OPT_TIMEOUT = "ltconform_timeout"
OPT_REPORT = "ltconform_report"
OPT_REQUIRE = "ltconform_require"
OPT_STRATEGIES = "ltconform_strategies"

INI_TARGET = "ltconform_target"


DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved configuration of one ltconform session.

    ``timeout_s`` is the wall-clock limit of one contract run (seconds); ``pg_timeout_s`` is the
    collective timeout given to the ranks' process group, kept below it so that most hangs
    surface as rank errors before the supervisor has to kill the world.
    """

    target: str | None
    datamodule: str | None = None
    trainer: str | None = None
    world_size: int = DEFAULT_WORLD_SIZE
    timeout_s: float = DEFAULT_TIMEOUT_S
    report: str | None = None
    require: tuple[str, ...] = ()
    strategies: tuple[str, ...] = STRATEGIES

    @property
    def enabled(self) -> bool:
        return bool(self.target)

    @property
    def pg_timeout_s(self) -> float:
        return pg_timeout_for(self.timeout_s)


def pg_timeout_for(timeout_s: float) -> float:
    """The process-group (collective) timeout, in seconds, for runs limited to ``timeout_s``: a
    quarter of it, between 5 and 60 s."""
    return max(5.0, min(timeout_s / 4.0, 60.0))


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ltconform", "distributed-training conformance (pytest-ltconform)")
    group.addoption(
        "--ltconform", dest=OPT_TARGET, metavar="TARGET", default=None,
        help="LightningModule to check: pkg.mod.Class, pkg.mod:factory or path/to/file.py:Name "
             "(ini: ltconform_target).",
    )
    group.addoption(
        "--ltconform-datamodule", dest=OPT_DATAMODULE, metavar="TARGET", default=None,
        help="LightningDataModule class or zero-argument factory, same forms as --ltconform "
             "(ini: ltconform_datamodule).",
    )
    group.addoption(
        "--ltconform-trainer", dest=OPT_TRAINER, metavar="TARGET", default=None,
        help="a dict, or a zero-argument callable returning one, of production Trainer kwargs "
             "(strategy, callbacks, accumulate_grad_batches, ...) (ini: ltconform_trainer).",
    )
    group.addoption(
        "--ltconform-world-size", dest=OPT_WORLD_SIZE, metavar="N", default=None,
        help=f"ranks per local world (default {DEFAULT_WORLD_SIZE}; ini: ltconform_world_size).",
    )
    group.addoption(
        "--ltconform-timeout", dest=OPT_TIMEOUT, metavar="SECONDS", default=None,
        help=f"wall-clock limit of one contract run; a world still running then is diagnosed and "
             f"killed (default {DEFAULT_TIMEOUT_S:g}; ini: ltconform_timeout).",
    )
    group.addoption(
        "--ltconform-report", dest=OPT_REPORT, metavar="PATH", default=None,
        help="write the verdicts as JSON to PATH (ini: ltconform_report).",
    )
    group.addoption(
        "--ltconform-require", dest=OPT_REQUIRE, metavar="TIER", default=None,
        help=f"comma-separated tiers ({', '.join(TIERS)}) whose missing hardware fails the "
             f"items instead of skipping them (ini: ltconform_require).",
    )
    group.addoption(
        "--ltconform-strategies", dest=OPT_STRATEGIES, metavar="LIST", default=None,
        help=f"comma-separated strategies to check ({', '.join(STRATEGIES)}; default all; "
             f"ini: ltconform_strategies).",
    )
    parser.addini(INI_TARGET, "LightningModule to check (as --ltconform)", default=None)
    parser.addini(OPT_DATAMODULE, "LightningDataModule (as --ltconform-datamodule)", default=None)
    parser.addini(OPT_TRAINER, "Trainer kwargs target (as --ltconform-trainer)", default=None)
    parser.addini(OPT_WORLD_SIZE, "ranks per local world (as --ltconform-world-size)", default=None)
    parser.addini(OPT_TIMEOUT, "seconds per contract run (as --ltconform-timeout)", default=None)
    parser.addini(OPT_REPORT, "JSON report path (as --ltconform-report)", default=None)
    parser.addini(OPT_REQUIRE, "tiers that must not skip (as --ltconform-require)", default=None)
    parser.addini(OPT_STRATEGIES, "strategies to check (as --ltconform-strategies)", default=None)


def _lookup(config: pytest.Config, dest: str, ini: str | None = None) -> tuple[str | None, str]:
    """Return (raw value, where it came from); the command line wins over the ini file."""
    value = config.getoption(dest)
    flag = "--" + dest.replace("_", "-")
    if value not in (None, ""):
        return str(value), flag
    ini = ini or dest
    value = config.getini(ini)
    if value not in (None, ""):
        return str(value).strip(), f"ini option {ini!r} in {config.inipath or 'the ini file'}"
    return None, flag


def _validate_positive_int(raw: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected a whole number of ranks, got {raw!r}.") from None
    if value < 1:
        raise pytest.UsageError(f"{where}: the world size must be at least 1, got {value}.")
    return value


def _validate_seconds(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected a number of seconds, got {raw!r}.") from None
    if value <= 0:
        raise pytest.UsageError(f"{where}: the timeout must be positive, got {raw!r}.")
    return value


def _validate_choices(raw: str, where: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(v.strip().lower() for v in raw.split(",") if v.strip())
    unknown = [v for v in values if v not in choices]
    if unknown:
        raise pytest.UsageError(
            f"{where}: unknown value(s) {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}."
        )
    return values


def resolve(config: pytest.Config) -> Settings:
    """Read every ltconform setting from ``config``.

    Raises ``pytest.UsageError`` naming the option (or ini key) that holds a bad value.
    """
    target, _ = _lookup(config, OPT_TARGET, INI_TARGET)
    datamodule, _ = _lookup(config, OPT_DATAMODULE)
    trainer, _ = _lookup(config, OPT_TRAINER)
    kwargs: dict = {}
    raw, where = _lookup(config, OPT_WORLD_SIZE)
    if raw is not None:
        kwargs["world_size"] = _validate_positive_int(raw, where)
    raw, where = _lookup(config, OPT_TIMEOUT)
    if raw is not None:
        kwargs["timeout_s"] = _validate_seconds(raw, where)
    raw, where = _lookup(config, OPT_REPORT)
    if raw is not None:
        kwargs["report"] = os.path.abspath(raw)
    raw, where = _lookup(config, OPT_REQUIRE)
    if raw is not None:
        kwargs["require"] = _validate_choices(raw, where, TIERS)
    raw, where = _lookup(config, OPT_STRATEGIES)
    if raw is not None:
        kwargs["strategies"] = _validate_choices(raw, where, STRATEGIES)
    return Settings(target=target, datamodule=datamodule, trainer=trainer, **kwargs)
