"""unused-parameters: verdicts over recorded per-backward gradient use (fast), and one real world."""

from __future__ import annotations

import pytest
import torch  # at collection: a later in-process import after a test dropped torch's modules crashes
from conftest import case

from pytest_ltconform.contracts import get_contract
from pytest_ltconform.contracts.unused_parameters import probe as rank_probe

NAMES = ["enc.weight", "enc.bias", "aux.weight", "aux.bias"]
SITE = {"file": "/x/model.py", "line": 40, "func": "Model.training_step"}


def _traces(per_rank_events, user_flag=False):
    """Each rank's trace: the gradient set-up events the probe records first, then that rank's events."""
    return [[{"ev": "grad_config", "user_find_unused": user_flag, "forced": not user_flag},
             {"ev": "grad_setup", "names": NAMES, "ddp": True, "find_unused": True}] + events
            for events in per_rank_events]


def _backward(batch, unused=(), k=1, epoch=0, **extra):
    return {"ev": "grad_use", "n": batch, "k": k, "batch": batch, "epoch": epoch, "unused": list(unused),
            "site": extra.pop("site", None), **extra}


def judge(run):
    return get_contract("unused-parameters").judge(run)


def test_all_used_with_default_flag_passes(fake_runs):
    v = judge(fake_runs.run(_traces([[_backward(b) for b in range(4)]] * 2)))
    assert v.outcome == "passed"
    assert "4 trainable parameters" in v.summary


def test_flag_on_with_nothing_unused_is_a_waste_advisory(fake_runs):
    v = judge(fake_runs.run(_traces([[_backward(b) for b in range(4)]] * 2, user_flag=True)))
    assert v.outcome == "advisory" and v.category == "waste" and v.failed
    text = v.render()
    assert "not a correctness bug" in text and "remove the flag" in text


def test_never_used_parameters_fail_with_names_steps_and_freeze_fix(fake_runs):
    events = [_backward(b, ["aux.weight", "aux.bias"], no_grad=["aux"], not_run=[], off=[]) for b in range(4)]
    v = judge(fake_runs.run(_traces([events, events])))
    assert v.outcome == "failed"
    text = v.render()
    assert "aux.weight, aux.bias" in text and "any backward pass" in text
    assert "ran only under torch.no_grad()" in text
    assert "epoch 0 batch 0, epoch 0 batch 1" in text
    assert "requires_grad_(False)" in v.fix
    assert "find_unused_parameters=False" in v.summary


def test_alternating_backwards_name_each_backward_and_the_dynamic_fix(fake_runs):
    events = []
    for b in range(3):
        events.append(_backward(b, ["aux.weight", "aux.bias"], k=1, off=["aux.weight", "aux.bias"], site=SITE))
        events.append(_backward(b, ["enc.weight", "enc.bias"], k=2, off=[], not_run=["enc"],
                                site=dict(SITE, line=47)))
    v = judge(fake_runs.run(_traces([events, events])))
    assert v.outcome == "failed"
    text = v.render()
    assert "backward 1 of each training step" in text and "backward 2 of each training step" in text
    assert "model.py:40" in text and "model.py:47" in text
    assert "ddp_find_unused_parameters_true" in v.fix
    assert "requires_grad_(False)" not in v.fix


def test_backwards_outside_manual_backward_are_not_said_to_raise_and_rest_on_their_record(fake_runs):
    """A loss.backward() of the user's own under manual optimization: DDP's reducer was never
    prepared for it (only manual_backward prepares it), so no 'Expected to have finished reduction'."""
    from pytest_ltconform import claims

    events = [_backward(b, ["aux.weight", "aux.bias"], not_run=[], off=[], outside=True, manual=True)
              for b in range(4)]
    v = judge(fake_runs.run(_traces([events, events])))
    record = dict(v.as_dict(), contract="unused-parameters")
    assert v.outcome == "failed" and "aux.weight, aux.bias" in v.render()
    assert "Expected to have finished reduction" not in v.render() and "DDP waits for" not in v.render()
    assert "ran outside Lightning's manual_backward" in v.summary and "self.manual_backward(loss)" in v.fix
    assert claims.check(record) == []
    bare = dict(record, claims=[c for c in record["claims"] if c["kind"] != "unprepared-backward"])
    assert any(p.startswith("unprepared-backward") for p in claims.check(bare))
    automatic = [dict(e, manual=False) for e in events]  # outside, but automatic: the reducer sentence stays
    assert "Expected to have finished reduction" in judge(fake_runs.run(_traces([automatic] * 2))).render()


def test_dynamic_usage_with_flag_on_passes(fake_runs):
    events = [_backward(b, ["aux.weight", "aux.bias"] if b % 2 else []) for b in range(4)]
    v = judge(fake_runs.run(_traces([events, events], user_flag=True)))
    assert v.outcome == "passed"
    assert "dynamic usage" in v.summary


def test_ddp_reducer_indices_are_mapped_to_names(fake_runs):
    message = ("Expected to have finished reduction in the prior iteration before starting a new one. "
               "Parameter indices which did not receive grad for rank 0: 2 3")
    trace_extra = [{"ev": "ddp_error", "message": message}]
    v = judge(fake_runs.failed(_traces([trace_extra, trace_extra]), messages={0: message, 1: message}))
    assert v.outcome == "failed"
    assert "aux.weight, aux.bias" in v.render()
    assert "Parameter indices which did not receive grad for rank 0: 2 3" in v.render()


@pytest.mark.slow
def test_registered_block_never_called_fails_in_a_real_world(pytester, no_leftover_ranks):
    target = case("unused-parameters/registered_block_never_called.py")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", target,
                                           "-k", "unused-parameters[ and not gpu and not multinode", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "attention.in_proj_weight" in out and "never ran in forward" in out
    assert "find_unused_parameters=False" in out


class _SkipsBadBatches:
    def training_step(self, batch, batch_idx):
        def helper():
            return None  # a nested function's return is not the step's

        if batch is None:
            return None
        return helper


def test_none_return_site_is_the_steps_own_return_none_line():
    import inspect

    from pytest_ltconform.contracts.unused_parameters.probe import none_return_site

    lines, start = inspect.getsourcelines(_SkipsBadBatches.training_step)
    expected = start + next(i for i, ln in enumerate(lines) if ln.strip() == "return None")
    site = none_return_site(_SkipsBadBatches)
    assert site["line"] == expected and site["also"] == [] and site["func"] == "_SkipsBadBatches.training_step"


_NONE_SITE = {"file": "/x/model.py", "line": 36, "func": "Model.training_step", "also": []}


def test_training_step_none_on_one_rank_fails_with_its_line_and_both_ranks(fake_runs):
    from pytest_ltconform.contracts.base import Blame

    traces = _traces([[_backward(0), _backward(1)],
                      [_backward(0), {"ev": "step_none", "epoch": 0, "batch": 1, "site": _NONE_SITE}]])
    run = fake_runs.failed(traces, messages={
        0: "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:23952",
        1: "Skipping the `training_step` by returning None in distributed training is not supported. It is ..."})
    assert get_contract("unused-parameters").blames(run) == Blame.CALL
    v = judge(run)
    assert v.outcome == "failed", v.render()
    assert v.summary == (
        "training_step returned None on rank 1 only (epoch 0, batch 1, at /x/model.py:36 (Model.training_step)): "
        "Lightning skips backward for that batch on that rank, so DDP's gradient all-reduce runs on rank 0 alone and "
        "pairs with nothing (the world hangs, or gradients of different steps are averaged); Lightning refuses a "
        "skipped training_step in distributed training and stopped the run.")
    assert [(e.rank, e.site) for e in v.evidence] == [(1, "/x/model.py:36 (Model.training_step)"), (0, None)]
    assert "with no partner on rank 1; it then failed in a collective whose peer had gone" in v.evidence[1].detail
    assert "mask the unusable samples out of the loss" in v.fix


def test_training_step_none_on_every_rank_fails_too(fake_runs):
    none = {"ev": "step_none", "epoch": 1, "batch": 0, "site": _NONE_SITE}
    v = judge(fake_runs.run(_traces([[_backward(0), dict(none)], [_backward(0), dict(none)]])))
    assert v.outcome == "failed", v.render()
    assert v.summary.startswith("training_step returned None on every rank (epoch 1, batch 0, at /x/model.py:36")
    assert [e.rank for e in v.evidence] == [0, 1]


@pytest.mark.slow
def test_training_step_none_on_one_rank_is_blamed_in_a_real_world(pytester, no_leftover_ranks):
    import inspect
    import runpy

    path = case("unused-parameters/training_step_none_on_one_rank.py").rsplit(":", 1)[0]
    step = runpy.run_path(path)["Model"].training_step
    lines, start = inspect.getsourcelines(step)
    line = start + next(i for i, ln in enumerate(lines) if ln.strip().startswith("return None"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", case(
        "unused-parameters/training_step_none_on_one_rank.py"), "--ltconform-strategies", "ddp",
        "-k", "unused-parameters[", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "unused-parameters[ddp]: training_step returned None on rank" in out
    assert f"training_step_none_on_one_rank.py:{line} (Model.training_step)" in out
    assert "did not skip epoch 0, batch" in out  # the other rank's evidence


@pytest.mark.slow
def test_manual_optimization_returning_none_is_not_a_skipped_step(pytester, no_leftover_ranks):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", case(
        "unused-parameters/ok_manual_optimization_single_backward.py"), "--ltconform-strategies", "ddp",
        "-k", "unused-parameters[", "-v")
    result.assert_outcomes(passed=1)
    assert "training_step returned None" not in result.stdout.str()


# -- a module ran when its parameters were used; where requires_grad was switched off ---------------

def _switch_event(batch, usage, off_at):
    return _backward(batch, ["aux.weight", "aux.bias"], off=["aux.weight", "aux.bias"], not_run=[], no_grad=[],
                     usage=usage, off_at=off_at)


def test_a_module_called_by_forward_is_not_said_never_to_have_run_and_the_switch_is_named(fake_runs):
    """`self.aux.forward(x)` fires no hook but uses the parameters; the module's own hook switched
    requires_grad off at a line of the user's: that line is named, Lightning is not guessed."""
    from pytest_ltconform import claims

    hook = {"file": "/x/model.py", "line": 51, "func": "Model.on_train_batch_start"}
    usage = {"aux": {"used": True, "grad": True, "hooks": False}}
    off_at = {"aux.weight": {"site": hook, "via": "Module.requires_grad_"},
              "aux.bias": {"site": hook, "via": "Module.requires_grad_"}}
    events = [_switch_event(b, usage, off_at) for b in range(2)] + [_backward(b) for b in range(2, 4)]
    v = judge(fake_runs.run(_traces([events, events])))
    text = v.render()
    assert v.outcome == "failed", text
    assert ("requires_grad was switched off for all of them at /x/model.py:51 (Model.on_train_batch_start) "
            "(through Module.requires_grad_)") in text
    assert "never ran" not in text and "toggle_optimizer" not in text
    assert claims.check({"contract": "unused-parameters", **v.as_dict()}) == []
    # The sentences before the fix, over the same recorded facts, are not borne out.
    old = {"contract": "unused-parameters", "message": "aux never ran in forward; requires_grad was switched off for "
           "all of them at that moment (toggle_optimizer or similar)", "claims": []}
    assert {p.split(":")[0] for p in claims.check(old)} == {"not-run", "switched-off"}


def test_a_switch_with_no_recorded_site_is_said_unknown(fake_runs):
    from pytest_ltconform import claims

    events = [_switch_event(b, {"aux": {"used": True, "grad": True, "hooks": True}}, {}) for b in range(4)]
    v = judge(fake_runs.run(_traces([events, events])))
    assert "requires_grad was switched off for all of them before this backward (where was not recorded)" in v.render()
    assert claims.check({"contract": "unused-parameters", **v.as_dict()}) == []


def test_an_unused_layer_is_located_where_the_users_code_built_it(fake_runs):
    built = {"aux.weight": {"file": "/x/model.py", "line": 12, "func": "Encoder.__init__"},
             "aux.bias": {"file": "/x/model.py", "line": 12, "func": "Encoder.__init__"}}
    traces = _traces([[_backward(b, ["aux.weight", "aux.bias"]) for b in range(4)]] * 2)
    for t in traces:
        t[1]["built"] = built
    v = judge(fake_runs.run(traces))
    located = [e for e in v.evidence if e.detail == "aux.weight, aux.bias built here"]
    assert [e.site for e in located] == ["/x/model.py:12 (Encoder.__init__)"], v.render()


class _Patcher:
    """The recorder's patch/uninstall, for the rank-side taps run in this process."""

    def __init__(self):
        self.undo = []

    def patch(self, owner, name, factory, inherited=False):
        own = owner.__dict__.get(name)
        setattr(owner, name, factory(getattr(owner, name)))
        self.undo.append((owner, name, own))

    def uninstall(self):
        for owner, name, own in reversed(self.undo):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def test_the_probe_records_parameter_use_without_hooks_and_the_switchs_site():
    import sys

    probe = rank_probe
    patcher = _Patcher()
    observer = probe._Observer(recorder=None)
    sites = {}
    try:
        probe._watch_requires_grad(patcher, observer)
        head, body = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        for name, mod in (("head", head), ("body", body)):
            for pname, p in mod.named_parameters():
                observer.ids[id(p)], observer.params[f"{name}.{pname}"] = f"{name}.{pname}", p
                observer.owner[f"{name}.{pname}"] = name
        step = probe._with_param_use(lambda x: head.forward(body(x)).sum(), observer)
        step(torch.randn(2, 3))
        line = sys._getframe().f_lineno + 1
        head.requires_grad_(False)
        sites = dict(observer.switched)
        assert observer.watching
        usage = observer._usage(["head", "body"])
    finally:
        patcher.uninstall()
    assert usage["head"] == {"used": True, "grad": True, "hooks": False}  # forward() bypassed the hooks
    switched = sites[id(head.weight)]
    assert switched["via"] == "Module.requires_grad_" and switched["site"]["line"] == line
    assert "requires_grad" not in torch.nn.Parameter.__dict__  # the watch is gone after the run


PLAIN_BACKWARD = """
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Linear(4, 1)
        self.extra = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        out = self.net(x).squeeze(1)
        if USE:  # 0: self.extra never runs, so its parameters get no gradient
            out = out + self.extra(x).squeeze(1)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


@pytest.mark.parametrize("use", [1, 0])
def test_a_plain_loss_backward_of_the_users_own_is_recorded_as_a_backward(pytester, no_leftover_ranks, use):
    """Issue 32 field trial: a manual-optimization step calling ``loss.backward()`` itself (not
    manual_backward) got "no backward pass was recorded"; it is a backward pass, judged by its gradients."""
    pytester.makepyfile(plain_case=PLAIN_BACKWARD.replace("USE", str(use)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "plain_case.py:Model",
                                           "--ltconform-strategies", "ddp", "-k", "unused-parameters[", "-rA")
    out = result.stdout.str()
    assert "no backward pass was recorded" not in out
    if use:
        result.assert_outcomes(passed=1)
        line = PLAIN_BACKWARD.strip().splitlines().index("        loss.backward()") + 1
        assert "ran outside Lightning's backward" in out and f"plain_case.py:{line} (Model.training_step)" in out
    else:
        result.assert_outcomes(failed=1)
        assert "extra.weight, extra.bias" in out and "find_unused_parameters=False" in out
        assert "Expected to have finished reduction" not in out  # the reducer was never prepared: no error
    # Lightning's DDP turns DDP's own reducer preparation off under manual optimization; only
    # manual_backward prepares it, so these backward passes are not averaged over the ranks.
    assert "ran outside Lightning's manual_backward" in out and "self.manual_backward(loss)" in out
