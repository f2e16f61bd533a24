"""Seams between the layers (issue 18): what the pytest side may import of the rank side, and
the greps the issue's done-when names."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).parents[1] / "src" / "pytest_ltconform"


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, relative imports as written (``.harness``), in functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            joiner = "" if base.endswith(".") else "."
            found |= {base} | {base + joiner + a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_pytest_side_reads_the_run_interface_from_runs_not_the_harness():
    # The header says what a run replaces (trainer_overrides), the session and the contracts' base
    # declare runs (runs.py): none of them needs the rank-side harness.
    for name in ("header.py", "session.py", "runs.py", "trainer_overrides.py", "contracts/base.py",
                 "contracts/__init__.py", "controller.py", "items.py"):
        assert not {m for m in _imports(SRC / name) if m.rsplit(".", 1)[-1] == "harness"}, name


def test_the_session_branches_on_no_tier_and_reads_no_run_attribute_by_name():
    text = (SRC / "session.py").read_text()
    assert "tier ==" not in text and "getattr(" not in text
    assert not any('startswith("not judged' in p.read_text() for p in SRC.rglob("*.py"))


def test_several_findings_merge_into_the_first():
    from pytest_ltconform.contracts.base import Evidence, Verdict, merged

    def finding(n):
        return Verdict(contract="x", outcome="failed", summary=f"finding {n}", evidence=[Evidence(f"e{n}")],
                       notes=[f"note {n}"])

    first = merged([finding(1), finding(2), finding(3)], ["after"])
    assert first.summary == "finding 1"
    assert [e.detail for e in first.evidence] == ["e1", "e2", "e3"]
    assert first.notes == ["finding 2", "finding 3", "note 1", "after"]
