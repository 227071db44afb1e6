"""How long a vLLM engine takes to start and stop, its processes spawned or forked from a fork server.

One process starts and cleans up the same engine (the tests' tiny Llama) again and again, alternating
``start_method="spawn"`` and ``"forkserver"`` (forkserver, spawn, forkserver, ...): the first forkserver
start also starts the fork server, which imports vLLM, and is reported on its own row. For each start:
the seconds until the engine answers, the seconds ``cleanup()`` takes, and the machine's busy CPU
seconds over both (from ``/proc/stat``: run it on a quiet machine). Medians with min-max; the last
column is forkserver's median over spawn's.

    python benchmarks/vllm_start.py [--layout multiprocess|async|tp2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

from _common import TINY_VLLM_ENGINE, TINY_VLLM_MODEL, busy_cpu_seconds

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.testing.models import tiny_model_dir

MODEL, ENGINE = TINY_VLLM_MODEL, TINY_VLLM_ENGINE
LAYOUTS: dict[str, dict[str, Any]] = {
    "multiprocess": {"multiprocess": True},
    "async": {"engine": "async"},
    "tp2": {"engine_opts": {**ENGINE, "tensor_parallel_size": 2}},
}


def one_start(path: str, layout: str, method: str) -> dict[str, float]:
    """Start the engine, ask it for one row, clean it up: seconds of each, and busy CPU seconds."""
    cpu, t = busy_cpu_seconds(), time.perf_counter()
    options = {
        "dtype": "float32",
        "max_model_len": 2048,
        "timeout": 0.01,
        "start_method": method,
        "engine_opts": ENGINE,
    }
    lm = load_model_by_name(path, backend="vllm", llm_opts={**options, **LAYOUTS[layout]})
    lm.next_token_logprobs_sync([1, 2, 3])
    up = time.perf_counter() - t
    t = time.perf_counter()
    lm.cleanup()
    return {"start": up, "cleanup": time.perf_counter() - t, "cpu": busy_cpu_seconds() - cpu}


def summary(runs: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), default="multiprocess")
    parser.add_argument("--rounds", type=int, default=3, help="starts of each method after the first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = str(tiny_model_dir("llama", **MODEL))
    first = one_start(path, args.layout, "forkserver")
    runs: dict[str, list[dict[str, float]]] = {"spawn": [], "forkserver": []}
    for _ in range(args.rounds):
        for method in ("spawn", "forkserver"):
            runs[method].append(one_start(path, args.layout, method))
    rows = [["forkserver, first (starts the server)", "1", f"{first['start']:.1f}", f"{first['cleanup']:.1f}",
             f"{first['cpu']:.1f}", ""]]  # fmt: skip
    spawn = statistics.median(r["start"] for r in runs["spawn"])
    for method, found in runs.items():
        ratio = statistics.median(r["start"] for r in found) / spawn
        rows.append([method, str(len(found)), summary(found, "start"), summary(found, "cleanup"),
                     summary(found, "cpu"), f"{ratio:.2f}x"])  # fmt: skip
    print(f"vLLM engine start, {args.layout}, tiny Llama; medians (min-max) in seconds; {os.cpu_count()} CPUs")
    print(table(["start method", "starts", "start", "cleanup", "busy CPU s", "start vs spawn"], rows))


if __name__ == "__main__":
    main()
