"""The generated items: one per (contract, variant) of each target, and the run items that
several contract items share; their setup, verdict, failure text and report shaping."""

from __future__ import annotations

import json
import time

import pytest

from . import controller
from .outcomes import Outcome


class VerdictRaised(Exception):
    """Raised by an item whose verdict pytest reports as a failure (the contract failed) or, from
    setup, as an error (the run could not be judged); carries the verdict's dict."""

    def __init__(self, verdict_dict: dict):
        super().__init__(verdict_dict["summary"])
        self.verdict = verdict_dict


class LtconformItem(pytest.Item):
    """One (contract, variant) check on one target (``target_id``); the variant (tiers.Variant)
    names the tier, the strategy and the world."""

    def __init__(self, *, contract_id: str, strategy: str, variant=None, target_id: str = "", **kwargs):
        super().__init__(**kwargs)
        self.target_id = target_id
        self.contract_id = contract_id
        self.strategy = strategy
        self.variant = variant
        self.tier = variant.tier if variant is not None else "cpu"
        self.verdict_dict: dict | None = None
        self.required_missing: str | None = None

    def _tier_check(self) -> bool:
        """Skip (or, for a tier in --ltconform-require, fail) when the tier cannot run here."""
        if self.variant is None:
            return True
        avail = controller.availability(self.config)
        require = self.config.stash[controller.SETTINGS_KEY].require
        for tier in self.variant.needs:
            reason = avail.missing(tier)
            if reason and tier in require:
                self.required_missing = (f"--ltconform-require {tier}: the {tier} tier cannot run here: {reason}. "
                                         f"The item fails instead of skipping so that a runner without that "
                                         f"hardware cannot pass silently.")
                self._record({**unavailable(self.required_missing), "outcome": Outcome.FAILED}, 0.0)
                return False
        first = avail.first_missing(self.variant)
        if first:
            self._record(unavailable(first[1]), 0.0)
            pytest.skip(first[1])
        return True

    def _record(self, verdict_dict: dict, duration: float) -> None:
        """Carry this item's report record on its pytest reports (see report.from_report)."""
        from . import report, tiers

        attached = controller.attached_world(self.config)
        launched = not tiers.get(self.tier).local and attached is not None  # the launched world's own size
        settings = self.config.stash[controller.SETTINGS_KEY]
        layout = tiers.get(self.tier).layout(settings.world_size, settings.nodes)
        world_size = attached.world_size if launched else layout.world_size if layout else settings.world_size
        rec = report.record(self.contract_id, self.variant.label if self.variant else self.strategy, world_size,
                            verdict_dict, duration, target=self.target_id)
        self.user_properties.append((report.PROPERTY, json.dumps(rec)))

    def setup(self) -> None:
        if not self._tier_check():
            return
        session = controller.session_for(self.config, self.target_id)
        verdict, duration = session.verdict(self.contract_id, self.strategy, self.tier)
        self.verdict_dict = verdict.as_dict()
        self._record(self.verdict_dict, duration)
        if verdict.outcome.skips:
            pytest.skip(verdict.summary)
        if verdict.outcome is Outcome.ERROR:
            raise VerdictRaised(self.verdict_dict)

    def runtest(self) -> None:
        if self.required_missing:
            pytest.fail(self.required_missing, pytrace=False)
        # An advisory (waste that breaks nothing) is reported, not failed: the item passes.
        if self.verdict_dict and self.verdict_dict["outcome"] == Outcome.FAILED:
            raise VerdictRaised(self.verdict_dict)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, VerdictRaised):
            return failure_repr(excinfo.value.verdict["message"], self.reportinfo())
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        # The module's class definition: -vv prints its file after the id.
        targets = self.config.stash.get(controller.ALL_TARGETS_KEY, {}).get(self.target_id)
        source = getattr(targets, "model_source", None)
        if source and source[0]:
            return source[0], source[1] - 1, f"ltconform {self.target_id}::{self.name}"
        return self.path, None, f"ltconform {self.target_id}::{self.name}"


class RunFailed(Exception):
    """Raised by a run item whose run a rank's own failure stopped; carries the text."""


class LtconformRunItem(pytest.Item):
    """The run ``kind`` (e.g. the traced fit) of one target under one variant, shared by the
    contract items after it: a user's exception that stops the run is reported here, once, and
    those items are not judged and point here (docs/internals.md, "When a world does not finish"). It
    passes when the run
    finished, or stopped because of a contract's failure (that contract's item fails)."""

    def __init__(self, *, kind: str, contract_id: str, variant, target_id: str, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.variant, self.target_id = kind, variant, target_id
        self.contract_id = contract_id  # the first contract item after it that needs the run
        self.summary = ""

    def setup(self) -> None:
        first = controller.availability(self.config).first_missing(self.variant)
        if first:
            pytest.skip(first[1])

    def runtest(self) -> None:
        from . import report
        from .world import WorldStartError

        started = time.monotonic()
        session = controller.session_for(self.config, self.target_id)
        no_world, claims = False, ()
        try:
            outcome, text, claims = session.run_failure(self.contract_id, self.variant.strategy, self.variant.tier,
                                                        self.name)
        except WorldStartError as exc:
            outcome, text, no_world = Outcome.ERROR, f"[{self.name}] could not start a world: {exc}", True
        summary = text.splitlines()[0].removeprefix(f"[{self.name}] ")
        # The report says what pytest says: a run the user's code stopped FAILED; a world that never
        # started is recorded as an error (not judged: the machine's, not the user's).
        recorded = Outcome.FAILED if outcome == Outcome.ERROR and not no_world else outcome
        # Its record carries the run's time (the contract items after it only judge).
        from . import tiers

        settings = self.config.stash[controller.SETTINGS_KEY]
        layout = tiers.get(self.variant.tier).layout(settings.world_size, settings.nodes)
        rec = report.record(self.kind, self.variant.label, layout.world_size if layout else settings.world_size,
                            {"outcome": recorded, "message": text, "summary": summary,
                             "category": "crash" if outcome == Outcome.ERROR else None,
                             "claims": [c.as_dict() for c in claims]},  # what its sentences rest on
                            time.monotonic() - started, target=self.target_id)
        self.user_properties.append((report.PROPERTY, json.dumps({**rec, "run": True})))
        self.summary = summary  # what -rA prints after "PASSED <id> - "
        if outcome == Outcome.SKIPPED:
            pytest.skip(text)
        if outcome == Outcome.ERROR:
            raise RunFailed(text)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, RunFailed):
            return failure_repr(str(excinfo.value), self.reportinfo())
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"ltconform {self.target_id}::{self.name}"


class RunItems:
    """Adds, after -k and -m deselected, one run item before the first selected contract item of
    each run that several selected items share (the traced fit): one place for a failure of the
    run itself. A run that one item needs is reported on that item, as before."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config, items: list) -> None:
        if config.stash.get(controller.ALL_TARGETS_KEY, None) is None:
            return
        from . import contracts, tiers

        users: dict = {}  # (target id, variant label, kind) -> [index of each contract item needing it]
        for n, item in enumerate(items):
            if isinstance(item, LtconformItem) and item.variant is not None:
                kind = contracts.get_contract(item.contract_id).run_spec.name
                users.setdefault((item.target_id, item.variant.label, kind), []).append(n)
        added, avail = {}, controller.availability(config)
        for (tid, _label, kind), where in users.items():
            # A tier that cannot run here skips (or fails) each of its items with the reason: no run.
            # A launched world's tier (multinode) is decided once its ranks agreed on the collection.
            variant = items[where[0]].variant
            if len(where) > 1 and tiers.get(variant.tier).local and not avail.first_missing(variant):
                added[where[0]] = _run_item(session, tid, kind, items[where[0]].contract_id, variant)
        if not added:
            return
        items[:] = [x for n, item in enumerate(items) for x in ((added[n], item) if n in added else (item,))]
        # Counted as collected, so pytest's "collected N items / M selected" adds up.
        config.hook.pytest_collectreport(report=pytest.CollectReport("ltconform-runs", Outcome.PASSED.value, None,
                                                                     list(added.values())))


def name_reporters(session: pytest.Session) -> None:
    """Decide, from the collection (the same in every xdist worker), which item reports each run's
    own failure: its run item, else the one contract item judged on it. The items after it name it;
    decided by whichever item ran first, a run's failure would be reported once per worker that
    holds its items, and a contract item ahead of its run item (-p randomly, --dist) would
    report what the run item reports again."""
    config = session.config
    if config.stash.get(controller.ALL_TARGETS_KEY, None) is None:
        return
    from . import contracts

    named: dict = {}  # target id -> {(kind, strategy, tier): item name}
    for item in session.items:
        if isinstance(item, LtconformRunItem):
            key = (item.kind, item.variant.strategy, item.variant.tier)
            named.setdefault(item.target_id, {})[key] = item.name  # a run item comes first, and wins
        elif isinstance(item, LtconformItem) and item.variant is not None:
            key = (contracts.get_contract(item.contract_id).run_spec.name, item.strategy, item.tier)
            named.setdefault(item.target_id, {}).setdefault(key, item.name)
    config.stash[controller.REPORTERS_KEY] = named


def _run_item(parent, target_id: str, kind: str, contract_id: str, variant) -> LtconformRunItem:
    name = f"{kind}[{variant.label}]"
    item = LtconformRunItem.from_parent(parent, name=name, nodeid=f"ltconform::{target_id}::{name}", kind=kind,
                                        contract_id=contract_id, variant=variant, target_id=target_id)
    item.extra_keyword_matches.add(target_id)
    item.add_marker("ltconform")
    for marker in variant.markers:
        item.add_marker(marker)
    return item


def add_items(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Append one contract item per (target, contract, variant) that applies and can be shown here."""
    if config.stash.get(controller.ALL_TARGETS_KEY, None) is None:
        return
    first_new = len(items)
    hidden = controller.hidden(config)  # tiers that cannot run here and were not asked for: said in the header
    # Target first: every id names its target, also with one target, so that adding a second
    # model never renames the first one's items; a target's runs stay together.
    for target_id, targets in config.stash[controller.ALL_TARGETS_KEY].items():
        for cid, contract, variant in controller.variants(config):
            if (cid, variant.label) not in hidden and controller.applies(contract, variant.strategy, targets, variant):
                items.append(_item(session, target_id, cid, variant))
    # Report the generated items like collected ones, so "collected N items" counts them.
    config.hook.pytest_collectreport(
        report=pytest.CollectReport("ltconform", Outcome.PASSED.value, None, items[first_new:]))


def _item(parent, target_id: str, cid: str, variant) -> LtconformItem:
    item = LtconformItem.from_parent(
        parent, name=f"{cid}[{variant.label}]", nodeid=f"ltconform::{target_id}::{cid}[{variant.label}]",
        contract_id=cid, strategy=variant.strategy, variant=variant, target_id=target_id,
    )
    item.extra_keyword_matches.add(target_id)  # -k matches the target's id
    item.add_marker("ltconform")
    for marker in variant.markers:
        item.add_marker(marker)
    return item


def shape_report(item, call, report) -> None:
    """What a report of an ltconform item shows: the verdict's message instead of a traceback of
    the plugin's code, a passed item's one-line summary and notes, a skip named after the item."""
    if isinstance(item, LtconformItem) and call.excinfo is not None and \
            isinstance(call.excinfo.value, VerdictRaised):
        # Setup errors would otherwise render a traceback of our own code.
        report.longrepr = failure_repr(call.excinfo.value.verdict["message"], item.reportinfo())
    elif isinstance(item, LtconformItem) and report.when == "call" and report.passed and item.verdict_dict:
        # What the item checked, in one line: -rA prints it after "PASSED <id> - " as it prints a
        # failure's message, and -rP / the JSON report carry the same words.
        report.longrepr = _one_line(item.verdict_dict.get("summary") or "")
        # The one-line reason is trimmed to the terminal's width in the short summary; -rA / -rP
        # print a passed item's sections in full, so its notes (a DeepSpeed substitution, a
        # second fit), evidence and rule are readable there.
        first, _, rest = item.verdict_dict.get("message", "").partition("\n")
        plain = first == f"[{item.contract_id}] passed: {item.verdict_dict.get('summary')}"
        report.sections.append(("ltconform", (rest if plain else f"{first}\n{rest}").strip() or "(no notes)"))
    elif isinstance(item, LtconformRunItem) and report.when == "call" and report.passed and item.summary:
        # What ran, and that the contract items judge it: -rA prints it as it prints theirs.
        report.longrepr = _one_line(item.summary)
        report.sections.append(("ltconform", "(no notes)"))
    elif isinstance(item, LtconformRunItem) and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (item.nodeid, None, report.longrepr[2])  # -rs: the item, not the plugin's file
    elif isinstance(item, LtconformItem) and report.skipped and isinstance(report.longrepr, tuple):
        # -rs names where a skip was raised: the plugin's own file means nothing to a user. A tier
        # that cannot run here reads "SKIPPED [n] ltconform: <reason>" (one line for all its
        # items); an item left not judged names itself, since its reason names another item.
        where = item.nodeid if item.verdict_dict else "ltconform"
        report.longrepr = (where, None, report.longrepr[2])


def failure_repr(text: str, where: tuple) -> object:
    """A failed item's report: ``text`` whole where pytest prints the failure, its first line
    where pytest prints one line per item (the short summary, ``--tb=line``, JUnit's message).

    A plain string would be printed whole in the short summary too whenever pytest runs under CI
    (``CI`` or ``BUILD_NUMBER`` set) or ``-vv``. ``where`` is :meth:`reportinfo`'s (path, 0-based
    line or None, name). The pytest classes used serialize across xdist workers."""
    from _pytest._code.code import ReprEntryNative, ReprExceptionInfo, ReprFileLocation, ReprTraceback

    headline = text.splitlines()[0] if text else ""
    path, line = where[0], where[1]
    crash = ReprFileLocation(str(path), (line or 0) + 1, headline)
    return ReprExceptionInfo(ReprTraceback([ReprEntryNative([text + "\n"])], None, "native"), crash)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def unavailable(reason: str) -> dict:
    """The verdict fields of an item whose tier cannot run here."""
    return {"outcome": Outcome.SKIPPED, "message": reason, "summary": reason, "category": "unavailable"}
