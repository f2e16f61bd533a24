"""Trace events are declared once (``events.declare``) and matched on their kind: no event name is
spelled as a string literal where an event is matched or made, outside its declaration."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).parents[1] / "src" / "pytest_ltconform"
# Where an event's kind is read: ``event.get("ev")``, ``event["ev"]``, a variable ``ev``, a call to
# ``events(...)`` or ``divergent_events()``.
_READS_KIND = re.compile(r"""\bev\b|['"]ev['"]|\bevents\(|divergent_events\(""")


def _declared() -> set[str]:
    """Every event name the package declares: the core ones and each contract's."""
    from pytest_ltconform import contracts, events

    for cid in contracts.ids():
        contracts.get_contract(cid)  # imports its probe, where its events are declared
    importlib.import_module("pytest_ltconform.contracts.loader_sites")
    importlib.import_module("pytest_ltconform.contracts.rank_reads")
    return set(events.declared())


def _strings(node) -> list[ast.Constant]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def _literal_matches(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of each place in ``tree`` that matches or makes an event by its name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                literal = [c for c in _strings(operand) if c.value in names]
                others = [ast.unparse(o) for o in operands if o is not operand]
                if literal and isinstance(operand, (ast.Constant, ast.Tuple, ast.Set, ast.List)) and \
                        any(_READS_KIND.search(o) for o in others):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("events"):
            if any(isinstance(a, ast.Constant) and a.value in names for a in node.args):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "ev" and isinstance(value, ast.Constant):
                    found.append((node.lineno, ast.unparse(node)[:120]))
    return found


def test_no_event_name_is_matched_or_made_as_a_string_literal_outside_its_declaration():
    names = _declared()
    assert {"hook", "call", "log", "stage", "strategy", "nonfinite"} <= names
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        for line, code in _literal_matches(ast.parse(path.read_text()), names):
            offenders.append(f"{path.relative_to(SRC)}:{line}: {code}")
    assert not offenders, "\n".join(offenders)


def test_the_check_finds_each_way_of_spelling_an_event_by_name():
    # The check above can fail: each form below is one it reports.
    names = {"hook", "log"}
    code = '''
a = e.get("ev") == "hook"
b = [x for x in t if x["ev"] in ("log", "other")]
c = run.events(0, "log")
d = "log" in run.divergent_events()
f = {"ev": "hook", "i": 1}
g = ev == "log"
ok = e.get("via") == "log"
'''
    lines = sorted(line for line, _ in _literal_matches(ast.parse(code), names))
    assert lines == [2, 3, 4, 5, 6, 7]


def test_a_kind_is_its_string_and_reads_its_own_events():
    from pytest_ltconform.events import HOOK, LOG, Kind

    event = HOOK.new(i=3, name="[LightningModule]M.training_step")
    assert event == {"ev": "hook", "i": 3, "name": "[LightningModule]M.training_step"}
    assert type(event["ev"]) is str and HOOK == "hook" and isinstance(HOOK, Kind)
    assert HOOK.of(event) and not LOG.of(event) and not HOOK.of("hook")
    assert HOOK.find([event, LOG.new(name="x"), {"no": "ev"}]) == [event]
    import pickle

    assert pickle.loads(pickle.dumps(HOOK)) == "hook"


def test_a_kind_declared_by_two_modules_is_refused():
    from pytest_ltconform import events

    with pytest.raises(ValueError, match="trace event 'hook' is declared by pytest_ltconform.events already"):
        events.declare("hook")
