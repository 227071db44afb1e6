"""What the test session sets up for itself and the processes it starts (``tests/conftest.py``): the garbage
collector's thresholds, here and in every process started from here, also under the ``sitecustomize.py`` files
that shadow ``tests/process_site``'s (the client suites', the test Ray cluster's); the imports those processes
leave out; and where a worker freezes its heap."""

from __future__ import annotations

import gc
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
PYTHONS_DEFAULT = (700, 10, 10)


@pytest.mark.parametrize(
    "first_on_path",
    [None, TESTS / "compat" / "without_vllm", TESTS / "vllm" / "ray_shim"],
    ids=["process_site", "client suites", "ray cluster"],
)
def test_processes_the_session_starts_collect_garbage_as_it_does(first_on_path):
    env = dict(os.environ)
    if first_on_path is not None:  # as client_suites.start and ray_cluster.shim_env put it
        env["PYTHONPATH"] = os.pathsep.join([str(first_on_path), env["PYTHONPATH"]])
    code = "import gc, sys; print(gc.get_threshold(), sys.modules['sitecustomize'].__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    thresholds, site = out.rsplit(" ", 1)
    assert gc.get_threshold() != PYTHONS_DEFAULT
    assert thresholds == str(gc.get_threshold())
    assert Path(site.strip()).parent == (first_on_path or TESTS / "process_site")


@pytest.mark.parametrize(
    ("first_on_path", "kept"),
    [(None, False), (TESTS / "vllm" / "ray_shim", False), (TESTS / "compat" / "without_vllm", True)],
    ids=["process_site", "ray cluster", "client suites"],
)
def test_processes_the_session_starts_leave_out_what_they_do_not_use(first_on_path, kept):
    """jsonschema without ``rfc3987_syntax`` (``tests/process_site/genlm_test_imports.py``) still checks the
    formats it has, and only the client suites' processes (genlm-control checks formats) still check IRIs."""
    # Installed (genlm-control's jsonschema[format-nongpl]); the day it is not, leave_out has nothing left to do.
    assert importlib.machinery.PathFinder.find_spec("rfc3987_syntax") is not None
    env = dict(os.environ)
    if first_on_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(first_on_path), env["PYTHONPATH"]])
    code = (
        "import sys, jsonschema\n"
        "check = jsonschema.Draft7Validator.FORMAT_CHECKER\n"
        "print('rfc3987_syntax' in sys.modules and sys.modules['rfc3987_syntax'] is not None,"
        " 'iri' in check.checkers, check.conforms('1.2.3.4', 'ipv4'), check.conforms('1.2.3', 'ipv4'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(kept), str(kept), "True", "False"]


def test_the_heap_is_frozen_again_after_the_serial_folder_in_a_run_with_slow_tests(request, monkeypatch):
    """``pytest_runtest_setup`` in a run with slow tests: no freeze between modules, but one when the worker
    leaves ``tests/vllm/`` (whose engines unfreeze the whole heap at shutdown)."""
    (conftest,) = [
        p
        for p in request.config.pluginmanager.get_plugins()
        if getattr(p, "__file__", "") == str(TESTS / "conftest.py")
    ]
    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    stash = pytest.Stash()
    stash[conftest._FREEZE_BETWEEN_MODULES] = False  # as pytest_collection_finish sets it where slow tests run
    config = type("Config", (), {"stash": stash})()
    frozen_before = []
    for nodeid in [
        "tests/vllm/test_a.py::t",
        "tests/vllm/test_a.py::u",
        "tests/vllm/test_b.py::t",
        "tests/hf/test_c.py::t",
        "tests/hf/test_d.py::t",
    ]:
        calls.clear()
        conftest.pytest_runtest_setup(type("Item", (), {"nodeid": nodeid, "config": config})())
        frozen_before.append(calls == ["collect", "freeze"])
        assert calls in ([], ["collect", "freeze"])
    assert frozen_before == [False, False, False, True, False]


def _conftest(request: pytest.FixtureRequest):
    (conftest,) = [
        p
        for p in request.config.pluginmanager.get_plugins()
        if getattr(p, "__file__", "") == str(TESTS / "conftest.py")
    ]
    return conftest


@pytest.mark.parametrize("machine", [0.5, 1.0, 2.0], ids=["fast machine", "reference machine", "slow machine"])
def test_the_fast_tiers_budget_follows_the_machines_speed(request, machine):
    """A tier that got slower fails on a fast machine and on a slow one; a slow machine does not fail a tier
    that did not (``TimeBudget``'s budget: ``fast_tier_budget`` scaled by the reference workload's time)."""
    speed_reference = _conftest(request).speed_reference
    reference = {"python": 0.08, "torch": 0.14}
    here = {name: seconds * machine for name, seconds in reference.items()}
    tier_budget, tier_there = 150.0, 110.0  # the budget, and what the tier took where it was set
    budget, factor = speed_reference.budget(tier_budget, reference, [here, reference])  # the slower reading
    assert factor == pytest.approx(max(machine, 1.0))
    budget, factor = speed_reference.budget(tier_budget, reference, [here])
    assert factor == pytest.approx(machine)
    unchanged, slower = tier_there * machine, 1.5 * tier_there * machine
    assert unchanged <= budget < slower


def test_the_time_budget_scales_by_the_reference_workload_read_at_both_ends(request, monkeypatch):
    """``TimeBudget`` reads the workload in the controller before the workers start and again at the end,
    and judges the fast tier by the slower reading."""
    conftest = _conftest(request)
    readings = iter([{"python": 0.17, "torch": 0.28}, {"python": 0.34, "torch": 0.56}])
    monkeypatch.setattr(conftest.speed_reference, "measure", lambda: next(readings))
    config = request.config
    budget = conftest.TimeBudget.__new__(conftest.TimeBudget)
    budget.controller, budget.fast_tier, budget.tier_budget = True, True, 150.0
    budget.reference = {"python": 0.085, "torch": 0.14}
    budget.speeds = [conftest.speed_reference.measure()]
    seconds, factor = budget.budget()
    assert factor == pytest.approx(4.0) and seconds == pytest.approx(600.0)
    assert len(budget.speeds) == 2
    assert conftest.speed_reference.parse(config.getini("fast_tier_reference")) == conftest.speed_reference.parse(
        conftest.REFERENCE_WORKLOAD
    )
