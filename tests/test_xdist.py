"""pytest-xdist as users run it (``pytest -n N --ltconform X``): what the workers of
one session share (the session folder, ``world.share``).
"""

from __future__ import annotations

import os
import threading
import time

import pytest


# -- the session folder (world.share), no world ----------------------------------------------------
def test_a_value_is_made_once_across_the_workers_and_a_failed_making_leaves_it_unmade(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    first, second = SessionShare(str(tmp_path), os.getpid()), SessionShare(str(tmp_path), os.getpid())
    made = []
    assert second.peek("run") == (False, None)
    with pytest.raises(RuntimeError):
        first.once("run", lambda: (_ for _ in ()).throw(RuntimeError("the maker died")))
    assert second.peek("run") == (False, None)  # not made: the next asker makes it
    assert first.once("run", lambda: made.append("first") or {"by": "first"}) == {"by": "first"}
    assert second.once("run", lambda: made.append("second") or {"by": "second"}) == {"by": "first"}
    assert made == ["first"] and second.peek("run") == (True, {"by": "first"})
    assert second.names("ru") == ["run"] and second.names("other") == []


def test_a_worker_asking_while_another_makes_the_value_waits_for_it(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    first, second = SessionShare(str(tmp_path), os.getpid()), SessionShare(str(tmp_path), os.getpid())
    started, order = threading.Event(), []

    def slow():
        started.set()
        time.sleep(0.3)
        order.append("made")
        return 1

    maker = threading.Thread(target=lambda: first.once("run", slow))
    maker.start()
    started.wait(10)
    got = second.once("run", lambda: order.append("made twice") or 2)
    order.append("read")
    maker.join(10)
    assert (got, order) == (1, ["made", "read"])


def test_world_slots_bound_the_worlds_running_at_once(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    share = SessionShare(str(tmp_path), os.getpid())
    order = []
    with share.slot(1):
        waiter = threading.Thread(target=lambda: _take(share, order))
        waiter.start()
        time.sleep(0.3)  # time for the waiter to take the slot, were it free
        order.append("released")
    waiter.join(10)
    assert order == ["released", "taken"]
    with share.slot(2), share.slot(2):  # two slots: two holders at once
        order.append("both")
    assert order[-1] == "both"


def _take(share, order):
    with share.slot(1):
        order.append("taken")
