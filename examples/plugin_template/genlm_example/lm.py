"""``BigramLM``: P(next | last token) from bigram counts with add-k smoothing.

Everything but the logits is genlm-core's: validation, batching, the output cache, normalisation,
sampling, the closed state. The backend only says how to load and how to score a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genlm_core import AsyncLM, Request, Tokenizer
from genlm_core.hub import load_tokenizer_by_name
from genlm_example.options import BigramOptions

DEFAULT_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. "
    "Paris is a city of art, and Rome is a city of history. The river in Paris is the Seine."
)


class BigramLM(AsyncLM):
    """Logits ``log(count(last, next) + k)``; core's normalisation turns them into exactly
    ``(count + k) / (count(last) + k * V)``."""

    Options = BigramOptions
    options: BigramOptions

    def __init__(self, tokenizer: Tokenizer, text: str, options: BigramOptions | None = None, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        pairs, counts = np.unique(ids[:-1] * self.vocab_size + ids[1:], return_counts=True)
        self.followers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for first in np.unique(pairs // self.vocab_size):
            mask = pairs // self.vocab_size == first
            nexts = torch.from_numpy(pairs[mask] % self.vocab_size)
            self.followers[int(first)] = (nexts, torch.from_numpy(counts[mask]).double())

    @classmethod
    def from_options(cls, model_name: str, options: BigramOptions) -> BigramLM:
        """The registry factory: ``model_name`` is a tokenizer (a local folder, a tokenizer genlm builds
        offline such as ``gpt2``, or a hub name; see :func:`genlm_core.hub.resolve_tokenizer`)."""
        text = Path(options.corpus).read_text(encoding="utf-8") if options.corpus else DEFAULT_CORPUS
        return cls(load_tokenizer_by_name(model_name), text, options)

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        k = self.options.smoothing
        logits = torch.full((len(requests), self.vocab_size), float(np.log(k)), dtype=torch.float64)
        for row, request in enumerate(requests):
            nexts, counts = self.followers.get(request.context[-1], (None, None))  # the last id, read in place
            if nexts is not None and counts is not None:
                logits[row, nexts] = torch.log(counts + k)
        return logits
