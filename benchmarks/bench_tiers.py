"""The cost of each CPU strategy tier (ddp, fsdp, deepspeed) on Lightning's BoringModel.

    python benchmarks/bench_tiers.py [--target pkg.mod.Class] [--strategies ddp,fsdp,deepspeed]

Prints, from one run on this machine, per strategy: the cold start a rank pays once (a fresh
interpreter importing what that tier needs: lightning.pytorch, plus deepspeed for the deepspeed
tier), the wall time of a pytest process that runs only that strategy's CPU items (one world cold
start, one shared traced run, every item judged), the first item's time (world start plus the
shared run) and the rest (judging only), and the verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

IMPORTS = {"ddp": "import lightning.pytorch", "fsdp": "import lightning.pytorch",
           "deepspeed": "import lightning.pytorch, deepspeed"}


def cold_start_s(strategy: str) -> float:
    """Seconds for a fresh interpreter to import what a rank of this tier imports."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", IMPORTS[strategy]], check=True, env=env, capture_output=True)
    return time.monotonic() - start


def tier_run(target: str, strategy: str) -> tuple[float, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ltconform", target,
             "--ltconform-strategies", strategy, "-m", "ltconform_cpu", "--ltconform-report", report],
            cwd=tmp, capture_output=True, text=True,
        )
        elapsed = time.monotonic() - start
        if not os.path.exists(report):
            sys.exit(f"{strategy}: no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(report) as fh:
            return elapsed, json.load(fh)["results"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="lightning.pytorch.demos.boring_classes.BoringModel")
    ap.add_argument("--strategies", default="ddp,fsdp,deepspeed")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{'tier':<10} {'cold start':>10} {'pytest wall':>11} {'first item':>10} {'other items':>11}  verdicts")
    for strategy in args.strategies.split(","):
        cold = cold_start_s(strategy)
        wall, results = tier_run(args.target, strategy)
        durations = [r["duration_s"] for r in results]
        first, rest = (durations[0], sum(durations[1:])) if durations else (0.0, 0.0)
        outcomes = sorted({r["outcome"] for r in results})
        print(f"{strategy:<10} {cold:>9.1f}s {wall:>10.1f}s {first:>9.1f}s {rest:>10.1f}s  "
              f"{len(results)} items {outcomes}")
    print("cold start: per rank, once per world; first item: world start + the shared traced run; "
          "other items: judging on that run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
