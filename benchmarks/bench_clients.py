"""Real client programs end to end: genlm-backend 0.3.1 versus genlm through genlm_compat, in one run.

The genlm-control program (PromptedLLM + a boolean FSA, the direct token sampler and AWRS under SMC) and
the llamppl lipogram under ``smc_steer`` from ``tests/compat/programs.py``, unmodified, on the same model
and seed: genlm-backend's ``AsyncTransformer`` against genlm's ``hf`` backend wrapped by
``genlm_compat.wrap``. Runs are interleaved (seed, genlm, seed, genlm, ...) with every cache cleared before
each run; the table gives medians, the spread (min and max of the per-round ratios) and how many sampled
particles were identical on both sides. Rows of the two libraries agree to float32 rounding (both within
~5e-5 of an unbatched forward pass on SmolLM2; batch shapes differ), so on a real model a draw that lands
within that distance of a boundary can go the other way, and the particle's future with it.

    python benchmarks/bench_clients.py [--model smollm2|tiny] [--rounds 3] [--particles 16] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import genlm_compat
from genlm.backend.llm import AsyncTransformer as SeedTransformer

from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir, tiny_model_dir
from tests.compat.programs import control_program, llamppl_program


def matches(a: dict, b: dict) -> tuple[int, int]:
    """(identical samples, samples): particles whose sampled sequence is the same on both sides."""
    if "texts" in a:
        pairs = list(zip(a["texts"], b["texts"]))
    else:
        pairs = [p for key in ("direct", "awrs") for p in zip(a[key]["contexts"], b[key]["contexts"])]
    return sum(x == y for x, y in pairs), len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    path = str(smollm2_dir() if args.model == "smollm2" else tiny_model_dir("llama", tokenizer="gpt2"))
    sides = {"genlm-backend": SeedTransformer.from_name(path), "genlm": genlm_compat.load(path, "hf")}
    programs = {"genlm-control (direct + AWRS, SMC)": control_program, "llamppl lipogram (smc_steer)": llamppl_program}
    rows = []
    for title, program in programs.items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        outputs: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(args.rounds + 1):  # round 0 warms up (compilation, allocator)
            for side, lm in sides.items():
                lm.clear_cache()
                start = time.perf_counter()
                out = asyncio.run(program(lm, seed=r, n_particles=args.particles, max_tokens=args.tokens))
                if r:
                    times[side].append(time.perf_counter() - start)
                    outputs[side].append(out)
        ratios = [s / g for s, g in zip(times["genlm-backend"], times["genlm"])]
        counts = [matches(a, b) for a, b in zip(outputs["genlm-backend"], outputs["genlm"])]
        identical = f"{sum(c[0] for c in counts)}/{sum(c[1] for c in counts)}"
        rows.append(
            [
                title,
                f"{statistics.median(times['genlm-backend']):.2f} s",
                f"{statistics.median(times['genlm']):.2f} s",
                f"{statistics.median(ratios):.2f}x",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
                identical,
            ]
        )
    print(f"model: {args.model}; {args.particles} particles, {args.tokens} tokens, {args.rounds} interleaved rounds\n")
    print(table(["program", "genlm-backend", "genlm", "speed-up", "spread", "identical samples"], rows))


if __name__ == "__main__":
    main()
