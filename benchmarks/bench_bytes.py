"""Byte-level log-probability (prefill) of a 300-byte English text, K=5: ours vs genlm-bytes 0.2.0.

Same model for both: a tiny 2-layer float32 Llama with the GPT-2 tokenizer (random weights), through
each library's HF backend. Prints the time, bytes per second and the log Z each computes.

    python benchmarks/bench_bytes.py
"""

from __future__ import annotations

import asyncio
import sys
import time

from _common import fmt_s, run_seed, seed_python

from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_core.cli import table
from genlm_core.testing.models import tiny_model_dir

TEXT = (
    b"The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    b"polished the great lens, and watched the ships pass far out on the grey water. In winter the storms "
    b"came in hard from the north, and he would sit by the lamp for hours, listening to the wind and the sea. "
)[:300]

SEED = """
import asyncio, json, time
from genlm.backend.llm import AsyncTransformer
from genlm.bytes import ByteBeamState, BeamParams
lm = AsyncTransformer.from_name({path!r}, **{kwargs!r})
async def main():
    beam = await ByteBeamState.initial(lm, BeamParams(K={k}, heal=False))
    t0 = time.perf_counter()
    after = await beam.prefill({text!r})
    return time.perf_counter() - t0, float(after.logZ)
seconds, log_z = asyncio.run(main())
print(json.dumps({{"seconds": seconds, "logZ": log_z}}))
"""


async def ours(path: str, k: int) -> tuple[float, float]:
    from genlm_hf import AsyncTransformer

    lm = AsyncTransformer.from_name(path, batch_size=256, timeout=0.0)
    beam = await ByteBeamState.initial(lm, BeamParams(K=k, heal=False))
    await (await beam.prefill(TEXT[:20])).logp_next()  # warm-up: JIT compilation, first model call
    lm.clear_cache()
    t0 = time.perf_counter()
    after = await beam.prefill(TEXT)
    seconds = time.perf_counter() - t0
    beam.cleanup()
    return seconds, after.logZ


def main() -> None:
    k = 5
    path = str(tiny_model_dir("llama"))
    t_ours, z_ours = asyncio.run(ours(path, k))
    rows = [
        ["ours (genlm_core.bytes), LM timeout=0", fmt_s(t_ours), f"{len(TEXT) / t_ours:.1f}", f"{z_ours:.4f}", "1.0x"]
    ]
    if seed_python() and "--no-seed" not in sys.argv:
        for label, kwargs in (("its defaults (timeout=0.02)", {}), ("tuned like ours (timeout=0)", {"timeout": 0.0})):
            try:
                seed = run_seed(SEED.format(path=path, k=k, text=TEXT, kwargs=kwargs))
            except RuntimeError as exc:
                print(f"seed failed: {exc}", file=sys.stderr)
                continue
            rows.append(
                [
                    f"genlm-bytes 0.2.0, {label}",
                    fmt_s(seed["seconds"]),
                    f"{len(TEXT) / seed['seconds']:.1f}",
                    f"{seed['logZ']:.4f}",
                    f"{seed['seconds'] / t_ours:.1f}x slower",
                ]
            )
    print(
        f"prefill of {len(TEXT)} bytes, K={k}, tiny 2-layer float32 Llama (GPT-2 tokenizer); target: ours >= 20x faster"
    )
    print(table(["implementation", "time", "bytes/s", "log Z", "vs ours"], rows))


if __name__ == "__main__":
    main()
