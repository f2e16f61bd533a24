"""One resolver for every ltconform setting: command line first, then the ini file.

Nothing here imports torch or lightning: the plugin reads settings at start-up of every pytest
session, including sessions that never use ``--ltconform``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile

import pytest

from .vocabulary import BASE_SEED, LAUNCHERS, SEEDINGS, STRATEGIES, TIERS
from .world.layout import Layout

# Option names are constants so tests and other plugins can refer to them.
OPT_TARGET = "ltconform"
OPT_DATAMODULE = "ltconform_datamodule"
OPT_TRAINER = "ltconform_trainer"
OPT_WORLD_SIZE = "ltconform_world_size"
OPT_TIMEOUT = "ltconform_timeout"
OPT_REPORT = "ltconform_report"
OPT_REQUIRE = "ltconform_require"
OPT_STRATEGIES = "ltconform_strategies"
OPT_OVERSUBSCRIBE = "ltconform_oversubscribe"
OPT_EXPLAIN = "ltconform_explain"
OPT_DEVICE_MEMORY = "ltconform_device_memory"
OPT_LAUNCHER = "ltconform_launcher"
OPT_SEEDING = "ltconform_seeding"
OPT_NODES = "ltconform_nodes"

INI_TARGET = "ltconform_target"
# Every ini key of the plugin (the others share their option's dest).
INI_NAMES = (INI_TARGET, OPT_DATAMODULE, OPT_TRAINER, OPT_WORLD_SIZE, OPT_TIMEOUT, OPT_REPORT, OPT_REQUIRE,
             OPT_STRATEGIES, OPT_OVERSUBSCRIBE, OPT_DEVICE_MEMORY, OPT_LAUNCHER, OPT_SEEDING, OPT_NODES)


DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 120.0
# The shortest run limit accepted: a traced fit in a started world takes several seconds on a small
# machine, and the ranks' collective timeout is at least 5 s (see pg_timeout_for).
MIN_TIMEOUT_S = 10.0
# What one rank holds once torch and Lightning are imported (MB): the memory check's estimate.
RANK_MEMORY_MB = 600
# The nodes tier's worlds: this many nodes, of one rank each on a small machine, two where it has the
# cores for both worlds' ranks (see default_nodes).
DEFAULT_NODES = 2


def default_nodes(cpus: int | None = None) -> Layout:
    """The nodes tier's layout when ``--ltconform-nodes`` is not given: 2 nodes x 1 rank, or 2 x 2
    on a machine with 4 CPUs or more (a local rank other than 0 shows only then)."""
    cpus = cpu_count() if cpus is None else cpus
    return Layout(DEFAULT_NODES, 2 if cpus >= 4 else 1)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved configuration of one ltconform session.

    ``timeout_s`` is the wall-clock limit of one contract run (seconds); ``pg_timeout_s`` is the
    collective timeout given to the ranks' process group, kept below it so that most hangs
    surface as rank errors before the supervisor has to kill the world.
    """

    target: str | None  # the first target's module text (what old readers of the report expect)
    datamodule: str | None = None
    trainer: str | None = None
    world_size: int = DEFAULT_WORLD_SIZE
    timeout_s: float = DEFAULT_TIMEOUT_S
    report: str | None = None
    require: tuple[str, ...] = ()
    strategies: tuple[str, ...] = STRATEGIES
    oversubscribe: bool = False
    world_size_from: str | None = None  # where world_size came from; None: the default
    # Every target of the session (target.Target, as declared), in order: the command line's
    # --ltconform values (or the ini list), then those of pytest_ltconform_targets hooks;
    # validate_args gives each the session-wide datamodule/trainer where it names none.
    targets: tuple = ()
    datamodule_from: str = "--ltconform-datamodule"
    trainer_from: str = "--ltconform-trainer"
    # The strategies given explicitly (command line or ini); () when the default, all, applies.
    strategies_named: tuple[str, ...] = ()
    # The memory of one device in bytes (--ltconform-device-memory); None: not stated.
    device_memory: int | None = None
    device_memory_from: str | None = None
    # How local worlds start their ranks: 'fork' (from a parent that imported Lightning once) or 'spawn'.
    launcher: str = LAUNCHERS[0]
    # How the ranks' generators are seeded (vocabulary.SEEDINGS), and the seed they start from.
    seeding: str = SEEDINGS[0]
    seed: int = BASE_SEED
    # The nodes tier's layout (--ltconform-nodes): nodes x ranks per node; None: no such tier (1 node).
    nodes: Layout | None = dataclasses.field(default_factory=lambda: default_nodes())
    nodes_from: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.targets or self.target)

    @property
    def pg_timeout_s(self) -> float:
        return pg_timeout_for(self.timeout_s)


def pg_timeout_for(timeout_s: float) -> float:
    """The process-group (collective) timeout, in seconds, for runs limited to ``timeout_s``: a
    quarter of it, between 5 and 60 s."""
    return max(5.0, min(timeout_s / 4.0, 60.0))


def add_options(parser: pytest.Parser) -> None:
    _add_target_options(parser)
    _add_launcher_option(parser, parser.getgroup("ltconform"))
    _add_seeding_option(parser, parser.getgroup("ltconform"))
    _add_nodes_option(parser, parser.getgroup("ltconform"))


def _add_target_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ltconform", "distributed-training conformance (pytest-ltconform)")
    group.addoption(
        "--ltconform", dest=OPT_TARGET, metavar="TARGET", default=None, action="append",
        help="LightningModule to check: pkg.mod.Class, pkg.mod:factory or path/to/file.py:Name, then optionally "
             "datamodule=TARGET trainer=TARGET id=NAME (quote it); repeat for more (ini: ltconform_target, a list).",
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
        help=f"ranks per local world (default {DEFAULT_WORLD_SIZE}; ini: ltconform_world_size); more than the "
             f"CPUs, or than the available memory holds, is refused unless --ltconform-oversubscribe.",
    )
    group.addoption(
        "--ltconform-timeout", dest=OPT_TIMEOUT, metavar="SECONDS", default=None,
        help=f"wall-clock limit of one contract run; a world still running then is diagnosed and "
             f"killed (default {DEFAULT_TIMEOUT_S:g}, at least {MIN_TIMEOUT_S:g}; ini: ltconform_timeout).",
    )
    group.addoption(
        "--ltconform-report", dest=OPT_REPORT, metavar="PATH", default=None,
        help="write the verdicts as JSON to PATH (ini: ltconform_report).",
    )
    group.addoption(
        "--ltconform-require", dest=OPT_REQUIRE, metavar="TIER", default=None,
        help=f"comma-separated tiers ({', '.join(TIERS)}) that must run: their items are always "
             f"created, and fail where the tier cannot run here (ini: ltconform_require).",
    )
    group.addoption(
        "--ltconform-strategies", dest=OPT_STRATEGIES, metavar="LIST", default=None,
        help=f"comma-separated strategies to check ({', '.join(STRATEGIES)}; default all; "
             f"ini: ltconform_strategies).",
    )
    group.addoption(
        "--ltconform-oversubscribe", dest=OPT_OVERSUBSCRIBE, action="store_true", default=None,
        help="start worlds with more ranks than this machine has CPUs, or than its available memory "
             "holds (ini: ltconform_oversubscribe).",
    )
    group.addoption(
        "--ltconform-explain", dest=OPT_EXPLAIN, metavar="CONTRACT", default=None,
        help="print the rule page of CONTRACT (e.g. sync-dist) and exit.",
    )
    parser.addini(INI_TARGET, "LightningModules to check, one per line (as --ltconform)", type="linelist")
    parser.addini(OPT_DATAMODULE, "LightningDataModule (as --ltconform-datamodule)", default=None)
    parser.addini(OPT_TRAINER, "Trainer kwargs target (as --ltconform-trainer)", default=None)
    parser.addini(OPT_WORLD_SIZE, "ranks per local world (as --ltconform-world-size)", default=None)
    parser.addini(OPT_TIMEOUT, "seconds per contract run (as --ltconform-timeout)", default=None)
    parser.addini(OPT_REPORT, "JSON report path (as --ltconform-report)", default=None)
    parser.addini(OPT_REQUIRE, "tiers that must run here (as --ltconform-require)", default=None)
    parser.addini(OPT_STRATEGIES, "strategies to check (as --ltconform-strategies)", default=None)
    parser.addini(OPT_OVERSUBSCRIBE, "allow more ranks than CPUs or memory (as --ltconform-oversubscribe)",
                  type="bool", default=False)


def add_device_memory_option(parser: pytest.Parser) -> None:
    """The memory contract's device size (``--ltconform-device-memory`` and its ini twin)."""
    parser.getgroup("ltconform").addoption(
        "--ltconform-device-memory", dest=OPT_DEVICE_MEMORY, metavar="SIZE", default=None,
        help="memory of one production device, e.g. 80GiB or 24GB: the memory contract fails when the configured "
             "strategy's step does not fit it (ini: ltconform_device_memory).",
    )
    parser.addini(OPT_DEVICE_MEMORY, "memory of one production device (as --ltconform-device-memory)", default=None)
def _add_nodes_option(parser: pytest.Parser, group) -> None:
    group.addoption(
        "--ltconform-nodes", dest=OPT_NODES, metavar="N[xM]", default=None,
        help="the layout of the local worlds of several nodes on this host (the [ddp-2nodes] items): N nodes of M "
             "ranks each (default 2 x 1, or 2 x 2 with 4 CPUs or more); 1 starts none (ini: ltconform_nodes).",
    )
    parser.addini(OPT_NODES, "nodes of the local multi-node worlds (as --ltconform-nodes)", default=None)


def _add_launcher_option(parser: pytest.Parser, group) -> None:
    group.addoption(
        "--ltconform-launcher", dest=OPT_LAUNCHER, metavar="HOW", default=None,
        help=f"how local worlds start their ranks: {LAUNCHERS[0]} (default: forked from one parent that imported "
             f"torch and Lightning once) or {LAUNCHERS[1]} (a fresh interpreter per rank; ini: ltconform_launcher).",
    )
    parser.addini(OPT_LAUNCHER, "how local worlds start their ranks (as --ltconform-launcher)", default=None)


def _add_seeding_option(parser: pytest.Parser, group) -> None:
    group.addoption(
        "--ltconform-seeding", dest=OPT_SEEDING, metavar="HOW", default=None,
        help="how the ranks' random generators are seeded, as your launch script would: both (default: each rank "
             "its own seed until training starts, so that a split or subset drawn per rank shows, then one seed on "
             "every rank, so that noise drawn alike shows), same (every rank one seed, as after seed_everything) or "
             "per-rank (each rank its own, as processes a launcher starts unseeded); ini: ltconform_seeding.",
    )
    parser.addini(OPT_SEEDING, "how the ranks' random generators are seeded (as --ltconform-seeding)", default=None)


def _validate_seeding(raw: str, where: str) -> str:
    value = raw.strip().lower()
    if value not in SEEDINGS:
        raise pytest.UsageError(f"{where}: unknown seeding {raw!r}; choose from {', '.join(SEEDINGS)} ({SEEDINGS[0]}, "
                                f"the default, judges draws that must agree across ranks under per-rank seeds and "
                                f"noise that must differ under one seed; same models a script that calls "
                                f"seed_everything, per-rank one that seeds nothing).")
    return value


def _lookup(config: pytest.Config, dest: str, ini: str | None = None) -> tuple[str | None, str]:
    """Return (raw value, where it came from); the command line wins over the ini file. An empty
    value on the command line is refused: it would otherwise fall back to the ini file or the
    default, which is not what the user wrote."""
    value = config.getoption(dest)
    flag = "--" + dest.replace("_", "-")
    if isinstance(value, str) and not value.strip():
        raise pytest.UsageError(f"{flag}: empty value {value!r}. {_EMPTY_FIX.get(dest, 'Give a value')}, or leave "
                                f"the option out for its default.")
    if value is not None:
        return str(value), flag
    ini = ini or dest
    value = config.getini(ini)
    if value not in (None, ""):
        return str(value).strip(), _ini_source(config, ini)
    return None, flag


def _ini_source(config: pytest.Config, ini: str) -> str:
    """Where an ini value came from: ``-o``/``--override-ini`` wins over the file, so name it."""
    overrides = getattr(config.option, "override_ini", None) or []
    if any(o.split("=", 1)[0].strip() == ini for o in overrides):
        return f"-o {ini}=..."
    return f"ini option {ini!r} in {config.inipath or 'the ini file'}"


# What to give instead of an empty command-line value.
_EMPTY_FIX = {
    OPT_STRATEGIES: f"Name one or more of {', '.join(STRATEGIES)} (comma-separated)",
    OPT_REQUIRE: f"Name one or more of {', '.join(TIERS)} (comma-separated)",
    OPT_WORLD_SIZE: f"Give a number of ranks, 2 or more (default {DEFAULT_WORLD_SIZE})",
    OPT_TIMEOUT: f"Give seconds, at least {MIN_TIMEOUT_S:g} (default {DEFAULT_TIMEOUT_S:g})",
    OPT_REPORT: "Give the path of the JSON file to write",
    OPT_DATAMODULE: "Name a LightningDataModule (pkg.mod.DataModule, pkg.mod:factory or path/to/file.py:Name)",
    OPT_TRAINER: "Name a dict of Trainer kwargs or a zero-argument callable returning one (pkg.mod:kwargs)",
    OPT_DEVICE_MEMORY: "Give the memory of one device with its unit, e.g. 80GiB",
    OPT_LAUNCHER: f"Name one of {', '.join(LAUNCHERS)}",
    OPT_SEEDING: f"Name one of {', '.join(SEEDINGS)}",
    OPT_NODES: f"Give a number of nodes, or NODESxRANKS (default {DEFAULT_NODES}; 1 starts no world of several nodes)",
}


def _validate_world_size(raw: str, where: str) -> int:
    """A local world of 2 ranks or more. One rank is refused rather than judged: every contract
    compares ranks (the rules' sections "Sampling, metrics and writes" and "FSDP"), so a one-rank world would
    pass a deadlock that needs two."""
    try:
        value = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected a whole number of ranks, got {raw!r}.") from None
    if value == 1:
        raise pytest.UsageError(
            f"{where}: a one-rank world cannot show a cross-rank fault (a collective on one rank only, ranks "
            f"that disagree, duplicated samples), so every contract would pass without comparing anything. "
            f"Use --ltconform-world-size {DEFAULT_WORLD_SIZE} (the default) or more.")
    if value < 1:
        raise pytest.UsageError(f"{where}: the world size must be at least {DEFAULT_WORLD_SIZE}, got {value}.")
    return value


def _validate_seconds(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected a number of seconds, got {raw!r}.") from None
    if value != value or value in (float("inf"), float("-inf")):  # nan and inf parse as floats
        raise pytest.UsageError(f"{where}: expected a finite number of seconds, got {raw!r}; the minimum is "
                                f"{MIN_TIMEOUT_S:g} s.")
    if value <= 0:
        raise pytest.UsageError(f"{where}: the timeout must be positive (at least {MIN_TIMEOUT_S:g} s), got {raw!r}.")
    if value < MIN_TIMEOUT_S:
        raise pytest.UsageError(
            f"{where}: {value:g} s is shorter than a contract run can take; the minimum is {MIN_TIMEOUT_S:g} s "
            f"(a traced fit takes several seconds and the ranks' collective timeout is at least 5 s).")
    return value


def _validate_choices(raw: str, where: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(v.strip().lower() for v in raw.split(",") if v.strip())
    if not values:
        raise pytest.UsageError(f"{where}: no value in {raw!r}; choose from {', '.join(choices)}.")
    unknown = [v for v in values if v not in choices]
    if unknown:
        raise pytest.UsageError(
            f"{where}: unknown value(s) {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}."
        )
    twice = [v for v in dict.fromkeys(values) if values.count(v) > 1]
    if twice:
        # Refused rather than merged: a list that names one twice is a typo for another value, often.
        raise pytest.UsageError(f"{where}: {', '.join(map(repr, twice))} named more than once in {raw!r}; name each "
                                f"once (choose from {', '.join(choices)}).")
    return values


_BYTES = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def _validate_bytes(raw: str, where: str) -> int:
    """A device memory size with its unit ('80GiB', '24 GB', '1.5TiB'), in bytes."""
    text = raw.strip().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number):].lower()
    try:
        value = float(number) * _BYTES[unit]
    except (ValueError, KeyError):
        value = None
    if value is None or value != value or value == float("inf") or value < 1:
        raise pytest.UsageError(
            f"{where}: expected the memory of one device with a unit, e.g. 80GiB, 24GB or 1.5TiB, got {raw!r} "
            f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).")
    return int(value)
def _validate_nodes(raw: str, where: str) -> tuple[Layout | None, str]:
    """``N`` or ``NxM`` (nodes, ranks per node; M defaults as :func:`default_nodes` does), as the
    nodes tier's layout; ``1`` (one node) or ``off`` is None: no such tier. Also returns where it
    came from."""
    text = raw.strip().lower().replace(" ", "")
    if text in ("off", "none", "0", "1"):
        return None, where
    match = re.fullmatch(r"(\d+)(?:x(\d+))?", text)
    if match is None:
        raise pytest.UsageError(f"{where}: expected a number of nodes or NODESxRANKS (e.g. 2 or 2x2), got {raw!r}; "
                                f"1 (or off) starts no world of several nodes.")
    nodes = int(match.group(1))
    ranks = int(match.group(2)) if match.group(2) else default_nodes().ranks_per_node
    if ranks < 1:
        raise pytest.UsageError(f"{where}: a node needs at least one rank, got {raw!r}.")
    return (Layout(nodes, ranks) if nodes > 1 else None), where


def _validate_launcher(raw: str, where: str) -> str:
    value = raw.strip().lower()
    if value not in LAUNCHERS:
        raise pytest.UsageError(f"{where}: unknown launcher {raw!r}; choose from {', '.join(LAUNCHERS)} "
                                f"({LAUNCHERS[0]}, the default, forks ranks from one parent that imported Lightning "
                                f"once; {LAUNCHERS[1]} starts a fresh interpreter per rank).")
    return value


def _validate_report_path(raw: str, where: str) -> str:
    """The report's absolute path, once it is known that the file can be written there: missing
    parent folders are created (the report would create them at the end anyway) and a probe file
    is made and removed, which also catches read-only file systems and root-owned folders."""
    path = os.path.abspath(raw)
    if os.path.isdir(path):
        raise pytest.UsageError(f"{where}: cannot write the JSON report to {path}: it is a directory; "
                                f"name a file, e.g. {os.path.join(raw, 'ltconform.json')}.")
    blocking = _file_in_the_way(os.path.dirname(path))
    if blocking:
        raise pytest.UsageError(f"{where}: cannot write the JSON report to {path}: {blocking} is a file, not a "
                                f"folder; choose another path.")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            open(path, "a").close()  # appends nothing: the file is untouched until the end
        else:
            fd, probe = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".ltconform-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        # The probe file's name means nothing to the user: name the folder it was made in.
        raise pytest.UsageError(f"{where}: cannot write the JSON report to {path}: {exc.strerror or exc} "
                                f"(in {os.path.dirname(path)}); choose a path in a folder you can write to.") from None
    return path


def _file_in_the_way(folder: str) -> str | None:
    """The nearest existing ancestor of ``folder`` (itself included) when it is not a folder."""
    while folder and not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    return folder if folder and not os.path.isdir(folder) else None


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, which CI containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_mb() -> int | None:
    """MemAvailable of /proc/meminfo in MB; None where there is no /proc (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_capacity(settings: Settings, cpus: int | None = None, memory_mb: int | None = None,
                   workers: int = 1) -> None:
    """Refuse a world that this machine cannot hold: more ranks than CPUs, or more than the
    available memory at :data:`RANK_MEMORY_MB` per rank; the local world first, then the nodes
    tier's when ``--ltconform-nodes`` asked for it (its default is chosen to fit the CPUs).
    ``cpus`` and ``memory_mb`` default to the machine's. With ``workers`` pytest-xdist workers
    every worker keeps a world of its own, so the memory is for that many worlds; the CPUs are for
    one world at a time, since the workers' worlds take turns at running (``workers.slots_for``).
    No-op under ``oversubscribe``. Raises ``pytest.UsageError`` (one line)."""
    if settings.oversubscribe:
        return
    worlds = [(settings.world_size, settings.world_size_from or f"--ltconform-world-size (default "
                                                                f"{DEFAULT_WORLD_SIZE})", "--ltconform-world-size")]
    nodes = settings.nodes
    if nodes is not None and settings.nodes_from and nodes.world_size > settings.world_size:
        worlds.append((nodes.world_size, f"{settings.nodes_from or '--ltconform-nodes'} ({nodes.nodes} nodes x "
                                         f"{nodes.ranks_per_node} ranks)", "--ltconform-nodes NxM with N x M"))
    cpus = cpu_count() if cpus is None else cpus
    memory_mb = available_memory_mb() if memory_mb is None else memory_mb
    for n, where, option in worlds:
        _check_world(n, where, option, cpus, memory_mb, workers)


def _check_world(n: int, where: str, option: str, cpus: int, memory_mb: int | None, workers: int) -> None:
    if n > cpus:
        # A world has at least 2 ranks (see _validate_world_size): on one CPU only oversubscribing helps.
        fix = f"Use {option} {cpus} or fewer, or add" if cpus >= 2 else "Add"
        raise pytest.UsageError(
            f"{where}: a world of {n} ranks needs {n} CPUs, but this machine gives pytest {cpus}; ranks that share "
            f"CPUs make healthy collectives time out. {fix} --ltconform-oversubscribe to start them anyway.")
    need = workers * n * RANK_MEMORY_MB
    if memory_mb is not None and need > memory_mb:
        worlds = f"{workers} pytest-xdist workers' worlds of {n} ranks need" if workers > 1 else \
            f"a world of {n} ranks needs"
        fewer = "Use fewer ranks or fewer workers (-n)" if workers > 1 else "Use fewer ranks"
        raise pytest.UsageError(
            f"{where}: {worlds} about {need / 1024:.1f} GB ({RANK_MEMORY_MB} MB per rank for "
            f"torch and Lightning), but {memory_mb / 1024:.1f} GB is available (MemAvailable in /proc/meminfo). "
            f"{fewer}, or add --ltconform-oversubscribe to start them anyway.")


def _ini_file_keys(path) -> list[str]:
    """The keys of pytest's section in the config file ``path`` (pytest.ini, tox.ini, setup.cfg,
    pyproject.toml, pytest.toml), read here because pytest keeps its parsed copy private."""
    if path is None or not os.path.isfile(path):
        return []
    name = os.path.basename(str(path))
    if name.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10: pytest's own dependency
            import tomli as tomllib
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        table = data.get("tool", {}).get("pytest", {}) if name == "pyproject.toml" else data.get("pytest", {})
        return [k for k in table if k != "ini_options"] + list(table.get("ini_options", {}))
    import configparser

    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # keys as written
    parser.read(path, encoding="utf-8")
    section = "tool:pytest" if name.endswith(".cfg") else "pytest"
    return list(parser[section]) if parser.has_section(section) else []


def check_ini_keys(config: pytest.Config) -> None:
    """Refuse an unknown key of the config file that is meant for this plugin (it starts with
    ``ltconform`` or is one typo away from a key of ours): pytest only warns about unknown keys,
    and a misspelt ``ltconform_target`` would leave the check off with a green job."""
    import difflib

    unknown = []
    for key in _ini_file_keys(config.inipath):
        if key in INI_NAMES:
            continue
        close = difflib.get_close_matches(key, INI_NAMES, n=1, cutoff=0.8)
        if not (key.lower().startswith("ltconform") or close):
            continue
        try:
            config.getini(key)
            continue  # another plugin registered it
        except ValueError:
            pass
        unknown.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown:
        # Every bad key at once: fixing them one run at a time costs a run each.
        raise pytest.UsageError(f"ini option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
                                f"{config.inipath}: pytest-ltconform has no such option, so "
                                f"{'they' if len(unknown) > 1 else 'it'} would be ignored. Its options are "
                                f"{', '.join(INI_NAMES)}.")
    if INI_TARGET in _ini_file_keys(config.inipath) and not any(v.strip() for v in config.getini(INI_TARGET) or []):
        # As `--ltconform ""`: an empty key would leave the check off with a green job.
        raise pytest.UsageError(f"ini option {INI_TARGET!r} in {config.inipath} is empty, so no target would be "
                                f"checked. Give it one target per line (pkg.mod.Class, pkg.mod:factory or "
                                f"path/to/file.py:Name), or remove the key.")


class InputProblems(pytest.UsageError):
    """Every bad input found at start, in one paragraph: fixing them one run at a time would cost a
    run each. ``problems`` are the messages one by one; ``settings`` what resolved (defaults where a
    value was bad), or None."""

    def __init__(self, problems: list[str], settings: Settings | None = None):
        self.problems, self.settings = list(problems), settings
        super().__init__(joined(self.problems))


def joined(problems: list[str]) -> str:
    """One problem as it is; several as one paragraph, numbered."""
    if len(problems) == 1:
        return problems[0]
    return (f"{len(problems)} inputs need fixing before anything runs: "
            + " ".join(f"({n}) {p}" for n, p in enumerate(problems, 1)))


class _Collect:
    """Runs each check, keeping its pytest.UsageError instead of stopping at the first."""

    def __init__(self):
        self.problems: list[str] = []

    def __call__(self, check, *args):
        try:
            return check(*args)
        except InputProblems as exc:
            self.problems += exc.problems
        except pytest.UsageError as exc:
            self.problems.append(str(exc))
        return None


def resolve(config: pytest.Config, project_targets: bool = True) -> Settings:
    """Read every ltconform setting from ``config``; ``project_targets`` False leaves out the
    targets the project declares (ini list, ``pytest_ltconform_targets``) unless ``--ltconform``
    is given (see :func:`resolve_targets`).

    Raises :class:`InputProblems` (a ``pytest.UsageError``) naming every option (or ini key) that
    holds a bad value, with where each came from.
    """
    check = _Collect()
    check(check_ini_keys, config)
    datamodule, dm_from = check(_lookup, config, OPT_DATAMODULE) or (None, "--ltconform-datamodule")
    trainer, tr_from = check(_lookup, config, OPT_TRAINER) or (None, "--ltconform-trainer")
    targets = check(resolve_targets, config, project_targets)
    kwargs: dict = {"datamodule_from": dm_from, "trainer_from": tr_from}
    for dest, validate, keys in _VALIDATED:
        raw, where = check(_lookup, config, dest) or (None, "")
        value = check(validate, raw, where) if raw is not None else None
        if value is not None:
            kwargs.update({key: (where if key.endswith("_from") else value) for key in keys})
    raw, where = check(_lookup, config, OPT_NODES) or (None, "")
    given = check(_validate_nodes, raw, where) if raw is not None else None
    if given is not None:
        kwargs["nodes"], kwargs["nodes_from"] = given
    kwargs["oversubscribe"] = bool(config.getoption(OPT_OVERSUBSCRIBE) or config.getini(OPT_OVERSUBSCRIBE))
    targets = targets or ()
    settings = Settings(target=targets[0].model if targets else None, datamodule=datamodule, trainer=trainer,
                        targets=targets, **kwargs)
    if check.problems:
        raise InputProblems(check.problems, settings)
    return settings


# (option, its validator, the Settings fields its value fills; a field ending in _from gets where it came from)
_VALIDATED = (
    (OPT_WORLD_SIZE, _validate_world_size, ("world_size", "world_size_from")),
    (OPT_TIMEOUT, _validate_seconds, ("timeout_s",)),
    (OPT_REPORT, _validate_report_path, ("report",)),
    (OPT_REQUIRE, lambda raw, where: _validate_choices(raw, where, TIERS), ("require",)),
    (OPT_STRATEGIES, lambda raw, where: _validate_choices(raw, where, STRATEGIES), ("strategies", "strategies_named")),
    (OPT_DEVICE_MEMORY, _validate_bytes, ("device_memory", "device_memory_from")),
    (OPT_LAUNCHER, _validate_launcher, ("launcher",)),
    (OPT_SEEDING, _validate_seeding, ("seeding",)),
)


# -- targets -------------------------------------------------------------------------------------

TARGET_KEYS = ("datamodule", "trainer", "id")


def parse_target(text: str, source: str):
    """One ``--ltconform`` value or ``ltconform_target`` line, ``TARGET [datamodule=DM] [trainer=TR]
    [id=NAME]`` (whitespace-separated), as a :class:`~pytest_ltconform.target.Target` whose
    ``source`` is ``source``. Raises ``pytest.UsageError`` naming the value and the accepted keys."""
    from .target.spec import Target

    parts = _target_parts(text)
    if not parts or "=" in parts[0]:
        raise pytest.UsageError(f"{source} {text!r}: the value starts with the LightningModule target "
                                f"(pkg.mod.Class, pkg.mod:factory or path/to/file.py:Name), then optionally "
                                f"{', '.join(k + '=...' for k in TARGET_KEYS)}.")
    given: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in TARGET_KEYS or not value or key in given:
            why = (f"{key!r} is given twice" if key in given and sep else
                   f"{part!r} is not KEY=VALUE with a known key" if key not in TARGET_KEYS or not sep else
                   f"{key}= has no value")
            spaces = " (a file path may hold spaces: it is taken as written, or in quotes, when it ends in " \
                     ".py:Name)" if ".py" in text else ""
            raise pytest.UsageError(f"{source} {text!r}: {why}; after the target only "
                                    f"{', '.join(k + '=...' for k in TARGET_KEYS)} are accepted{spaces}.")
        given[key] = value
    found = Target(parts[0], datamodule=given.get("datamodule"), trainer=given.get("trainer"), id=given.get("id"))
    found.source = source
    return found


# Where a target value's next KEY=VALUE starts: whitespace before one of TARGET_KEYS and '='.
_NEXT_KEY = re.compile(r"\s+(?=(?:" + "|".join(TARGET_KEYS) + r")=)")


def _target_parts(text: str) -> list[str]:
    """A target value split into the target and its KEY=VALUE parts. A part may hold spaces when
    it names a file (``my models/model.py:Model``, ``trainer=my models/train.py:kwargs``), as
    written or in quotes; any other part is split at whitespace, so a stray word is reported."""
    parts: list[str] = []
    for piece in _NEXT_KEY.split(text.strip()):
        key, sep, value = piece.partition("=") if _NEXT_KEY.match(" " + piece) else ("", "", piece)
        value = _unquoted(value)
        if " " in value.strip() and not re.search(r"\.py(:[\w.]+)?$", value):
            parts += piece.split()
        else:
            parts.append(f"{key}{sep}{value}")
    return [p for p in parts if p]


def _unquoted(value: str) -> str:
    value = value.strip()
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def resolve_targets(config: pytest.Config, project_targets: bool = True) -> tuple:
    """Every target of the session: ``--ltconform`` values (or else the ini list) then the
    ``pytest_ltconform_targets`` hooks' results. Without ``--ltconform`` and with
    ``project_targets`` False there are none (the run selects no contract item). Raises
    ``pytest.UsageError`` for a malformed value, a hook result that is not a Target, or two
    targets with the same id."""
    values, source = config.getoption(OPT_TARGET) or [], "--ltconform"
    if any(not v.strip() for v in values):
        raise pytest.UsageError(f"--ltconform {next(v for v in values if not v.strip())!r}: empty target. Pass "
                                f"pkg.mod.Class, pkg.mod:factory or path/to/file.py:Name (quoted when it carries "
                                f"datamodule=, trainer= or id=), or leave the option out.")
    if not values:
        if not project_targets:
            return ()
        values = config.getini(INI_TARGET) or []
        source = f"ini option {INI_TARGET!r}"
    found = [parse_target(v, source) for v in values if v.strip()]
    hook = getattr(config.hook, "pytest_ltconform_targets", None)
    for result in (hook(config=config) if hook is not None else []):
        found.extend(_hook_targets(result))
    _check_ids(found)
    return tuple(found)


def validate_args(settings: Settings, t) -> dict:
    """Keyword arguments of ``target.validation.validate`` for target ``t`` of ``settings``: its own
    datamodule and trainer, or else the session-wide ones, each with where it came from."""
    own = t.source if t.source.startswith(("--", "ini ", "pytest_ltconform")) else f"Target at {t.source}"
    dm, dm_from = (t.datamodule, f"datamodule= of {own}") if t.datamodule is not None else \
        (settings.datamodule, settings.datamodule_from)
    tr, tr_from = (t.trainer, f"trainer= of {own}") if t.trainer is not None else \
        (settings.trainer, settings.trainer_from)
    return {"model": t.model, "datamodule": dm, "trainer": tr, "init": t.init, "id": t.id,
            "declared_at": None if t.source.startswith(("--", "ini ", "pytest_ltconform")) else t.source,
            "options": (own, dm_from, tr_from)}


def _hook_targets(result) -> list:
    from .target.spec import Target

    items = [result] if isinstance(result, (Target, str)) else list(result or [])
    out = []
    for item in items:
        if isinstance(item, str):
            item = parse_target(item, "pytest_ltconform_targets")
        elif not isinstance(item, Target):
            raise pytest.UsageError(f"pytest_ltconform_targets returned {item!r}; return a list of "
                                    f"pytest_ltconform.Target(model, datamodule=..., trainer=..., init=..., id=...).")
        _check_types(item)
        out.append(item)
    return out


def _check_types(t) -> None:
    wrong = [f"{name} must be {kind}, got {type(value).__name__}" for name, value, types, kind in (
        ("model", t.model, (str,), "a target string"),
        ("datamodule", t.datamodule, (str, type(None)), "a target string or None"),
        ("trainer", t.trainer, (str, dict, type(None)), "a target string, a dict of Trainer kwargs or None"),
        ("init", t.init, (dict, type(None)), "a dict of constructor arguments or None"),
        ("id", t._id, (str, type(None)), "a string or None")) if not isinstance(value, types)]
    if wrong:
        raise pytest.UsageError(f"{t!r} declared at {t.source}: {'; '.join(wrong)}.")


def _check_ids(found: list) -> None:
    seen: dict[str, tuple[int, object]] = {}
    for n, t in enumerate(found, 1):
        tid = t.id
        if not isinstance(tid, str) or not tid.strip() or "::" in tid:
            raise pytest.UsageError(f"target {n} ({t!r}, {t.source}): id {tid!r} cannot name items; give a "
                                    f"non-empty id without '::'.")
        if tid in seen:
            m, first = seen[tid]
            # Both named by hand: only another id helps; else a datamodule/trainer also tells them apart.
            fix = "give one of them another id" if first._id is not None and t._id is not None else \
                "give one an id (id=NAME after the target, or Target(..., id=...) in conftest.py), or name a " \
                "distinct datamodule=/trainer= so the targets differ as written"
            raise pytest.UsageError(
                f"targets {m} and {n} have the same id {tid!r}: {first!r} ({first.source}) and {t!r} ({t.source}). "
                f"Item ids must differ: {fix}.")
        seen[tid] = (n, t)
