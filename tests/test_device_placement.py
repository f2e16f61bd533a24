"""device-placement: where each tensor would be on GPU ranks, followed on CPU ranks, and the verdict
against the user's Trainer config.

The rank-side follower (``follow.DeviceFollower``, the interception's observer) runs here in this
process on real torch calls, no world needed; the verdicts are judged on hand-built runs. The
conformance cases (``conformance/device-placement/``) judge both ends on real ranks in the corpus test.
The interception itself is tests/test_cuda_on_cpu.py's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from pytest_ltconform import claims, cuda_on_cpu
from pytest_ltconform.contracts import get_contract
from pytest_ltconform.contracts.device_placement.config import Production
from pytest_ltconform.contracts.device_placement.follow import DeviceFollower, plain_tensor_attributes
from pytest_ltconform.contracts.device_placement.probe import EV_COLLECTIVE, EV_LOADED, EV_MIX, EV_UNSET
from pytest_ltconform.contracts.device_placement.source import index_source, static_sites
from pytest_ltconform.cuda_on_cpu import EV_CUDA, EV_UNMAPPED
from pytest_ltconform.events import HOOK

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (after the call that marks it)."""
    with open(__file__, encoding="utf-8") as fh:
        return next(n for n, text in enumerate(fh, 1) if text.rstrip().endswith(f"# {marker}"))


# -- following devices ------------------------------------------------------------------------------------

@contextlib.contextmanager
def following(local_rank: int = 1, mimic: bool = True):
    """The interception with a follower as its observer, as the probe installs them; yields
    ``(follower, findings)``."""
    found = []
    with cuda_on_cpu.intercept(local_rank, local_rank, 2, None, mapping=True) as state:
        follower = DeviceFollower(local_rank, lambda kind, key, event: found.append({"kind": kind, **event}),
                                  lambda: state.current if state.current is not None else local_rank, mimic)
        state.observer = follower
        state.synchronized.append(follower.synchronized)
        yield follower, found


def _on_device(follower, *tensors):
    for t in tensors:
        follower.place(t, follower.own)
    return tensors


def test_a_tensor_made_without_a_device_stays_on_the_host_and_a_mix_with_the_device_is_found():
    with following() as (follower, found):
        weight, x = _on_device(follower, torch.randn(3, 4), torch.randn(2, 4))
        bias = torch.zeros(3)  # host
        out = F.linear(x, weight) + bias  # mix
        assert follower.tag(bias)[0] == "cpu" and follower.tag(out)[0] == follower.own
    mix = [f for f in found if f["kind"] == "mix"]
    assert [(m["site"]["line"], m["devices"]) for m in mix] == [(_line("mix"), ["cuda:1", "cpu"])]
    assert mix[0]["origins"][0]["site"]["line"] == _line("host")


def test_what_cuda_accepts_across_devices_is_not_a_mix():
    with following() as (follower, found):
        (x,) = _on_device(follower, torch.randn(4, 3))
        scaled = x * torch.tensor(2.0)  # a 0-dim CPU scalar: CUDA takes it
        picked = x[torch.tensor([0, 2])]  # CPU indices into a device tensor: CUDA takes them
        x.copy_(torch.zeros(4, 3))  # a copy across devices
        moved = torch.zeros(4, 3).to(x.device) + x  # sent to x's device first
        like = torch.zeros_like(x) + x
        made = torch.ones(3, device=x.device) + x
    assert [f for f in found if f["kind"] == "mix"] == []
    assert {follower.tag(t)[0] for t in (scaled, picked, moved, like, made)} == {follower.own}


def test_a_fixed_cuda_index_is_another_gpu_on_other_ranks():
    with following(local_rank=1) as (follower, found):
        (x,) = _on_device(follower, torch.randn(2, 4))
        grid = torch.arange(4, device="cuda:0", dtype=torch.float32).repeat(2, 1)
        x + grid  # two
    assert follower.tag(grid)[0] == "cuda:0"
    mix = next(f for f in found if f["kind"] == "mix")
    assert mix["devices"] == ["cuda:1", "cuda:0"] and mix["site"]["line"] == _line("two")
    with following(local_rank=0) as (follower, found):
        (x,) = _on_device(follower, torch.randn(2, 4))
        x + torch.arange(4, device="cuda:0", dtype=torch.float32)  # rank 0: its own GPU
    assert found == []


def test_an_in_place_update_of_a_host_tensor_from_the_device_is_a_mix():
    with following() as (follower, found):
        (preds,) = _on_device(follower, torch.tensor([1, 0, 1]))
        correct = torch.tensor(0)
        correct += (preds == 1).sum()  # inplace
    assert [f["site"]["line"] for f in found if f["kind"] == "mix"] == [_line("inplace")]


class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("moved", torch.ones(4))
        self.positions = torch.arange(4.0)
        self.table = [torch.zeros(2)]


def test_plain_tensor_attributes_are_the_ones_to_does_not_move():
    module = torch.nn.Sequential(_Encoder())
    module.alias = module[0].proj.weight  # a parameter under another name is moved with it
    found = {path for path, _ in plain_tensor_attributes(module)}
    assert found == {"0.positions", "0.table[0]"}


def test_a_metric_states_move_with_it_and_its_plain_tensor_attribute_does_not():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Hits(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("hits", default=torch.tensor(0), dist_reduce_fx="sum")
            self.total = torch.tensor(0)  # not a state: .to() leaves it

        def update(self, preds, target):
            self.hits += (preds == target).sum()

        def compute(self):
            return self.hits

    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    module.hits = Hits()
    assert {path for path, _ in plain_tensor_attributes(module)} == {"hits.total"}


def test_moving_to_the_module_device_and_reading_x_device_follow_the_device():
    with following() as (follower, found):
        (x,) = _on_device(follower, torch.randn(3))
        root = torch.device("cpu")
        follower.mark_device(root, follower.own)  # the strategy's root device
        host = torch.tensor([1.0, 2.0, 3.0])
        sent = host.to(root)
        assert follower.tag(sent)[0] == follower.own
        made = torch.ones(3, device=x.device)
        assert follower.tag(made)[0] == follower.own
        unknown = torch.ones(3, device=torch.device("cpu"))  # a CPU device nobody placed: not judged
        assert follower.tag(unknown) is None


def test_cpu_of_a_device_tensor_is_a_host_copy_under_a_gpu_config():
    with following(mimic=True) as (follower, found):
        (loss,) = _on_device(follower, torch.tensor(0.5))
        copy = loss.cpu()
        assert copy is not loss and follower.tag(copy)[0] == "cpu" and follower.tag(loss)[0] == follower.own
    with following(mimic=False) as (follower, found):
        (loss,) = _on_device(follower, torch.tensor(0.5))
        assert loss.cpu() is loss and follower.tag(loss)[0] == follower.own  # a CPU config: torch's own answer


def test_numpy_of_a_device_tensor_is_found_and_of_a_cpu_copy_is_not():
    with following() as (follower, found):
        (preds,) = _on_device(follower, torch.tensor([1, 0]))
        preds.numpy()  # numpy
        preds.detach().cpu().numpy()
    assert [f["site"]["line"] for f in found if f["kind"] == "numpy"] == [_line("numpy")]


def test_a_non_blocking_copy_read_before_synchronize_is_found():
    with following() as (follower, found):
        (preds,) = _on_device(follower, torch.tensor([1, 0, 1]))
        early = preds.to("cpu", non_blocking=True)
        assert early.shape == (3,) and early.numel() == 3  # metadata: no values read
        early.tolist()  # unsynced
        later = preds.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        later.tolist()
    assert [f["site"]["line"] for f in found if f["kind"] == "unsynced"] == [_line("unsynced")]


# -- reading the source ------------------------------------------------------------------------------------

def _src(tmp_path, text: str) -> str:
    path = tmp_path / "mod.py"
    path.write_text(text)
    return str(path)


def test_the_source_says_whether_an_index_is_the_global_or_the_local_rank(tmp_path):
    path = _src(tmp_path, "import os, torch\n"
                          "class M:\n"
                          "    def a(self):\n"
                          "        torch.zeros(1, device=f'cuda:{self.global_rank}')\n"
                          "    def b(self):\n"
                          "        rank = int(os.environ['LOCAL_RANK'])\n"
                          "        torch.cuda.set_device(rank)\n"
                          "    def c(self):\n"
                          "        torch.cuda.set_device(self.index)\n"
                          "    def setup(self):\n"
                          "        self.index = torch.distributed.get_rank()\n")
    where = [index_source({"file": path, "line": n})[0] for n in (4, 7, 9)]
    assert where == ["global", "local", "global"]


def test_the_static_pass_finds_fixed_indices_set_device_and_loads(tmp_path):
    path = _src(tmp_path, "import torch\n"
                          "x = torch.zeros(1, device='cuda:0')\n"
                          "y = torch.ones(1).cuda(1)\n"
                          "torch.cuda.set_device(0)\n"
                          "z = torch.load('w.pt')\n"
                          "w = torch.load('w.pt', map_location='cpu')\n"
                          "v = torch.zeros(1, device='cuda')\n")
    assert [(s["line"], s["what"].split("(")[0]) for s in static_sites([path])] == [
        (2, "torch.zeros"), (3, ".cuda"), (4, "torch.cuda.set_device"), (5, "torch.load")]


# -- the verdict, against the user's Trainer config ----------------------------------------------------------

def test_the_config_says_what_breaks():
    auto = Production.of({"accelerator": None})
    assert auto.gpu == "auto" and auto.breaks("node") and auto.breaks("gpu") and not auto.breaks("nodes")
    one = Production.of({"accelerator": "gpu", "devices": 1})
    assert one.breaks("gpu") and not one.breaks("node") and not one.breaks("ranks")
    cpu = Production.of({"accelerator": "cpu", "devices": 4, "num_nodes": 2})
    assert not any(cpu.breaks(n) for n in ("gpu", "ranks", "node", "nodes"))
    assert Production.of({"devices": "0,1"}).per_node == 2 and Production.of({"devices": "1,"}).per_node == 1
    assert Production.of({"strategy": "ddp_notebook"}).start == "fork"
    assert Production.of({"strategy": "ddp_spawn"}).start == "spawn"


_SITE = {"file": __file__, "line": 1, "func": "Model.on_validation_epoch_end"}


def _loaded(config: dict, world: str = "cpu") -> dict:
    return {"ev": EV_LOADED, "seq": 2, "config": config, "world": world}


def _host_collective(rank: int) -> dict:
    return {"ev": EV_COLLECTIVE, "seq": 40, "op": "all_reduce", "site": None, "hook": "on_validation_epoch_end",
            "device": "cpu", "own": f"cuda:{rank}", "role": "the tensor",
            "origin": {"how": "torch.tensor without a device", "site": _SITE}}


def _judge(fake_runs, traces, **job):
    return _borne_out(get_contract("device-placement").judge(fake_runs.run(traces, **job)))


def _borne_out(verdict):
    """The verdict, once every sentence of it is checked against its recorded facts (claims.check)."""
    record = {"contract": verdict.contract, **verdict.as_dict()}
    assert claims.check(record) == [], record["message"]
    return verdict


def test_a_host_tensor_given_to_a_collective_fails_a_gpu_config_and_is_an_advisory_on_a_cpu_one(fake_runs):
    traces = [[_loaded({"accelerator": "gpu", "devices": 2}), _host_collective(r)] for r in range(2)]
    verdict = _judge(fake_runs, traces)
    assert verdict.outcome == "failed" and "No backend type associated with device type cpu" in verdict.summary
    assert [e.rank for e in verdict.evidence] == [0, 1] and "torch.tensor(value, device=self.device)" in verdict.fix
    cpu = _judge(fake_runs, [[_loaded({"accelerator": "cpu"}), _host_collective(r)] for r in range(2)])
    assert cpu.outcome == "advisory" and cpu.summary.startswith("The Trainer config is for CPU ranks")


def _request(rank: int, index, line: int = 3, api: str = "torch.arange", seq: int = 30) -> dict:
    return {"ev": EV_CUDA, "seq": seq, "api": api, "device": f"cuda:{index}", "index": index, "current": 0,
            "site": {"file": __file__, "line": line, "func": "anchor_grid"}, "direct": True, "hook": "training_step",
            "rank": rank, "local_rank": rank, "mapped": "cpu"}


def test_a_fixed_index_fails_with_several_gpus_per_node_and_is_an_advisory_with_one(fake_runs):
    traces = [[_loaded({}), _request(r, 0)] for r in range(2)]
    verdict = _judge(fake_runs, traces)
    assert verdict.outcome == "failed" and "hard-coded device 'cuda:0' on every rank" in verdict.summary
    assert "this rank's own GPU is cuda:1" in verdict.evidence[1].detail
    one = _judge(fake_runs, [[_loaded({"accelerator": "gpu", "devices": 1}), _request(r, 0)] for r in range(2)])
    assert one.outcome == "advisory"
    own = _judge(fake_runs, [[_loaded({}), _request(r, r, line=10)] for r in range(2)])
    assert own.outcome == "passed", own.summary  # each rank's own index (this file's line 10 reads no rank)


def test_an_object_collective_before_the_device_is_set_fails(fake_runs):
    unset = {"ev": EV_UNSET, "seq": 1, "op": "broadcast_object_list", "hook": None, "current": None,
             "group": None, "site": {"file": __file__, "line": 5, "func": "shared_run_name"}}
    verdict = _judge(fake_runs, [[unset, _loaded({})] for _ in range(2)])
    assert verdict.outcome == "failed" and "Duplicate GPU detected" in verdict.summary
    assert "before the Trainer was built" in verdict.summary and "torch.cuda.set_device" in verdict.fix


def test_a_run_stopped_by_a_call_the_cpu_cannot_give_is_not_judged_with_the_line(fake_runs):
    stop = {"ev": EV_UNMAPPED, "seq": 5, "api": "torch.cuda.get_device_properties",
            "site": {"file": __file__, "line": 7, "func": "Model.setup"}, "why": "a CPU has no CUDA device properties"}
    ranks = [fake_runs.rank(r, [_loaded({}), stop], status="error", exc_type="CudaNotMappable", message="...")
             for r in range(2)]
    run = fake_runs.of(ranks, status="error")
    contract = get_contract("device-placement")
    assert contract.blames(run) is not None
    verdict = _borne_out(contract.judge(run))
    assert verdict.not_judged is not None and "test_device_placement.py:7" in verdict.summary
    assert "torch.cuda.get_device_properties" in verdict.summary


def test_on_gpu_ranks_a_device_error_a_rank_raised_is_this_contracts(fake_runs):
    message = "No backend type associated with device type cpu"
    ranks = [fake_runs.rank(r, [_loaded({}, world="gpu")], status="error", exc_type="RuntimeError", message=message)
             for r in range(2)]
    run = fake_runs.of(ranks, status="error")
    contract = get_contract("device-placement")
    assert contract.blames(run) is not None
    verdict = _borne_out(contract.judge(run))
    assert verdict.outcome == "failed" and message in verdict.summary


def test_a_run_with_nothing_off_the_device_passes_and_says_what_it_saw(fake_runs):
    traces = [[_loaded({}), {"ev": HOOK, "name": "[LightningModule]Model.training_step", "i": 1}]
              for _ in range(2)]
    values = [{"probes": {"device-placement": {"counts": {"collectives": 3, "own": 5, "unplaced": 1}}}}] * 2
    verdict = _borne_out(get_contract("device-placement").judge(fake_runs.run(traces, values)))
    assert verdict.outcome == "passed"
    assert "the 3 collectives rank 0 made got 6 tensors: 5 on the rank's own device" in verdict.summary


def test_a_mix_on_every_rank_names_each_ranks_own_devices(fake_runs):
    """Rank 0 mixes cuda:0 with the CPU, rank 1 cuda:1: the sentence gives each rank's devices."""
    def mix(rank: int) -> dict:
        return {"ev": EV_MIX, "seq": 30, "api": "Tensor.add", "devices": [f"cuda:{rank}", "cpu"], "own": f"cuda:{rank}",
                "why": "expected device meta", "site": {"file": __file__, "line": 9, "func": "Model.forward"},
                "origins": [None, {"how": "torch.linspace without a device", "site": _SITE}]}

    verdict = _judge(fake_runs, [[_loaded({}), mix(r)] for r in range(2)])
    assert verdict.outcome == "failed"
    assert "gets tensors on cuda:0 and cpu on rank 0 (rank 1: cuda:1 and cpu), with a tensor made by" in verdict.summary
    assert [e.rank for e in verdict.evidence] == [0, 1] and "cuda:1, cpu" in verdict.evidence[1].detail


def test_a_factory_another_probe_wraps_is_still_followed(monkeypatch):
    """data-sharding wraps torch.randn (recorder.patch keeps the original as __wrapped__); the mode
    sees the original: a GAN's latent drawn without a device is still on the host."""
    original = torch.randn

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original
    monkeypatch.setattr(torch, "randn", wrapper)
    generator = torch.nn.Linear(4, 8)
    with following() as (follower, found):
        for p in generator.parameters():
            follower.place(p, follower.own)
        latent = torch.randn(3, 4)
        generator(latent)  # latent meets the weights
        assert follower.tag(latent)[0] == "cpu"
    assert [(f["kind"], f["site"]["line"]) for f in found] == [("mix", _line("latent meets the weights"))]


def test_nested_collectives_are_counted_with_the_tensors_they_got(fake_runs):
    """all_gather_object's allgather is a collective made inside another: its tensors are counted,
    so it is counted and said too (the old sentence gave 1 collective with 2 tensors)."""
    traces = [[_loaded({}), {"ev": HOOK, "name": "[LightningModule]Model.training_step", "i": 1}]
              for _ in range(2)]
    counts = {"collectives": 1, "nested": 2, "own": 0, "unplaced": 2}
    values = [{"probes": {"device-placement": {"counts": counts}}}] * 2
    verdict = _borne_out(get_contract("device-placement").judge(fake_runs.run(traces, values)))
    assert "the 1 collective rank 0 made (and the 2 collectives made inside them) got 2 tensors" in verdict.summary
    old = "[device-placement] PASSED: Under the Trainer config (x): the 1 collective rank 0 made got 2 tensors."
    record = {"contract": "device-placement", "message": old,
              "claims": [claims.claim("collectives-seen", "the 1 collective rank 0 made got 2 tensors",
                                      collectives=1, nested=2, tensors=2, own=0, unplaced=2).as_dict()]}
    assert any("made inside others" in p for p in claims.check(record))


def test_plain_tensor_attributes_are_listed_whole_or_as_the_first_few_and_nothing_unrecorded_is_said(fake_runs):
    """Seen on anomalib's Ganomaly: "none met a tensor on the device" (not recorded) and seven
    attributes counted with three names."""
    from pytest_ltconform.contracts.device_placement.probe import EV_ATTRIBUTES

    attributes = [{"attr": f"a{i}", "device": "cpu", "shape": [2], "origin": None} for i in range(7)]
    traces = [[_loaded({}), {"ev": EV_ATTRIBUTES, "attributes": attributes},
               {"ev": HOOK, "name": "[LightningModule]Model.training_step", "i": 1}] for _ in range(2)]
    values = [{"probes": {"device-placement": {"counts": {"collectives": 0, "own": 0, "unplaced": 0}}}}] * 2
    verdict = _borne_out(get_contract("device-placement").judge(fake_runs.run(traces, values)))
    note = next(n for n in verdict.notes if "plain tensor attribute" in n)
    assert "7 plain tensor attributes (first 5: self.a0, self.a1, self.a2, self.a3, self.a4)" in note
    assert "none met" not in note
    old = ("[device-placement] PASSED: x\nNote: 7 plain tensor attributes (self.a0, self.a1, self.a2) stay where they "
           "were made; none met a tensor on the device in what ran.")
    problems = claims.check({"contract": "device-placement", "message": old})
    assert any(p.startswith("unrecorded") for p in problems) and any(p.startswith("listed") for p in problems)
