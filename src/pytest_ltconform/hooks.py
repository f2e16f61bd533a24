"""Hook specifications this plugin adds (registered through ``pytest_addhooks``)."""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_ltconform_targets(config: pytest.Config) -> list:
    """Return the targets to check, a list of ``pytest_ltconform.Target`` (or target strings).

    Implement it in the ``conftest.py`` at the root of the project (or of the test paths given):
    it is called at start-up, before collection. The results of every implementation are
    concatenated after the ``--ltconform`` values (or the ``ltconform_target`` ini list).
    """


@pytest.hookspec
def pytest_ltconform_contracts(config: pytest.Config) -> list:
    """Return contracts of the project's own to judge, a list of instances of
    ``pytest_ltconform.Contract`` subclasses (docs/design.md, "Adding a contract").

    Implement it in a ``conftest.py`` or a plugin: it is called once ``--ltconform`` (or its ini
    twin) is in use, before collection. Each contract gets an item per strategy and tier it declares,
    after the plugin's own; its probe class must be importable on the ranks (a module on the
    project's path, not only a ``conftest.py``). An id another contract has is a usage error.
    """
