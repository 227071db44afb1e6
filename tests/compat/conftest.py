"""The client suites run beside the rest of the session.

Each is a pytest run of its own, in processes of its own that use about one core each and need nothing of
this process. The session leaves most of a second core idle (engines starting, workers on other
processes), so the suites start as soon as collection ends, a few steps lower in CPU priority, and the
tests that read their results (those that ask for ``on_genlm``) go last. The suites of ``ALONE`` (a test
that times genlm's batcher against the wall clock) run last, when the others have ended.

Under pytest-xdist every worker collects every test, and the other workers use the spare cores: there the
suites start when the worker that runs their tests first asks for ``on_genlm``.

The fixture waits for them all until its deadline (``client_suites.DEADLINE_S`` from when it starts), stops what
still runs there and gives each suite its results and what kept it from finishing; the tests that read them
fail with that (their own time limit is above the deadline: ``test_client_suites.py``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from .client_suites import ALONE, DEADLINE_S, SuiteResult, SuiteRuns, results_by, start_all

SUITE_RUNS = pytest.StashKey[SuiteRuns]()
_ALONE = pytest.StashKey[list[str]]()
_BESIDE = pytest.StashKey[list[str]]()
_FOLDER = pytest.StashKey[Path]()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suites = [item for item in items if "on_genlm" in getattr(item, "fixturenames", ())]
    if not suites or config.option.collectonly:
        return
    items[:] = [item for item in items if item not in suites] + suites
    names = list(dict.fromkeys(item.callspec.params["name"] for item in suites))  # type: ignore[attr-defined]
    config.stash[_FOLDER] = Path(tempfile.mkdtemp(prefix="genlm-client-suites-"))
    config.stash[_ALONE] = [name for name in names if name in ALONE]
    config.stash[_BESIDE] = [name for name in names if name not in ALONE]
    if not hasattr(config, "workerinput"):  # one process runs the session: start them now, beside it
        start_beside(config)


def start_beside(config: pytest.Config) -> None:
    config.stash[SUITE_RUNS] = start_all(config.stash[_BESIDE], on_genlm=True, folder=config.stash[_FOLDER], nice=10)


def pytest_unconfigure(config: pytest.Config) -> None:
    if SUITE_RUNS in config.stash:
        config.stash[SUITE_RUNS].stop()
    if _FOLDER in config.stash:
        shutil.rmtree(config.stash[_FOLDER], ignore_errors=True)


@pytest.fixture(scope="session")
def on_genlm(request: pytest.FixtureRequest) -> dict[str, SuiteResult]:
    """Every selected suite's results on genlm (``SuiteResult``: ``{test id: outcome}`` and its problems), once
    its processes have ended, or ``DEADLINE_S`` from now at the latest: what still runs then is stopped."""
    config = request.config
    deadline = time.monotonic() + DEADLINE_S
    if SUITE_RUNS not in config.stash:  # a pytest-xdist worker: this one runs the suites' tests
        start_beside(config)
    folder = config.stash[_FOLDER]
    return results_by(
        deadline,
        config.stash[SUITE_RUNS],
        config.stash[_ALONE],
        lambda names: start_all(names, on_genlm=True, folder=folder),
    )
