"""What a contract is: the run it needs, a rank-side probe that observes it, the failures of an
unfinished run it owns, and a verdict over all ranks.

A contract never starts processes itself. It declares the run it needs (``run_spec``, a
:class:`~..runs.RunSpec`) and its probe (``probe_class``, a :class:`~..runs.Probe`); the
session makes that run once per (target, strategy, world) and hands every contract that declares
it the same :class:`Run`. When a run did not finish, the session asks every contract's
:meth:`Contract.blames`; the claim with the lowest :class:`Blame` names the cause. Verdicts are
plain data so they travel on pytest reports (and through xdist).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import linecache
from typing import Any

from ..claims import LABELS, Claim, label_claim
from ..events import RAISED
from ..outcomes import NOT_JUDGED_PREFIX, NotJudged, Outcome
from ..runs import FIT, Probe, RunSpec
from ..sites import fmt_site
from ..vocabulary import DEFAULT_CONTRACT_TIERS


class Blame(enum.IntEnum):
    """Why a world stopped early, first cause first (docs/internals.md, "When a world does not
    finish"): of the contracts
    that claim an unfinished run (:meth:`Contract.blames`), the lowest value is named as the
    cause, and every other contract's verdict on that run says so in one line instead of
    repeating the tracebacks. A rank that raised on its own, outside any claimed call, is named
    by the session itself when no contract claims the run; data claims come last, since uneven
    batches are usually a symptom of a rank that stopped."""

    CALL = 10      # a collective-bearing call made on some ranks only (all-rank-save), including the
    #                collectives a library makes for a user call (Metric.compute, a DDP forward)
    DECISION = 20  # a decision all ranks must share differs (sync-dist: should_stop, best checkpoint)
    LOG = 30       # a synced self.log made on some ranks only, or a monitored key some ranks never log (sync-dist)
    RAISED = 40    # every failed rank raised inside a recorded call whose event names its owner
    DATA = 50      # the ranks' own dataloaders give them different numbers of batches (data-sharding)


@dataclasses.dataclass
class Evidence:
    """One fact behind a verdict: which rank (None: all), where in the user's code, what.
    ``frame``: the recorded frame (``{"file", "line", "func"}``) the site was written from, kept
    in the JSON report so that the named line can be held against it (``site`` defaults to it)."""

    detail: str
    rank: int | None = None
    site: str | None = None
    frame: dict | None = None
    call: str | None = None  # the call the named line makes (``log`` for self.log), held against its source

    def __post_init__(self):
        if self.site is None and self.frame:
            self.site = fmt_site(self.frame)

    def as_dict(self) -> dict:
        out = {"rank": self.rank, "site": self.site, "detail": self.detail}
        if self.frame:
            out["frame"] = {k: self.frame.get(k) for k in ("file", "line", "func")}
            if self.call:
                out["frame"]["call"] = self.call
        return out


@dataclasses.dataclass
class Verdict:
    """The judgement of one contract on one run.

    ``outcome``: an :class:`~..outcomes.Outcome` (today's strings are accepted too: 'skipped'
    with a summary starting "not judged: " is :attr:`Outcome.NOT_JUDGED`). ``summary`` is one
    paragraph naming the rule and what broke it; ``category`` says whether the fault deadlocks
    the world ('deadlock') or silently mixes values ('silent'). ``depends_on`` names the item
    whose failure left this one not judged, when another item did. ``claims``: the sentences of
    the summary, evidence and notes next to the recorded facts they were made from
    (:mod:`..claims`); the headline's label adds its own.
    """

    contract: str
    outcome: Outcome
    summary: str
    evidence: list[Evidence] = dataclasses.field(default_factory=list)
    fix: str | None = None
    rule_section: str | None = None
    category: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    diagnosis: str | None = None
    partial: bool = False
    # Set on a pass that found nothing of what the contract judges (no evaluation, no batch, no
    # backward): kept on a finished run, but on an unfinished one the session reports the item
    # not judged, since a pass that compared nothing is no pass.
    empty: bool = False
    depends_on: str | None = None
    claims: list[Claim] = dataclasses.field(default_factory=list)
    # An error of a run that stopped: where, as the headline says it ("in your code", "in library
    # code", "in the plugin's code", "when a rank died"); "in your code" only when a user frame raised.
    stopped_in: str | None = None

    def __post_init__(self):
        self.outcome = Outcome.read(self.outcome, self.summary)
        if self.outcome is Outcome.NOT_JUDGED and not self.summary.startswith(NOT_JUDGED_PREFIX):
            self.summary = NOT_JUDGED_PREFIX + self.summary

    @property
    def finding(self) -> bool:
        """A failure or an advisory (which passes): the verdict found something against the rule."""
        return self.outcome.finding

    @property
    def failed(self) -> bool:
        """The name before :attr:`finding` (true for advisories too), kept for code written against it."""
        return self.finding

    @property
    def not_judged(self) -> NotJudged | None:
        """Why the item was not judged, and the item it depends on; None when it was judged."""
        if self.outcome is not Outcome.NOT_JUDGED:
            return None
        return NotJudged(self.summary.removeprefix(NOT_JUDGED_PREFIX), self.depends_on)

    def render(self, with_diagnosis: bool = True) -> str:
        """The evidence block shown in the pytest report (with the hang diagnosis) and in the
        terminal summary (without it)."""
        head = self.outcome.head
        if self.partial and self.outcome is Outcome.PASSED:
            head += " (on the part of the run before the world stopped)"
        kind = LABELS.get(self.category or "", "")
        if self.outcome is Outcome.ERROR and self.category == "crash":
            head = f"NOT JUDGED (the run stopped {self.stopped_in or 'in your code'})"
        lines = [f"[{self.contract}] {head}{kind}: {self.summary}"]
        if self.outcome is Outcome.NOT_JUDGED:
            lines = [f"[{self.contract}] {self.summary}"]
        if self.evidence:
            lines.append("Evidence:")
            for e in self.evidence:
                who = "all ranks" if e.rank is None else f"rank {e.rank}"
                where = f" at {e.site}" if e.site else ""
                lines.append(f"  - {who}{where}: {e.detail}")
        for note in self.notes:
            lines.append(f"Note: {note}")
        if self.fix:
            lines.append(f"Fix: {self.fix}")
        if self.rule_section and self.category != "consequence":
            lines.append(f"Rule: pytest --ltconform-explain {self.contract} (docs/contracts/{self.contract}.md; "
                         f"from the '{self.rule_section}' section of the distributed-training contracts, "
                         f"Lightning 2.6.6)")
        if self.diagnosis and with_diagnosis:
            lines.append(self.diagnosis)
        return "\n".join(lines)

    def all_claims(self) -> list[Claim]:
        """The verdict's claims, with its headline label's when the headline carries one."""
        label = label_claim(self.category)
        shown = label is not None and self.outcome is not Outcome.NOT_JUDGED and \
            not (self.outcome is Outcome.ERROR and self.category == "crash")
        return list(self.claims) + ([label] if shown else [])

    def as_dict(self) -> dict:
        return {"outcome": self.outcome.reported, "message": self.render(), "summary": self.summary,
                "partial": self.partial, "block": self.render(with_diagnosis=False),
                "category": self.category, "fix": self.fix, "rule_section": self.rule_section,
                "evidence": [e.as_dict() for e in self.evidence], "notes": list(self.notes),
                "claims": [c.as_dict() for c in self.all_claims()]}


@dataclasses.dataclass
class Finding:
    """One thing a check found against the rule: its sentence, the kind of fault it is
    (:attr:`Verdict.category`), the rank it is about (None: all ranks, or none in particular) and
    the fix it calls for."""

    category: str | None
    detail: str
    rank: int | None = None
    fix: str | None = None


@dataclasses.dataclass
class Findings:
    """What a contract's checks found for one verdict, in the order found: the first finding
    leads (its sentence opens the summary, its category is the verdict's) and the others follow.
    Evidence and notes are kept in order; ``causes`` collects the causes the evidence names, for
    the fix. :func:`merged` does the same for checks that each return a whole verdict."""

    items: list[Finding] = dataclasses.field(default_factory=list)
    evidence: list[Evidence] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    causes: set[str] = dataclasses.field(default_factory=set)
    claims: list[Claim] = dataclasses.field(default_factory=list)

    def add(self, category: str | None, detail: str, rank: int | None = None, fix: str | None = None) -> None:
        self.items.append(Finding(category, detail, rank, fix))

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def lead(self) -> Finding | None:
        return self.items[0] if self.items else None

    def summary(self, every: bool = False) -> str:
        """The lead's sentence and a count of the findings below it; ``every``: all the sentences."""
        if every:
            return " ".join(f.detail for f in self.items)
        more = len(self.items) - 1
        return self.items[0].detail + (f"; and {more} more finding(s) below" if more else "")

    def fixes(self) -> str:
        """The distinct fixes of the findings, sorted, as one paragraph."""
        return " ".join(sorted({f.fix for f in self.items if f.fix}))


def merged(findings: list[Verdict], notes: list[str] = ()) -> Verdict:
    """The verdict of a contract whose checks found several things: the first finding leads, with
    every finding's evidence in order and the others' summaries as notes before its own (then
    ``notes``). Mutates and returns ``findings[0]``. :class:`Findings` collects findings that are
    not yet verdicts."""
    first = findings[0]
    first.evidence = [e for f in findings for e in f.evidence]
    first.claims = [c for f in findings for c in f.claims]
    first.notes = [f.summary for f in findings[1:]] + first.notes + list(notes)
    return first


class Run:
    """One run (e.g. a traced fit) as every contract sees it: per-rank outcomes, traces,
    rank-side observations, and, for a world that did not finish, the divergence and diagnosis.
    """

    def __init__(self, job, strategy: str, kind: str, target: Any = None):
        self.job = job
        self.strategy = strategy
        self.label = strategy  # the item parameter its items carry (``ddp``, ``ddp-2nodes``), set by the session
        self.kind = kind
        self.target = target  # the target.spec.ResolvedTarget it ran (None in hand-built runs)
        self.reference: Run | None = None  # the one-rank run of RunSpec.reference, when it ran
        self.first_item: str | None = None  # the first item judged on it: a later hang names it
        self.cause_item: str | None = None  # the item that shows why it did not finish
        self.settings: Any = None  # the session's Settings (a stated device memory), set by the session
        self.observed: dict[str, Run] = {}  # the runs of Contract.observes, by name, set by the session

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def finished(self) -> bool:
        return self.job.status == "ok"

    @property
    def traces(self) -> list[list[dict]]:
        return [r.trace for r in self.job.ranks]

    def value(self, rank: int) -> dict | None:
        r = self.job.ranks[rank]
        return r.value if r.status == "ok" and isinstance(r.value, dict) else None

    def values(self) -> list[dict | None]:
        return [self.value(r) for r in range(self.world_size)]

    def probe(self, contract_id: str) -> list[Any]:
        """Each rank's probe observations for ``contract_id`` (None for a rank that did not finish)."""
        return [(v or {}).get("probes", {}).get(contract_id) if v else None for v in self.values()]

    def events(self, rank: int, kind: str | None = None) -> list[dict]:
        """Rank ``rank``'s trace events of ``kind`` (an ``events.Kind``; a project's own contract
        may name its kind as a string), in order; every event without one."""
        trace = self.job.ranks[rank].trace or []
        return list(trace) if kind is None else [e for e in trace if e.get("ev") == kind]

    def divergence_kind(self) -> str | None:
        """'hooks' or 'calls' for the first point where the ranks' traces differ; None if none."""
        div = self.job.divergence
        return div["kind"] if div else None

    def divergent_events(self) -> set:
        """The kinds of the events at the first divergence (``events.CALL``, ``events.LOG``, ...;
        compared as the strings they are)."""
        div = self.job.divergence
        return {e.get("ev") for evs in div["events"].values() for e in evs} if div else set()

    def raised_in_user_code(self) -> bool:
        """Whether a rank raised in the user's own code (not in a collective, not in a library
        check): that rank's exception leads, and what its peers did after it is a consequence."""
        from ..world.causes import raised_in_user_code

        return not self.finished and any(raised_in_user_code(r) for r in self.job.ranks)

    def raised_owner(self) -> str | None:
        """The contract owning a failure that every failed rank raised inside a recorded user call
        (trace event ``events.RAISED`` with its ``owner``, e.g. load_from_checkpoint on a sharded
        directory); None when a failed rank has no such event or they name different owners."""
        owners = set()
        for rank in self.job.ranks:
            if rank.status == "ok":
                continue
            found = [e.get("owner") for e in RAISED.find(rank.trace) if e.get("owner")]
            if not found:
                return None
            owners.add(found[-1])
        return owners.pop() if len(owners) == 1 else None


class Contract:
    """Base class. Subclasses set ``id``, ``title``, ``rule_section`` (the section of the
    distributed-training rules it enforces), the run they need (``run_spec``, default the traced
    fit) and their rank-side ``probe_class`` if any, and implement :meth:`judge`; one that owns a
    kind of early stop overrides :meth:`blames`."""

    id: str = ""
    title: str = ""
    rule_section: str = ""
    run_spec: RunSpec = FIT
    probe_class: type[Probe] | None = None
    # Runs besides ``run_spec`` whose ranks load this contract's probe too; the verdict reads them as
    # ``run.observed[spec.name]`` (spawn-safety reads what the traced fit's DataLoader workers receive).
    observes: tuple[RunSpec, ...] = ()
    strategies: tuple[str, ...] = ("ddp",)  # a contract that also holds under CPU FSDP adds "fsdp"
    # Strategies whose items exist only for targets whose Trainer config names them (there is
    # nothing of theirs to judge otherwise).
    configured_only: tuple[str, ...] = ()
    # The tiers it has items in (vocabulary.TIERS).
    tiers: tuple[str, ...] = DEFAULT_CONTRACT_TIERS
    # Whether the verdict compares values (metrics, gradients, weights): not judged on top of a
    # non-finite training loss (nan never equals nan).
    needs_finite_loss: bool = False

    def probe_ref(self) -> str | None:
        """The probe's class as "module:Class", which the harness loads on the ranks; None without one."""
        cls = self.probe_class
        return f"{cls.__module__}:{cls.__qualname__}" if cls is not None else None

    def blames(self, run: Run) -> int | None:
        """How strongly this contract claims why the unfinished ``run`` stopped (a :class:`Blame`,
        lower wins); None when it does not. By default a contract claims a failure its own probe
        named it the owner of (:meth:`Run.raised_owner`)."""
        return Blame.RAISED if run.raised_owner() == self.id else None

    def plugin_choice(self, run: Run) -> tuple[str, str, list[Claim]] | None:
        """(reason, advisory, claims) when the unfinished ``run`` stopped only because of something
        the plugin's own run chose and the user's Trainer config never reaches (a save format of a
        strategy the config does not name): every item of the run is not judged for ``reason`` (no
        period at its end; ``claims``: the sentences it makes), and this contract's item adds
        ``advisory``. None by default."""
        return None

    def judge(self, run: Run) -> Verdict:
        raise NotImplementedError

    def verdict(self, outcome: Outcome | str, summary: str, **kwargs) -> Verdict:
        """This contract's verdict; ``outcome`` an :class:`Outcome` or its value ('skipped' with a
        "not judged: " summary, as contracts wrote it before the enum, is :attr:`Outcome.NOT_JUDGED`)."""
        return Verdict(contract=self.id, outcome=outcome, summary=summary, rule_section=self.rule_section, **kwargs)

    def not_judged(self, reason: str, depends_on: str | None = None, **kwargs) -> Verdict:
        """Not judged for ``reason`` (one line; a premise of the verdict does not hold, or the plugin
        cannot read something), or because of the item ``depends_on``."""
        return self.verdict(Outcome.NOT_JUDGED, reason, depends_on=depends_on, **kwargs)


# -- source helpers for evidence -----------------------------------------------------------------

_RANK_WORDS = ("rank", "global_zero", "is_global_zero", "local_rank", "node_rank")


@functools.lru_cache(maxsize=256)
def _parse(path: str):
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


def rank_guard(site: dict | None) -> str | None:
    """The rank condition that decides whether the call at ``site`` runs, as source text:
    the innermost enclosing ``if`` that tests a rank, or an earlier ``if <rank test>: return``
    in the same function. None when the call site has no such guard."""
    if not site or not site.get("file"):
        return None
    tree = _parse(site["file"])
    if tree is None:
        return None
    line = site.get("line", 0)
    best = None
    func = None
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if end is None or not (node.lineno <= line <= end):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if func is None or node.lineno > func.lineno:
                func = node
        if isinstance(node, ast.If) and _mentions_rank(node.test):
            in_body = any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.body)
            if (best is None or node.lineno > best[0].lineno):
                best = (node, in_body)
    if best is not None:
        node, in_body = best
        text = ast.unparse(node.test)
        return f"if {text}:" if in_body else f"else branch of `if {text}:`"
    if func is not None:
        for node in ast.walk(func):
            if isinstance(node, ast.If) and node.lineno < line and _mentions_rank(node.test) and \
                    any(isinstance(s, ast.Return) for s in node.body):
                return f"if {ast.unparse(node.test)}: return"
    return None


def rank_decorator(site: dict | None) -> dict | None:
    """The decorator on the function at ``site`` (a line inside it) that tests a rank in its source
    (``@rank_zero_only``): ``{"text", "file", "line"}``, the decorator's own line; None without one."""
    tree = _parse(site["file"]) if site and site.get("file") else None
    line = (site or {}).get("line") or 0
    func = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno) and (func is None or node.lineno > func.lineno):
            func = node
    for dec in func.decorator_list if func is not None else ():
        if _mentions_rank(dec):
            return {"text": f"@{ast.unparse(dec)}", "file": site["file"], "line": dec.lineno, "func": func.name}
    return None


def defined_as_property(site: dict | None) -> bool:
    """Whether the function at ``site`` (``{"file", "line"}``, a line inside it) is a property's
    getter in its source (decorated ``@property`` or ``@functools.cached_property``), so that user
    code reads it as an attribute instead of calling it."""
    tree = _parse(site["file"]) if site and site.get("file") else None
    line = (site or {}).get("line") or 0
    inner = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            if inner is None or node.lineno > inner.lineno:
                inner = node
    if inner is None:
        return False
    names = {ast.unparse(d).rsplit(".", 1)[-1] for d in inner.decorator_list}
    return bool(names & {"property", "cached_property"})


def _mentions_rank(test: ast.AST) -> bool:
    text = ast.unparse(test)
    return any(word in text for word in _RANK_WORDS)


# -- where the user's classes define things (pytest side, for evidence) ---------------------------

def user_classes(run: Run, which: str = "model") -> tuple[tuple[str, str], ...]:
    """The user's classes of this run's LightningModule (or, with ``which="datamodule"``, its
    LightningDataModule) and their user base classes, as (class name, source path), most derived
    first, as validation found them; empty when unknown."""
    if run.target is None:
        return ()
    return tuple(getattr(run.target, f"{which}_classes", ()) or ())


def _class_nodes(classes, name: str | None = None):
    """(ClassDef node, class name, path) for each of ``classes`` found in its source file."""
    for klass_name, path in classes:
        tree = _parse(path)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ClassDef) and node.name == (name or klass_name):
                yield node, klass_name, path
                break


def attribute_site(classes, attr: str) -> dict | None:
    """Where ``self.<attr> = ...`` is assigned in one of ``classes`` (see :func:`user_classes`),
    as a site dict."""
    for node, klass_name, path in _class_nodes(classes):
        for fn in node.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(fn):
                targets = sub.targets if isinstance(sub, ast.Assign) else \
                    [sub.target] if isinstance(sub, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == attr and \
                            isinstance(t.value, ast.Name) and t.value.id == "self":
                        return {"file": path, "line": sub.lineno, "func": f"{klass_name}.{fn.name}"}
    return None


def method_site(classes, name: str) -> dict | None:
    """Where one of ``classes`` (see :func:`user_classes`) defines method ``name`` (its first
    decorator's line, as ``inspect`` gives it), as a site dict."""
    for node, klass_name, path in _class_nodes(classes):
        for fn in node.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == name:
                line = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
                return {"file": path, "line": line, "func": f"{klass_name}.{name}"}
    return None


def class_site(classes, name: str) -> dict | None:
    """Where a class called ``name`` is defined in the source file of the first of ``classes``
    (e.g. a sampler or dataset class next to the user's module)."""
    for node, _, path in _class_nodes(classes[:1], name):
        return {"file": path, "line": node.lineno, "func": name}
    return None


def target_site(spec) -> dict | None:
    """Where a target (e.g. the ``--ltconform-trainer`` callable or dict) is defined."""
    if spec is None:
        return None
    from ..target import loading as target_loading

    try:
        obj = target_loading.load_object(spec)
    except Exception:
        return None
    if inspect.isfunction(obj) or inspect.isclass(obj):
        try:
            return {"file": inspect.getsourcefile(obj), "line": inspect.getsourcelines(obj)[1],
                    "func": spec.attr}
        except (TypeError, OSError):
            return None
    module = target_loading.import_module(spec)
    path = getattr(module, "__file__", None)
    tree = _parse(path) if path else None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == spec.attr for t in node.targets):
            return {"file": path, "line": node.lineno, "func": spec.attr}
    return None


def definition_evidence(run: Run, names: list[str], what: str = "created") -> list[Evidence]:
    """One line per top-level submodule of the parameter ``names``, pointing at the
    ``self.<name> = ...`` that creates it in the user's class."""
    classes = user_classes(run)
    out = []
    for attr in dict.fromkeys(n.split(".")[0] for n in names):
        site = attribute_site(classes, attr)
        if site:
            out.append(Evidence(f"self.{attr} is {what} here", site=fmt_site(site)))
    return out
