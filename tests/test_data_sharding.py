"""data-sharding: verdicts on hand-made batch fingerprints and the rank-side fingerprint helper
(the worlds themselves are exercised by the corpus, tests/test_corpus.py)."""

from __future__ import annotations

from pytest_ltconform.contracts import get_contract


def test_data_sharding_identical_batches_fail_and_disjoint_pass(fake_runs):
    contract = get_contract("data-sharding")
    same = fake_runs.batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(fake_runs.run([same, same]))
    assert verdict.outcome == "failed" and "identical train batches in every step" in verdict.summary
    other = fake_runs.batches([["e", "f"], ["g", "h"]])
    assert contract.judge(fake_runs.run([same, other])).outcome == "passed"


def test_data_sharding_uneven_counts_and_replay_within_rank(fake_runs):
    contract = get_contract("data-sharding")
    verdict = contract.judge(fake_runs.run([fake_runs.batches([["a"], ["b"], ["c"]]),
                                            fake_runs.batches([["d"], ["e"]])]))
    assert verdict.outcome == "failed" and "rank 0: 3 batches, rank 1: 2 batches" in verdict.summary
    replay = fake_runs.batches([["a", "b"], ["a", "b"]])
    verdict = contract.judge(fake_runs.run([replay, fake_runs.batches([["c", "d"], ["c", "d"]])]))
    assert verdict.outcome == "failed" and "more than once" in verdict.summary


def test_data_sharding_recreate_failure_names_the_dataloader_line(fake_runs):
    contract = get_contract("data-sharding")
    tb = ('Traceback (most recent call last):\n  File "/site-packages/lightning/pytorch/utilities/data.py", '
          'line 1, in _update_dataloader\n')
    created = {"ev": "ds_created", "site": {"file": "/u/dm.py", "line": 7, "func": "DM.train_dataloader"},
               "positional": 4, "hook": "DM.train_dataloader"}
    ranks = [fake_runs.rank(r, [created], status="error", exc_type="MisconfigurationException",
                            message="The DataLoader implementation has an error where more than one `__init__` "
                                    "argument",
                            traceback=tb) for r in range(2)]
    verdict = contract.judge(fake_runs.of(ranks, status="error"))
    assert verdict.outcome == "failed"
    assert "positionally" in verdict.summary and "/u/dm.py:7" in verdict.render()


def test_fingerprint_rows_and_ids():
    import torch

    from pytest_ltconform.contracts.data_sharding import fingerprint

    fp = fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))
    assert fp["n"] == 3 and len(fp["rows"]) == 3 and fp["ids"] == [5, 6, 7]
    assert fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))["fp"] == fp["fp"]
