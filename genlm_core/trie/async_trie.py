"""``AsyncTokenCharacterTrie``: concurrent ``await trie.weight_sum(ws)`` calls, batched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from genlm_core.batching import AutoBatcher, ContentKey
from genlm_core.closing import CLOSED, Closed
from genlm_core.plugins import get_plugins
from genlm_core.trie.base import TrieBase
from genlm_core.validation import check_batcher_numbers, check_vocabulary


def stack_rows(rows: list[Any]) -> np.ndarray | torch.Tensor:
    """Checked 1-D weight rows (numpy, or tensors on one device) as one 2-D batch."""
    return torch.stack(rows) if isinstance(rows[0], torch.Tensor) else np.stack(rows)


class WeightTrie(Protocol):
    """What :class:`AsyncTokenCharacterTrie` needs of a trie: :class:`TrieBase`'s checks and reduction."""

    def check_weights(
        self, ws: Any, allow_neg_inf: bool = False, *, single: bool = False, copy: bool = False
    ) -> Any: ...

    def reduce_checked(self, ws: Any, op: str) -> Any: ...


class AsyncTokenCharacterTrie:
    """Batches concurrent weight_sum / weight_max requests into engine batch calls.

    Inputs are checked and copied when submitted (a bad vector fails alone, at once; changing the
    caller's array afterwards does not change the result); equal weight vectors submitted together
    for the same operation are computed once. Batches run in a worker thread, so the event loop
    (and the language model's batches) keep going meanwhile. After :meth:`cleanup` every call
    raises :class:`~genlm_core.errors.ClosedError`.
    """

    def __init__(self, trie: TrieBase | WeightTrie, batch_size: int = 128, timeout: float = 0.001):
        """``trie``: a trie engine (a :class:`TrieBase`, or any object with its ``check_weights`` and
        ``reduce_checked``)."""
        if not (hasattr(trie, "check_weights") and hasattr(trie, "reduce_checked")):
            raise TypeError(f"trie must be a trie engine (a TrieBase), got {type(trie).__name__}")
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
        check_batcher_numbers(batch_size, timeout)  # before the (slower) build
        vocab = check_vocabulary(vocab)
        engine = get_plugins().load_trie_engine(backend)
        return cls(engine(vocab, **engine_kwargs), batch_size=batch_size, timeout=timeout)

    def _process(self, items: list[tuple[str, Any]]) -> list[np.ndarray]:
        results: list[Any] = [None] * len(items)
        for op in ("sum", "max"):
            picked = [i for i, (o, _) in enumerate(items) if o == op]
            if picked:
                for i, row in zip(picked, self.trie.reduce_checked(stack_rows([items[i][1] for i in picked]), op)):
                    results[i] = row
        return results

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or :meth:`cleanup`) has been called."""
        return self.batcher.closed

    async def _submit(self, op: str, ws: Any) -> np.ndarray:
        self.batcher.ensure_open()  # a closed trie says so before it looks at the weights
        row = self.trie.check_weights(ws, allow_neg_inf=op == "max", single=True, copy=True)[0]
        return await self.batcher.submit(ContentKey(op, row), (op, row))

    async def weight_sum(self, ws: Any) -> np.ndarray:
        """Per-node sums for one weight vector, batched with concurrent calls."""
        return await self._submit("sum", ws)

    async def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node maxima for one weight vector, batched with concurrent calls."""
        return await self._submit("max", ws)

    def close(self) -> None:
        """Stop the worker thread; later calls raise ClosedError. Calling it again is harmless."""
        self.batcher.close()

    shutdown = close

    def cleanup(self) -> Closed:
        """:meth:`close`; the result may be awaited, as genlm-backend's ``await trie.cleanup()``."""
        self.close()
        return CLOSED
