"""SMC workload on the mlx backend: ours vs a plain batched mlx-lm decode of the same shapes, one run.

Same workload and model as ``bench_hf.py`` (66M-parameter float32 Llama, N particles x T steps, each
particle awaiting next_token_logprobs of its own context and sampling a token). The plain decode uses
mlx-lm's own BatchKVCache. The mlx-cpu wheel bundles a slow reference BLAS; for the OpenBLAS numbers
run ``bash benchmarks/mlx_openblas.sh`` (preloads Debian's OpenBLAS, no system install).

    python benchmarks/bench_mlx.py [--n 32 --t 32]
"""

from __future__ import annotations

import argparse
import os
import time

import mlx.core as mx
import numpy as np
import torch
from bench_hf import MODEL, ours
from mlx_lm.models.cache import BatchKVCache

from genlm_core.cli import table
from genlm_core.testing.models import tiny_model_dir


def plain_decode(model, prompt: list[int], n: int, steps: int) -> float:
    """The limit: mlx-lm's batched decode with BatchKVCache, sampling like the particles."""
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    t0 = time.perf_counter()
    cache = [BatchKVCache([0] * n) for _ in model.layers]
    ids = mx.array([prompt] * n)
    for _ in range(steps):
        h = model.model(ids, cache=cache)[:, -1:, :]
        logits = model.lm_head(h)[:, 0, :] if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear(h)[:, 0]
        logprobs = torch.log_softmax(torch.from_numpy(np.array(logits.astype(mx.float32))), -1)
        nxt = [int(torch.multinomial(torch.softmax(lp.double(), -1), 1, generator=g)) for lp, g in zip(logprobs, gens)]
        ids = mx.array(nxt)[:, None]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--t", type=int, default=32)
    args = ap.parse_args()
    from genlm_mlx import AsyncMlxLM

    path = str(tiny_model_dir(**MODEL))
    lm = AsyncMlxLM.from_name(path, batch_size=args.n, timeout=0.001)
    prompt = lm.tokenizer.encode("It was a bright cold day in April, and the clocks were striking thirteen.")
    ours(lm, prompt, args.n, 2)  # warm-up
    plain_decode(lm.model, prompt, args.n, 2)
    t_ours = ours(lm, prompt, args.n, args.t)
    t_plain = plain_decode(lm.model, prompt, args.n, args.t)
    blas = "OpenBLAS (preloaded)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "bundled reference BLAS"
    print(f"mlx {mx.__version__} on {mx.default_device()}, {blas}; 66M float32 Llama")
    print(
        table(
            ["workload", "ours", "plain mlx-lm decode", "ours / plain (target <= 1.5)"],
            [[f"N={args.n}, T={args.t}", f"{t_ours:.2f} s", f"{t_plain:.2f} s", f"{t_ours / t_plain:.2f}x"]],
        )
    )


if __name__ == "__main__":
    main()
