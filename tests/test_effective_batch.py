"""effective-batch: the merge of micro-batches and the report, and the verdict on hand-made gradient
norms against a reference run (no world started)."""

from __future__ import annotations

import pytest

from pytest_ltconform.contracts import get_contract


def test_concat_and_report():
    import torch

    from pytest_ltconform.contracts.effective_batch import EffectiveBatch, _concat

    out = _concat([(torch.zeros(2, 3), {"m": torch.ones(2)}), (torch.ones(4, 3), {"m": torch.zeros(4)})])
    assert out[0].shape == (6, 3) and out[1]["m"].shape == (6,)
    loader = {"batches": 5, "samples": 18, "batch_size": 4, "drop_last": False}
    report, notes = EffectiveBatch._report([{"loader": loader}, {"loader": loader}], 4, 2, 2)
    assert "Effective batch 16 = 4 (per rank) x 2 (ranks) x 2 (accumulation)" in report
    assert any("partial final window" in n for n in notes) and any("uneven last batch" in n for n in notes)


@pytest.mark.parametrize("ratio,passed", [(1.0, True), (0.5, False), (1.3, False)])
def test_effective_batch_ratio(ratio, passed, fake_runs):
    values = [{"ebatch": {"sizes": [4], "accumulate": 1, "stepped": True, "loader": {}, "loss_lines": []}}] * 2
    run = fake_runs.run(values=values)
    ref = fake_runs.run(values=[{"reference": {"norm": 2.0, "world_norm": 2.0 * ratio, "cosine": 1.0,
                                               "stepped": True, "per_param": []}}])
    run.reference = ref
    verdict = get_contract("effective-batch").judge(run)
    assert (verdict.outcome == "passed") is passed
    if ratio == 0.5:
        assert "shrinks by the world size" in verdict.summary
