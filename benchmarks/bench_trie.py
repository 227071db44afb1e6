"""Token-character tries: ours (numba CPU engine, torch engine) vs the seed library, in one run.

Workload of the trie issue: the 32k Mistral v1 SentencePiece vocabulary; weight_sum and weight_max
on 1 distribution and on a batch of 128; trie build on 32k and 131k (Tekken) vocabularies.

    python benchmarks/bench_trie.py            # add --cuda to time the torch engine on a GPU
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import best_of, fmt_s, run_seed, seed_python

from genlm_core import decode_vocab
from genlm_core.cli import table
from genlm_core.testing.tokenizers import cache_dir, load_tokenizer
from genlm_core.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

SEED = """
import json, time, statistics, torch
from transformers import AutoTokenizer
from genlm.backend.tokenization import decode_vocab
from genlm.backend.trie import TokenCharacterTrie, ParallelTokenCharacterTrie
def med(f, r):
    f(); ts = []
    for _ in range(r):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
out = {{}}
for name in ("mistral-v1", "tekken"):
    vocab = decode_vocab(AutoTokenizer.from_pretrained({cache!r} + "/tokenizers/" + name))[0]
    t0 = time.perf_counter(); trie = TokenCharacterTrie(vocab); out["build " + name] = time.perf_counter() - t0
    if name == "tekken":
        break
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128, len(vocab), generator=g) * 3
    probs, logs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    par = ParallelTokenCharacterTrie(vocab, device="cpu")
    out["sum1 numba"] = med(lambda: trie.weight_sum(probs[0]), 20)
    out["sum1 sparse"] = med(lambda: par.weight_sum(probs[0]), 5)
    out["sum128 numba"] = med(lambda: trie.batch_weight_sum(probs), 3)
    out["sum128 sparse"] = med(lambda: par.batch_weight_sum(probs), 3)
    out["max1 numba"] = med(lambda: trie.weight_max(logs[0]), 10)
    out["max128 numba"] = med(lambda: trie.batch_weight_max(logs), 3)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="also time the torch engine on CUDA")
    ap.add_argument("--no-seed", action="store_true")
    args = ap.parse_args()

    vocab32 = decode_vocab(load_tokenizer("mistral-v1"))[0]
    vocab131 = decode_vocab(load_tokenizer("tekken"))[0]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128, len(vocab32), generator=g) * 3
    probs, logs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    cpu = TokenCharacterTrie(vocab32)
    engines = {"ours numba": cpu, "ours torch-cpu": ParallelTokenCharacterTrie(vocab32, device="cpu", index=cpu.index)}
    if args.cuda:
        engines["ours torch-cuda"] = ParallelTokenCharacterTrie(vocab32, device="cuda", output="torch", index=cpu.index)

    def timed(engine, op, batch):
        fn = getattr(engine, f"{'batch_' if batch else ''}weight_{op}")
        data = (probs if op == "sum" else logs).to(getattr(engine, "device", "cpu"))
        data = data if batch else data[0]

        def call():
            fn(data)
            if args.cuda:
                torch.cuda.synchronize()

        return best_of(call, repeat=5 if batch else 30)

    ours = {}
    for label, engine in engines.items():
        ours[label] = {
            "weight_sum, 1": timed(engine, "sum", False),
            "weight_sum, batch 128": timed(engine, "sum", True),
            "weight_max, 1": timed(engine, "max", False),
            "weight_max, batch 128": timed(engine, "max", True),
        }
    build32 = best_of(lambda: TokenCharacterTrie(vocab32), repeat=5)
    build131 = best_of(lambda: TokenCharacterTrie(vocab131), repeat=3)

    seed: dict = {}
    if seed_python() and not args.no_seed:
        try:
            seed = run_seed(SEED.format(cache=str(cache_dir())))
        except RuntimeError as exc:
            print(f"seed run failed: {exc}", file=sys.stderr)

    targets = {
        "weight_sum, 1": 0.3e-3,
        "weight_sum, batch 128": 25e-3,
        "weight_max, 1": 0.45e-3,
        "weight_max, batch 128": 38e-3,
    }
    seed_keys = {
        "weight_sum, 1": ("sum1 numba", "sum1 sparse"),
        "weight_sum, batch 128": ("sum128 numba", "sum128 sparse"),
        "weight_max, 1": ("max1 numba", None),
        "weight_max, batch 128": ("max128 numba", None),
    }
    labels = list(engines)
    rows = []
    for op, target in targets.items():
        numba_s, sparse_s = (seed.get(k) if k else None for k in seed_keys[op])
        best_seed = min(x for x in (numba_s, sparse_s, float("inf")) if x is not None)
        mine = ours["ours numba"][op]
        rows.append(
            [
                op,
                *(fmt_s(ours[label][op]) for label in labels),
                fmt_s(numba_s) if numba_s else "n/a",
                fmt_s(sparse_s) if sparse_s else "n/a",
                f"{best_seed / mine:.0f}x" if seed else "n/a",
                fmt_s(target),
                "yes" if mine <= target else "NO",
            ]
        )
    for name, ours_s, target, key in (
        ("build, 32k", build32, 0.3, "build mistral-v1"),
        ("build, 131k", build131, 1.5, "build tekken"),
    ):
        s = seed.get(key)
        rows.append(
            [
                name,
                fmt_s(ours_s),
                *["-"] * (len(labels) - 1),
                fmt_s(s) if s else "n/a",
                "-",
                f"{s / ours_s:.0f}x" if s else "n/a",
                fmt_s(target),
                "yes" if ours_s <= target else "NO",
            ]
        )
    print(
        f"32k vocabulary: mistral v1 ({len(vocab32)} tokens, {cpu.num_nodes} nodes); torch {torch.__version__}; "
        f"{torch.get_num_threads()} threads"
    )
    print(table(["operation", *labels, "seed numba", "seed sparse", "seed best / ours", "target", "met"], rows))


if __name__ == "__main__":
    main()
