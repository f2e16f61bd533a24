"""The conformance corpus: every case's expected verdict, with its evidence in the message.

The corpus is judged in PARTS parts, each once, by the documented command in a subprocess (one
shared world pool for a part's cases, so a hang or crash in a case can never take this session
down); each (case, contract) expectation is then its own test. A part's tests are one class:
under the default run's workers (``--dist loadscope``) each part is judged on one worker while
other tests run beside it (a part spends much of its time waiting out the hangs its cases provoke).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import CONFORMANCE, REPO

from pytest_ltconform import contracts
from pytest_ltconform.corpus import (
    Case,
    case_items,
    discover,
    mark_known,
    print_table,
    rates,
    read_case,
    read_known,
    rows_from_records,
    sentence_problems,
    status_of,
)

CASES = [c for c in map(read_case, discover([str(CONFORMANCE)])) if c is not None]
PARTS = 4
# Every PARTS-th case in discovery order: each part gets its share of every folder (and of the
# all-rank-save hangs, the slowest cases).
PART_OF = {c.name: n % PARTS for n, c in enumerate(CASES)}
# Items other work fixes (conformance/known_failing.txt): reported as xfail until then, not as red.
KNOWN = read_known([str(CONFORMANCE)])


def _known(case, contract: str = "*") -> str | None:
    return KNOWN.get((case.name, contract)) or KNOWN.get((case.name, "*"))


def _param(*values, case):
    why = _known(case, values[1] if len(values) > 1 else "*")
    marks = [pytest.mark.xfail(reason=why, strict=False)] if why else []
    return pytest.param(*values, marks=marks, id="-".join([case.name, *values[1:]]))


# (case, contract) expectations of each part.
EXPECTATIONS = {part: [_param(c, cid, case=c) for c in CASES if PART_OF[c.name] == part
                       for cid in c.expected if cid in contracts.ids()] for part in range(PARTS)}


def _judge_corpus(out, *extra: str, paths: list[str] | None = None) -> dict:
    """{(case, contract): [row per strategy]} from the documented command, run in a subprocess on
    ``paths`` (cases; default: the whole corpus folder)."""
    # The command's per-case progress lines (stderr) are left to pytest's capture: `-s` shows them
    # as the corpus runs, a failure shows them under "Captured stderr", the default output stays short.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_ltconform.corpus", *(paths or [str(CONFORMANCE)]), "--json", str(out),
         "--timeout", "40", *extra], cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=5400,
    )
    assert out.exists(), f"the corpus command wrote no result:\n{proc.stdout[-4000:]}"
    doc = json.loads(out.read_text())
    print(proc.stdout[-3000:])
    rows: dict = {}
    for r in doc["rows"]:
        rows.setdefault((r["case"], r["contract"]), []).append(r)
    return rows


@pytest.fixture(scope="session")
def corpus_part(tmp_path_factory):
    """``corpus_part(n)``: the rows of part ``n``, judged on first use in this process (session
    scope: a worker may run other tests between two parts). The default
    tier: the contracts EXPECTED names, under ddp and the strategy each case's config names, fsdp
    too on ok_ cases, as before the full matrix (see test_full_matrix for the cost)."""
    judged: dict[int, dict] = {}

    def rows_of(part: int) -> dict:
        if part not in judged:
            paths = [c.path for c in CASES if PART_OF[c.name] == part]
            out = tmp_path_factory.mktemp(f"corpus-part-{part}") / "corpus.json"
            judged[part] = _judge_corpus(out, "--matrix", "named", paths=paths)
        return judged[part]

    return rows_of


@pytest.mark.slow
def test_full_matrix(tmp_path):
    """Every item a default `pytest --ltconform` run creates for each case, every CPU strategy."""
    # spawn-safety's fresh import of an ok_ case may take up to 90 s at load: a run limit of 40 s
    # would cut it (and the plugin would blame the case: see known_failing.txt).
    rows = _judge_corpus(tmp_path / "corpus.json", "--timeout", "120")
    bad = [f"{r['case']} {r['contract']}[{r['strategy']}]: expected {r['expected']}, got {r['got']}: "
           f"{r['message'][:300]}" for (name, cid), group in rows.items() for r in group
           if not r["matched"] and (name, cid) not in KNOWN and (name, "*") not in KNOWN]
    bad += sentence_problems([r for group in rows.values() for r in group])  # every sentence true
    assert not bad, "\n".join(bad)


def _evidence_tokens(evidence: str) -> list[str]:
    """The concrete names an EVIDENCE text promises: quoted names and backticked code."""
    tokens = re.findall(r"'([^'\s]+)'", evidence) + re.findall(r"`([^`]+)`", evidence)
    # A token cut short with "..." (`if self.global_rank == 0 and ...`) promises its beginning.
    tokens = [re.split(r"\.\.\.|\u2026", t)[0] for t in tokens]
    return [t.strip() for t in tokens if t.strip()]


class CorpusPart:
    """One part's expectations, each its own test, and its detection rate. A class per part: the
    suite's workers take a class at a time (``--dist loadscope``), so a part's tests share one
    worker and the part is judged once."""

    part: int

    def test_case_gets_its_expected_verdict(self, corpus_part, case, contract):
        rows = corpus_part(self.part).get((case.name, contract))
        assert rows, f"no verdict for {case.name} / {contract}"
        for row in rows:
            assert row["matched"], f"[{row['strategy']}] expected {row['expected']}, got {row['got']}: {row['message']}"
        if case.expected[contract] == "fail":
            message = next(r for r in rows if r["key"])["message"]
            assert f"{case.name.rsplit('/', 1)[-1]}.py:" in message, f"the user's file:line is missing:\n{message}"
            missing = [t for t in _evidence_tokens(case.evidence) if t not in message]
            assert not missing, f"evidence {missing} not named in:\n{message}"
            assert "Fix:" in message

    def test_every_sentence_rests_on_a_recorded_fact(self, corpus_part):
        """Issue 32: every item of the part, held against the facts recorded next to its sentences
        (``claims.check``: a claim of difference on two different values, of reduction on a recorded
        sync, a named line on a line of its frame, ...). Reuses the part's verdicts."""
        rows = [r for group in corpus_part(self.part).values() for r in group]
        assert rows
        problems = sentence_problems(rows)
        assert not problems, "\n".join(problems)

    def test_detection_rate_is_complete(self, corpus_part):
        rows = [r for (name, cid), group in corpus_part(self.part).items() for r in group
                if (name, cid) not in KNOWN and (name, "*") not in KNOWN]
        positives = [r for r in rows if r["expected"] == "fail" and r["key"]]
        negatives = [r for r in rows if r["expected"] != "fail"]
        assert positives and negatives
        assert all(r["got"] == "fail" for r in positives)
        assert all(r["matched"] for r in rows)


for _n in range(PARTS):  # TestCorpusPart0, TestCorpusPart1, ...
    globals()[f"TestCorpusPart{_n}"] = type(f"TestCorpusPart{_n}", (CorpusPart,), {"part": _n})


# -- the version matrix's cell (tox.ini, docs/ci.md "Versions") -----------------------------------
# BoringModel of both namespaces, and per contract one failing and one ok_ case, chosen where
# Lightning's behaviour changed between releases (sampler wrapping and replacement, weights_only
# loads, FSDP and DeepSpeed arguments, self.log of a rank-zero-only metric): judged as the corpus
# parts are, on whatever Lightning the cell installed. Deselected by default (the parts judge the
# same cases): `-m cell`, which tox's cells run.
CELL = (
    "demos/boring_model", "demos/pl_boring_model",
    "all-rank-save/deepspeed_checkpoint_dir_torch_load", "all-rank-save/ok_hparams_hold_config_object",
    "configure-model/configure_model_rebuilds_layers", "configure-model/ok_configure_model_fsdp_wrap",
    "data-sharding/own_sampler_never_reseeded", "data-sharding/ok_weighted_sampler_lightning_wrapped",
    "eval-duplication/no_sampler_replacement_full_val_set_every_rank", "eval-duplication/ok_unpadded_val_sampler",
    "sync-dist/monitor_rank_zero_only", "sync-dist/ok_auroc_metric_object_logged",
    "strategy-config/fsdp_wrap_policy_class_absent", "strategy-config/ok_deepspeed_offload_inside_zero_section",
    "unused-parameters/training_step_none_on_one_rank", "unused-parameters/ok_corrupt_rows_masked_every_rank_steps",
    "effective-batch/sum_loss_under_ddp_average", "effective-batch/ok_batchnorm_mean_loss",
    "shared-writes/every_rank_torch_saves_model_pt", "shared-writes/ok_prediction_writer_per_rank_files",
    "spawn-safety/lambda_loss_and_open_log_file",
    "launch-env/nccl_timeout_env_instead_of_strategy", "launch-env/ok_torchrun_two_nodes_two_devices",
    "memory/ok_small_transformer_zero3",
    "device-placement/log_numpy_metric_as_cpu_tensor_sync_dist", "device-placement/ok_log_metric_on_module_device",
    "node-local-files/prepare_data_once_into_node_local_tmp", "node-local-files/ok_checkpoint_dir_under_shared_root",
)
CELL_CASES = [c for c in CASES if c.name in CELL]
EXPECTATIONS["cell"] = [_param(c, cid, case=c) for c in CELL_CASES for cid in c.expected if cid in contracts.ids()]


@pytest.fixture(scope="session")
def cell_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus-cell") / "corpus.json"
    return _judge_corpus(out, "--matrix", "named", paths=[c.path for c in CELL_CASES])


@pytest.mark.cell
class TestMatrixCell(CorpusPart):
    part = "cell"

    @pytest.fixture
    def corpus_part(self, cell_rows):
        return lambda part: cell_rows

    def test_the_cell_has_every_case_it_names(self):
        assert sorted(c.name for c in CELL_CASES) == sorted(CELL)
        named = {name.split("/")[0] for name in CELL} - {"demos"}
        with_cases = {c.name.split("/")[0] for c in CASES} & set(contracts.ids())
        assert not with_cases - named, (f"add one failing and one ok_ case of {sorted(with_cases - named)} "
                                        f"to CELL: every contract with corpus cases is judged in each cell")

    def test_the_cell_runs_the_releases_it_was_made_for(self):
        """tox sets LTCONFORM_CELL to the Lightning (and torch) releases it installed: a cell that
        resolved other ones (a pin lost, a cached wheel) fails instead of passing on the wrong release."""
        import os
        from importlib import metadata

        wanted = dict(part.split("=", 1) for part in os.environ.get("LTCONFORM_CELL", "").split() if "=" in part)
        if not wanted:
            pytest.skip("not a tox cell: LTCONFORM_CELL names no releases")
        for dist, prefix in wanted.items():
            assert metadata.version(dist).startswith(prefix), f"{dist} {metadata.version(dist)}, not {prefix}"
        assert metadata.version("pytorch-lightning") == metadata.version("lightning"), "both namespaces, one release"

    def test_the_weights_only_note_says_what_this_lightning_loads(self, cell_rows):
        """The version read end to end: the ranks record the release, the note follows it."""
        import lightning

        from pytest_ltconform import releases

        messages = [r["message"] for r in cell_rows[("all-rank-save/ok_hparams_hold_config_object", "all-rank-save")]]
        assert messages
        if releases.before(lightning.__version__, releases.LOAD_USES_TORCH_DEFAULT):
            assert all(f"Lightning {lightning.__version__} passes weights_only=False" in m for m in messages), messages
        else:
            assert all("on one device alike" in m for m in messages), messages


def pytest_generate_tests(metafunc):
    if metafunc.cls is not None and issubclass(metafunc.cls, CorpusPart) and "case" in metafunc.fixturenames:
        metafunc.parametrize("case, contract", EXPECTATIONS[metafunc.cls.part])


# -- the rules, on JSON report records as a default run writes them (no world needed) ----------

def _case(name: str, expected: dict, strategy: str = "ddp") -> Case:
    return Case(path=f"/cases/contract/{name}.py", name=f"contract/{name}", expected=expected, evidence="",
                has_datamodule=False, has_trainer=False, strategy=strategy)


def _rec(contract: str, strategy: str, outcome: str, summary: str = "", category: str | None = None) -> dict:
    return {"contract": contract, "strategy": strategy, "outcome": outcome, "summary": summary or outcome,
            "message": summary or outcome, "category": category, "duration_s": 1.0}


def _statuses(rows: list[dict]) -> dict:
    return {(r["contract"], r["strategy"]): status_of(r) for r in rows}


def test_pass_expectation_of_a_faulty_case_is_judged_under_every_strategy():
    """A false failure under FSDP of a faulty case's "pass" contract shows (it was judged under ddp only)."""
    case = _case("faulty", {"all-rank-save": "fail", "sync-dist": "pass"})
    records = [_rec("all-rank-save", "ddp", "failed"), _rec("all-rank-save", "fsdp", "passed"),
               _rec("sync-dist", "ddp", "passed"), _rec("sync-dist", "fsdp", "failed"),
               _rec("sync-dist", "deepspeed", "skipped", "not judged: cannot tell samples apart"),
               _rec("sync-dist", "ddp-gpu", "skipped", "needs 2 CUDA devices", "unavailable")]
    assert _statuses(rows_from_records(case, records)) == {
        ("all-rank-save", "ddp"): "right", ("all-rank-save", "fsdp"): "right",
        ("sync-dist", "ddp"): "right", ("sync-dist", "fsdp"): "wrong", ("sync-dist", "deepspeed"): "wrong"}


def test_a_faulty_case_may_stop_its_own_runs_a_conforming_one_may_not():
    """Another item's failure that stops the shared run leaves a "pass" not judged under that
    strategy: on a faulty case the fault's doing (judged elsewhere), on an ok_ case a wrong item."""
    stopped = _rec("sync-dist", "deepspeed", "skipped", "not judged: the fit stopped (see strategy-config[deepspeed])",
                   "consequence")
    records = [_rec("sync-dist", "ddp", "passed"), stopped, _rec("strategy-config", "deepspeed", "failed")]
    faulty = rows_from_records(_case("faulty", {"sync-dist": "pass", "strategy-config": "fail"}), records)
    assert _statuses(faulty) == {("sync-dist", "ddp"): "right", ("sync-dist", "deepspeed"): "skipped",
                                 ("strategy-config", "deepspeed"): "right"}
    ok = rows_from_records(_case("ok_same", {"sync-dist": "pass"}), records)
    assert _statuses(ok)[("sync-dist", "deepspeed")] == "wrong"
    alone = rows_from_records(_case("faulty", {"sync-dist": "pass", "strategy-config": "fail"}), [stopped])
    assert _statuses(alone)[("sync-dist", "deepspeed")] == "wrong"


def test_a_contract_whose_tier_cannot_run_here_is_skipped_with_the_reason():
    """launch-env has multi-node items only: a default run here has no record of it (the JSON
    report counts its tier under not_run), which is not a missing item."""
    rows = rows_from_records(_case("slurm", {"launch-env": "fail"}), [_rec("sync-dist", "ddp", "passed")])
    launch = [r for r in rows if r["contract"] == "launch-env"]
    assert [(r["strategy"], r["got"], status_of(r)) for r in launch] == [("ddp-multinode", "unavailable", "skipped")]
    assert "multi-node-only contract" in launch[0]["message"] and "not_run" in launch[0]["message"]
    assert rates(launch)["positives"] == 0


def test_fail_expectation_is_decided_by_the_strategy_the_config_names():
    case = _case("sharded", {"all-rank-save": "fail"}, strategy="fsdp")
    rows = rows_from_records(case, [_rec("all-rank-save", "ddp", "failed"), _rec("all-rank-save", "fsdp", "passed")])
    assert _statuses(rows) == {("all-rank-save", "ddp"): "right", ("all-rank-save", "fsdp"): "wrong"}
    assert [r["strategy"] for r in rows if r["key"]] == ["fsdp"]


def test_skips_count_by_expected_value():
    applies_not = "the module does not run under FSDP on CPU (...); the sharded tier does not apply"
    case = _case("mixed", {"sync-dist": "pass", "data-sharding": "nofail", "unused-parameters": "advisory"})
    records = [_rec("sync-dist", "ddp", "passed"), _rec("sync-dist", "fsdp", "skipped", applies_not),
               _rec("data-sharding", "ddp", "skipped", "not judged: cannot tell samples apart"),
               _rec("unused-parameters", "ddp", "skipped", "not judged: no step ran"),
               _rec("unused-parameters", "fsdp", "error", "the verdict itself failed")]
    assert _statuses(rows_from_records(case, records)) == {
        ("sync-dist", "ddp"): "right", ("sync-dist", "fsdp"): "skipped",
        ("data-sharding", "ddp"): "skipped", ("unused-parameters", "ddp"): "wrong",
        ("unused-parameters", "fsdp"): "error"}


def test_pass_that_only_skipped_judged_nothing():
    case = _case("skips", {"sync-dist": "pass"})
    rows = rows_from_records(case, [_rec("sync-dist", "ddp", "skipped", "the tier does not apply")])
    assert [status_of(r) for r in rows] == ["wrong"] and "compared nothing" in rows[0]["why"]


def test_every_item_of_a_conforming_case_must_not_fail_and_its_code_never_stops_a_run():
    crash = {"category": "crash"}
    ok = _case("ok_twin", {"sync-dist": "nofail"})
    faulty = _case("twin", {"sync-dist": "nofail"})
    records = [_rec("sync-dist", "ddp", "error", "the run did not finish: ValueError", **crash),
               _rec("shared-writes", "fsdp", "failed"), _rec("shared-writes", "ddp", "advisory")]
    assert _statuses(rows_from_records(ok, records)) == {
        ("sync-dist", "ddp"): "wrong", ("shared-writes", "fsdp"): "wrong", ("shared-writes", "ddp"): "right"}
    assert _statuses(rows_from_records(faulty, records)) == {
        ("sync-dist", "ddp"): "skipped", ("shared-writes", "fsdp"): "unchecked", ("shared-writes", "ddp"): "unchecked"}


def test_a_case_expecting_only_passes_conforms():
    assert _case("demo", {"sync-dist": "pass", "unused-parameters": "advisory"}).conforming
    assert not _case("raises", {"data-sharding": "nofail"}).conforming
    assert _case("ok_raises", {"data-sharding": "nofail"}).conforming


def test_a_named_contract_without_items_is_an_error():
    rows = rows_from_records(_case("none", {"sync-dist": "pass"}), [], "pytest exited 4 without a report")
    assert [(r["contract"], status_of(r), r["message"]) for r in rows] == [
        ("sync-dist", "error", "pytest exited 4 without a report")]


def test_table_counts_per_strategy_and_lists_every_skip_with_its_reason(capsys):
    case = _case("ok_table", {"sync-dist": "pass"})
    print_table(rows_from_records(case, [_rec("sync-dist", "ddp", "passed"),
                                         _rec("sync-dist", "fsdp", "skipped", "FSDP does not apply here")]))
    out = capsys.readouterr().out
    assert "[ddp] right 1" in out and "[fsdp] skipped 1" in out
    assert "skipped: contract/ok_table sync-dist[fsdp]: FSDP does not apply here" in out


def test_corpus_items_are_those_of_a_default_run():
    """Every contract of a conforming case (each under its CPU strategies, deepspeed where the
    config names it and it is installed); only the named contracts of a faulty one."""
    from pytest_ltconform.corpus import item_strategies
    from pytest_ltconform.settings import default_nodes
    from pytest_ltconform.target import validation as target_validation
    from pytest_ltconform.tiers import contract_tiers
    from pytest_ltconform.tiers.nodes import label as nodes_label

    path = CONFORMANCE / "all-rank-save" / "ok_metric_compute_every_rank.py"
    ok = read_case(str(path))
    targets = target_validation.validate(f"{path}:Model", f"{path}:DataModule" if ok.has_datamodule else None)
    items = dict(case_items(ok, targets, None))
    # A default run's local items: the CPU tier's and the nodes tier's (2 nodes x 1 rank on this host).
    assert list(items) == [c for c in contracts.ids()
                           if {"cpu", "nodes"} & set(contract_tiers(contracts.get_contract(c)))]
    strategies = item_strategies()
    assert items["all-rank-save"] == [s for s in contracts.get_contract("all-rank-save").strategies
                                      if s in strategies] + [nodes_label("ddp", default_nodes())]
    assert items["launch-env"] == items["node-local-files"] == [nodes_label("ddp", default_nodes())]
    assert "fsdp" in items["sync-dist"] and "deepspeed" not in items["strategy-config"]
    faulty = read_case(str(CONFORMANCE / "sync-dist" / "monitor_rank_zero_only.py"))
    faulty.strategy = "ddp"
    assert [cid for cid, _ in case_items(faulty, targets, None)] == \
        [c for c in contracts.ids() if c in faulty.expected]
    # The default suite's tier: ddp and the configured strategy; fsdp too on a conforming case.
    assert dict(case_items(faulty, targets, None, named_only=True))["sync-dist"] == ["ddp"]
    faulty.strategy = "fsdp"  # as if its config named FSDP: the fault decided there, passes under both
    named = dict(case_items(faulty, targets, None, named_only=True))
    assert named["sync-dist"] == ["fsdp"] and named["all-rank-save"] == ["ddp", "fsdp"]
    ok.strategy = "ddp"
    named = dict(case_items(ok, targets, None, named_only=True))
    assert list(named) == [c for c in contracts.ids() if c in ok.expected] and named["sync-dist"] == ["ddp", "fsdp"]


def test_known_failing_items_show_as_known_not_wrong(tmp_path, capsys):
    listing = "# case contract why\ncontract/ok_k sync-dist  fixed by issue 19 sec. 4\n"
    (tmp_path / "known_failing.txt").write_text(listing)
    known = read_known([str(tmp_path)])
    assert known == {("contract/ok_k", "sync-dist"): "fixed by issue 19 sec. 4"}
    rows = rows_from_records(_case("ok_k", {"sync-dist": "pass", "data-sharding": "pass"}),
                             [_rec("sync-dist", "ddp", "failed"), _rec("data-sharding", "ddp", "failed")])
    mark_known(rows, known)
    assert _statuses(rows) == {("sync-dist", "ddp"): "known", ("data-sharding", "ddp"): "wrong"}
    print_table(rows)
    assert "known failing" in capsys.readouterr().out


@pytest.mark.slow
def test_as_user_judges_the_report_of_a_default_run(tmp_path):
    """--as-user runs `pytest --ltconform CASE.py:Model` with default options and judges its report:
    every CPU strategy's item of each named contract, the GPU and multi-node records left out."""
    from pytest_ltconform.corpus import item_strategies

    out = tmp_path / "as_user.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_ltconform.corpus", "--as-user", str(CONFORMANCE / "sync-dist" /
         "monitor_rank_zero_only.py"), "--json", str(out), "--keep-reports", str(tmp_path / "reports")],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True, timeout=1800,
    )
    rows = json.loads(out.read_text())["rows"]
    named = [(r["contract"], r["strategy"], r["got"], status_of(r)) for r in rows if r["expected"]]
    strategies = item_strategies()
    assert [n for n in named if n[0] == "sync-dist"] == [("sync-dist", s, "fail", "right") for s in strategies]
    assert [n for n in named if n[0] == "all-rank-save"] == [("all-rank-save", s, "pass", "right") for s in strategies]
    assert all(r["strategy"] in strategies for r in rows)
    assert (tmp_path / "reports" / "sync-dist__monitor_rank_zero_only.report.json").exists()
    assert proc.returncode == 0 and "[ddp] right" in proc.stdout
