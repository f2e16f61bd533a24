"""data-sharding: verdicts on hand-made batch fingerprints and the rank-side fingerprint helper
(the worlds themselves are exercised by the corpus, tests/test_corpus.py)."""

from __future__ import annotations

import pytest
from conftest import FakeRuns, case

from pytest_ltconform.contracts import get_contract


def test_data_sharding_identical_batches_fail_and_disjoint_pass(fake_runs):
    contract = get_contract("data-sharding")
    same = fake_runs.batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(fake_runs.run([same, same]))
    assert verdict.outcome == "failed" and "identical train batches in every step" in verdict.summary
    other = fake_runs.batches([["e", "f"], ["g", "h"]])
    assert contract.judge(fake_runs.run([same, other])).outcome == "passed"
    # A world of one rank (the GPU tier on a one-GPU runner) repeats nobody's data.
    assert contract.judge(fake_runs.run([same])).outcome == "passed"


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
               "positional": 5, "hook": "DM.train_dataloader"}
    ranks = [fake_runs.rank(r, [created], status="error", exc_type="MisconfigurationException",
                            message="The DataLoader implementation has an error where more than one `__init__` "
                                    "argument",
                            traceback=tb) for r in range(2)]
    verdict = contract.judge(fake_runs.of(ranks, status="error"))
    assert verdict.outcome == "failed"
    assert "positionally" in verdict.summary and "/u/dm.py:7" in verdict.render()
    # Five arguments by position: the sampler is still the 4th (it said "argument 5 and on").
    assert "sampler positionally (its 4th argument, of 5 given by position)" in verdict.summary
    # Three by position (dataset, batch_size, shuffle): the sampler is not among them.
    three = [fake_runs.rank(r, [{**created, "positional": 3}], status="error", exc_type="MisconfigurationException",
                            message="The DataLoader implementation has an error", traceback=tb) for r in range(2)]
    assert "positionally" not in contract.judge(fake_runs.of(three, status="error")).summary
    # The stop is this contract's on every strategy: the run item and the other items point at it, and the
    # sharded tiers do not read it as "the module does not run under FSDP" (chemprop trial).
    from pytest_ltconform import contracts

    assert contracts.blamed(fake_runs.of(ranks, status="error")) == "data-sharding"


def test_fingerprint_rows_and_ids():
    import torch

    from pytest_ltconform.contracts.data_sharding.probe import fingerprint

    fp = fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))
    assert fp["n"] == 3 and len(fp["rows"]) == 3 and fp["ids"] == [5, 6, 7]
    assert fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))["fp"] == fp["fp"]


# -- uneven counts only from the data ------------------------------------------------------------

def _loader(epoch: int, length, **info) -> dict:
    return {"ev": "ds_loader", "stage": "train", "epoch": epoch, "length": length, "batch_size": 4,
            "dataset": "Images", "iterable": False, "use_distributed_sampler": True, **info}


def _epochs(fake_runs, rows_per_epoch: list[list[list[str]]]) -> list[dict]:
    return [e for ep, rows in enumerate(rows_per_epoch) for e in fake_runs.batches(rows, epoch=ep)]


def test_hung_world_with_even_loaders_is_not_a_data_fault(fake_runs):
    """A world stuck in a collective: rank 1 moved into epoch 1, rank 0 is stuck at epoch 0's end."""
    contract = get_contract("data-sharding")
    r0 = [_loader(0, 4)] + _epochs(fake_runs, [[["a"], ["b"], ["c"], ["d"]]])
    r1 = [_loader(0, 4)] + _epochs(fake_runs, [[["e"], ["f"], ["g"], ["h"]], [["i"]]]) + [_loader(1, 4)]
    ranks = [fake_runs.rank(0, r0, status="hung"), fake_runs.rank(1, r1, status="hung")]
    verdict = contract.judge(fake_runs.of(ranks, status="hung"))
    assert verdict.outcome == "passed", verdict.render()
    # even when both ranks completed an epoch with different counts, equal len() clears the data
    r0 = [_loader(0, 4)] + _epochs(fake_runs, [[["a"], ["b"]], [["x"]]])
    ranks = [fake_runs.rank(0, r0, status="hung"), fake_runs.rank(1, r1, status="hung")]
    assert contract.judge(fake_runs.of(ranks, status="hung")).outcome == "passed"


def test_hung_world_counts_only_epochs_every_rank_completed(fake_runs):
    contract = get_contract("data-sharding")
    r0 = _epochs(fake_runs, [[["a"], ["b"], ["c"]], [["x"]]])      # epoch 0 complete: 3 batches
    r1 = _epochs(fake_runs, [[["e"], ["f"]], [["y"], ["z"]]])       # epoch 0 complete: 2 batches
    ranks = [fake_runs.rank(0, r0, status="hung"), fake_runs.rank(1, r1, status="hung")]
    verdict = contract.judge(fake_runs.of(ranks, status="hung"))
    assert verdict.outcome == "failed"
    assert "epoch 0 (rank 0: 3 batches, rank 1: 2 batches)" in verdict.summary
    # the last epoch (1: 1 vs 2 batches) is not complete on any rank and is not the evidence
    assert "epoch 1" not in verdict.summary


def test_loader_lengths_differ_under_the_batch_cap(fake_runs):
    contract = get_contract("data-sharding")
    rows = [[["a"], ["b"], ["c"], ["d"]], [["c"], ["a"], ["d"], ["b"]]]
    other = [[["e"], ["f"], ["g"], ["h"]], [["h"], ["g"], ["f"], ["e"]]]
    r0 = [_loader(0, 5), _loader(1, 5)] + _epochs(fake_runs, rows)
    r1 = [_loader(0, 4), _loader(1, 4)] + _epochs(fake_runs, other)
    verdict = contract.judge(fake_runs.run([r0, r1]))
    assert verdict.outcome == "failed" and verdict.category == "deadlock"
    assert verdict.summary.startswith("len(train DataLoader) differs across ranks in epoch 0 (rank 0: 5 batches, "
                                      "rank 1: 4 batches); ")
    assert "caps an epoch at 4 batches" in verdict.summary


def test_stream_item_counts_decide_for_iterables(fake_runs):
    contract = get_contract("data-sharding")
    it = {"iterable": True, "dataset": "Blocks"}
    r0 = [_loader(0, None, **it), {"ev": "ds_stream", "stage": "train", "n": 12, "epoch": 0}] \
        + fake_runs.batches([["a"], ["b"]])
    r1 = [_loader(0, None, **it), {"ev": "ds_stream", "stage": "train", "n": 8, "epoch": 0}] \
        + fake_runs.batches([["c"], ["d"]])
    verdict = contract.judge(fake_runs.of([fake_runs.rank(0, r0, status="hung"), fake_runs.rank(1, r1, status="hung")],
                                          status="hung"))
    assert verdict.outcome == "failed" and "(rank 0: 3 batches, rank 1: 2 batches: the items" in verdict.summary
    # equal item counts: a rank that stopped early is not the data's fault
    r1[1] = {"ev": "ds_stream", "stage": "train", "n": 12, "epoch": 0}
    r0 += fake_runs.batches([["e"]], epoch=1)
    r1b = r1[:2] + fake_runs.batches([["c"]]) + fake_runs.batches([["f"]], epoch=1)
    verdict = contract.judge(fake_runs.of([fake_runs.rank(0, r0, status="hung"),
                                           fake_runs.rank(1, r1b, status="hung")], status="hung"))
    assert verdict.outcome == "passed", verdict.render()


# -- sampling with replacement ----------------------------------------------------------------------

def test_replacement_sampler_repeats_are_not_a_fault(fake_runs):
    contract = get_contract("data-sharding")
    r0 = [_loader(0, 2, replacement=True)] + fake_runs.batches([["a", "b"], ["a", "c"], ["b", "a"]])
    r1 = [_loader(0, 2, replacement=True)] + fake_runs.batches([["c", "d"], ["d", "d"], ["a", "c"]])
    assert contract.judge(fake_runs.run([r0, r1])).outcome == "passed"
    r0[0] = _loader(0, 2, replacement=False)
    verdict = contract.judge(fake_runs.run([r0, r1]))
    assert verdict.outcome == "failed"
    assert ("every rank (0 and 1) saw its own train tensor rows (dataset items cannot be counted) more than once "
            "in epoch 0 (rank 0: 3 of 6, rank 1: 3 of 6)") in verdict.summary


# -- random inputs identical on every rank ----------------------------------------------------------

def _draws(hashes: list[str], line: int = 42, use: str | None = "input") -> list[dict]:
    """``ds_draw`` events of one line, one per step, each followed by its ``ds_draw_use`` (none
    when ``use`` is None)."""
    out = []
    for i, h in enumerate(hashes):
        out.append({"ev": "ds_draw", "fn": "torch.randn", "key": [0, i], "hash": h, "shape": [8, 3], "epoch": 0,
                    "id": i + 1, "site": {"file": "/u/gan.py", "line": line, "func": "Model.training_step"}})
        if use:
            out.append({"ev": "ds_draw_use", "id": i + 1, "use": use, "op": "linear" if use == "input" else "mul"})
    return out


def test_noise_identical_across_ranks_fails_with_the_draw_site(fake_runs):
    contract = get_contract("data-sharding")
    r0 = fake_runs.batches([["a"], ["b"], ["c"]]) + _draws(["h1", "h2", "h3"])
    r1 = fake_runs.batches([["d"], ["e"], ["f"]]) + _draws(["h1", "h2", "h3"])
    verdict = contract.judge(fake_runs.run([r0, r1]))
    assert verdict.outcome == "failed" and verdict.category == "silent"
    assert verdict.summary.startswith("torch.randn at /u/gan.py:42 (Model.training_step) in training_step draws "
                                      "the same values on every rank at every recorded step (3 steps compared")
    assert [e.site for e in verdict.evidence] == ["/u/gan.py:42 (Model.training_step)"] * 2
    assert "seed + self.global_rank" in verdict.fix
    assert "the draw is itself the model's input (it reaches linear with only weights" in verdict.summary


def test_noise_combined_with_each_ranks_data_or_never_used_passes(fake_runs):
    """A VAE's eps * std or a dropout mask times the batch: the same noise on every rank still
    meets different data, so each rank's samples stay its own."""
    contract = get_contract("data-sharding")
    for use in ("combined", None):
        r0 = fake_runs.batches([["a"], ["b"], ["c"]]) + _draws(["h1", "h2", "h3"], use=use)
        r1 = fake_runs.batches([["d"], ["e"], ["f"]]) + _draws(["h1", "h2", "h3"], use=use)
        verdict = contract.judge(fake_runs.run([r0, r1]))
        assert verdict.outcome == "passed", (use, verdict.render())
        said = "the random draws at /u/gan.py:42 (Model.training_step) are the same on every rank, but each meets"
        assert (said in " ".join(verdict.notes)) == (use == "combined")


def test_noise_that_differs_per_rank_or_is_drawn_once_passes(fake_runs):
    contract = get_contract("data-sharding")
    r0 = fake_runs.batches([["a"], ["b"], ["c"]])
    r1 = fake_runs.batches([["d"], ["e"], ["f"]])
    per_rank = [r0 + _draws(["h1", "h2", "h3"]), r1 + _draws(["k1", "k2", "k3"])]
    assert contract.judge(fake_runs.run(per_rank)).outcome == "passed"
    once = [r0 + _draws(["h1"]), r1 + _draws(["h1"])]  # a fixed sample drawn once, e.g. for previews
    assert contract.judge(fake_runs.run(once)).outcome == "passed"
    partly = [r0 + _draws(["h1", "h2", "h3"]), r1 + _draws(["h1", "x2", "h3"])]
    assert contract.judge(fake_runs.run(partly)).outcome == "passed"


# -- order across epochs, wherever the shuffling lives ----------------------------------------------

def test_same_order_every_epoch_from_a_dataset_or_batch_sampler(fake_runs):
    contract = get_contract("data-sharding")
    rows0, rows1 = [[["a", "b"], ["c", "d"]]] * 2, [[["e", "f"], ["g", "h"]]] * 2
    shuffles = {"iterable": True, "dataset": "Shuffled", "dataset_shuffles": True}
    runs = [[_loader(0, None, **shuffles)] + _epochs(fake_runs, rows0),
            [_loader(0, None, **shuffles)] + _epochs(fake_runs, rows1)]
    verdict = contract.judge(fake_runs.run(runs))
    assert verdict.outcome == "failed"
    assert verdict.summary.startswith("IterableDataset Shuffled yields every rank the same sample order in epoch 0 "
                                      "and epoch 1")
    plain = {"iterable": True, "dataset": "Stream"}  # a stream read in file order is a choice
    runs = [[_loader(0, None, **plain)] + _epochs(fake_runs, rows0),
            [_loader(0, None, **plain)] + _epochs(fake_runs, rows1)]
    assert contract.judge(fake_runs.run(runs)).outcome == "passed"
    bucket = {"custom_batch_sampler": "Buckets", "batch_sampler_shuffles": True}
    runs = [[_loader(0, 2, **bucket)] + _epochs(fake_runs, rows0),
            [_loader(0, 2, **bucket)] + _epochs(fake_runs, rows1)]
    verdict = contract.judge(fake_runs.run(runs))
    assert verdict.outcome == "failed" and "the train batch sampler Buckets gives every rank" in verdict.summary


def _owner(cls: str, role: str = "batch sampler", methods=("set_epoch(epoch)",), words=()) -> dict:
    return {"cls": cls, "role": role, "user": True, "epoch_methods": list(methods), "random_words": list(words),
            "shuffle": None, "site": {"file": "/u/data.py", "line": 12, "func": cls}}


def _keyed(rows_per_epoch):
    """Batch events whose rows are the dataset keys each fetch received (src "index")."""
    return [dict(e, src="index") for e in rows_per_epoch]


def _reseed_run(fake_runs, owner: dict, extra=(), rng: bool = False, epochs=None):
    rows = epochs or ([[["3", "1"], ["7", "5"]]] * 2, [[["2", "8"], ["0", "6"]]] * 2)
    ranks = []
    for r in range(2):
        trace = [_loader(0, 2, use_distributed_sampler=False, order_owners=[owner])]
        trace += [{"ev": "ds_sampler", "cls": owner["cls"], "indices": [[3, 1]], "rng": rng}]
        trace += _keyed(_epochs(fake_runs, rows[r])) + list(extra)
        ranks.append(trace)
    return fake_runs.run(ranks)


def test_a_batch_sampler_whose_set_epoch_nothing_calls_fails_from_the_indices_each_epoch_received(fake_runs):
    """Lightning calls set_epoch on the loader's sampler and the batch sampler's .sampler, never on a
    batch sampler: one that draws its order at random repeats it every epoch."""
    contract = get_contract("data-sharding")
    verdict = contract.judge(_reseed_run(fake_runs, _owner("Buckets"), rng=True))
    assert verdict.outcome == "failed" and verdict.category == "silent"
    assert verdict.summary.startswith("the train batch sampler Buckets gives every rank the same sample order in "
                                      "epoch 0 and epoch 1, though its order is drawn at random (the global random "
                                      "state moved while its __iter__ ran (ranks 0, 1)): Buckets has "
                                      "set_epoch(epoch), which nothing called: Lightning calls set_epoch(epoch) at "
                                      "every epoch start on the DataLoader's sampler and on its batch sampler's "
                                      ".sampler only, never on a batch sampler itself.")
    assert "the same 4 dataset keys in the same order (starting 3, 1, 7, 5)" in verdict.evidence[0].detail
    assert "Lightning never calls a batch sampler's set_epoch" in verdict.fix
    # Another name for the reseed: said, with the name Lightning calls.
    other = contract.judge(_reseed_run(fake_runs, _owner("Buckets", methods=["shuffle(epoch)"], words=["sample"])))
    assert "Buckets has shuffle(epoch), which nothing called" in other.summary
    assert "(Lightning calls set_epoch by that name only)" in other.summary
    assert "(its source calls sample)" in other.summary
    # Called (by the module's hook) and still the same order: its __iter__ ignores the epoch.
    called = [{"ev": "ds_epoch_call", "cls": "Buckets", "method": "set_epoch", "epoch": e,
               "caller": {"file": "/u/model.py", "line": 30, "func": "on_train_epoch_start"}} for e in (0, 1)]
    ignored = contract.judge(_reseed_run(fake_runs, _owner("Buckets"), extra=called, rng=True))
    assert "its set_epoch(epoch) was called (epochs 0, 1; first from /u/model.py:30 (on_train_epoch_start)), yet " \
           "the order did not change" in ignored.summary


def test_an_order_that_repeats_without_any_random_draw_is_a_choice_said_in_a_note(fake_runs):
    contract = get_contract("data-sharding")
    verdict = contract.judge(_reseed_run(fake_runs, _owner("ByLength", methods=[])))
    assert verdict.outcome == "passed", verdict.render()
    assert any("the train order is the same in epoch 0 and epoch 1 on every rank, and ByLength draws nothing at "
               "random that this check saw" in n for n in verdict.notes)
    # A new order in the second epoch: nothing to say.
    moved = contract.judge(_reseed_run(fake_runs, _owner("Buckets"), rng=True,
                                       epochs=([[["3", "1"]], [["1", "3"]]], [[["2", "8"]], [["8", "2"]]])))
    assert moved.outcome == "passed" and not any("the train order" in n for n in moved.notes)


def test_fingerprint_of_opaque_batches_has_no_addresses():
    import dataclasses

    import torch

    from pytest_ltconform.contracts.data_sharding.probe import fingerprint

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        meta: object

    class Meta:
        def __init__(self, lengths):
            self.lengths = lengths

    a = fingerprint(Batch(torch.arange(6.0).reshape(3, 2), Meta(torch.tensor([1, 2, 3]))))
    b = fingerprint(Batch(torch.arange(6.0).reshape(3, 2), Meta(torch.tensor([1, 2, 3]))))
    assert a["fp"] == b["fp"] and a["n"] == 3 and a["ids"] == [1, 2, 3]
    assert fingerprint([object(), "text"]) == {"n": None}  # no tensor leaves: not fingerprinted


# -- crashes of the verdict found by a fuzzer -------------------------------------------------------

def test_recreate_failure_with_an_empty_message(fake_runs):
    contract = get_contract("data-sharding")
    tb = ('Traceback (most recent call last):\n  File "/site-packages/lightning/pytorch/utilities/data.py", '
          'line 1, in _update_dataloader\n')
    ranks = [fake_runs.rank(r, [], status="error", exc_type="TypeError", message="", traceback=tb) for r in range(2)]
    verdict = contract.judge(fake_runs.of(ranks, status="error"))
    assert verdict.outcome == "failed" and "(TypeError: no message)" in verdict.summary


def test_identical_batches_evidence_with_missing_fingerprints_and_epochs(fake_runs):
    contract = get_contract("data-sharding")
    same = fake_runs.batches([["a"], ["b"], ["c"]])
    broken = [dict(e) for e in same]
    del broken[1]["fp"]  # fingerprinting raised on that batch
    verdict = contract.judge(fake_runs.run([same, broken]))
    assert verdict.outcome == "failed" and "batch hashes ['a', 'none', 'c']" in verdict.render()
    # rank 1 has no batch in rank 0's first epoch
    r0 = fake_runs.batches([["a"]], epoch=0) + fake_runs.batches([["b"], ["c"]], epoch=1)
    r1 = fake_runs.batches([["b"], ["c"]], epoch=1)
    verdict = contract.judge(fake_runs.run([r0, r1]))
    assert verdict.outcome == "failed"
    assert "train epoch 0: 0 batches of [] tensor rows (not samples)" in verdict.render()


def test_first_sentence_never_cuts_a_sentence():
    from pytest_ltconform.sites import first_sentence

    assert first_sentence("Bad value 1.5 for x. Try again.\nmore") == "Bad value 1.5 for x"
    assert first_sentence("") == ""
    long = "word " * 200
    assert first_sentence(long, limit=50).endswith("word ...")


def _read(use: str, hook: str = "training_step", line: int = 30) -> dict:
    how = {"select": "a subscript (it picks this rank's rows)",
           "gate": "the test of an if (it gates what runs, it selects no data)"}[use]
    return {"ev": "rank_read", "hook": hook, "what": "self.global_rank", "use": use, "how": how,
            "site": {"file": "/x/tsmixer.py", "line": line, "func": "Model._shard"}}


def test_identical_batches_split_by_rank_inside_the_step_pass_with_a_note(fake_runs):
    contract = get_contract("data-sharding")
    same = fake_runs.batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(fake_runs.run([same + [_read("select")], same + [_read("select")]]))
    assert verdict.outcome == "passed", verdict.render()
    assert "train batches are the same on every rank (every rank ran 2 batches) and training_step selects" \
        in verdict.summary
    note = " ".join(verdict.notes)
    assert "training_step reads self.global_rank at /x/tsmixer.py:30 (Model._shard) as a subscript" in note
    assert "the split between ranks happens inside the step, which this check does not see" in note


def test_identical_batches_with_a_rank_read_that_only_gates_still_fail(fake_runs):
    contract = get_contract("data-sharding")
    same = fake_runs.batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(fake_runs.run([same + [_read("gate", line=41)], same]))
    assert verdict.outcome == "failed" and "identical train batches in every step" in verdict.summary
    text = verdict.render()
    assert "training_step reads self.global_rank as the test of an if" in text
    assert "(it gates what runs, it selects no data), so it does not split the batch" in text
    assert "rank 0 at /x/tsmixer.py:41" in text and "inside training_step (e.g. rows[self.global_rank::" in text
    # a selecting read on one rank only, or in another hook, does not explain identical train batches
    for reads in ([[_read("select")], []], [[_read("select", "validation_step")]] * 2):
        verdict = contract.judge(fake_runs.run([same + reads[0], same + reads[1]]))
        assert verdict.outcome == "failed", verdict.render()


def test_classify_rank_reads_by_what_the_line_does(tmp_path):
    from pytest_ltconform.contracts.rank_reads import classify

    src = tmp_path / "m.py"
    src.write_text(
        "import torch\n"
        "class M:\n"
        "    def step(self, w, x):\n"
        "        a = w[self.global_rank::2]\n"                          # 4
        "        if self.global_rank == 0 and x is not None:\n"         # 5
        "            print(a)\n"
        "        rank = torch.distributed.get_rank()\n"                 # 7
        "        b = x.chunk(2)[rank]\n"
        "        c = torch.narrow(x, 0, self.trainer.local_rank, 1)\n"  # 9
        "        print(self.global_rank)\n"                             # 10
        "        return [v for i, v in enumerate(x) if i % 2 == self.global_rank]\n")  # 11
    uses = {line: classify(str(src), line)[0] for line in (4, 5, 7, 9, 10, 11)}
    assert uses == {4: "select", 5: "gate", 7: "select", 9: "select", 10: "other", 11: "select"}
    assert classify(str(src), 9)[1] == "an argument of narrow() (it picks this rank's part)"
    assert classify(str(tmp_path / "missing.py"), 3)[0] == "other"


def _fetched(rank_keys: list[list], epoch: int = 0, ds: int = 7) -> list[dict]:
    """data-sharding's ``ds_index`` events for one rank: one fetch per list of dataset keys."""
    return [{"ev": "ds_index", "stage": "train", "keys": keys, "ds": ds, "epoch": epoch} for keys in rank_keys]


def test_samples_are_the_dataset_keys_fetched_not_tensor_rows(fake_runs):
    """Collated graphs: one-hot atom rows repeat within a rank (the tensor fingerprint calls that a
    replay), but the molecules each rank fetched are disjoint: a pass. The same fetches on every
    rank fail, named by their indices."""
    contract = get_contract("data-sharding")
    atoms = fake_runs.batches([["C", "H", "H", "O"], ["C", "C", "H", "H"]])
    r0 = atoms + _fetched([[0, 2], [4, 6]])
    r1 = [dict(e) for e in atoms] + _fetched([[1, 3], [5, 7]])
    assert contract.judge(fake_runs.run([atoms, [dict(e) for e in atoms]])).outcome == "failed"  # rows only
    verdict = contract.judge(fake_runs.run([r0, r1]))
    assert verdict.outcome == "passed", verdict.render()
    same = contract.judge(fake_runs.run([atoms + _fetched([[0, 2], [4, 6]]),
                                         [dict(e) for e in atoms] + _fetched([[0, 2], [4, 6]])]))
    assert same.outcome == "failed"
    assert "batches compared by the dataset indices they fetched" in same.summary
    assert "sample ids 0, 2, 4, 6 in the same order on every rank" in same.summary


def test_batches_without_keys_or_tensors_are_not_judged(fake_runs):
    contract = get_contract("data-sharding")
    opaque = [{"ev": "batch", "stage": "train", "idx": i, "dl": 0, "epoch": 0, "n": None} for i in range(3)]
    verdict = contract.judge(fake_runs.run([opaque, [dict(e) for e in opaque]]))
    assert verdict.outcome == "not_judged"
    assert verdict.not_judged.reason.startswith("cannot tell samples apart in the train loader over the DataLoader")


def test_keys_of_a_fetch():
    from pytest_ltconform.contracts.data_sharding.probe import _keys

    assert _keys(3) == [3] and _keys([4, 5]) == [4, 5] and _keys(None) is None
    assert _keys(("a", 1)) == ["'a'", 1]


@pytest.mark.slow
def test_index_lists_fetched_by_every_rank_fail_in_a_real_world(pytester, no_leftover_ranks):
    """Batches the fingerprint cannot read (slotted objects) from a sampler yielding index lists:
    the indices __getitem__ receives are recorded on each rank and compared."""
    path = case("data-sharding/index_list_sampler_ignores_rank.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-trainer", f"{path}:trainer_kwargs",
                                           "--ltconform-nodes", "1", "-k", "data-sharding[ and ddp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "batches compared by the dataset indices they fetched" in out


class _Emits:
    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)


def _uses_of(step) -> list[tuple[int, str]]:
    """The ``ds_draw_use`` (draw id, use) events a step makes with draw 1 tracked."""
    from pytest_ltconform.contracts.data_sharding.probe import _Draws

    recorder = _Emits()
    draws = _Draws(recorder)
    draws.key = [0, 0]
    draws.enter()
    try:
        step(lambda t: draws._track(t, 1))
    finally:
        draws.leave()
    return [(e["id"], e["use"]) for e in recorder.events]


def test_a_latent_fed_to_weights_is_input_and_noise_on_data_is_combined():
    import torch

    generator = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    data = torch.randn(8, 2)

    def gan(track):  # z, labels next to it, then the generator: the latent is the sample
        z = torch.randn(8, 3)
        track(z)
        generator(torch.cat([z[:, :2], torch.zeros(8, 1)], dim=1).float())

    def vae(track):  # mu + eps * std: the noise meets each rank's own encoding
        mu, std = data * 2, (data * 0.5).exp()
        eps = torch.randn_like(std)
        track(eps)
        return mu + eps * std

    def dropout(track):  # a mask from the noise, then the batch times the mask
        mask = torch.rand_like(data)
        track(mask)
        return data * (mask > 0.3).float()

    assert _uses_of(gan) == [(1, "input")]
    assert _uses_of(vae) == [(1, "combined")]
    assert _uses_of(dropout) == [(1, "combined")]


# -- iterable datasets: the items the iterator yields ----------------------------------------------

class _Stage:
    value = "train"


class _Trainer:
    sanity_checking = False
    current_epoch = 0

    class state:  # noqa: N801 (Lightning's attribute name)
        stage = _Stage()


class _FileRecorder:
    """The parts of the trace Recorder that _Items uses: emit (main process) and the file a
    worker appends to, and patch/undo."""

    def __init__(self, path):
        import json

        self.trainer = _Trainer()
        self._fh = open(path, "a", buffering=1)
        self._json = json
        self._patches = []

    def emit(self, event):
        self._fh.write(self._json.dumps(event) + "\n")

    def patch(self, owner, name, factory):
        original = owner.__dict__[name]
        setattr(owner, name, factory(original))
        self._patches.append((owner, name, original))

    def undo(self):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._fh.close()


def test_items_of_an_iterable_are_recorded_in_dataloader_workers(tmp_path):
    import json

    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from pytest_ltconform.contracts.data_sharding.probe import _item_hash, _Items

    class Stream(IterableDataset):  # every worker replays the same 6 items
        def __iter__(self):
            return iter([torch.tensor([float(i)]) for i in range(6)])

    recorder = _FileRecorder(tmp_path / "trace.jsonl")
    try:
        _Items(recorder).install()
        batches = list(DataLoader(Stream(), batch_size=3, num_workers=2))
    finally:
        recorder.undo()
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(batches) == 4
    assert sorted({(e["w"], e["nw"]) for e in events}) == [(0, 2), (1, 2)]
    per_worker = [[e["h"] for e in events if e["w"] == w] for w in (0, 1)]
    assert per_worker[0] == per_worker[1] == [_item_hash(torch.tensor([float(i)])) for i in range(6)]


def test_iterable_items_fill_the_batches_they_were_collated_into(fake_runs):
    """Batch k came from worker k % workers: a replay across workers shows as repeated items,
    whatever the collated tensors' rows hold."""
    contract = get_contract("data-sharding")
    loader = {"ev": "ds_loader", "stage": "train", "epoch": 0, "batch_size": 2, "iterable": True,
              "num_workers": 2, "dataset": "Stream"}

    def rank(items_by_worker):
        batches = fake_runs.batches([[f"atom{k}{j}" for j in range(2)] for k in range(4)])
        items = [{"ev": "ds_item", "stage": "train", "epoch": 0, "w": w, "nw": 2, "h": h}
                 for w, hs in enumerate(items_by_worker) for h in hs]
        return [loader] + batches + items

    replayed = contract.judge(fake_runs.run([rank([["a", "b", "c", "d"]] * 2), rank([["e", "f", "g", "h"]] * 2)]))
    assert replayed.outcome == "failed", replayed.render()
    # Every rank that shows it is named (the evidence once gave rank 0 only).
    assert ("every rank (0 and 1) saw its own train dataset items more than once in epoch 0 (rank 0: 4 of 8, "
            "rank 1: 4 of 8)") in replayed.summary
    assert [e.rank for e in replayed.evidence] == [0, 1]
    sharded = contract.judge(fake_runs.run([rank([["a", "b", "c", "d"], ["e", "f", "g", "h"]]),
                                            rank([["i", "j", "k", "l"], ["m", "n", "o", "p"]])]))
    assert sharded.outcome == "passed", sharded.render()


def test_an_item_that_cannot_be_hashed_never_breaks_the_stream(tmp_path, monkeypatch):
    from torch.utils.data import DataLoader, IterableDataset

    from pytest_ltconform.contracts.data_sharding import probe as data_sharding

    def refuse(item):
        raise TypeError("unhashable")

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    monkeypatch.setattr(data_sharding, "_item_hash", refuse)
    recorder = _FileRecorder(tmp_path / "trace.jsonl")
    try:
        data_sharding._Items(recorder).install()
        assert [int(b) for b in DataLoader(Stream(), batch_size=None)] == [0, 1, 2, 3]
    finally:
        recorder.undo()


def test_a_loader_of_its_own_is_named_where_built_and_its_rows_are_not_counted_as_samples(fake_runs):
    """mlcolvar's DictLoader: not a torch DataLoader, so no sampler is injected and nothing reads
    dataset keys; the verdict names its construction line, counts no samples, and says what to do."""
    contract = get_contract("data-sharding")
    built = {"site": {"file": "/pkg/datamodule.py", "line": 168, "func": "DictModule.setup"}, "cls": "DictLoader",
             "torch_loader": False}
    loader = {"ev": "ds_loader", "stage": "train", "epoch": 0, "type": "DictLoader", "built": built,
              "use_distributed_sampler": True}
    same = [loader] + fake_runs.batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(fake_runs.run([same, same]))
    assert verdict.outcome == "failed"
    text = verdict.render()
    assert "4 distinct tensor rows (dataset items cannot be counted in DictLoader)" in verdict.summary
    assert "DictLoader (not a torch DataLoader) is not sharded by rank" in verdict.summary
    assert "2 batches of [2, 2] tensor rows (not samples)" in text and "distinct samples" not in text
    assert "/pkg/datamodule.py:168 (DictModule.setup): the train DictLoader is built here; it is not a torch " \
           "DataLoader, so Lightning injects no DistributedSampler into it" in text
    assert verdict.fix.startswith("DictLoader (built at /pkg/datamodule.py:168 (DictModule.setup)) is not a torch "
                                  "DataLoader, so Lightning injects no DistributedSampler into it: split the samples "
                                  "by rank inside DictLoader")
    assert "return a torch DataLoader over the same dataset" in verdict.fix


def test_items_of_a_stream_without_batching_are_counted_as_the_items_it_yields(fake_runs):
    """pykeen's instances: the IterableDataset yields ready-made batches (batch_size=None), one item each."""
    contract = get_contract("data-sharding")
    loader = {"ev": "ds_loader", "stage": "train", "epoch": 0, "batch_size": None, "iterable": True,
              "num_workers": 0, "dataset": "Instances", "type": "DataLoader"}
    batches = fake_runs.batches([[f"row{k}{j}" for j in range(8)] for k in range(3)])
    items = [{"ev": "ds_item", "stage": "train", "epoch": 0, "w": 0, "nw": 1, "h": h} for h in ("x", "y", "z")]
    verdict = contract.judge(fake_runs.run([[loader] + batches + items] * 2))
    assert verdict.outcome == "failed"
    text = verdict.render()
    assert "3 distinct dataset items" in verdict.summary
    assert "3 batches of [1, 1, 1] dataset items (each a ready-made batch the dataset yields: batch_size=None)" in text


def test_a_loader_built_before_the_hooks_that_lightning_cannot_recreate_is_named_where_built(fake_runs):
    """chemprop's loaders built once in the datamodule's __init__: the DataLoader patch is not yet
    installed then, so the line comes from the loader the hook returned."""
    contract = get_contract("data-sharding")
    tb = ('Traceback (most recent call last):\n  File "/site-packages/lightning/pytorch/utilities/data.py", '
          'line 1, in _update_dataloader\n')
    built = {"ev": "loader_built", "hook": "train_dataloader",
             "loaders": [{"site": {"file": "/pkg/dataloader.py", "line": 87, "func": "build_dataloader"},
                          "cls": "DataLoader", "torch_loader": True}]}
    ranks = [fake_runs.rank(r, [built], status="error", exc_type="TypeError", message="got multiple values",
                            traceback=tb) for r in range(2)]
    verdict = contract.judge(fake_runs.of(ranks, status="error"))
    assert verdict.outcome == "failed" and "Fit fails on every rank at /pkg/dataloader.py:87" in verdict.summary
    assert "/pkg/dataloader.py:87 (build_dataloader): the train DataLoader is built here" in verdict.render()


_HOOK_LOADER_MODULE = '''
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self, n, seed):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


class Model(L.LightningModule):
    """Like rl4co's RolloutBaseline: every rank evaluates the same fixed set at the start of fit and in
    on_train_epoch_end through a DataLoader of its own, on purpose (the ranks must agree on the result)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.baseline_set = Points(18, 7)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def rollout(self):
        with torch.no_grad():
            costs = [self.layer(b).sum() for b in DataLoader(self.baseline_set, batch_size=8)]
        self.baseline_cost = float(sum(costs))

    def on_train_start(self):  # before the first training fetch, as rl4co's setup() does
        self.rollout()

    def on_train_epoch_end(self):
        self.rollout()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Points(48, 3), batch_size=8, shuffle=True)
'''


def test_a_loader_iterated_inside_a_hook_on_every_rank_is_not_the_train_stream(pytester, no_leftover_ranks):
    """The training loader is sharded by Lightning's DistributedSampler; the same 18 samples every
    rank fetches in on_train_epoch_end are not training batches (field trial: rl4co)."""
    pytester.makepyfile(hook_loader=_HOOK_LOADER_MODULE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "hook_loader.py:Model",
                                           "--ltconform-nodes", "1", "-k", "data-sharding[ and ddp", "-rA")
    out = result.stdout.str()
    result.assert_outcomes(passed=1)
    assert "identical" not in out
    assert "train batches hold different samples on each rank" in out
    assert "dataset Points, sampler DistributedSampler" in out


def test_only_the_stage_loaders_fetches_count_and_an_unreadable_wrapper_keeps_all():
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader

    from pytest_ltconform.contracts.data_sharding.probe import _is_stage_stream

    data = torch.arange(6.0)
    train, own = DataLoader(data, batch_size=2), DataLoader(data, batch_size=2)
    trainer = SimpleNamespace(train_dataloader={"a": [train]})
    assert _is_stage_stream(trainer, "train", index_sampler=iter(train)._index_sampler)
    assert not _is_stage_stream(trainer, "train", index_sampler=iter(own)._index_sampler)
    wrapped = SimpleNamespace(train_dataloader=SimpleNamespace(dataset=data))  # no torch DataLoader
    assert _is_stage_stream(wrapped, "train", index_sampler=iter(own)._index_sampler)
    assert _is_stage_stream(SimpleNamespace(), "train", index_sampler=iter(own)._index_sampler)


# -- a split drawn per rank ------------------------------------------------------------------------

def _split_trace(indices, val, seed, draw_line=12, whole=64):
    base = {"base": "TensorDataset", "base_digest": "d1", "whole": whole}
    split = {**base, "n": len(indices), "indices": indices, "indices_hash": str(hash(tuple(indices)))}
    vsplit = {**base, "n": len(val), "indices": val, "indices_hash": str(hash(tuple(val)))}
    return [{"ev": "seeding", "at": "start", "mode": "both", "seed": seed},
            {"ev": "ds_global_draw", "fn": "torch.randperm", "hook": "setup",
             "site": {"file": __file__, "line": draw_line, "func": "DataModule.setup"}},
            {"ev": "ds_loader", "stage": "train", "epoch": 0, "type": "DataLoader", "split": split},
            {"ev": "ds_loader", "stage": "val", "epoch": 0, "type": "DataLoader", "split": vsplit},
            *FakeRuns.batches([[f"r{seed}a"], [f"r{seed}b"]])]


def test_a_split_drawn_per_rank_fails_with_the_overlap_and_the_drawing_line(fake_runs):
    """Issue 38 §1: random_split without a generator in setup(), ranks seeded per rank: their
    training splits differ and overlap, rank 0's validation samples are in rank 1's training split."""
    rank0 = _split_trace(list(range(0, 48)), list(range(48, 64)), seed=0)
    rank1 = _split_trace(list(range(16, 64)), list(range(0, 16)), seed=1)
    verdict = get_contract("data-sharding").judge(fake_runs.run([rank0, rank1]))
    assert verdict.outcome == "failed" and verdict.category == "silent", verdict.render()
    text = verdict.render()
    assert "the training data differs by rank" in verdict.summary
    assert "share 32 of 48 samples" in verdict.summary
    assert "16 of rank 0's 16 validation samples are in rank 1's training split" in verdict.summary
    assert "rank 0: 0, rank 1: 1" in verdict.summary
    assert f"{__file__}:12" in text or "test_data_sharding.py:12" in text
    assert "generator=torch.Generator().manual_seed(42)" in verdict.fix and "seed_everything" in verdict.fix


def test_the_same_split_on_every_rank_passes_and_says_so_under_per_rank_seeds(fake_runs):
    same = list(range(0, 48))
    traces = [_split_trace(same, list(range(48, 64)), seed=s) for s in (0, 1)]
    verdict = get_contract("data-sharding").judge(fake_runs.run(traces))
    assert verdict.outcome == "passed", verdict.render()
    assert any("is the same on every rank although each rank's generators were seeded" in n for n in verdict.notes)
    from pytest_ltconform import claims

    assert claims.check({"contract": verdict.contract, **verdict.as_dict()}) == []
    assert "every rank ran 2 train batches" in verdict.summary


def test_random_data_drawn_per_rank_that_never_overlaps_is_no_split(fake_runs):
    """BoringModel's RandomDataset draws its rows from the global generator: different data on each
    rank under per-rank seeds, but no sample is shared, so nothing is split wrongly."""
    def trace(seed):
        return [{"ev": "ds_loader", "stage": "train", "epoch": 0, "type": "DataLoader",
                 "split": {"base": "RandomDataset", "base_digest": f"d{seed}"}},
                *FakeRuns.batches([[f"r{seed}a", f"r{seed}b"], [f"r{seed}c"]])]
    verdict = get_contract("data-sharding").judge(fake_runs.run([trace(0), trace(1)]))
    assert verdict.outcome == "passed", verdict.render()


def _content_trace(seed, rows, draw=False):
    """A rank whose (non-Subset) dataset has digest ``d<seed>`` and whose batches hold ``rows``."""
    trace = [{"ev": "seeding", "at": "start", "mode": "both", "seed": seed},
             {"ev": "ds_loader", "stage": "train", "epoch": 0, "type": "DataLoader",
              "split": {"base": "Records", "base_digest": f"d{seed}"}},
             *FakeRuns.batches(rows)]
    if draw:
        trace.insert(1, {"ev": "ds_global_draw", "fn": "random.shuffle", "hook": "setup",
                         "site": {"file": __file__, "line": 12, "func": "DataModule.setup"}})
    return trace


def test_datasets_that_differ_without_a_recorded_draw_are_no_split(fake_runs):
    """Field trial (iterable_dataset_unsharded_with_workers): the datasets' digests differ and the
    ranks' batches are identical, but no split was drawn: the split headline must not fire, the
    identical batches head the verdict; with a recorded global draw in setup it is the split."""
    rows = [["a", "b"], ["c", "d"]]
    verdict = get_contract("data-sharding").judge(fake_runs.run([_content_trace(0, rows), _content_trace(1, rows)]))
    assert verdict.outcome == "failed", verdict.render()
    assert "split" not in verdict.summary and "generator" not in verdict.summary, verdict.summary
    assert "identical train batches" in verdict.summary, verdict.summary
    assert "seed_everything" not in verdict.fix and "random_split" not in verdict.fix, verdict.fix
    drawn = fake_runs.run([_content_trace(0, rows, draw=True), _content_trace(1, rows, draw=True)])
    verdict = get_contract("data-sharding").judge(drawn)
    assert verdict.summary.startswith("the training data differs by rank: the split was drawn"), verdict.summary


def test_subsets_that_differ_without_a_recorded_draw_claim_no_global_generator(fake_runs):
    """Subsets chosen per rank without a global draw (e.g. from the rank itself) still differ by
    rank, but the headline and the fix say nothing of the global generator or seeding."""
    rank0 = [e for e in _split_trace(list(range(0, 48)), list(range(48, 64)), seed=0) if e["ev"] != "ds_global_draw"]
    rank1 = [e for e in _split_trace(list(range(16, 64)), list(range(0, 16)), seed=1) if e["ev"] != "ds_global_draw"]
    verdict = get_contract("data-sharding").judge(fake_runs.run([rank0, rank1]))
    assert verdict.outcome == "failed", verdict.render()
    assert "each rank's Subset selects different samples" in verdict.summary, verdict.summary
    assert "generator" not in verdict.summary and "seed_everything" not in verdict.fix, verdict.render()


def test_a_dataset_digest_leaves_out_a_stored_rank():
    import torch
    from torch.utils.data import IterableDataset

    from pytest_ltconform.contracts.data_sharding.probe import dataset_digest

    class Records(IterableDataset):
        def __init__(self, rank, world_size, shift=0.0):
            self.x = torch.arange(8.0) + shift
            self.rank, self.world_size = rank, world_size

        def __iter__(self):
            return iter(self.x)

    assert dataset_digest(Records(0, 2)) == dataset_digest(Records(1, 2))
    assert dataset_digest(Records(0, 2)) != dataset_digest(Records(0, 2, shift=1.0))


def test_the_split_is_read_through_subsets_of_subsets():
    import torch
    from torch.utils.data import Subset, TensorDataset

    from pytest_ltconform.contracts.data_sharding.probe import _through_subsets, dataset_digest, split_info

    base = TensorDataset(torch.arange(10.0))
    inner = Subset(base, [9, 8, 7, 6, 5])
    outer = Subset(inner, [4, 0])
    info = split_info(outer)
    assert info["indices"] == [5, 9] and info["n"] == 2 and info["whole"] == 10 and info["base"] == "TensorDataset"
    assert _through_subsets(outer, [1, 0]) == [9, 5]
    assert dataset_digest(TensorDataset(torch.arange(10.0))) == dataset_digest(base)
    assert dataset_digest(TensorDataset(torch.arange(1, 11.0))) != dataset_digest(base)


def test_ranks_that_read_some_of_the_same_samples_in_an_epoch_fail(fake_runs):
    """Issue 38 §1: under per-rank seeds an unsharded shuffling sampler gives each rank its own order
    over the whole dataset: the batches differ, but the ranks read some of the same samples."""
    def rank(keys_per_batch):
        trace = FakeRuns.batches([[str(k) for k in keys] for keys in keys_per_batch])
        for e, keys in zip(trace, keys_per_batch):
            e.update(src="index", ids=keys, rows=[str(k) for k in keys])
        return trace + [{"ev": "ds_loader", "stage": "train", "epoch": 0, "sampler": "RandomSampler",
                         "dataset": "Molecules", "use_distributed_sampler": False}]

    overlapping = fake_runs.run([rank([[3, 9], [12, 40]]), rank([[40, 1], [9, 22]])])
    verdict = get_contract("data-sharding").judge(overlapping)
    assert verdict.outcome == "failed", verdict.render()
    assert verdict.summary.startswith("rank 0 and rank 1 read 2 of the same train samples in epoch 0")
    assert "use_distributed_sampler=False" in verdict.fix
    padded = fake_runs.run([rank([[3, 9], [12, 40]]), rank([[40, 1], [7, 22]])])  # one repeat: a pad
    assert get_contract("data-sharding").judge(padded).outcome == "passed"


def test_a_global_draw_in_setup_is_recorded_though_fit_is_already_in_the_training_stage():
    """Trainer.fit enters the training stage before setup() and the loader hooks run: a split drawn
    there (random_split in setup) is recorded; a draw from the training loop's own code is not."""
    from types import SimpleNamespace

    from pytest_ltconform.contracts.data_sharding.probe import DS_GLOBAL_DRAW, _Draws

    events, hook = [], ["setup"]
    trainer = SimpleNamespace(state=SimpleNamespace(stage=SimpleNamespace(value="train")), training=True)
    recorder = SimpleNamespace(trainer=trainer, emit=events.append, current_hook=lambda: hook[0])
    draws = _Draws(recorder)

    def wrapper():  # where the patched torch.randperm calls outside_step from
        draws.outside_step("torch.randperm", {})

    def setup():  # the user's line that draws
        wrapper()

    setup()
    hook[0] = "on_train_batch_end"
    setup()
    assert [e.get("hook") for e in events if e.get("ev") == DS_GLOBAL_DRAW] == ["setup"], events


def test_identical_ranks_on_two_nodes_blame_the_local_rank_only_when_the_data_read_it(fake_runs):
    """Field trial (iterable_dataset_unsharded_with_workers, [ddp-2nodes]): a stream nothing splits is
    identical on one rank per node; 'split by the local rank' needs a read of the local rank while
    the data is built."""
    rows = [["a", "b"], ["c", "d"]]

    def rank(node, read):
        trace = [{"ev": "ds_place", "node": node, "local_rank": 0}, *FakeRuns.batches(rows)]
        if read:
            trace.append({"ev": "rank_read", "hook": "train_dataloader", "what": "self.trainer.local_rank",
                          "site": {"file": __file__, "line": 3, "func": "Model.train_dataloader"},
                          "use": "data", "how": "read while the data is built"})
        return trace

    plain = get_contract("data-sharding").judge(fake_runs.run([rank(0, False), rank(1, False)]))
    assert plain.outcome == "failed" and "identical train batches" in plain.summary, plain.render()
    assert "local rank" not in plain.summary and "local_rank" not in plain.fix, plain.render()
    local = get_contract("data-sharding").judge(fake_runs.run([rank(0, True), rank(1, True)]))
    assert "the data is split by the local rank" in local.summary, local.render()


def test_stream_length_is_not_the_runs_capped_step_count(fake_runs):
    """An unsharded stream of 64 items in batches of 8 gives each rank 8 batches; the run, capped
    at 4, took 4 steps, which must not be given as the stream's length."""
    contract = get_contract("data-sharding")
    loader = {"iterable": True, "batch_size": 8, "dataset": "RecordStream"}
    run = fake_runs.probed("data-sharding", [{"stream_len": {"train": 64}}] * 2)
    text = contract._loader_evidence(run, "train", loader, 4)[0].detail
    assert text == ("IterableDataset RecordStream yields all 64 items on each rank: 8 batches of 8 per rank per "
                    "epoch, where a split by rank gives 64 items / (8 per batch x 2 ranks) = 4; this run took 4 "
                    "steps per rank per epoch, fewer than 8 because the run limits the batches of an epoch")
    uncapped = contract._loader_evidence(run, "train", dict(loader, batch_size=32), 2)[0].detail
    assert uncapped.endswith("this run took 2 steps per rank per epoch")
