"""Outcomes are written through ``Outcome``: no item outcome is spelled as a string outside
``outcomes.py``."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).parents[1] / "src" / "pytest_ltconform"


def _outcome_words() -> set[str]:
    from pytest_ltconform.outcomes import Outcome

    return {o.value for o in Outcome}


def _exempt(tree: ast.AST) -> set[int]:
    """ids of the constants that are not outcomes written: docstrings; dictionary keys,
    subscripts, ``.get`` names and ``"name" in record`` (field names of a record, such as a trace
    event's ``error``); a rank's ``.status`` compared (the world's own vocabulary,
    ``world.outcome.RankOutcome``: 'ok', 'error', 'died', 'hung', 'skip'); and the values of an
    enum's members (where a named value is defined)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            ids.add(id(node.body[0].value))
        if isinstance(node, ast.Dict):
            ids |= {id(k) for k in node.keys if k is not None}
        if isinstance(node, ast.Subscript):
            ids |= {id(c) for c in ast.walk(node.slice) if isinstance(c, ast.Constant)}
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            ids.add(id(node.left))  # "error" in record: a field's name
        if isinstance(node, ast.Compare) and any(ast.unparse(o).endswith(".status") for o in
                                                 [node.left, *node.comparators]):
            ids |= {id(c) for c in ast.walk(node) if isinstance(c, ast.Constant)}  # a rank's status
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and node.args:
            ids.add(id(node.args[0]))  # a record's field read by name
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
            ids |= {id(c) for c in ast.walk(node) if isinstance(c, ast.Constant)}
    return ids


def outcome_constants(tree: ast.AST, words: set[str]) -> list[ast.Constant]:
    exempt = _exempt(tree)
    return [c for c in ast.walk(tree) if isinstance(c, ast.Constant) and c.value in words and id(c) not in exempt]


def outcome_strings(tree: ast.AST, words: set[str]) -> list[tuple[int, str]]:
    return [(c.lineno, c.value) for c in outcome_constants(tree, words)]


def test_no_outcome_is_spelled_as_a_string_outside_outcomes_py():
    # world/ is left out: a rank's status ('ok', 'error', 'died', 'hung', 'skip') is the world's own
    # vocabulary (world.outcome.RankOutcome), not an item's outcome.
    words = _outcome_words()
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "world" or rel.name == "outcomes.py":
            continue
        offenders += [f"{rel}:{line}: {word!r}" for line, word in outcome_strings(ast.parse(path.read_text()), words)]
    assert not offenders, "\n".join(offenders)


def test_the_check_finds_an_outcome_written_as_a_string():
    code = '''
"""A docstring may say passed."""
v = contract.verdict("failed", "x")
if record["outcome"] == "skipped":
    pass
ok = {"error": 1}["error"] or record.get("error") or "error" in record or rank.status == "error"
class Got(enum.StrEnum):
    ADVISORY = "advisory"
'''
    assert outcome_strings(ast.parse(code), _outcome_words()) == [(3, "failed"), (4, "skipped")]
