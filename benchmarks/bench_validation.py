"""What checking every input costs on the hot paths, measured side by side, interleaved.

1. ``AsyncLM.request`` (runs on every ``next_token_logprobs``): today's checks vs the earlier,
   laxer conversion (``array("q", ids)`` plus a range check), per call.
2. ``AsyncTokenCharacterTrie.weight_sum`` x 128 concurrent (each call validated, snapshotted, keyed
   by content), at ``--base REV`` vs the working tree, each in its own process, alternating; and
   against the engine's own ``batch_weight_sum`` of the same 128 rows (the limit).
3. The byte LM's 300-byte prefill (bench_bytes' workload), likewise at ``--base REV`` vs ours.

    python benchmarks/bench_validation.py [--base REV] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from _common import ROOT, fmt_s

from genlm_core import Request, load_model_by_name
from genlm_core.cli import table
from genlm_core.testing import bounds


def earlier_request(ids: list[int], vocab_size: int) -> Request:
    """The conversion ``request`` did before these checks (bools, sets and floats slipped through)."""
    converted = array("q", ids)
    if min(converted) < 0 or max(converted) >= vocab_size:
        raise ValueError("out of range")
    return Request(tuple(converted), None)


def interleaved(fns: dict[str, object], rounds: int, number: int) -> dict[str, list[float]]:
    """Seconds per call of each function, measured A, B, A, B, ... ``rounds`` times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()  # type: ignore[operator]
            times[name].append((time.perf_counter() - t0) / number)
    return times


def spread(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4)
    return f"{fmt_s(q[0])}–{fmt_s(q[2])}"


def bench_request(rounds: int) -> list[list[str]]:
    lm = load_model_by_name("gpt2", backend="mock")
    rows = []
    for n in (16, 256, 2048):
        ids = [(i * 7919) % lm.vocab_size for i in range(n)]
        fns = {
            "ours": lambda ids=ids: lm.request(ids),
            "earlier": lambda ids=ids: earlier_request(ids, lm.vocab_size),
        }
        t = interleaved(fns, rounds, 2000)
        ours, earlier = statistics.median(t["ours"]), statistics.median(t["earlier"])
        rows.append(
            [f"request(), {n} tokens", fmt_s(ours), spread(t["ours"]), fmt_s(earlier), f"{ours / earlier:.2f}x"]
        )
    lm.cleanup()
    return rows


ASYNC_TRIE = """
import asyncio, json, statistics, time
import numpy as np
from genlm_core.testing.tokenizers import load_tokenizer
from genlm_core.tokenization import decode_vocab
from genlm_core.trie import AsyncTokenCharacterTrie

vocab = decode_vocab(load_tokenizer("mistral-v1"))[0]
trie = AsyncTokenCharacterTrie.from_vocab(vocab, batch_size=128, timeout=0.0)
rng = np.random.default_rng(0)
rows = [rng.random(len(vocab)).astype(np.float32) for _ in range(128)]
stacked = np.stack(rows)
loop = asyncio.new_event_loop()

def concurrent():
    async def step():
        await asyncio.gather(*(trie.weight_sum(w) for w in rows))
    loop.run_until_complete(step())

ours, engine = [], []
for i in range(23):
    t0 = time.perf_counter(); concurrent(); t1 = time.perf_counter()
    trie.trie.batch_weight_sum(stacked); t2 = time.perf_counter()
    if i >= 3:
        ours.append(t1 - t0); engine.append(t2 - t1)
print(json.dumps({{"seconds": statistics.median(ours), "engine": statistics.median(engine)}}))
"""

PREFILL = """
import asyncio, json, sys, time
sys.path.insert(0, {bench!r})
from bench_bytes import TEXT
from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_hf import AsyncTransformer

async def main():
    lm = AsyncTransformer.from_name({path!r}, batch_size=256, timeout=0.0)
    beam = await ByteBeamState.initial(lm, BeamParams(K=5, heal=False))
    await (await beam.prefill(TEXT[:20])).logp_next()
    lm.clear_cache()
    t0 = time.perf_counter()
    after = await beam.prefill(TEXT[:300])
    return time.perf_counter() - t0, after.logZ

seconds, log_z = asyncio.run(main())
print(json.dumps({{"seconds": seconds, "logZ": float(log_z)}}))
"""


def in_both_trees(code: str, base: str, rounds: int) -> dict[str, list[dict]]:
    """Run ``code`` (prints one JSON object) with the working tree and with ``base`` on the path,
    alternating processes ``rounds`` times."""
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(
            ["git", "archive", base, "genlm_core", "plugins/genlm_hf/genlm_hf"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        trees = {"ours": f"{ROOT}:{ROOT / 'plugins/genlm_hf'}", "base": f"{old}:{Path(old) / 'plugins/genlm_hf'}"}
        results: dict[str, list[dict]] = {"ours": [], "base": []}
        for _ in range(rounds):
            for name, pythonpath in trees.items():
                out = subprocess.run(
                    [sys.executable, "-c", code],
                    capture_output=True,
                    text=True,
                    env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                    check=True,
                )
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def compared_row(label: str, results: dict[str, list[dict]], base: str) -> list[str]:
    ours = [r["seconds"] for r in results["ours"]]
    before = [r["seconds"] for r in results["base"]]
    return [
        label,
        fmt_s(statistics.median(ours)),
        spread(ours) if len(ours) >= 2 else "-",
        f"{fmt_s(statistics.median(before))} ({base})",
        f"{statistics.median(ours) / statistics.median(before):.2f}x",
    ]


def bench_async_trie(base: str, rounds: int) -> list[list[str]]:
    results = in_both_trees(ASYNC_TRIE.format(), base, rounds)
    row = compared_row("128 x await weight_sum, 32000 tokens", results, base)
    limit = statistics.median(r["seconds"] / r["engine"] for r in results["ours"])
    row[-1] += f" ({limit:.2f}x the engine's batch_weight_sum)"
    return [row]


def prefill_bound(path: str) -> bounds.Bound:
    """How far the two trees' log Z may differ: each tree's batches depend on timing (``timeout=0.0``), so
    their rows are two float32 passes of one model, each entry within ``d`` =
    :func:`bounds.model_difference` of the model's float32 error (measured on the prefixes of the text's
    own tokenization: the beam's items are other tokenizations of the same bytes, with errors of the same
    size). An item's weight sums at most one log-probability per byte (a token covers at least one), log Z
    is a logsumexp of the items' weights (1-Lipschitz), and both trees sum the trie in float64 (error
    below 1e-12): at most ``300 d``."""
    from bench_bytes import TEXT
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)(TEXT[:300].decode("utf-8", "replace"))["input_ids"]
    d = bounds.model_difference(bounds.float32_error(path, [ids]), what="the tiny llama")
    return bounds.Bound(300 * float(d), f"300 bytes x ({d.basis})")


def bench_prefill(base: str, rounds: int) -> list[list[str]]:
    from genlm_core.testing.models import tiny_model_dir

    path = str(tiny_model_dir("llama"))
    code = PREFILL.format(bench=str(ROOT / "benchmarks"), path=path)
    results = in_both_trees(code, base, rounds)
    z = {name: results[name][-1]["logZ"] for name in results}
    bounds.within("bench_validation: prefill log Z, ours vs base", abs(z["ours"] - z["base"]), prefill_bound(path))
    return [compared_row("byte LM prefill, 300 bytes, K=5", results, base)]


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--base", default="HEAD~3", help="revision to compare the prefill with (default: HEAD~3)")
    args.add_argument("--rounds", type=int, default=15, help="interleaved rounds for the in-process rows")
    args.add_argument("--process-rounds", type=int, default=3, help="alternating process pairs for rows 2 and 3")
    opts = args.parse_args()
    rows = bench_request(opts.rounds)
    rows += bench_async_trie(opts.base, opts.process_rounds)
    rows += bench_prefill(opts.base, opts.process_rounds)
    print("cost of input checks on the hot paths (medians; interquartile range; interleaved in one run)")
    print(table(["path", "ours", "ours IQR", "reference", "ours / reference"], rows))


if __name__ == "__main__":
    main()
