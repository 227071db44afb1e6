"""The mock language model: each context gets its own fixed, peaked random distribution."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genlm_core import AsyncLM, Request, Tokenizer
from genlm_mock.options import MockOptions


class TokenizerNotFoundError(OSError, ValueError):
    """No tokenizer by that name: an OSError like transformers' own, and a ValueError (a bad name)."""


def load_tokenizer(name: str) -> Tokenizer:
    """A local tokenizer folder, a built-in offline tokenizer name (``gpt2``, ``mistral-v1``, ...), or a
    tokenizer the Hugging Face hub serves (where it can be reached)."""
    from transformers import AutoTokenizer

    from genlm_core.testing.tokenizers import TOKENIZERS
    from genlm_core.testing.tokenizers import load_tokenizer as builtin

    if Path(name).exists():
        return AutoTokenizer.from_pretrained(name)
    if name in TOKENIZERS:
        return builtin(name)
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise TokenizerNotFoundError(
            f"mock backend: {name!r} is neither a local tokenizer folder nor a built-in tokenizer "
            f"({sorted(TOKENIZERS)}), and the Hugging Face hub did not give it ({exc.__class__.__name__})"
        ) from exc


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
        """Mock model over the tokenizer ``model_name`` (see :func:`load_tokenizer`); the registry
        factory (``from_name`` takes the options as keywords)."""
        return cls(load_tokenizer(model_name), options)

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
