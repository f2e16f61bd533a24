"""Sessions of 1, 3 and 6 targets: what each extra target costs.

    python benchmarks/bench_targets.py [--target pkg.mod.Class] [--counts 1,3,6] [-k EXPR]

Runs one pytest session per count, each checking that many targets (the same module under the ids
t1, t2, ..., so every target costs the same), ddp only, on the contracts selected by ``-k`` (by
default sync-dist and unused-parameters, which share one traced fit per target). Prints, for each
session: the wall time (pytest's own start-up included), the rank generations it started (the
report's ``cold_starts``: one per target, since a target never runs in ranks another target used),
the fits it made (one per target), and the seconds each target's first item spent: the first
target's includes the fork parent's import, every further target's a fork of fresh ranks and its fit.
All targets share one world (store, folder, fork parent): the cost grows by a fork and a fit.
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


def session(target: str, count: int, keyword: str) -> dict:
    """One pytest session over ``count`` targets; its wall time and report."""
    args = []
    for n in range(1, count + 1):
        args += ["--ltconform", f"{target} id=t{n}"]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "--ltconform-strategies", "ddp",
             "-m", "ltconform_cpu", "-k", keyword, "--ltconform-report", report],
            cwd=tmp, capture_output=True, text=True,
        )
        wall = time.monotonic() - start
        if not os.path.exists(report):
            sys.exit(f"the session wrote no report (exit {proc.returncode}):\n"
                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(report) as fh:
            doc = json.load(fh)
    outcomes = sorted({r["outcome"] for r in doc["results"]})
    # The first item of each target pays for its fit; the others only judge it.
    fits = [t["results"][0]["duration_s"] for t in doc["targets"] if t["results"]]
    return {"wall": wall, "cold_starts": doc["cold_starts"], "fits": len(fits), "fit_s": fits,
            "items": len(doc["results"]), "outcomes": outcomes, "exit": proc.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="lightning.pytorch.demos.boring_classes.BoringModel")
    ap.add_argument("--counts", default="1,3,6")
    ap.add_argument("-k", dest="keyword", default="sync-dist or unused-parameters")
    ap.add_argument("--repeat", type=int, default=1, help="sessions per count; the fastest is shown")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"target: {args.target} (ids t1..tN), ddp, -k '{args.keyword}'")
    print(f"{'targets':>7} {'wall':>7} {'cold starts':>11} {'fits':>4}  first target (import + fit)  "
          f"each further target (fork + fit)")
    rows = {}
    for count in counts:
        row = rows[count] = min((session(args.target, count, args.keyword) for _ in range(args.repeat)),
                                key=lambda r: r["wall"])
        rest = ", ".join(f"{s:.1f}" for s in row["fit_s"][1:]) or "-"
        print(f"{count:>7} {row['wall']:>6.1f}s {row['cold_starts']:>11} {row['fits']:>4}  "
              f"{row['fit_s'][0]:>26.1f}s  {rest}")
    further = [s for row in rows.values() for s in row["fit_s"][1:]]
    if further:
        print(f"a further target costs {sum(further) / len(further):.1f} s on average (fresh ranks forked, its fit "
              f"and judgements); the import is paid once per session")
    ok = all(r["exit"] == 0 and r["cold_starts"] == c and r["fits"] == c for c, r in rows.items())
    print(f"fresh ranks and one fit per target: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
