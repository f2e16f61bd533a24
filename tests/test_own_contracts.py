"""A project adds a contract of its own through the ``pytest_ltconform_contracts`` hook: written
the way docs/design.md "Adding a contract" says, with its own probe on the ranks and its own
verdict, judged in a real run."""

from __future__ import annotations

import json

MODEL = '''
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
'''

# The class follows the template of docs/internals.md "A contract", attribute by attribute; the probe
# sits in a module of the project (the ranks import it by name), the hook in conftest.py.
CONTRACTS = '''
from pytest_ltconform import FIT, Contract, Evidence, Outcome, Probe


class StepProbe(Probe):
    def collect(self, objects, trainer, recorder):
        return {"steps": trainer.global_step, "rank": trainer.global_rank}


class SameSteps(Contract):
    """Counts each rank's optimizer steps after the fit."""

    id = "same-steps"
    title = "every rank takes the same number of optimizer steps"
    rule_section = "Sampling, metrics and writes"
    run_spec = FIT
    probe_class = StepProbe
    strategies = ("ddp",)
    configured_only = ()
    tiers = ("cpu",)

    def judge(self, run):
        seen = run.probe(self.id)
        evidence = [Evidence(f"took {s['steps']} optimizer step(s)", rank=s["rank"]) for s in seen]
        if len({s["steps"] for s in seen}) != 1:
            return self.verdict(Outcome.FAILED, "the ranks took different numbers of steps", evidence=evidence,
                                fix="give every rank as many batches")
        return self.verdict(Outcome.PASSED, f"every rank took {seen[0]['steps']} optimizer step(s)",
                            evidence=evidence)
'''

CONFTEST = '''
import my_contracts


def pytest_ltconform_contracts(config):
    return [my_contracts.SameSteps()]
'''


def test_a_contract_registered_in_conftest_is_judged_on_the_ranks(pytester, no_leftover_ranks):
    pytester.makepyfile(model=MODEL, my_contracts=CONTRACTS, conftest=CONFTEST)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "model.py:Model",
                                           "-k", "same-steps", "-v", f"--ltconform-report={report}")
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    result.stdout.fnmatch_lines(["*::same-steps[[]ddp[]] PASSED*"])
    [rec] = json.loads(report.read_text())["results"]
    assert (rec["contract"], rec["strategy"], rec["outcome"]) == ("same-steps", "ddp", "passed")
    # 16 samples, 2 ranks, batches of 4, two epochs: 2 steps an epoch on each rank.
    assert rec["summary"] == "every rank took 4 optimizer step(s)"
    assert [(e["rank"], e["detail"]) for e in rec["evidence"]] == [(0, "took 4 optimizer step(s)"),
                                                                  (1, "took 4 optimizer step(s)")]
    assert "from the 'Sampling, metrics and writes' section" in rec["message"]


def test_explain_shows_a_contract_registered_in_conftest_and_lists_it_for_an_unknown_id(pytester):
    import pytest

    from pytest_ltconform import report

    pytester.makepyfile(my_contracts=CONTRACTS, conftest=CONFTEST)
    result = pytester.runpytest_subprocess("--ltconform-explain", "same-steps", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()[-2000:]
    assert result.stdout.lines[:10] == [
        "# same-steps", "", "**every rank takes the same number of optimizer steps**", "",
        "Counts each rank's optimizer steps after the fit.", "",
        "Rule: the 'Sampling, metrics and writes' section of the distributed-training contracts (Lightning 2.6.6).",
        "", "Strategies: ddp; tiers: cpu.",
        "A contract of this project: my_contracts.SameSteps, registered through pytest_ltconform_contracts."]
    bad = pytester.runpytest_subprocess("--ltconform-explain", "same_steps", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    known = ", ".join(report.contract_pages() + ["same-steps"])
    assert (f"ERROR: --ltconform-explain: no contract 'same_steps'. Did you mean 'same-steps'? Choose from "
            f"{known}.") in bad.stderr.lines
    assert "INTERNALERROR" not in bad.stderr.str() + bad.stdout.str()


def test_a_contract_that_cannot_be_judged_is_a_usage_error_naming_it(pytester):
    pytester.makepyfile(model=MODEL, conftest='''
from pytest_ltconform import Contract


class Nameless(Contract):
    def judge(self, run):
        raise AssertionError


class Taken(Contract):
    id = "sync-dist"

    def judge(self, run):
        raise AssertionError


def pytest_ltconform_contracts(config):
    return [Nameless()] if config.getoption("-k") == "nameless" else [Taken()]
''')
    for k, words in (("nameless", "conftest.Nameless has id '': set `id` to lower-case words joined by dashes"),
                     ("taken", "conftest.Taken has id 'sync-dist', which another contract has: choose another id")):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "model.py:Model", "-k", k)
        assert result.ret == 4, result.stdout.str()[-2000:]
        assert f"pytest_ltconform_contracts: {words}" in result.stderr.str()
        assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


def test_the_internals_page_names_every_attribute_a_contract_has():
    """docs/internals.md's contract template, to the letter: each name it sets is one Contract reads,
    and each attribute a contract declares is in it (a contract written from an older page set
    `seed =`, which nothing read, and lost its Rule line)."""
    import pathlib
    import re

    from pytest_ltconform.contracts.base import Contract

    page = (pathlib.Path(__file__).parents[1] / "docs" / "internals.md").read_text()
    template = page.split("class MyContract(Contract):", 1)[1].split("```", 1)[0]
    written = set(re.findall(r"^    (\w+) = ", template, re.M)) | set(re.findall(r"^    def (\w+)", template, re.M))
    declared = {name for name, value in vars(Contract).items()
                if not name.startswith("_") and name not in ("verdict", "not_judged", "probe_ref")}
    assert written == declared
