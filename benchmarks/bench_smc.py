"""SMC on genlm against the engine's own decode of the same tokens, one run, interleaved.

For each backend (vLLM, HF, MLX, llama.cpp) one model is loaded (SmolLM2-135M: float32; for llama.cpp
the shipped Q4_1 GGUF, or ``llamacpp-f32`` for its float32 dequantization), then for each case
(prompt length, steps T, constrained or not) two things are timed, alternating (engine, ours,
engine, ours, ...), every cache cleared before each:

- engine: the engine's own batched decode of N continuations of T tokens from the prompt
  (vLLM: ``generate(n=N, max_tokens=T, ignore_eos=True)``; HF: ``model.generate`` with its KV cache;
  MLX: mlx-lm's batched decode with ``BatchKVCache``, as in ``bench_mlx.py``; llama.cpp: the prompt
  decoded in one sequence, copied to N, then T ``llama_decode`` calls of N tokens through the same
  bindings, each token the argmax of its row);
- ours: ``examples/smc.py``'s SMC (N particles, masked proposal, multinomial resampling when ESS
  falls below N/2) for T steps, each particle awaiting its own ``next_token_logprobs``. EOS is
  outside the mask so that every particle runs all T steps: the same N x T tokens as the engine.

Beside the times: rows the model computed per step, tokens it ran per step (vLLM: continued
sessions' new tokens plus fresh prompts' uncached part; HF: its KV reuse's count), tokens vLLM's
prefix cache served, tokens forks copied from their parent's unfinished block
(:mod:`genlm_vllm.in_engine.forks`), and the share of the run in which the model was computing.

    python benchmarks/bench_smc.py [--backends vllm,hf,llamacpp] [--rounds 3] [--n 32] [--steps 32,64]
    python benchmarks/bench_smc.py --versus hf,llamacpp   # the same SMC on two backends, interleaved
    bash benchmarks/mlx_openblas.sh benchmarks/bench_smc.py --backends mlx   # MLX with OpenBLAS
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from smc import smc, token_mask


def prompt_of(lm: Any, length: int) -> list[int]:
    """The first ``length`` tokens of a repeated sentence (the same prefix for every length)."""
    text = "The history of the city begins with a small settlement on the river. " * (40 + length // 8)
    ids = list(lm.tokenizer.encode(text))
    if len(ids) < length:
        raise ValueError(f"length={length}: the prompt text has only {len(ids)} tokens")
    return ids[:length]


def llama_decode(engine: Any, prompt: list[int], n: int, steps: int) -> None:
    """llama.cpp's own batched decode: the prompt once, copied to ``n`` sequences, then ``steps``
    decode calls of one token per sequence (the argmax of its row)."""
    import numpy as np

    from genlm_llamacpp.engine import stream

    engine.decode_stream(*stream([(prompt, 0, 0)]))
    for seq in range(1, n):
        engine.copy_sequence(0, seq)
    last = np.zeros(n, np.int64)
    for t in range(steps):
        last = engine.decode_stream(*stream([([int(last[s])], len(prompt) + t, s) for s in range(n)])).argmax(1)


def load(backend: str, n: int, extra: dict[str, Any]) -> Any:
    """SmolLM2-135M on ``backend`` (float32; llama.cpp: the Q4_1 GGUF, or float32 as ``llamacpp-f32``)."""
    opts: dict[str, Any] = {"batch_size": n, "timeout": 0}
    if backend in ("hf", "vllm"):
        opts["dtype"] = "float32"
    if backend == "vllm":
        opts["engine_opts"] = {"kv_cache_memory_bytes": 2**30, "seed": 0}
    if backend.startswith("llamacpp"):
        model, name = ("smollm2-f32" if backend == "llamacpp-f32" else "smollm2"), "llamacpp"
    else:
        model, name = str(smollm2_dir()), backend  # mlx-lm keeps the checkpoint's float32
    t0 = time.perf_counter()
    lm = load_model_by_name(model, backend=name, llm_opts={**opts, **extra})
    print(f"{backend}: loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return lm


class Engine:
    """The engine's own decode of N x T tokens from one prompt, and what to reset between runs."""

    def __init__(self, lm: Any, backend: str):
        self.lm, self.backend = lm, backend

    def decode(self, prompt: list[int], n: int, steps: int) -> None:
        if self.backend == "vllm":
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = SamplingParams(n=n, max_tokens=steps, ignore_eos=True, detokenize=False, seed=0)
            self.lm.driver.engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        elif self.backend.startswith("llamacpp"):
            llama_decode(self.lm.engine, prompt, n, steps)
        elif self.backend == "mlx":
            from bench_mlx import plain_decode

            plain_decode(self.lm.model, prompt, n, steps)
        else:
            ids = torch.tensor([prompt] * n, device=self.lm.device)  # on the model's device (CUDA too)
            with torch.inference_mode():
                self.lm.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    do_sample=True,
                    top_k=0,
                    pad_token_id=0,
                )

    def reset(self) -> None:
        self.lm.clear_cache()  # output cache, KV states / prefix cache, live sessions
        gc.collect()


def counters(lm: Any, backend: str) -> dict[str, float]:
    busy = {"busy": lm.batcher.stats.busy_seconds}  # the model's computing time
    if backend == "vllm":
        if lm.driver.sessions is None:  # live={'enabled': False}: rows only
            return {"rows": lm.batcher.stats.items, "computed": 0, "cached": 0, "copied": 0, **busy}
        s = lm.driver.sessions.stats
        work = {"rows": s.rows, "computed": s.tokens_computed, "cached": s.tokens_cached, "copied": s.tokens_copied}
        return {**work, **busy}
    if backend.startswith("llamacpp"):
        q = lm.sequences.stats
        return {"rows": q.rows, "computed": q.tokens_computed, "cached": 0, "copied": q.tokens_copied, **busy}
    return {"rows": lm.batcher.stats.items, "computed": lm.tokens_computed, "cached": 0, "copied": 0, **busy}


def run_case(
    engine: Engine, backend: str, prompt: list[int], n: int, steps: int, mask: torch.Tensor, rounds: int, ess: float
):
    lm = engine.lm
    times: dict[str, list[float]] = {"engine": [], "ours": []}
    work: dict[str, float] = {}
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        engine.reset()
        t0 = time.perf_counter()
        engine.decode(prompt, n, steps)
        t_engine = time.perf_counter() - t0
        engine.reset()
        before = counters(lm, backend)
        t0 = time.perf_counter()
        asyncio.run(smc(lm, prompt, n, steps, mask, set(), seed=r, ess_threshold=ess))
        t_ours = time.perf_counter() - t0
        after = counters(lm, backend)
        if r:
            times["engine"].append(t_engine)
            times["ours"].append(t_ours)
            work = {k: (after[k] - before[k]) / steps for k in after}
            work["busy"] = (after["busy"] - before["busy"]) / t_ours  # share of the run the model computed
    ratios = [o / e for o, e in zip(times["ours"], times["engine"], strict=True)]
    return statistics.median(times["engine"]), statistics.median(times["ours"]), ratios, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="vllm,hf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", default="32,64")
    ap.add_argument("--prompts", default="24,500")
    ap.add_argument(
        "--opts", type=json.loads, default={}, help='more llm_opts, as JSON: \'{"live": {"enabled": false}}\''
    )
    ap.add_argument("--ess", type=float, default=0.5, help="resample below this ESS / N (0: never)")
    ap.add_argument("--versus", default="", help="two backends, e.g. hf,llamacpp: the same SMC on each, interleaved")
    args = ap.parse_args()
    if args.versus:
        versus(args)
        return
    rows = []
    for backend in args.backends.split(","):
        lm = load(backend, args.n, args.opts)
        engine = Engine(lm, backend)
        lipogram = token_mask(lm, b"e", None, set())
        everything = torch.ones(len(lm.byte_vocab), dtype=torch.bool)
        for length in (int(x) for x in args.prompts.split(",")):
            prompt = prompt_of(lm, length)
            for steps in (int(x) for x in args.steps.split(",")):
                for name, mask in (("lipogram", lipogram), ("none", everything)):
                    case = (prompt, args.n, steps, mask, args.rounds, args.ess)
                    t_e, t_o, ratios, work = run_case(engine, backend, *case)
                    rows.append(
                        [
                            backend,
                            str(len(prompt)),
                            str(steps),
                            name,
                            f"{t_e:.2f} s",
                            f"{t_o:.2f} s",
                            f"{statistics.median(ratios):.2f}x",
                            f"{min(ratios):.2f}-{max(ratios):.2f}",
                            f"{work['rows']:.1f}",
                            f"{work['computed']:.1f}",
                            f"{work['cached']:.0f}",
                            f"{work['copied']:.0f}",
                            f"{work['busy']:.0%}",
                        ]
                    )
                    print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        lm.cleanup()
        del lm, engine
        gc.collect()
    header = ["backend", "prompt", "T", "constraint", "engine decode", "SMC (ours)", "ratio", "spread"]
    work = ["rows/step", "tokens run/step", "prefix-cache tokens/step", "fork-copied tokens/step", "engine busy"]
    print(table([*header, *work], rows))
    blas = ", mlx with OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else ""
    resampling = f"resampling below ESS {args.ess} N" if args.ess > 0 else "no resampling"
    rounds = f"{args.rounds} interleaved rounds after a warm-up"
    model = "SmolLM2-135M float32 (llamacpp: the Q4_1 GGUF; llamacpp-f32: its float32 dequantization)"
    print(f"\nN={args.n} particles, {resampling}, {model}, {rounds}; CPU{blas}.")


def versus(args: argparse.Namespace) -> None:
    """The same SMC program on two backends, loaded side by side and timed alternately."""
    a, b = args.versus.split(",")
    lms = {name: load(name, args.n, {}) for name in (a, b)}
    rows = []
    for length in (int(x) for x in args.prompts.split(",")):
        for steps in (int(x) for x in args.steps.split(",")):
            for constrained in (True, False):
                times: dict[str, list[float]] = {a: [], b: []}
                for r in range(args.rounds + 1):
                    for name, lm in lms.items():
                        mask = (
                            token_mask(lm, b"e", None, set())
                            if constrained
                            else torch.ones(len(lm.byte_vocab), dtype=bool)
                        )
                        lm.clear_cache()
                        gc.collect()
                        t0 = time.perf_counter()
                        asyncio.run(
                            smc(lm, prompt_of(lm, length), args.n, steps, mask, set(), seed=r, ess_threshold=args.ess)
                        )
                        if r:
                            times[name].append(time.perf_counter() - t0)
                ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
                per_token = {k: statistics.median(v) / (args.n * steps) * 1e3 for k, v in times.items()}
                rows.append(
                    [
                        str(length),
                        str(steps),
                        "lipogram" if constrained else "none",
                        f"{statistics.median(times[a]):.2f} s ({per_token[a]:.2f} ms/token)",
                        f"{statistics.median(times[b]):.2f} s ({per_token[b]:.2f} ms/token)",
                        f"{statistics.median(ratios):.2f}x",
                        f"{min(ratios):.2f}-{max(ratios):.2f}",
                    ]
                )
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(table(["prompt", "T", "constraint", a, b, f"{a} / {b}", "spread"], rows))
    models = f"SmolLM2-135M ({a} vs {b}; hf float32, llamacpp the Q4_1 GGUF)"
    print(f"\nN={args.n} particles, {models}, {args.rounds} interleaved rounds after a warm-up; CPU.")
    for lm in lms.values():
        lm.cleanup()


if __name__ == "__main__":
    main()
