"""Shared benchmark helpers: timing, tables, and running a snippet in the seed library's venv.

The seed libraries (genlm-backend 0.3.1, genlm-bytes 0.2.0) live in their own virtualenv so that
they never mix with ours: ``bash benchmarks/seed_venv.sh`` creates ``.seedvenv``; set
``GENLM_SEED_PYTHON`` to use another interpreter.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The tests' tiny vLLM model (head dim 64, as vLLM's CPU attention needs) and a small engine for it.
TINY_VLLM_MODEL: dict[str, Any] = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
TINY_VLLM_ENGINE: dict[str, Any] = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 256 * 2**20,
    "enforce_eager": True,
}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every core; idle and iowait left out):
    the difference over a run is its busy CPU, from ``/proc/stat`` (run it on a quiet machine)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def seed_python() -> str | None:
    """The seed venv's interpreter, or None when it is not installed."""
    path = os.environ.get("GENLM_SEED_PYTHON", str(ROOT / ".seedvenv" / "bin" / "python"))
    return path if Path(path).exists() else None


def run_seed(code: str, timeout: float = 3600) -> dict:
    """Run ``code`` in the seed venv; it must print one JSON object on its last line."""
    python = seed_python()
    if python is None:
        raise RuntimeError("seed venv not found: run `bash benchmarks/seed_venv.sh` or set GENLM_SEED_PYTHON")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"seed snippet failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(fn: Callable[[], object], repeat: int = 5, number: int = 1, warmup: int = 3) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` rounds of ``number`` calls, after ``warmup`` calls
    (JIT compilation, allocator and page-cache warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
