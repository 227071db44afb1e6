"""Importing genlm-backend without its side effects on the process.

genlm-backend's vLLM module sets ``VLLM_USE_V2_MODEL_RUNNER``, ``VLLM_USE_FLASHINFER_SAMPLER`` and
``VLLM_ENABLE_V1_MULTIPROCESSING`` in ``os.environ`` when it is imported; the first makes vLLM's CPU build
refuse to start (it needs Triton) for genlm-vllm in the same process. We import it once here and put the
environment back as it was.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def import_seed() -> ModuleType:
    """``genlm.backend``, imported with ``os.environ`` left as it was."""
    before = dict(os.environ)
    try:
        return importlib.import_module("genlm.backend")
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


import_seed()
