"""node-local-files: where a path lies (node_storage.locate), the rank-side probe on real files, and
verdicts on hand-made records of two nodes (the worlds themselves: tests/test_nodes.py and the corpus)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch  # imported at collection: a test below saves with it (see NOTES on in-process runs)

from pytest_ltconform.contracts import get_contract, node_storage
from pytest_ltconform.contracts.node_local_files import faults
from pytest_ltconform.contracts.node_local_files import probe as nlf_probe

WORLD = "/tmp/ltconform-world-abc"
RUN = f"{WORLD}/job0003"
MOUNT = f"{WORLD}/node-local"


def _storage(node: int, how: str = "mountns", nodes: int = 2) -> dict:
    """What rank_storage reports on ``node`` of a two-node world kept apart by ``how``."""
    if how == "mountns":
        local = [[f"{MOUNT}/job0003", -1, "<gettempdir>"]]
        local += [[f"{WORLD}/node{n}/job0003", n, "<gettempdir>"] for n in range(nodes) if n != node]
        local += [[f"{WORLD}/node{n}", n, f"<node {n}'s temp folder>"] for n in range(nodes) if n != node]
    else:
        local = [[f"{WORLD}/node{node}/job0003", node, "<gettempdir>"]]
        for n in range(nodes):
            local += [[f"{WORLD}/node{n}/job0003", n, "<gettempdir>"],
                      [f"{WORLD}/node{n}", n, f"<node {n}'s temp folder>"]]
    local.append([MOUNT, -1, "<node-local tmpfs>"])
    return {"node": node, "nodes": nodes, "storage": how, "local": local, "shared": [RUN, WORLD, "/work/project"],
            "system": ["/tmp", "/var/tmp", "/dev/shm"]}


def test_a_path_is_placed_on_the_node_whose_storage_holds_it():
    on1 = _storage(1)
    assert node_storage.locate(f"{MOUNT}/job0003/toy/train.pt", on1) == (1, "<gettempdir>/toy/train.pt")
    assert node_storage.locate(f"{MOUNT}/job0003/toy/train.pt", _storage(0)) == (0, "<gettempdir>/toy/train.pt")
    # The run's folder and the world's are shared storage even though they lie under /tmp here.
    assert node_storage.locate(f"{RUN}/checkpoints/last.ckpt", on1) is None
    assert node_storage.locate("/work/project/data.csv", on1) is None
    # The system temp folders are the accessing node's own.
    assert node_storage.locate("/dev/shm/cache", on1) == (1, "/dev/shm/cache")
    assert node_storage.locate("/tmp/other/x", on1) == (1, "/tmp/other/x")
    # A folder per node: another node's folder, reached through this host's disk, is that node's storage.
    tmp1 = _storage(1, "tmpdir")
    assert node_storage.locate(f"{WORLD}/node0/job0003/ckpts/a.ckpt", tmp1) == (0, "<gettempdir>/ckpts/a.ckpt")
    assert node_storage.locate(f"{WORLD}/node1/job0003/ckpts/a.ckpt", tmp1) == (1, "<gettempdir>/ckpts/a.ckpt")
    assert node_storage.locate("/opt/data/x", tmp1) is None
    assert node_storage.on(0, "<gettempdir>/x") == "<gettempdir>/x on node 0's local storage"


def _access(op, path, storage, site_line=None, hook="DataModule.setup", ckpt=None, raw=None):
    site = {"file": "/work/project/case.py", "line": site_line, "func": hook} if site_line else None
    return {"ev": nlf_probe.FILE_EVENT, "op": op, "path": path, "storage": storage, "raw": raw or f"/x{path}",
            "site": site, "ckpt": ckpt, "hook": hook}


def _trace(node: int, *events, how: str = "mountns", per_node: bool = False) -> list[dict]:
    return [{"ev": node_storage.EVENT, **_storage(node, how)},
            {"ev": nlf_probe.PREPARE_EVENT, "per_node": {"DataModule": per_node}}, *events]


def test_a_file_only_node_0_prepared_and_node_1_read_fails_with_both_lines(fake_runs):
    contract = get_contract("node-local-files")
    traces = [_trace(0, _access("mkdir", "<gettempdir>/toy", 0, 38, "DataModule.prepare_data"),
                     _access("write", "<gettempdir>/toy/train.pt", 0, 42, "DataModule.prepare_data"),
                     _access("read", "<gettempdir>/toy/train.pt", 0, 48)),
              _trace(1, _access("read", "<gettempdir>/toy/train.pt", 1, 48))]
    verdict = contract.judge(fake_runs.run(traces))
    assert verdict.outcome == "failed", verdict.render()
    text = verdict.render()
    assert ("prepare_data (prepare_data_per_node=False: global rank 0 only): global rank 0 (node 0) wrote "
            "<gettempdir>/toy/train.pt on node 0's local storage in DataModule.prepare_data") in text
    assert "global rank 1 (node 1) opened the same path in DataModule.setup" in text
    assert "case.py:42" in text and "case.py:48" in text  # the writer's line and the reader's
    assert "prepare_data_per_node=True" in verdict.fix and "shared filesystem" in verdict.fix


def test_the_reader_that_raised_for_that_path_is_named_and_the_stop_is_this_contracts(fake_runs):
    contract = get_contract("node-local-files")
    traces = [_trace(0, _access("write", "<gettempdir>/toy/train.pt", 0, 42, "DataModule.prepare_data",
                                raw=f"{MOUNT}/job0003/toy/train.pt")),
              _trace(1, _access("read", "<gettempdir>/toy/train.pt", 1, 48, raw=f"{MOUNT}/job0003/toy/train.pt"))]
    ranks = [fake_runs.rank(0, traces[0], status="hung"),
             fake_runs.rank(1, traces[1], status="error", exc_type="FileNotFoundError",
                            message=f"[Errno 2] No such file or directory: '{MOUNT}/job0003/toy/train.pt'")]
    run = fake_runs.of(ranks, status="error")
    assert contract.blames(run) is not None
    verdict = contract.judge(run)
    assert verdict.outcome == "failed" and "opened the same path in DataModule.setup: FileNotFoundError" in \
        verdict.summary


@pytest.mark.parametrize("other,category", [("ok", "crash"), ("error", "crash"), ("hung", "deadlock")])
def test_the_headline_label_follows_what_the_run_recorded(fake_runs, other, category):
    """Field trial tnodes F1-F3: the reader raised FileNotFoundError and its peer ended ok or failed in a
    collective whose peer had gone; nothing hung, yet the headline said '(deadlocks the world)'."""
    contract = get_contract("node-local-files")
    path = f"{MOUNT}/job0003/toy/train.pt"
    traces = [_trace(0, _access("write", "<gettempdir>/toy/train.pt", 0, 42, "DataModule.prepare_data", raw=path)),
              _trace(1, _access("read", "<gettempdir>/toy/train.pt", 1, 48, raw=path))]
    peer = {"exc_type": "RuntimeError", "message": "Connection closed by peer"} if other == "error" else {}
    ranks = [fake_runs.rank(0, traces[0], status=other, **peer),
             fake_runs.rank(1, traces[1], status="error", exc_type="FileNotFoundError",
                            message=f"[Errno 2] No such file or directory: '{path}'")]
    verdict = contract.judge(fake_runs.of(ranks, status="error"))
    assert verdict.outcome == "failed" and verdict.category == category, verdict.render()
    assert ("(deadlocks the world)" in verdict.render()) == (category == "deadlock")
    # A run that finished (a folder per node, where the path opened) recorded neither: no label.
    assert contract.judge(fake_runs.run([traces[0], traces[1]])).category is None


def test_each_node_preparing_its_own_copy_passes(fake_runs):
    contract = get_contract("node-local-files")
    traces = [_trace(n, _access("write", "<gettempdir>/toy/train.pt", n, 42, "DataModule.prepare_data"),
                     _access("read", "<gettempdir>/toy/train.pt", n, 48), per_node=True) for n in (0, 1)]
    run = fake_runs.run(traces)
    verdict = contract.judge(run)
    assert verdict.outcome == "passed", verdict.render()
    assert "<gettempdir>/toy/train.pt" in verdict.summary and "nodes 0, 1" in verdict.summary
    assert contract.blames(run) is None


def test_another_nodes_folder_read_through_the_shared_disk_fails_as_on_a_cluster(fake_runs):
    """A folder per node (no namespaces): node 1 opens the path rank 0 broadcast, in node 0's folder."""
    contract = get_contract("node-local-files")
    dirs = {"ev": nlf_probe.CKPT_DIR_EVENT, "callback": "ModelCheckpoint", "raw": f"{WORLD}/node0/job0003/ckpts",
            "path": "<gettempdir>/ckpts", "storage": 0, "given": True,
            "site": {"file": "/work/project/case.py", "line": 66, "func": "trainer_kwargs"}}
    save = _access("write", "<gettempdir>/ckpts/epoch=1-step=16.ckpt", 0, None, "ModelCheckpoint.on_validation_end",
                   ckpt="save")
    traces = [_trace(0, dirs, save, _access("read", "<gettempdir>/ckpts/epoch=1-step=16.ckpt", 0, 29,
                                            "RestoreBest.on_fit_end"), how="tmpdir"),
              _trace(1, _access("read", "<gettempdir>/ckpts/epoch=1-step=16.ckpt", 0, 29, "RestoreBest.on_fit_end"),
                     how="tmpdir")]
    verdict = contract.judge(fake_runs.run(traces))
    assert verdict.outcome == "failed", verdict.render()
    text = verdict.render()
    assert "global rank 1 (node 1) opened the same path in RestoreBest.on_fit_end" in text
    assert ("ModelCheckpoint(dirpath=<gettempdir>/ckpts) saved epoch=1-step=16.ckpt from global rank 0 (node 0) "
            "onto node 0's local storage: no other node has it") in text
    assert "case.py:66" in text and "case.py:29" in text
    assert "default_root_dir on a shared filesystem" in verdict.fix


def test_a_sharded_checkpoint_written_from_both_nodes_is_held_by_no_node_whole(fake_runs):
    contract = get_contract("node-local-files")
    dirs = {"ev": nlf_probe.CKPT_DIR_EVENT, "callback": "ModelCheckpoint", "raw": "/tmp/ckpts", "path": "/tmp/ckpts",
            "storage": 0, "given": True, "site": None}
    traces = [_trace(n, *([dirs] if n == 0 else []),
                     _access("write", f"/tmp/ckpts/last.ckpt/__{n}_0.distcp", n, None, "ModelCheckpoint", ckpt="save"))
              for n in (0, 1)]
    verdict = contract.judge(fake_runs.run(traces))
    assert verdict.outcome == "failed"
    assert "from nodes 0, 1 each onto its own local storage: no node holds the whole checkpoint" in verdict.summary


def test_a_user_default_root_dir_on_node_local_storage_fails_and_a_run_on_one_node_is_not_judged(fake_runs):
    contract = get_contract("node-local-files")
    root = {"ev": nlf_probe.ROOT_DIR_EVENT, "path": "/tmp/runs", "storage": 0, "raw": "/tmp/runs"}
    verdict = contract.judge(fake_runs.run([_trace(0, root), _trace(1)]))
    assert verdict.outcome == "failed" and "default_root_dir=/tmp/runs" in verdict.summary
    one_node = fake_runs.run([_trace(0), _trace(0)])
    assert contract.judge(one_node).outcome == "not_judged"
    nothing = contract.judge(fake_runs.run([_trace(0), _trace(1)]))
    assert nothing.outcome == "passed" and "no rank read, listed or wrote node-local storage" in nothing.summary


class _Recorder:
    def __init__(self):
        self.events, self._patches, self.closed = [], [], False

    def emit(self, event):
        self.events.append(event)

    def current_hook(self):
        return "DataModule.prepare_data"

    def patch(self, owner, name, factory):
        original = getattr(owner, name)
        setattr(owner, name, factory(original))
        self._patches.append((owner, name, original))

    def undo(self):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


def test_the_probe_records_node_local_accesses_with_the_user_line(tmp_path, monkeypatch):
    from pytest_ltconform.world import rank as rank_mod

    local = tmp_path / "node-local" / "job0001"
    local.mkdir(parents=True)
    run_dir = tmp_path / "job0001"
    run_dir.mkdir()
    ctx = rank_mod.RankContext(0, 2, 0, str(run_dir / "rank0"), str(tmp_path / "t.jsonl"), None, num_nodes=2,
                               run_dir=str(run_dir), node_rank=1, node_local=str(local), node_storage="mountns")
    monkeypatch.setattr(rank_mod, "_CURRENT", ctx)
    monkeypatch.setenv("TMPDIR", str(local))
    recorder = _Recorder()
    probe = nlf_probe.NodeLocalFilesProbe()
    try:
        probe.install(recorder)
        monkeypatch.setattr(tempfile, "tempdir", None)  # the next gettempdir() writes its check file (F5-F7)
        assert tempfile.gettempdir() == str(local)
        os.makedirs(local / "toy", exist_ok=True)  # user code for the probe: this test file
        torch.save({"x": torch.zeros(2)}, str(local / "toy" / "train.pt"))
        with open(local / "toy" / "train.pt", "rb") as fh:
            fh.read(4)
        os.listdir(local / "toy")
        with open(run_dir / "shared.txt", "w") as fh:  # the run's folder: shared storage, not recorded
            fh.write("x")
    finally:
        probe.collect(None, None, recorder)
        recorder.undo()
    seen = [(e["op"], e["path"], e["storage"]) for e in recorder.events if e["ev"] == nlf_probe.FILE_EVENT]
    assert ("mkdir", "<gettempdir>/toy", 1) in seen
    assert ("write", "<gettempdir>/toy/train.pt", 1) in seen and ("read", "<gettempdir>/toy/train.pt", 1) in seen
    assert ("list", "<gettempdir>/toy", 1) in seen
    assert not any("shared.txt" in path for _, path, _ in seen)
    assert all(path.startswith("<gettempdir>/toy") for _, path, _ in seen), seen  # not gettempdir()'s check file
    files = [e for e in recorder.events if e["ev"] == nlf_probe.FILE_EVENT]
    assert all(e["site"]["file"] == __file__ for e in files)
    assert recorder.events[0]["ev"] == node_storage.EVENT and recorder.events[0]["node"] == 1


@pytest.mark.parametrize("how", ["mountns", "tmpdir"])
def test_the_same_record_gives_the_same_verdict_however_the_nodes_were_kept_apart(fake_runs, how):
    """The verdict is read from who wrote what where, so a folder per node (where the kernel refuses
    namespaces) judges as the private tmpfs per node does."""
    contract = get_contract("node-local-files")
    node_of_read = 1 if how == "mountns" else 0  # tmpdir: node 1 opens node 0's folder, reached on this host
    traces = [_trace(0, _access("write", "<gettempdir>/c.pt", 0, 10, "Model.on_fit_end"), how=how),
              _trace(1, _access("read", "<gettempdir>/c.pt", node_of_read, 20, "Model.on_fit_end"), how=how)]
    verdict = contract.judge(fake_runs.run(traces))
    assert verdict.outcome == "failed"
    assert verdict.summary.startswith("global rank 0 (node 0) wrote <gettempdir>/c.pt on node 0's local storage")
    assert [f.reader for f in faults.cross_node_reads(faults.Record.of(fake_runs.run(traces)))] == [1]


def test_a_file_written_in_setup_gets_the_fix_of_its_writer_hook_not_prepare_data_per_node(fake_runs):
    """Field trial N5: a file setup() wrote on global rank 0 into node-local storage and another node read; the fix
    named prepare_data_per_node=True, which places prepare_data only."""
    contract = get_contract("node-local-files")
    traces = [_trace(0, _access("write", "<gettempdir>/toy/index.json", 0, 42, "DataModule.setup"),
                     _access("read", "<gettempdir>/toy/index.json", 0, 48)),
              _trace(1, _access("read", "<gettempdir>/toy/index.json", 1, 48))]
    verdict = contract.judge(fake_runs.run(traces))
    assert verdict.outcome == "failed", verdict.render()
    assert "prepare_data_per_node=True" not in verdict.fix
    assert verdict.fix.startswith("the file is written in DataModule.setup, where prepare_data_per_node does not apply")
    assert "storage every node mounts" in verdict.fix and "`if self.trainer.local_rank == 0:`" in verdict.fix
def test_rank_zero_only_on_a_per_node_prepare_data_is_named_and_the_set_flag_is_not_offered(fake_runs, tmp_path):
    """Field trial tnodes F4/W4: prepare_data_per_node=True was set, `@rank_zero_only` on prepare_data kept node 1
    from writing; the fix offered prepare_data_per_node=True and the decorator went unnamed."""
    source = tmp_path / "case.py"
    source.write_text("from lightning.pytorch.utilities import rank_zero_only\n\n\nclass DataModule:\n"
                      "    @rank_zero_only\n    def prepare_data(self):\n        save()\n")
    write = _access("write", "<gettempdir>/toy/train.pt", 0, 7, "DataModule.prepare_data")
    write["site"]["file"] = str(source)
    traces = [_trace(0, write, _access("read", "<gettempdir>/toy/train.pt", 0, 48), per_node=True),
              _trace(1, _access("read", "<gettempdir>/toy/train.pt", 1, 48), per_node=True)]
    verdict = get_contract("node-local-files").judge(fake_runs.run(traces))
    assert verdict.outcome == "failed", verdict.render()
    assert "prepare_data_per_node=True (Lightning's default) has" not in verdict.fix
    assert verdict.fix.startswith("remove @rank_zero_only at ") and "case.py:5 (prepare_data)" in verdict.fix
    assert "local rank 0 of every node, but @rank_zero_only at " in verdict.summary
    # Without the decorator in the source, the flag already set is still not offered.
    plain = tmp_path / "plain.py"
    plain.write_text("class DataModule:\n    def prepare_data(self):\n\n\n\n\n        save()\n")
    write["site"]["file"] = str(plain)
    verdict = get_contract("node-local-files").judge(fake_runs.run(traces))
    assert "@rank_zero_only" not in verdict.render() and "is already set" in verdict.fix
    assert "prepare_data_per_node=True (Lightning's default) has" not in verdict.fix


def test_the_storage_note_cites_the_recorded_nodes_ranks_and_folders():
    """The note said fixed words (/tmp, /var/tmp and /dev/shm count as each node's own) whatever the
    ranks recorded: each of its facts now comes from the recorded storage and ranks."""
    from pytest_ltconform.contracts.node_local_files.faults import Record

    storage = {"node": 0, "nodes": 2, "storage": "mountns", "local": [["/w/n", -1, "<node-local tmpfs>"]],
               "shared": ["/w/run"], "system": ["/tmp", "/dev/shm"]}
    record = Record(storage, {0: 0, 1: 0, 2: 1, 3: 1}, [], [], [], None, [])
    note = record.storage_note()
    assert "2 nodes (node 0: ranks 0, 1; node 1: ranks 2, 3)" in note
    assert "recorded as each node's own: /tmp, /dev/shm, <node-local tmpfs>; as shared: /w/run." in note
    assert "/var/tmp" not in note  # not recorded here, so not said
