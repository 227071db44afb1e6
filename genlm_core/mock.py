"""The ``mock`` backend, built into genlm-core: no model, a real tokenizer, and for each context its own
fixed, peaked random distribution. For trying genlm and testing programs and plugins without weights.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm_core.config import MockOptions  # defined there: listing backends imports no torch
from genlm_core.hub import load_tokenizer_by_name
from genlm_core.lm import AsyncLM, Request
from genlm_core.tokenization import Tokenizer


class MockAsyncLM(AsyncLM):
    """Logits are a deterministic function of the whole context (and ``seed``): Gaussian with
    standard deviation ``scale``, so distributions are non-flat and differ from context to context.

    ``batches`` records the requests of the most recent ``forward_batch`` calls (``keep_batches``
    of them), so tests can observe batching.
    """

    Options = MockOptions
    options: MockOptions

    def __init__(self, tokenizer: Tokenizer, options: MockOptions | None = None, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        self.batches: deque[list[Request]] = deque(maxlen=self.options.keep_batches)

    @classmethod
    def from_options(cls, model_name: str, options: MockOptions) -> MockAsyncLM:
        """Mock model over the tokenizer ``model_name`` (see :func:`genlm_core.hub.resolve_tokenizer`);
        the registry factory (``from_name`` takes the options as keywords)."""
        return cls(load_tokenizer_by_name(model_name), options)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The mock's raw logits for one context (what a model would return)."""
        digest = hashlib.blake2b(
            np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8, key=str(self.options.seed).encode()
        ).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        width = self.vocab_size + self.options.vocab_padding
        return rng.standard_normal(width, dtype=np.float32) * np.float32(self.options.scale)

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        self.batches.append(list(requests))
        if self.options.delay:
            time.sleep(self.options.delay)
        return torch.from_numpy(np.stack([self.logits(r.token_ids) for r in requests]))
