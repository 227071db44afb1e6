"""Small test doubles shared by core tests."""

from __future__ import annotations

import torch
from pydantic import Field

from genlm_core import AsyncLM, BackendOptions, hookimpl


class BigramLM(AsyncLM):
    """A model whose logits depend only on the last token: ``peak`` at ``(last + 1) % V``."""

    def __init__(self, tokenizer, peak: float = 4.0, width: int | None = None, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.peak = peak
        self.width = width or self.vocab_size
        self.calls: list[list] = []

    def forward_batch(self, requests):
        self.calls.append(list(requests))
        logits = torch.zeros(len(requests), self.width, dtype=torch.float64)
        for row, r in enumerate(requests):
            logits[row, (r.token_ids[-1] + 1) % self.vocab_size] = self.peak
        return logits


class BigramOptions(BackendOptions):
    peak: float = Field(4.0, description="Logit of the favoured next token.")


class ThirdPartyPlugin:
    """What a third party's ``genlm-bigram`` distribution would ship: no change to core needed."""

    def __init__(self, tokenizer, name="bigram"):
        self.tokenizer = tokenizer
        self.name = name

    @hookimpl
    def register_backends(self, register):
        register.backend(self.name, self.load, options=BigramOptions, description="test bigram model")

    def load(self, model: str, options: BigramOptions) -> BigramLM:
        return BigramLM(self.tokenizer, peak=options.peak, batch_size=options.batch_size, timeout=options.timeout)
