"""Which items a run creates on this machine, and what the report header says of the rest."""

from __future__ import annotations

from .availability import Availability
from .base import Variant
from .marks import MarkExpression
from .registry import get


def hidden_reason(variant: Variant, avail: Availability, require=(), markexpr: MarkExpression | None = None,
                  named_strategies=()) -> tuple[str, str] | None:
    """Whether the item of ``variant`` is left out of collection on this machine.

    Returns ``(tier, reason)``: a tier the variant needs cannot run here (``avail``) and the user
    neither requires it (``require``, the tiers of --ltconform-require: such an item is created and
    fails) nor asked for it (its marker named, not negated, in ``markexpr``; or, for a tier that is
    also a strategy, deepspeed, that strategy in ``named_strategies``, the ones given explicitly to
    --ltconform-strategies): such an item is created and skips with its reason. None: create the
    item (it can run, it is asked for or required, or ``markexpr`` deselects it anyway). Inside a
    launched world the multinode tier is decided later, once the ranks have agreed on the nodes.
    """
    if markexpr is not None and not markexpr.matches({"ltconform", *variant.markers}):
        return None  # pytest deselects it: nothing to hide
    missing = []
    for tier in variant.needs:
        if not get(tier).decided(avail):
            continue
        reason = avail.missing(tier)
        if reason:
            missing.append((tier, reason))
    if any(tier in require for tier, _ in missing):
        return None
    for tier, reason in missing:
        asked = (markexpr is not None and markexpr.names(get(tier).marker())) or \
            (tier == variant.strategy and tier in named_strategies)
        if not asked:
            return tier, reason
    return None


def not_run_line(tier: str, reason: str) -> str:
    """The report-header line for a tier whose items were left out: why, and how to run them."""
    hint = "" if "docs/ci.md" in reason else f" ({get(tier).enable_hint})"  # said once is enough
    return f"ltconform: {tier} tier not run: {reason}{hint}"
