"""What judging both seedings costs: sessions under --ltconform-seeding same, both and per-rank.

    python benchmarks/bench_seeding.py [--target pkg.mod.Class] [--repeat 3] [-k EXPR]

Seeding "both" (the default) judges draws that must agree across ranks under per-rank seeds and
noise that must differ under one seed in the *same* traced fit: each rank starts with its own seed
and is reseeded alike when training starts, and the taps that record where user code draws from a
global generator outside the steps run in that fit. This prints, per seeding, the wall time of a
pytest session on one target (ddp only, the items of ``-k``: by default the fit-based data-sharding
and sync-dist, which share one traced fit), the CPU seconds of pytest and everything it started, the
runs it made (the fit items' count: an extra run per target would show here) and the fit item's own
seconds. Sessions are interleaved (same, both, per-rank, same, ...) so that the machine's drift
falls on every seeding alike; the fastest of ``--repeat`` is shown with the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

SEEDINGS = ("same", "both", "per-rank")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def session(target: str, seeding: str, keyword: str) -> dict:
    """One pytest session under ``seeding``; its wall and CPU seconds and its report's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cpu, start = _cpu(), time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ltconform", target,
             "--ltconform-strategies", "ddp", "--ltconform-seeding", seeding, "-m", "ltconform_cpu", "-k", keyword,
             "--ltconform-report", report], cwd=tmp, capture_output=True, text=True)
        wall, cpu = time.monotonic() - start, _cpu() - cpu
        if not os.path.exists(report):
            sys.exit(f"the session wrote no report (exit {proc.returncode}):\n"
                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(report) as fh:
            doc = json.load(fh)
    runs = [r for r in doc["results"] if r.get("run")]
    return {"wall": wall, "cpu": cpu, "runs": len(runs), "fit_s": runs[0]["duration_s"] if runs else None,
            "outcomes": sorted({r["outcome"] for r in doc["results"]}), "seeds": doc.get("seeding", {}).get("ranks")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="lightning.pytorch.demos.boring_classes.BoringModel")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-k", dest="keyword", default="fit or data-sharding or sync-dist")
    args = ap.parse_args()
    seen: dict[str, list[dict]] = {s: [] for s in SEEDINGS}
    for _ in range(args.repeat):
        for seeding in SEEDINGS:
            seen[seeding].append(session(args.target, seeding, args.keyword))
    print(f"target {args.target}, ddp, -k {args.keyword!r}; {platform.python_version()} on {os.cpu_count()} CPUs, "
          f"{args.repeat} interleaved session(s) per seeding")
    print(f"{'seeding':10} {'wall s':>14} {'CPU s':>14} {'runs':>5} {'fit item s':>11}  seeds   outcomes")
    for seeding, rows in seen.items():
        best = min(rows, key=lambda r: r["wall"])
        walls, cpus = [r["wall"] for r in rows], [r["cpu"] for r in rows]
        print(f"{seeding:10} {best['wall']:6.1f} ({max(walls) - min(walls):4.1f}) "
              f"{min(cpus):6.1f} ({max(cpus) - min(cpus):4.1f}) {best['runs']:>5} {best['fit_s'] or 0:>11.2f}  "
              f"{best['seeds']}  {', '.join(best['outcomes'])}")
    print("(wall and CPU: the fastest session, the spread of all in parentheses; runs: the fit items, one per "
          "fit made)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
