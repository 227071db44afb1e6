"""The CPU engine: compiled bottom-up passes in float64 (numba), batches split over cores."""

from __future__ import annotations

import functools
import sys
import threading

import numba
import numpy as np
import torch

from genlm_core.trie.base import TrieBase


@numba.njit(cache=True, nogil=True)
def _sum_into(
    out: np.ndarray, ws: np.ndarray, index_arrays: tuple[np.ndarray, ...]
) -> None:  # pragma: no cover - compiled
    token_leaf, leaf_parent, inner, inner_parent = index_arrays
    out[:] = 0.0
    for t in range(ws.shape[0]):
        w = ws[t]
        out[token_leaf[t]] = w
        out[leaf_parent[t]] += w
    # Inner nodes are numbered after their parents: one sweep from the highest number down adds
    # every finished subtree into its parent. Only same-sign terms meet, so a tiny subtree keeps
    # its full relative precision next to a large one.
    for i in range(inner.shape[0]):
        out[inner_parent[i]] += out[inner[i]]


@numba.njit(cache=True, nogil=True)
def _max_into(
    out: np.ndarray, ws: np.ndarray, index_arrays: tuple[np.ndarray, ...]
) -> None:  # pragma: no cover - compiled
    token_leaf, leaf_parent, inner, inner_parent = index_arrays
    out[:] = -np.inf
    for t in range(ws.shape[0]):
        w = ws[t]
        out[token_leaf[t]] = w
        out[leaf_parent[t]] = max(out[leaf_parent[t]], w)
    for i in range(inner.shape[0]):
        out[inner_parent[i]] = max(out[inner_parent[i]], out[inner[i]])


@numba.njit(cache=True, nogil=True, parallel=True)
def _batch(
    out: np.ndarray, ws: np.ndarray, index_arrays: tuple[np.ndarray, ...], is_max: bool
) -> None:  # pragma: no cover - compiled
    for b in numba.prange(ws.shape[0]):
        if is_max:
            _max_into(out[b], ws[b], index_arrays)
        else:
            _sum_into(out[b], ws[b], index_arrays)


def _count_at(buffers: list[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``buffers[i]`` as :class:`OutputPool` sees it (one code path for the
    calibration and the use, so the baseline is always the interpreter's own)."""
    buf = buffers[i]
    return sys.getrefcount(buf)


@functools.cache
def _free_count() -> int | None:
    """The count of a buffer that only the pool holds, measured on this interpreter; None where
    reference counts cannot tell (not CPython, or a live view does not raise the count): pooling
    is then off and every result gets fresh memory. Measured once per process."""
    if sys.implementation.name != "cpython" or not hasattr(sys, "getrefcount"):
        return None
    probe = [np.empty(1)]
    free = _count_at(probe, 0)
    view = probe[0][:]
    held = _count_at(probe, 0)
    del view
    return free if held > free and _count_at(probe, 0) == free else None


class OutputPool:
    """Output arrays whose memory is reused once no array views it any more.

    Large fresh allocations are page-faulted (and zeroed by the kernel) on first touch, which costs
    as much as the trie sweep itself at batch 128; results the caller has dropped are recycled
    instead. An array still referenced anywhere (a view keeps its base referenced) is never handed
    out again. "Only the pool holds it" is the reference count measured at start-up on this
    interpreter (:func:`_free_count`), not a constant; where counts cannot tell, nothing is reused.
    """

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.free_count = _free_count()
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, rows: int, cols: int) -> np.ndarray:
        if self.free_count is None:
            return np.empty((rows, cols))
        with self._lock:
            for i in range(len(self._buffers)):
                if self._buffers[i].shape == (rows, cols) and _count_at(self._buffers, i) == self.free_count:
                    self._buffers.append(self._buffers.pop(i))
                    return self._buffers[-1]
            buf = np.empty((rows, cols))
            self._buffers = [*self._buffers[-(self.keep - 1) :], buf] if self.keep > 1 else [buf]
            return buf


class TokenCharacterTrie(TrieBase):
    """CPU trie engine: float64 results as numpy arrays ``[num_nodes]`` / ``[batch, num_nodes]``.

    >>> trie = TokenCharacterTrie([b"a", b"ab", b"b"])
    >>> masses = trie.weight_sum([0.5, 0.25, 0.25])
    >>> float(masses[trie.root]), float(masses[trie.node_of_prefix(b"a")])
    (1.0, 0.75)
    """

    _pool: OutputPool | None = None

    def _reduce(self, ws: np.ndarray | torch.Tensor, op: str) -> np.ndarray:
        if isinstance(ws, torch.Tensor):  # a CUDA tensor (CPU ones arrive as numpy)
            ws = ws.detach().cpu().numpy()
        if self._pool is None:
            self._pool = OutputPool()
        out = self._pool.empty(ws.shape[0], self.num_nodes)
        ix = self.index
        arrays = (ix.token_leaf, ix.leaf_parent, ix.inner, ix.inner_parent)
        if ws.shape[0] == 1:
            (_max_into if op == "max" else _sum_into)(out[0], ws[0], arrays)
        else:
            _batch(out, ws, arrays, op == "max")
        return out
