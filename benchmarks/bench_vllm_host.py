"""Host-bound SMC on vLLM: genlm's step against vLLM's own decode step where the forward is nearly free.

On a GPU, vLLM's decode step is a few milliseconds and everything genlm does around it is added to every
step; a CPU engine running a real model hides that behind a slow forward. This benchmark makes the GPU's
regime measurable on vLLM's CPU build: a Llama with 1 layer and width 64 (random weights) on a real
tokenizer (``mistral-v1``: SentencePiece, 32,000 ids; ``tekken``: 131,072 ids), so that vLLM's own step
is mostly its host work (scheduling, input preparation, sampling) plus the ``[N, V]`` row math that both
sides share. The engine runs in this process (one engine, the same options for both sides).

For each case (vocabulary, N particles, prompt of P tokens, T steps) these are timed, interleaved
(vLLM, ours, vLLM, ours, ...; genlm's output cache and vLLM's prefix cache cleared before each run):

- **vLLM's own step**: ``LLM.generate(n=N, max_tokens=T, ignore_eos=True)`` of the prompt, less the
  same with ``max_tokens=1`` (the prefill), over ``T - 1``: one decode step of N sequences;
- **vLLM greedy**: the same of N requests at ``temperature=0`` (vLLM's cheapest sampler: an argmax, where
  its random sampler draws an exponential variate per id of ``[N, V]``, which on this CPU costs what the
  forward does not, and on a GPU next to nothing): the stricter floor, as our resident requests are
  greedy requests whose sampled token the program's replaces;
- **genlm's step call**: ``batch_next_token_logprobs`` over the N particles' context handles, inside
- **the whole SMC step**: the step call, :func:`genlm_core.proposal.masked_proposal` under a lipogram
  mask (no token with an "e"; EOS outside the mask, so every particle runs all T steps: N x T tokens,
  as vLLM's decode), the weights, and multinomial resampling when the ESS falls below N/2;
- **a per-particle program**: each particle awaits its own ``next_token_logprobs`` and draws with
  ``torch.multinomial`` (``asyncio.gather`` per step; no resampling).

A whole SMC run goes first, untimed: a process's first rows are written into new host memory (the
output cache keeps them), whose page faults cost 2-40 ms per 4 MiB on this kind of machine; from then
on the capture writes into blocks nothing holds any more, as it does in a program that runs for long.
Each of ours is the mean over steps 2..T of a run (step 1 is the prompt's prefill), then the median
over rounds, beside the spread (min to max) of the per-round ratios. Beside the ratios, per step of the
SMC run: vLLM requests added, tokens computed per row, row bytes the capture wrote (gathered and
normalised) and the caller stacked, engine steps, and where the step call's time went: vLLM's
``execute_model`` (the model's forward and logits), its ``sample_tokens`` (the sampler), the capture's
row normalisation (``write_rows``, inside one of those two), its scheduling (``schedule`` and
``update_from_output``), adding requests (``InputProcessor.process_inputs`` and ``add_request``), and
genlm's own host work (the rest of the step call); the program's share is the whole SMC step less the
step call. The same split is printed for vLLM's own step. The split wraps vLLM's engine-core methods
for timing (a benchmark reading internals, not the plugin).

    python benchmarks/bench_vllm_host.py                          # every case (long: N=1,024 x 131k)
    python benchmarks/bench_vllm_host.py --vocabs mistral-v1 --n 32,256 --prompts 24 --rounds 3
    python benchmarks/bench_vllm_host.py --n 1024 --per-particle-rounds 1   # the per-particle program once
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.proposal import masked_proposal
from genlm_core.testing.models import tiny_model_dir

#: The host-bound model: 1 layer, width 64, one head (head_dim 64: vLLM's CPU attention has no 16).
MODEL = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}
PROMPT_TEXT = "The history of the city begins with a small settlement on the river. "


@dataclass
class Split:
    """Seconds and calls per wrapped stage, over one timed window."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    on: bool = False


SPLIT = Split()


def timed(name: str, fn: Callable[..., Any], count_bytes: Callable[..., int] | None = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        if not SPLIT.on:
            return fn(*args, **kw)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            SPLIT.seconds[name] += time.perf_counter() - t0
            SPLIT.calls[name] += 1
            if count_bytes is not None:
                SPLIT.bytes[name] += count_bytes(*args, **kw)

    return wrapper


def instrument(lm: Any) -> None:
    """Wrap the in-process engine's stages (instances and module functions) with :func:`timed`."""
    import genlm_vllm.in_engine.capture as capture
    import genlm_vllm.live as sessions

    llm = lm.driver.engine
    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    for obj, names in (
        (core.scheduler, ("schedule", "update_from_output")),
        (core.model_executor, ("execute_model", "sample_tokens")),
        (llm.llm_engine.input_processor, ("process_inputs",)),
        (core, ("add_request",)),
    ):
        for name in names:
            setattr(obj, name, timed(name, getattr(obj, name)))
    live = lm.driver.sessions.engine.core  # genlm's adapter over the engine core
    live.step = timed("engine step", live.step)
    live.add_chunk = timed("add chunk", live.add_chunk)

    def written(wanted: Any, logits: torch.Tensor) -> int:
        return 2 * len(wanted) * logits.shape[-1] * 4  # gathered, then normalised (float32)

    if not hasattr(capture.write_rows, "timed"):  # module functions: wrapped once, whatever the engines
        capture.write_rows = timed("write_rows", capture.write_rows, written)
        capture.write_rows.timed = True  # type: ignore[attr-defined]

    if hasattr(sessions.rows_block, "timed"):
        return
    block = sessions.rows_block

    def rows_block(rows: Any) -> torch.Tensor:
        out = block(rows)
        if SPLIT.on and out.data_ptr() != rows[0].data_ptr():
            SPLIT.bytes["stacked"] += out.numel() * out.element_size()
        return out

    rows_block.timed = True  # type: ignore[attr-defined]
    sessions.rows_block = rows_block


def start(vocab: str, n: int, max_len: int) -> Any:
    path = str(tiny_model_dir("llama", tokenizer=vocab, **MODEL))
    engine_opts = {
        "kv_cache_memory_bytes": 2**30,
        "seed": 0,
        "max_num_seqs": n + 8,
        "max_model_len": max_len,
        "max_num_batched_tokens": max(8192, 2 * n),
    }
    t0 = time.perf_counter()
    lm = load_model_by_name(
        path, backend="vllm", llm_opts={"batch_size": n, "timeout": 0, "dtype": "float32", "engine_opts": engine_opts}
    )
    if lm.driver.sessions is None or not hasattr(lm.driver, "engine"):
        raise SystemExit("this benchmark needs the in-process LLM engine with live sessions (the default)")
    instrument(lm)
    print(f"{vocab}: engine for N={n} started in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return lm


def prompt_of(lm: Any, length: int) -> list[int]:
    ids = list(lm.tokenizer.encode(PROMPT_TEXT * (8 + length // 8)))
    if len(ids) < length:
        raise ValueError(f"the prompt text has only {len(ids)} tokens, {length} asked")
    return ids[:length]


def lipogram(lm: Any) -> torch.Tensor:
    """True for tokens with no "e" or "E" (EOS excluded: every particle runs every step)."""
    eos = set(lm.eos_token_ids) if hasattr(lm, "eos_token_ids") else {lm.tokenizer.eos_token_id}
    return torch.tensor([i not in eos and b"e" not in t.lower() for i, t in enumerate(lm.byte_vocab)])


def reset(lm: Any) -> None:
    lm.clear_cache()  # output cache, live sessions, vLLM's prefix cache
    gc.collect()


def vllm_decode(lm: Any, prompt: list[int], n: int, steps: int, greedy: bool = False) -> float:
    """Seconds for vLLM's own ``generate`` of ``n`` sequences of ``steps`` tokens from ``prompt``:
    sampled (``n=N``, unseeded: a seed sends vLLM's sampler down its slower per-request path), or
    greedy (N requests of ``n=1``: vLLM's greedy sampling takes one sequence per request)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if greedy:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=prompt) for _ in range(n)]
    else:
        params = SamplingParams(n=n, max_tokens=steps, ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=prompt)]
    reset(lm)
    t0 = time.perf_counter()
    lm.driver.engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def vllm_step(lm: Any, prompt: list[int], n: int, steps: int, greedy: bool = False) -> tuple[float, Split]:
    """One decode step of vLLM's own ``generate`` (T tokens less the prefill, over T - 1), and its split
    (the T-token run's, less the prefill run's, over T - 1)."""
    global SPLIT
    SPLIT = Split(on=True)
    prefill = vllm_decode(lm, prompt, n, 1, greedy)
    first = SPLIT
    SPLIT = Split(on=True)
    whole = vllm_decode(lm, prompt, n, steps, greedy)
    split, SPLIT = SPLIT, Split()
    for name in list(split.seconds):
        split.seconds[name] = (split.seconds[name] - first.seconds.get(name, 0.0)) / (steps - 1)
        split.calls[name] = round((split.calls[name] - first.calls.get(name, 0)) / (steps - 1))
    return (whole - prefill) / (steps - 1), split


@dataclass
class Run:
    step_call: float  # seconds per step, steps 2..T
    smc_step: float
    split: Split
    added: float  # vLLM requests added per step
    computed_per_row: float


async def smc_run(lm: Any, prompt: list[int], n: int, steps: int, mask: torch.Tensor) -> Run:
    """SMC over handles: the step call, masked_proposal, weights, resampling below ESS N/2."""
    global SPLIT
    gen = torch.Generator().manual_seed(0)
    root = lm.context(prompt)
    handles = [root] * n
    log_w = torch.zeros(n, dtype=torch.float64)
    stats = lm.driver.sessions.stats
    call_s = step_s = 0.0
    before = None
    for t in range(steps):
        if t == 1:  # from the second step on: the prefill is step 1
            SPLIT = Split(on=True)
            before = (stats.rows, stats.tokens_computed)
        t0 = time.perf_counter()
        rows = await lm.batch_next_token_logprobs(handles)
        t1 = time.perf_counter()
        proposal = masked_proposal(rows, mask, generator=gen)
        log_w += proposal.log_kept.to(torch.float64)
        handles = [h.extend(tok) for h, tok in zip(handles, proposal.tokens.tolist(), strict=True)]
        w = torch.softmax(log_w, 0)
        if float(1.0 / (w**2).sum()) < n / 2 and t + 1 < steps:
            picks = torch.multinomial(w, n, replacement=True, generator=gen).tolist()
            handles = [handles[i] for i in picks]
            log_w.zero_()
        t2 = time.perf_counter()
        if t >= 1:
            call_s += t1 - t0
            step_s += t2 - t0
    split, SPLIT = SPLIT, Split()
    assert before is not None
    rows_run, computed = stats.rows - before[0], stats.tokens_computed - before[1]
    k = steps - 1
    return Run(
        call_s / k,
        step_s / k,
        split,
        split.calls.get("add chunk", 0) / k,
        computed / max(rows_run, 1),
    )


async def particle_run(lm: Any, prompt: list[int], n: int, steps: int) -> float:
    """Each particle awaits its own row and draws with torch.multinomial; seconds per step, 2..T."""
    gen = torch.Generator().manual_seed(0)
    contexts = [lm.context(prompt) for _ in range(n)]

    async def one(i: int) -> None:
        row = await lm.next_token_logprobs(contexts[i])
        contexts[i] = contexts[i].extend(int(torch.multinomial(row.exp(), 1, generator=gen)))

    elapsed = 0.0
    for t in range(steps):
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        if t >= 1:
            elapsed += time.perf_counter() - t0
    return elapsed / (steps - 1)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def ratio_cell(ours: list[float], engine: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, engine, strict=True)]
    return f"{statistics.median(ours) / statistics.median(engine):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def split_cells(split: Split, per: float, call: float, n: int = 0) -> list[str]:
    """Per step: vLLM's execute_model and sample_tokens, the capture's write_rows (inside one of them),
    scheduling, adding requests, genlm's own (with its share per particle, in microseconds)."""
    s = {k: v / per for k, v in split.seconds.items()}
    rows = s.get("write_rows", 0.0)
    sched = s.get("schedule", 0.0) + s.get("update_from_output", 0.0)
    adding = s.get("add chunk", 0.0)
    own = call - s.get("engine step", 0.0) - adding
    return [
        ms(s.get("execute_model", 0.0)),
        ms(s.get("sample_tokens", 0.0)),
        ms(rows),
        ms(sched),
        ms(adding),
        f"{ms(own)} ({own / n * 1e6:.0f} us/particle)" if call and n else "-",
    ]


def bench(
    lm: Any, vocab: str, n: int, prompt_len: int, steps: int, rounds: int, particle_rounds: int
) -> tuple[list[str], list[str]]:
    prompt = prompt_of(lm, prompt_len)
    mask = lipogram(lm)
    vllm_steps, greedy_steps, calls, smcs, particles = [], [], [], [], []
    runs: list[Run] = []
    engine_split = None
    vllm_decode(lm, prompt, n, 4)  # warm-up, not timed: first calls, allocator, compiled paths
    vllm_decode(lm, prompt, n, 4, greedy=True)
    reset(lm)
    # a whole run: the rows' host blocks are made once and reused from then on, as in a long program
    asyncio.run(smc_run(lm, prompt, n, steps, mask))
    reset(lm)
    for r in range(rounds):
        step, split = vllm_step(lm, prompt, n, steps)
        vllm_steps.append(step)
        engine_split = engine_split or split
        greedy_steps.append(vllm_step(lm, prompt, n, steps, greedy=True)[0])
        reset(lm)
        run = asyncio.run(smc_run(lm, prompt, n, steps, mask))
        calls.append(run.step_call)
        smcs.append(run.smc_step)
        runs.append(run)
        if r < particle_rounds:
            reset(lm)
            particles.append(asyncio.run(particle_run(lm, prompt, n, steps)))
        print(
            f"  {vocab} N={n} P={prompt_len} round {r + 1}: vLLM {ms(step)} (greedy {ms(greedy_steps[-1])}), "
            f"step call {ms(run.step_call)}, "
            f"SMC {ms(run.smc_step)}, per-particle {ms(particles[-1]) if r < particle_rounds else '-'}",
            file=sys.stderr,
            flush=True,
        )
    case = f"{vocab} N={n} P={prompt_len}"
    mid = runs[len(runs) // 2]
    per = steps - 1
    summary = [
        case,
        ms(statistics.median(vllm_steps)),
        ms(statistics.median(greedy_steps)),
        ms(statistics.median(calls)),
        ratio_cell(calls, vllm_steps),
        ratio_cell(smcs, vllm_steps),
        ratio_cell(particles, vllm_steps[: len(particles)]) if particles else "-",
        ratio_cell(calls, greedy_steps),
        ratio_cell(smcs, greedy_steps),
    ]
    written = mid.split.bytes.get("write_rows", 0) / per
    stacked = mid.split.bytes.get("stacked", 0) / per
    counters = [
        case,
        f"{mid.added:.0f}",
        f"{mid.computed_per_row:.2f}",
        f"{written / 2**20:.1f} + {stacked / 2**20:.1f} MiB",
        f"{mid.split.calls.get('engine step', 0) / per:.1f}",
        *split_cells(mid.split, per, mid.step_call, n),
        ms(mid.smc_step - mid.step_call),
    ]
    assert engine_split is not None
    engine_row = ["  vLLM's own step", "-", "1", "-", "1", *split_cells(engine_split, 1, 0.0), "-"]
    return summary, [counters, engine_row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="mistral-v1,tekken", help="tokenizers (32k and 128k ids)")
    ap.add_argument("--n", default="32,256,1024", help="particles per case")
    ap.add_argument("--prompts", default="24,2000", help="prompt lengths in tokens")
    ap.add_argument("--steps", type=int, default=32, help="SMC steps T (and vLLM's max_tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    ap.add_argument(
        "--per-particle-rounds",
        type=int,
        default=None,
        help="rounds that also run the per-particle program (default: all; it is the slowest by far)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-call log lines would bury the tables
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (step 1 is the prefill)")
    prompts = [int(p) for p in args.prompts.split(",")]
    particle_rounds = args.rounds if args.per_particle_rounds is None else args.per_particle_rounds
    summary, counters = [], []
    for vocab in args.vocabs.split(","):
        for n in (int(x) for x in args.n.split(",")):
            lm = start(vocab, n, max(prompts) + args.steps + 64)
            try:
                for p in prompts:
                    s, c = bench(lm, vocab, n, p, args.steps, args.rounds, particle_rounds)
                    summary.append(s)
                    counters += c
            finally:
                lm.cleanup()
                del lm
                gc.collect()
    print(f"\nper step, T={args.steps}, medians of {args.rounds} interleaved rounds (spread of the ratios)")
    print(
        table(
            [
                "case",
                "vLLM's own step",
                "vLLM greedy",
                "genlm's step call",
                "step call / vLLM",
                "SMC step / vLLM",
                "per-particle / vLLM",
                "step call / greedy",
                "SMC step / greedy",
            ],
            summary,
        )
    )
    print("\nper step of the SMC run (middle round), and vLLM's own step beneath each")
    print(
        table(
            [
                "case",
                "requests added",
                "tokens computed / row",
                "rows written + stacked",
                "engine steps",
                "execute_model",
                "sample_tokens",
                "write_rows (in those)",
                "scheduling",
                "adding requests",
                "genlm's own",
                "program",
            ],
            counters,
        )
    )


if __name__ == "__main__":
    main()
