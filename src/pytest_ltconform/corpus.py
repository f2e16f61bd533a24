"""Run the checker over the conformance corpus and measure it.

    python -m pytest_ltconform.corpus [PATH ...] [--contract ID] [--json OUT] [--timeout S]

Each case file (``conformance/<contract>/<case>.py``) defines ``Model`` (and optionally
``DataModule`` and ``trainer_kwargs``) plus ``EXPECTED = {contract id: "pass" | "fail" | "advisory" |
"nofail"}`` (see ``ACCEPTED``).
Every case is judged in the same persistent world pool (one cold start for the corpus, plus
one per world a hanging case tears down), and the command prints a table (case, contract,
expected, got) and the detection rate: true positives and true negatives separately; while it
runs, one line per case on stderr (``[12/111] sync-dist/monitor_rank_zero_only.py 14 s``). Exit
status 0 when every expectation holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

from . import contracts
from .settings import Settings


@dataclasses.dataclass
class Case:
    path: str
    name: str
    expected: dict
    evidence: str
    has_datamodule: bool
    has_trainer: bool
    strategy: str


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
                if isinstance(t, ast.Name) and t.id in ("EXPECTED", "EVIDENCE", "STRATEGY"):
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
    rel = os.path.relpath(path)
    name = os.path.splitext(rel)[0].replace(os.sep, "/")
    if name.startswith("conformance/"):
        name = name[len("conformance/"):]
    return Case(path=os.path.abspath(path), name=name, expected=names["EXPECTED"],
                evidence=names.get("EVIDENCE", ""), has_datamodule="DataModule" in defined,
                has_trainer="trainer_kwargs" in defined, strategy=names.get("STRATEGY", ""))


def judge_case(case: Case, pool, settings: Settings, only: str | None = None,
               skipped: list | None = None) -> list[dict]:
    """Verdicts for every registered contract the case states an expectation for; items of an
    extra strategy that skip (the tier does not apply to the case) go to ``skipped``."""
    skipped = [] if skipped is None else skipped
    from . import target as target_mod
    from .session import LtconformSession
    from .vocabulary import CPU_CORE_STRATEGIES

    rows = []
    # Registry order, as pytest orders the items: the first item judged on a run that stopped in
    # the user's own code is the one that shows that failure.
    wanted = [c for c in contracts.ids() if c in case.expected and (only is None or c == only)]
    if not wanted:
        return rows
    try:
        targets = target_mod.validate(
            f"{case.path}:Model",
            f"{case.path}:DataModule" if case.has_datamodule else None,
            f"{case.path}:trainer_kwargs" if case.has_trainer else None,
        )
    except target_mod.TargetError as exc:
        return [{"case": case.name, "contract": c, "strategy": case.strategy or "ddp", "expected": case.expected[c],
                 "got": "error", "outcome": "error", "message": str(exc), "duration_s": 0.0} for c in wanted]
    session = LtconformSession(settings, targets, pool=pool)
    conforming = all(v != "fail" for v in case.expected.values())
    if not case.strategy:
        case.strategy = _configured_strategy(targets)
    for cid in wanted:
        contract = contracts.get_contract(cid)
        if conforming:
            # A conforming case must pass under every strategy the contract runs under; DeepSpeed
            # only where the case's config names it (a DeepSpeed world costs more than the others).
            strategies = [s for s in contract.strategies if s in CPU_CORE_STRATEGIES or s == case.strategy]
        elif case.expected[cid] == "fail" and case.strategy in contract.strategies:
            # The fault shows where the case's own config runs it (e.g. a sharded checkpoint).
            strategies = [case.strategy]
        else:
            strategies = [contract.strategies[0]]
        for strategy in strategies:
            verdict, duration = session.verdict(cid, strategy)
            if conforming and verdict.outcome == "skipped" and strategy != strategies[0]:
                skipped.append(f"{case.name} {cid}[{strategy}]: {verdict.summary}")
                continue  # a tier that does not apply to this case is not a verdict on it
            rows.append(_row(case, cid, strategy, verdict, duration))
    return rows


def _configured_strategy(targets) -> str:
    """The strategy a case's own Trainer config names, as an item strategy: 'fsdp' for FSDP;
    'deepspeed' for DeepSpeed where deepspeed is importable (else 'fsdp', the CPU sharded tier)."""
    from . import target as target_mod
    from .sharded import deepspeed_installed, deepspeed_stand_in, sharded_kind

    if targets.trainer is None:
        return "ddp"
    try:
        with deepspeed_stand_in():
            kwargs = target_mod.trainer_kwargs(targets.trainer)
    except Exception:
        return "ddp"
    kind = sharded_kind(kwargs.get("strategy"))
    if kind == "deepspeed" and deepspeed_installed():
        return "deepspeed"
    return "fsdp" if kind else "ddp"


# What a verdict counts as against a case's EXPECTED value (shared/cases/README.md): "pass" needs
# a pass; "advisory" (waste that breaks nothing) an advisory or a pass; "nofail" anything but a
# failure or an error, a verdict not judged for a stated reason included.
ACCEPTED = {"fail": ("fail",), "pass": ("pass",), "advisory": ("advisory", "pass"),
            "nofail": ("pass", "advisory", "notjudged")}


def got_of(verdict) -> str:
    """The verdict as a corpus value: fail, advisory, pass, notjudged (a premise that does not
    hold, another item's failure, or the user's own code stopping the run, each with its reason),
    skipped (the tier does not apply) or error (the run could not be judged)."""
    if verdict.outcome == "failed":
        return "fail"
    if verdict.outcome in ("advisory", "passed"):
        return {"advisory": "advisory", "passed": "pass"}[verdict.outcome]
    stated = verdict.category in ("consequence", "crash") or verdict.summary.startswith("not judged")
    return "notjudged" if stated else verdict.outcome


def _row(case: Case, cid: str, strategy: str, verdict, duration: float) -> dict:
    got = got_of(verdict)
    expected = case.expected[cid]
    return {"case": case.name, "contract": cid, "strategy": strategy, "expected": expected,
            "got": got, "matched": got in ACCEPTED.get(expected, (expected,)), "outcome": verdict.outcome,
            "consequence": verdict.category == "consequence", "message": verdict.render(),
            "evidence_expected": case.evidence, "duration_s": round(duration, 3)}


def rates(rows: list[dict]) -> dict:
    """True positives (expected fail, got fail) and true negatives (any other expectation,
    met), the misses and false positives, and how many verdicts were not judged because of
    another item's failure."""
    pos = [r for r in rows if r["expected"] == "fail"]
    neg = [r for r in rows if r["expected"] != "fail"]
    return {"true_positives": sum(r["got"] == "fail" for r in pos), "positives": len(pos),
            "true_negatives": sum(bool(r["matched"]) for r in neg), "negatives": len(neg),
            "false_positives": sum(r["got"] == "fail" for r in neg),
            "misses": sum(r["got"] in ("pass", "advisory") for r in pos),
            "not_judged_because_of_another_item": sum(bool(r.get("consequence")) for r in rows),
            "errors": sum(r["got"] == "error" for r in rows)}


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.0f}% ({a}/{b})" if b else "n/a (0 cases)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytest_ltconform.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["conformance"], help="case files or folders (default: conformance)")
    ap.add_argument("--contract", help="judge only this contract id")
    ap.add_argument("--json", help="write the rows and rates to this file")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run (default 60)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--verbose", "-v", action="store_true", help="print every verdict's message")
    args = ap.parse_args(argv)

    from .world import WorldPool

    cases = [c for c in map(read_case, discover(args.paths)) if c is not None]
    if not cases:
        print(f"no cases found under {', '.join(args.paths)} (a case defines Model and EXPECTED)", file=sys.stderr)
        return 2
    settings = Settings(target="corpus", world_size=args.world_size, timeout_s=args.timeout)
    # Cases keep their unguarded script part behind CASE_TOPLEVEL_TRAIN so that run_plain.py can
    # import them; the checker must see the module as the user wrote it (set before the pool starts).
    os.environ.setdefault("CASE_TOPLEVEL_TRAIN", "1")
    pool = WorldPool()
    rows: list[dict] = []
    skipped: list[str] = []
    started = time.monotonic()
    try:
        for i, case in enumerate(cases, 1):
            case_started = time.monotonic()
            rows += judge_case(case, pool, settings, args.contract, skipped)
            # Progress on stderr, a line per case, so that stdout stays the table alone.
            print(f"[{i}/{len(cases)}] {case.name}.py {time.monotonic() - case_started:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        cold = pool.cold_starts
        pool.close()
    elapsed = time.monotonic() - started
    width = max([len(r["case"]) for r in rows] + [4])
    print(f"{'case':<{width}}  {'contract':<18} {'strategy':<8} {'expected':<8} {'got':<8}")
    for r in rows:
        mark = "" if r["matched"] else "   <-- MISMATCH"
        print(f"{r['case']:<{width}}  {r['contract']:<18} {r['strategy']:<8} {r['expected']:<8} {r['got']:<8}{mark}")
        if args.verbose or not r["matched"]:
            for line in r["message"].splitlines():
                print(f"    {line}")
    rate = rates(rows)
    print()
    print(f"detection rate: true positives {_pct(rate['true_positives'], rate['positives'])}, "
          f"true negatives {_pct(rate['true_negatives'], rate['negatives'])}; "
          f"false positives {rate['false_positives']}, misses {rate['misses']}, errors {rate['errors']}; "
          f"not judged because of another item: {rate['not_judged_because_of_another_item']}")
    for line in skipped:
        print(f"skipped (tier does not apply): {line}")
    print(f"{len(cases)} cases, {len(rows)} verdicts in {elapsed:.1f} s with {cold} world start(s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "rates": rate, "elapsed_s": elapsed, "world_starts": cold}, fh, indent=2)
    return 0 if all(r["matched"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
