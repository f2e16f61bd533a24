"""data-sharding on a nodes world: a seed derived from the local rank, which repeats on every node,
named as a seed (value per rank, the seeding line, the read of the local rank) and never as a split
of the data; and the rank-side recording of seeding calls and LOCAL_RANK reads (seed_watch)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import FakeRuns, case

from pytest_ltconform import claims
from pytest_ltconform.contracts import get_contract

SETUP = {"file": __file__, "func": "Model.setup"}


def _rank(node: int, seed: int, rows: list, read: str = "env", read_func: str = "Model.setup") -> list[dict]:
    """One rank of a 2-node x 1 world: its place, batches, a read of the local rank at line 10 of
    ``read_func`` (from the environment, or trainer.local_rank) and torch.manual_seed(seed) at line 11."""
    trace = [{"ev": "ds_place", "node": node, "local_rank": 0}, *FakeRuns.batches(rows),
             {"ev": "user_seed", "fn": "torch.manual_seed", "value": seed, "hook": "setup",
              "site": {**SETUP, "line": 11}}]
    site = {"file": __file__, "line": 10, "func": read_func}
    if read == "env":
        trace.append({"ev": "env_rank_read", "key": "LOCAL_RANK", "value": "0", "site": site, "hook": "setup",
                      "code": 'seed = SEED + int(os.environ["LOCAL_RANK"])'})
    else:
        trace.append({"ev": "rank_read", "hook": "setup", "what": "self.trainer.local_rank", "site": site,
                      "use": "data", "how": "read while the data is built"})
    return trace


def _checked(verdict) -> None:
    assert claims.check({"contract": verdict.contract, **verdict.as_dict()}) == [], verdict.render()


@pytest.mark.parametrize("read", ["env", "trainer"])
def test_identical_ranks_whose_seed_came_from_the_local_rank_are_told_the_seed_not_a_split(fake_runs, read):
    """Field trial (mujocolab/mjlab#988 rebuilt, [ddp-2nodes]): seed = base + LOCAL_RANK, then
    torch.manual_seed: both nodes' rank draws the same stream. The verdict names the seed on each
    rank, the line and the read, with the global-rank fix; 'split by the local rank' is not said."""
    rows = [["a", "b"], ["c", "d"]]
    traces = [_rank(0, 1000, rows, read), _rank(1, 1000, rows, read)]
    verdict = get_contract("data-sharding").judge(fake_runs.run(traces))
    assert verdict.outcome == "failed" and "identical train batches" in verdict.summary, verdict.render()
    assert "split by the local rank" not in verdict.summary, verdict.render()
    text = verdict.summary
    assert "global rank 0 (node 0, local rank 0) and global rank 1 (node 1, local rank 0)" in text, text
    assert "torch.manual_seed with 1000 on rank 0, 1000 on rank 1" in text
    assert f"{os.path.basename(__file__)}:11" in text
    assert f"{os.path.basename(__file__)}:10" in text
    assert verdict.fix.startswith("derive the seed from the global rank (trainer.global_rank / RANK)"), verdict.fix
    if read == "env":
        assert '`seed = SEED + int(os.environ["LOCAL_RANK"])`' in text
    _checked(verdict)


def test_a_local_rank_read_that_fed_no_seed_is_still_a_split_by_the_local_rank(fake_runs):
    """The local rank read in another function than the seeding call (a shard id in the dataloader
    hook) is a split: the split sentence stays, and no seed sentence is made."""
    rows = [["a", "b"], ["c", "d"]]
    traces = [_rank(n, 1000, rows, "trainer", read_func="Model.train_dataloader") for n in (0, 1)]
    verdict = get_contract("data-sharding").judge(fake_runs.run(traces))
    assert "the data is split by the local rank" in verdict.summary, verdict.render()
    assert "derived from the local rank" not in verdict.summary and verdict.fix.startswith("shard by the global rank")
    _checked(verdict)


def test_different_seeds_or_one_node_make_no_seed_sentence(fake_runs):
    """Seeds that differ (base + global rank), or ranks on one node, share nothing."""
    rows = [["a", "b"], ["c", "d"]]
    differ = get_contract("data-sharding").judge(fake_runs.run([_rank(0, 1000, rows), _rank(1, 1001, rows)]))
    assert "seeded with the same value" not in differ.summary, differ.render()
    one_node = [_rank(0, 1000, rows), _rank(0, 1000, rows)]
    for trace, local in zip(one_node, (0, 1)):
        trace[0] = {"ev": "ds_place", "node": 0, "local_rank": local}
    assert "seeded with the same value" not in get_contract("data-sharding").judge(fake_runs.run(one_node)).summary


def test_a_shared_seed_with_different_batches_passes_and_says_so_in_a_note(fake_runs):
    verdict = get_contract("data-sharding").judge(fake_runs.run([_rank(0, 1000, [["a"], ["b"]]),
                                                                 _rank(1, 1000, [["c"], ["d"]])]))
    assert verdict.outcome == "passed", verdict.render()
    assert any("seeded with the same value, derived from the local rank" in n and "derive the seed from the global "
               "rank" in n for n in verdict.notes), verdict.notes
    _checked(verdict)


def test_seed_collision_claim_rests_on_equal_values_on_different_nodes():
    places = {"0": {"node": 0, "local_rank": 0}, "1": {"node": 1, "local_rank": 0}}
    good = {"values": {"0": 7, "1": 7}, "places": places, "read": "m.py:3 (f)"}
    text = "seeded with the same value, derived from the local rank: 7 on rank 0, 7 on rank 1 after m.py:3"
    record = {"contract": "data-sharding", "message": text, "claims": [{"kind": "seed-collision", "text": text,
                                                                         "facts": good}]}
    assert claims.check(record) == []
    record["claims"][0]["facts"] = {**good, "values": {"0": 7, "1": 8}}
    assert claims.check(record) and "not one value" in claims.check(record)[0]
    record["claims"] = []
    assert claims.check(record), "the prose without a claim is a false sentence"


# -- rank side: what seed_watch records ---------------------------------------------------------------

def _recorded(tmp_path, body) -> list[dict]:
    """Run ``body()`` with seed_watch installed on a real Recorder; the events it wrote."""
    from pytest_ltconform.seed_watch import watch_env_rank, watch_seeding
    from pytest_ltconform.trace import Recorder

    path = str(tmp_path / "trace.jsonl")
    recorder = Recorder(path, 0)
    watch_seeding(recorder)
    watch_env_rank(recorder)
    try:
        body()
    finally:
        recorder.uninstall()
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_seed_watch_records_values_generators_and_local_rank_reads_of_user_code(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("LOCAL_RANK", "0")
    kept = {}

    def body():
        seed = 1000 + int(os.environ["LOCAL_RANK"])
        torch.manual_seed(seed)
        kept["gen"] = torch.Generator().manual_seed(seed + 1)
        kept["isinstance"] = isinstance(torch.default_generator, torch.Generator)
        os.getenv("LOCAL_RANK")

    original = torch.Generator
    events = _recorded(tmp_path, body)
    assert torch.Generator is original and kept["isinstance"]
    seeds = [(e["fn"], e["value"]) for e in events if e.get("ev") == "user_seed"]
    assert seeds == [("torch.manual_seed", 1000), ("torch.Generator.manual_seed", 1001)], events
    reads = [e for e in events if e.get("ev") == "env_rank_read"]
    assert [r["code"] for r in reads] == ['seed = 1000 + int(os.environ["LOCAL_RANK"])', 'os.getenv("LOCAL_RANK")']
    assert all(r["site"]["file"] == __file__ and r["value"] == "0" for r in reads), reads
    assert torch.randn(1, generator=kept["gen"]).shape == (1,)


def test_seed_watch_leaves_out_a_library_reading_the_environment(tmp_path, monkeypatch):
    """Lightning's cluster environment reads LOCAL_RANK too: not user code's read."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("LOCAL_RANK", "0")
    events = _recorded(tmp_path, lambda: LightningEnvironment().local_rank())
    assert [e for e in events if e.get("ev") == "env_rank_read"] == []


def test_a_seed_from_local_rank_fails_on_two_nodes_naming_the_seed_in_a_real_world(pytester, no_leftover_ranks):
    path = case("data-sharding/rollout_seed_from_local_rank.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-trainer", f"{path}:trainer_kwargs",
                                           "-k", "data-sharding[ and 2nodes", "-v")
    out = result.stdout.str()
    assert result.parseoutcomes().get("failed") == 1, out
    assert "global rank 0 (node 0, local rank 0) and global rank 1 (node 1, local rank 0) each called " \
           "torch.manual_seed with 1000 on rank 0, 1000 on rank 1" in out, out
    assert "split by the local rank" not in out and "derive the seed from the global rank" in out
