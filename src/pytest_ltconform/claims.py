"""Claims: each sentence of a verdict next to the recorded facts it was made from.

A verdict's sentences are built from what the run recorded. A :class:`Claim` keeps one of them
(``text``, exactly as the message carries it) with the facts it rests on (``facts``: plain JSON,
the values per rank, ranks, paths and sites it names), and the JSON report writes them under each
record's ``claims``, so a reader and a test can hold one against the other.

The kinds of claim are one registry (:data:`KINDS`), each a small function registered with
:func:`kind`: it gets the claim (``{"kind", "text", "facts"}``) and its whole report record and
returns what is wrong with it, or None. A kind may also name the phrases that make its claim in
prose (``prose``, regular expressions, for the contracts in ``scope``; every contract when
empty): a message that carries such a phrase outside every claim of that kind states something no
recorded fact backs. :func:`check` runs every kind over one report record (a corpus row works
too: it has the same ``contract``, ``message``, ``claims`` and ``evidence``); the corpus test runs
it over every item the corpus produces.

To add a kind: one function here, decorated with ``@kind("name", prose=(...), scope=(...))``, and
the contract builds its sentence with :func:`claim` (or :meth:`Claim.of`), putting ``claim.text``
into the message. Imports nothing of the plugin but :mod:`sites`; no torch, no Lightning.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
import math
import re
from collections.abc import Callable

from .sites import fmt_site


@dataclasses.dataclass
class Claim:
    """One sentence (or clause) of a verdict and the recorded facts it was made from."""

    kind: str
    text: str
    facts: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "facts": _plain(self.facts)}


def claim(kind_name: str, text: str, **facts) -> Claim:
    """A :class:`Claim` of a registered kind (a KeyError names an unknown kind at once)."""
    if kind_name not in KINDS:
        raise KeyError(f"no claim kind {kind_name!r}; registered: {', '.join(sorted(KINDS))}")
    return Claim(kind_name, text, facts)


@dataclasses.dataclass(frozen=True)
class ClaimKind:
    """A registered kind: its check (claim dict, record -> problem or None), the prose that makes
    its claim, and the contracts whose messages that prose is looked for in (all when empty)."""

    name: str
    check: Callable[[dict, dict], str | None]
    prose: tuple[re.Pattern, ...] = ()
    scope: tuple[str, ...] = ()
    doc: str = ""
    advice: bool = False  # its prose is looked for in the Fix line too (a fix can state a falsehood)


KINDS: dict[str, ClaimKind] = {}


def kind(name: str, prose: tuple[str, ...] = (), scope: tuple[str, ...] = (), advice: bool = False):
    """Register ``fn(claim, record) -> str | None`` as the check of claim kind ``name``; ``advice``:
    its prose is looked for in the Fix line as well as in what the run showed."""

    def register(fn):
        KINDS[name] = ClaimKind(name, fn, tuple(re.compile(p) for p in prose), tuple(scope),
                                (fn.__doc__ or "").strip(), advice)
        return fn

    return register


def check(record: dict) -> list[str]:
    """What is wrong with the sentences of one report record (or corpus row): a claim whose text is
    not in the message, of no registered kind, or that its facts do not bear out; a phrase of a
    kind's ``prose`` that no claim of that kind covers; an evidence line whose recorded frame does
    not hold its named line. Empty when every sentence checked rests on its facts."""
    message = record.get("message") or ""
    claims = [c for c in record.get("claims") or [] if isinstance(c, dict)]
    problems = []
    for c in claims:
        registered = KINDS.get(c.get("kind"))
        if registered is None:
            problems.append(f"claim of unknown kind {c.get('kind')!r}: {c.get('text')!r}")
            continue
        if c.get("text") and c["text"] not in message:
            problems.append(f"{c['kind']} claim not in the message: {c['text']!r}")
        found = registered.check(c, record)
        if found:
            problems.append(f"{c['kind']}: {found} (in {_short(c.get('text'))!r})")
    problems += _uncovered_prose(record, _stated(message), claims)
    problems += _uncovered_prose(record, message, claims, advice=True)
    for e in record.get("evidence") or []:
        frame = e.get("frame") if isinstance(e, dict) else None
        if frame:
            found = frame_problem(frame, frame.get("call"))
            if found:
                problems.append(f"evidence site: {found} (in {_short(e.get('detail'))!r})")
    return problems


def _uncovered_prose(record: dict, message: str, claims: list[dict], advice: bool = False) -> list[str]:
    """Prose of a kind no claim of that kind covers; ``advice``: only the kinds whose prose may sit
    in a Fix line, over the whole message (the others were looked for in what the run showed)."""
    contract = record.get("contract")
    problems = []
    for registered in KINDS.values():
        if registered.scope and contract not in registered.scope or registered.advice != advice:
            continue
        texts = [c.get("text") or "" for c in claims if c.get("kind") == registered.name]
        for pattern in registered.prose:
            for m in pattern.finditer(message):
                if not any(m.group(0) in t and _inside(message, t, m) for t in texts):
                    problems.append(f"{registered.name}: {m.group(0)!r} is said with no {registered.name} claim "
                                    f"behind it (in {_short(_sentence_at(message, m.start()))!r})")
    return problems


def _stated(message: str) -> str:
    """The part of a message that states what the run showed: without its Fix and Rule lines
    (advice and a pointer, which may name what the user should do: "a TorchMetrics object,
    synced across ranks")."""
    return "\n".join(line for line in message.splitlines() if not line.startswith(("Fix: ", "Rule: ")))


def _inside(message: str, text: str, m: re.Match) -> bool:
    """Whether the match lies inside one of the occurrences of ``text`` in ``message``."""
    start = message.find(text)
    while start != -1:
        if start <= m.start() and m.end() <= start + len(text):
            return True
        start = message.find(text, start + 1)
    return False


def _sentence_at(message: str, pos: int) -> str:
    start = max(message.rfind("\n", 0, pos), message.rfind(". ", 0, pos)) + 1
    end = min([i for i in (message.find("\n", pos), message.find(". ", pos)) if i != -1] or [len(message)])
    return message[start:end].strip()


def _short(text: str | None, limit: int = 160) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _plain(value):
    if isinstance(value, (bool, int, str, type(None))):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in (sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value)]
    return repr(value)


# -- values -------------------------------------------------------------------------------------

def same_value(a, b, rel: float = 1e-5) -> bool:
    """Whether two recorded values are the same: numbers within ``rel`` (relative, at least 1
    absolute unit of ``rel``), anything else by equality; None (missing) equals only None."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= rel * max(1.0, abs(a), abs(b))
    return a == b


def _values(c: dict) -> list:
    values = c.get("facts", {}).get("values")
    return list(values.values()) if isinstance(values, dict) else list(values or [])


@kind("differ", prose=(r"different best (?:checkpoint|model)\w*", r"different best_model_\w+",
                       r"best_model_\w+ differs?", r"differs? across ranks", r"different epochs per rank"),
      scope=("sync-dist",))
def _differ(c: dict, record: dict) -> str | None:
    """A claim that values differ (across ranks, or from a reference) rests on at least two
    recorded values that are not the same (``facts["values"]``: label -> value)."""
    values = _values(c)
    if len(values) < 2:
        return f"needs two recorded values, has {len(values)}"
    if all(same_value(values[0], v, c["facts"].get("rel", 1e-5)) for v in values[1:]):
        return f"the recorded values are the same: {values}"
    return None


@kind("equal", prose=(r"equal on every rank", r"equal the single-device ones"))
def _equal(c: dict, record: dict) -> str | None:
    """A claim that values agree rests on at least one recorded value per side, all the same
    (``facts["values"]``: label -> value; a value per rank, or each side of a comparison)."""
    values = _values(c)
    if len(values) < 2 and not c["facts"].get("each"):
        return f"needs two recorded values to be equal, has {len(values)}"
    rel = c["facts"].get("rel", 1e-5)
    for group in c["facts"].get("each") or [values]:
        group = list(group.values()) if isinstance(group, dict) else list(group)
        if len(group) < 2 or not all(same_value(group[0], v, rel) for v in group[1:]):
            return f"the recorded values are not all the same: {group}"
    return None


@kind("not-finite", prose=(r"not judged, because the value is (?:NaN|inf)",))
def _not_finite(c: dict, record: dict) -> str | None:
    """A value left out of a comparison as NaN or inf rests on a recorded value that is not finite
    (``facts["values"]``: label -> value), of the kind the text names (NaN, inf or NaN/inf)."""
    # A record's JSON writes NaN and inf as their repr ('nan', 'inf', '-inf'; see _plain).
    values = [float(v) if v in ("nan", "inf", "-inf") else v for v in _values(c)]
    bad = [v for v in values if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return f"no recorded value is NaN or inf: {_values(c)}"
    word = "NaN" if all(math.isnan(v) for v in bad) else "inf" if not any(math.isnan(v) for v in bad) else "NaN/inf"
    return None if f"is {word} on" in c["text"] else f"the recorded values are {word}, which the text misstates"


# -- reductions ---------------------------------------------------------------------------------

def reduced_across_ranks(log: dict) -> bool:
    """Whether a recorded log call (its flags ``sync_dist``, ``rank_zero_only`` and ``vtype``) has
    its value reduced across ranks: ``sync_dist=True`` without ``rank_zero_only`` (which disables
    the sync in Lightning 2.6.6), a TorchMetrics object (which syncs its own state), or the value of
    a Metric's compute() that was recorded gathering the metric's state over the ranks
    (``metric_synced``)."""
    return bool((log.get("sync_dist") and not log.get("rank_zero_only")) or log.get("vtype") == "metric"
                or log.get("metric_synced"))


@kind("reduced", prose=(r"reduced over (?:batches and )?ranks",), scope=("sync-dist", "eval-duplication"))
def _reduced(c: dict, record: dict) -> str | None:
    """A value called reduced over ranks rests on a recorded sync: the log call's ``sync_dist``
    (without ``rank_zero_only``) or a TorchMetrics object (``facts["log"]``)."""
    log = c["facts"].get("log")
    if not isinstance(log, dict):
        return "no log call recorded"
    return None if reduced_across_ranks(log) else f"the log call was not synced ({_flags(log)})"


@kind("local", prose=(r"publishes rank 0's own",), scope=("sync-dist",))
def _local(c: dict, record: dict) -> str | None:
    """A value called one rank's own rests on a recorded log call that did not sync it, and that no
    Metric's compute() synced."""
    log = c["facts"].get("log")
    if not isinstance(log, dict):
        return "no log call recorded"
    return f"the log call was synced ({_flags(log)})" if reduced_across_ranks(log) else None


def _flags(log: dict) -> str:
    keys = ("sync_dist", "rank_zero_only", "vtype") + (("metric", "metric_synced") if "metric" in log else ())
    return ", ".join(f"{k}={log.get(k)!r}" for k in keys)


@kind("rank-value", prose=(r"\S+ on \d+ ranks vs ",), scope=("eval-duplication",))
def _rank_value(c: dict, record: dict) -> str | None:
    """A comparison that uses one rank's value names that rank when the ranks' values differ
    (``facts``: ``rank``, ``values`` per rank); 'on N ranks' is said only of a value every rank has."""
    facts = c["facts"]
    values = [v for v in _values(c) if v is not None]
    agree = len(values) >= 2 and all(same_value(values[0], v, 1e-4) for v in values[1:])
    if agree:
        return None
    if f"rank {facts.get('rank')}" not in c["text"]:
        return f"the ranks' values differ ({values}), and the text does not say it uses rank {facts.get('rank')}'s"
    if re.search(r"on \d+ ranks", c["text"]):
        return f"the ranks' values differ ({values}), yet the text gives one value 'on N ranks'"
    return None


@kind("ranks")
def _ranks(c: dict, record: dict) -> str | None:
    """A fault said of some ranks names every rank that recorded it (``facts["ranks"]``), each as
    "rank r" or in "ranks a and b" / "every rank (...)" (then they must be all ``world_size``)."""
    ranks, text = c["facts"].get("ranks") or [], c["text"]
    if not ranks:
        return "no rank recorded"
    if text.startswith("every rank") and len(ranks) != c["facts"].get("world_size"):
        return f"says every rank, but only {ranks} recorded it"
    missing = [r for r in ranks if not re.search(rf"\b{r}\b", text)]
    return f"ranks {missing} recorded it and are not named" if missing else None


# -- modules and parameters ---------------------------------------------------------------------

@kind("not-run", prose=(r"never ran in forward",), scope=("unused-parameters",))
def _not_run(c: dict, record: dict) -> str | None:
    """A module said never to have run in forward: none of its parameters was recorded as an input
    of an operation in that step (``facts["used"]`` is False), whether or not its hooks fired."""
    used = c["facts"].get("used")
    return None if used is False else f"its parameters' use was recorded as {used!r}"


@kind("no-grad", prose=(r"ran only under torch\.no_grad\(\)",), scope=("unused-parameters",))
def _no_grad(c: dict, record: dict) -> str | None:
    """A module said to have run only under torch.no_grad(): its parameters were used in that step
    (``facts["used"]``) and never with grad mode on (``facts["grad_enabled"]`` is False)."""
    facts = c["facts"]
    if facts.get("used") is not True or facts.get("grad_enabled") is not False:
        return f"recorded used={facts.get('used')!r}, grad_enabled={facts.get('grad_enabled')!r}"
    return None


@kind("unprepared-backward", prose=(r"ran outside Lightning's manual_backward",), scope=("unused-parameters",))
def _unprepared_backward(c: dict, record: dict) -> str | None:
    """Backward passes said to have run outside Lightning's manual_backward under manual
    optimization: each was recorded at the patched Tensor.backward / torch.autograd.backward,
    not under strategy.backward (``facts["outside"]``), with automatic_optimization off
    (``facts["manual"]``), in ``facts["count"]`` (at least one) backward passes."""
    facts = c["facts"]
    if facts.get("outside") is not True or facts.get("manual") is not True or not facts.get("count"):
        return (f"recorded outside={facts.get('outside')!r}, manual={facts.get('manual')!r}, "
                f"count={facts.get('count')!r}")
    return None


@kind("switched-off", prose=(r"requires_grad was switched off",), scope=("unused-parameters",))
def _switched_off(c: dict, record: dict) -> str | None:
    """Where requires_grad was switched off is named from the recorded switch (``facts["site"]``,
    the user's frame; ``facts["via"]``, the library function it went through), or said unknown;
    a library function is named only when it was recorded."""
    facts, text = c["facts"], c["text"]
    site, via = facts.get("site"), facts.get("via")
    if site and fmt_site(site).split(" (")[0] not in text:
        return f"the recorded site {fmt_site(site)} is not named"
    if not site and "not recorded" not in text and "unknown" not in text:
        return "no site was recorded, and the text does not say so"
    for name in ("toggle_optimizer", "freeze", "untoggle_optimizer"):
        if name in text and name not in (via or ""):
            return f"names {name}, which was not recorded (via={via!r})"
    return None


# -- sites --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _tree(path: str):
    source = "".join(linecache.getlines(path))
    if not source:
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError:
            return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def frame_problem(frame: dict, call: str | None = None) -> str | None:
    """What is wrong with a named line as a line of its recorded frame (``{"file", "line",
    "func"}``): the line must lie in a function of that name in that file (module level for
    ``<module>``), and, with ``call``, the statement at that line must call ``call`` (a name or an
    attribute, e.g. ``log`` for ``self.log(...)``). None when it holds or the file cannot be read."""
    path, line, func = frame.get("file"), frame.get("line"), frame.get("func") or ""
    tree = _tree(path) if path else None
    if tree is None or not isinstance(line, int):
        return None  # nothing to hold it against (a file gone, a pseudo file)
    name = func.rsplit(".", 1)[-1]
    if name not in ("<module>", "") and not name.startswith("<"):
        defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == name]
        if defs and not any(_first_line(n) <= line <= (n.end_lineno or n.lineno) for n in defs):
            return f"line {line} of {path} is not in {func}"
    if call is not None and not _calls_at(tree, line, call):
        return f"line {line} of {path} makes no {call}(...) call"
    return None


def _first_line(fn) -> int:
    return min([fn.lineno] + [d.lineno for d in fn.decorator_list])


def _calls_at(tree, line: int, call: str) -> bool:
    """Whether a call of ``call`` starts at ``line``, or the innermost statement at ``line`` holds one."""
    stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno <= line <= (n.end_lineno or n.lineno)
             and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For,
                                    ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith))]
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
                target = node.func
                named = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
                if named == call:
                    return True
    return False


@kind("site")
def _site(c: dict, record: dict) -> str | None:
    """A named line is a line of the recorded frame (``facts["frame"]``), and, with
    ``facts["call"]``, the line of that call itself; the text names it as ``path:line``."""
    frame = c["facts"].get("frame")
    if not isinstance(frame, dict):
        return "no frame recorded"
    named = fmt_site(frame).split(" (")[0]
    if named not in c["text"]:
        return f"the text does not name {named}"
    return frame_problem(frame, c["facts"].get("call"))


# -- calls, configs, precision, causes -------------------------------------------------------------

@kind("gather-counts", prose=(r"ranks made different numbers of gathers",), scope=("all-rank-save",))
def _gather_counts(c: dict, record: dict) -> str | None:
    """Ranks said to have made different numbers of gathers rest on a recorded count per rank
    (``facts["counts"]``: rank -> gathers up to collective ``facts["upto"]``), at least two of them
    different, each named in the text as "rank r N gather(s)"."""
    counts = c["facts"].get("counts") or {}
    if len(set(counts.values())) < 2:
        return f"the recorded gather counts do not differ: {counts}"
    missing = [f"rank {r} {n}" for r, n in counts.items() if f"rank {r} {n} gather" not in c["text"]]
    return f"the text does not name {', '.join(missing)}" if missing else None


@kind("call-form", prose=(r"\bcall [\w.]+\(\) on every rank",), scope=("all-rank-save",), advice=True)
def _call_form(c: dict, record: dict) -> str | None:
    """A fix that tells the user to call something calls a function, never a property: a property
    (``facts["property"]``, recorded from the library's own source) is read (``trainer.log_dir``)."""
    func = str(c["facts"].get("func") or "").rsplit(".", 1)[-1]
    if c["facts"].get("property") and re.search(rf"\b{re.escape(func)}\(\)", c["text"]):
        return f"{func} is a property, and the text calls it as a function"
    return None


@kind("auto-effect", prose=(r'DeepSpeed config has "auto" at ',), scope=("strategy-config",))
def _auto_effect(c: dict, record: dict) -> str | None:
    """A DeepSpeed config's "auto" values are explained one by one, by what DeepSpeed's own config
    reader made of each (``facts["paths"]``, ``facts["effects"]``: path -> effect), or the text says
    it was not measured; a key is explained only when it is one of the "auto" paths."""
    facts, text = c["facts"], c["text"]
    paths, effects = facts.get("paths") or [], facts.get("effects") or {}
    if not effects:
        return None if "not measured" in text else "no effect was recorded, and the text does not say so"
    for path in paths:
        if path not in effects:
            return f"no effect recorded for {path}"
        if f"{path}: " not in text:
            return f"the text does not say what DeepSpeed does with {path}"
    if "micro-batch" in text and not any("batch_size" in p for p in paths):
        return "the text speaks of the micro-batch size, which is not \"auto\" here"
    return None


@kind("coupling", prose=(r"couples the samples of a batch",), scope=("effective-batch",))
def _coupling(c: dict, record: dict) -> str | None:
    """Two gradients are said to differ because samples are coupled only when the gap lies beyond
    the rounding of the precision the run computed in (``facts``: ``rel_diff``, ``limit``, the
    limit that precision's rounding gives, and ``precision``)."""
    rel, limit = c["facts"].get("rel_diff"), c["facts"].get("limit")
    if isinstance(rel, (int, float)) and isinstance(limit, (int, float)) and rel <= limit:
        return (f"the gradients differ by {rel:.2g}, within {c['facts'].get('precision')} rounding ({limit:.2g}): "
                f"the precision explains it")
    return None


@kind("consequence", prose=(r"Consequences, not causes: [^.\n]*?\brank \d+ raised\b",))
def _consequence(c: dict, record: dict) -> str | None:
    """A rank is a consequence of another only when it failed in a collective its peer left (a
    transport error), was left waiting or exited after it: a rank that raised on its own is not.
    No claim of this kind is made; its prose is always a false sentence."""
    return "a rank that raised on its own is listed as a consequence"


@kind("cpu-only", prose=(r"does not run under (?:FSDP|DeepSpeed) on CPU",))
def _cpu_only(c: dict, record: dict) -> str | None:
    """"does not run under FSDP/DeepSpeed on CPU" is said only when the ddp run did not stop the same
    way (``facts["ddp"]``: 'finished', 'stopped differently', 'not run'; 'same' makes it false)."""
    ddp = c["facts"].get("ddp")
    if ddp == "same":
        return "the ddp run stopped the same way: the module runs under no strategy, CPU is not why"
    return None if ddp in ("finished", "stopped differently", "not run") else f"the ddp run is not recorded ({ddp!r})"


@kind("plugin-format", prose=(r"the plugin's \w+ run saved",))
def _plugin_format(c: dict, record: dict) -> str | None:
    """"the plugin's <strategy> run saved <format> where your config saves <format>" rests on the
    recorded layout the plugin's run wrote (``facts["saved"]``) and the one the user's own strategy
    writes (``facts["theirs"]``, from ``sharded.saved_layout``): both recorded, and different."""
    saved, theirs = c["facts"].get("saved"), c["facts"].get("theirs")
    if not saved or not theirs:
        return f"a save layout is not recorded (plugin's {saved!r}, the config's {theirs!r})"
    return f"the config saves the same layout ({saved!r}): not the plugin's choice" if saved == theirs else None


@kind("batches-differ", prose=(r"batches differ across ranks", r"batches hold different samples on each rank"),
      scope=("data-sharding",))
def _batches_differ(c: dict, record: dict) -> str | None:
    """The ranks' batches are said to differ by what differs (the samples, in ``facts["differed"]`` of
    ``facts["compared"]`` steps) and what is equal (``facts["counts"]``, batches per rank, said as
    "every rank ran N" only when they are equal)."""
    facts, text = c["facts"], c["text"]
    differed, compared, counts = facts.get("differed"), facts.get("compared"), facts.get("counts") or {}
    if not isinstance(differed, int) or not differed:
        return f"no step with different batches was recorded ({differed} of {compared})"
    if f"{differed} of {compared} steps" not in text:
        return "the text does not say how many of the steps compared differ"
    equal = len(set(counts.values())) == 1
    if equal != ("every rank ran" in text):
        return f"the batch counts per rank are {counts}, which the text misstates"
    return None


@kind("seed-collision", prose=(r"seeded with the same value, derived from the local rank",), scope=("data-sharding",))
def _seed_collision(c: dict, record: dict) -> str | None:
    """Ranks said to share a seed derived from the local rank rest on a recorded seed per rank
    (``facts["values"]``: rank -> value, all the same, each named as "V on rank r"), their places
    (``facts["places"]``: rank -> node and local rank: different nodes, one local rank) and a
    recorded read of the local rank (``facts["read"]``, named in the text)."""
    facts, text = c["facts"], c["text"]
    values, places = facts.get("values") or {}, facts.get("places") or {}
    if len(values) < 2 or len(set(values.values())) != 1:
        return f"the recorded seeds are not one value on several ranks: {values}"
    if set(places) != set(values) or len({p.get("node") for p in places.values()}) < 2 \
            or len({p.get("local_rank") for p in places.values()}) != 1:
        return f"the ranks are not on different nodes with one local rank: {places}"
    missing = [f"{v} on rank {r}" for r, v in values.items() if f"{v} on rank {r}" not in text]
    if missing:
        return f"the text does not name {', '.join(missing)}"
    read = facts.get("read")
    return None if read and read.split(" (")[0] in text else f"no read of the local rank is named ({read!r})"


@kind("local-split", prose=(r"split by the local rank",), scope=("data-sharding",))
def _local_split(c: dict, record: dict) -> str | None:
    """"the data is split by the local rank" rests on a recorded read of the local rank while the data
    was built that fed no seed (``facts["reads"]``) and on ranks on different nodes with one local
    rank (``facts["places"]``)."""
    places = c["facts"].get("places") or {}
    if not c["facts"].get("reads"):
        return "no read of the local rank while the data was built is recorded"
    if len({p.get("node") for p in places.values()}) < 2 or len({p.get("local_rank") for p in places.values()}) != 1:
        return f"the ranks are not on different nodes with one local rank: {places}"
    return None


@kind("one-device", prose=(r"evaluated exactly once across ranks",), scope=("eval-duplication",))
def _one_device(c: dict, record: dict) -> str | None:
    """An evaluation pass either gives the values it compared with the one-device run
    (``facts["compared"]``: key -> [world value, one-device value]) or says why none was compared
    (``facts["why"]``, in the text)."""
    compared, why = c["facts"].get("compared") or {}, c["facts"].get("why")
    if compared:
        return None
    if not why:
        return "no value was compared with the one-device run, and no reason is recorded"
    return None if why in c["text"] else "the text does not say why no value was compared with the one-device run"


# -- devices (device-placement) -----------------------------------------------------------------

@kind("off-device", prose=(r"on the CPU: on GPU ranks it stays on the CPU", r"which GPU ranks keep on the CPU",
                           r"while the rank's own GPU is"), scope=("device-placement",))
def _off_device(c: dict, record: dict) -> str | None:
    """A tensor said to be off its rank's device rests on the device it would have on GPU ranks, as
    the probe followed it, and the rank's own (``facts["ranks"]``: rank -> ``{"device", "own"}``; own
    None: the module's GPU); said on the CPU only when every rank's is the CPU."""
    ranks = c["facts"].get("ranks") or {}
    if not ranks:
        return "no rank's tensor was recorded"
    own = [r for r, d in ranks.items() if d.get("device") == d.get("own") or not d.get("device")]
    if own:
        return f"on rank(s) {own} the tensor was recorded on the rank's own device"
    if "on the CPU" in c["text"] and any(d.get("device") != "cpu" for d in ranks.values()):
        return f"says the CPU, but the recorded devices are {[d.get('device') for d in ranks.values()]}"
    return None


@kind("mixed-devices", prose=(r"gets tensors on \S+ and \S+",), scope=("device-placement",))
def _mixed_devices(c: dict, record: dict) -> str | None:
    """A call said to get tensors of two devices rests on the devices recorded for its tensors on the
    first rank that mixed them (``facts["devices"]``): two different ones, each named in the text."""
    devices = c["facts"].get("devices") or []
    if len(set(devices)) < 2:
        return f"the recorded devices are {devices}, not two different ones"
    missing = [d for d in devices[:2] if d not in c["text"]]
    return f"the text does not name {missing}" if missing else None


@kind("cuda-index", prose=(r"asks for the hard-coded device 'cuda:\d+' on every rank",
                           r"asks each rank for a GPU that is not its own",
                           r"takes its CUDA index from the global rank"), scope=("device-placement",))
def _cuda_index(c: dict, record: dict) -> str | None:
    """What a CUDA index is said to be rests on the index each rank asked for at that line and each
    rank's local rank (``facts``: ``form``, ``indices`` and ``local``: rank -> int): 'same' is one
    index on two or more ranks, not the own GPU of one of them; 'wrong' an index not some rank's own;
    'global' each rank's global rank."""
    facts = c["facts"]
    indices = {str(r): i for r, i in (facts.get("indices") or {}).items()}
    local = {str(r): i for r, i in (facts.get("local") or {}).items()}
    if len(indices) < 2:
        return f"needs the index of two ranks, has {indices}"
    off = [r for r, i in indices.items() if i != local.get(r)]
    form = facts.get("form")
    if form == "same":
        if len(set(indices.values())) != 1:
            return f"the ranks asked for different indices: {indices}"
        if not off:
            return "every rank asked for its own GPU"
        return None if f"'cuda:{next(iter(indices.values()))}'" in c["text"] else "the text names another index"
    if form == "wrong":
        return None if off else f"every rank asked for its own GPU: {indices}"
    if form == "global":
        wrong = {r: i for r, i in indices.items() if i != int(r)}
        return f"indices {wrong} are not the ranks' global ranks" if wrong else None
    return f"no such form {form!r}"


_BREAKS = {"gpu": lambda f: True, "ranks": lambda f: _several_per_node(f) or (f.get("nodes") or 1) > 1,
           "node": lambda f: _several_per_node(f), "nodes": lambda f: (f.get("nodes") or 1) > 1,
           "never": lambda f: False}


def _several_per_node(facts: dict) -> bool:
    per_node = facts.get("per_node")
    return per_node is None or per_node > 1


@kind("gpu-config", prose=(r"Under the Trainer config \(", r"The Trainer config is for CPU ranks \("),
      scope=("device-placement",))
def _gpu_config(c: dict, record: dict) -> str | None:
    """A device finding fails exactly when the Trainer config is for GPU ranks (``facts["gpu"]``:
    'gpu' or 'auto'; None for a CPU-only config) and one of the faults found breaks the ranks it asks
    for (``facts["needs"]``, each 'gpu', 'ranks', 'node', 'nodes' or 'never', against ``per_node``
    devices and ``nodes``); the config is called CPU-only only when it is."""
    facts = c["facts"]
    gpu, needs = facts.get("gpu"), facts.get("needs") or []
    unknown = [n for n in needs if n not in _BREAKS]
    if unknown:
        return f"no such need {unknown}"
    breaks = gpu is not None and any(_BREAKS[n](facts) for n in needs)
    if bool(facts.get("failed")) != breaks:
        return (f"failed={facts.get('failed')!r}, but under gpu={gpu!r}, per_node={facts.get('per_node')!r}, "
                f"nodes={facts.get('nodes')!r} the faults {needs} {'break' if breaks else 'do not break'} the run")
    if "for CPU ranks" in c["text"] and gpu is not None:
        return f"calls the config CPU-only, but it is for GPU ranks ({gpu!r})"
    return None


@kind("collectives-seen", prose=(r"\d+ collectives? rank 0 made",), scope=("device-placement",))
def _collectives_seen(c: dict, record: dict) -> str | None:
    """A count of the collectives rank 0 made and the tensors they got counts the same things: the
    collectives made inside another (``facts["nested"]``, all_gather_object's allgather, whose tensors
    are among ``facts["tensors"]``) are said when there are any; each number said is the recorded one."""
    facts, text = c["facts"], c["text"]
    outer, nested, tensors = facts.get("collectives"), facts.get("nested"), facts.get("tensors")
    if not isinstance(outer, int) or not re.search(rf"\b{outer} collectives?\b", text):
        return f"the text does not give the recorded count of collectives ({outer!r})"
    if nested and not re.search(rf"\b{nested} collectives? made inside", text):
        return f"{nested} collective(s) made inside others are counted among the tensors' but not said"
    if tensors is not None:
        if tensors != (facts.get("own") or 0) + (facts.get("unplaced") or 0):
            return f"{tensors} tensors is not the recorded own + unplaced"
        if not re.search(rf"\b{tensors} tensors?\b", text):
            return f"the text does not give the recorded count of tensors ({tensors})"
    return None


@kind("listed", prose=(r"\d+ plain tensor attributes? \(",))
def _listed(c: dict, record: dict) -> str | None:
    """A sentence that gives a count of named things and lists them lists all of them
    (``facts["names"]``), or says it lists the first K (``facts["shown"]``) of them."""
    names, shown, text = c["facts"].get("names") or [], c["facts"].get("shown") or [], c["text"]
    missing = [n for n in shown if n not in text]
    if missing:
        return f"the names {missing} are not in the text"
    if len(shown) < len(names) and f"first {len(shown)}" not in text:
        return f"lists {len(shown)} of {len(names)} names without saying so"
    return None


@kind("unrecorded", prose=(r"none met a tensor on the device", r"ends with \d+ rows where \d+ are meant",
                           r"/tmp, /var/tmp and /dev/shm count as each node's own"))
def _unrecorded(c: dict, record: dict) -> str | None:
    """Sentences no run records the facts of: that no plain tensor attribute met a device tensor (the
    probe records the attributes, not what a step did with them), and a file's row count against what
    was meant (shared-writes records the opens, not the rows), and node-local folders said from fixed
    words, not from the storage the ranks recorded. No claim of this kind is made; its
    prose is always a false sentence."""
    return "no recorded fact shows this"


@kind("address", prose=(r"<[^<>\n]* at 0x[0-9a-fA-F]+>",),
      scope=("memory", "device-placement", "shared-writes", "node-local-files"))
def _address(c: dict, record: dict) -> str | None:
    """A Python object's address (``<Foo object at 0x7f...>``) says nothing to a reader and differs on
    every run: a message names the object (``sites.no_addresses``). No claim of this kind is made."""
    return "a Python object address is printed"


# -- headline labels ----------------------------------------------------------------------------

@kind("label", prose=(r"silently wrong values",))
def _label(c: dict, record: dict) -> str | None:
    """The headline's consequence label follows from what was measured: 'silently wrong values' is
    not said where the record's own claims measured the published values equal to the reference
    and none measured one that differs."""
    if c["facts"].get("category") != "silent":
        return None
    claims = record.get("claims") or []
    equal = [x for x in claims if x.get("kind") == "equal" and x.get("facts", {}).get("against") == "reference"]
    differ = [x for x in claims if x.get("kind") == "differ" or x.get("facts", {}).get("wrong")]
    if equal and not differ:
        return "the record's claims measure the published values equal to the single-device ones and none differ"
    return None


LABELS = {"deadlock": " (deadlocks the world)", "silent": " (silently wrong values, no error)",
          "waste": " (not a correctness bug: wasted work)",
          "repeated": " (repeated work: samples evaluated more than once, no published value measured wrong)"}


def label_claim(category: str | None) -> Claim | None:
    """The headline label of a verdict's category as a claim (None for a category without one)."""
    text = LABELS.get(category or "")
    return Claim("label", text.strip(" ()"), {"category": category}) if text else None
