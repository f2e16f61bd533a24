"""Run the checker over the conformance corpus and measure it.

    python -m pytest_ltconform.corpus [PATH ...] [--contract ID] [--strategies S,..] [--json OUT] [--timeout S]
    python -m pytest_ltconform.corpus --as-user [PATH ...] [--jobs N] [--json OUT]

Each case file (``conformance/<contract>/<case>.py``, or a shared case) defines ``Model`` (and
optionally ``DataModule`` and ``trainer_kwargs``) plus ``EXPECTED = {contract id: "pass" | "fail" |
"advisory" | "nofail"}``; a file named ``ok_*`` conforms, as does one whose EXPECTED says only
"pass" or "advisory" (the demos).

Which items are judged: every item a default ``pytest --ltconform`` run creates for the case, on the
CPU tier: each contract under each of its strategies among ddp, fsdp and deepspeed (deepspeed where
it is installed; a ``configured_only`` strategy where the case's Trainer config names it). On a
faulty case, the contracts EXPECTED names; on an ``ok_`` case, every contract. ``--strategies``
narrows the strategies; ``--matrix named`` keeps the contracts EXPECTED names, a "fail" under the
strategy that decides it, any other under ddp and the strategy the case's config names (plus fsdp
on ``ok_`` cases): the default test suite's cheaper tier, the full matrix being slow-tier (see
tests/test_corpus.py).

What each item's verdict counts as (``got``): fail, advisory, pass; consequence (not judged because
another item's failure stopped the shared run); notjudged (a skip that says "not judged" and why);
skipped (the strategy does not apply to the case); unavailable (the item's tier cannot run on this
machine: accepted whatever is expected, and listed with the reason); stopped (an error because the
case's own code stopped the run); error. The rule per expected value, item by item:

- "fail": the item under the strategy the case's Trainer config names (ddp when none; the
  contract's first strategy when it has no item there) must fail; the contract's other items may
  show anything but an error (a fault may belong to one strategy).
- "pass": every item passes, or skips because the strategy does not apply, or (on a faulty case)
  is a consequence of that case's own fault stopping the run; a not-judged premise is no pass, and
  a contract none of whose items judged anything compared nothing, which is no pass either.
- "advisory": as "pass", advisory counting as well.
- "nofail": anything but a failure or an error: passed, advisory, not judged or skipped with a
  stated reason, or stopped by the case's own code (never on an ``ok_`` case).
- a contract EXPECTED does not name, on a conforming case: anything but a failure, an error or a
  stop. On a conforming case no "pass" may be left unjudged by another item's failure either.

A contract with no CPU item (launch-env: multi-node only) is judged in the local world as before;
``--as-user`` shows it as unavailable (a local run has no item of it; the report counts its tier
under ``not_run``).

Each item is then right, wrong, error, skipped (an accepted skip, not judged or stop) or unchecked
(an item of a faulty case's contract that EXPECTED does not name, ``--as-user`` only). The
command prints a table (case, contract, strategy, expected, got, status), the detection rate
(true positives: the deciding item of each "fail"; true negatives: every other checked item), one
line per strategy with its counts, and every skip with its reason; while it runs, one line per
case on stderr (``[12/111] sync-dist/monitor_rank_zero_only.py 14 s``). Items that other work
is fixing are listed in ``known_failing.txt`` beside the cases (``read_known``) and show as
"known", with the reason. Exit status 0 when no other item is wrong or an error.

By default every case is judged in this process's persistent world pool: its ranks are forked
from one parent that imported Lightning once, so a world a failing case tears down is replaced by
a fork (``--launcher spawn``: by fresh interpreters, one import per rank). ``--as-user`` instead runs
``pytest --ltconform CASE.py:Model [--ltconform-datamodule ...] [--ltconform-trainer ...]
--ltconform-report JSON`` per case, with default options, in an empty folder, exactly as a user
would, and judges the report's items by the same rules: what a user sees, at the price of one
cold start per case.
"""


from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import glob
import json
import os
import sys
import time

from . import contracts
from .outcomes import Outcome
from .settings import Settings
from .vocabulary import LAUNCHERS


@dataclasses.dataclass
class Case:
    path: str
    name: str
    expected: dict
    evidence: str
    has_datamodule: bool
    has_trainer: bool
    strategy: str
    nodes: int = 0  # NODES: the fault shows only on a world of this many nodes (the nodes tier decides it)

    @property
    def conforming(self) -> bool:
        """A case named ``ok_*``, or whose EXPECTED says only "pass" or "advisory" (a demo), conforms:
        no item of any contract may fail on it."""
        return os.path.basename(self.path).startswith("ok_") or \
            all(v in (Got.PASS, Got.ADVISORY) for v in self.expected.values())


def discover(paths: list[str]) -> list[str]:
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += sorted(glob.glob(os.path.join(p, "**", "*.py"), recursive=True))
        else:
            found.append(p)
    return [f for f in found if not os.path.basename(f).startswith(("_", "run_plain", "conftest"))]


def read_case(path: str) -> Case | None:
    """Read a case's declarations without running its module body in this process."""
    import ast

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    names: dict = {}
    defined = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id in ("EXPECTED", "EVIDENCE", "STRATEGY", "NODES"):
                    try:
                        names[t.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            defined.add(node.name)
        if isinstance(node, ast.ImportFrom):
            defined.update(alias.asname or alias.name for alias in node.names)
        if isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    if "EXPECTED" not in names or "Model" not in defined:
        return None
    # "<contract folder>/<case>", wherever the corpus lies (conformance/, shared cases).
    name = "/".join(os.path.splitext(os.path.abspath(path))[0].split(os.sep)[-2:])
    return Case(path=os.path.abspath(path), name=name, expected=names["EXPECTED"],
                evidence=names.get("EVIDENCE", ""), has_datamodule="DataModule" in defined,
                has_trainer="trainer_kwargs" in defined, strategy=names.get("STRATEGY", ""),
                nodes=int(names.get("NODES", 0) or 0))


def judge_case(case: Case, pool, settings: Settings, only: str | None = None,
               strategies: tuple[str, ...] | None = None, named_only: bool = False) -> list[dict]:
    """One row per item a default ``pytest --ltconform`` run creates for the case and the corpus
    checks: every contract EXPECTED names, and on a conforming (``ok_``) case every other contract
    too; each under every CPU strategy of ``strategies`` (default: the ones a default run has)."""
    from .session import LtconformSession
    from .target import spec as target_spec

    try:
        targets = _validate(case, pool, settings)
    except target_spec.TargetError as exc:
        return [_target_error_row(case, c, str(exc)) for c in case.expected if only in (None, c)]
    if not case.strategy:
        case.strategy = _configured_strategy(targets)
    session = LtconformSession(settings, targets, pool=pool)
    rows = []
    # Registry order, as pytest orders the items: the first item judged on a run that stopped in
    # the user's own code is the one that shows that failure.
    for cid, labels in case_items(case, targets, only, strategies, named_only, settings.nodes):
        group = []
        for label in labels:
            verdict, duration = session.verdict(cid, *variant_of(label))
            group.append(_row(case, cid, label, got_of(verdict), verdict.render(), duration,
                              consequence=verdict.category == "consequence", said=verdict.as_dict()))
        _mark_keys(case, group)
        rows += group
    return rows


def _validate(case: Case, pool, settings: Settings):
    """The case's ``target.spec.ResolvedTarget``, checked in a process forked from the CPU world's
    fork parent as ``pytest --ltconform`` does (this process then imports neither the case nor
    torch), else here. Raises ``target.spec.TargetError``."""
    from . import tiers, validation
    from .target import validation as target_validation
    from .world import WorldStartError

    kwargs = {"model": f"{case.path}:Model",
              "datamodule": f"{case.path}:DataModule" if case.has_datamodule else None,
              "trainer": f"{case.path}:trainer_kwargs" if case.has_trainer else None}
    try:  # None under the spawn launcher
        cpu = tiers.get("cpu")
        world = cpu.world(pool, None, cpu.layout(settings.world_size), settings.pg_timeout_s)
        resolved = validation.validate_forked(world, kwargs, {})
    except WorldStartError:
        resolved = None  # the parent cannot start: validate here; the first run says why
    if resolved is not None:
        return resolved
    with validation.cuda_named_on_cpu():
        return target_validation.validate(**kwargs)


def item_strategies() -> tuple[str, ...]:
    """The CPU strategies a default run has items for here (deepspeed when installed)."""
    from .sharded import deepspeed_installed
    from .vocabulary import CPU_STRATEGIES

    return tuple(s for s in CPU_STRATEGIES if s != "deepspeed" or deepspeed_installed())


def variant_of(label: str) -> tuple[str, str]:
    """(strategy, tier) of an item label: ``ddp`` is ('ddp', 'cpu'), ``ddp-2nodes`` ('ddp', 'nodes')."""
    strategy, _, rest = label.partition("-")
    return (strategy, "nodes") if rest.endswith("nodes") and rest != "multinode" else (label, "cpu")


def local_label(label: str) -> bool:
    """Whether an item label names a local CPU world this machine runs (one node or several)."""
    from .vocabulary import CPU_STRATEGIES

    strategy, tier = variant_of(label)
    return strategy in CPU_STRATEGIES and tier in ("cpu", "nodes")


def case_items(case: Case, targets, only: str | None, strategies: tuple[str, ...] | None = None,
               named_only: bool = False, nodes="default"):
    """(contract id, [strategy, ...]) of the case's checked items, in item order, as the plugin
    creates them (``tiers.variants`` on the CPU tier, ``configured_only`` strategies where the
    Trainer config names them). ``named_only`` (``--matrix named``) keeps the contracts EXPECTED
    names: a "fail" under the strategy that decides it (``key_strategy``), any other under ddp and
    the strategy the case's config names, plus fsdp on an ``ok_`` case (else its first strategy); the
    nodes tier's item of the configured strategy where the case says its fault needs nodes (``NODES``)
    or the contract has no other. Labels are the items' (``ddp``, ``ddp-2nodes``); ``nodes`` the
    nodes tier's layout (None: no such items)."""
    from . import tiers
    from .vocabulary import CPU_STRATEGIES

    strategies = item_strategies() if strategies is None else strategies
    if nodes == "default":
        from .settings import default_nodes

        nodes = default_nodes()
    for cid in contracts.ids():
        every_contract = case.conforming and not named_only
        if (only is not None and cid != only) or (cid not in case.expected and not every_contract):
            continue
        contract = contracts.get_contract(cid)
        found = [v.label for v in tiers.variants(contract, strategies, CPU_STRATEGIES, nodes)
                 if v.tier in ("cpu", "nodes") and (v.strategy not in contract.configured_only or
                                                    targets.configures(v.strategy))
                 and (not v.configured_only or targets.configures(v.strategy))]
        if not found and cid in case.expected:
            # No local item (launch-env with --ltconform-nodes 1): judged in the local world as before.
            found = list(contract.strategies[:1])
        elif named_only:
            found = _named_labels(case, cid, found)
        if found:
            yield cid, found


def _named_labels(case: Case, cid: str, found: list[str]) -> list[str]:
    """The labels of ``found`` the cheaper matrix keeps (see :func:`case_items`)."""
    from .vocabulary import CPU_CORE_STRATEGIES

    configured = case.strategy or "ddp"
    on_nodes = [s for s in found if variant_of(s)[1] == "nodes" and variant_of(s)[0] == configured]
    plain = [s for s in found if variant_of(s)[1] == "cpu"]
    if case.expected.get(cid) == "fail":
        key = key_strategy("fail", configured, on_nodes if (case.nodes or not plain) and on_nodes else plain)
        return [key] if key else []
    named = ("ddp", configured) + (CPU_CORE_STRATEGIES if case.conforming else ())
    kept = [s for s in plain if s in named] or plain[:1]
    return kept + (on_nodes[:1] if case.nodes or not plain else [])


def _target_error_row(case: Case, cid: str, message: str) -> dict:
    row = _row(case, cid, case.strategy or "ddp", Got.ERROR, message, 0.0)
    row["matched"] = False
    return row


def _mark_keys(case: Case, group: list[dict]) -> None:
    """Mark the item that decides a "fail" expectation, then judge the group's rows. Of the
    configured strategy's items (one node, several nodes) the one that failed decides: a fault that
    only a second node shows fails only there (``NODES`` names that layout when none failed)."""
    if not group:
        return
    configured = case.strategy or "ddp"
    labels = [r["strategy"] for r in group]
    key = key_strategy(group[0]["expected"], configured, labels)
    same = [r for r in group if variant_of(r["strategy"])[0] == variant_of(key or "")[0]]
    failed = [r["strategy"] for r in same if r["got"] == "fail"]
    on_nodes = [r["strategy"] for r in same if variant_of(r["strategy"])[1] == "nodes"]
    if key is not None and failed:
        key = failed[0]
    elif key is not None and (case.nodes or variant_of(key)[1] == "nodes") and on_nodes:
        key = on_nodes[0]
    for r in group:
        r["key"] = r["strategy"] == key
    mark_group(group)


def _configured_strategy(targets) -> str:
    """The strategy a case's own Trainer config names, as an item strategy: 'fsdp' for FSDP;
    'deepspeed' for DeepSpeed where deepspeed is importable (else 'fsdp', the CPU sharded tier).
    Read off the validated target (``strategy_names``): nothing of the case is imported here."""
    from .sharded import deepspeed_installed

    names = targets.strategy_names
    for kind in ("deepspeed", "fsdp"):
        # A registered name ('deepspeed_stage_3') or a strategy object of that class or a subclass.
        if f"{kind}strategy" in names or (len(names) == 1 and names[0].startswith(kind)):
            return "fsdp" if kind == "deepspeed" and not deepspeed_installed() else kind
    return "ddp"


class Got(enum.StrEnum):
    """What an item's verdict counts as in the corpus (see :func:`got_of_fields`); an EXPECTED
    value ('fail', 'pass', 'advisory', 'nofail') is met by some of these (:data:`ACCEPTED`)."""

    FAIL = "fail"
    PASS = "pass"
    ADVISORY = "advisory"
    CONSEQUENCE = "consequence"
    NOT_JUDGED = "notjudged"
    SKIPPED = "skipped"
    UNAVAILABLE = "unavailable"
    STOPPED = "stopped"
    ERROR = "error"


class Status(enum.StrEnum):
    """How a row stands against its case's EXPECTED value (see :func:`status_of`)."""

    RIGHT = "right"
    WRONG = "wrong"
    ERROR = "error"
    SKIPPED = "skipped"
    UNCHECKED = "unchecked"
    KNOWN = "known"


# What an item's verdict counts as against the case's EXPECTED value (shared/cases/README.md),
# judged on every item a default run creates for the case (see the module doc for the rule).
ACCEPTED = {"fail": (Got.FAIL, Got.UNAVAILABLE),
            "pass": (Got.PASS, Got.SKIPPED, Got.CONSEQUENCE, Got.UNAVAILABLE),
            "advisory": (Got.ADVISORY, Got.PASS, Got.SKIPPED, Got.CONSEQUENCE, Got.UNAVAILABLE),
            "nofail": (Got.PASS, Got.ADVISORY, Got.NOT_JUDGED, Got.CONSEQUENCE, Got.SKIPPED, Got.STOPPED,
                       Got.UNAVAILABLE)}
# An item of a faulty case's contract under a strategy other than the one that shows the fault.
OTHER_STRATEGY = (Got.FAIL, Got.PASS, Got.ADVISORY, Got.NOT_JUDGED, Got.CONSEQUENCE, Got.SKIPPED, Got.STOPPED,
                  Got.UNAVAILABLE)
# An item of a conforming (ok_) case's contract that EXPECTED does not name.
UNNAMED_ON_OK = (Got.PASS, Got.ADVISORY, Got.NOT_JUDGED, Got.CONSEQUENCE, Got.SKIPPED, Got.UNAVAILABLE)
# Values that judged nothing: a contract whose items all have one of these passed nothing.
NOTHING_JUDGED = (Got.SKIPPED, Got.NOT_JUDGED, Got.CONSEQUENCE, Got.STOPPED, Got.UNAVAILABLE)


def got_of(verdict) -> str:
    """The verdict as a corpus value (``Verdict`` or a JSON report record)."""
    get = verdict.get if isinstance(verdict, dict) else lambda k: getattr(verdict, k)
    return got_of_fields(get("outcome"), get("summary") or "", get("category"))


def got_of_fields(outcome: str, summary: str, category: str | None) -> str:
    """fail, advisory, pass; consequence (not judged because another item's failure stopped the
    shared run); notjudged (a skip that says "not judged" and why: a premise that does not hold);
    skipped (the strategy does not apply to the case); unavailable (the item's tier cannot run on
    this machine); stopped (an error because the user's own code stopped the run); error (the
    plugin could not judge)."""
    outcome = Outcome.read(outcome, summary)
    if outcome is Outcome.FAILED:
        return Got.FAIL
    if outcome in (Outcome.ADVISORY, Outcome.PASSED):
        return {Outcome.ADVISORY: Got.ADVISORY, Outcome.PASSED: Got.PASS}[outcome]
    if outcome.skips:
        if category in ("consequence", "unavailable"):  # the categories of those two kinds of skip
            return Got(category)
        return Got.NOT_JUDGED if outcome is Outcome.NOT_JUDGED else Got.SKIPPED
    return Got.STOPPED if category == "crash" else Got.ERROR


def accepted(expected: str | None, key: bool, conforming: bool) -> tuple[str, ...]:
    """The corpus values that meet ``expected`` on one item; ``key`` marks the item that must show
    a case's fault (see ``key_strategy``); a conforming case's own code never stops a run."""
    if expected is None:
        return UNNAMED_ON_OK if conforming else OTHER_STRATEGY + (Got.ERROR,)
    if expected == "fail" and not key:
        return OTHER_STRATEGY
    allowed = ACCEPTED.get(expected, (expected,))
    if not conforming:
        return allowed
    # Nothing may stop a conforming case's run, nor leave its "pass" unjudged.
    return tuple(g for g in allowed if g != Got.STOPPED and (expected == "nofail" or g != Got.CONSEQUENCE))


def key_strategy(expected: str, configured: str, strategies: list[str]) -> str | None:
    """The item of a contract whose verdict decides a "fail" expectation: the strategy the case's
    Trainer config names (ddp when it names none), on one node where it has that item, else on
    several; else the contract's first."""
    if expected != "fail" or not strategies:
        return None
    if configured in strategies:
        return configured
    return next((s for s in strategies if variant_of(s)[0] == configured), strategies[0])


def mark_group(rows: list[dict]) -> None:
    """Set ``matched`` on the rows of one (case, contract): each row by ``accepted``; a "pass" or
    "advisory" expectation also needs one item that judged something (all skipped is no pass)."""
    for r in rows:
        r["matched"] = r["got"] in accepted(r["expected"], r.get("key", False), r.get("conforming", False))
    if all(r["got"] == Got.UNAVAILABLE for r in rows):
        return  # no item of it can run on this machine: said, with the reason, as skipped
    if rows and rows[0]["expected"] in (Got.PASS, Got.ADVISORY) and all(r["got"] in NOTHING_JUDGED for r in rows):
        for r in rows:
            r["matched"] = False
            r["why"] = "no item judged anything: a pass that compared nothing"


def status_of(row: dict) -> str:
    """right, wrong, error, skipped (an accepted skip or not-judged item), unchecked (an item
    of a faulty case's contract that EXPECTED does not name) or known (wrong or an error, and
    listed in the corpus's known_failing.txt)."""
    if row["expected"] is None and not row.get("conforming"):
        return Status.UNCHECKED
    if row.get("known") and not row["matched"]:
        return Status.KNOWN
    if row["got"] == Got.ERROR:
        return Status.ERROR
    if not row["matched"]:
        return Status.WRONG
    return Status.SKIPPED if row["got"] in NOTHING_JUDGED else Status.RIGHT


def _row(case: Case, cid: str, strategy: str, got: str, message: str, duration: float,
         consequence: bool = False, said: dict | None = None) -> dict:
    """One item's row; ``said``: its verdict's record (a ``Verdict.as_dict()`` or a JSON report
    record), whose ``evidence`` and ``claims`` the row keeps for the consistency check."""
    said = said or {}
    return {"case": case.name, "contract": cid, "strategy": strategy, "expected": case.expected.get(cid),
            "got": got, "matched": False, "key": False, "conforming": case.conforming,
            "consequence": consequence, "message": message,
            "evidence": said.get("evidence") or [], "claims": said.get("claims") or [],
            "evidence_expected": case.evidence, "duration_s": round(duration, 3)}


def rates(rows: list[dict]) -> dict:
    """True positives (the key item of a "fail" expectation failed) and true negatives (every other
    checked item met its rule), the misses and false positives, the items not judged because of
    another item's failure, and the count per status (``status_of``)."""
    judged = [r for r in rows if r["got"] != Got.UNAVAILABLE]  # items this machine cannot run count in neither
    pos = [r for r in judged if r["expected"] == "fail" and r.get("key")]
    neg = [r for r in judged if r["expected"] not in ("fail", None) or (r["expected"] is None and r.get("conforming"))]
    statuses = collections.Counter(status_of(r) for r in rows)
    return {"true_positives": sum(r["got"] == Got.FAIL for r in pos), "positives": len(pos),
            "true_negatives": sum(bool(r["matched"]) for r in neg), "negatives": len(neg),
            "false_positives": sum(r["got"] == Got.FAIL for r in neg),
            "misses": sum(r["got"] in (Got.PASS, Got.ADVISORY) for r in pos),
            "not_judged_because_of_another_item": sum(bool(r.get("consequence")) for r in rows),
            "errors": statuses[Status.ERROR], "statuses": {str(k): n for k, n in statuses.items()}}


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.0f}% ({a}/{b})" if b else "n/a (0 cases)"


def print_table(rows: list[dict], verbose: bool = False) -> None:
    """The table (a row per item), then the rates, one line per strategy, and every skip with its
    reason."""
    width = max([len(r["case"]) for r in rows] + [4])
    print(f"{'case':<{width}}  {'contract':<18} {'strategy':<9} {'expected':<8} {'got':<9} status")
    for r in rows:
        status = status_of(r)
        mark = {Status.WRONG: "   <-- MISMATCH", Status.ERROR: "   <-- MISMATCH",
                Status.KNOWN: "   <-- known failing"}.get(status, "")
        print(f"{r['case']:<{width}}  {r['contract']:<18} {r['strategy']:<9} {str(r['expected'] or '-'):<8} "
              f"{r['got']:<9} {status}{mark}")
        if verbose or status in (Status.WRONG, Status.ERROR, Status.KNOWN):
            why = [r[k] for k in ("known", "why") if r.get(k)]
            for line in why + r["message"].splitlines():
                print(f"    {line}")
    rate = rates(rows)
    print()
    print(f"detection rate: true positives {_pct(rate['true_positives'], rate['positives'])}, "
          f"true negatives {_pct(rate['true_negatives'], rate['negatives'])}; "
          f"false positives {rate['false_positives']}, misses {rate['misses']}, errors {rate['errors']}; "
          f"not judged because of another item: {rate['not_judged_because_of_another_item']}")
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        counts = collections.Counter(status_of(r) for r in rows if r["strategy"] == strategy)
        print(f"[{strategy}] " + ", ".join(f"{k} {counts[k]}" for k in STATUSES if counts[k]))
    for r in rows:
        if r["got"] in NOTHING_JUDGED:
            print(f"{r['got']}: {r['case']} {r['contract']}[{r['strategy']}]: {_first_line(r['message'])}")


STATUSES = tuple(Status)


def sentence_problems(rows: list[dict]) -> list[str]:
    """Every sentence of every row that its recorded facts do not bear out (``claims.check``), as
    "<case> <contract>[<strategy>]: <problem>"."""
    from . import claims

    return [f"{r['case']} {r['contract']}[{r['strategy']}]: {p}" for r in rows for p in claims.check(r)]


def print_sentence_problems(rows: list[dict]) -> None:
    problems = sentence_problems(rows)
    print(f"sentences: {len(problems)} not borne out by their recorded facts" + (":" if problems else ""))
    for line in problems:
        print(f"    {line}")


def read_known(paths: list[str]) -> dict:
    """{(case name, contract or "*"): why} from ``known_failing.txt`` in each folder of ``paths``:
    lines ``<contract folder>/<case> <contract|*> <why>`` ("#" starts a comment). Such items still
    show in the table, as "known", and do not make the command fail."""
    known = {}
    for folder in paths:
        listing = os.path.join(folder, "known_failing.txt")
        if not os.path.isfile(listing):
            continue
        with open(listing, encoding="utf-8") as fh:
            for line in fh:
                parts = line.split("#", 1)[0].split(None, 2)
                if len(parts) == 3:
                    known[(parts[0], parts[1])] = parts[2].strip()
    return known


def mark_known(rows: list[dict], known: dict) -> None:
    for r in rows:
        why = known.get((r["case"], r["contract"])) or known.get((r["case"], "*"))
        if why:
            r["known"] = why


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pytest_ltconform.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["conformance"], help="case files or folders (default: conformance)")
    ap.add_argument("--contract", help="judge only this contract id")
    ap.add_argument("--json", help="write the rows and rates to this file")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run (default 60)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--strategies", help="comma-separated CPU strategies to judge (default: every one a "
                                         "default run has here: ddp,fsdp and deepspeed when installed)")
    ap.add_argument("--matrix", choices=("full", "named"), default="full",
                    help="full (default): every item a default run has; named: the contracts EXPECTED names, "
                         "under ddp and the strategy the case's config names, plus fsdp on ok_ cases (the "
                         "default test suite's cheaper tier)")
    ap.add_argument("--as-user", action="store_true",
                    help="run `pytest --ltconform CASE.py:Model ...` per case exactly as a user would, with "
                         "default options, and judge its JSON report (see the module doc)")
    ap.add_argument("--case-timeout", type=float, default=1800.0,
                    help="--as-user: seconds one case's pytest run may take (default 1800)")
    ap.add_argument("--keep-reports", metavar="DIR", help="--as-user: copy each case's JSON report and output here")
    ap.add_argument("--jobs", type=int, default=1, help="--as-user: cases run at a time (default 1)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every verdict's message")
    ap.add_argument("--launcher", choices=LAUNCHERS, default=LAUNCHERS[0],
                    help="how worlds start their ranks: fork (default; from one parent that imported Lightning "
                         "once) or spawn (a fresh interpreter per rank), as --ltconform-launcher")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cases = [c for c in map(read_case, discover(args.paths)) if c is not None]
    if not cases:
        print(f"no cases found under {', '.join(args.paths)} (a case defines Model and EXPECTED)", file=sys.stderr)
        return 2
    # Cases keep their unguarded script part behind CASE_TOPLEVEL_TRAIN so that run_plain.py can
    # import them; the checker must see the module as the user wrote it (set before the pool starts).
    os.environ.setdefault("CASE_TOPLEVEL_TRAIN", "1")
    strategies = _strategies(args.strategies)
    started = time.monotonic()
    if args.as_user:
        rows, cold = judge_as_user(cases, args.case_timeout, args.contract, args.jobs, args.keep_reports), None
    else:
        rows, cold = _judge_in_pool(cases, args, strategies)
    elapsed = time.monotonic() - started
    mark_known(rows, read_known(args.paths))
    print_table(rows, args.verbose)
    print_sentence_problems(rows)
    starts = f" with {cold} world start(s)" if cold is not None else " (one pytest run per case)"
    print(f"{len(cases)} cases, {len(rows)} verdicts in {elapsed:.1f} s{starts}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "rates": rates(rows), "sentence_problems": sentence_problems(rows),
                       "elapsed_s": elapsed, "world_starts": cold}, fh, indent=2)
    return 0 if all(status_of(r) not in (Status.WRONG, Status.ERROR) for r in rows) else 1


def _strategies(text: str | None) -> tuple[str, ...] | None:
    from .vocabulary import CPU_STRATEGIES

    if not text:
        return None
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in chosen if s not in CPU_STRATEGIES]
    if bad:
        raise SystemExit(f"--strategies {text!r}: unknown strategy {', '.join(bad)}; choose from "
                         f"{', '.join(CPU_STRATEGIES)}")
    return chosen


def _judge_in_pool(cases: list[Case], args, strategies) -> tuple[list[dict], int]:
    """Every case in one persistent world pool; a progress line per case on stderr."""
    from .world import WorldPool

    settings = Settings(target="corpus", world_size=args.world_size, timeout_s=args.timeout)
    pool = WorldPool(launcher=args.launcher, preload=contracts.preload(strategies or item_strategies()))
    rows: list[dict] = []
    try:
        for i, case in enumerate(cases, 1):
            case_started = time.monotonic()
            rows += judge_case(case, pool, settings, args.contract, strategies, args.matrix == "named")
            # Progress on stderr, a line per case, so that stdout stays the table alone.
            print(f"[{i}/{len(cases)}] {case.name}.py {time.monotonic() - case_started:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        cold = pool.cold_starts
        pool.close()
    return rows, cold


# -- as a user runs it ---------------------------------------------------------------------------

def user_argv(case: Case, report: str) -> list[str]:
    """The command a user runs on the case: default options, every CPU strategy."""
    argv = [sys.executable, "-m", "pytest", "--ltconform", f"{case.path}:Model"]
    if case.has_datamodule:
        argv += ["--ltconform-datamodule", f"{case.path}:DataModule"]
    if case.has_trainer:
        argv += ["--ltconform-trainer", f"{case.path}:trainer_kwargs"]
    return argv + ["--ltconform-report", report]


def judge_as_user(cases: list[Case], timeout_s: float, only: str | None = None, jobs: int = 1,
                  keep: str | None = None) -> list[dict]:
    """Rows from one ``pytest --ltconform`` run per case (in an empty folder of its own, as a
    user's project), judged by the same rules as the corpus; ``jobs`` runs at a time. ``keep``: a
    folder that gets each case's JSON report and output as soon as its run ends."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: Case) -> tuple[list[dict], str, float]:
        import shutil
        import tempfile

        case_started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ltconform-as-user-") as folder:
            records, problem = _user_run(case, folder, timeout_s)
            if keep:
                os.makedirs(keep, exist_ok=True)
                stem = os.path.join(keep, case.name.replace("/", "__"))
                for name in ("report.json", "output.txt"):
                    if os.path.exists(os.path.join(folder, name)):
                        shutil.copy(os.path.join(folder, name), f"{stem}.{name}")
        return records, problem, time.monotonic() - case_started

    rows: list[dict] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as runner:
        for i, (case, (records, problem, took)) in enumerate(zip(cases, runner.map(one, cases)), 1):
            rows += rows_from_records(case, records, problem, only)
            print(f"[{i}/{len(cases)}] {case.name}.py {took:.0f} s", file=sys.stderr, flush=True)
    return rows


def _user_run(case: Case, folder: str, timeout_s: float) -> tuple[list[dict], str]:
    """The JSON report's records of one user run, or [] and what went wrong."""
    import subprocess

    report = os.path.join(folder, "report.json")
    try:
        proc = subprocess.run(user_argv(case, report), cwd=folder, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"the pytest run took longer than {timeout_s:.0f} s (--case-timeout)"
    with open(os.path.join(folder, "output.txt"), "w", encoding="utf-8") as fh:
        fh.write(proc.stdout)
    if not os.path.exists(report):
        return [], f"pytest exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}"
    with open(report, encoding="utf-8") as fh:
        return json.load(fh).get("results", []), ""


def rows_from_records(case: Case, records: list[dict], problem: str = "", only: str | None = None) -> list[dict]:
    """One row per report record (every item of the run), plus an error row for each contract
    EXPECTED names that has no item; rows of one contract are judged together."""

    if not case.strategy:
        case.strategy = _configured_strategy_of(case)
    groups: dict[str, list[dict]] = {}
    for rec in records:
        # The JSON report also lists the GPU and multi-node items this machine did not create.
        if local_label(rec["strategy"]) and only in (None, rec["contract"]):
            got = got_of(rec)
            groups.setdefault(rec["contract"], []).append(
                _row(case, rec["contract"], rec["strategy"], got, rec.get("message") or "", rec.get("duration_s", 0.0),
                     consequence=rec.get("category") == "consequence", said=rec))
    for cid in case.expected:
        # A contract without CPU items (launch-env: multi-node only) has no record in a local run:
        # the report counts its tier under not_run, so it shows as unavailable, not as missing.
        cpu = "cpu" in getattr(contracts.get_contract(cid), "tiers", ("cpu",))
        if cid not in groups and not cpu and only in (None, cid):
            groups[cid] = [_row(case, cid, "ddp-multinode", "unavailable", "a multi-node-only contract: a local "
                                "run has no item of it (the report counts its tier under not_run)", 0.0)]
    rows = []
    for group in groups.values():
        _mark_keys(case, group)
        rows += group
    for cid in case.expected:
        if cid not in groups and only in (None, cid):
            rows.append(_target_error_row(case, cid, problem or "the run has no item of this contract"))
    return rows


def _configured_strategy_of(case: Case) -> str:
    from .target import spec as target_spec
    from .target import validation as target_validation
    from .validation import cuda_named_on_cpu

    try:
        with cuda_named_on_cpu():
            targets = target_validation.validate(
                f"{case.path}:Model", f"{case.path}:DataModule" if case.has_datamodule else None,
                f"{case.path}:trainer_kwargs" if case.has_trainer else None)
    except target_spec.TargetError:
        return "ddp"
    return _configured_strategy(targets)


if __name__ == "__main__":
    sys.exit(main())
