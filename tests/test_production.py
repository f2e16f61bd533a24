"""The split at the production world size: every rank's indices computed from the loader's own
DistributedSampler, with rank and world size set (no process started)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pytest_ltconform.contracts import production


def _loader(n: int, labels, batch: int = 4, drop_last: bool = False, shuffle: bool = False) -> DataLoader:
    data = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.tensor(labels))
    return DataLoader(data, batch_size=batch, drop_last=drop_last,
                      sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=shuffle, seed=3))


def test_a_small_validation_set_padded_for_64_ranks_repeats_its_first_samples():
    p = production.plan(_loader(100, [i % 5 for i in range(100)]), {"num_nodes": 8, "devices": 8}, run_world=2)
    assert (p["world"], p["samples"], p["duplicates"], p["unread"]) == (64, 100, 28, 0)
    assert p["batches"] == {"min": 1, "max": 1, "fewer": []}
    first, ranks = p["duplicate_examples"][0]
    assert first == 0 and ranks == [0, 36]  # sample 0 at position 0 (rank 0) and, padded, at 100 (rank 36)
    note, findings = production.sentences(p, "val")
    assert note == ("at the production size (num_nodes 8 x devices 8 = 64 ranks): each rank reads 1 val batch of 4; "
                    "28 of the 100 samples are read twice (DistributedSampler pads the last round: sample 0 by ranks "
                    "0 and 36).")
    assert findings == []


def test_a_drop_last_that_drops_the_only_samples_of_a_class_is_a_finding():
    labels = [i % 3 for i in range(128)] + [7, 7]  # class 7: samples 128 and 129, the third slot of ranks 0, 1
    p = production.plan(_loader(130, labels, batch=2, drop_last=True), {"num_nodes": 8, "devices": 8}, run_world=2)
    assert p["classes_left_out"] == [7] and p["unread"] == 2 and p["unread_examples"] == [128, 129]
    note, findings = production.sentences(p, "train")
    assert "2 samples are read by no rank (drop_last drops the last batch of each rank)" in note
    assert findings == ["at the production size (num_nodes 8 x devices 8 = 64 ranks) no rank reads any sample of "
                        "class(es) 7: drop_last drops every one of them, in every epoch (the sampler does not shuffle)"]
    # Shuffled the same way on every rank (the sampler's seed and epoch), still each index once or padded.
    shuffled = production.plan(_loader(130, labels, shuffle=True), {"num_nodes": 2, "devices": 4}, run_world=2)
    assert shuffled["duplicates"] == 6 and shuffled["unread"] == 0


def test_nothing_is_computed_without_a_larger_production_size_or_without_a_distributed_sampler():
    loader = _loader(10, list(range(10)))
    assert production.plan(loader, {"devices": 2}, run_world=2) is None
    assert production.plan(loader, {"devices": "auto", "num_nodes": 4}, run_world=2) is None
    plain = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=2)
    p = production.plan(plain, {"devices": 8, "num_nodes": 2}, run_world=2)
    assert p["world"] == 16 and "only a sampler can be replayed" in p["not_computed"]
    assert production.sentences(p, "train")[0].startswith("at the production size (num_nodes 2 x devices 8 = 16 "
                                                          "ranks) the train split was not computed")
    assert production.production_world({"num_nodes": 2, "devices": [0, 1, 2]}) == (2, 3)
