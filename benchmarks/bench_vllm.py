"""Full-vocabulary next-token logprobs on vLLM (SmolLM2-135M, one engine): ours vs the limit, one run.

N concurrent requests, each the full distribution after its own prompt. Columns: ours (AsyncVirtualLM,
logits captured inside the engine), vLLM's own ``generate(max_tokens=1)`` on the same prompts (the
limit: the same model work, no distribution returned), and ``SamplingParams(logprobs=-1)`` (vLLM's
built-in way to get the whole distribution). The prefix cache is reset before each measurement.

    python benchmarks/bench_vllm.py [--n 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from genlm_vllm import AsyncVirtualLM

    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(
        str(smollm2_dir()),
        dtype="float32",
        max_model_len=2048,
        batch_size=1024,
        timeout=0.005,
        cache_size=0,
        engine_opts={"max_logprobs": -1, "kv_cache_memory_bytes": 2**30},
    )
    start = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 40000, (int(k),), generator=g).tolist()
        for k in torch.randint(16, 64, (args.n,), generator=g)
    ]
    tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def timed(fn):
        best = float("inf")
        for _ in range(args.repeat):
            lm.llm.reset_prefix_cache()
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    async def ours():
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))

    plain = SamplingParams(max_tokens=1, detokenize=False)
    full = SamplingParams(max_tokens=1, logprobs=-1, detokenize=False)
    t_plain = timed(lambda: lm.llm.generate(tokens, plain, use_tqdm=False))
    t_ours = timed(lambda: asyncio.run(ours()))
    t_full = timed(lambda: lm.llm.generate(tokens, full, use_tqdm=False))
    print(
        f"vLLM engine (SmolLM2-135M, float32, CPU build) started in {start:.0f} s; N={args.n} prompts of 16-63 tokens"
    )
    print(
        table(
            ["method", "time", "ratio to the limit"],
            [
                ["generate(max_tokens=1) (the limit)", f"{t_plain * 1e3:.0f} ms", "1.00x"],
                [
                    "ours: full-vocab logprobs (capture in engine)",
                    f"{t_ours * 1e3:.0f} ms",
                    f"{t_ours / t_plain:.2f}x (target <= 1.1)",
                ],
                ["SamplingParams(logprobs=-1)", f"{t_full * 1e3:.0f} ms", f"{t_full / t_plain:.2f}x"],
            ],
        )
    )
    lm.cleanup()


if __name__ == "__main__":
    main()
