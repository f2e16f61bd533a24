"""What device-placement costs a traced fit: the CUDA interception (every run on CPU ranks pays it)
and the device following (the shared fit pays it), side by side in one run.

    python benchmarks/bench_device_placement.py [--repeats 3]

Runs the harness's traced fit in this process, as one rank of a one-rank gloo world, on two
modules: Lightning's BoringModel (a handful of torch calls per step) and a small transformer
encoder (hundreds per step), each under three settings, interleaved ``--repeats`` times:

- ``neither``: no interception, no device-placement probe (the fit as it was before the interception);
- ``interception``: the torch function mode that runs CUDA names on the CPU, recording requests;
- ``interception+probe``: that, and the device-placement probe following every tensor's device.

Prints the median CPU seconds of the fit and the torch calls the mode saw per fit. The other
contracts' probes are off in every setting, so the difference is this contract's alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("device-placement", "pytest_ltconform.contracts.device_placement.probe:DevicePlacementProbe")
SETTINGS = ("neither", "interception", "interception+probe")


def transformer():
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Encoder(L.LightningModule):
        """Two encoder layers of width 64 over sequences of 32 tokens; batches of 8."""

        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.head(self.encoder(x)).pow(2).mean()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 32, 64)), batch_size=8)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Encoder()


def fit(target, setting: str, folder: str) -> tuple[float, int]:
    """CPU seconds of one traced fit under ``setting``, and the torch calls the mode saw."""
    from pytest_ltconform import cuda_on_cpu, harness
    from pytest_ltconform.runs import RunArgs
    from pytest_ltconform.world import rank as rank_mod

    ctx = rank_mod.RankContext(rank=0, world_size=1, local_rank=0, job_dir=folder,
                               trace_path=os.path.join(folder, f"trace-{time.monotonic_ns()}.jsonl"), store=None,
                               run_dir=folder)
    rank_mod._CURRENT = ctx
    calls = [0]
    original = cuda_on_cpu._call

    def counted(*args):
        calls[0] += 1
        return original(*args)

    cuda_on_cpu._call = counted
    plain = setting == "neither"
    saved = harness._interception
    if plain:  # the harness before the interception: no mode entered (a stand-in the harness can ask for worker events)
        stand_in = cuda_on_cpu.Interception(0, 0, 1, None, False)
        harness._interception = lambda ctx, recorder: contextlib.nullcontext(stand_in)
    probes = [PROBE] if setting == "interception+probe" else []
    try:
        start = time.process_time()
        with contextlib.redirect_stdout(open(os.devnull, "w")), contextlib.redirect_stderr(open(os.devnull, "w")):
            harness.traced_fit(ctx, RunArgs(target, "ddp", tuple(probes), 30.0))
        return time.process_time() - start, calls[0]
    finally:
        cuda_on_cpu._call = original
        harness._interception = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import torch
    import torch.distributed as dist

    from pytest_ltconform.target import validation as target_validation

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)  # CPU seconds of one thread: steadier on a shared machine
    modules = {"BoringModel": "lightning.pytorch.demos.boring_classes.BoringModel",
               "transformer": f"{os.path.abspath(__file__)}:transformer"}
    print(f"{os.cpu_count()} cores; median CPU seconds of one traced fit (2 epochs x 4 batches) over "
          f"{args.repeats} interleaved runs; torch calls the mode saw per fit")
    print(f"{'module':<14}" + "".join(f"{s:>28}" for s in SETTINGS))
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        for name, spec in modules.items():
            target = target_validation.validate(model=spec)
            times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            seen: dict[str, int] = {}
            for _ in range(args.repeats):
                for setting in SETTINGS:
                    spent, calls = fit(target, setting, folder)
                    times[setting].append(spent)
                    seen[setting] = calls
            print(f"{name:<14}" + "".join(f"{statistics.median(times[s]):>17.2f} s {seen[s]:>7} calls"
                                          for s in SETTINGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
