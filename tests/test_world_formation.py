"""Forming a job's process group in a reused world: never a failure the plugin's own runs cause.

Each test starts its worlds inside a pytest subprocess, so a hung or killed world can never take
this session down.
"""

from __future__ import annotations

import pytest
from conftest import BORING

pytest_plugins = ["pytester"]

SHORT_JOBS = '''
import os
import subprocess
import sys

from pytest_ltconform.world import JobRequest, LocalWorld

JOBS = int(os.environ.get("SHORT_JOBS", "5"))
TORCH = ("torch.distributed",)  # what the fork parent imports: these worlds never need Lightning
BURNERS = int(os.environ.get("SHORT_JOBS_BURNERS", "0"))


def rank_of(ctx):
    return ctx.rank  # as short as a job gets: no collective at all


def peers_formed(ctx, n):
    from pytest_ltconform.world import protocol

    gen = int(os.environ[protocol.GENERATION_ENV])
    return ctx.store.check(protocol.formed_keys(gen, n, ctx.world_size))


def test_back_to_back_short_jobs():
    # Busy loops beside the world: the race showed under a CPU load of about 6.
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    world = LocalWorld(2, preload=TORCH)
    failed = []
    try:
        for i in range(JOBS):
            result = world.run(JobRequest("test_short_jobs:rank_of", timeout_s=120))
            if result.values != [0, 1]:
                failed.append((i, [(o.status, o.message) for o in result.ranks]))
    finally:
        for b in burners:
            b.kill()
            b.wait()
        world.close()
    assert failed == []
    assert world.cold_starts == 1


def test_no_rank_starts_a_job_before_every_rank_formed_its_group():
    world = LocalWorld(2, preload=TORCH)
    try:
        for n in range(JOBS):
            assert world.run(JobRequest("test_short_jobs:peers_formed", (n,), timeout_s=120)).values == [True, True]
    finally:
        world.close()


def test_a_fresh_world_per_job_pays_one_cold_start_per_job():
    world = LocalWorld(2, preload=TORCH, fresh_per_job=True)
    try:
        values = [world.run(JobRequest("test_short_jobs:rank_of", timeout_s=120)).values for _ in range(2)]
    finally:
        world.close()
    assert values == [[0, 1], [0, 1]] and world.cold_starts == 2
'''


def test_a_job_starts_only_once_every_rank_formed_its_group(pytester):
    """A rank that finished a short job and destroyed its group used to close the socket under a
    peer still inside gloo's rendezvous: each job's code now starts after every rank's group formed."""
    pytester.makepyfile(test_short_jobs=SHORT_JOBS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "formed")
    result.assert_outcomes(passed=1)


def test_a_fresh_world_per_job_is_one_world_started_again_for_each_job(pytester):
    """LTCONFORM_FRESH_WORLDS=1 (the benchmark of reuse): the world's ranks are stopped after each job."""
    pytester.makepyfile(test_short_jobs=SHORT_JOBS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fresh_world")
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_hundreds_of_back_to_back_short_jobs_under_load_never_fail(pytester, monkeypatch):
    """300 jobs without a collective in one world beside 3 busy loops: before the fix about 1 in
    15 failed with 'Gloo connectFullMesh failed ... Connection closed by peer'."""
    monkeypatch.setenv("SHORT_JOBS", "300")
    monkeypatch.setenv("SHORT_JOBS_BURNERS", "3")
    pytester.makepyfile(test_short_jobs=SHORT_JOBS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "back_to_back")
    result.assert_outcomes(passed=1)


FORMATION = '''
import pytest

from pytest_ltconform.world import JobRequest, LocalWorld, WorldStartError

NO_SUCH_INTERFACE = {"GLOO_SOCKET_IFNAME": "ltconform-no-such-if"}  # gloo cannot form a group on it
TORCH = ("torch.distributed",)  # what the fork parent imports: these worlds never need Lightning


def rank_of(ctx):
    return ctx.rank


class FirstWorldCannotForm(LocalWorld):
    """The first generation of ranks fails inside gloo's init_process_group; later ones do not."""

    def _rank_env(self, rank):
        env = super()._rank_env(rank)
        if self.generation == 0:
            env.update(NO_SUCH_INTERFACE)
        return env


def test_a_world_that_did_not_form_is_started_once_more():
    world = FirstWorldCannotForm(2, preload=TORCH)
    try:
        assert world.run(JobRequest("test_formation:rank_of", timeout_s=120)).values == [0, 1]
    finally:
        world.close()
    assert world.cold_starts == 2


def test_a_world_that_never_forms_says_why_and_runs_nothing():
    world = LocalWorld(2, preload=TORCH, env=NO_SUCH_INTERFACE)
    try:
        with pytest.raises(WorldStartError) as info:
            world.run(JobRequest("test_formation:rank_of", timeout_s=120))
    finally:
        world.close()
    assert world.cold_starts == 2
    message = str(info.value)
    assert "did not form, in two fresh worlds, before the job's code ran" in message, message
    assert "rank(s) 0, 1 raised RuntimeError" in message and "ltconform-no-such-if" in message, message
'''


def test_world_formation_failures_are_retried_once_then_named(pytester):
    """A real gloo failure inside init_process_group: a fresh world is started once; a world that
    fails twice raises WorldStartError with what the ranks said, and no job code ran."""
    pytester.makepyfile(test_formation=FORMATION)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_an_item_whose_world_never_forms_says_so_not_that_the_code_stopped(pytester, monkeypatch,
                                                                           no_leftover_ranks):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ltconform-no-such-if")
    result = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp",
                                           "--ltconform-nodes", "1", "-k", "sync-dist",
                                           "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "could not start a world: the process group of a world of 2 gloo ranks did not form" in out, out[-3000:]
    assert "ltconform-no-such-if" in out and "stopped in your code" not in out, out[-3000:]


def test_the_world_fixture_says_when_its_world_never_forms(pytester, monkeypatch, no_leftover_ranks):
    # A test using ltconform_world fails with one line naming the world, not the plugin's traceback.
    pytester.makepyfile(test_fixture_world='''
def rank_of(ctx):
    return ctx.rank


def test_ranks(ltconform_world):
    ltconform_world(2).run(rank_of)
''')
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ltconform-no-such-if")
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch")  # machinery: its ranks need no Lightning
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "ltconform_world.run(test_fixture_world:rank_of): could not start a 2-rank world: " in out, out[-3000:]
    assert "did not form, in two fresh worlds" in out and "Traceback" not in out, out[-3000:]
