"""The plugin's fixtures: ``ltconform_world`` (run a function on every rank of a world) and
``ltconform_target`` (the validated target of the session)."""

from __future__ import annotations

import pytest

from . import controller
from . import settings as settings_mod


class WorldHandle:
    """What ``ltconform_world(...)`` returns: ``run(fn, *args)`` on every rank of ``world`` (a
    ``world.World``: a local one from the session's pool, or the launched world pytest runs in)."""

    def __init__(self, world, timeout_s: float, timeout_name: str = "--ltconform-timeout"):
        self._world = world
        self.world_size = world.world_size
        self.timeout_s = timeout_s
        self.timeout_name = timeout_name  # named when a run is killed at the limit

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run ``fn(ctx, *args)`` on every rank; ``fn`` must be importable (module level).

        Returns the per-rank return values in rank order. Fails the test with every failed
        rank's traceback (rank-tagged) and the hang diagnosis when any rank raises, dies or hangs.
        """
        ref = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        if not isinstance(fn, str) and "<locals>" in fn.__qualname__:
            raise pytest.UsageError(f"ltconform_world.run: {fn.__qualname__} is a local function; ranks import "
                                    f"the function by name, so define it at module level.")
        from .world import JobRequest, WorldStartError

        limit, name = (timeout_s, "timeout_s") if timeout_s else (self.timeout_s, self.timeout_name)
        try:
            result = self._world.run(JobRequest(ref, args, timeout_s=limit, timeout_name=name))
        except WorldStartError as exc:  # the machine's, not the test's code: one line, no plugin traceback
            pytest.fail(f"ltconform_world.run({ref}): could not start a {self.world_size}-rank world: {exc}",
                        pytrace=False)
        if result.status == "skip":
            pytest.skip(result.ranks[0].message or "skipped inside the ranks")
        if result.status != "ok":
            failed = [str(r.rank) for r in result.ranks if r.status != "ok"]
            pytest.fail(f"ltconform_world.run({ref}) failed on rank(s) {', '.join(failed)} of a "
                        f"{result.world_size}-rank world:\n"
                        f"{result.failure_text()}", pytrace=False)
        return result.values


@pytest.fixture
def ltconform_world(request):
    """Factory fixture: ``ltconform_world(world_size=2).run(fn, *args)`` -> per-rank results.

    Worlds are persistent for the session (one cold start per world size); a world whose job
    failed is replaced on the next call.
    """
    config = request.config
    settings = config.stash.get(controller.SETTINGS_KEY, None) or settings_mod.Settings(target=None)

    attached = controller.attached_world(config)

    def make(world_size: int | None = None, timeout_s: float | None = None) -> WorldHandle:
        timeout = timeout_s or settings.timeout_s
        pg_timeout = settings_mod.pg_timeout_for(timeout)
        name = "timeout_s" if timeout_s else "--ltconform-timeout"
        if attached is not None:  # inside torchrun/SLURM: the launched world is the world
            if world_size not in (None, attached.world_size):
                pytest.skip(f"needs a world of {world_size} ranks; pytest is {attached.info.describe()}")
            return WorldHandle(attached, timeout, name)
        world = controller.pool(config).get(world_size or settings.world_size, pg_timeout_s=pg_timeout)
        return WorldHandle(world, timeout, name)

    return make


@pytest.fixture
def ltconform_target(request):
    """The validated target of this session (a ``pytest_ltconform.ResolvedTarget``); with several
    targets, the first (skips when no target is set). Under a ``-m`` that deselects every contract
    item it is validated when a test first asks for it."""
    targets = request.config.stash.get(controller.TARGETS_KEY, None)
    if targets is None and controller.deselected_line(request.config) is not None:
        targets = controller.target_on_demand(request.config)  # -m "not ltconform": validated by no one yet
    if targets is None:
        pytest.skip("no --ltconform target given")
    return targets
