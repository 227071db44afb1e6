"""The GPU check: genlm on one CUDA device, checked and timed in one command of under 10 minutes.

Run it with ``bash scripts/gpu_check.sh`` (which installs the carried wheels and sets ``PYTHONPATH``);
``--dry-run`` runs the same parts on the CPU with tiny shapes (``tests/test_gpu_check.py``). Each part
runs in its own Python process under a time guard; a part that fails or runs out of time is recorded
and the rest go on; the exit status is 1 when any part failed. Parts, in the order they run:

- ``rows``: genlm-hf's rows (async API, KV reuse across three rounds of extensions and branches) on
  the device against a float64 forward pass on the CPU with the same random weights (SmolLM2-135M's
  shape): float32 with TF32 off and bfloat16 each within twice the error (against the same float64
  reference) of the model's own unbatched forward pass on the device in that dtype
  (``genlm_core.testing.bounds.model_difference``; ``--rows-tol`` sets float32's instead). The rows
  must come back on the device.
- ``trie``: the torch trie on the device against the numba trie (GPT-2's 50,257 tokens), sums and
  maxima of 32 random distributions, and their times.
- ``smc:135m``, ``smc:1b``, ``smc:8b``: random-weight Llama shapes (SmolLM2-135M, Llama-3.2-1B,
  Llama-3.1-8B) in bfloat16 built on the device: ``bench_smc.py``'s hf rows (its SMC against HF's own
  batched ``generate`` of the same N x T tokens, interleaved), then the flush policies ``idle`` and
  ``eager`` on the same particle program (``examples/smc.py``), time per step of each.
- ``overhead``: ``benchmarks/bench_overhead.py`` with rows on the device (genlm's own host cost per
  step, with a zero-cost engine, against a log_softmax floor).
- ``step:1b``, ``step:8b`` (only with ``--only step``): ``hf_step.py``'s cells on random-weight bf16
  Llama shapes built on the device: HF's bare decode step (``model(input_ids=[N, 1],
  past_key_values=DynamicCache)``), genlm-hf's model call inside an SMC step (``run_step``, between
  device syncs) and the whole SMC step, interleaved, N = 32, 256 and 1,024, prompts of 24 and 2,000
  tokens, each with genlm-hf's defaults and with ``decode_room=32`` (and at N = 256, particles
  resampled every step: each step's past gathered); ratios against the issue's targets (1.05x,
  1.15x). A cell that does not fit in the device's free memory is skipped and says what it needs.
- ``profile:8b`` (only with ``--only profile``): torch.profiler (CPU and CUDA) on the bare step, on
  genlm-hf's model call (one SMC step's ``run_step`` replayed) and on the whole SMC step at N = 256:
  the top ops and kernels by self time side by side, the ops only one of them runs; the full tables
  go to ``OUT/profile/``.

The ``vllm`` parts run apart (``--only vllm``: they need vLLM, which the machine lacks, carried by
``scripts/vllm_payload.py``; see docs/gpu.md), within the same 8-minute budget:

- ``vllm:rows``: one float32 random-weight folder of SmolLM2-135M's shape written here; genlm-vllm's rows
  against genlm-hf's on the same weights (on every token genlm-hf gives p >= 1e-4, within 4 x the
  float32 folder's own error against float64 on those contexts and tokens, or ``--vllm-tol``) and
  against vLLM's own ``logprobs=20``, batched against single; then the shared randomised live check
  (``genlm_core.testing.live.check_live_sequences``: live sessions, forks, resampling, cancellation)
  on the same engine, every row against the uncached one.
- ``vllm:smc:1b``, ``vllm:smc:8b``: ``bench_smc.py``'s vLLM rows on Llama-3.2-1B's and Llama-3.1-8B's
  shapes (``load_format="dummy"``, bfloat16): SMC against vLLM's own ``generate(n=N)`` of the same tokens,
  interleaved, N = 32 and 256, prompts of 24 and 2,000 tokens, lipogram and no mask, with the counters
  (rows, tokens computed, cached, copied per step; model busy share, and genlm's own share of a step:
  the rest).

The models use the GPT-2 tokenizer (built offline; ``scripts/gpu_check.sh --prepare`` carries it in
``.gpucheck/``); a model's vocabulary is padded to its shape's (128,256 for the Llama-3 shapes), so the
model's work is the real shape's while rows have 50,257 entries. Tables go to stdout, and with the logs
into ``--out`` (default ``$OUT``, else ``.gpucheck/out``): ``gpu_check.md``, ``gpu_check.json``.

    python benchmarks/gpu_check.py [--dry-run] [--only rows,trie] [--out DIR] [--budget 480]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: Random-weight Llama shapes (the models' own configs, weights drawn at random): hidden size,
#: MLP size, layers, attention heads, KV heads, vocabulary, tied embeddings.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=0, tie_word_embeddings=False),
    "vtiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=0, tie_word_embeddings=False),  # head size 64: vLLM's CPU attention
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}  # fmt: skip
SHAPE_NAMES = {
    "tiny": "tiny Llama",
    "vtiny": "tiny Llama",
    "135m": "SmolLM2-135M",
    "1b": "Llama-3.2-1B",
    "8b": "Llama-3.1-8B",
}

#: Part -> (time guard in seconds on the GPU machine, on a dry run).
PARTS: dict[str, tuple[float, float]] = {
    "rows": (90, 60),
    "trie": (60, 60),
    "smc:135m": (120, 60),
    "smc:1b": (90, 60),
    "smc:8b": (150, 60),
    "overhead": (150, 90),
    "step:1b": (150, 60),
    "step:8b": (170, 60),
    "profile:8b": (120, 60),
}
DRY_PARTS = ("rows", "trie", "smc:tiny", "overhead", "step:tiny", "profile:tiny")
#: Parts the GPU machine runs only when ``--only`` names them (a dry run runs them all).
ASKED_FOR = ("step:", "profile:")
#: The vLLM parts (``--only vllm``), with their guards, on the GPU machine and on a dry run.
VLLM_PARTS: dict[str, tuple[float, float]] = {
    "vllm:rows": (150, 240),
    "vllm:smc:1b": (170, 240),
    "vllm:smc:8b": (160, 1),
}
VLLM_DRY_PARTS = ("vllm:rows", "vllm:smc:vtiny")
#: What each part is, in the order of the issue's list (for the summary).
SECTIONS = {
    "rows": "1. genlm-hf rows on the device vs a CPU float64 reference",
    "trie": "2. torch trie on the device vs numba",
    "overhead": "3. bench_overhead.py with rows on the device",
    "smc": "4. bench_smc.py's hf rows vs HF's own batched decode",
    "flush": "5. flush policies (idle, eager) on the plain particle program",
    "vllm": "6. genlm-vllm rows vs genlm-hf and vLLM's own logprobs; live sessions",
    "vllm-smc": "7. bench_smc.py's vLLM rows vs vLLM's own generate(n=N)",
    "step": "8. genlm-hf's model call and SMC step vs HF's bare decode step",
    "profile": "9. torch.profiler: HF's bare decode step vs genlm-hf's model call",
}
#: The step parts' grid on the GPU machine (N, prompt lengths, counted rounds) and on a dry run.
STEP_GRID = {"n": [32, 256, 1024], "prompts": [24, 2000], "rounds": 7}
STEP_DRY_GRID = {"n": [4, 8], "prompts": [24, 100], "rounds": 2}
#: genlm-hf's options in the step parts (each cell runs once per variant): the default, and the opt-in
#: room after a plain step's past (its next steps write in place; room for every counted step).
STEP_VARIANTS: dict[str, dict[str, Any]] = {"": {}, " decode_room=32": {"decode_room": 32}}
#: The N at which the step parts also run particles resampled uniformly after every step (duplicates
#: deduplicated, each step's past gathered), with genlm-hf's defaults.
RESAMPLED_N = (256, 8)
#: The profile parts' cells (N, prompt lengths, profiled steps) on the GPU machine and on a dry run.
PROFILE_GRID = {"n": [256], "prompts": [24, 500], "steps": 3}
PROFILE_DRY_GRID = {"n": [8], "prompts": [24], "steps": 2}
#: bench_overhead.py's grid on the GPU machine and on a dry run.
OVERHEAD_ARGS = ["--n", "32,256,1024", "--context", "24,8000", "--vocab", "50257,128256", "--steps", "12"]
OVERHEAD_DRY_ARGS = ["--n", "8", "--context", "24,200", "--vocab", "50257", "--steps", "3", "--breakdown-rounds", "1"]


# ---- helpers shared by the parts ------------------------------------------------------------------


class Part:
    """What one part found: tables, failures (a part with none passed) and numbers for the JSON."""

    def __init__(self, name: str, result: str | None = None):
        self.name = name
        self.tables: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.numbers: dict[str, Any] = {}
        self.result = result  # where what was found so far goes (a part cut off for time keeps it)
        self.t0 = time.perf_counter()

    def table(self, section: str, title: str, header: list[str], rows: list[list[str]]) -> None:
        from genlm_core.cli import table

        self.tables.append({"section": section, "title": title, "header": header, "rows": rows})
        print(f"\n== {SECTIONS[section]}: {title}\n{table(header, rows)}", flush=True)
        self.save()

    def save(self) -> None:
        """Write what this part found so far to its result file."""
        if self.result is None:
            return
        found = {
            "part": self.name,
            "ok": not self.failures,
            "failures": self.failures,
            "notes": self.notes,
            "tables": self.tables,
            "numbers": self.numbers,
            "seconds": time.perf_counter() - self.t0,
        }
        Path(self.result).write_text(json.dumps(found, indent=1, default=str))

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"FAIL [{self.name}] {message}", flush=True)

    def note(self, message: str) -> None:
        self.notes.append(message)
        print(f"[{self.name}] {message}", flush=True)


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def synced(fn: Callable[[Any], Any], arg: Any, device: Any) -> Callable[[], None]:
    """``fn(arg)``, then wait for the device (what a timing of ``fn`` must include)."""

    def call() -> None:
        fn(arg)
        sync(device)

    return call


def gpt2_tokenizer() -> Any:
    from genlm_core.testing.tokenizers import load_tokenizer

    return load_tokenizer("gpt2")


def build_llama(shape: str, tokenizer: Any, device: str, dtype: Any, seed: int = 0, std: float | None = None) -> Any:
    """A random-weight Llama of ``shape`` built directly on ``device`` in ``dtype`` (the vocabulary is at
    least the tokenizer's); with ``std``, matrices are redrawn with that deviation (peaked rows)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = dict(SHAPES[shape])
    spec["vocab_size"] = max(spec["vocab_size"], len(tokenizer))
    cfg = LlamaConfig(
        **spec,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, std)
    return model.eval()


def hf_lm(model: Any, tokenizer: Any, **options: Any) -> Any:
    """genlm-hf's LM over a model already loaded (no entry point, no folder: the backend's class itself)."""
    from genlm_hf.lm import AsyncTransformer
    from genlm_hf.options import HFOptions

    return AsyncTransformer(model, tokenizer, HFOptions(**options))


# ---- 1. rows --------------------------------------------------------------------------------------


def row_contexts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[list[int]]]:
    """Three rounds of contexts as an SMC and a byte beam ask for them: fresh contexts of several lengths;
    each extended by a token, and two siblings of the longest (KV reuse); each extended by four more, and a
    branch ``c+a``, ``c+a+b``, ``c+a+d`` (shared new tokens, packed)."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    first = [tokens(n) for n in lengths]
    second = [c + tokens(1) for c in first] + [first[-1] + tokens(1) for _ in range(2)]
    a, b, d = tokens(1), tokens(1), tokens(1)
    third = [c + tokens(4) for c in second[: len(first)]] + [second[0] + a, second[0] + a + b, second[0] + a + d]
    return [first, second, third]


def reference_rows(ref: Any, contexts: list[list[int]], vocab: int) -> dict[tuple[int, ...], Any]:
    """float64 next-token logprobs of every context on the CPU: one forward pass per longest sequence,
    the head only at the positions asked for, normalised over the tokenizer's vocabulary."""
    import torch

    wanted = sorted({tuple(c) for c in contexts}, key=len, reverse=True)
    leaves: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for c in wanted:
        leaf = next((s for s in leaves if s[: len(c)] == c), c)
        leaves.setdefault(leaf, []).append(c)
    out = {}
    with torch.no_grad():
        for leaf, members in leaves.items():
            hidden = ref.model(input_ids=torch.tensor([leaf])).last_hidden_state[0]
            positions = torch.tensor([len(c) - 1 for c in members])
            logits = ref.lm_head(hidden[positions])[:, :vocab]
            for c, row in zip(members, torch.log_softmax(logits, -1)):
                out[c] = row
    return out


def genlm_rows(lm: Any, rounds: list[list[list[int]]]) -> list[Any]:
    async def ask(contexts: list[list[int]]) -> list[Any]:
        return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))

    return [row for contexts in rounds for row in asyncio.run(ask(contexts))]


def max_diff(rows: list[Any], contexts: list[list[int]], ref: dict[tuple[int, ...], Any]) -> float:
    import torch

    worst = 0.0
    for row, c in zip(rows, contexts):
        ours, theirs = row.detach().to("cpu", torch.float64), ref[tuple(c)]
        finite = torch.isfinite(theirs)
        if not torch.equal(torch.isfinite(ours), finite):
            return float("inf")
        worst = max(worst, float((ours[finite] - theirs[finite]).abs().max()))
    return worst


def part_rows(part: Part, args: argparse.Namespace) -> None:
    import torch

    from genlm_core.testing import bounds

    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # no TF32 in float32 matmuls (torch's default, made sure)
    shape = "tiny" if args.dry_run else "135m"
    lengths = [1, 3, 12, 40] if args.dry_run else [1, 3, 12, 40, 150, 400]
    tok = gpt2_tokenizer()
    vocab = len(tok)
    model = build_llama(shape, tok, "cpu", torch.float32, seed=1, std=0.05)
    ref = copy.deepcopy(model).to(torch.float64)
    rounds = row_contexts(vocab, lengths)
    contexts = [c for r in rounds for c in r]
    t0 = time.perf_counter()
    reference = reference_rows(ref, contexts, vocab)
    part.note(f"float64 reference of {len(reference)} contexts on the CPU in {time.perf_counter() - t0:.1f} s")
    part.note(f"float32 matmul precision: {torch.get_float32_matmul_precision()} (no TF32)")
    del ref
    model = model.to(device)
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        lm = hf_lm(model, tok, batch_size=16)
        rows = genlm_rows(lm, rounds)
        stats = lm.batcher.stats
        diff = max_diff(rows, contexts, reference)
        name = str(dtype).removeprefix("torch.")
        # The dtype's own rounding on this device: the model's plain unbatched forward pass against the same
        # float64 reference sets the scale; genlm-hf's batched rows (other accumulation orders, the KV reused)
        # are another computation of that size: within twice it (bounds.model_difference's second factor).
        with torch.inference_mode():
            plain = [
                torch.log_softmax(model(input_ids=torch.tensor([c], device=device)).logits[0, -1, :vocab].float(), -1)
                for c in contexts
            ]
        plain_diff = max_diff(plain, contexts, reference)
        if dtype == torch.float32 and args.rows_tol is not None:
            tol, basis = args.rows_tol, "--rows-tol"
        else:
            tol = float(bounds.model_difference(plain_diff, factor=2.0))
            basis = f"2 x {plain_diff:.2g}, HF's unbatched {name} vs float64"
        bounds.record(f"gpu check rows: {name}", diff, bounds.Bound(tol, basis))
        devices = sorted({str(r.device) for r in rows})
        ok = diff <= tol
        on_device = all(r.device.type == device.type for r in rows)
        table.append(
            [
                f"{SHAPE_NAMES[shape]} {name}",
                str(device),
                str(len(rows)),
                f"{stats.batches}",
                ",".join(map(str, lengths)),
                f"{diff:.3g}",
                f"{tol:.3g} ({basis})",
                ",".join(devices),
                "ok" if ok and on_device else "FAIL",
            ]
        )
        part.numbers[name] = {
            "max_abs_diff": diff,
            "tolerance": tol,
            "plain_diff": plain_diff,
            "rows": len(rows),
            "row_devices": devices,
        }
        if not ok:
            part.fail(f"{name} rows on {device} differ from the CPU float64 reference by {diff:.3g} > {tol:.3g}")
        if not on_device:
            part.fail(
                f"{name} rows came back on {devices}, not on {device}: genlm-hf must keep rows on the model's device"
            )
        if any(r.dtype != torch.float32 or r.shape != (vocab,) for r in rows):
            part.fail(f"{name} rows are not float32 of shape ({vocab},)")
        lm.cleanup()
    header = ["model", "device", "rows", "batches", "context lengths", "max abs diff vs float64", "tolerance"]
    part.table("rows", "3 rounds (fresh, +1 and siblings, +4 and a branch)", [*header, "row device", "result"], table)


# ---- 2. trie --------------------------------------------------------------------------------------


def part_trie(part: Part, args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from _common import best_of, fmt_s

    from genlm_core import decode_vocab
    from genlm_core.testing import bounds
    from genlm_core.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

    device = torch.device(args.device)
    vocab = decode_vocab(gpt2_tokenizer())[0]
    t0 = time.perf_counter()
    numba_trie = TokenCharacterTrie(vocab)
    built = time.perf_counter() - t0
    torch_trie = ParallelTokenCharacterTrie(vocab, device=device, index=numba_trie.index)
    on_device = ParallelTokenCharacterTrie(vocab, device=device, output="torch", index=numba_trie.index)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, len(vocab), generator=g, dtype=torch.float64) * 3
    data = {"sum": torch.softmax(logits, -1), "max": torch.log_softmax(logits, -1)}
    # sum: float64 sums of at most V probabilities (total 1) in two orders, twice bounds.sum_error in float64;
    # max: exact (a maximum rounds nothing)
    tols = {"sum": float(2 * bounds.sum_error(len(vocab), 1.0, u=bounds.U64)), "max": 0.0}
    rows = []
    for op, ws in data.items():
        tol = tols[op]
        for batch in (1, 32):
            method = f"batch_weight_{op}" if batch > 1 else f"weight_{op}"
            host = ws[:batch].numpy() if batch > 1 else ws[0].numpy()
            on_device_ws = torch.from_numpy(host).to(device)
            diff = float(np.abs(getattr(torch_trie, method)(host) - getattr(numba_trie, method)(host)).max())

            run_device = synced(getattr(on_device, method), on_device_ws, device)
            run_numba = synced(getattr(numba_trie, method), host, "cpu")
            repeat = 3 if args.dry_run else 10
            t_dev = best_of(run_device, repeat=repeat, warmup=2)
            t_cpu = best_of(run_numba, repeat=repeat, warmup=2)
            rows.append(
                [f"weight_{op}", str(batch), f"{diff:.3g}", fmt_s(t_cpu), fmt_s(t_dev), f"{t_cpu / t_dev:.3g}x"]
            )
            part.numbers[f"{op}{batch}"] = {"max_abs_diff": diff, "tolerance": tol, "numba_s": t_cpu, "torch_s": t_dev}
            bounds.record(f"gpu check trie: weight_{op} batch {batch}", diff, tol)
            if not diff <= tol:
                part.fail(f"torch trie on {device}: weight_{op} (batch {batch}) differs from numba by {diff:.3g}")
    title = f"GPT-2 vocabulary ({len(vocab)} tokens, {numba_trie.num_nodes} nodes; numba trie built in {built:.1f} s)"
    header = ["op", "batch", f"max abs diff (tol sum {tols['sum']:.2g}, max 0)", "numba (CPU)", f"torch ({device})"]
    header.append("numba / torch")
    part.table("trie", title, header, rows)


# ---- 4, 5. SMC against HF's own decode; flush policies -------------------------------------------


def part_smc(part: Part, args: argparse.Namespace, shape: str) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_smc
    from smc import smc, token_mask  # examples/smc.py, on the path that bench_smc set

    device = torch.device(args.device)
    dry = args.dry_run
    n, steps, rounds = (4, 3, 1) if dry else (args.n, args.steps, 2)
    prompts = [24] if dry else [24, 500]
    tok = gpt2_tokenizer()
    t0 = time.perf_counter()
    model = build_llama(shape, tok, str(device), torch.bfloat16)
    sync(device)
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    name = f"{SHAPE_NAMES[shape]} bf16"
    part.note(f"{name}: {params / 1e9:.2f} B parameters built on {device} in {built:.1f} s")
    part.numbers.update(params=params, build_s=built)

    lm = hf_lm(model, tok, batch_size=n, timeout=0)  # bench_smc's hf options
    engine = bench_smc.Engine(lm, "hf")
    lipogram = token_mask(lm, b"e", None, set()).to(device)
    everything = torch.ones(len(lm.byte_vocab), dtype=torch.bool, device=device)
    short = bench_smc.prompt_of(lm, 24)
    probe = asyncio.run(lm.next_token_logprobs(short))
    part.note(f"rows come back on {probe.device}")
    table = []
    for length in prompts:
        prompt = bench_smc.prompt_of(lm, length)
        for mask_name, mask in (("lipogram", lipogram), ("none", everything)):
            t_e, t_o, ratios, work = bench_smc.run_case(engine, "hf", prompt, n, steps, mask, rounds, 0.5)
            table.append(
                [
                    name,
                    str(len(prompt)),
                    str(steps),
                    mask_name,
                    f"{t_e:.3f} s",
                    f"{t_o:.3f} s",
                    f"{t_o / steps * 1e3:.1f} ms",
                    f"{statistics.median(ratios):.2f}x",
                    f"{min(ratios):.2f}-{max(ratios):.2f}",
                    f"{work['rows']:.1f}",
                    f"{work['computed']:.1f}",
                    f"{work['busy']:.0%}",
                ]
            )
            part.numbers[f"smc p{len(prompt)} {mask_name}"] = {"hf_s": t_e, "ours_s": t_o, "ratios": ratios, **work}
    header = ["model", "prompt", "T", "constraint", "HF generate", "SMC (ours)", "ours/step", "ours/HF", "spread"]
    title = f"N={n}, {rounds} interleaved rounds after a warm-up, on {device}"
    part.table("smc", title, [*header, "rows/step", "tokens run/step", "model busy"], table)
    lm.cleanup()
    gc.collect()

    # 5. the same particle program under each flush policy, interleaved (the default timeout bounds waits)
    lms = {policy: hf_lm(model, tok, batch_size=n, flush=policy) for policy in ("idle", "eager")}
    per_step: dict[str, list[float]] = {p: [] for p in lms}
    batches: dict[str, list[float]] = {p: [] for p in lms}
    prompt = short
    for r in range(rounds + 2):  # round 0 warms up
        for policy, flm in lms.items():
            flm.clear_cache()
            gc.collect()
            before = flm.batcher.stats.batches
            t0 = time.perf_counter()
            asyncio.run(smc(flm, prompt, n, steps, lipogram, set(), seed=r))
            elapsed = time.perf_counter() - t0
            if r:
                per_step[policy].append(elapsed / steps)
                batches[policy].append((flm.batcher.stats.batches - before) / steps)
    idle = statistics.median(per_step["idle"])
    flush_rows = []
    for policy in lms:
        t = statistics.median(per_step[policy])
        spread = f"{min(per_step[policy]) * 1e3:.1f}-{max(per_step[policy]) * 1e3:.1f} ms"
        flush_rows.append(
            [name, policy, f"{t * 1e3:.2f} ms", spread, f"{statistics.median(batches[policy]):.1f}", f"{t / idle:.2f}x"]
        )
        part.numbers[f"flush {policy}"] = {"s_per_step": per_step[policy], "batches_per_step": batches[policy]}
    title = f"N={n}, T={steps}, lipogram, prompt {len(prompt)}, {rounds + 1} interleaved rounds, on {device}"
    part.table("flush", title, ["model", "flush", "time/step", "spread", "batches/step", "vs idle"], flush_rows)
    for flm in lms.values():
        flm.cleanup()


# ---- 8, 9. genlm-hf's model call and SMC step against HF's bare decode step; the profiler --------


def grid(args: argparse.Namespace, gpu: dict[str, Any], dry: dict[str, Any]) -> dict[str, Any]:
    """A part's grid: ``gpu`` or, on a dry run, ``dry``; each ``--step-*`` argument given overrides."""
    out = dict(dry if args.dry_run else gpu)
    for key in out:
        given = getattr(args, f"step_{key}", None)
        if given:
            out[key] = [int(x) for x in given.split(",")] if isinstance(out[key], list) else int(given)
    return out


def fits(part: Part, hf_step: Any, model: Any, n: int, tokens: int, vocab: int, device: Any) -> bool:
    """Whether a cell of ``n`` rows of ``tokens`` fits in the device's free memory (always, on the CPU);
    a cell that does not is noted with what it needs."""
    import torch

    if device.type != "cuda":
        return True
    free = torch.cuda.mem_get_info(device)[0]
    need = hf_step.memory_needed(model, n, tokens, vocab) + 4 * 2**30  # genlm's older stored blocks
    if need <= 0.95 * free:
        return True
    part.note(f"N={n}, {tokens} tokens skipped: needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    return False


def part_step(part: Part, args: argparse.Namespace, shape: str) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_smc
    import hf_step

    device = torch.device(args.device)
    g = grid(args, STEP_GRID, STEP_DRY_GRID)
    warmup = 2
    tok = gpt2_tokenizer()
    t0 = time.perf_counter()
    model = build_llama(shape, tok, str(device), torch.bfloat16)
    sync(device)
    name = f"{SHAPE_NAMES[shape]} bf16"
    part.note(f"{name}: built on {device} in {time.perf_counter() - t0:.1f} s")
    lms = {label: hf_lm(model, tok, batch_size=max(g["n"]), timeout=0, **o) for label, o in STEP_VARIANTS.items()}
    rows: list[list[str]] = []
    try:
        for n in g["n"]:
            for length in g["prompts"]:
                variants = [(label, lm, False) for label, lm in lms.items()]
                variants += [(" resampled", lms[""], True)] if n in RESAMPLED_N else []
                for label, lm, resample in variants:
                    lm.batcher.batch_size = n  # one batch per SMC step
                    prompt = bench_smc.prompt_of(lm, length)
                    tokens = length + 2 * (warmup + g["rounds"]) + 2 + lm.options.decode_room
                    if not fits(part, hf_step, model, n, tokens, len(tok), device):
                        skipped = [f"{name}{label}", str(n), str(length), "skipped: memory"]
                        rows.append(skipped + [""] * (len(hf_step.HEADER) - 4))
                        continue
                    cell = asyncio.run(hf_step.time_cell(model, lm, prompt, n, g["rounds"], warmup, resample))
                    s = hf_step.summary(cell)
                    rows.append(hf_step.table_row(f"{name}{label}", n, length, s))
                    part.numbers[f"N{n} p{length}{label}"] = {**s, "times": cell["times"]}
                    part.save()
                    lm.clear_cache()
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        title = f"{g['rounds']} interleaved rounds (bare, SMC step timed inside, SMC step) after {warmup}, on {device}"
        if rows:
            part.table("step", title, hf_step.HEADER, rows)
        for lm in lms.values():
            lm.cleanup()


def part_profile(part: Part, args: argparse.Namespace, shape: str) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_smc
    import hf_step

    device = torch.device(args.device)
    g = grid(args, PROFILE_GRID, PROFILE_DRY_GRID)
    tok = gpt2_tokenizer()
    model = build_llama(shape, tok, str(device), torch.bfloat16)
    name = f"{SHAPE_NAMES[shape]} bf16"
    lm = hf_lm(model, tok, batch_size=max(g["n"]), timeout=0)
    where = Path(args.result).parent.parent / "profile" if args.result else None
    try:
        for n in g["n"]:
            lm.batcher.batch_size = n
            for length in g["prompts"]:
                if not fits(part, hf_step, model, n, length + 10, len(tok), device):
                    continue
                prompt = bench_smc.prompt_of(lm, length)
                found = asyncio.run(hf_step.profile_cell(model, lm, prompt, n, g["steps"], where))
                step = found["step"]
                what = f"{name}, N={n}, prompt {length}: {g['steps']} steps each, per step; genlm's step {step}"
                part.table("profile", f"{what}: top ops by self time", hf_step.OPS_HEADER, found["ranked"])
                part.table("profile", f"{what}: ops run a different number of times", hf_step.OPS_HEADER,
                           found["differ"])  # fmt: skip
                totals = [
                    [k, f"{v['calls']:.0f}", f"{v['cpu_us'] / 1e3:.2f} ms", f"{v['device_us'] / 1e3:.2f} ms"]
                    for k, v in found["totals"].items()
                ]
                part.table("profile", f"{what}: totals", ["profiled", "ops/step", "self CPU", "self device"], totals)
                calls = {side: {op: v["calls"] for op, v in ops.items()} for side, ops in found["ops"].items()}
                part.numbers[f"N{n} p{length}"] = {
                    "totals": found["totals"],
                    "calls": calls,  # per op and step: the bare step's and the model call's
                    "files": found["files"],
                    "step": step,
                }
                if found["files"]:
                    part.note(f"full tables: {', '.join(found['files'])}")
                lm.clear_cache()
                gc.collect()
    finally:
        lm.cleanup()


# ---- 6, 7. genlm-vllm ----------------------------------------------------------------------------


def model_folder(shape: str, where: Path, dtype: Any, weights: bool, std: float | None = None) -> Path:
    """A Llama folder of ``shape`` with the GPT-2 tokenizer: random weights (``weights``), or only its
    config (for vLLM's ``load_format="dummy"``: the model's work without writing gigabytes)."""
    from transformers import LlamaConfig

    tok = gpt2_tokenizer()
    folder = where / f"{shape}-{str(dtype).removeprefix('torch.')}{'' if weights else '-dummy'}"
    if (folder / "config.json").exists():
        return folder
    if weights:
        build_llama(shape, tok, "cpu", dtype, seed=1, std=std).save_pretrained(folder)
    else:
        spec = dict(SHAPES[shape])
        spec["vocab_size"] = max(spec["vocab_size"], len(tok))
        cfg = LlamaConfig(
            **spec, max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
        )
        cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def vllm_lm(folder: Path, **options: Any) -> Any:
    """genlm-vllm's LM over ``folder`` (no entry point: the backend's class itself)."""
    from genlm_vllm.lm import AsyncVirtualLM

    return AsyncVirtualLM.from_name(str(folder), **options)


def vllm_engine_opts(dry: bool, **more: Any) -> dict[str, Any]:
    """vLLM arguments for the check's engines: on a dry run, the CPU's small KV space and eager mode."""
    if dry:
        return {"kv_cache_memory_bytes": 512 * 2**20, "enforce_eager": True, "max_num_batched_tokens": 512, **more}
    return {"gpu_memory_utilization": 0.85, **more}


def part_vllm_rows(part: Part, args: argparse.Namespace) -> None:
    import torch

    from genlm_core.testing import bounds
    from genlm_core.testing.live import check_live_sequences
    from genlm_vllm.tools import selftest
    from genlm_vllm.vllm_api import client, release

    dry = args.dry_run
    torch.set_float32_matmul_precision("highest")
    shape = "vtiny" if dry else "135m"
    folder = model_folder(shape, Path(args.models), torch.float32, weights=True, std=0.05)
    from genlm_hf.lm import AsyncTransformer

    hf = AsyncTransformer.from_name(str(folder), dtype="float32", device=args.device, batch_size=16)
    contexts = selftest.contexts_for(hf.vocab_size, n=8)
    want = [hf.next_token_logprobs_sync(c).to("cpu") for c in contexts]
    # Two float32 runs of the folder (vLLM's and genlm-hf's): 4 x its float32 error against a float64 run on
    # the CPU, on the same contexts (and for the kept tokens, on those tokens); --vllm-tol sets it instead.
    rows_tol = bounds.rows_bound(str(folder))
    kept_error = bounds.float32_error(str(folder), contexts, min_logprob=math.log(selftest.KEPT))
    derived_tol = float(bounds.model_difference(kept_error))  # the real one, reported beside what is applied
    vllm_tol = derived_tol if args.vllm_tol is None else args.vllm_tol
    hf.cleanup()
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free when it starts
    t0 = time.perf_counter()
    lm = vllm_lm(folder, dtype="float32", max_model_len=2048, engine_opts=vllm_engine_opts(dry))
    started = time.perf_counter() - t0
    facts = release.engine_facts(client.engine_config(lm.driver.engine))
    part.note(f"engine up in {started:.0f} s: {facts.describe()}")
    part.numbers["engine"] = {"start_s": started, "facts": facts.describe(), "env": release.runner_env(facts.runner)}
    table = []
    try:
        report = selftest.check(lm, contexts, batch_tol=float(rows_tol(contexts)))
        for problem in report.problems:
            part.fail(problem)
        lm.clear_cache()
        rows = [r.to("cpu") for r in asyncio.run(lm.batch_next_token_logprobs(contexts))]
        kept = max(float((a - b).abs()[b.exp() >= selftest.KEPT].max()) for a, b in zip(rows, want, strict=True))
        every = max(float((a - b).abs().max()) for a, b in zip(rows, want, strict=True))
        name = f"{SHAPE_NAMES[shape]} float32"
        vs_engine, batch_tol = report.tolerance_vs_engine, report.tolerance_batch
        table += [
            [name, "rows vs genlm-hf (p >= 1e-4)", f"{kept:.2g}", f"{vllm_tol:.2g}", f"all tokens {every:.2g}"],
            [name, "rows vs vLLM's logprobs=20", f"{report.max_diff_vs_engine:.2g}", f"{vs_engine:.2g}", ""],
            [name, "batched vs single", f"{report.max_diff_batch_vs_single:.2g}", f"{batch_tol:.2g}", ""],
        ]
        bounds.record("gpu check vllm: rows vs genlm-hf (p >= 1e-4)", kept, vllm_tol)
        part.numbers["rows"] = {
            "vs_hf_kept": kept,
            "vs_hf_all": every,
            "vs_vllm_logprobs": report.max_diff_vs_engine,
            "batch_vs_single": report.max_diff_batch_vs_single,
            "tolerance_vs_hf_kept": derived_tol,
            "tolerance_vs_hf_kept_applied": vllm_tol,
            "tolerance_vs_vllm_logprobs": report.tolerance_vs_engine,
            "tolerance_batch_vs_single": report.tolerance_batch,
        }
        if not kept <= vllm_tol:
            part.fail(f"rows differ from genlm-hf's by {kept:.3g} > {vllm_tol:.3g} where genlm-hf gives p >= 1e-4")
        lm.clear_cache()
        llm_engine = lm.driver.engine.llm_engine
        t0 = time.perf_counter()
        try:
            stats = check_live_sequences(
                lm,
                lm.driver.sessions.live,
                in_use=lambda: int(llm_engine.has_unfinished_requests()),
                steps=30,
                atol=rows_tol,
            )
            detail = (
                f"{stats.rows} rows: {stats.continued} continued, {stats.forked} forked, {stats.fresh} fresh; "
                f"{stats.tokens_computed} computed, {stats.tokens_copied} copied, {stats.tokens_cached} cached"
            )
            table.append([name, "live sessions vs uncached (shared check)", "ok", "4 x float32 error", detail])
            part.numbers["live"] = stats.as_dict()
        except AssertionError as exc:
            table.append(
                [name, "live sessions vs uncached (shared check)", "FAIL", "4 x float32 error", str(exc)[:200]]
            )
            part.fail(f"the shared live check: {exc}")
        part.numbers["live_s"] = time.perf_counter() - t0
    finally:
        part.table("vllm", facts.describe(), ["model", "check", "max abs diff", "tolerance", "detail"], table)
        lm.cleanup()


def part_vllm_smc(part: Part, args: argparse.Namespace, shape: str) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_smc
    from smc import token_mask  # examples/smc.py, on the path that bench_smc set

    from genlm_vllm.vllm_api import client, release

    dry = args.dry_run
    ns = [4, 8] if dry else [32, 256]
    prompts = [24, 100] if dry else [24, 2000]
    steps = 3 if dry else args.vllm_steps
    folder = model_folder(shape, Path(args.models), torch.bfloat16, weights=False)
    t0 = time.perf_counter()
    opts = vllm_engine_opts(dry, load_format="dummy", seed=0, max_num_seqs=max(ns))
    lm = vllm_lm(folder, dtype="bfloat16", max_model_len=4096, batch_size=max(ns), timeout=0, engine_opts=opts)
    started = time.perf_counter() - t0
    facts = release.engine_facts(client.engine_config(lm.driver.engine))
    part.note(f"{SHAPE_NAMES[shape]} (dummy bf16 weights): engine up in {started:.0f} s: {facts.describe()}")
    sessions = getattr(lm.driver, "sessions", None)
    if sessions is None:
        path = "plain requests (no live sessions)"
    else:
        path = f"resumable sessions ({sessions.not_resident})" if sessions.not_resident else "running vLLM requests"
    part.note(f"particles continue as {path}")
    part.numbers["engine"] = {"start_s": started, "facts": facts.describe(), "particles_as": path}
    engine = bench_smc.Engine(lm, "vllm")
    lipogram = token_mask(lm, b"e", None, set())
    everything = torch.ones(len(lm.byte_vocab), dtype=torch.bool)
    table: list[list[str]] = []
    header = ["model", "N", "prompt", "T", "constraint", "vLLM generate", "SMC (ours)", "ours/step", "ours/vLLM"]
    header += ["spread", "rows/step", "computed/step", "cached/step", "copied/step", "model busy", "genlm's share"]
    title = f"{facts.describe()}; {args.rounds} interleaved round(s) after a warm-up, on {args.device}"
    try:
        for n in ns:
            lm.batcher.batch_size = n  # one engine batch per SMC step, flushed as soon as every particle asked
            for length in prompts:
                prompt = bench_smc.prompt_of(lm, length)
                for mask_name, mask in (("lipogram", lipogram), ("none", everything)):
                    t_e, t_o, ratios, work = bench_smc.run_case(
                        engine, "vllm", prompt, n, steps, mask, args.rounds, 0.5
                    )
                    table.append(
                        [
                            f"{SHAPE_NAMES[shape]} bf16",
                            str(n),
                            str(len(prompt)),
                            str(steps),
                            mask_name,
                            f"{t_e:.3f} s",
                            f"{t_o:.3f} s",
                            f"{t_o / steps * 1e3:.1f} ms",
                            f"{statistics.median(ratios):.2f}x",
                            f"{min(ratios):.2f}-{max(ratios):.2f}",
                            f"{work['rows']:.1f}",
                            f"{work['computed']:.1f}",
                            f"{work['cached']:.0f}",
                            f"{work['copied']:.0f}",
                            f"{work['busy']:.0%}",
                            f"{1 - work['busy']:.0%}",
                        ]
                    )
                    key = f"N{n} p{len(prompt)} {mask_name}"
                    part.numbers[key] = {"vllm_s": t_e, "ours_s": t_o, "ratios": ratios, "steps": steps, **work}
                    part.save()
    finally:
        if table:
            part.table("vllm-smc", title, header, table)
        lm.cleanup()


# ---- the parts' process ---------------------------------------------------------------------------


def run_part(args: argparse.Namespace) -> int:
    """Run one part in this process; write what it found to ``--result`` (as it goes, and at the end)."""
    part = Part(args.part, args.result)
    try:
        if args.part == "rows":
            part_rows(part, args)
        elif args.part == "trie":
            part_trie(part, args)
        elif args.part.startswith("smc:"):
            part_smc(part, args, args.part.split(":", 1)[1])
        elif args.part == "vllm:rows":
            part_vllm_rows(part, args)
        elif args.part.startswith("step:"):
            part_step(part, args, args.part.split(":", 1)[1])
        elif args.part.startswith("profile:"):
            part_profile(part, args, args.part.split(":", 1)[1])
        elif args.part.startswith("vllm:smc:"):
            part_vllm_smc(part, args, args.part.split(":", 2)[2])
        else:
            raise ValueError(f"unknown part {args.part!r}")
    except Exception as exc:
        import traceback

        traceback.print_exc()
        part.fail(f"{type(exc).__name__}: {exc}")
    part.save()
    return 0 if not part.failures else 1


# ---- the driver -----------------------------------------------------------------------------------


def stream(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, float]:
    """Run ``cmd``, its output to stdout and to ``log``; kill its process group after ``timeout`` s.
    The exit status (None: killed for time) and the seconds it ran."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                out.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
        reader.join(timeout=5)
    return rc, time.perf_counter() - t0


def machine() -> dict[str, Any]:
    """What ran the check: versions, CPUs, the GPU and the commit (numba and transformers are not imported
    here: the driver only reads their versions, each part imports what it uses)."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def version_of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:  # on the path without its metadata: the module says
            return str(importlib.import_module(name).__version__)

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": version_of("transformers"),
        "numba": version_of("numba"),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    commit = ROOT / ".gpucheck" / "commit.txt"  # written by --prepare: the machine may have no .git
    if os.environ.get("GENLM_COMMIT"):  # set by scripts/gpu_check.sh from --prepare's record
        info["commit"] = os.environ["GENLM_COMMIT"] + " (from --prepare)"
        return info
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10)
        info["commit"] = head.stdout.strip() if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    if not info["commit"] and commit.exists():
        info["commit"] = commit.read_text().strip() + " (from --prepare)"
    return info


def markdown(info: dict[str, Any], results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def md(header: list[str], rows: list[list[str]]) -> str:
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

    mode = "dry run (CPU, tiny shapes)" if args.dry_run else f"device {args.device}"
    out = [f"# genlm GPU check: {mode}", "", "```", json.dumps(info, indent=1), "```", ""]
    summary = [
        [r["part"], "ok" if r["ok"] else "FAIL", f"{r['seconds']:.0f} s", "; ".join(r["failures"])[:300]]
        for r in results
    ]
    out += ["## Parts", "", md(["part", "result", "time", "failures"], summary), ""]
    for key, section in SECTIONS.items():
        out += [f"## {section}", ""]
        for r in results:
            for t in r.get("tables", []):
                if t["section"] == key:
                    out += [f"{t['title']}", "", md(t["header"], t["rows"]), ""]
            if key == "overhead" and r["part"] == "overhead" and r.get("log_tail"):
                out += ["```", r["log_tail"], "```", ""]
    return "\n".join(out)


def vllm_environment(env: dict[str, str], dry: bool) -> str | None:
    """Put genlm-vllm (and on the GPU machine, the carried vLLM) on ``env``'s path; None, or why the
    vllm parts cannot run."""
    paths = [str(ROOT / "plugins" / "genlm_vllm")]
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_payload

    site = vllm_payload.HOME / "site"
    if (site / "vllm" / "__init__.py").exists():
        paths.append(str(site))
    elif not dry:
        return (
            f"no vLLM in {site}: build the payload where a registry is reachable (bash scripts/gpu_check.sh "
            "--prepare vllm), carry each part and run 'bash scripts/gpu_check.sh --stash' with it (docs/gpu.md)"
        )
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    if dry:
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # no Triton CPU backend for V2 here
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes (the test)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu on a dry run)")
    ap.add_argument("--only", default="", help="comma-separated parts (default: all)")
    ap.add_argument("--out", default=None, help="where the summary goes (default: $OUT, else .gpucheck/out)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all parts (each also has a guard)")
    ap.add_argument(
        "--rows-tol", type=float, default=None, help="float32 rows vs float64: most |Δ| (default: 2 x HF's unbatched)"
    )
    ap.add_argument("--n", type=int, default=32, help="particles for the SMC parts")
    ap.add_argument("--steps", type=int, default=32, help="SMC steps for the SMC parts")
    ap.add_argument(
        "--vllm-tol",
        type=float,
        default=None,
        help="vllm:rows vs genlm-hf where p >= 1e-4 (default: 4 x float32 error)",
    )
    ap.add_argument("--vllm-steps", type=int, default=24, help="SMC steps for the vllm:smc parts (default 24)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds after a warm-up, vllm:smc parts")
    ap.add_argument("--models", default=None, help="where model folders are written (default: OUT/models)")
    ap.add_argument("--step-n", default=None, help="N for the step and profile parts, e.g. 32,256")
    ap.add_argument("--step-prompts", default=None, help="prompt lengths for the step and profile parts")
    ap.add_argument("--step-rounds", default=None, help="counted rounds of the step parts (default 7)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    if args.part:
        return run_part(args)

    out = Path(args.out or os.environ.get("OUT") or ROOT / ".gpucheck" / "out")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    info = machine()
    info["mode"] = "dry run" if args.dry_run else "full"
    print(json.dumps(info), flush=True)
    if args.device.startswith("cuda") and not info["gpu"]:
        print("no CUDA device here: run `bash scripts/gpu_check.sh --dry-run` on a machine without one", flush=True)
        return 2
    parts = list(DRY_PARTS if args.dry_run else PARTS)
    if not args.only and not args.dry_run:  # issue 46's parts run when asked for (--only step,profile)
        parts = [p for p in parts if not p.startswith(ASKED_FOR)]
    if args.only:
        wanted = args.only.split(",")
        parts += list(VLLM_DRY_PARTS if args.dry_run else VLLM_PARTS)  # only when asked for
        parts = [p for p in parts if p in wanted or p.split(":")[0] in wanted]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if any(p.startswith("vllm") for p in parts):
        problem = vllm_environment(env, args.dry_run)
        if problem is not None:
            print(problem, flush=True)
            return 2
    models = args.models or str(out / "models")
    passthrough = ["--device", args.device, "--n", str(args.n)]
    passthrough += ["--steps", str(args.steps), "--vllm-steps", str(args.vllm_steps), "--rounds", str(args.rounds)]
    for flag in ("rows_tol", "vllm_tol"):
        if getattr(args, flag) is not None:
            passthrough += [f"--{flag.replace('_', '-')}", repr(getattr(args, flag))]
    for flag in ("step_n", "step_prompts", "step_rounds"):
        if getattr(args, flag):
            passthrough += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    passthrough += ["--models", models] + (["--dry-run"] if args.dry_run else [])
    deadline = time.monotonic() + args.budget
    results: list[dict[str, Any]] = []
    for part in parts:
        guard = {**PARTS, **VLLM_PARTS, "vllm:smc:vtiny": (240, 240)}.get(part, (60, 60))[1 if args.dry_run else 0]
        left = deadline - time.monotonic()
        print(f"\n#### {part} (guard {guard:.0f} s, {max(left, 0):.0f} s of the budget left)", flush=True)
        if left < 10:
            results.append({"part": part, "ok": False, "failures": ["skipped: the budget was spent"], "seconds": 0})
            continue
        timeout = min(guard, left)
        log = out / "logs" / f"{part.replace(':', '-')}.log"
        if part == "overhead":
            script = HERE / "bench_overhead.py"
            json_path = out / "overhead.json"
            grid = OVERHEAD_DRY_ARGS if args.dry_run else OVERHEAD_ARGS
            cmd = [sys.executable, str(script), "--device", args.device, *grid, "--json", str(json_path)]
            json_path.unlink(missing_ok=True)
            if script.exists():
                rc, secs = stream(cmd, log, timeout, env)
                failures = [] if rc == 0 else [f"bench_overhead.py {'timed out' if rc is None else f'exited {rc}'}"]
                if rc == 0 and not json_path.exists():
                    failures.append("bench_overhead.py wrote no --json")
            else:
                secs, failures = 0.0, [f"{script.relative_to(ROOT)} not found"]
                log.write_text(failures[0] + "\n")
            result: dict[str, Any] = {"part": part, "ok": not failures, "failures": failures, "seconds": secs}
            result["command"] = " ".join(cmd[1:])
            result["log_tail"] = "\n".join(log.read_text().splitlines()[-40:])
            if json_path.exists():
                result["json"] = json.loads(json_path.read_text())
        else:
            result_path = out / "logs" / f"{part.replace(':', '-')}.json"
            result_path.unlink(missing_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--result", str(result_path)]
            rc, secs = stream(cmd + passthrough, log, timeout, env)
            if result_path.exists():
                result = json.loads(result_path.read_text())
                result["seconds"] = secs
            else:
                why = f"timed out after {timeout:.0f} s" if rc is None else f"its process exited {rc} with no result"
                tail = " | ".join(log.read_text().splitlines()[-3:])
                result = {
                    "part": part,
                    "ok": False,
                    "failures": [f"{why}: {tail}"[:600] if tail else why],
                    "seconds": secs,
                }
            if rc is None and result.get("ok"):
                result["ok"], result["failures"] = False, [f"timed out after {timeout:.0f} s"]
        results.append(result)
    from genlm_core.cli import table

    summary = [[r["part"], "ok" if r["ok"] else "FAIL", f"{r['seconds']:.0f} s"] for r in results]
    print("\n== summary\n" + table(["part", "result", "time"], summary), flush=True)
    for r in results:
        for failure in r["failures"]:
            print(f"FAIL [{r['part']}] {failure}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps({"machine": info, "parts": results}, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(info, results, args))
    failed = [r["part"] for r in results if not r["ok"]]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all parts passed'}; summary in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
