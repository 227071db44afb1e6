"""The one output cache: an LRU map from request keys to tensors, bounded by entries and bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from genlm_core.validation import check_int

#: The memory a cached value keeps alive: (its storage's device and address, or None; bytes).
Memory = tuple[tuple[torch.device, int] | None, int]


def _memory(value: Any) -> Memory:
    """The memory ``value`` keeps alive: ``(key, bytes)``. A tensor keeps its whole storage (a row that
    is a view of a batch's block keeps the block), counted once however many rows share it (key: the
    storage's address, alive while a cached value holds it); other values count their own bytes."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        return (storage.device, storage.data_ptr()), int(storage.nbytes())
    if hasattr(value, "nbytes"):
        return None, int(value.nbytes)
    return None, 0


class OutputCache:
    """Least-recently-used cache of computed outputs.

    Bounded by ``maxsize`` entries and, optionally, ``max_bytes`` of tensor data (the newest entry
    is always kept): the memory the cached values keep alive, so rows that are views of one batch's
    block count that block once, for as long as any of them is cached.
    With ``move_to_cpu`` torch tensors are copied to CPU memory as they are stored.
    Keys must carry everything that changes the output (token ids, active adapter, ...).
    Thread-safe: backends fill it from their worker thread.
    """

    def __init__(self, maxsize: int = 1024, max_bytes: int | None = None, move_to_cpu: bool = False):
        maxsize = check_int(maxsize, "maxsize", 0)
        max_bytes = None if max_bytes is None else check_int(max_bytes, "max_bytes", 0)
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.move_to_cpu = move_to_cpu
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[Hashable, tuple[Any, Memory]] = OrderedDict()  # key -> (value, its memory)
        #: storage (device, address) -> [cached values in it, its bytes]
        self._storages: dict[tuple[torch.device, int], list[int]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (now most recently used), or ``default``."""
        with self._lock:
            try:
                entry = self._data[key]
            except KeyError:
                self.misses += 1
                return default
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def get_many(self, keys: Sequence[Hashable]) -> list[Any]:
        """:meth:`get` of each key in turn (None where missing), under one lock (a step's requests)."""
        data = self._data
        out: list[Any] = []
        with self._lock:
            for key in keys:
                entry = data.get(key)
                if entry is None:
                    out.append(None)
                else:
                    data.move_to_end(key)
                    out.append(entry[0])
            hits = len(out) - out.count(None)
            self.hits += hits
            self.misses += len(out) - hits
        return out

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` (moved to CPU if asked) and evict the least recently used beyond bounds."""
        return self.put_many([key], [value])[0]

    def put_many(self, keys: Sequence[Hashable], values: Sequence[Any]) -> list[Any]:
        """:meth:`put` of each ``(key, value)`` pair in turn, under one lock (a batch's rows)."""
        if self.maxsize == 0:
            return list(values)
        if self.move_to_cpu:
            values = [v.cpu() if hasattr(v, "cpu") else v for v in values]
        with self._lock:
            base: Any = None
            memory: Memory = (None, 0)
            data = self._data
            for key, value in zip(keys, values, strict=True):
                old = data.pop(key, None)
                if old is not None:
                    self._release(old[1])
                view_of = getattr(value, "_base", None)  # rows of one block: its memory found once
                if view_of is None or view_of is not base:
                    base, memory = view_of, _memory(value)
                data[key] = (value, memory)
                self._hold(memory)
            while len(data) > 1 and (
                len(data) > self.maxsize or (self.max_bytes is not None and self.nbytes > self.max_bytes)
            ):
                self._release(data.popitem(last=False)[1][1])
        return list(values)

    def _hold(self, memory: Memory) -> None:
        where, size = memory
        if where is None:
            self.nbytes += size
            return
        held = self._storages.get(where)
        if held is None:
            self._storages[where] = [1, size]
            self.nbytes += size
        else:
            held[0] += 1

    def _release(self, memory: Memory) -> None:
        where, size = memory
        if where is None:
            self.nbytes -= size
            return
        held = self._storages[where]
        held[0] -= 1
        if held[0] == 0:
            del self._storages[where]
            self.nbytes -= held[1]

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._storages.clear()
            self.nbytes = 0
