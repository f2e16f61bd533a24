"""Persistent worlds versus a fresh world per contract, on Lightning's BoringModel.

    python benchmarks/bench_worlds.py [--target pkg.mod.Class] [--repeat 1]

Prints, from one run on this machine: the cold-start cost (seconds until a rank has imported
torch and lightning), the wall time of the default ltconform suite with the persistent world
pool and with LTCONFORM_FRESH_WORLDS=1 (a cold world and its own run for every item), their
ratio, and whether both gave identical verdicts.
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


def cold_start_s() -> float:
    """Seconds for a fresh interpreter to import lightning.pytorch (what each rank pays once)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import lightning.pytorch"], check=True)
    return time.monotonic() - start


def suite(target: str, fresh: bool) -> tuple[float, dict]:
    env = dict(os.environ, LTCONFORM_FRESH_WORLDS="1" if fresh else "0")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ltconform", target,
             "--ltconform-report", report],
            cwd=tmp, env=env, capture_output=True, text=True,
        )
        elapsed = time.monotonic() - start
        if not os.path.exists(report):
            sys.exit(f"the suite wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(report) as fh:
            doc = json.load(fh)
    # Items of tiers this machine cannot run are listed as skipped "unavailable": not verdicts.
    verdicts = {f"{r['contract']}[{r['strategy']}]": r["outcome"] for r in doc["results"]
                if r.get("category") != "unavailable"}
    return elapsed, verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="lightning.pytorch.demos.boring_classes.BoringModel")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"cold start (import lightning.pytorch in a fresh interpreter): {cold_start_s():.2f} s")
    persistent, fresh = [], []
    for _ in range(args.repeat):
        t, v_persistent = suite(args.target, fresh=False)
        persistent.append(t)
        t, v_fresh = suite(args.target, fresh=True)
        fresh.append(t)
    p, f = min(persistent), min(fresh)
    print(f"items: {len(v_persistent)} ({', '.join(sorted(v_persistent))})")
    print(f"persistent world pool: {p:.1f} s")
    print(f"fresh world per item:  {f:.1f} s")
    print(f"speed-up: {f / p:.2f}x")
    print(f"identical verdicts: {v_persistent == v_fresh} ({sorted(set(v_persistent.values()))})")
    for key in sorted(set(v_persistent) | set(v_fresh)):
        if v_persistent.get(key) != v_fresh.get(key):
            print(f"  differs: {key}: persistent {v_persistent.get(key)}, fresh {v_fresh.get(key)}")
    return 0 if v_persistent == v_fresh else 1


if __name__ == "__main__":
    sys.exit(main())
