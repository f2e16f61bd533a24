"""Ranks forked from one pre-imported parent (``--ltconform-launcher fork``) against a fresh
interpreter per rank (``spawn``, the baseline), side by side, from one run.

    python benchmarks/bench_launch.py [--target pkg.mod.Class] [--corpus PATH ...] [--skip-corpus]

Prints, for each launcher:

- session CPU / import CPU: the CPU seconds (user + system, of every process of the session, from
  ``getrusage(RUSAGE_CHILDREN)``) of ``pytest --ltconform TARGET`` (every default item), over
  the CPU seconds of one ``python -c "import lightning.pytorch"``; for one target and for three
  (the same module under three ids). CPU time, unlike wall time, barely moves with the load of
  other work on the machine. Under fork the session imports Lightning once, in the ranks'
  parent (DeepSpeed and torch's inductor with it for the deepspeed items); pytest imports neither
  (the ranks' store is served by a fork of that parent); validation and spawn-safety's import are
  forks of that parent too. Under
  spawn pytest, every rank and spawn-safety's interpreter each import Lightning. Also printed: the
  one-target session over one import of what its ranks' parent imports with the deepspeed tier
  (Lightning, DeepSpeed and torch's inductor, which every DeepSpeed rank needs), and a session of
  the ddp and fsdp tiers alone (no DeepSpeed import) over one import of Lightning.
- replace: the seconds from asking a world whose last run failed (a rank raised) for a new run to
  that run's result, for a job that does nothing (the time to replace the world), median of 3.
- corpus: the wall time of ``python -m pytest_ltconform.corpus`` over the named cases (default:
  four of ``conformance/all-rank-save`` whose runs fail on a rank, so each replaces its world).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BORING = "lightning.pytorch.demos.boring_classes.BoringModel"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# Cases whose runs fail on a rank (each replaces its world), where the launchers differ.
CORPUS = [os.path.join(REPO, "conformance", "all-rank-save", name) for name in (
    "callback_save_rank_zero_only.py", "deepspeed_zero3_save_on_rank_zero.py",
    "deepspeed_checkpoint_dir_torch_load.py", "load_sharded_checkpoint_as_file.py")]

# What the ranks' parent imports when the deepspeed tier runs (vocabulary.DEEPSPEED_PRELOAD): every
# DeepSpeed rank needs the inductor (its ZeRO gradient reduction imports torch.compile'd kernels).
DEEPSPEED_SESSION_IMPORT = ("lightning.pytorch", "deepspeed", "torch._inductor.compile_fx")

NOTHING_JOB = '''
import os


def nothing(ctx):
    return os.getpid()


def fail(ctx):
    raise RuntimeError("a failed run: the world is replaced")
'''


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_of(argv: list[str], cwd: str | None = None) -> tuple[float, float, subprocess.CompletedProcess]:
    """(CPU seconds of the command and every process it waited for, wall seconds, the result)."""
    before, start = _children_cpu(), time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    return _children_cpu() - before, time.monotonic() - start, proc


def import_cpu(modules: tuple[str, ...] = ("lightning.pytorch",)) -> float:
    """CPU seconds of a fresh interpreter that imports ``modules``."""
    code = f"import importlib\nfor name in {modules!r}: importlib.import_module(name)"
    cpu, _, proc = cpu_of([sys.executable, "-c", code])
    if proc.returncode:
        sys.exit(f"importing {', '.join(modules)} failed:\n{proc.stderr[-2000:]}")
    return cpu


def session_cpu(target: str, targets: int, launcher: str, *extra: str) -> tuple[float, str]:
    """CPU seconds of one default session over ``targets`` copies of ``target`` (and ``extra``
    options), and its last line."""
    args = list(extra)
    for n in range(1, targets + 1):
        args += ["--ltconform", target if targets == 1 else f"{target} id=t{n}"]
    with tempfile.TemporaryDirectory() as tmp:
        cpu, _, proc = cpu_of([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args,
                               "--ltconform-launcher", launcher], cwd=tmp)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode not in (0, 1):
        sys.exit(f"the {launcher} session failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return cpu, last


def replace_s(launcher: str, repeat: int = 3) -> float:
    """Median seconds of a run that first replaces a world whose last run failed."""
    from pytest_ltconform.world import JobRequest, LocalWorld

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "bench_launch_jobs.py"), "w") as fh:
            fh.write(NOTHING_JOB)
        sys.path.insert(0, tmp)
        cwd = os.getcwd()
        os.chdir(tmp)  # ranks find the job module in the supervisor's working folder
        world = LocalWorld(2, launcher=launcher)
        times = []
        try:
            world.run(JobRequest("bench_launch_jobs:nothing", timeout_s=300))
            for _ in range(repeat):
                assert world.run(JobRequest("bench_launch_jobs:fail", timeout_s=300)).status == "error"
                start = time.monotonic()
                result = world.run(JobRequest("bench_launch_jobs:nothing", timeout_s=300))
                times.append(time.monotonic() - start)
                assert result.status == "ok", result.failure_text()
        finally:
            world.close()
            os.chdir(cwd)
            sys.path.remove(tmp)
    return statistics.median(times)


def corpus_s(paths: list[str], launcher: str) -> tuple[float, str]:
    _, wall, proc = cpu_of([sys.executable, "-m", "pytest_ltconform.corpus", "--launcher", launcher, *paths])
    lines = [line for line in proc.stdout.splitlines() if " cases, " in line]
    return wall, lines[-1] if lines else f"(exit {proc.returncode}) {proc.stderr[-500:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=BORING)
    ap.add_argument("--corpus", nargs="*", default=CORPUS,
                    help="corpus cases or folders (default: four all-rank-save cases)")
    ap.add_argument("--skip-corpus", action="store_true")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    one_import = import_cpu()
    print(f"one `import lightning.pytorch`: {one_import:.2f} CPU s")
    with_deepspeed = import_cpu(DEEPSPEED_SESSION_IMPORT)
    print(f"one import of {', '.join(DEEPSPEED_SESSION_IMPORT)} (what a session with the deepspeed tier "
          f"needs): {with_deepspeed:.2f} CPU s")
    rows = {launcher: {} for launcher in ("fork", "spawn")}
    for launcher in rows:
        for targets in (1, 3):
            cpu, last = session_cpu(args.target, targets, launcher)
            rows[launcher][f"session CPU / import CPU, {targets} target(s)"] = f"{cpu / one_import:.2f} ({cpu:.1f} s)"
            print(f"  {launcher}, {targets} target(s): {cpu:.1f} CPU s; {last}", flush=True)
            if targets == 1:
                rows[launcher]["  the same / its own import (with DeepSpeed)"] = f"{cpu / with_deepspeed:.2f}"
        cpu, last = session_cpu(args.target, 1, launcher, "--ltconform-strategies", "ddp,fsdp")
        rows[launcher]["session CPU / import CPU, 1 target, ddp+fsdp"] = f"{cpu / one_import:.2f} ({cpu:.1f} s)"
        print(f"  {launcher}, 1 target, ddp and fsdp: {cpu:.1f} CPU s; {last}", flush=True)
        rows[launcher]["replace a world after a failed run (s)"] = f"{replace_s(launcher):.2f}"
        if not args.skip_corpus:
            wall, line = corpus_s(args.corpus, launcher)
            rows[launcher][f"corpus wall time, {len(args.corpus)} path(s) (s)"] = f"{wall:.0f}"
            print(f"  {launcher} corpus: {line}", flush=True)
    print(f"\n{'':48}{'fork':>16}{'spawn':>16}")
    for name in rows["fork"]:
        print(f"{name:48}{rows['fork'][name]:>16}{rows['spawn'][name]:>16}")
    print("targets: session CPU / import CPU <= 2.0; replace < 1 s")
    print(f"(a plain import of what the deepspeed tier's parent imports costs {with_deepspeed / one_import:.2f} "
          "imports; the parent imports it with the collector off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
