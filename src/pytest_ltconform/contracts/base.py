"""What a contract is: a rank-side probe that observes a run, and a verdict over all ranks.

A contract never starts processes itself. It declares the run it needs (``run_kind``); the
session makes that run once per (target, strategy, world) and hands every contract the same
:class:`Run`. Verdicts are plain data so they travel on pytest reports (and through xdist).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
from typing import Any

from ..world.diagnose import fmt_site

OUTCOMES = ("passed", "failed", "advisory", "error", "skipped")


@dataclasses.dataclass
class Evidence:
    """One fact behind a verdict: which rank (None: all), where in the user's code, what."""

    detail: str
    rank: int | None = None
    site: str | None = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "site": self.site, "detail": self.detail}


@dataclasses.dataclass
class Verdict:
    """The judgement of one contract on one run.

    ``outcome``: 'passed', 'failed', 'advisory' (a failed item whose finding wastes resources
    but computes the right thing), 'error' (the run could not be judged) or 'skipped'.
    ``summary`` is one paragraph naming the rule and what broke it; ``category`` says whether
    the fault deadlocks the world ('deadlock') or silently mixes values ('silent').
    """

    contract: str
    outcome: str
    summary: str
    evidence: list[Evidence] = dataclasses.field(default_factory=list)
    fix: str | None = None
    seed: str | None = None
    category: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    diagnosis: str | None = None
    partial: bool = False

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "advisory")

    def render(self, with_diagnosis: bool = True) -> str:
        """The evidence block shown in the pytest report (with the hang diagnosis) and in the
        terminal summary (without it)."""
        head = {"failed": "FAILED", "advisory": "ADVISORY", "error": "NOT JUDGED",
                "passed": "passed", "skipped": "skipped"}[self.outcome]
        if self.partial and self.outcome == "passed":
            head += " (on the part of the run before the world stopped)"
        kind = {"deadlock": " (deadlocks the world)", "silent": " (silently wrong values, no error)",
                "waste": " (not a correctness bug: wasted work)"}.get(self.category or "", "")
        lines = [f"[{self.contract}] {head}{kind}: {self.summary}"]
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
        if self.seed:
            lines.append(f"Rule: docs/contracts/{self.contract}.md (from the '{self.seed}' section of the "
                         f"distributed-training contracts, Lightning 2.6.6)")
        if self.diagnosis and with_diagnosis:
            lines.append(self.diagnosis)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "message": self.render(), "summary": self.summary, "partial": self.partial,
                "block": self.render(with_diagnosis=False),
                "category": self.category, "fix": self.fix, "seed": self.seed,
                "evidence": [e.as_dict() for e in self.evidence], "notes": list(self.notes)}


class Run:
    """One run (e.g. a traced fit) as every contract sees it: per-rank outcomes, traces,
    rank-side observations, and, for a world that did not finish, the divergence and diagnosis.
    """

    def __init__(self, job, strategy: str, kind: str, targets: Any = None, note: str | None = None):
        self.job = job
        self.strategy = strategy
        self.kind = kind
        self.targets = targets
        self.note = note

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

    def events(self, rank: int, ev: str | None = None) -> list[dict]:
        trace = self.job.ranks[rank].trace
        return [e for e in trace if ev is None or e.get("ev") == ev]


class Contract:
    """Base class. Subclasses set ``id``, ``title``, ``seed`` (the seed section enforced) and
    implement :meth:`judge`; those that need rank-side observations return a :class:`Probe`."""

    id: str = ""
    title: str = ""
    seed: str = ""
    run_kind: str = "fit"
    strategies: tuple[str, ...] = ("ddp",)  # a contract that also holds under CPU FSDP adds "fsdp"

    def probe(self) -> Probe | None:
        return None

    def judge(self, run: Run) -> Verdict:
        raise NotImplementedError

    def verdict(self, outcome: str, summary: str, **kwargs) -> Verdict:
        return Verdict(contract=self.id, outcome=outcome, summary=summary, seed=self.seed, **kwargs)


class Probe:
    """Rank-side observer for one run; every method is optional."""

    def before_trainer(self, loaded, trainer_kwargs: dict, recorder) -> None:
        """Adjust the Trainer kwargs (e.g. add a callback) before the Trainer is built."""

    def before_fit(self, loaded, trainer, recorder) -> None:
        """Inspect or hook the model and trainer before ``fit``."""

    def after_fit(self, loaded, trainer, recorder) -> None:
        """Run more Trainer calls on the same world after ``fit`` (validate, test, predict)."""

    def collect(self, loaded, trainer, recorder) -> Any:
        """Plain-data observations returned to the pytest side."""
        return None


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


def _mentions_rank(test: ast.AST) -> bool:
    text = ast.unparse(test)
    return any(word in text for word in _RANK_WORDS)


def site_text(site: dict | None) -> str:
    return fmt_site(site)
