"""The ecosystem's own tests, unmodified, on genlm (genlm-control's, llamppl's, genlm-backend's and
genlm-bytes'): every test that passes on the seeds here (``seed_passing.txt``, measured by
``python -m tests.compat.client_suites``) must pass, but for the few that read the seeds' private state
(``PRIVATE_STATE``, each listed with its reason in the migration page)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from .client_suites import (
    CLIENTS,
    DEADLINE_S,
    PRIVATE_STATE,
    SEED_PASSING,
    STOP_GRACE_S,
    SuiteProcess,
    SuiteResult,
    SuiteRuns,
    launch,
    results_by,
)

#: This test's own limit (pytest-timeout's, over its setup, which waits for every suite): above the fixture's
#: deadline and the grace it gives a stopped suite to write its results, so that the fixture's deadline, with
#: its message, is what ends a run whose suites cannot finish, not pytest-timeout's ``os._exit`` of the worker.
TIMEOUT_S = DEADLINE_S + STOP_GRACE_S + 60


@pytest.mark.slow
@pytest.mark.clients
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_suite_passes_on_genlm(name: str, on_genlm: dict[str, SuiteResult]) -> None:  # on_genlm: conftest.py
    listed = SEED_PASSING.read_text().splitlines()
    expected = [t for t in listed if t.startswith(f"{name}::") and t not in PRIVATE_STATE]
    assert expected, f"no reference results for {name} in {SEED_PASSING.name}"
    result = on_genlm[name]
    lost = [t for t in expected if result.outcomes.get(t) != "passed"]
    missing = f"{len(lost)} of {len(expected)} without a pass, among them {lost[:5]}"
    assert not result.problems, "\n\n".join([*result.problems, missing])
    assert not lost, f"{len(lost)} of {len(expected)} tests that pass on genlm-backend fail on genlm: {lost}"


def test_every_private_state_exception_is_in_the_migration_page():
    page = (Path(__file__).parents[2] / "docs" / "migration.md").read_text()
    for test, reason in PRIVATE_STATE.items():
        assert test.rsplit("::", 1)[1] in page and reason in page, test


#: A stand-in for a suite's pytest run: ``done`` writes its results and ends; ``hangs`` starts a process of its
#: own (which ignores interrupts, as a stuck one would), names its test and sleeps, and on an interrupt writes
#: the results it has, as pytest does; ``deaf`` also ignores interrupts itself.
FAKE_SUITE = """
import signal, subprocess, sys, time
from pathlib import Path

mode, junit = sys.argv[1], Path(sys.argv[2])
CASE = '<testcase classname="tests.test_x" name="{}"{}>'
def results(*cases):
    junit.write_text("<testsuites><testsuite>" + "".join(cases) + "</testsuite></testsuites>")
print("tests/test_x.py::test_ok PASSED", flush=True)
if mode == "done":
    results(CASE.format("test_ok", "/"), CASE.format("test_bad", "><failure message='no'/></testcase"))
    sys.exit(1)
ignore = "import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(flush=True); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE)
child.stdout.readline()  # its interrupts ignored from here on
junit.with_suffix(".child").write_text(str(child.pid))
if mode == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("tests/test_x.py::test_hangs ", flush=True)
try:  # ready inside the try: the interrupt, sent once it is ready, cannot land before the handler
    junit.with_suffix(".ready").touch()
    time.sleep(600)
except KeyboardInterrupt:
    print("tests/test_x.py:7: KeyboardInterrupt", flush=True)
    results(CASE.format("test_ok", "/"))
    sys.exit(2)
"""


def fake_suite(folder: Path, name: str, mode: str) -> SuiteProcess:
    """A :data:`FAKE_SUITE` started as a suite is (``launch``); once it is ready (started its process and
    ignores what it will ignore), or has ended."""
    junit = folder / f"{name}.xml"
    command = [sys.executable, "-c", FAKE_SUITE, mode, str(junit)]
    run = launch(name, [f"tests/test_{mode}.py"], junit, command, cwd=folder, env=dict(os.environ))
    while not junit.with_suffix(".ready").exists() and run.process.poll() is None:
        time.sleep(0.01)
    assert mode == "done" or run.process.poll() is None, run.output_tail()
    if mode == "done":
        run.process.wait()
    return run


def ended(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie: dead, waiting to be reaped by its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def assert_ended(pid: int) -> None:
    """``pid`` is gone within 30 s: a process killed (SIGKILL) dies at once; the bound only keeps a failure short."""
    give_up = time.monotonic() + 30
    while not ended(pid) and time.monotonic() < give_up:
        time.sleep(0.01)
    assert ended(pid), f"process {pid} outlived its suite's process group"


@pytest.mark.parametrize(
    ("mode", "grace_s", "partial"),
    # An interrupted run that writes what it has ends at once, whatever the grace (60 s here is never waited
    # for); a run deaf to interrupts is killed once its grace has passed (0.2 s: its results do not depend on it).
    [("hangs", 60.0, {"fake::tests.test_x::test_ok": "passed"}), ("deaf", 0.2, {})],
)
def test_a_suite_past_the_deadline_is_stopped_with_what_it_started_and_named(
    tmp_path: Path, mode: str, grace_s: float, partial: dict[str, str]
) -> None:
    done, late = fake_suite(tmp_path, "other", "done"), fake_suite(tmp_path, "fake", mode)
    child = int(late.junit.with_suffix(".child").read_text())
    results = SuiteRuns([done, late]).outcomes(deadline=time.monotonic(), grace_s=grace_s)  # the deadline: now
    assert late.process.returncode is not None and done.process.returncode == 1
    assert_ended(child)  # the group was killed, not only the suite's process
    assert results["other"] == SuiteResult(
        {"other::tests.test_x::test_ok": "passed", "other::tests.test_x::test_bad": "failure"}
    )
    assert results["fake"].outcomes == partial  # what it wrote before it stopped
    (problem,) = results["fake"].problems
    stopped = r"fake's suite \(tests/test_(hangs|deaf)\.py\) did not finish by its deadline: stopped after \d+ s"
    assert re.match(stopped, problem)
    assert problem.endswith(late.output_tail()) and "tests/test_x.py::test_hangs" in problem  # the test it was in
    assert ("KeyboardInterrupt" in problem) == (mode == "hangs")


def test_the_suites_after_the_first_start_if_the_deadline_leaves_time_and_say_so_if_not(tmp_path: Path) -> None:
    started: list[list[str]] = []

    def start_then(names: list[str]) -> SuiteRuns:
        started.append(names)
        return SuiteRuns([fake_suite(tmp_path, name, "done") for name in names])

    first = SuiteRuns([fake_suite(tmp_path, "first", "done")])
    found = results_by(time.monotonic() + 600, first, ["alone"], start_then)  # each ends by itself: not waited for
    assert started == [["alone"]] and {name: r.problems for name, r in found.items()} == {"first": [], "alone": []}
    assert found["alone"].outcomes["alone::tests.test_x::test_ok"] == "passed"
    found = results_by(time.monotonic(), first, ["alone"], start_then)  # the deadline has passed
    assert started == [["alone"]]
    assert found["alone"] == SuiteResult(
        {}, ["alone's suite was not started: the deadline passed while the suites before it ran (first)"]
    )
