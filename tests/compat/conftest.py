"""The client suites run beside the rest of the session.

Each is a pytest run of its own, in processes of its own that use about one core each and need nothing of
this process. The session leaves most of a second core idle (engines starting, workers on other
processes), so the suites start as soon as collection ends, a few steps lower in CPU priority, and the
tests that read their results (marked ``clients``) go last.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .client_suites import SuiteRuns, start_all

SUITE_RUNS = pytest.StashKey[SuiteRuns]()
_FOLDER = pytest.StashKey[Path]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suites = [item for item in items if item.get_closest_marker("clients")]
    if not suites or config.option.collectonly:
        return
    items[:] = [item for item in items if not item.get_closest_marker("clients")] + suites
    names = list(dict.fromkeys(item.callspec.params["name"] for item in suites))  # type: ignore[attr-defined]
    config.stash[_FOLDER] = folder = Path(tempfile.mkdtemp(prefix="genlm-client-suites-"))
    config.stash[SUITE_RUNS] = start_all(names, on_genlm=True, folder=folder, nice=10)


def pytest_unconfigure(config: pytest.Config) -> None:
    if SUITE_RUNS in config.stash:
        config.stash[SUITE_RUNS].stop()
        shutil.rmtree(config.stash[_FOLDER], ignore_errors=True)


@pytest.fixture(scope="session")
def on_genlm(request: pytest.FixtureRequest) -> dict[str, dict[str, str]]:
    """Every selected suite's ``{test id: outcome}`` on genlm, once its processes have ended."""
    return request.config.stash[SUITE_RUNS].outcomes()
