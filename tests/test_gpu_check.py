"""benchmarks/gpu_check.py, the GPU check a maintainer runs on a CUDA machine: its no-CUDA path (what
CI runs) and the parts of its table that need no GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import CONFORMANCE, REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_runs_nothing_and_exits_0(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run the check")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", "out.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_check: no CUDA device here" in proc.stdout and "nothing was run" in proc.stdout
    assert not (tmp_path / "out.json").exists()


def test_every_device_placement_case_becomes_a_target_with_its_objects():
    check = _script()
    folder = CONFORMANCE / "device-placement"
    cases = [check.read_case(str(folder / f)) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    assert len(cases) >= 20
    broadcast = next(c for c in cases if c["name"] == "broadcast_run_name_before_set_device")
    assert broadcast["expected"] == "fail"
    assert check.target_of(broadcast) == (f"{broadcast['path']}:Model datamodule={broadcast['path']}:DataModule "
                                          f"trainer={broadcast['path']}:trainer_kwargs")


def test_agreement_between_the_cpu_finding_and_cuda():
    agree = _script().agree
    failed, passed = {"got": "fail"}, {"got": "pass"}
    raised = {"got": "raised", "first": "RuntimeError: No backend type associated with device type cpu"}
    clean = {"got": "clean", "first": "ran cleanly on one CUDA device"}
    assert agree(failed, raised, 1) == "yes" and agree(passed, clean, 1) == "yes"
    assert agree(passed, raised, 1) == "no"
    assert agree(failed, clean, 1) == "one device cannot show it"  # a fixed cuda:0 is rank 0's own GPU
    assert agree(failed, clean, 2) == "no"
    assert agree(failed, {"got": "failed"}, 2) == "yes" and agree(passed, {"got": "failed"}, 2) == "no"
    assert agree(None, clean, 1) == "not run"


def test_the_table_prints_every_row(capsys):
    check = _script()
    case = {"name": "hard_coded_cuda0_anchor_grid", "expected": "fail", "path": "x.py"}
    rows = check.case_rows([case], {case["name"]: {"got": "fail", "first": "torch.arange asks for cuda:0"}},
                           {case["name"]: {"got": "clean", "first": "ran cleanly"}}, 1, "one CUDA device")
    assert rows[0]["agree"] == "one device cannot show it"
    check.print_table(rows + [{"check": "memory", "target": "MLP1024b32", "cpu": "predicted 1 B", "gpu": "2 B",
                               "agree": "ratio 0.50"}], "gpu_check")
    out = capsys.readouterr().out
    assert "hard_coded_cuda0_anchor_grid" in out and "MLP1024b32" in out and "ratio 0.50" in out


def test_the_memory_check_models_are_lightning_modules_of_the_stated_size():
    check = _script()
    model = check.mlp_1024_b32()
    assert sum(p.numel() for p in model.parameters()) == 4 * (1024 * 1024 + 1024)
    assert model.train_dataloader().batch_size == 32
    assert len(check.SIZES) == 6 and all(hasattr(check, f"mlp_{w}_b{b}") for w, b in check.SIZES)
