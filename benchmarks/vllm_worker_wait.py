"""How a vLLM engine's workers wait for the next step: vLLM's spin against genlm-vllm's nap.

``VLLMOptions.worker_wait``: in the second after each step, vLLM's workers check for the next one in a
busy loop (``"spin"``); with ``"nap"`` they sleep 0.5 ms between checks. A particle program does work
of its own between steps (potentials, resampling), and on vLLM's CPU build its workers share their
cores with it. This runs that program: ``--particles`` contexts grow by one token per step, and between
steps the caller computes for ``--work`` ms of its own CPU time (a Python loop), so a core taken by a
spinning worker shows as a longer step. With ``--neighbour``, another program shares the machine: a
process that counts in a loop, whose count per second of each step is reported (the work a spinning
worker takes from whatever else runs there).

One process starts the engine (the tests' tiny Llama) once per round and method, alternating (spin,
nap, spin, ...), and runs the program once per ``--work`` on it. Each step: its wall time, the part
spent in the model call, the part spent in the caller's work, and the machine's busy CPU seconds
(``/proc/stat``: run it on a quiet machine). Medians over steps and rounds, with min-max of the
rounds' medians; the last column is nap's step over spin's.

    python benchmarks/vllm_worker_wait.py [--layout tp2|multiprocess] [--rounds 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import random
import statistics
import time
from typing import Any

from _common import TINY_VLLM_ENGINE, TINY_VLLM_MODEL, busy_cpu_seconds

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.testing.models import tiny_model_dir

LAYOUTS: dict[str, dict[str, Any]] = {
    "multiprocess": {"multiprocess": True, "engine_opts": TINY_VLLM_ENGINE},
    "tp2": {"engine_opts": {**TINY_VLLM_ENGINE, "tensor_parallel_size": 2}},
}
METHODS = ("spin", "nap")


def work(ms: float) -> None:
    """Compute for ``ms`` of this thread's own CPU time (what the caller's program does between steps)."""
    end = time.thread_time() + ms / 1000
    x = 0
    while time.thread_time() < end:
        x += 1


def count_forever(counter: Any) -> None:
    """The neighbour: count as fast as one core allows."""
    while True:
        counter.value += 1


def one_round(
    path: str, layout: str, method: str, particles: int, steps: int, works: list[float], counter: Any = None
) -> dict:
    """Start the engine with ``worker_wait=method``, run the program once per caller's work in ``works``,
    clean up: ``{work ms: per-step medians}``."""
    options = {"dtype": "float32", "max_model_len": 2048, "timeout": 0.01, "worker_wait": method}
    lm = load_model_by_name(path, backend="vllm", llm_opts={**options, **LAYOUTS[layout]})
    found = {}
    try:
        for ms in works:
            rng = random.Random(0)
            contexts = [[1 + i, 2, 3] for i in range(particles)]
            lm.clear_cache()
            lm.batch_next_token_logprobs_sync(contexts)  # warm
            rows: dict[str, list[float]] = {"step": [], "model call": [], "caller's work": [], "busy cpu": []}
            rows["neighbour"] = []
            for _ in range(steps):
                contexts = [c + [rng.randrange(5, 5000)] for c in contexts]
                counted = counter.value if counter is not None else 0
                cpu, t0 = busy_cpu_seconds(), time.perf_counter()
                lm.batch_next_token_logprobs_sync(contexts)
                t1 = time.perf_counter()
                work(ms)
                t2 = time.perf_counter()
                rows["step"].append(t2 - t0)
                rows["model call"].append(t1 - t0)
                rows["caller's work"].append(t2 - t1)
                rows["busy cpu"].append(busy_cpu_seconds() - cpu)
                rows["neighbour"].append(((counter.value if counter is not None else 0) - counted) / (t2 - t0))
            found[ms] = {k: statistics.median(v) for k, v in rows.items()}
    finally:
        lm.cleanup()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="tp2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--work", type=float, nargs="+", default=[0.0, 5.0, 20.0], help="caller's ms between steps")
    parser.add_argument("--neighbour", action="store_true", help="another process counts in a loop meanwhile")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = str(tiny_model_dir("llama", **TINY_VLLM_MODEL))
    found: dict[tuple[float, str], list[dict[str, float]]] = {}
    counter, neighbour = None, None
    if args.neighbour:
        counter = multiprocessing.get_context("spawn").Value("q", 0, lock=False)
        neighbour = multiprocessing.get_context("spawn").Process(target=count_forever, args=(counter,), daemon=True)
        neighbour.start()
    try:
        for _ in range(args.rounds):
            for method in METHODS:
                runs = one_round(path, args.layout, method, args.particles, args.steps, args.work, counter)
                for ms, medians in runs.items():
                    found.setdefault((ms, method), []).append(medians)
    finally:
        if neighbour is not None:
            neighbour.kill()
    rows = []
    for ms in args.work:
        medians = {m: {k: statistics.median(r[k] for r in found[ms, m]) for k in found[ms, m][0]} for m in METHODS}
        for method in METHODS:
            runs = found[ms, method]
            cells = [f"{ms:g}", method]
            keys = ["step", "model call", "caller's work", "busy cpu"] + (["neighbour"] if args.neighbour else [])
            for key in keys:
                low, high = min(r[key] for r in runs), max(r[key] for r in runs)
                unit = {"busy cpu": 1, "neighbour": 1e-6}.get(key, 1000)
                cells.append(f"{medians[method][key] * unit:.2f} ({low * unit:.2f}-{high * unit:.2f})")
            cells.append(f"{medians[method]['step'] / medians['spin']['step']:.2f}x")
            rows.append(cells)
    print(f"{args.layout}, {args.particles} particles, {args.steps} steps per round, {args.rounds} rounds")
    header = ["caller ms", "worker_wait", "step ms", "model call ms", "caller's work ms", "busy CPU s"]
    header += ["neighbour Mcounts/s"] if args.neighbour else []
    print(table([*header, "step vs spin"], rows))


if __name__ == "__main__":
    main()
