"""``BatchedTrie``: what both async tries share, the batching of concurrent callers' requests over a trie.

Each request names an operation (a reduction, or a byte-trie mode) and one weight vector. The vector
is checked and copied when submitted (a bad one fails alone, at once; later changes to the caller's
array do not change its result), equal vectors submitted together for the same operation are
computed once, and a batch runs each operation once over its stacked rows, in a worker thread, so
the event loop (and the language model's batches) keep going meanwhile.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np
import torch

from genlm_core.batching import AutoBatcher, ContentKey
from genlm_core.closing import CLOSED, Closed


def stack_rows(rows: list[Any]) -> np.ndarray | torch.Tensor:
    """Checked 1-D weight rows (numpy, or tensors on one device) as one 2-D batch."""
    return torch.stack(rows) if isinstance(rows[0], torch.Tensor) else np.stack(rows)


class WeightChecker(Protocol):
    """What checks a weight vector against a vocabulary: :meth:`TrieBase.check_weights
    <genlm_core.trie.base.TrieBase.check_weights>`."""

    def check_weights(
        self, ws: Any, allow_neg_inf: bool = False, *, single: bool = False, copy: bool = False
    ) -> Any: ...


class BatchedTrie(abc.ABC):
    """Concurrent ``await`` requests over a trie, batched by the core AutoBatcher.

    A subclass lists its operations in :attr:`ops` (the order a batch computes them in) and computes
    one over a batch in :meth:`_compute`; its public methods call :meth:`_submit`. After
    :meth:`close` every call raises :class:`~genlm_core.errors.ClosedError`.
    """

    #: the operations a batch may hold, in the order a batch computes them
    ops: tuple[Hashable, ...]

    def __init__(self, checker: WeightChecker, batch_size: int, timeout: float, name: str):
        """``checker`` checks each submitted vector; ``name`` names the worker thread."""
        self._checker = checker
        self.batcher: AutoBatcher[tuple[Hashable, Any], np.ndarray] = AutoBatcher(
            self._process, batch_size=batch_size, timeout=timeout, run_in_thread=True, name=name
        )

    @abc.abstractmethod
    def _compute(self, op: Hashable, rows: np.ndarray | torch.Tensor) -> Any:
        """Values ``[batch, nodes]`` of operation ``op`` for checked 2-D weight ``rows``."""

    def _process(self, items: list[tuple[Hashable, Any]]) -> list[np.ndarray]:
        """One batch: each operation once, over the rows of the requests that asked for it."""
        results: list[Any] = [None] * len(items)
        for op in self.ops:
            picked = [i for i, (o, _) in enumerate(items) if o == op]
            if picked:
                for i, values in zip(picked, self._compute(op, stack_rows([items[i][1] for i in picked]))):
                    results[i] = values
        return results

    async def _submit(self, op: Hashable, ws: Any, allow_neg_inf: bool = False) -> np.ndarray:
        """Operation ``op`` on one weight vector, batched with concurrent calls."""
        self.batcher.ensure_open()  # a closed trie says so before it looks at the weights
        row = self._checker.check_weights(ws, allow_neg_inf=allow_neg_inf, single=True, copy=True)[0]
        return await self.batcher.submit(ContentKey(op, row), (op, row))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or :meth:`cleanup`) has been called."""
        return self.batcher.closed

    def close(self) -> None:
        """Stop the worker thread; later calls raise ClosedError. Calling it again is harmless."""
        self.batcher.close()

    shutdown = close

    def cleanup(self) -> Closed:
        """:meth:`close`; the result may be awaited, as the seed libraries' ``await trie.cleanup()``."""
        self.close()
        return CLOSED
