"""What an item's verdict can be, as named values instead of strings parsed back.

Pure data, importable by every layer (no torch, no pytest). The JSON report and pytest keep their
five words ('passed', 'failed', 'advisory', 'skipped', 'error'): an item not judged is reported
as skipped, its summary starting with :data:`NOT_JUDGED_PREFIX`, so readers of the report see what
they saw before. :meth:`Outcome.read` is the one place that spelling is read back.
"""

from __future__ import annotations

import dataclasses
import enum

# How a not-judged verdict's summary starts, in the report and on the terminal.
NOT_JUDGED_PREFIX = "not judged: "


class Outcome(enum.StrEnum):
    """The outcome of one item (docs/design.md, "What crosses each boundary")."""

    PASSED = "passed"
    FAILED = "failed"
    ADVISORY = "advisory"  # waste that breaks nothing: reported, the item passes
    NOT_JUDGED = "not_judged"  # a premise does not hold, or another item's failure stopped the run
    SKIPPED = "skipped"  # the tier or strategy does not apply
    ERROR = "error"  # the run could not be judged (the user's code stopped it, or no world started)

    @property
    def finding(self) -> bool:
        """Whether the verdict found something against the rule: a failure or an advisory."""
        return self in (Outcome.FAILED, Outcome.ADVISORY)

    @property
    def skips(self) -> bool:
        """Whether pytest reports the item as skipped."""
        return self in (Outcome.SKIPPED, Outcome.NOT_JUDGED)

    @property
    def head(self) -> str:
        """The word a verdict's first line gives it (``[contract] FAILED: ...``): FAILED, ADVISORY,
        NOT JUDGED (an error: the run could not be judged), passed, skipped (a not-judged line
        gives its reason instead)."""
        return _HEADS[self]

    @property
    def reported(self) -> str:
        """The word the JSON report and pytest use: a not-judged item is reported as skipped."""
        return Outcome.SKIPPED.value if self is Outcome.NOT_JUDGED else self.value

    @classmethod
    def read(cls, outcome: str, summary: str = "") -> Outcome:
        """The outcome of a report record (or of a verdict written as today's strings): 'skipped'
        with a summary that starts with :data:`NOT_JUDGED_PREFIX` is :attr:`NOT_JUDGED`."""
        value = cls(outcome)
        if value is cls.SKIPPED and summary.startswith(NOT_JUDGED_PREFIX):
            return cls.NOT_JUDGED
        return value


_HEADS = {Outcome.FAILED: "FAILED", Outcome.ADVISORY: "ADVISORY", Outcome.ERROR: "NOT JUDGED",
          Outcome.PASSED: "passed", Outcome.SKIPPED: "skipped", Outcome.NOT_JUDGED: "skipped"}


@dataclasses.dataclass(frozen=True)
class NotJudged:
    """Why an item was not judged: the ``reason`` (one line, without the prefix) and, when another
    item's failure or hang left it unjudged, that item (``depends_on``, e.g. ``fit[ddp]``)."""

    reason: str
    depends_on: str | None = None
