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
