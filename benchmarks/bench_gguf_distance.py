"""How far genlm-llamacpp's rows are from genlm-hf's on the same SmolLM2-135M weights.

For the shipped Q4_1 GGUF and its float32 dequantization (``smollm2-f32``), each context's next-token
distribution is compared with genlm-hf's on the float32 folder converted from the same GGUF: total
variation, KL(hf || llama.cpp) and the largest logprob difference among the tokens hf gives at least
1e-4. Contexts are every prefix length of a few English sentences (alone, so batching plays no part),
then each continuing the sequence of the one before (``continued``), then in batches of 32 (which share
their prefixes by sequence copies), to show how much the way a row is computed changes it.

    python benchmarks/bench_gguf_distance.py [--contexts 48]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from genlm_core import load_model_by_name
from genlm_core.cli import table
from genlm_core.testing.models import smollm2_dir

TEXT = (
    "The capital of France is Paris. It lies on the Seine, and its museums hold paintings from every century. "
    "Early in the morning the bakers open their shops, and the smell of bread fills the narrow streets."
)


def distances(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float, float]:
    p, q = theirs.double().exp(), ours.double().exp()
    tv = 0.5 * (p - q).abs().sum().item()
    kl = (p * (theirs.double() - ours.double())).sum().item()
    likely = p >= 1e-4
    return tv, kl, (ours - theirs)[likely].abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, default=48)
    args = ap.parse_args()
    hf = load_model_by_name(str(smollm2_dir()), backend="hf", llm_opts={"dtype": "float32"})
    ids = hf.tokenizer.encode(TEXT)
    contexts = [ids[:n] for n in range(2, min(len(ids), args.contexts + 2))]
    reference = [hf.next_token_logprobs_uncached(c) for c in contexts]
    rows = []
    for name in ("smollm2", "smollm2-f32"):
        lm = load_model_by_name(name, backend="llamacpp")
        alone = [lm.next_token_logprobs_uncached(c) for c in contexts]
        lm.clear_cache()
        lm.next_token_logprobs_sync(contexts[0])
        continued = [lm.next_token_logprobs_sync(c) for c in contexts[1:]]  # each continues the one before
        lm.clear_cache()
        batched = list(lm.batch_next_token_logprobs_sync(contexts))  # batches of 32 rows sharing prefixes
        for how, got, refs in (
            ("alone", alone, reference),
            ("continued", continued, reference[1:]),
            ("in batches of 32", batched, reference),
        ):
            d = [distances(a, b) for a, b in zip(got, refs, strict=True)]
            tv, kl, dmax = zip(*d)
            rows.append(
                [
                    f"{name} ({lm.engine.config.cache_type} cache)",
                    how,
                    f"{statistics.median(tv):.2e} / {max(tv):.2e}",
                    f"{statistics.median(kl):.2e} / {max(kl):.2e}",
                    f"{statistics.median(dmax):.2e} / {max(dmax):.2e}",
                ]
            )
        for how, got, refs in (("continued vs alone", continued, alone[1:]), ("batched vs alone", batched, alone)):
            tv = [distances(a, b)[0] for a, b in zip(got, refs, strict=True)]
            rows.append([f"{name}", how, f"{statistics.median(tv):.2e} / {max(tv):.2e}", "", ""])
        lm.cleanup()
    print(
        table(["llama.cpp model", "rows", "TV (median / max)", "KL (median / max)", "max |dlogp| (median / max)"], rows)
    )
    print(
        f"\n{len(contexts)} contexts of SmolLM2-135M-Instruct against genlm-hf float32 on the dequantized weights; CPU."
    )


if __name__ == "__main__":
    main()
