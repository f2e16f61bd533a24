"""Pure-Python units: hook alignment, rank guards, positions (no world needed)."""

from __future__ import annotations

from pytest_ltconform.contracts.base import rank_guard
from pytest_ltconform.world.diagnose import first_divergence, rank_position


def hook(i, name):
    return {"ev": "hook", "i": i, "name": name, "h": i, "epoch": 0, "step": 0}


def hook_exit(i):
    return {"ev": "hook_exit", "i": i, "h": i}


def save(h, seq=100):
    return {"ev": "call", "kind": "save", "label": "Trainer.save_checkpoint", "user": True, "h": h, "seq": seq,
            "site": {"file": "m.py", "line": 3, "func": "f"}}


def test_identical_ranks_do_not_diverge():
    t = [hook(1, "[Callback]A.on_train_epoch_end"), save(1), hook_exit(1)]
    assert first_divergence([t, list(t)]) is None


def test_one_sided_call_diverges_at_its_hook():
    r0 = [hook(1, "[LightningModule]M.training_step"), hook_exit(1), hook(2, "[Callback]A.on_train_epoch_end"),
          save(2), hook_exit(2)]
    r1 = [hook(1, "[LightningModule]M.training_step"), hook_exit(1), hook(2, "[Callback]A.on_train_epoch_end"),
          hook_exit(2), hook(3, "[LightningModule]M.training_step")]
    div = first_divergence([r0, r1])
    assert div["kind"] == "calls" and div["h"] == 2
    assert len(div["events"][0]) == 1 and div["events"][1] == []


def test_rank_still_inside_a_hook_is_not_a_divergence():
    r0 = [hook(1, "[Callback]A.on_train_epoch_end"), save(1)]          # still inside hook 1
    r1 = [hook(1, "[Callback]A.on_train_epoch_end"), save(1), {"ev": "call", "label": "x", "user": True, "h": 1,
                                                               "seq": 101}, hook_exit(1)]
    assert first_divergence([r0, r1]) is None


def test_different_hook_sequences_are_reported_as_hooks():
    r0 = [hook(1, "[LightningModule]M.training_step"), hook_exit(1)]
    r1 = [hook(1, "[Callback]A.on_train_epoch_end"), hook_exit(1)]
    assert first_divergence([r0, r1])["kind"] == "hooks"


def test_rank_guard_finds_the_guarding_if(tmp_path):
    src = tmp_path / "cb.py"
    src.write_text(
        "def on_end(trainer):\n"
        "    if trainer.global_rank == 0:\n"
        "        trainer.save_checkpoint('x')\n"
        "def early(self):\n"
        "    if self.global_rank != 0:\n"
        "        return\n"
        "    self.log('a', 1.0, sync_dist=True)\n"
        "def plain(self):\n"
        "    self.log('a', 1.0)\n"
    )
    assert rank_guard({"file": str(src), "line": 3}) == "if trainer.global_rank == 0:"
    assert rank_guard({"file": str(src), "line": 7}) == "if self.global_rank != 0: return"
    assert rank_guard({"file": str(src), "line": 9}) is None


def test_position_names_the_open_call_and_hook():
    trace = [hook(1, "[Callback]A.on_train_epoch_end"), save(1, seq=5),
             {"ev": "call", "label": "torch.distributed.barrier", "parent": 5, "seq": 6, "h": 1, "epoch": 0, "step": 4}]
    text = rank_position(trace)
    assert text.startswith("in torch.distributed.barrier from Trainer.save_checkpoint <- m.py:3 (f)")
    assert "inside A.on_train_epoch_end" in text and "epoch 0, global step 4" in text


def test_a_rank_killed_by_a_signal_is_named_with_the_signal():
    from pytest_ltconform.world.causes import exit_words

    assert exit_words(3) == "exit code 3"
    assert exit_words(-9).startswith("killed by SIGKILL (exit code -9; the kernel's out-of-memory killer")
    assert exit_words(-11) == "killed by SIGSEGV (exit code -11)"


def test_the_ddp_warning_the_plugins_own_flag_causes_is_not_the_users_output():
    from pytest_ltconform.world.outcome import without_own_noise

    tail = ("epoch 0\n[W reducer.cpp:1400] Warning: find_unused_parameters=True was specified in DDP constructor, "
            "but did not find any unused parameters in the forward pass.\nValueError: boom")
    assert without_own_noise(tail) == "epoch 0\nValueError: boom"


def test_a_rank_that_raised_in_its_step_is_placed_where_it_raised(tmp_path):
    # The trace records hooks, not every training_step call: the rank's own traceback places it.
    from pytest_ltconform.world.diagnose import _rank_place
    from pytest_ltconform.world.outcome import RankOutcome

    user = tmp_path / "model.py"
    tb = (f'Traceback (most recent call last):\n  File "{user}", line 52, in training_step\n'
          f'    raise KeyError("lost")\nKeyError: \'lost\'\n')
    trace = [hook(1, "[LightningModule]M.on_train_start"), hook_exit(1)]
    raised = RankOutcome(rank=1, status="error", exc_type="KeyError", message="'lost'", traceback=tb, trace=trace)
    assert _rank_place(raised) == f"raised KeyError at {user}:52 (training_step), epoch 0, global step 0"
    # A rank that did not raise keeps its traced position.
    assert _rank_place(RankOutcome(rank=0, status="hung", trace=trace)).startswith("between hooks")


def _dump(why, *entries):
    return {"ev": "collectives", "why": why, "frames": False,
            "entries": [{"pg": "0", "seq": seq, "is_p2p": False, "op": op, "sizes": sizes}
                        for seq, op, sizes in entries]}


def test_blocked_ranks_whose_collectives_differ_have_parted():
    """Issue 38 §5: a broadcast no tap names (trainer.log_dir on rank 0 alone) met by another
    collective on rank 1: both ranks blocked, their Flight Recorder entries differ at #36."""
    from pytest_ltconform.world.diagnose import collectives_parted

    hook = {"ev": "hook", "i": 1, "name": "[Callback]on_train_epoch_end", "h": 1}
    rank0 = [hook, _dump("blocked", (35, "broadcast", [[1]]), (36, "broadcast", [[77]]))]
    rank1 = [hook, _dump("blocked", (35, "broadcast", [[1]]), (36, "allreduce", [[1]]))]
    assert collectives_parted([rank0, rank1], [0, 1]) == ("0", 36)


def test_ranks_in_the_same_collective_or_not_blocked_have_not_parted():
    from pytest_ltconform.world.diagnose import collectives_parted

    same = [[_dump("blocked", (35, "allreduce", [[4]]))], [_dump("blocked", (35, "allreduce", [[4]]))]]
    assert collectives_parted(same, [0, 1]) is None
    # rank 1 recorded more since its dump (it is running, not blocked): not judged stuck yet
    moving = [[_dump("blocked", (35, "broadcast", [[1]]))],
              [_dump("blocked", (35, "allreduce", [[1]])), {"ev": "hook", "i": 2, "name": "x", "h": 2}]]
    assert collectives_parted(moving, [0, 1]) is None
    # a rank without any dump: nothing to compare
    assert collectives_parted([[_dump("blocked", (35, "broadcast", [[1]]))], []], [0]) is None
