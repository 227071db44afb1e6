"""The test session's garbage-collector thresholds, in a process it started (``tests/conftest.py`` says why).

``tests/conftest.py`` puts this folder first on ``PYTHONPATH`` and the thresholds in
``$GENLM_TEST_GC_THRESHOLDS``; this folder's ``sitecustomize.py`` applies them at each process's start, and so do
the ``sitecustomize.py`` files that shadow it (the client suites', the test Ray cluster's)."""

from __future__ import annotations

import gc
import os

VARIABLE = "GENLM_TEST_GC_THRESHOLDS"


def apply() -> None:
    """Set the thresholds ``$GENLM_TEST_GC_THRESHOLDS`` names (``"7000,10,100"``); nothing where it is unset."""
    if os.environ.get(VARIABLE):
        gc.set_threshold(*(int(n) for n in os.environ[VARIABLE].split(",")))
