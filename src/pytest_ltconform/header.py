"""The lines ``pytest_report_header`` adds: targets the run leaves unchecked, the launched world
pytest is a rank of, tiers that cannot run here, and the user's Trainer kwargs the runs replace."""

from __future__ import annotations

import pytest

from . import controller


def header_lines(config: pytest.Config) -> list[str] | None:
    """What ``pytest_report_header`` prints for ltconform; None when there is nothing to say."""
    lines = [config.stash[controller.UNSELECTED_KEY]] if controller.UNSELECTED_KEY in config.stash else []
    lines += [controller.deselected_line(config)] if controller.deselected_line(config) else []
    attached = controller.attached_world(config)
    if attached is not None:
        lines.append(f"ltconform: pytest is {attached.info.describe()} (Lightning {attached.info.environment}); "
                     f"contract runs happen in that world and this rank reports every rank's verdicts")
    if config.stash.get(controller.TARGETS_KEY, None) is not None:
        from . import tiers

        reasons = dict(controller.hidden(config).values())  # {tier: reason}: one line per tier, in item order
        lines += [tiers.not_run_line(tier, reason) for tier, reason in reasons.items()]
        lines += nodes_line(config, reasons)
        lines += overridden_line(config)
        lines.append(seeding_line(config.stash[controller.SETTINGS_KEY]))
    return lines or None


def seeding_line(settings) -> str:
    """How the ranks are seeded, with the seeds, so that a run can be repeated (--ltconform-seeding)."""
    return f"ltconform: seeding: {seeding_words(settings.seeding, settings.seed, settings.world_size)}"


def seeding_words(seeding: str, seed: int, world_size: int) -> str:
    """``both (each rank its own seed until ...)``: the seeding and the seeds each rank gets."""
    per_rank = ", ".join(f"rank {r}: {seed + r}" for r in range(min(world_size, 4))) + \
        (", ..." if world_size > 4 else "")
    if seeding == "same":
        return (f"same (random, numpy and torch seeded with {seed} on every rank, as after seed_everything({seed}); "
                f"--ltconform-seeding both|per-rank changes it)")
    if seeding == "per-rank":
        return (f"per-rank (random, numpy and torch seeded with {seed} + rank: {per_rank}; runs compared with a "
                f"one-rank reference, and the reference, with {seed}; --ltconform-seeding both|same changes it)")
    return (f"both (random, numpy and torch seeded with {seed} + rank ({per_rank}) until the fit's training starts, "
            f"then with {seed} on every rank unless your module seeds them itself; other runs seed every rank with "
            f"{seed}; --ltconform-seeding same|per-rank changes it)")
def nodes_line(config: pytest.Config, hidden_tiers: dict) -> list[str]:
    """The line saying what the nodes tier's items run in, when they run here."""
    settings = config.stash[controller.SETTINGS_KEY]
    nodes = settings.nodes
    if nodes is None or "nodes" in hidden_tiers or controller.attached_world(config) is not None:
        return []
    ranks = f"{nodes.ranks_per_node} rank{'s' if nodes.ranks_per_node != 1 else ''}"
    return [f"ltconform: [ddp-{nodes.nodes}nodes] items: a world of {nodes.nodes} nodes x {ranks} on this host "
            f"(marker ltconform_nodes; --ltconform-nodes 1 leaves them out): each rank has its node's NODE_RANK/"
            f"GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_WORLD_SIZE and its node's own temp storage; the "
            f"Trainer runs with num_nodes={nodes.nodes}, devices={nodes.ranks_per_node}"]


def overridden_line(config: pytest.Config) -> list[str]:
    """The header lines naming the user's Trainer kwargs that conformance runs replace (once,
    instead of in every item; per target, named, when there are several); none when nothing is
    replaced."""
    every = config.stash[controller.ALL_TARGETS_KEY]
    lines = []
    for tid, targets in every.items():
        said = _overridden(config, targets)
        if said:
            named = f"{tid}: " if len(every) > 1 else ""
            lines.append(f"ltconform: {named}your Trainer kwargs: {', '.join(said)}")
    return lines


def _overridden(config: pytest.Config, targets) -> list[str]:
    """What conformance runs replace of one target's Trainer kwargs."""
    if targets.trainer is None and targets.trainer_dict is None:
        return []
    from . import trainer_overrides
    from .target import loading as target_loading
    from .target import spec as target_spec

    try:
        user = target_loading.user_trainer_kwargs(targets)
    except target_spec.TargetError:
        return []  # validated at start-up; a factory that fails only now is the items' to report
    settings, attached = config.stash[controller.SETTINGS_KEY], controller.attached_world(config)
    avail = controller.availability(config)
    strategies = tuple(s for s in settings.strategies if s != "deepspeed" or not avail.missing(s))
    if attached is not None:
        said = trainer_overrides.overridden(user, attached.world_size, accelerator=attached.accelerator,
                                            num_nodes=None, strategies=strategies)
    else:
        said = trainer_overrides.overridden(user, settings.world_size, strategies=strategies)
        nodes = settings.nodes
        if nodes is not None and not avail.missing("nodes"):
            label = f"[ddp-{nodes.nodes}nodes]"
            on_nodes = trainer_overrides.overridden({k: v for k, v in user.items() if k in ("devices", "num_nodes")},
                                                    nodes.world_size, num_nodes=nodes.nodes, strategies=strategies)
            said += [f"{phrase} on the {label} items" for phrase in on_nodes]
    return said
