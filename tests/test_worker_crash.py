"""A pytest-xdist worker that dies under ``tests/conftest.py``'s scheduler (``pytest_xdist_make_scheduler``):
the test it died in counts once, as failed with the crash, and every other test runs once. A pytest run of its
own, over a folder written here whose conftest takes the scheduler and the run order from ``tests/conftest.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

PROJECT_CONFTEST = Path(__file__).parent / "conftest.py"

CONFTEST = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("genlm_tests_conftest", {str(PROJECT_CONFTEST)!r})
_project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_project)
pytest_xdist_make_scheduler = _project.pytest_xdist_make_scheduler
pytest_collection_modifyitems = _project.pytest_collection_modifyitems
"""
#: Three work units (modules). ``test_b.py::test_crash`` ends its worker's process the first time it runs (as
#: pytest-timeout's thread method does past its limit) and passes if it is run again, as the client suites' test
#: did in the run that reported 845 results for 844 items.
MODULES = {
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_b.py": (
        "import os\nfrom pathlib import Path\n\n"
        "def test_before(): pass\n\n"
        "def test_crash():\n"
        "    ran = Path(__file__).with_name('crashed-once')\n"
        "    if not ran.exists():\n"
        "        ran.touch()\n"
        "        os._exit(1)\n\n"
        "def test_after(): pass\n"
    ),
    "test_c.py": "def test_c1(): pass\ndef test_c2(): pass\n",
}
ITEMS = {f"{module[:-3]}::{name}" for module, text in MODULES.items() for name in re.findall(r"def (test_\w+)", text)}


@pytest.mark.slow
@pytest.mark.process
def test_a_crashed_workers_test_counts_once_and_the_others_of_its_units_run_once(tmp_path: Path) -> None:
    # This folder is the run's root: none of the repository's options.
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for module, text in MODULES.items():
        (tmp_path / module).write_text(text)
    junit = tmp_path / "results.xml"
    command = [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-rA", f"--junitxml={junit}"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env={**os.environ}, timeout=300)
    out = run.stdout + run.stderr
    assert "replacing crashed worker" in out, out  # the worker did die, and was replaced

    results = Counter()
    failed = {}
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        results[test] += 1
        problems = [child for child in case if child.tag in ("failure", "error")]
        if problems:
            failed[test] = " ".join((p.get("message") or "") + (p.text or "") for p in problems)
    counts = f"results per item: {dict(results)}; failed: {failed}\n{out}"
    assert set(results) == ITEMS, counts
    assert {test: n for test, n in results.items() if n != 1} == {}, counts
    assert list(failed) == ["test_b::test_crash"], counts
    assert "crashed while running 'test_b.py::test_crash'" in failed["test_b::test_crash"], counts
    # pytest's own count agrees: one result per item.
    assert re.search(rf"\b1 failed, {len(ITEMS) - 1} passed\b", out), counts
