"""pytest glue: the hook functions, each delegating to the module that does the work.

``controller`` holds the session's state and life cycle, ``items`` the generated items,
``results`` the records, summary and JSON report, ``progress`` the live lines of long runs,
``header`` the header lines and ``fixtures`` the fixtures. Nothing heavy is imported unless
``--ltconform`` (or its ini twin, or an ``ltconform_*`` fixture) is in use, so a plain
``pytest`` run in a repository that has this plugin installed costs what it cost before.
"""

from __future__ import annotations

import sys

import pytest

from . import controller, header, results, workers
from . import items as items_mod
from . import settings as settings_mod
from .fixtures import ltconform_target, ltconform_world  # noqa: F401 (registered as the plugin's fixtures)


def pytest_addoption(parser: pytest.Parser) -> None:
    settings_mod.add_options(parser)
    settings_mod.add_device_memory_option(parser)


def pytest_addhooks(pluginmanager) -> None:
    from . import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--ltconform-explain CONTRACT``: print the contract's rule page (the project's contracts
    included) and exit, like ``--markers`` (no target needed, nothing heavy imported)."""
    cid = config.getoption(settings_mod.OPT_EXPLAIN)
    if cid is None:
        return None
    page = controller.explain(config, cid.strip())
    sys.stdout.write(page if page.endswith("\n") else page + "\n")
    return pytest.ExitCode.OK


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists, so quiet ranks can drop it
def pytest_configure(config: pytest.Config) -> None:
    for name, text in controller.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    settings, problems = controller.resolve_settings(config)
    config.pluginmanager.register(results.ResultsCollector(config), "ltconform-results")
    config.pluginmanager.register(items_mod.RunItems(), "ltconform-run-items")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() >= 1:
        config.pluginmanager.register(results.PassedReasons(reporter), "ltconform-passed-reasons")
    if settings.enabled and controller.deselected_line(config) is None:
        if workers.is_controller(config):
            workers.start_controller(config, settings, problems)  # the workers validate and run
        else:
            _start(config, settings, problems)
    elif problems:
        raise settings_mod.InputProblems(problems)
    elif settings.enabled:  # -m deselected every contract item: no target validated, but a launched world
        controller.attach(config, settings)  # still checks that its ranks collected alike and serves the fixture


def _start(config: pytest.Config, settings, problems: list[str]) -> None:
    """Validate the targets (here, or once between the xdist workers); a worker hands a usage
    error to its controller instead of raising it (xdist would restart a worker that raised)."""
    try:
        controller.start(config, settings, problems)
    except settings_mod.InputProblems as exc:
        if controller.shared(config)[0] is None:
            raise
        config.stash[controller.ONLY_CONTRACTS_KEY] = controller.contracts_alone(config)  # collect nothing else
        workers.publish(config, str(exc))
        return
    workers.publish(config, None)


def pytest_ignore_collect(collection_path, config):
    return True if controller.contracts_only(config) else None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    controller.finishing(session, exitstatus)
    workers.worker_output(session.config)  # an xdist worker: what its sessions made, for the controller
    workers.gather(session.config)  # the xdist controller: what its workers made, for the report


def pytest_unconfigure(config: pytest.Config) -> None:
    controller.close(config)
    workers.close(config)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    lines = (header.header_lines(config) or []) + [line for line in [workers.cores_line(config)] if line]
    return lines or None


def pytest_collection_finish(session: pytest.Session) -> None:
    items_mod.name_reporters(session)
    controller.agree_collection(session)


@pytest.hookimpl(tryfirst=True)  # our items must exist before -k / -m deselection runs
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    items_mod.add_items(session, config, items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    items_mod.shape_report(item, call, report)
    return report


def pytest_report_teststatus(report, config):
    return results.teststatus(report)
