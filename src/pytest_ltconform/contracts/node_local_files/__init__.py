"""node-local-files: every node reads only what is on its own storage or on storage every node
mounts, and checkpoints go to shared storage.

Seed section "Multi-node launch": every node runs the same code and needs access to the data and
the checkpoints. ``/tmp``, ``/dev/shm``, ``$TMPDIR``, ``$SLURM_TMPDIR`` and ``tempfile.gettempdir()``
are each node's own on a cluster: a file one node's rank writes there does not exist on another
node, whatever the path is called.

Checked on the nodes tier's worlds (several nodes on this host, each with its own node-local storage,
see ``world.nodes``) and in a launched world of several nodes (the multinode tier), from what every
rank's probe recorded: each read, listing and open of a node-local path, each write, folder, rename
and copy there, with the user's line, and where each checkpoint callback's folder is. It fails

- when a rank reads, lists or loads a node-local path that only ranks of another node wrote (the
  same path on the reader's own node holds nothing), naming the path, the writing rank and node,
  the reading rank and node and both user lines; a rank that then raised (its node really had no
  such file, under a private mount namespace) is this contract's finding, not a crash of the user's;
- when a checkpoint goes to node-local storage: a ModelCheckpoint ``dirpath`` there, a
  ``trainer.save_checkpoint`` path there, the user's ``default_root_dir`` there (where Lightning's
  own checkpoints go); a sharded checkpoint whose files several nodes wrote is held by no node whole.

The verdict is read from the record, so it is the same whether the ranks' storage was kept apart
by mount namespaces (where the fault also shows as a real FileNotFoundError) or by a folder per
node (where a path handed from one node to another still opens on this host).
"""

from __future__ import annotations

from ...outcomes import Outcome
from ..base import Blame, Contract, Evidence, Run, Verdict, merged
from . import faults
from .probe import NodeLocalFilesProbe

FIX_DATA = ("write it to storage every node mounts (a shared filesystem: the run's default_root_dir, a project "
            "data folder), or prepare it on every node: prepare_data_per_node=True (Lightning's default) has each "
            "node's local rank 0 write its own node-local copy.")
FIX_SHARED = ("write it to storage every node mounts (a shared filesystem: the run's default_root_dir, a project "
              "data folder)")


def fix_data(writers: list, record=None) -> str:
    """The fix for node-local data another node read, following the hook that wrote it: only
    prepare_data is placed by prepare_data_per_node; a file written elsewhere (setup, a step, outside
    any hook) is placed by the user's own guard. A prepare_data_per_node=True the run recorded is not
    offered again: the rank decorator that kept the other nodes out is named instead, where its source has one."""
    hooks = list(dict.fromkeys(faults.hook_name(w.hook) for w in writers if w.hook))
    guard = faults.prepare_guard(record, writers) if record is not None else None
    if guard is not None:
        return (f"remove {guard['text']} at {faults.fmt_site(guard)}: with "
                f"prepare_data_per_node=True (already set) Lightning runs prepare_data on each node's local rank 0, "
                f"and the decorator stops all but global rank 0; or {FIX_SHARED}.")
    if record is not None and faults.per_node_prepare(record, writers):
        return (f"{FIX_SHARED} (prepare_data_per_node=True, which has each node's local rank 0 run prepare_data, "
                f"is already set).")
    if any(h.endswith(".prepare_data") for h in hooks) or not hooks:
        return FIX_DATA
    named = " and ".join(hooks[:2])
    return (f"the file is written in {named}, where prepare_data_per_node does not apply (it places prepare_data "
            f"only): write it to storage every node mounts (a shared filesystem: the run's default_root_dir, a "
            f"project data folder), or write it on every node: guard the write with `if self.trainer.local_rank "
            f"== 0:` (each node's local rank 0, not the global rank zero) and call self.trainer.strategy.barrier() "
            f"before any rank reads it; or move the writing into prepare_data, which Lightning runs on each "
            f"node's local rank 0 by default.")


FIX_CKPT = ("put checkpoints on storage every node mounts: leave ModelCheckpoint(dirpath=...) unset with "
            "default_root_dir on a shared filesystem, or give it a shared dirpath; a checkpoint in node-local "
            "scratch must be copied to shared storage before another node (or a later job) reads it.")


def consequence(run: Run, reads: list) -> str | None:
    """The headline's category, from what the run recorded (field trial tnodes F1-F3): a listing of
    another node's folder is silent (it comes back empty on a cluster); a rank left waiting and
    killed is a deadlock; a rank that raised or died, none left waiting, is a crash; a run that
    finished recorded neither, so the headline carries no label."""
    ranks = run.job.ranks
    if all(r.op == "list" for r in reads):
        return "silent"
    if any(r.status == "hung" for r in ranks):
        return "deadlock"
    if any(r.status in ("error", "died") for r in ranks):
        return "crash"
    return None


class NodeLocalFiles(Contract):
    id = "node-local-files"
    title = "Nodes read only their own node-local files; checkpoints go to storage every node mounts"
    rule_section = "Multi-node launch"
    strategies = ("ddp", "fsdp")
    tiers = ("nodes", "multinode")
    probe_class = NodeLocalFilesProbe

    def blames(self, run: Run) -> int | None:
        """A rank that raised an OS error after reading a node-local path only another node wrote
        (its node had no such file): this contract's finding, not the user's crash."""
        if run.finished:
            return super().blames(run)
        reads = faults.cross_node_reads(faults.Record.of(run))
        failed = [r for r in run.job.ranks if r.status in ("error", "died")]
        if failed and all(faults.raised_on(read, r) for r in failed for read in reads if read.reader == r.rank) \
                and any(read.reader == r.rank for r in failed for read in reads):
            return Blame.RAISED
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        record = faults.Record.of(run)
        if record.storage is None:
            return self.not_judged("no rank reported its node storage (the run stopped before its probe started).")
        if len(set(record.nodes.values())) < 2:
            node = min(record.nodes.values(), default=0)
            return self.not_judged(f"every rank of this run sits on node {node}: no node "
                                   f"can read another's storage here (the nodes tier, [ddp-2nodes], judges it).")
        found = [self._read_verdict(run, record, group) for group in faults.grouped(faults.cross_node_reads(record))]
        found += [self._checkpoint_verdict(c) for c in faults.local_checkpoints(record)]
        found += [self._root_verdict(root) for root in record.root_dirs]
        notes = [record.storage_note()]
        if record.dropped:
            notes.append(f"{record.dropped} further node-local accesses were not recorded (a rank records "
                         f"{faults.MAX_EVENTS} distinct ones).")
        if not found:
            return self.verdict(Outcome.PASSED, record.passed_summary(), notes=notes)
        return merged(found, notes)

    def _read_verdict(self, run: Run, record, reads: list) -> Verdict:
        first = reads[0]
        writers = first.writers
        readers = sorted({(r.reader, r.reader_node) for r in reads})
        raised = [faults.raised_text(r, run.job.ranks[r.reader]) for r in reads]
        raised = next((t for t in raised if t), "")
        summary = (f"{faults.written_words(record, writers)}; {faults.reader_words(readers, reads)} "
                   f"the same path{faults.in_hooks(reads, reading=True)}{raised}. On a cluster node-local storage "
                   f"(/tmp, /dev/shm, $TMPDIR, $SLURM_TMPDIR, tempfile.gettempdir()) is each node's own: the file "
                   f"exists on node {writers[0].node} only.")
        evidence = [Evidence(f"{w.op_words()} {w.path}{faults.in_hook(w)} (node {w.node}, local storage)"
                             + (" (its folder is set here)" if not w.site and w.config else ""),
                             rank=w.rank, frame=w.site, site=None if w.site else w.config_site())
                    for w in writers[:4]]
        evidence += [Evidence(f"{r.op_words()} {r.path}{faults.in_hook(r)} on node {r.reader_node}, which no rank of "
                              f"node {r.reader_node} wrote{faults.raised_text(r, run.job.ranks[r.reader])}",
                              rank=r.reader, frame=r.site) for r in reads[:4]]
        fix = FIX_CKPT if first.is_checkpoint() else fix_data(writers, record)
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category=consequence(run, reads))

    def _checkpoint_verdict(self, ckpt) -> Verdict:
        summary = ckpt.summary()
        evidence = [Evidence(line, rank=rank, frame=site, site=None if site else fallback)
                    for line, rank, site, fallback in ckpt.evidence()]
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=FIX_CKPT)

    def _root_verdict(self, root: dict) -> Verdict:
        summary = (f"default_root_dir={root['raw']} in your Trainer kwargs is node-local storage ({root['path']}): "
                   f"Lightning's own checkpoints (<default_root_dir>/checkpoints) and logs go there, so only the node "
                   f"of global rank 0 holds them and a resume on another node finds nothing. (The runs here use a "
                   f"folder of their own, shared by every rank.)")
        site = root.get("site")
        evidence = [Evidence("default_root_dir is set in these Trainer kwargs", frame=site)] if site else []
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=FIX_CKPT)


CONTRACT = NodeLocalFiles()
