"""The token-character trie's structure, built once and shared by every engine.

Nodes are numbered in preorder, so the subtree of node ``n`` is exactly ``range(n, subtree_end[n])``
and every parent has a smaller number than its children. Each token gets its own leaf (a child of
the node of its full byte string, reached by the end-of-token edge :data:`END`), so duplicate byte
strings with distinct ids keep distinct leaves. The build sorts the tokens and makes one compiled
pass over them; no Python code runs per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

#: Edge label of the edge from a token's byte-string node to the token's leaf.
END = 256


@numba.njit(cache=True, nogil=True)
def _build(
    flat: np.ndarray, offsets: np.ndarray, order: np.ndarray, max_len: int
) -> tuple[np.ndarray, ...]:  # pragma: no cover - compiled
    n_tokens = order.shape[0]
    # pass 1: longest common prefix with the previous token in sorted order -> node count
    lcp = np.zeros(n_tokens, np.int64)
    count = 1
    for k in range(n_tokens):
        t = order[k]
        start, length = offsets[t], offsets[t + 1] - offsets[t]
        c = 0
        if k > 0:
            p = order[k - 1]
            ps, plen = offsets[p], offsets[p + 1] - offsets[p]
            limit = min(length, plen)
            while c < limit and flat[start + c] == flat[ps + c]:
                c += 1
        lcp[k] = c
        count += length - c + 1
    parent = np.full(count, -1, np.int32)
    edge = np.full(count, -1, np.int16)
    depth = np.zeros(count, np.int32)
    node_token = np.full(count, -1, np.int32)
    token_leaf = np.zeros(n_tokens, np.int32)
    path = np.zeros(max_len + 1, np.int32)  # path[d]: node of the current token's prefix of length d
    nxt = 1
    # pass 2: create the nodes in preorder
    for k in range(n_tokens):
        t = order[k]
        start, length = offsets[t], offsets[t + 1] - offsets[t]
        for d in range(lcp[k] + 1, length + 1):
            parent[nxt] = path[d - 1]
            edge[nxt] = flat[start + d - 1]
            depth[nxt] = d
            path[d] = nxt
            nxt += 1
        parent[nxt] = path[length]
        edge[nxt] = 256
        depth[nxt] = length + 1
        node_token[nxt] = t
        token_leaf[t] = nxt
        nxt += 1
    subtree_end = np.arange(1, count + 1).astype(np.int32)
    for n in range(count - 1, 0, -1):
        if subtree_end[n] > subtree_end[parent[n]]:
            subtree_end[parent[n]] = subtree_end[n]
    return parent, edge, depth, node_token, token_leaf, subtree_end


@dataclass(frozen=True, eq=False)
class TrieIndex:
    """Arrays describing the trie (all indexed by node unless noted)."""

    parent: np.ndarray  #: int32, parent node; -1 for the root
    edge: np.ndarray  #: int16, byte on the edge into the node; END for leaves; -1 for the root
    depth: np.ndarray  #: int32, length of the node's byte prefix (leaves: token length + 1)
    node_token: np.ndarray  #: int32, token id of a leaf; -1 for inner nodes
    token_leaf: np.ndarray  #: int32, by token id: its leaf node
    subtree_end: np.ndarray  #: int32, the subtree of n is range(n, subtree_end[n])
    leaf_parent: np.ndarray  #: int32, by token id: the parent of its leaf (the node of its bytes)
    inner: np.ndarray  #: int32, inner nodes except the root, deepest-numbered first
    inner_parent: np.ndarray  #: int32, parent of each node in ``inner``

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @classmethod
    def build(cls, vocab: Sequence[bytes]) -> TrieIndex:
        """Index of ``vocab``; token id ``i`` is ``vocab[i]``."""
        if not all(isinstance(t, (bytes, bytearray)) for t in vocab):
            bad = next(t for t in vocab if not isinstance(t, (bytes, bytearray)))
            raise TypeError(f"trie vocabulary entries must be bytes (or Token), got {type(bad).__name__}: {bad!r}")
        if not len(vocab):
            raise ValueError("cannot build a trie over an empty vocabulary")
        lengths = np.fromiter(map(len, vocab), np.int64, len(vocab))
        offsets = np.zeros(len(vocab) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.frombuffer(b"".join(vocab), np.uint8)
        order = np.array(sorted(range(len(vocab)), key=vocab.__getitem__), np.int64)
        parent, edge, depth, node_token, token_leaf, subtree_end = _build(flat, offsets, order, int(lengths.max()))
        inner = np.flatnonzero(node_token[1:] < 0)[::-1].astype(np.int32) + 1
        return cls(
            parent,
            edge,
            depth,
            node_token,
            token_leaf,
            subtree_end,
            leaf_parent=parent[token_leaf],
            inner=inner,
            inner_parent=parent[inner],
        )
