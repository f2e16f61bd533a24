"""The GPU check: what only GPU ranks show, on a machine with CUDA devices, next to the CPU tier's finding.

    python benchmarks/gpu_check.py [--json gpu_check.json] [--cases DIR] [--timeout SECONDS]

Run it as is on a machine with one or more CUDA devices; it takes a few minutes (under five on
one device). On a machine without CUDA it says so and exits 0 without running anything (CI runs
that path: tests/test_gpu_check.py). It prints one table and writes the same rows to a JSON file:

1. **device-placement, CPU tier**: every case of ``conformance/device-placement`` judged on CPU ranks by
   the corpus command (``python -m pytest_ltconform.corpus --contract device-placement``): the
   plugin's verdict and its first sentence.
2. **the same cases on CUDA**: with two or more devices, the GPU tier (NCCL ranks, world size 2,
   ``-m ltconform_gpu -k device-placement``) in one pytest session over every case, plus every
   contract's GPU item on Lightning's BoringModel; with one device, each case's own code in a one-rank
   DDP run on CUDA (``Trainer(accelerator="gpu", devices=1, strategy="ddp")``, so Lightning's syncs go
   through NCCL) with what CUDA raised. A fault that needs two GPUs of a node, or two nodes, cannot
   show on one device; its row says so instead of agreeing or not.
3. **memory**: the memory contract's prediction for a training step against
   ``torch.cuda.max_memory_allocated`` of the GPU tier's run (world size 1), for three model sizes at
   two batch sizes (the factories at the end of this file).

Rule section: "Choose using measured memory" (NCCL is the usual CUDA backend, gloo the CPU one).
The table of what NCCL needs that gloo does not is on the device-placement rule page.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(ROOT, "conformance", "device-placement")
BORING = "lightning.pytorch.demos.boring_classes.BoringModel"
# The errors GPU ranks raise for a device fault (as the device-placement contract names them).
DEVICE_ERRORS = ("No backend type associated with device type cpu", "Tensors must be CUDA and dense",
                 "Expected all tensors to be on the same device", "Duplicate GPU detected", "invalid device ordinal",
                 "can't convert cuda", "Cannot re-initialize CUDA", "can't create new processes if CUDA")
SIZES = ((1024, 32), (1024, 256), (2048, 32), (2048, 256), (4096, 32), (4096, 256))  # (width, batch)


def cuda_devices() -> tuple[int, str]:
    """(CUDA device count, a line saying what torch sees)."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "none"
        return 0, f"torch {torch.__version__} (CUDA build: {built}) sees no CUDA device"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return torch.cuda.device_count(), f"torch {torch.__version__}, CUDA {torch.version.cuda}: " \
                                      f"{torch.cuda.device_count()} x {', '.join(names)}"


def read_case(path: str) -> dict:
    """A case's declarations, read without executing it: its objects and its EXPECTED verdict."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    expected = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXPECTED" for t in node.targets):
            expected = ast.literal_eval(node.value)
    name = os.path.splitext(os.path.basename(path))[0]
    return {"path": path, "name": name, "datamodule": "DataModule" in names, "trainer": "trainer_kwargs" in names,
            "expected": expected.get("device-placement")}


def target_of(case: dict) -> str:
    """The ``--ltconform`` value of a case (its datamodule and Trainer kwargs written in)."""
    spec = f"{case['path']}:Model"
    if case["datamodule"]:
        spec += f" datamodule={case['path']}:DataModule"
    if case["trainer"]:
        spec += f" trainer={case['path']}:trainer_kwargs"
    return spec


def _run(args: list[str], timeout: float, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def cpu_findings(cases: list[dict], timeout: float, tmp: str) -> dict[str, dict]:
    """Each case's device-placement verdict on CPU ranks (the corpus command): name -> {got, first}."""
    out = os.path.join(tmp, "cpu.json")
    _run([sys.executable, "-m", "pytest_ltconform.corpus", *[c["path"] for c in cases], "--contract",
          "device-placement", "--strategies", "ddp", "--json", out], timeout, tmp)
    if not os.path.exists(out):
        return {}
    with open(out, encoding="utf-8") as fh:
        rows = json.load(fh)["rows"]
    return {r["case"].rsplit("/", 1)[-1]: {"got": r["got"], "first": _first(r["message"])} for r in rows}


def _first(message: str) -> str:
    text = (message or "").split("\n", 1)[0]
    return text if len(text) <= 240 else text[:237] + "..."


def gpu_tier(cases: list[dict], world: int, timeout: float, tmp: str) -> tuple[dict[str, dict], list[dict]]:
    """The GPU tier in one pytest session: device-placement[ddp-gpu] of every case, and every
    contract's GPU item on BoringModel. Returns (case name -> {got, first}, BoringModel's rows)."""
    report = os.path.join(tmp, "gpu.json")
    # The cases are copied out of their folder, whose name would match -k device-placement in every item id.
    folder = os.path.join(tmp, "cases")
    os.makedirs(folder, exist_ok=True)
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "ltconform_gpu",
            "--ltconform-world-size", str(world), "--ltconform-require", "gpu", "--ltconform-report", report,
            "-k", "device-placement or BoringModel", "--ltconform", BORING]
    for case in cases:
        copy = os.path.join(folder, os.path.basename(case["path"]))
        shutil.copy(case["path"], copy)
        args += ["--ltconform", target_of({**case, "path": copy})]
    proc = _run(args, timeout, tmp)
    if not os.path.exists(report):
        raise RuntimeError(f"the GPU tier wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    with open(report, encoding="utf-8") as fh:
        results = json.load(fh)["results"]
    by_case, boring = {}, []
    for r in results:
        target = str(r.get("target", ""))
        if "BoringModel" in target:
            boring.append({"check": "gpu tier", "target": f"BoringModel {r['contract']}[{r['strategy']}]",
                           "gpu": f"{r['outcome']}: {_first(r.get('summary', ''))}"})
        elif r["contract"] == "device-placement":
            name = os.path.splitext(os.path.basename(target.split(":")[0]))[0]
            by_case[name] = {"got": r["outcome"], "first": _first(r.get("message", ""))}
    return by_case, boring


def one_device(cases: list[dict], timeout: float, tmp: str) -> dict[str, dict]:
    """Each case's own code in a one-rank DDP run on CUDA, four at a time: name -> {got, first}."""
    running, done = {}, {}
    pending = list(cases)
    while pending or running:
        while pending and len(running) < 4:
            case = pending.pop(0)
            folder = tempfile.mkdtemp(dir=tmp)
            running[case["name"]] = (subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--one-case", case["path"]], cwd=folder,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))),
                time.monotonic())
        for name, (proc, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                done[name] = {"got": "hung", "first": f"still running after {timeout:.0f} s (killed)"}
            else:
                out = proc.stdout.read().strip().splitlines()
                done[name] = json.loads(out[-1]) if out and out[-1].startswith("{") else \
                    {"got": "error", "first": _first(proc.stderr.read().strip().splitlines()[-1:][0] if
                                                     proc.stderr else "no output")}
            del running[name]
        time.sleep(0.2)
    return done


def run_case_on_cuda(path: str) -> dict:
    """Fit a case's module on one CUDA device as its own code is (a one-rank DDP run, so
    Lightning's syncs go through NCCL): ``{"got": "clean"}`` or ``{"got": "raised", "first": ...}``."""
    import importlib.util

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    spec = importlib.util.spec_from_file_location("gpu_check_case", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        kwargs = module.trainer_kwargs() if hasattr(module, "trainer_kwargs") else {}
        strategy = kwargs.get("strategy")
        forking = isinstance(strategy, str) and strategy.startswith(("ddp_fork", "ddp_notebook"))
        kwargs.update(accelerator="gpu", devices=1, num_nodes=1, max_epochs=1, limit_train_batches=2,
                      limit_val_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      strategy=strategy if forking else DDPStrategy())
        model = module.Model()
        datamodule = module.DataModule() if hasattr(module, "DataModule") else None
        L.Trainer(**kwargs).fit(model, datamodule=datamodule)
    except BaseException as exc:  # what CUDA (or Lightning on CUDA) raised: the row's finding
        return {"got": "raised", "first": _first(f"{type(exc).__name__}: {exc}")}
    return {"got": "clean", "first": "ran cleanly on one CUDA device"}


def agree(cpu: dict | None, gpu: dict | None, devices: int) -> str:
    """Whether the CPU finding and what CUDA did say the same: 'yes', 'no', or why it cannot tell."""
    if not cpu or not gpu:
        return "not run"
    failed_cpu = cpu["got"] in ("fail", "failed")
    if gpu["got"] in ("failed", "passed", "advisory", "skipped"):  # a GPU-tier item's outcome
        return "yes" if failed_cpu == (gpu["got"] == "failed") else "no"
    raised = gpu["got"] == "raised" and any(text in gpu.get("first", "") for text in DEVICE_ERRORS)
    if failed_cpu and not raised and devices == 1:
        return "one device cannot show it"
    return "yes" if failed_cpu == raised else "no"


def memory_rows(world: int, timeout: float, tmp: str) -> list[dict]:
    """The memory contract's prediction against torch.cuda.max_memory_allocated (GPU tier, world
    size 1) for each (width, batch) of SIZES."""
    report = os.path.join(tmp, "memory.json")
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "ltconform_gpu", "-k", "memory",
            "--ltconform-world-size", "1", "--ltconform-report", report]
    for width, batch in SIZES:
        args += ["--ltconform", f"{os.path.abspath(__file__)}:mlp_{width}_b{batch}"]
    proc = _run(args, timeout, tmp)
    if not os.path.exists(report):
        return [{"check": "memory", "target": "all sizes", "gpu": f"no report: {_first(proc.stdout[-400:])}"}]
    with open(report, encoding="utf-8") as fh:
        results = [r for r in json.load(fh)["results"] if r["contract"] == "memory"]
    return [_memory_row(r) for r in results]


def _memory_row(result: dict) -> dict:
    table = result.get("table") or {}
    measured = (table.get("measured") or {}).get("ranks", {}).get("0", {})
    predicted = table.get("predicted") or {}
    label = measured.get("strategy", result.get("strategy"))
    guess = (predicted.get("strategies") or {}).get(label) or {}
    peak, total = measured.get("cuda_peak"), guess.get("total")
    ratio = f"{total / peak:.2f}" if peak and total else "-"
    target = str(result.get("target", "")).rsplit(":", 1)[-1]
    return {"check": "memory", "target": target, "cpu": f"predicted {total:,} B" if total else "no prediction",
            "gpu": f"max_memory_allocated {peak:,} B" if peak else "not measured", "agree": f"ratio {ratio}",
            "predicted": total, "measured": peak}


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("check", "target", "CPU ranks (plugin)", "CUDA", "agree"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r["check"], r["target"], r.get("cpu", ""), r.get("gpu", ""), r.get("agree", ""))
    Console(width=200).print(table)


def case_rows(cases: list[dict], cpu: dict, gpu: dict, devices: int, how: str) -> list[dict]:
    rows = []
    for case in cases:
        c, g = cpu.get(case["name"]), gpu.get(case["name"])
        rows.append({"check": f"device-placement ({how})", "target": case["name"], "expected": case["expected"],
                     "cpu": f"{c['got']}: {c['first']}" if c else "not judged", "gpu": f"{g['got']}: {g['first']}"
                     if g else "not run", "agree": agree(c, g, devices)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_check.json", help="where the rows go (default: gpu_check.json)")
    parser.add_argument("--cases", default=CASES, help="the device-placement cases (a folder)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds each step may take")
    parser.add_argument("--one-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_case:
        print(json.dumps(run_case_on_cuda(args.one_case)))
        return 0
    devices, seen = cuda_devices()
    if devices == 0:
        print(f"gpu_check: no CUDA device here ({seen}): nothing was run. Run it on a machine with one or more "
              f"CUDA devices (docs/ci.md).")
        return 0
    started = time.monotonic()
    print(f"gpu_check: {seen}; {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    cases = [read_case(os.path.join(args.cases, f)) for f in sorted(os.listdir(args.cases)) if f.endswith(".py")]
    with tempfile.TemporaryDirectory() as tmp:
        cpu = cpu_findings(cases, args.timeout, tmp)
        if devices >= 2:
            gpu, boring = gpu_tier(cases, 2, args.timeout, tmp)
            how = "GPU tier, 2 NCCL ranks"
        else:
            gpu, boring = one_device(cases, args.timeout, tmp), [
                {"check": "gpu tier", "target": "BoringModel", "gpu": "not run: the GPU tier needs 2 CUDA devices, "
                 "found 1; the cases ran as one-rank DDP runs on the one device"}]
            how = "one CUDA device, one-rank DDP"
        rows = case_rows(cases, cpu, gpu, devices, how) + boring + memory_rows(1, args.timeout, tmp)
    print_table(rows, f"gpu_check: {seen}")
    document = {"machine": {"cuda": seen, "devices": devices, "node": platform.node(), "cores": os.cpu_count(),
                            "python": platform.python_version()}, "elapsed_s": round(time.monotonic() - started, 1),
                "rows": rows}
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(document, fh, indent=2)
    print(f"gpu_check: {len(rows)} rows in {document['elapsed_s']} s; written to {args.json}")
    return 0


# -- the memory check's models: an MLP of a given width, trained on random batches ----------------------

def _sized(width: int, batch: int):
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class SizedMLP(L.LightningModule):
        """Four Linear layers of ``width`` (4 x width^2 parameters), Adam, batches of ``batch``."""

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width),
                                                                          torch.nn.ReLU())])

        def training_step(self, data, batch_idx):
            (x,) = data
            return self.net(x).pow(2).mean()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(batch * 4, width)), batch_size=batch)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    SizedMLP.__qualname__ = SizedMLP.__name__ = f"MLP{width}b{batch}"
    return SizedMLP()


def mlp_1024_b32():
    return _sized(1024, 32)


def mlp_1024_b256():
    return _sized(1024, 256)


def mlp_2048_b32():
    return _sized(2048, 32)


def mlp_2048_b256():
    return _sized(2048, 256)


def mlp_4096_b32():
    return _sized(4096, 32)


def mlp_4096_b256():
    return _sized(4096, 256)


if __name__ == "__main__":
    sys.exit(main())
