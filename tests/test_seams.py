"""Seams between the layers: what the pytest side may import of the rank side, and what the
session may read of a run (docs/design.md, "Layers")."""

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
    parsed_back = 'startswith("not ' + 'judged'  # split, so that a grep of the tree finds none either
    assert not any(parsed_back in p.read_text() for p in SRC.rglob("*.py"))


def test_several_findings_merge_into_the_first():
    from pytest_ltconform.contracts.base import Evidence, Verdict, merged

    def finding(n):
        return Verdict(contract="x", outcome="failed", summary=f"finding {n}", evidence=[Evidence(f"e{n}")],
                       notes=[f"note {n}"])

    first = merged([finding(1), finding(2), finding(3)], ["after"])
    assert first.summary == "finding 1"
    assert [e.detail for e in first.evidence] == ["e1", "e2", "e3"]
    assert first.notes == ["finding 2", "finding 3", "note 1", "after"]


def test_findings_collected_before_a_verdict_are_led_by_the_first():
    # launch-env, eval-duplication and unused-parameters collect their findings in one accumulator.
    from pytest_ltconform.contracts.base import Findings

    found = Findings()
    found.add("deadlock", "ranks disagree", rank=1, fix="b fix")
    found.add("silent", "sizes differ", fix="a fix")
    found.add("silent", "sizes differ again", fix="a fix")
    found.note("a note")
    assert (found.lead.category, found.lead.rank, found.lead.detail) == ("deadlock", 1, "ranks disagree")
    assert found.summary() == "ranks disagree; and 2 more finding(s) below"
    assert found.summary(every=True) == "ranks disagree sizes differ sizes differ again"
    assert found.fixes() == "a fix b fix"
    assert found.notes == ["a note"]
    single = Findings()
    single.add(None, "only one")
    assert (single.summary(), single.fixes()) == ("only one", "")
    assert Findings().lead is None


def test_the_target_fixture_returns_a_public_type(pytester):
    pytester.makepyfile(model='''
import torch
import lightning.pytorch as pl


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2)
''', test_fixture='''
import pytest_ltconform


def test_target(ltconform_target):
    assert type(ltconform_target) is pytest_ltconform.ResolvedTarget
    assert type(ltconform_target.model) is pytest_ltconform.target.spec.ObjectRef
    assert ltconform_target.model.text == "model.py:Model"
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "model.py:Model",
                                           "test_fixture.py", "-m", "not ltconform")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=1)
    # -m deselected every contract item; the test that asked for the target had it validated then.
    result.stdout.fnmatch_lines(["ltconform: -m 'not ltconform' deselects every contract item, so model.py:Model is "
                                 "not checked in this run (only imported for a test's ltconform_target fixture)*"])
