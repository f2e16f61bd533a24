"""``pytest -n N --ltconform X`` (pytest-xdist, as users run it) against a serial session, side by
side, from one run.

    python benchmarks/bench_xdist.py [--target pkg.mod.Class] [--targets 3] [--repeat 3]
                                     [--modes serial,n2,n2-loadscope,n4] [--strategies ddp]

Every mode runs the same session: ``--targets`` copies of ``--target`` (ids t1, t2, ...) under
``--ltconform-strategies``; the modes are interleaved, ``--repeat`` rounds of each, so a change
in the machine's load falls on every mode alike. Prints, per mode:

- wall: seconds of the whole pytest command, median and (min-max) over the rounds;
- CPU: CPU seconds (user + system) of the command and every process it waited for
  (``getrusage(RUSAGE_CHILDREN)``: pytest, its xdist workers, the fork parents, the ranks), median
  and spread; CPU barely moves with other work on the machine, wall does;
- the same two over the serial session's medians;
- runs / imports / worlds: from the JSON report (``runs``: the runs made, by whichever worker;
  ``imports``: the processes that imported torch and Lightning for the ranks; ``cold_starts``);
- the outcome counts of pytest's last line, which must be the same in every mode (else the
  comparison is void, and the script says so and fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BORING = "lightning.pytorch.demos.boring_classes.BoringModel"
MODES = {
    "serial": ["-p", "no:xdist"],
    "n2": ["-n", "2"],  # --dist load, xdist's default
    "n2-loadscope": ["-n", "2", "--dist", "loadscope"],
    "n4": ["-n", "4"],
}
_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|error|errors|advisory|xfailed|xpassed)")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def session(mode: str, target: str, targets: int, strategies: str) -> dict:
    """One pytest session in ``mode``: its wall and CPU seconds, outcome counts and report facts."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *MODES[mode],
                "--ltconform-strategies", strategies, "--ltconform-report", report]
        for n in range(1, targets + 1):
            argv += ["--ltconform", f"{target} id=t{n}"]
        before, start = _children_cpu(), time.monotonic()
        proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True)
        wall, cpu = time.monotonic() - start, _children_cpu() - before
        if proc.returncode not in (0, 1):
            sys.exit(f"{mode}: pytest exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        with open(report) as fh:
            doc = json.load(fh)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {word.rstrip("s") if word == "errors" else word: int(n) for n, word in _COUNTS.findall(last)}
    return {"wall": wall, "cpu": cpu, "counts": counts, "runs": len(doc["runs"]), "imports": doc["imports"],
            "cold_starts": doc["cold_starts"]}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=BORING)
    parser.add_argument("--targets", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="serial,n2,n2-loadscope,n4")
    parser.add_argument("--strategies", default="ddp")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    print(f"{platform.node()}: {os.cpu_count()} CPUs; {args.targets} x {args.target}, strategies {args.strategies}; "
          f"{args.repeat} interleaved rounds")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    for n in range(args.repeat):
        for mode in modes:
            got[mode].append(session(mode, args.target, args.targets, args.strategies))
            print(f"  round {n + 1} {mode:13s} wall {got[mode][-1]['wall']:6.1f} s  CPU {got[mode][-1]['cpu']:6.1f} s",
                  flush=True)
    base = got.get("serial")
    print(f"\n{'mode':13s} {'wall s (min-max)':>20s} {'CPU s (min-max)':>20s} {'wall/serial':>11s} "
          f"{'CPU/serial':>10s} {'runs':>5s} {'imports':>7s} {'worlds':>6s}  outcomes")
    for mode in modes:
        rows = got[mode]
        wall, cpu = [r["wall"] for r in rows], [r["cpu"] for r in rows]
        ratio = (f"{statistics.median(wall) / statistics.median([r['wall'] for r in base]):11.2f} "
                 f"{statistics.median(cpu) / statistics.median([r['cpu'] for r in base]):10.2f}") if base else \
            f"{'-':>11s} {'-':>10s}"
        last = rows[-1]
        outcomes = ", ".join(f"{v} {k}" for k, v in sorted(last["counts"].items()))
        print(f"{mode:13s} {_spread(wall):>20s} {_spread(cpu):>20s} {ratio} {last['runs']:5d} "
              f"{last['imports'] if last['imports'] is not None else '-':>7} {last['cold_starts'] or 0:6d}  {outcomes}")
    outcomes = {json.dumps(r["counts"], sort_keys=True) for rows in got.values() for r in rows}
    if len(outcomes) > 1:
        print(f"\nthe modes' outcomes differ ({'; '.join(sorted(outcomes))}): the figures compare different work")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
