"""First on ``PYTHONPATH`` of the processes a test session starts (``tests/conftest.py`` puts it there): they run
with the session's garbage-collector thresholds (``genlm_test_gc``), and without the imports nothing they run
uses (``genlm_test_imports``)."""

from __future__ import annotations

if __name__ == "sitecustomize":  # imported by Python's site at start, not by pytest's collection of this folder
    import genlm_test_gc
    import genlm_test_imports

    genlm_test_gc.apply()
    genlm_test_imports.leave_out()
