"""genlm's own host cost per step, apart from any engine: a backend whose forward costs nothing, against the floor.

The backend, ``ZeroCostLM``, is written only against genlm_core's public API: an ``AsyncLM`` whose
``forward_batch(requests)`` returns the slice ``[:len(requests)]`` of one float32 logits block
``[max N, V]`` preallocated on the chosen device (random values, filled once): no model, no copy. What
a step costs beyond the floor is then genlm's own work: validation and snapshot, cache keys and lookups,
the batcher (tasks, queue, the worker-thread hand-off), normalisation, the NaN check, the per-row copies
and the output cache.

A step (what an SMC step does): N particles, each an asyncio task (``asyncio.gather``, as
``examples/smc.py``), each awaiting ``lm.next_token_logprobs(context)`` on its own Python list and then
appending one token id taken from a precomputed pseudo-random list (O(1): nothing is done with the row).
Every particle starts from the same prompt of C tokens; the first step's N requests are therefore one
context and deduplicate into one row, so that step and one more (``--warmup 2``) are not timed. From
then on every context is new: the output cache serves nothing (checked: no hits) and, with
``batch_size=N`` and the default flush policy, each step is one batch of N rows (checked through
``lm.batcher.stats``). The output cache keeps its defaults (1024 rows, 512 MiB), so memory stays at a
few GB even for N=1024 x V=151936 (620 MB per ``[N, V]`` block).

The floor: ``torch.log_softmax(block[:N], dim=-1)`` into fresh memory (allocated, then released, inside
the timing), on the same device, on the thread where genlm normalises rows (the LM's batcher thread): the
least any exact implementation does to turn a step's logits into normalised rows. (The same on the event
loop's thread is printed beside it: on the host, fresh memory there often comes back without page faults,
since glibc gives each thread its own arena; the batcher thread's faults its pages afresh.)
Steps and floors are timed interleaved (step, floor, step, floor,
...); the tables give medians, the p25-p75 spread, the median of the per-pair ratios and of the
per-pair differences, and ``gc``: the median time the cyclic garbage collector ran during a step (part of
the step; measured through ``gc.callbacks``). On CUDA both are timed between ``torch.cuda.synchronize()``
calls, the step until every particle holds its row (rows stay on the device).

``--live``: batches go through core's live sequences (:class:`genlm_core.live.LiveSequences`, the path of
genlm-vllm and genlm-llamacpp) over an engine that costs nothing either (``ZeroCostSequences``): the step
then also pays core's bookkeeping of which particle continues which sequence (plan, place, keep), and
each timed step is checked to start no fresh sequence (every particle continues its own).

Modes (``--modes``, each cell times them interleaved with the floor): ``lists`` (the program above),
``handles`` (the same with ``lm.context`` handles, each particle extending its own with ``ctx.extend``)
and ``step`` (the whole step as one ``batch_next_token_logprobs`` of the N handles: one submission, one
future, the rows returned as their block). Each mode starts from its own prompt, so no mode's contexts
are another's.

The targets (issue 44), printed cell by cell: ``step`` at N >= 256 within 1.2x the floor; ``handles``
and ``lists``: genlm's own time per request (step less floor, over N) within 12 us; for each (V, N,
mode): the step at the largest context within 1.1x the step at the smallest (flat in context; for
lists, the per-token slope is printed beside it).

The breakdown (``--breakdown ends``, the default: each (V, N) at its smallest and largest context) times
each stage alone on the N contexts a step would ask for next (each one token longer than a context asked
for before, as in a step), interleaved with a step and a floor, a few rounds per cell:
``tasks`` (``gather`` of N coroutines that do nothing: the program's own cost, not genlm's),
``request`` (``lm.request``: validation and snapshot), ``cache.get`` (N misses) and ``hash`` (``hash()``
of the N requests: what each further dict a request passes through pays, unless the request keeps its hash),
``batcher`` (an ``AutoBatcher`` round trip of the N requests as keys, ``run_in_thread=True`` as the LM
uses, through a function returning precomputed results), ``finish_rows`` (``lm.finish_rows`` on the
step's logits: normalisation, NaN check, copies, output cache). ``rest`` is what the step costs beyond
request + cache.get + batcher + finish_rows.

``--profile`` runs cProfile over a few steps of one cell and prints the top 15 functions by own time,
for the event-loop thread and for the batcher's worker thread (its time in ``epoll.poll`` and in
``SimpleQueue.get`` is waiting for the other thread); from Python 3.12 on, one table for both threads.

Vocabularies: 50257 is GPT-2's real tokenizer (``genlm_core.testing``, offline once built; a synthetic
one where it was never built, e.g. on a GPU machine: the benchmark downloads nothing; or with
``--synthetic``); 128256 (Llama-3) and 151936 (Qwen2) are synthetic
byte-level BPE tokenizers with exactly V distinct tokens, built in memory (under a second each; building
the LM, which decodes the vocabulary, takes up to another second). Only V matters here: the engine does
nothing with the tokens.

    python benchmarks/bench_overhead.py [--quick] [--live] [--device cuda [--synthetic]]
    python benchmarks/bench_overhead.py --n 32,256 --context 24,8000 --vocab 50257 --steps 20 --json out.json
    python benchmarks/bench_overhead.py --quick --profile 50257,256,2000

The default grid (N 32,256,1024 x C 24,2000,8000 x V 50257,128256,151936) takes about 5 minutes on 2 CPU
cores, breakdown included: cells of N >= 1024 time half of ``--steps`` (at least 5). ``--quick``
(N 32,256; C 24,2000; V 50257; 8 steps; 3 breakdown rounds) takes about 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import itertools
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _common import ROOT, fmt_s

import genlm_core
from genlm_core import AsyncLM, AutoBatcher, Request
from genlm_core.cli import table
from genlm_core.live import LiveEngine, LiveSequences, Piece, Ran
from genlm_core.rows import RowsOut

QUICK = {"n": "32,256", "context": "24,2000", "vocab": "50257", "steps": 8, "breakdown_rounds": 3}
STAGES = ("tasks", "request", "cache.get", "hash", "batcher", "finish_rows")
EOT = "<|endoftext|>"


# ---- the backend ---------------------------------------------------------------------------------


class ZeroCostSequences(LiveEngine[int, torch.Tensor]):
    """A live engine that costs nothing (``--live``): sequence ids from a free list, copies that copy
    nothing, and each batch's rows a slice of the LM's preallocated block. What a step costs beyond the
    floor is then also core's live-sequence bookkeeping: plan, place, keep (:mod:`genlm_core.live`)."""

    def __init__(self, block: torch.Tensor, sequences: int) -> None:
        self.block = block
        self.free = list(range(sequences))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, seqs: Sequence[int]) -> None:
        self.free.extend(seqs)

    def copy(self, source: int, target: int, length: int) -> bool:
        return True

    def run(self, pieces: Sequence[Piece[int]], make_room: Callable[[], bool]) -> Ran[torch.Tensor]:
        return Ran(self.block[: len(pieces)])


class ZeroCostLM(AsyncLM):
    """An engine that costs nothing: every batch is a slice of one preallocated logits block (no copy).
    With ``live``, batches go through core's live sequences (as genlm-vllm's and genlm-llamacpp's do)
    over :class:`ZeroCostSequences`."""

    def __init__(self, tokenizer: Any, block: torch.Tensor, live: bool = False, **options: Any) -> None:
        super().__init__(tokenizer, **options)
        self.block = block
        self.sequences = LiveSequences(ZeroCostSequences(block, 4 * len(block) + 8)) if live else None

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        if self.sequences is not None:
            return self.sequences.run(requests).rows()
        return self.block[: len(requests)]


class ProfiledLM(ZeroCostLM):
    """:class:`ZeroCostLM` that switches a profiler on and off in the batcher's worker thread (cProfile
    profiles one thread): it follows ``on`` at the start of each batch."""

    def __init__(self, tokenizer: Any, block: torch.Tensor, **options: Any) -> None:
        super().__init__(tokenizer, block, **options)
        self.profiler = cProfile.Profile()
        self.on = False
        self._enabled = False

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        if self.on != self._enabled:
            if self.on:
                self.profiler.enable()
            else:
                self.profiler.disable()
            self._enabled = self.on
        return super().forward_batch(requests)


# ---- tokenizers ------------------------------------------------------------------------------------

_TOKENIZERS: dict[tuple[int, bool], tuple[Any, str, float]] = {}


def synthetic_tokenizer(size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``size`` distinct tokens: the 256 bytes,
    then every 2-byte string, then 3-byte strings, ..., and ``<|endoftext|>`` as the last id. No merges:
    text encodes byte by byte, which decodes (and round-trips) exactly."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from genlm_core.tokenization.vocab import byte_level_alphabet

    chars = [c for c, _ in sorted(byte_level_alphabet().items(), key=lambda kv: kv[1])]
    pieces = ("".join(p) for n in itertools.count(1) for p in itertools.product(chars, repeat=n))
    vocab = {piece: i for i, piece in zip(range(size - 1), pieces)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT, bos_token=EOT)


def tokenizer_for(size: int, synthetic: bool) -> tuple[Any, str, float]:
    """A tokenizer of ``size`` tokens, what it is, and the seconds it took (cached for the run)."""
    key = (size, synthetic)
    if key not in _TOKENIZERS:
        t0 = time.perf_counter()
        tok, what = None, f"synthetic byte-level BPE of {size} tokens"
        if size == 50257 and not synthetic:
            from genlm_core.testing.tokenizers import load_tokenizer

            index = os.environ.get("PIP_NO_INDEX")
            os.environ["PIP_NO_INDEX"] = "1"  # built once before, or not at all: a benchmark downloads nothing
            try:
                tok, what = load_tokenizer("gpt2"), "GPT-2"
            except Exception as exc:  # never built here (e.g. on a GPU machine): V is all that matters
                why = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
                print(f"GPT-2 tokenizer not built here ({type(exc).__name__}: {why}); a synthetic one", file=sys.stderr)
            finally:
                if index is None:
                    del os.environ["PIP_NO_INDEX"]
                else:
                    os.environ["PIP_NO_INDEX"] = index
        if tok is None:
            tok = synthetic_tokenizer(size)
        if len(tok) != size:
            raise RuntimeError(f"{what}: {len(tok)} tokens, expected {size}")
        _TOKENIZERS[key] = (tok, what, time.perf_counter() - t0)
    return _TOKENIZERS[key]


# ---- timing helpers --------------------------------------------------------------------------------


def syncer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[1], q[2]


def spread(samples: Sequence[float]) -> str:
    lo, _, hi = quartiles(samples)
    return f"{fmt_s(lo)}–{fmt_s(hi)}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.2f} ms"


#: How a program hands its contexts over (``--modes``): ``lists``, each particle awaiting
#: ``next_token_logprobs`` of its own Python list (appended to in place); ``handles``, the same with
#: :class:`~genlm_core.Context` handles (``ctx.extend(token)``); ``step``, the whole step as one
#: ``batch_next_token_logprobs`` of the N handles (one submission, one future, the rows as one block).
MODES = ("lists", "handles", "step")


class Particles:
    """N contexts sharing a prompt of C tokens; a step grows each by one token. ``mode``: see :data:`MODES`;
    ``shift`` moves the prompt along the pool, so that the contexts of two modes never coincide."""

    def __init__(self, lm: AsyncLM, pool: list[int], n: int, context: int, mode: str = "lists", shift: int = 0):
        self.lm, self.pool, self.n, self.mode = lm, pool, n, mode
        prompt = [pool[(i + shift) % len(pool)] for i in range(context)]
        self.contexts: list[Any]
        if mode == "lists":
            self.contexts = [list(prompt) for _ in range(n)]
        else:
            self.contexts = [lm.context(prompt)] * n
        self.offset = 0  # the first step appends pool[0..N-1]: distinct, so the contexts diverge

    async def _list_particle(self, context: list[int], token: int) -> None:
        await self.lm.next_token_logprobs(context)
        context.append(token)

    async def _handle_particle(self, i: int, token: int) -> None:
        context = self.contexts[i]
        await self.lm.next_token_logprobs(context)
        self.contexts[i] = context.extend(token)

    async def step(self) -> None:
        pool, size, k, contexts = self.pool, len(self.pool), self.offset, self.contexts
        self.offset += self.n
        if self.mode == "lists":
            await asyncio.gather(*(self._list_particle(c, pool[(i + k) % size]) for i, c in enumerate(contexts)))
        elif self.mode == "handles":
            await asyncio.gather(*(self._handle_particle(i, pool[(i + k) % size]) for i in range(self.n)))
        else:
            await self.lm.batch_next_token_logprobs(contexts)
            self.contexts = [c.extend(pool[(i + k) % size]) for i, c in enumerate(contexts)]

    def advance(self) -> None:
        """One token more for every context, without asking for rows (so no later step hits the cache)."""
        pool, size, k = self.pool, len(self.pool), self.offset
        self.offset += self.n
        if self.mode == "lists":
            for i, c in enumerate(self.contexts):
                c.append(pool[(i + k) % size])
        else:
            self.contexts = [c.extend(pool[(i + k) % size]) for i, c in enumerate(self.contexts)]


class GcClock:
    """Seconds the cyclic garbage collector has run (in any thread), through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1


GC = GcClock()
gc.callbacks.append(GC)


def counters(lm: AsyncLM) -> tuple[int, int, int, int]:
    """Batches, rows, output-cache hits, and (``--live``) rows computed from a fresh sequence."""
    stats = lm.batcher.stats
    sequences = getattr(lm, "sequences", None)
    fresh = sequences.stats.fresh if sequences is not None else 0
    return stats.batches, stats.items, int(getattr(lm.cache, "hits", 0)), fresh


async def timed_step(particles: Particles, sync: Callable[[], None]) -> tuple[float, float]:
    """Seconds of one step, and of the garbage collections during it (checked: one batch of N rows)."""
    lm, n = particles.lm, particles.n
    before = counters(lm)
    collecting = GC.seconds
    sync()
    t0 = time.perf_counter()
    await particles.step()
    sync()
    seconds = time.perf_counter() - t0
    batches, items, hits, fresh = (a - b for a, b in zip(counters(lm), before))
    if (batches, items, hits) != (1, n, 0):
        raise RuntimeError(f"a step was {batches} batches of {items} rows with {hits} cache hits, not 1 x {n}, 0")
    if fresh:
        raise RuntimeError(f"--live: {fresh} of a step's rows started a fresh sequence (each should continue one)")
    return seconds, GC.seconds - collecting


async def timed_floor_on_worker(lm: ZeroCostLM, block: torch.Tensor, n: int, sync: Callable[[], None]) -> float:
    """:func:`timed_floor` on the thread where the LM normalises its rows (the batcher's worker thread):
    fresh memory costs differently there (glibc gives each thread its own arena)."""
    executor = getattr(lm.batcher, "_executor", None)
    if executor is None:  # no worker thread (yet): the loop's thread
        return timed_floor(block, n, sync)
    return await asyncio.get_running_loop().run_in_executor(executor, timed_floor, block, n, sync)


def timed_floor(block: torch.Tensor, n: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    out = torch.log_softmax(block[:n], dim=-1)
    sync()
    del out
    return time.perf_counter() - t0


async def nothing() -> None:
    pass


async def timed_stages(
    lm: ZeroCostLM, particles: Particles, batcher: AutoBatcher[Request, int], sync: Callable[[], None]
) -> dict[str, float]:
    """Each stage of a step alone, on the N contexts the last step left (each one token longer than the one
    it requested, as a step's are); then one token more, so that the next step asks for new contexts."""
    n, block, contexts = particles.n, lm.block, particles.contexts
    sync()
    t0 = time.perf_counter()
    await asyncio.gather(*(nothing() for _ in range(n)))
    t1 = time.perf_counter()
    requests = [lm.request(c) for c in contexts]
    t2 = time.perf_counter()
    for r in requests:
        lm.cache.get(r)
    t3 = time.perf_counter()
    for r in requests:
        hash(r)
    t4 = time.perf_counter()
    before = batcher.stats.batches
    await asyncio.gather(*(batcher.submit(r, r) for r in requests))
    t5 = time.perf_counter()
    if batcher.stats.batches - before != 1:
        raise RuntimeError(f"the batcher round trip took {batcher.stats.batches - before} batches, not 1")
    sync()
    t6 = time.perf_counter()
    rows = lm.finish_rows(requests, block[:n])
    sync()
    del rows
    t7 = time.perf_counter()
    out = dict(zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t6)))
    particles.advance()
    return out


# ---- one cell --------------------------------------------------------------------------------------


async def run_cell(
    lm: ZeroCostLM,
    pool: list[int],
    n: int,
    context: int,
    steps: int,
    warmup: int,
    breakdown: int,
    device: torch.device,
    modes: Sequence[str] = ("lists",),
) -> list[dict[str, Any]]:
    """One (V, N, C) cell: a step of each mode and a floor, interleaved (mode 1, floor, mode 2, floor,
    ...); one result per mode. The breakdown follows the first mode's contexts."""
    sync = syncer(device)
    block = lm.block
    everyone = {mode: Particles(lm, pool, n, context, mode, shift=31 * i) for i, mode in enumerate(modes)}
    for particles in everyone.values():
        first = counters(lm)
        for w in range(warmup):
            await particles.step()
            if w == 0 and (counters(lm)[1] - first[1]) != 1:
                raise RuntimeError("the first step's N requests of one context did not deduplicate into one row")
    times = {mode: {"step": [], "floor": [], "floor_loop": [], "gc": []} for mode in modes}
    for _ in range(steps):
        for mode, particles in everyone.items():
            seconds, collecting = await timed_step(particles, sync)
            t = times[mode]
            t["step"].append(seconds)
            t["gc"].append(collecting)
            t["floor"].append(await timed_floor_on_worker(lm, block, n, sync))
            t["floor_loop"].append(timed_floor(block, n, sync))
    cells = []
    for mode in modes:
        t = times[mode]
        cell = summarise(t["step"], t["floor"])
        cell["gc"] = {"median": statistics.median(t["gc"]), "samples": t["gc"]}
        cell["floor_loop"] = {"median": statistics.median(t["floor_loop"]), "samples": t["floor_loop"]}
        cell.update(vocab=lm.vocab_size, n=n, context=context, steps=steps, mode=mode)
        cells.append(cell)
    if breakdown:
        particles = everyone[modes[0]]
        results = list(range(n))
        batcher: AutoBatcher[Request, int] = AutoBatcher(
            lambda items: results[: len(items)],
            batch_size=n,
            timeout=lm.options.timeout,
            run_in_thread=True,
            flush=lm.options.flush,
        )
        rounds: dict[str, list[float]] = {k: [] for k in ("step", "floor", *STAGES)}
        try:
            await timed_stages(lm, particles, batcher, sync)  # warm-up: the batcher's thread starts
            for _ in range(breakdown):
                rounds["step"].append((await timed_step(particles, sync))[0])
                rounds["floor"].append(await timed_floor_on_worker(lm, block, n, sync))
                for k, v in (await timed_stages(lm, particles, batcher, sync)).items():
                    rounds[k].append(v)
        finally:
            batcher.close()
        cells[0]["breakdown"] = {k: {"median": statistics.median(v), "samples": v} for k, v in rounds.items()}
    return cells


def summarise(step: list[float], floor: list[float]) -> dict[str, Any]:
    ratios = [s / f for s, f in zip(step, floor)]
    diffs = [s - f for s, f in zip(step, floor)]
    return {
        "step": {"median": statistics.median(step), "quartiles": quartiles(step), "samples": step},
        "floor": {"median": statistics.median(floor), "quartiles": quartiles(floor), "samples": floor},
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "minus_floor": statistics.median(diffs),
    }


def target(cell: dict[str, Any]) -> tuple[str, bool | None]:
    """Issue 44's targets on this machine: the step call at N >= 256 within 1.2x the floor; per-particle
    awaits of handles and of lists, genlm's own time per request (step less floor, over N) within 12 us
    (the GPU host's figure; lists add a per-token slope, judged in the context table)."""
    n, mode = cell["n"], cell.get("mode", "lists")
    if mode == "step" and n >= 256:
        return "ratio <= 1.2", cell["ratio"]["median"] <= 1.2
    if mode in ("handles", "lists"):
        return "<= 12 us/request", cell["minus_floor"] / n <= 12e-6
    return "none", None


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


# ---- profile ---------------------------------------------------------------------------------------


def top(profile: cProfile.Profile, count: int, steps: int) -> list[list[str]]:
    stats: dict[Any, Any] = getattr(pstats.Stats(profile), "stats")  # noqa: B009 - untyped in typeshed
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:count]
    out = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in rows:
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        out.append([where, f"{calls / steps:.4g}", fmt_s(tottime / steps), fmt_s(cumtime / steps)])
    return out


#: Before Python 3.12 a cProfile profiler sees one thread; from 3.12 on (sys.monitoring) it sees them all,
#: and only one can be active.
PER_THREAD_PROFILES = sys.version_info < (3, 12)


async def profile_steps(lm: ProfiledLM, particles: Particles, warmup: int, steps: int) -> cProfile.Profile:
    for _ in range(warmup):
        await particles.step()
    main = cProfile.Profile()
    lm.on = PER_THREAD_PROFILES
    main.enable()
    for _ in range(steps):
        await particles.step()
    main.disable()
    lm.on = False
    await particles.step()  # its batch switches the worker thread's profiler off
    return main


# ---- the run ---------------------------------------------------------------------------------------


def big_steps(steps: int) -> int:
    """Timed steps for cells of N >= 1024: half, at least 5 (and never more than asked)."""
    return min(steps, max(5, steps // 2))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def commit() -> str:
    if os.environ.get("GENLM_COMMIT"):  # the GPU check's record of the tree it carried (scripts/gpu_check.sh)
        return os.environ["GENLM_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def worker_threads() -> int:
    """torch's intra-op threads as a fresh thread (the batcher's worker) sees them."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="32,256,1024", help="particles per step")
    ap.add_argument("--context", default="24,2000,8000", help="prompt lengths C")
    ap.add_argument("--vocab", default="50257,128256,151936", help="vocabulary sizes V")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per cell (N >= 1024: half, at least 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first is one shared row)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", type=Path, help="write every result (raw samples too) here")
    ap.add_argument("--quick", action="store_true", help="N 32,256; C 24,2000; V 50257; 8 steps")
    ap.add_argument("--breakdown", default="ends", choices=["none", "ends", "all"], help="cells to break down")
    ap.add_argument("--breakdown-rounds", type=int, default=5)
    ap.add_argument("--profile", nargs="?", const="auto", help="V,N,C of the cell to profile (default: the last)")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true", help="synthetic tokenizers for every V (GPT-2's too)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help=f"how contexts are handed over: {', '.join(MODES)}")
    ap.add_argument("--live", action="store_true", help="batches through core's live sequences (ZeroCostSequences)")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the first step is one shared row, never timed)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    device = torch.device(args.device)
    ns, contexts, vocabs = ints(args.n), ints(args.context), ints(args.vocab)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    started = time.perf_counter()
    env = {
        "argv": sys.argv[1:],
        "commit": commit(),
        "device": args.device,
        "machine": machine(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": {"main": torch.get_num_threads(), "worker": worker_threads()},
        "genlm_core": str(Path(genlm_core.__file__).parent),
    }
    print(
        f"bench_overhead {' '.join(env['argv'])} | {env['machine']} | commit {env['commit']} | torch {env['torch']}"
        f" | torch threads: main {env['threads']['main']}, worker {env['threads']['worker']} | {env['genlm_core']}",
        file=sys.stderr,
        flush=True,
    )
    cells: list[dict[str, Any]] = []
    setup: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    for vocab in vocabs:
        tok, what, tok_seconds = tokenizer_for(vocab, args.synthetic)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        block = torch.randn(max(ns), vocab, generator=generator, device=device, dtype=torch.float32) * 3
        pool = rng.sample(range(vocab), k=min(vocab, 65536))
        for n in ns:
            t0 = time.perf_counter()
            lm = ZeroCostLM(tok, block, live=args.live, batch_size=n)
            lm_seconds = time.perf_counter() - t0
            if lm.vocab_size != vocab:
                raise RuntimeError(f"{what}: the LM's vocabulary has {lm.vocab_size} tokens, not {vocab}")
            setup.append({"vocab": vocab, "tokenizer": what, "tokenizer_s": tok_seconds, "n": n, "lm_s": lm_seconds})
            print(f"V={vocab} ({what}, {tok_seconds:.2f} s), N={n}: LM built in {lm_seconds:.2f} s", file=sys.stderr)
            steps = args.steps if n < 1024 else big_steps(args.steps)
            for context in contexts:
                ends = context in (min(contexts), max(contexts))
                rounds = args.breakdown_rounds if args.breakdown == "all" or (args.breakdown == "ends" and ends) else 0
                lm.clear_cache()
                gc.collect()
                for cell in asyncio.run(run_cell(lm, pool, n, context, steps, args.warmup, rounds, device, modes)):
                    cells.append(cell)
                    print(
                        f"  C={context} {cell['mode']}: step {fmt_s(cell['step']['median'])},"
                        f" floor {fmt_s(cell['floor']['median'])}, ratio {cell['ratio']['median']:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
            lm.cleanup()
        del block
        gc.collect()
    profile = None
    if args.profile:
        profile = run_profile(args, ns, contexts, vocabs, device)
    report(cells, setup, env, args)
    if profile:
        for name, rows in profile["tables"].items():
            print(f"\n{profile['title']}, {name}: top 15 by own time, per step")
            print(table(["function", "calls", "own time", "cumulative"], rows))
    elapsed = time.perf_counter() - started
    print(f"\n{elapsed:.0f} s in all.")
    if args.json:
        result = {"env": env, "setup": setup, "cells": cells, "seconds": elapsed}
        if profile:
            result["profile"] = profile
        args.json.write_text(json.dumps(result, indent=1))


def run_profile(
    args: argparse.Namespace, ns: list[int], contexts: list[int], vocabs: list[int], device: torch.device
) -> dict[str, Any]:
    vocab, n, context = ints(args.profile) if args.profile != "auto" else (vocabs[-1], ns[-1], contexts[-1])
    tok, _, _ = tokenizer_for(vocab, args.synthetic)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    block = torch.randn(n, vocab, generator=generator, device=device, dtype=torch.float32) * 3
    pool = random.Random(args.seed).sample(range(vocab), k=min(vocab, 65536))
    lm = ProfiledLM(tok, block, live=args.live, batch_size=n)
    try:
        particles = Particles(lm, pool, n, context, args.modes.split(",")[0])
        main_profile = asyncio.run(profile_steps(lm, particles, args.warmup, args.profile_steps))
    finally:
        lm.cleanup()
    steps = args.profile_steps
    if PER_THREAD_PROFILES:
        tables = {"event-loop thread": top(main_profile, 15, steps), "worker thread": top(lm.profiler, 15, steps)}
    else:
        tables = {"both threads": top(main_profile, 15, steps)}
    return {"title": f"cProfile of {steps} steps, V={vocab}, N={n}, C={context}", "tables": tables}


def report(cells: list[dict[str, Any]], setup: list[dict[str, Any]], env: dict[str, Any], args: Any) -> None:
    rows = []
    for cell in cells:
        what, ok = target(cell)
        cell["target"] = {"what": what, "met": ok}
        rows.append(
            [
                str(cell["vocab"]),
                str(cell["n"]),
                str(cell["context"]),
                cell["mode"],
                fmt_s(cell["step"]["median"]),
                spread(cell["step"]["samples"]),
                fmt_s(cell["floor"]["median"]),
                spread(cell["floor"]["samples"]),
                fmt_s(cell["floor_loop"]["median"]),
                f"{cell['ratio']['median']:.2f}x",
                ms(cell["minus_floor"]),
                f"{cell['minus_floor'] / cell['n'] * 1e6:.1f} us",
                fmt_s(cell["gc"]["median"]),
                what,
                verdict(ok),
            ]
        )
    head = ["V", "N", "C", "mode", "genlm step", "p25–p75", "floor", "p25–p75", "floor (loop thread)", "ratio"]
    head += ["genlm − floor", "per request", "gc", "target", "met"]
    engine = "zero-cost engine, through core's live sequences" if args.live else "zero-cost engine"
    print(f"\ngenlm's step (N particles, {engine}) against the floor (log_softmax of [N, V]), interleaved")
    print(table(head, rows))

    scaling = []
    by_vn: dict[tuple[int, int, str], dict[int, dict[str, Any]]] = {}
    for cell in cells:
        by_vn.setdefault((cell["vocab"], cell["n"], cell["mode"]), {})[cell["context"]] = cell
    for (vocab, n, mode), row in by_vn.items():
        if len(row) < 2:
            continue
        small, large = row[min(row)], row[max(row)]
        ratio = large["step"]["median"] / small["step"]["median"]
        extra = large["step"]["median"] - small["step"]["median"]
        per_token = extra / (n * (large["context"] - small["context"]))
        large["context_scaling"] = {"versus": small["context"], "ratio": ratio, "met": ratio <= 1.1}
        scaling.append(
            [
                str(vocab),
                str(n),
                mode,
                f"{small['context']} → {large['context']}",
                fmt_s(small["step"]["median"]),
                fmt_s(large["step"]["median"]),
                f"{ratio:.2f}x",
                f"{per_token * 1e9:.1f} ns",
                verdict(ratio <= 1.1),
            ]
        )
    if scaling:
        print("\nstep at the largest context against the smallest (target: <= 1.1x)")
        head = ["V", "N", "mode", "C", "step (small C)", "step (large C)", "ratio", "extra per particle per token"]
        head += ["met"]
        print(table(head, scaling))

    broken = [c for c in cells if "breakdown" in c]
    if broken:
        rows = []
        for cell in broken:
            b = {k: v["median"] for k, v in cell["breakdown"].items()}
            rest = b["step"] - b["request"] - b["cache.get"] - b["batcher"] - b["finish_rows"]
            rows.append(
                [
                    str(cell["vocab"]),
                    str(cell["n"]),
                    str(cell["context"]),
                    cell["mode"],
                    fmt_s(b["step"]),
                    fmt_s(b["floor"]),
                    *(fmt_s(b[k]) for k in STAGES),
                    ms(b["finish_rows"] - b["floor"]),
                    ms(rest),
                ]
            )
        rounds = f"medians of {args.breakdown_rounds} interleaved rounds"
        print(f"\nbreakdown: each stage alone, on the N contexts a step would ask for next; {rounds}")
        head = ["V", "N", "C", "mode", "step", "floor", *STAGES, "finish − floor", "rest"]
        print(table(head, rows))

    met = [c["target"]["met"] for c in cells if c["target"]["met"] is not None]
    met += [c["context_scaling"]["met"] for c in cells if "context_scaling" in c]
    tokenizers = sorted({(s["vocab"], s["tokenizer"], s["tokenizer_s"]) for s in setup})
    lm_build = max(s["lm_s"] for s in setup)
    print(
        f"\n{sum(met)} of {len(met)} targets met. Tokenizers: "
        + "; ".join(f"V={v} {w} ({t:.2f} s)" for v, w, t in tokenizers)
        + f". LM construction (vocabulary decoding) up to {lm_build:.2f} s."
        "\ngc: median seconds of cyclic garbage collection within a step (part of the step)."
        f"\n{env['machine']} ({args.device}), torch threads: main {env['threads']['main']},"
        f" worker {env['threads']['worker']}; commit {env['commit']}; timed steps per cell: {args.steps}"
        f" (N >= 1024: {big_steps(args.steps)}), after {args.warmup} warm-up steps."
    )


if __name__ == "__main__":
    main()
