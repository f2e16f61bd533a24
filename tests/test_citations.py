"""Docs and comments cite only what a reader of the repository can open: its files and pages,
never a design document, an issue number or a check kept somewhere else."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).parents[1]
# What a reader of the repository cannot open.
OUTSIDE = re.compile(r"\bDESIGN(\.md)?\b|\bissues? #?\d+|\blayering check\b")


def _comments_and_docstrings(path: pathlib.Path):
    """(line, text) of each comment and each string that stands alone as a statement (docstrings)."""
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and (previous is None or previous.type in (
                tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)):
            yield tok.start[0], tok.string
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok


def citations_outside(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def test_no_doc_or_comment_cites_what_the_repository_does_not_hold():
    found = []
    for folder in ("src", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}: {cited}" for line, text in _comments_and_docstrings(path)
                      for cited in citations_outside(text)]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "src" / "pytest_ltconform" / "contract_docs").glob("*.md"))]
    for path in pages:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {cited}" for cited in citations_outside(line)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_citation_in_a_comment_or_docstring_and_not_in_data(tmp_path):
    code = '''"""Module doc (DESIGN "Blame")."""
x = "fixed by issue 19"  # a comment citing issue 11
def f():
    """as the layering check says"""
'''
    path = tmp_path / "probe.py"
    path.write_text(code)
    cited = [(line, citations_outside(text)) for line, text in _comments_and_docstrings(path)]
    assert [(line, c) for line, c in cited if c] == [(1, ["DESIGN"]), (2, ["issue 11"]), (4, ["layering check"])]
