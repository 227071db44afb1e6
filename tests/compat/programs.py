"""Two real client programs, run unmodified on genlm-backend or on genlm (tests and bench_clients.py).

``control_program``: genlm-control's PromptedLLM with a boolean FSA, sampled by the direct token sampler
and by AWRS under SMC. ``llamppl_program``: a llamppl lipogram (no letter "e") under ``smc_steer``.
``plain_program``: SMC written on genlm's public API as a user would, each particle working on its own
row. Each fixes every random seed it uses and returns what it sampled with its weights.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

PROMPT = "The capital of France is"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


async def control_program(lm: Any, seed: int = 0, n_particles: int = 6, max_tokens: int = 6) -> dict[str, Any]:
    from genlm.control import AWRS, BoolFSA, PromptedLLM, direct_token_sampler

    llm = PromptedLLM(lm, eos_byte_strings=[b"."])
    llm.set_prompt_from_str(PROMPT)
    fsa = BoolFSA.from_regex(r" [a-z]+( [a-z]+)*").coerce(llm, f=b"".join)
    out: dict[str, Any] = {}
    for name, sampler in (("direct", direct_token_sampler(llm)), ("awrs", AWRS(llm, fsa))):
        seed_everything(seed)
        sequences = await sampler.smc(n_particles=n_particles, ess_threshold=0.5, max_tokens=max_tokens)
        out[name] = {
            "contexts": [tuple(bytes(t) if isinstance(t, bytes) else repr(t) for t in c) for c in sequences.contexts],
            "log_weights": np.asarray(sequences.log_weights, dtype=np.float64),
            "log_ml": float(sequences.log_ml),
        }
        await sampler.cleanup()
    rows = await lm.batch_next_token_logprobs([llm.prompt_ids, llm.prompt_ids[:3]])
    out["logprobs"] = rows.double().cpu().numpy()
    return out


async def llamppl_program(lm: Any, seed: int = 0, n_particles: int = 6, max_tokens: int = 8) -> dict[str, Any]:
    from llamppl import CachedCausalLM, LMContext, Model, smc_steer

    llm = lm if isinstance(lm, CachedCausalLM) else CachedCausalLM(lm)
    allowed = {i for i, v in enumerate(llm.str_vocab) if "e" not in v.lower()}
    eos = llm.tokenizer.eos_token_id

    class Lipogram(Model):
        def __init__(self) -> None:
            super().__init__()
            self.context = LMContext(llm, PROMPT)
            self.left = max_tokens

        async def step(self) -> None:
            await self.observe(self.context.mask_dist(allowed), True)  # weight by the kept mass
            token = await self.sample(self.context.next_token())
            self.left -= 1
            if token.token_id == eos or self.left == 0:
                self.finish()

        def string_for_serialization(self) -> str:
            return str(self.context)

    seed_everything(seed)
    particles = await smc_steer(Lipogram(), n_particles, 2)
    return {
        "texts": [str(p.context) for p in particles],
        "log_weights": np.array([p.weight for p in particles], dtype=np.float64),
    }


async def plain_program(
    lm: Any, prompt: list[int], mask: torch.Tensor, seed: int = 0, n_particles: int = 32, max_tokens: int = 32
) -> dict[str, Any]:
    """SMC as a user writes it on the public API: each particle awaits its own row, masks it, takes
    the softmax in float64 and draws one token; multinomial resampling when the ESS falls below N/2.
    ``mask`` (bool over the vocabulary) is the constraint; every particle runs ``max_tokens`` steps."""
    import asyncio

    gen = torch.Generator().manual_seed(seed)
    contexts = [list(prompt) for _ in range(n_particles)]
    log_weights = np.zeros(n_particles)
    log_z = 0.0
    allowed = mask.to(torch.float64).log()

    async def extend(i: int) -> None:
        row = (await lm.next_token_logprobs(contexts[i])).to(torch.float64) + allowed
        kept = torch.logsumexp(row, 0)
        token = int(torch.multinomial(torch.softmax(row, 0), 1, generator=gen))
        log_weights[i] += float(kept)
        contexts[i] = [*contexts[i], token]

    for _ in range(max_tokens):
        await asyncio.gather(*(extend(i) for i in range(n_particles)))
        w = np.exp(log_weights - log_weights.max())
        if w.sum() ** 2 / (w**2).sum() < n_particles / 2:
            log_z += float(np.log(w.mean()) + log_weights.max())
            picks = torch.multinomial(torch.as_tensor(w / w.sum()), n_particles, replacement=True, generator=gen)
            contexts = [list(contexts[int(j)]) for j in picks]
            log_weights[:] = 0.0
    shift = log_weights.max()
    log_z += float(np.log(np.exp(log_weights - shift).mean()) + shift)
    return {"contexts": [tuple(c) for c in contexts], "log_weights": log_weights.copy(), "log_z": log_z}
