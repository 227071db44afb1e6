"""Shared fixtures: real offline tokenizers (built once per machine) and a fresh plugin manager; how the run
is spread over worker processes (pytest-xdist: ``pytest_xdist_make_scheduler``); the garbage collector's
thresholds, here and in the processes the tests start (``GC_THRESHOLDS``); and the fast tier's time budget
(``TimeBudget``)."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

# Nothing here comes from a model hub: an unknown name fails at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from genlm_core.plugins import reset_plugins
from genlm_core.testing.tokenizers import load_tokenizer, toy_tokenizer

REAL_TOKENIZERS = ["gpt2", "mistral-v1", "mistral-v3", "tekken"]
#: Folders whose tests run on one worker, one after another, and first. vLLM's tests start engines and then
#: count every process and /dev/shm file left since (``left_since``: a second worker's engine running at the same
#: moment would be counted; the engines themselves keep apart, see ``tests/vllm/test_shm_files.py``), a Ray
#: cluster on fixed loopback addresses, and a session engine per process; they are also the run's longest chain.
SERIAL_FIRST = {"tests/vllm/": "vllm"}
#: The next longest work units, handed out next in this order (seconds of their worker in a whole run, 2 cores):
#: the client suites 240-319 (their worker waits on processes of their own), the GPU check's dry runs 130-162,
#: the fresh-virtualenv installs 74-92. The other units follow, most tests first, and the short ones fill in
#: at the end, where a long one given out last ran alone (``test_install.py`` did, for the run's last 33-80 s).
LONG_NEXT = ["tests/compat/test_client_suites.py", "tests/test_gpu_check.py", "tests/test_install.py"]
MAX_WORKERS = 4  # each worker holds torch, transformers and a model or two: about 1.5 GB


def _sibling(name: str) -> Any:
    """A module of this folder (not a package: pytest imports this file by path)."""
    spec = importlib.util.spec_from_file_location(f"genlm_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


speed_reference = _sibling("speed_reference")
#: The reference workload's seconds on the machine where ``fast_tier_budget`` is judged against (2 cores, the
#: project's kind): the median of the four readings of two fast-tier runs in clean clones on 2026-12-02 (python
#: 0.032-0.042 s, torch 0.061-0.096 s), where the tier took 101.5 and 134.7 s; ``python
#: tests/speed_reference.py`` prints a reading.
REFERENCE_WORKLOAD = "python=0.036 torch=0.068"


@pytest.fixture(scope="session")
def toy_tok():
    return toy_tokenizer()


@pytest.fixture(scope="session", params=REAL_TOKENIZERS)
def real_tokenizer(request):
    return request.param, load_tokenizer(request.param)


@contextlib.contextmanager
def _loaded_once(owner: object, name: str, key: Callable[..., Hashable] | None = None) -> Iterator[None]:
    """While in the block, ``owner.name(*args, **kwargs)`` runs once per ``key(*args, **kwargs)`` (default: the
    arguments) and later calls get that first result. Only for loaders whose result the code under test
    reads and never changes, such as a tokenizer."""
    load = getattr(owner, name)
    loaded: dict[Hashable, object] = {}

    def once(*args: Any, **kwargs: Any) -> object:
        k = key(*args, **kwargs) if key is not None else (args, tuple(sorted(kwargs.items())))
        if k not in loaded:
            loaded[k] = load(*args, **kwargs)
        return loaded[k]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, once)
        yield


@pytest.fixture(scope="session")
def loaded_once() -> Callable[..., contextlib.AbstractContextManager[None]]:
    """:func:`_loaded_once`, for a module fixture: ``with loaded_once(module, "load_tokenizer"): yield``."""
    return _loaded_once


@pytest.fixture
def fresh_plugins():
    """A new plugin manager for the test, restored to a new default one afterwards."""
    plugins = reset_plugins()
    yield plugins
    reset_plugins()


_FREEZE_BETWEEN_MODULES = pytest.StashKey[bool]()
_LAST_MODULE = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, vLLM: about a million objects) is kept out of the
    garbage collector's full passes from here on. ``AsyncLM.cleanup()`` runs one (models hold reference
    cycles), and over every import it took seconds, at each of the tier's hundreds of model closes; the
    objects the tests create are still collected as before."""
    gc.collect()
    gc.freeze()
    # Where no slow test runs, what outlives a test module (the session's fixtures, caches) is frozen too
    # when the next module starts, so that each full pass walks one module's objects. A session fixture
    # released later would keep its memory; the slow tier starts and closes whole engines, so not there.
    session.config.stash[_FREEZE_BETWEEN_MODULES] = not any(item.get_closest_marker("slow") for item in session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A new test module (the last one's module fixtures torn down): freeze what is left, collected first,
    where no slow test runs, and in any run after the last module of a ``SERIAL_FIRST`` folder. vLLM's engine
    unfreezes the whole heap at its shutdown (it froze it at its start), so after ``tests/vllm/`` each full
    pass in that worker walked every import again: 0.6 s at each model's ``cleanup()`` of the modules it ran
    next. What is frozen there is what the session keeps (its fixtures), and a vLLM engine's shutdown
    unfreezes it all again."""
    stash = item.config.stash
    module = item.nodeid.split("::")[0]
    last = stash.get(_LAST_MODULE, module)
    if last != module:
        leaving_serial = work_unit(last) in SERIAL_FIRST.values() and work_unit(module) != work_unit(last)
        if stash.get(_FREEZE_BETWEEN_MODULES, False) or leaving_serial:
            gc.collect()
            gc.freeze()
    stash[_LAST_MODULE] = module


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where it is not installed or -p no:xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one worker per CPU this process may use, at most
    ``MAX_WORKERS`` (``$PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides; ``-n 0`` runs in this process)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def work_unit(nodeid: str) -> str:
    """What runs whole on one worker: the folder of ``SERIAL_FIRST`` the test is in, else its module."""
    module = nodeid.split("::")[0]
    return next((name for folder, name in SERIAL_FIRST.items() if module.startswith(folder)), module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n`` (``--dist load``, the default): each :func:`work_unit` whole on one worker, so a module's
    fixtures are built once and vLLM's tests run one after another; units are handed out in collection order
    (:func:`run_order`). Another ``--dist`` is pytest-xdist's own.

    A worker that dies (a test that ends its process, or pytest-timeout's ``os._exit``) is replaced, and its
    test counts once: pytest-xdist reports the test it was running as failed ("worker 'gw0' crashed while
    running ..."), and the tests of its units that had not run yet are handed out again, to run once each."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # units in collection order: run_order's

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def remove_node(self, node: Any) -> str | None:
            """Forget ``node`` (it finished, or it died); return the test it died in, if it had one pending.

            pytest-xdist 3.8's ``LoadScopeScheduling`` put the dead worker's whole units back in the queue,
            the test it died in still pending: the replacement ran that test again (a second result for one
            item, and a test that always ends its process ended each replacement in turn), and got the units
            it had finished as empty batches. Here only the tests not yet started go back, at the head of the
            queue (in their place in :func:`run_order`)."""
            units = self.assigned_work.pop(node)
            left = [(scope, [nodeid for nodeid, done in unit.items() if not done]) for scope, unit in units.items()]
            left = [(scope, nodeids) for scope, nodeids in left if nodeids]
            if not left:
                return None
            # A worker runs its tests in the order they were sent: the first not completed is the one it died in.
            crashed = left[0][1].pop(0)
            requeued = [(scope, dict.fromkeys(nodeids, False)) for scope, nodeids in left if nodeids]
            for scope, unit in reversed(requeued):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
            if requeued:
                for other in self.assigned_work:
                    self._reschedule(other)
            return crashed

        def _reschedule(self, node: Any) -> None:
            """pytest-xdist's, and then: a worker starts a test once it has the next one or knows that none
            will come, so a worker left with one test (a replacement handed a unit of one, as a dead worker's
            leftovers can be) gets another unit, or is told there is none; else it waits for ever."""
            super()._reschedule(node)
            while not node.shutting_down and self._pending_of(self.assigned_work[node]) == 1:
                if self.workqueue:
                    self._assign_work_unit(node)
                else:
                    node.shutdown()

    return WorkUnitScheduling(config, log)


def run_order(nodeids: list[str]) -> list[str]:
    """``nodeids`` with their work units longest first (stable: a unit's tests keep their order): the folders of
    ``SERIAL_FIRST``, then ``LONG_NEXT`` in its order, then the other units by their number of tests, most first.
    Under xdist each free worker takes the next unit, so the longest chain starts at once and the short units
    fill in around the long ones and at the end.

    >>> run_order(["tests/a.py::t", "tests/test_install.py::t", "tests/b.py::t", "tests/b.py::u", "tests/vllm/c.py::t"])
    ['tests/vllm/c.py::t', 'tests/test_install.py::t', 'tests/b.py::t', 'tests/b.py::u', 'tests/a.py::t']
    """
    first = set(SERIAL_FIRST.values())
    sizes = Counter(work_unit(nodeid) for nodeid in nodeids)

    def rank(nodeid: str) -> tuple[int, int]:
        unit = work_unit(nodeid)
        if unit in first:
            return (0, 0)
        if unit in LONG_NEXT:
            return (1, LONG_NEXT.index(unit))
        return (2, -sizes[unit])

    return sorted(nodeids, key=rank)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Items in :func:`run_order`."""
    position = {nodeid: i for i, nodeid in enumerate(run_order([item.nodeid for item in items]))}
    items.sort(key=lambda item: position[item.nodeid])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.sized(name=(fast, full))``: the test's argument ``name`` is ``fast`` in the fast tier, and
    ``full`` in a second case marked ``slow`` and ``soak``: a randomised check runs small in the loop a
    developer waits for, and at its full size in the whole suite, with the same assertions."""
    for marker in metafunc.definition.iter_markers("sized"):
        for name, (fast, full) in marker.kwargs.items():
            if name in metafunc.fixturenames:
                slow = pytest.param(full, marks=[pytest.mark.slow, pytest.mark.soak], id=f"{name}={full}")
                metafunc.parametrize(name, [pytest.param(fast, id=f"{name}={fast}"), slow])


def pytest_addoption(parser: pytest.Parser) -> None:
    # The budget that fails CI, for the machine it was set on (whose reference workload took
    # fast_tier_reference there) and scaled by the workload's time on the machine at hand (tests/speed_reference.py):
    # 150 s on 2 cores, where the tier measures about 100 s over two workers, the margin for a slower run and a
    # fresh machine's first build of the tiny models (CONTRIBUTING.md, Tests).
    parser.addini("fast_tier_budget", "seconds the whole fast tier may take (pytest's own time)", default="150")
    parser.addini(
        "fast_tier_reference",
        "the reference workload's seconds (tests/speed_reference.py) where fast_tier_budget was set",
        default=REFERENCE_WORKLOAD,
    )
    parser.addini("fast_test_budget", "seconds one fast test may take, less its shared fixtures", default="2")
    parser.addoption(
        "--time-budget",
        action="store_true",
        help="fail the whole fast tier (-m 'not slow' over testpaths) past fast_tier_budget seconds (on when $CI "
        "is set); fast tests over fast_test_budget seconds of their own are named in any run",
    )


#: The garbage collector's thresholds in the test processes (Python's default: 700, 10, 10), and in the
#: processes they start (``PROCESS_SITE``). Those import torch, transformers and often vLLM and Ray, and tests make
#: many objects at once (a million batcher requests, a vocabulary's Tokens, SMC particles): with the default, a
#: full pass over the whole heap ran every few thousand survivors. That was a sixth of the slow tier's CPU
#: outside vLLM, and 2.5 of the 14 CPU-s of importing vLLM. Only when garbage is collected changes: a test that
#: needs it freed at a point collects it there (``AsyncLM.cleanup()`` does).
GC_THRESHOLDS = (7000, 10, 100)
#: First on ``PYTHONPATH`` of every process the session starts: its ``sitecustomize.py`` applies the thresholds
#: named in ``$GENLM_TEST_GC_THRESHOLDS`` (the client suites' and the test Ray cluster's shadow it, and do too).
PROCESS_SITE = str(Path(__file__).parent / "process_site")


def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    os.environ["GENLM_TEST_GC_THRESHOLDS"] = ",".join(map(str, GC_THRESHOLDS))
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if path[0] != PROCESS_SITE:  # a pytest-xdist worker inherits the controller's
        os.environ["PYTHONPATH"] = os.pathsep.join([PROCESS_SITE, *filter(None, path)])
    # Registered as a plugin object, not left as conftest hooks: a conftest's test hooks see only the tests
    # under its folder, and the fast tier also runs genlm_core's doctests.
    config.pluginmanager.register(TimeBudget(config), TimeBudget.NAME)
    if cap := os.environ.get(BATCH_CAP_ENV):
        cap_batches(int(cap))


#: Set (with ``GENLM_RECORD_BOUNDS``) for a run that records the tolerance checks' margins under another batch
#: split: every autobatcher of this run's processes computes at most that many requests at once. Tests that count
#: batches then fail; the rows' checks must not.
BATCH_CAP_ENV = "GENLM_BOUNDS_BATCH"


def cap_batches(cap: int) -> None:
    """Every ``AutoBatcher`` made from now on in this process takes at most ``cap`` requests per batch."""
    from genlm_core.batching import AutoBatcher

    init = AutoBatcher.__init__

    def capped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.batch_size = min(self.batch_size, cap)

    AutoBatcher.__init__ = capped  # type: ignore[method-assign]


class TimeBudget:
    """Prints the run's time, and names each test not marked ``slow`` that takes over ``fast_test_budget``
    seconds of its own; fails the whole fast tier (``-m "not slow"`` over ``testpaths``) over
    ``fast_tier_budget`` seconds where ``--time-budget`` is given or ``$CI`` is set. A file or a ``-k``
    selection on a busy laptop is only reported, never failed.

    A test's own time leaves out what fixtures of a wider scope than the function (a module's model, the
    session's engine) cost to set up and tear down: those are shared, and counted once in the tier's time.
    A fixture that starts something shared lazily reports it with :meth:`shared`. One test's time is too
    noisy on a shared machine to fail a run on; the tier's total, with its margin, is what fails.
    """

    NAME = "genlm-time-budget"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        selected_all = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
        self.fast_tier = selected_all and config.option.markexpr.strip() == "not slow"
        tiers = {"not slow": "fast tier", "slow": "slow tier", "": "whole suite"}
        self.tier = tiers.get(config.option.markexpr.strip(), "this run") if selected_all else "this run"
        self.enforced = config.option.time_budget or (_truthy(os.environ.get("CI")) and self.fast_tier)
        self.tier_budget = float(config.getini("fast_tier_budget"))
        self.reference = speed_reference.parse(config.getini("fast_tier_reference"))
        # The machine's speed, read where the tier's time is judged (the controller, not a worker) before its
        # workers start and again after they end: the slower reading counts, so that a machine loaded at
        # either end is not taken for a slow tier.
        self.controller = not hasattr(config, "workerinput")
        self.speeds: list[dict[str, float]] = []
        if self.controller and self.fast_tier:
            self.speeds.append(speed_reference.measure())
        self.test_budget = float(config.getini("fast_test_budget"))
        self.start = time.perf_counter()
        self.session: pytest.Session | None = None
        self.times: dict[str, dict[str, float]] = defaultdict(dict)  # fast test: {phase: seconds}
        self.shared_torn_down = False  # a shared fixture was finalized in the current phase
        self.shared_depth = 0
        self.shared_costs: dict[str, float] = defaultdict(float)  # what: seconds, summed from the reports
        self.phase_costs: dict[str, float] = defaultdict(float)  # what: seconds, in the current phase

    def budget(self) -> tuple[float, float]:
        """The fast tier's budget on this machine and the speed factor it was scaled by (1.0 unmeasured)."""
        if self.controller and self.fast_tier and len(self.speeds) == 1:
            self.speeds.append(speed_reference.measure())
        return speed_reference.budget(self.tier_budget, self.reference, self.speeds)

    def shared(self, what: str, seconds: float) -> None:
        """Count ``seconds`` spent inside a function-scoped fixture on something the session shares."""
        self.phase_costs[what] += seconds

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.start = time.perf_counter()
        self.session = session

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
        if fixturedef.scope == "function":
            return (yield)
        self.shared_depth += 1
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            self.shared_depth -= 1
            if self.shared_depth == 0:  # a shared fixture set up inside another is counted once
                took = time.perf_counter() - start
                self.shared(f"{fixturedef.argname} ({fixturedef.scope})", took)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
        if fixturedef.scope != "function":
            self.shared_torn_down = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
        """Written on the report where the fixtures ran (a worker, under xdist), read where it is logged (the
        controller, which runs no test): the phase's own seconds, less its shared fixtures, and their costs."""
        report = yield
        own = report.duration - sum(self.phase_costs.values())
        if report.when == "teardown" and self.shared_torn_down:
            own = 0.0  # the session's or a module's fixtures closed after this test: not its time
        report.genlm_own_s = max(own, 0.0)  # type: ignore[attr-defined]  # kept by xdist's serialisation
        report.genlm_shared_s = dict(self.phase_costs)  # type: ignore[attr-defined]
        self.shared_torn_down = False
        self.phase_costs.clear()
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        own = getattr(report, "genlm_own_s", None)
        if own is None:  # a report made without this plugin's makereport (a worker's crash)
            return
        for what, seconds in getattr(report, "genlm_shared_s", {}).items():
            self.shared_costs[what] += seconds
        if "slow" not in report.keywords:
            self.times[report.nodeid][report.when] = own

    @pytest.hookimpl(trylast=True)  # the run's time as late as it can be read, before pytest's last line
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        elapsed = time.perf_counter() - self.start
        over = [(nodeid, sum(phases.values()), phases) for nodeid, phases in self.times.items()]
        over = sorted((entry for entry in over if entry[1] > self.test_budget), key=lambda entry: -entry[1])
        budget, factor = self.budget()
        tier_over = self.fast_tier and elapsed > budget
        write = terminalreporter.write_line
        terminalreporter.section("time budget")
        if self.fast_tier:
            readings = ", ".join(speed_reference.describe(speed) for speed in self.speeds)
            write(
                f"{self.tier}: {elapsed:.1f} s (budget {budget:.0f} s: {self.tier_budget:g} s where the reference "
                f"workload took {speed_reference.describe(self.reference)}, times {factor:.2f} for this machine, "
                f"where it took {readings} at the start and the end)"
            )
        else:
            write(f"{self.tier}: {elapsed:.1f} s")
        shared = sorted(self.shared_costs.items(), key=lambda kv: -kv[1])
        if shared:
            write("shared fixtures, set up once: " + ", ".join(f"{what} {s:.1f} s" for what, s in shared[:6]))
        for nodeid, total, phases in over:
            parts = ", ".join(f"{when} {s:.1f} s" for when, s in phases.items() if s >= 0.05)
            write(f"fast test over {self.test_budget:g} s: {nodeid}: {total:.1f} s ({parts})", yellow=True)
        if over:
            write(
                f"a fast test takes under {self.test_budget:g} s of its own: share what it builds (a module or "
                "session fixture), size its randomised checks (@pytest.mark.sized), or mark it slow with its kind "
                "(CONTRIBUTING.md, Tests)"
            )
        if tier_over:
            write(f"the fast tier took {elapsed:.1f} s, over its budget of {budget:.0f} s here", red=self.enforced)
        if self.enforced and tier_over and self.session is not None:
            write("time budget exceeded: the run fails (--time-budget, or $CI with the whole fast tier)", red=True)
            if self.session.exitstatus == pytest.ExitCode.OK:
                self.session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no")
