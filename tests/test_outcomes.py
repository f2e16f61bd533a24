"""Outcomes as named values: not judged is an outcome carrying its reason and the item it depends
on, a finding is not called a failure, and the report keeps its five words."""

from pytest_ltconform.contracts import get_contract
from pytest_ltconform.contracts.base import Verdict
from pytest_ltconform.corpus import got_of
from pytest_ltconform.outcomes import NotJudged, Outcome


def test_a_verdict_written_with_todays_strings_is_not_judged():
    # A contract written against the string API (another one may be in the works) keeps working.
    v = get_contract("sync-dist").verdict("skipped", "not judged: no step ran.")
    assert v.outcome is Outcome.NOT_JUDGED
    assert v.not_judged == NotJudged("no step ran.", None)
    assert v.as_dict()["outcome"] == "skipped" and v.render().splitlines()[0] == "[sync-dist] not judged: no step ran."
    assert got_of(v) == got_of(v.as_dict()) == "notjudged"


def test_not_judged_carries_its_reason_and_the_item_it_depends_on():
    v = get_contract("sync-dist").not_judged("the fit stopped (see all-rank-save[ddp]).",
                                             depends_on="all-rank-save[ddp]", category="consequence")
    assert v.summary == "not judged: the fit stopped (see all-rank-save[ddp])."
    assert v.not_judged == NotJudged("the fit stopped (see all-rank-save[ddp]).", "all-rank-save[ddp]")
    assert got_of(v) == "consequence"
    # The JSON record is what it was before the enum: no new key, 'skipped'.
    assert "depends_on" not in v.as_dict() and v.as_dict()["outcome"] == "skipped"


def test_an_advisory_is_a_finding_that_passes():
    advisory = Verdict(contract="unused-parameters", outcome="advisory", summary="waste")
    assert advisory.finding and advisory.outcome is Outcome.ADVISORY and advisory.not_judged is None
    assert not Outcome.ADVISORY.skips and Outcome.NOT_JUDGED.skips and Outcome.SKIPPED.skips
    plain = Verdict(contract="x", outcome="skipped", summary="the fsdp tier does not apply")
    assert plain.outcome is Outcome.SKIPPED and not plain.finding and got_of(plain) == "skipped"


def test_an_unknown_outcome_is_refused():
    import pytest

    with pytest.raises(ValueError, match="'fail'"):
        Verdict(contract="x", outcome="fail", summary="")
