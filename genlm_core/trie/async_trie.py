"""``AsyncTokenCharacterTrie``: concurrent ``await trie.weight_sum(ws)`` calls, batched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from genlm_core.batching import AutoBatcher
from genlm_core.plugins import get_plugins
from genlm_core.trie.base import TrieBase


class AsyncTokenCharacterTrie:
    """Batches concurrent weight_sum / weight_max requests into engine batch calls.

    Inputs are checked when submitted (a bad vector fails alone, at once); the same weight object
    submitted twice for the same operation is computed once. Batches run in a worker thread, so the
    event loop (and the language model's batches) keep going meanwhile.
    """

    def __init__(self, trie: TrieBase, batch_size: int = 128, timeout: float = 0.001):
        self.trie = trie
        self.batcher: AutoBatcher[tuple[str, Any], np.ndarray] = AutoBatcher(
            self._process, batch_size=batch_size, timeout=timeout, run_in_thread=True, name="trie"
        )

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
        engine = get_plugins().trie_engine(backend).load()
        return cls(engine(vocab, **engine_kwargs), batch_size=batch_size, timeout=timeout)

    def _process(self, items: list[tuple[str, Any]]) -> list[np.ndarray]:
        results: list[Any] = [None] * len(items)
        for op in ("sum", "max"):
            picked = [i for i, (o, _) in enumerate(items) if o == op]
            if picked:
                batch = self.trie.check_weights([items[i][1] for i in picked], allow_neg_inf=op == "max")
                for i, row in zip(picked, self.trie._reduce(batch, op)):
                    results[i] = row
        return results

    async def _submit(self, op: str, ws: Any) -> np.ndarray:
        checked = self.trie.check_weights(ws, allow_neg_inf=op == "max")
        if checked.shape[0] != 1:
            raise ValueError(f"weight_{op} takes one weight vector; use batch_weight_{op} for batches")
        return await self.batcher.submit((op, id(ws)), (op, checked[0]))

    async def weight_sum(self, ws: Any) -> np.ndarray:
        """Per-node sums for one weight vector, batched with concurrent calls."""
        return await self._submit("sum", ws)

    async def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node maxima for one weight vector, batched with concurrent calls."""
        return await self._submit("max", ws)

    def cleanup(self) -> None:
        """Stop the worker thread."""
        self.batcher.close()

    shutdown = cleanup
