"""cuda_on_cpu: code that names CUDA runs on CPU ranks during the plugin's runs, each request recorded.

The interception runs here in this process on real torch calls (a CPU-only torch), no world needed;
the device-placement contract's cases (``conformance/device-placement/``) run it on real ranks.
"""

from __future__ import annotations

import zipfile

import pytest
import torch

from pytest_ltconform import cuda_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (after the call that marks it)."""
    with open(__file__, encoding="utf-8") as fh:
        return next(n for n, text in enumerate(fh, 1) if text.rstrip().endswith(f"# {marker}"))


# -- the interception ---------------------------------------------------------------------------------

def test_code_that_names_cuda_runs_on_the_cpu_and_each_request_is_recorded():
    events = []
    with cuda_on_cpu.intercept(1, 1, 2, events.append, mapping=True):
        a = torch.arange(4, device="cuda:0")  # arange
        b = torch.ones(3).cuda()  # cuda
        c = torch.ones(3).to("cuda:1")  # to
        d = torch.zeros(2, device=torch.device("cuda", 1))  # device
        lin = torch.nn.Linear(2, 2).cuda(0)  # module
        e = torch.ones(2).to(0)  # index
    assert {t.device.type for t in (a, b, c, d, e, lin.weight)} == {"cpu"}
    got = {(ev["api"], ev["device"], ev["index"], ev["site"]["line"]) for ev in events}
    assert got == {("torch.arange", "cuda:0", 0, _line("arange")), ("Tensor.cuda", "cuda", None, _line("cuda")),
                   ("Tensor.to", "cuda:1", 1, _line("to")), ("torch.zeros", "cuda:1", 1, _line("device")),
                   ("Tensor.cuda", "cuda:0", 0, _line("module")), ("Tensor.to", "cuda:0", 0, _line("index"))}
    module_event = next(ev for ev in events if ev["site"]["line"] == _line("module"))
    assert module_event["direct"] is False  # reached through nn.Module._apply: the user's line is named
    assert all(ev["rank"] == 1 and ev["local_rank"] == 1 and ev["mapped"] == "cpu" for ev in events)


def test_a_request_is_recorded_once_per_site():
    events = []
    with cuda_on_cpu.intercept(0, 0, 2, events.append, mapping=True):
        for _ in range(5):
            torch.zeros(1, device="cuda:0")
    assert len(events) == 1


def test_torch_cuda_calls_run_on_the_cpu_and_are_undone_afterwards():
    original = (torch.cuda.set_device, torch.cuda.current_device, torch.load)
    events = []
    with cuda_on_cpu.intercept(1, 1, 4, events.append, mapping=True) as state:
        assert torch.cuda.current_device() == 0  # nothing set yet: GPU 0, as on a GPU rank
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
        assert torch.cuda.current_device() == 1
        torch.cuda.synchronize()
        assert torch.cuda.device_count() == 0  # the config is not known to be for GPUs yet
        state.gpu_config = True
        assert torch.cuda.device_count() == 4  # user code asking gets the ranks per node
        assert torch.ones(2).pin_memory().is_pinned() is False
    assert (torch.cuda.set_device, torch.cuda.current_device, torch.load) == original
    assert [ev["index"] for ev in events if ev["api"] == "torch.cuda.set_device"] == [1]
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()  # the CPU-only torch again


def test_cuda_as_the_default_device_is_recorded_and_the_cpu_made_the_default():
    events = []
    with cuda_on_cpu.intercept(0, 0, 1, events.append, mapping=True) as state:
        torch.set_default_device("cuda")  # default
        made = torch.zeros(2)
        torch.set_default_device(None)
    assert made.device.type == "cpu" and state.default_cuda is False
    assert [(e["api"], e["site"]["line"]) for e in events] == [("torch.set_default_device", _line("default"))]


def test_in_a_gpu_world_set_device_runs_as_it_is_and_is_recorded():
    ran, events = [], []
    with cuda_on_cpu.intercept(1, 1, 2, events.append, mapping=False) as state:
        set_device = cuda_on_cpu._recording_set_device(state, ran.append)
        set_device(1)  # gpu-world
    assert ran == [1] and state.current == 1
    assert [(e["api"], e["index"], e["site"]["line"], e["mapped"]) for e in events] == [
        ("torch.cuda.set_device", 1, _line("gpu-world"), None)]


def test_a_cuda_call_that_cannot_run_on_a_cpu_names_its_line():
    told = []
    with cuda_on_cpu.intercept(0, 0, 1, told.append, mapping=True) as state:
        state.unmapped.append(told.append)
        with pytest.raises(cuda_on_cpu.CudaNotMappable) as raised:
            torch.cuda.get_device_properties(0)  # properties
        with pytest.raises(AssertionError):  # what code catching torch's own CUDA error catches
            torch.cuda.current_stream()
    assert f"test_cuda_on_cpu.py:{_line('properties')}" in str(raised.value)
    assert "torch.cuda.get_device_properties" in str(raised.value) and "GPU tier" in str(raised.value)
    unmapped = [ev for ev in told if ev.get("ev") == cuda_on_cpu.EV_UNMAPPED]
    assert unmapped[0]["site"]["line"] == _line("properties")


def _saved_on_gpu(path, tmp_path) -> str:
    """A checkpoint whose storages say they were saved on cuda:0 (torch.save's pickle, retagged)."""
    cpu = tmp_path / "cpu.pt"
    torch.save({"w": torch.ones(2)}, cpu)
    with zipfile.ZipFile(cpu) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(item, data)
    return str(path)


def test_torch_load_of_a_gpu_checkpoint_loads_onto_the_cpu_and_says_so(tmp_path):
    path = _saved_on_gpu(tmp_path / "gpu.pt", tmp_path)
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(path)  # what the user's code meets on a CPU-only torch without the plugin
    events = []
    with cuda_on_cpu.intercept(0, 0, 1, events.append, mapping=True):
        plain = torch.load(path)  # plain
        mapped = torch.load(path, map_location="cuda:0")  # mapped
    assert plain["w"].device.type == mapped["w"].device.type == "cpu"
    loads = {ev["site"]["line"]: ev for ev in events if ev["ev"] == cuda_on_cpu.EV_LOAD}
    assert loads[_line("plain")]["cuda"] is True and loads[_line("plain")]["map_location"] is None
    assert loads[_line("mapped")]["map_location"] == "'cuda:0'"
    assert any(ev["api"] == "torch.load(map_location)" and ev["index"] == 0 for ev in events
               if ev["ev"] == cuda_on_cpu.EV_CUDA)


def _train(steps: int = 3) -> tuple[list, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, losses = torch.randn(16, 4), []
    for _ in range(steps):
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    same = x.to(torch.float32)
    assert same is x  # a call that names no device keeps torch's own answer
    return losses, net[0].weight.detach().clone()


def test_code_that_names_no_cuda_sees_no_difference():
    plain_losses, plain_weight = _train()
    events = []
    with cuda_on_cpu.intercept(0, 0, 2, events.append, mapping=True):
        losses, weight = _train()
    assert losses == plain_losses and torch.equal(weight, plain_weight)
    assert events == []
