"""``AsyncTokenCharacterTrie``: concurrent ``await trie.weight_sum(ws)`` calls, batched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from genlm_core.plugins import get_plugins
from genlm_core.trie.base import TrieBase
from genlm_core.trie.batched import BatchedTrie, WeightChecker
from genlm_core.validation import check_batcher_numbers, check_vocabulary


class WeightTrie(WeightChecker, Protocol):
    """What :class:`AsyncTokenCharacterTrie` needs of a trie: :class:`TrieBase`'s checks and reduction."""

    def reduce_checked(self, ws: Any, op: str) -> Any: ...


class AsyncTokenCharacterTrie(BatchedTrie):
    """Batches concurrent weight_sum / weight_max requests into engine batch calls.

    Inputs are checked and copied when submitted (a bad vector fails alone, at once; changing the
    caller's array afterwards does not change the result); equal weight vectors submitted together
    for the same operation are computed once. Batches run in a worker thread, so the event loop
    (and the language model's batches) keep going meanwhile. After :meth:`cleanup` every call
    raises :class:`~genlm_core.errors.ClosedError`.
    """

    ops = ("sum", "max")

    def __init__(self, trie: TrieBase | WeightTrie, batch_size: int = 128, timeout: float = 0.001):
        """``trie``: a trie engine (a :class:`TrieBase`, or any object with its ``check_weights`` and
        ``reduce_checked``)."""
        if not (hasattr(trie, "check_weights") and hasattr(trie, "reduce_checked")):
            raise TypeError(f"trie must be a trie engine (a TrieBase), got {type(trie).__name__}")
        self.trie = trie
        super().__init__(trie, batch_size, timeout, name="trie")

    @classmethod
    def from_vocab(
        cls,
        vocab: Sequence[bytes],
        backend: str = "numba",
        batch_size: int = 128,
        timeout: float = 0.001,
        **engine_kwargs: Any,
    ) -> AsyncTokenCharacterTrie:
        """Build the trie with a registered engine (``numba``/``cpu``/``sequential``,
        ``torch``/``parallel``, or a plugin's) and wrap it."""
        check_batcher_numbers(batch_size, timeout)  # before the (slower) build
        vocab = check_vocabulary(vocab)
        engine = get_plugins().load_trie_engine(backend)
        return cls(engine(vocab, **engine_kwargs), batch_size=batch_size, timeout=timeout)

    def _compute(self, op: Any, rows: np.ndarray | torch.Tensor) -> Any:
        return self.trie.reduce_checked(rows, op)

    async def weight_sum(self, ws: Any) -> np.ndarray:
        """Per-node sums for one weight vector, batched with concurrent calls."""
        return await self._submit("sum", ws)

    async def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node maxima for one weight vector, batched with concurrent calls."""
        return await self._submit("max", ws, allow_neg_inf=True)
