"""First on ``PYTHONPATH`` of the client suites' processes (``client_suites.py``): there vLLM cannot be
imported, as on a machine without it. ``import vllm`` raises ``ModuleNotFoundError``, so genlm-backend takes
its own no-vLLM path; ``importlib.util.find_spec("vllm")`` still finds it, so genlm-vllm's plugin registers
its backend as usual (nothing in the suites loads it).

Under a test session, the suites' processes also get its garbage-collector thresholds
(``tests/process_site/genlm_test_gc.py``)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType

HIDDEN = "vllm"


class Hidden(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        raise ModuleNotFoundError(f"No module named {spec.name!r} (hidden from the client suites)", name=spec.name)

    def exec_module(self, module: ModuleType) -> None:  # a loader needs one for create_module to be used
        raise ModuleNotFoundError(f"No module named {module.__name__!r}", name=module.__name__)


if __name__ == "sitecustomize":  # imported by Python's site at start, not by pytest's collection of this folder
    sys.meta_path.insert(0, Hidden())
    if os.environ.get("GENLM_TEST_GC_THRESHOLDS"):  # started by a test session, with tests/process_site on the path
        import genlm_test_gc

        genlm_test_gc.apply()
