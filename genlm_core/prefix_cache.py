"""The one prefix cache: longest-prefix lookup of token sequences, LRU-bounded by entries and bytes.

Backends keep model state (KV caches) for token sequences they have run. A value is usually a
view into a larger *block* of storage shared by several sequences (one batch's KV tensors), so
each entry names its block and the block's bytes are counted once, while any entry uses it.

Sequences are kept as :class:`~genlm_core.context.Context` handles: a lookup of a handle's prefixes
hashes each in O(1) and finds its parent directly (a tuple is wrapped without a copy).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from genlm_core.context import Context, as_context
from genlm_core.validation import check_int

V = TypeVar("V")


class PrefixHit(NamedTuple, Generic[V]):
    """The longest cached prefix found: its length and its value."""

    length: int
    value: V


class PrefixCache(Generic[V]):
    """Maps ``(namespace, tokens)`` to values; finds the longest cached prefix of a sequence.

    ``namespace`` separates states that must never mix (e.g. the active LoRA adapter).
    Eviction is least-recently-used, until at most ``max_entries`` entries remain and the blocks
    they use hold at most ``max_bytes`` (None: unbounded). Entries of the block stored last are
    never evicted by that bound, so one batch's states always survive to be extended.

    >>> cache = PrefixCache()
    >>> cache.put(None, (1, 2, 3), "state after 1 2 3", block="batch-0", nbytes=100)
    >>> cache.longest_prefix(None, (1, 2, 3, 4, 5))
    PrefixHit(length=3, value='state after 1 2 3')
    """

    def __init__(self, max_entries: int = 4096, max_bytes: int | None = None):
        self.max_entries = check_int(max_entries, "max_entries", 1)
        self.max_bytes = None if max_bytes is None else check_int(max_bytes, "max_bytes", 0)
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[Hashable, Context], tuple[Any, Any]] = OrderedDict()
        self._lengths: dict[Hashable, Counter[int]] = {}
        self._blocks: dict[int, list[Any]] = {}  # id(block) -> [block, nbytes, users]
        self._newest_block: int | None = None
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, namespace: Hashable, tokens: Sequence[int], value: V, block: Any, nbytes: int) -> None:
        """Cache ``value`` for ``tokens``; ``block`` is the storage it lives in (``nbytes`` large)."""
        key = (namespace, as_context(tokens))
        with self._lock:
            if key in self._entries:
                self._drop(key)
            record = self._blocks.get(id(block))
            if record is None:
                self._blocks[id(block)] = record = [block, nbytes, 0]
                self.nbytes += nbytes
            record[2] += 1
            self._newest_block = id(block)
            self._entries[key] = (value, block)
            self._lengths.setdefault(namespace, Counter())[len(tokens)] += 1
            self._evict()

    def longest_prefix(
        self, namespace: Hashable, tokens: Sequence[int], max_length: int | None = None
    ) -> PrefixHit[V] | None:
        """The cached entry for the longest prefix of ``tokens`` (at most ``max_length`` long), or None."""
        limit = len(tokens) if max_length is None else min(max_length, len(tokens))
        context = as_context(tokens)
        with self._lock:
            lengths = self._lengths.get(namespace)
            if lengths:
                for length in sorted((n for n in lengths if n <= limit), reverse=True):
                    key = (namespace, context.prefix(length))
                    found = self._entries.get(key)
                    if found is not None:
                        self._entries.move_to_end(key)
                        self.hits += 1
                        return PrefixHit(length, found[0])
            self.misses += 1
            return None

    def _drop(self, key: tuple[Hashable, Context]) -> None:
        _, block = self._entries.pop(key)
        lengths = self._lengths[key[0]]
        lengths[len(key[1])] -= 1
        if not lengths[len(key[1])]:
            del lengths[len(key[1])]
        record = self._blocks[id(block)]
        record[2] -= 1
        if not record[2]:
            del self._blocks[id(block)]
            self.nbytes -= record[1]

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            oldest = next(iter(self._entries))
            if id(self._entries[oldest][1]) == self._newest_block:
                break
            self._drop(oldest)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self._blocks.clear()
            self._newest_block = None
            self.nbytes = 0
