"""The trace's event kinds, each declared once, with the fields its events carry.

A rank's trace (``rankN.trace.jsonl``) is one JSON object per event, in order; ``ev`` names its
kind. A kind is a :class:`Kind`: the string the trace carries, declared by :func:`declare` next
to what writes it, with a ``TypedDict`` of its fields. Readers match events on the kind
(``HOOK.of(event)``, ``run.events(rank, LOG)``), never on the string: a test checks that no event
name is matched as a literal outside its declaration.

Declared here: the events every traced run writes (the recorder's, ``trace.py``, and the
harness's), which the world's diagnosis reads too (so they live below both: this module imports
nothing of the plugin and is importable by every layer). A contract declares its own events in
its ``probe.py`` (or the shared module whose probe writes them), with the same :func:`declare`.

Every recorded event also carries the :class:`Recorded` fields the recorder adds.
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict


class Kind(str):
    """One kind of trace event: the ``ev`` string its events carry (a ``str``, so it compares,
    hashes and serialises as that string), and ``fields``, the ``TypedDict`` of their keys."""

    fields: type | None
    declared_in: str

    def __new__(cls, name: str, fields: type | None = None, declared_in: str = ""):
        kind = super().__new__(cls, name)
        kind.fields = fields
        kind.declared_in = declared_in
        return kind

    def __reduce__(self):  # pickles as the plain string the trace carries
        return (str, (str(self),))

    def of(self, event: Any) -> bool:
        """Whether ``event`` (a trace event, or anything else) is of this kind."""
        return isinstance(event, dict) and event.get("ev") == self

    def new(self, **fields: Any) -> dict:
        """A new event of this kind with ``fields`` (what a probe emits)."""
        return {"ev": str(self), **fields}

    def find(self, trace) -> list[dict]:
        """The events of this kind in ``trace`` (one rank's events, in order)."""
        return [e for e in trace or () if e.get("ev") == self]


_DECLARED: dict[str, Kind] = {}


def declare(name: str, fields: type | None = None) -> Kind:
    """Declare the event kind ``name`` (its events' keys in ``fields``, a TypedDict) for the
    calling module; ValueError when another module declared it already (two writers would make
    one kind mean two things)."""
    module = sys._getframe(1).f_globals.get("__name__", "")
    known = _DECLARED.get(name)
    if known is not None and known.declared_in != module:
        raise ValueError(f"trace event {name!r} is declared by {known.declared_in} already; "
                         f"{module} must declare a kind of its own")
    _DECLARED[name] = kind = Kind(name, fields, module)
    return kind


def declared() -> dict[str, Kind]:
    """Every kind declared so far (by the modules imported so far), by name."""
    return dict(_DECLARED)


class Recorded(TypedDict, total=False):
    """What the recorder adds to every event it writes: ``seq`` (1, 2, ... per rank and job),
    ``t`` (seconds since the job started on this rank), ``h`` (the index of the innermost open
    hook, 0 outside any), and, once a Trainer is bound, ``epoch``, ``step`` (the global step)
    and ``sanity`` (inside the sanity check)."""

    ev: str
    seq: int
    t: float
    h: int
    epoch: int
    step: int
    sanity: bool


class HookEvent(Recorded):
    """A hook entered: ``i`` its index (1, 2, ... in entry order), ``name`` the profiler's action
    (``[LightningModule]Model.training_step``)."""

    i: int
    name: str


class HookExitEvent(Recorded):
    """The hook of index ``i`` returned (or raised)."""

    i: int


class CallEvent(Recorded):
    """A collective-bearing call began: ``kind`` ('collective', 'strategy', 'save' or a probe's),
    ``op``, ``label`` (``torch.distributed.all_reduce``), ``site`` (the user's frame), ``user``
    (made directly by user code), ``parent`` (the enclosing call's ``seq``), ``hook``, and the
    probe's extra keys (``path`` of a save)."""

    kind: str
    op: str
    label: str
    site: dict | None
    user: bool
    parent: int | None
    hook: str | None


class ExitEvent(Recorded):
    """The call whose ``seq`` is ``of`` returned; ``raised`` (its exception type) and ``hooks``
    (the hooks open then) when it raised."""

    of: int
    raised: str
    hooks: list[str]


class LogEvent(Recorded):
    """One ``LightningModule.log``: its ``name``, ``hook``, ``site``, ``user``, ``via`` ('log' or
    'log_dict'), the flags (``sync_dist``, ``rank_zero_only``, ``on_step``, ``on_epoch``,
    ``batch_size`` given, ``reduce_fx``), ``vtype`` ('metric', 'tensor', 'float', 'other') and
    ``value`` (a float, for tensors and numbers); probes' log taps add keys."""

    name: str
    hook: str | None
    site: dict | None
    user: bool
    via: str
    sync_dist: bool
    rank_zero_only: bool
    on_step: bool
    on_epoch: bool
    batch_size: bool
    reduce_fx: str
    vtype: str
    value: float


class LogDictEvent(Recorded):
    """One ``LightningModule.log_dict`` (its ``log`` events follow): ``keys`` and its flags."""

    keys: list[str]
    site: dict | None
    user: bool
    hook: str | None
    sync_dist: bool
    rank_zero_only: bool


class CollectivesEvent(TypedDict):
    """torch's Flight Recorder entries of this job (``entries``: ``pg``, ``seq``, ``p2p``,
    ``is_p2p``, ``op``, ``sizes``, ``frames``), dumped ``why`` ('raised', 'stuck', 'blocked'),
    ``frames`` whether they carry Python frames; written without the trainer's position."""

    ev: str
    why: str
    frames: bool
    entries: list[dict]
    seq: int


class TraceErrorEvent(Recorded):
    """Recording failed ``where`` (a tap's name) with ``error`` (its repr); the user's run went on."""

    where: str
    error: str


class StageEvent(Recorded):
    """A Trainer stage began on this rank: ``name`` ('fit', 'test', 'predict', 'validate')."""

    name: str


class StageErrorEvent(Recorded):
    """A later stage (``name``) raised ``exc_type`` with ``message`` (its first 500 characters);
    the later stages end there. ``raised``: the frame that raised it, ``user``: the innermost user
    frame (``{"file", "line", "func"}`` or None)."""

    name: str
    exc_type: str
    message: str
    raised: dict | None
    user: dict | None


class ExceptionEvent(Recorded):
    """A Trainer call raised on this rank (written when Lightning's ``on_exception`` runs, before
    the teardown, traced run or not): ``exc_type``, ``message`` (its first 500 characters), the
    frame that raised it (``raised``), the innermost user frame (``user``), the Trainer's ``fn``."""

    exc_type: str
    message: str
    raised: dict | None
    user: dict | None
    fn: str


class StrategyEvent(Recorded):
    """The strategy a traced run was made under; ``configured``: whether the user's Trainer config
    asks for it (else the run is the plugin's own extra strategy)."""

    configured: bool


class NoteEvent(Recorded):
    """What ran in place of the user's setting (``text``, one sentence: their FSDP config as CPU
    FSDP, an optimizer substituted on CPU); every item judged on the run shows it."""

    text: str


class NonfiniteEvent(Recorded):
    """The first training loss that was nan or inf on this rank: ``loss`` (its value, as text),
    ``step``, ``epoch``, ``batch_idx`` and ``site`` (the user's ``training_step`` line)."""

    loss: str
    batch_idx: int
    site: dict | None


class SeedingEvent(Recorded):
    """How this rank's generators were seeded: ``at`` 'start' (the job's start: ``mode``, the
    session's --ltconform-seeding, and ``seed``, this rank's) or 'train_start' (seeding "both":
    every rank reseeded with ``seed``, or ``kept`` the module's own seed, set at ``by``)."""

    at: str
    mode: str
    seed: int
    kept: bool
    by: dict | None
    fn: str


class UserSeedEvent(Recorded):
    """User code (directly, or through a library such as seed_everything) seeded a global
    generator: ``fn`` (``torch.manual_seed``), ``site``, ``hook`` and ``value``, the seed passed
    (its repr when it is not an int)."""

    fn: str
    site: dict | None
    hook: str | None
    value: int | str | None


class EnvRankReadEvent(Recorded):
    """User code read a rank variable of the environment (``key``, "LOCAL_RANK") itself, through
    ``os.environ[...]``, ``os.environ.get`` or ``os.getenv``, at ``site`` (its source line ``code``)
    in ``hook``; ``value`` is what it read. One event per user line."""

    key: str
    value: str | None
    site: dict | None
    code: str
    hook: str | None


class RaisedEvent(Recorded):
    """A recorded user call raised for a reason a contract owns (``owner``, its id): that
    contract claims the stop; ``exc`` says what ("Type: message"). Its ``in`` key (which call
    raised, e.g. 'torch.load') is a Python keyword, so it is not spelled here."""

    owner: str
    exc: str


# Written by the recorder (trace.py).
HOOK = declare("hook", HookEvent)
HOOK_EXIT = declare("hook_exit", HookExitEvent)
CALL = declare("call", CallEvent)
EXIT = declare("exit", ExitEvent)
LOG = declare("log", LogEvent)
LOG_DICT = declare("log_dict", LogDictEvent)
FLIGHT_RECORD = declare("collectives", CollectivesEvent)
TRACE_ERROR = declare("trace_error", TraceErrorEvent)
# Written by the harness (harness.py) on every traced run.
STAGE = declare("stage", StageEvent)
STAGE_ERROR = declare("stage_error", StageErrorEvent)
EXCEPTION = declare("exception", ExceptionEvent)
STRATEGY = declare("strategy", StrategyEvent)
NOTE = declare("note", NoteEvent)
NONFINITE = declare("nonfinite", NonfiniteEvent)
SEEDING = declare("seeding", SeedingEvent)
USER_SEED = declare("user_seed", UserSeedEvent)
ENV_RANK_READ = declare("env_rank_read", EnvRankReadEvent)
# Written by a probe that names itself the owner of an exception (contracts.base.Run.raised_owner).
RAISED = declare("raised", RaisedEvent)
