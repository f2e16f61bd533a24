"""The memory contract's prediction next to what the ranks measured, per strategy, in one run.

    python benchmarks/bench_memory.py [--target FILE.py:Model] [--trainer FILE.py:trainer_kwargs] [--gpu]

Runs `pytest --ltconform TARGET -k memory` with the JSON report and prints, per strategy item, the
bytes rank 0 measured in the plugin's run (parameters with buffers, gradients, optimizer state,
activations saved for backward) next to what the prediction (one training step traced under fake
tensors with torch's memory tracker) gives the same strategy at the same world size. On a GPU
(`--gpu`, the gpu tier, world size 1 on one device) the last column is
`torch.cuda.max_memory_allocated` of the rank for the same step; on CPU it is '-'. Rule section:
"Choose using measured memory". A prediction made for another world size or strategy than the run
is shown as '-' rather than compared. A predicted total adds the traced peak's temporaries (the
loss's gradient, optimizer scratch), for which the measured run has no figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "conformance", "memory", "ok_boring_model_adam.py") + ":Model"
CATEGORIES = ("params", "grads", "optimizer", "activations", "total")


def memory_items(target: str, trainer: str | None, gpu: bool) -> list[dict]:
    """The report's memory results of one pytest run (a list of result dicts)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ltconform", target,
                "-k", "memory", "-m", "ltconform_gpu" if gpu else "ltconform_cpu", "--ltconform-report", report]
        if trainer:
            args += ["--ltconform-trainer", trainer]
        proc = subprocess.run(args, cwd=tmp, capture_output=True, text=True)
        if not os.path.exists(report):
            sys.exit(f"the run wrote no report:\n{proc.stdout[-3000:]}")
        with open(report) as fh:
            return [r for r in json.load(fh)["results"] if r["contract"] == "memory"]


def row(result: dict) -> tuple[str, dict, dict | None, int | None]:
    """(strategy label, rank 0's measured bytes, the predicted bytes for that label or None, cuda peak)."""
    table = result.get("table") or {}
    measured = (table.get("measured") or {}).get("ranks", {}).get("0", {})
    label = measured.get("strategy", result["strategy"])
    predicted = table.get("predicted") or {}
    same_world = predicted.get("world") == measured.get("world_size")
    guess = (predicted.get("strategies") or {}).get(label) if same_world else None
    return label, measured, guess, measured.get("cuda_peak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--trainer", default=None)
    parser.add_argument("--gpu", action="store_true", help="the gpu tier (needs a CUDA device)")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"target: {args.target}; bytes of rank 0, measured / predicted")
    print(f"{'strategy':<20}" + "".join(f"{c:>22}" for c in CATEGORIES) + f"{'cuda max allocated':>20}")
    for result in memory_items(args.target, args.trainer, args.gpu):
        label, measured, guess, cuda = row(result)
        cells = "".join(f"{measured.get(c, 0):>11,}/{(guess or {}).get(c, '-'):>10,}" if guess else
                        f"{measured.get(c, 0):>11,}/{'-':>10}" for c in CATEGORIES)
        print(f"{label:<20}{cells}{(f'{cuda:,}' if cuda else '-'):>20}   ({result['outcome']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
