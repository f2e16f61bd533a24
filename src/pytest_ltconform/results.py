"""What the run reports: the verdict records collected from the item reports (also those xdist
workers send back), the summary table, the JSON report, and the ``-v`` line of a passed item."""

from __future__ import annotations

import errno
import os
import sys

import pytest

from . import controller, progress
from .outcomes import Outcome


def not_run(config: pytest.Config) -> list[dict]:
    """The JSON report's ``not_run``: per tier whose items were not created here, the reason and how
    many items it would have had (one record each would bury the verdicts). Items that ``-k``
    would have deselected are not counted, as ``-m`` leaves out the tiers it deselects."""
    targets = config.stash.get(controller.ALL_TARGETS_KEY, None)
    if targets is None:
        return []
    from . import tiers

    try:
        keyword = tiers.MarkExpression.parse(config.getoption("keyword", ""))
    except ValueError:
        keyword = tiers.MarkExpression.parse("")  # pytest reports a malformed -k itself
    hidden = controller.hidden(config)
    counts: dict = {}  # (tier, reason) -> items, in item order
    for tid, target in targets.items():
        for cid, contract, variant in controller.variants(config):
            why = hidden.get((cid, variant.label))
            # The names pytest's -k matches on a generated item: its name, the target's id, markers.
            names = (f"{cid}[{variant.label}]", tid, "ltconform", *variant.markers)
            shown = controller.applies(contract, variant.strategy, target, variant)
            if why and shown and keyword.matches_keywords(names):
                counts[why] = counts.get(why, 0) + 1
    return [{"tier": tier, "reason": reason, "items": n} for (tier, reason), n in counts.items()]


def teststatus(report):
    """An advisory (waste that breaks nothing) passes, but reads "A" / ADVISORY, not a plain pass."""
    if report.when == "call" and report.passed:
        from . import report as report_mod

        rec = report_mod.from_report(report)
        if rec and rec["outcome"] == Outcome.ADVISORY:
            return Outcome.ADVISORY.value, "A", ("ADVISORY", {"yellow": True})
    return None


def advisory_sections(tr) -> None:
    """``-rA`` / ``-rP``: each advisory item's sections (its evidence block, the notes on what ran
    in place of the user's config), after PASSES and as pytest prints a passed item's there: its
    PASSES lists only the "passed" category, and an advisory reports as its own (:func:`teststatus`)."""
    if tr.config.option.tbstyle == "no" or not tr.hasopt("P"):
        return
    reports = [rep for rep in tr.getreports(Outcome.ADVISORY.value) if rep.sections]
    if not reports:
        return
    show = tr.config.option.showcapture
    tr.write_sep("=", "ADVISORIES")
    for rep in reports:
        tr.write_sep("_", rep.head_line or rep.nodeid, yellow=True, bold=True)
        if rep.longreprtext:
            tr.write_line(rep.longreprtext)
        for name, content in rep.sections if show != "no" else ():
            if show == "all" or show in name:
                tr.write_sep("-", name)
                tr.write_line(content.rstrip("\n"))


class PassedReasons:
    """Under ``-v``: below each passed (or advisory) contract item's line, what it checked (the
    verdict's summary)."""

    def __init__(self, terminalreporter):
        self.tr = terminalreporter

    @pytest.hookimpl(trylast=True)  # after the terminal reporter wrote the item's "PASSED" line
    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" or not report.passed or not isinstance(report.longrepr, str):
            return
        if self.tr.config.pluginmanager.get_plugin("terminalreporter") is not self.tr:
            return  # a quiet rank of a launched world dropped its reporter: print nothing
        from . import report as report_mod

        rec = report_mod.from_report(report)
        if rec is None or rec["outcome"] not in (Outcome.PASSED, Outcome.ADVISORY) or not report.longrepr:
            return
        line = f"    {report.longrepr}"
        width = self.tr.config.get_terminal_writer().fullwidth - 1
        if self.tr.config.get_verbosity() < 2 and len(line) > width:  # as pytest trims skip reasons
            line = line[:width - 3] + "..."
        self.tr.ensure_newline()
        self.tr.write(line, light=True)


class ResultsCollector:
    """Collects every ltconform record from the reports (also those xdist workers send back),
    prints the summary table and writes the JSON report."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.results: list[dict] = []
        self.seen: dict[str, tuple] = {}  # item nodeid -> (outcome, message) of its record
        self.report_error: str | None = None
        self.report_line: str | None = None  # where the report went, or why it was left as it was

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the outcome
    def pytest_runtest_logreport(self, report) -> None:
        from . import report as report_mod

        progress.end_live_line(self.config, report.nodeid)
        rec = report_mod.from_report(report)
        # One record per item: the call phase, or the setup phase when setup did not pass.
        if rec is not None and (report.when == "call" or (report.when == "setup" and not report.passed)):
            verdict = (rec["outcome"], rec["message"])
            if self.seen.get(report.nodeid) == verdict:
                return  # --dist each: every worker runs the item; the same verdict of the same run is one record
            self.seen[report.nodeid] = verdict
            self.results.append(rec)

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self) -> None:
        progress.end_live_line(self.config)  # Ctrl-C or SIGTERM during a run: pytest's banner starts a line

    def pytest_terminal_summary(self, terminalreporter) -> None:
        advisory_sections(terminalreporter)
        deselected = controller.deselected_line(self.config)
        if deselected:  # the header said it too; the counts at the end are where a reader looks
            terminalreporter.write_line(deselected, yellow=True, bold=True)
        if self.results:
            from . import report as report_mod

            width = min(terminalreporter.config.get_terminal_writer().fullwidth, 100)
            terminalreporter.write_sep("=", "ltconform summary", bold=True)
            if all(r.get("category") == "unavailable" and r["outcome"] == Outcome.SKIPPED for r in self.results):
                # A run of skips only must not read as a pass: say that nothing was judged, and why.
                reasons = "; ".join(dict.fromkeys(r["summary"] for r in self.results))
                terminalreporter.write_line(f"ltconform: nothing was judged: every selected item needs a tier that "
                                            f"cannot run here: {reasons}", yellow=True, bold=True)
            else:
                # Each failure's block is printed once: in FAILURES, or here when --tb=no leaves it out.
                text = report_mod.summary_text(self.results, width=width, color=terminalreporter.hasmarkup,
                                               blocks=self.config.getoption("tbstyle", "auto") == "no",
                                               details=self.config.get_verbosity() >= 2)
                for line in text.splitlines():
                    terminalreporter.write_line(line)
        if self.report_error:
            terminalreporter.write_line(self.report_error, red=True, bold=True)
        if self.report_line and self.report_line.startswith("ltconform:"):
            terminalreporter.write_line(self.report_line, yellow=True)
        elif self.report_line:
            terminalreporter.write_sep("-", self.report_line)  # as --junitxml says where its file went

    def _made(self) -> dict:
        """What the report says of the session's targets, worlds and runs: from this process, or
        from the pytest-xdist workers (an xdist controller makes none)."""
        workers = self.config.stash.get(controller.XDIST_REPORT_KEY, None)
        if workers is not None:
            return workers
        pool = self.config.stash.get(controller.POOL_KEY, None)
        return {"targets": list(self.config.stash.get(controller.ALL_TARGETS_KEY, {}).values()),
                "cold_starts": pool.cold_starts if pool is not None else None,
                "imports": pool.imports if pool is not None else None,
                "not_run": not_run(self.config), "runs": controller.made_runs(self.config)}

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        settings = self.config.stash.get(controller.SETTINGS_KEY, None)
        if settings is None or not settings.report or hasattr(self.config, "workerinput"):
            return
        attached = controller.attached_world(self.config)
        if attached is not None and attached.rank != 0:
            return  # rank 0 writes the report for every rank
        if all(r["outcome"] == Outcome.SKIPPED for r in self.results) and os.path.isfile(settings.report):
            # `pytest -m "not ltconform"` with the report in the ini file must not wipe the last verdicts.
            self.report_line = (f"ltconform: nothing was judged, so the JSON report {settings.report} was left "
                                f"as an earlier session wrote it")
            return
        from . import report as report_mod

        status = int(exitstatus)
        try:
            report_mod.write_json(settings.report, settings.target, settings.world_size, list(self.results),
                                  interrupted=status == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop),
                                  exitstatus=status, **self._made(),
                                  seeding=report_mod.seeding_entry(settings.seeding, settings.seed,
                                                                   settings.world_size))
        except OSError as exc:
            # Checked at start-up, yet the disk can fill or the folder go: the summary still prints,
            # and the session fails (a CI job that keeps the report must not pass without it).
            why = f"{exc.strerror} (errno {exc.errno}, {errno.errorcode.get(exc.errno, '?')})" if exc.strerror \
                else str(exc)
            self.report_error = (f"pytest-ltconform: could not write the JSON report to {settings.report}: {why}; "
                                 f"the session fails, and the verdicts are in the summary above.")
            if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            if self.config.pluginmanager.get_plugin("terminalreporter") is None:
                sys.stderr.write(self.report_error + "\n")
            return
        self.report_line = f"generated ltconform report file: {os.path.abspath(settings.report)}"
