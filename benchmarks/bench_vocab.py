"""decode_vocab on real tokenizers: ours vs the seed library (genlm-backend 0.3.1), one run.

python benchmarks/bench_vocab.py
"""

from __future__ import annotations

import sys

from _common import best_of, fmt_s, run_seed, seed_python

from genlm_core import decode_vocab
from genlm_core.cli import table
from genlm_core.testing.tokenizers import TOKENIZERS, cache_dir, load_tokenizer

SEED = """
import json, time, statistics
from transformers import AutoTokenizer
from genlm.backend.tokenization import decode_vocab
tok = AutoTokenizer.from_pretrained({path!r})
times = []
for _ in range({repeat}):
    t0 = time.perf_counter(); bv, sv = decode_vocab(tok); times.append(time.perf_counter() - t0)
print(json.dumps({{"seconds": statistics.median(times), "n": len(bv)}}))
"""


def main() -> None:
    repeat = 3
    rows = []
    for name in TOKENIZERS:
        tok = load_tokenizer(name)
        ours = best_of(lambda tok=tok: decode_vocab(tok), repeat=repeat)
        seed = None
        if seed_python():
            try:
                seed = run_seed(SEED.format(path=str(cache_dir() / "tokenizers" / name), repeat=repeat))["seconds"]
            except RuntimeError as exc:
                print(f"seed failed on {name}: {str(exc).splitlines()[-1]}", file=sys.stderr)
        rows.append(
            [name, len(tok), fmt_s(ours), fmt_s(seed) if seed else "n/a", f"{seed / ours:.1f}x" if seed else "n/a"]
        )
    print(table(["tokenizer", "vocab", "ours", "seed 0.3.1", "seed / ours"], rows))


if __name__ == "__main__":
    main()
