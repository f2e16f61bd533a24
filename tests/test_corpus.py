"""The conformance corpus: every case's expected verdict, with its evidence in the message.

The whole corpus is judged once, by the documented command in a subprocess (one shared world
pool for all cases, so a hang or crash in a case can never take this session down); each
(case, contract) expectation is then its own test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import CONFORMANCE, REPO

from pytest_ltconform import contracts
from pytest_ltconform.corpus import discover, read_case

CASES = [c for c in map(read_case, discover([str(CONFORMANCE)])) if c is not None]
EXPECTATIONS = [(c, cid) for c in CASES for cid in c.expected if cid in contracts.ids()]


@pytest.fixture(scope="module")
def corpus_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "corpus.json"
    # The command's per-case progress lines (stderr) are left to pytest's capture: `-s` shows them
    # as the corpus runs, a failure shows them under "Captured stderr", the default output stays short.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_ltconform.corpus", str(CONFORMANCE), "--json", str(out), "--timeout", "40"],
        cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=1500,
    )
    assert out.exists(), f"the corpus command wrote no result:\n{proc.stdout[-4000:]}"
    doc = json.loads(out.read_text())
    print(proc.stdout[-3000:])
    rows: dict = {}
    for r in doc["rows"]:  # a conforming case has one row per strategy
        rows.setdefault((r["case"], r["contract"]), []).append(r)
    return rows


def _evidence_tokens(evidence: str) -> list[str]:
    """The concrete names an EVIDENCE text promises: quoted names and backticked code."""
    tokens = re.findall(r"'([^'\s]+)'", evidence) + re.findall(r"`([^`]+)`", evidence)
    return [t.strip() for t in tokens if t.strip()]


@pytest.mark.parametrize("case, contract", EXPECTATIONS, ids=[f"{c.name}-{cid}" for c, cid in EXPECTATIONS])
def test_case_gets_its_expected_verdict(corpus_rows, case, contract):
    rows = corpus_rows.get((case.name, contract))
    assert rows, f"no verdict for {case.name} / {contract}"
    for row in rows:
        assert row["matched"], f"[{row['strategy']}] expected {row['expected']}, got {row['got']}: {row['message']}"
    row = rows[0]
    if case.expected[contract] == "fail":
        message = row["message"]
        assert f"{case.name.rsplit('/', 1)[-1]}.py:" in message, f"the user's file:line is missing:\n{message}"
        missing = [t for t in _evidence_tokens(case.evidence) if t not in message]
        assert not missing, f"evidence {missing} not named in:\n{message}"
        assert "Fix:" in message


def test_detection_rate_is_complete(corpus_rows):
    rows = [r for group in corpus_rows.values() for r in group]
    positives = [r for r in rows if r["expected"] == "fail"]
    negatives = [r for r in rows if r["expected"] != "fail"]
    assert positives and negatives
    assert all(r["got"] == "fail" for r in positives)
    assert all(r["matched"] for r in negatives)
