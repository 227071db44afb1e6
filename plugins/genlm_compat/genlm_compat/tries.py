"""genlm's trie engines behind genlm-backend's trie classes and attributes.

genlm-backend's tries accept any items (bytes, genlm-backend Tokens, or other iterables such as
genlm-control's ``EOS`` marker) and expose their structure: ``root``, ``children`` (a list of dicts from
a letter, or ``(None, position)`` for an item's leaf, to a node), ``word2leaf`` (keyed by
``(byte_string, token_id)`` for a Token, else by the item), ``leaf2word`` and ``node2prefix``. Here the
byte items go to one of genlm's engines (numba on CPU, torch on a GPU), and the few other items get
nodes numbered after the engine's, summed with a small dense map.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from genlm_core.closing import CLOSED, Closed
from genlm_core.trie import END, AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie
from genlm_core.trie.base import check_weights


def _key(item: Any) -> Any:
    token_id = getattr(item, "token_id", None)
    return (bytes(item), token_id) if isinstance(item, bytes) and token_id is not None else item


class CompatCharacterTrie:
    """genlm-backend's ``TokenCharacterTrie`` interface over a genlm engine (``engine``)."""

    engine_class: type[Any] = TokenCharacterTrie

    def __init__(self, decode: Sequence[Any], **engine_kwargs: Any):
        self.decode = list(decode)
        if not self.decode:
            raise ValueError("cannot build a trie over an empty vocabulary")
        self.byte_pos = np.array([i for i, t in enumerate(self.decode) if isinstance(t, bytes)], np.int64)
        self.other_pos = np.array([i for i, t in enumerate(self.decode) if not isinstance(t, bytes)], np.int64)
        byte_items = [bytes(self.decode[i]) for i in self.byte_pos]
        self.engine = self.engine_class(byte_items or [b""], **engine_kwargs)
        self.root = self.engine.root
        self.vocab_size = len(self.decode)
        self.all_bytes = len(self.other_pos) == 0
        self._build_other_nodes()
        keys = [_key(t) for t in self.decode]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate word in vocabulary")

    def _build_other_nodes(self) -> None:
        """Nodes for the non-byte items, numbered from the engine's node count: one per distinct letter
        path, plus one leaf per item; ``other_map[n, k]`` is 1 when item ``other_pos[k]`` is below node n."""
        first = self.engine.num_nodes
        self.other_children: dict[int, dict[Any, int]] = {}
        self.other_leaf: list[int] = []
        paths: list[list[int]] = []
        count = first
        for pos in self.other_pos:
            node, path = self.root, []
            for letter in self.decode[pos]:
                kids = self.other_children.setdefault(node, {})
                if letter not in kids:
                    kids[letter], count = count, count + 1
                node = kids[letter]
                path.append(node)
            self.other_children.setdefault(node, {})[(None, int(pos))] = count
            self.other_leaf.append(count)
            path.append(count)
            paths.append(path)
            count += 1
        self.num_nodes = count
        self.other_map = np.zeros((count - first, len(self.other_pos)))
        for k, path in enumerate(paths):
            self.other_map[np.array(path, np.int64) - first, k] = 1.0

    # ---- genlm-backend's structure ----------------------------------------------------------

    @cached_property
    def children(self) -> list[dict[Any, int]]:
        index = self.engine.index
        out: list[dict[Any, int]] = [{} for _ in range(self.num_nodes)]
        positions = self.byte_pos
        for node in range(1, index.num_nodes):
            edge = int(index.edge[node])
            label: Any = edge if edge != END else (None, int(positions[index.node_token[node]]))
            out[int(index.parent[node])][label] = node
        for node, kids in self.other_children.items():
            out[node].update(kids)
        return out

    @cached_property
    def word2leaf(self) -> dict[Any, int]:
        leaves = self.engine.index.token_leaf
        out = {_key(self.decode[p]): int(leaves[j]) for j, p in enumerate(self.byte_pos)}
        out.update((_key(self.decode[p]), leaf) for p, leaf in zip(self.other_pos, self.other_leaf))
        return out

    @cached_property
    def leaf2word(self) -> dict[int, Any]:
        return {leaf: word for word, leaf in self.word2leaf.items()}

    @cached_property
    def idx_to_leaf(self) -> np.ndarray:
        leaves = self.engine.index.token_leaf
        pairs = [(int(p), int(leaves[j])) for j, p in enumerate(self.byte_pos)]
        pairs += [(int(p), leaf) for p, leaf in zip(self.other_pos, self.other_leaf)]
        return np.array(sorted(pairs), np.int64)

    @cached_property
    def node2prefix(self) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {self.root: []}
        for node, kids in enumerate(self.children):  # parents are numbered before their children
            for letter, child in kids.items():
                leaf = isinstance(letter, tuple) and letter[0] is None
                out[child] = out[node] if leaf else [*out[node], letter]
        return out

    # ---- weights ------------------------------------------------------------------------------

    def check_weights(self, ws: Any, allow_neg_inf: bool = False, *, single: bool = False, copy: bool = False) -> Any:
        """Weights as a checked 2-D batch over ``decode`` (genlm_core's :func:`check_weights`)."""
        return check_weights(ws, self.vocab_size, allow_neg_inf, single=single, copy=copy)

    def reduce_checked(self, ws: Any, op: str) -> np.ndarray:
        """Node values ``[batch, num_nodes]`` of checked weights ``ws``; ``op`` is "sum" or "max"."""
        if self.all_bytes:
            return np.asarray(self.engine.reduce_checked(ws, op))
        ws = np.asarray(ws.detach().cpu() if isinstance(ws, torch.Tensor) else ws, dtype=np.float64)
        out = np.empty((ws.shape[0], self.num_nodes))
        first = self.engine.num_nodes
        if len(self.byte_pos):
            out[:, :first] = self.engine.reduce_checked(np.ascontiguousarray(ws[:, self.byte_pos]), op)
        else:
            out[:, :first] = 0.0 if op == "sum" else -np.inf
        other = ws[:, self.other_pos]
        if op == "sum":
            out[:, first:] = other @ self.other_map.T
            out[:, self.root] += other.sum(axis=1)
        else:
            masked = np.where(self.other_map[None] > 0, other[:, None, :], -np.inf)
            out[:, first:] = masked.max(axis=2)
            out[:, self.root] = np.maximum(out[:, self.root], other.max(axis=1))
        return out

    def weight_sum(self, ws: Any) -> np.ndarray:
        """Per-node sums of one weight vector indexed by position in ``decode``."""
        return self.reduce_checked(self.check_weights(ws, single=True), "sum")[0]

    def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node maxima of one weight vector (log space welcome)."""
        return self.reduce_checked(self.check_weights(ws, allow_neg_inf=True, single=True), "max")[0]

    def batch_weight_sum(self, ws: Any) -> np.ndarray:
        return self.reduce_checked(self.check_weights(ws), "sum")

    def batch_weight_max(self, ws: Any) -> np.ndarray:
        return self.reduce_checked(self.check_weights(ws, allow_neg_inf=True), "max")


class CompatParallelCharacterTrie(CompatCharacterTrie):
    """genlm-backend's ``ParallelTokenCharacterTrie``: genlm's torch engine, on ``device``."""

    engine_class: type[Any] = ParallelTokenCharacterTrie

    def __init__(self, decode: Sequence[Any], device: str | None = None, **kwargs: Any):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"Invalid device: {device}. Must be 'cpu', 'cuda' or None")
        # On CPU genlm's numba engine is the faster one; the results are the same.
        if self.device == "cpu":
            self.engine_class = TokenCharacterTrie
        else:
            kwargs["device"] = self.device
        super().__init__(decode, **kwargs)


class CompatAsyncCharacterTrie(AsyncTokenCharacterTrie):
    """genlm-backend's ``AsyncTokenCharacterTrie``: genlm's batching wrapper with its constructor,
    ``from_vocab(vocab, backend="parallel")``, ``start()`` and an awaitable ``cleanup()``."""

    def __init__(self, trie: Any, batch_size: int = 128, timeout: float = 0.001):
        if not isinstance(trie, CompatCharacterTrie) and isinstance(trie, Sequence):
            raise TypeError("AsyncTokenCharacterTrie takes a trie; use from_vocab(vocab) for a vocabulary")
        super().__init__(trie, batch_size=batch_size, timeout=timeout)

    @classmethod
    def from_vocab(  # type: ignore[override]  # genlm-backend's signature
        cls, vocab: Sequence[Any], backend: str = "parallel", **kwargs: Any
    ) -> CompatAsyncCharacterTrie:
        if backend == "sequential":
            return cls(CompatCharacterTrie(vocab, **kwargs))
        if backend == "parallel":
            return cls(CompatParallelCharacterTrie(vocab, **kwargs))
        raise ValueError(f"Unknown backend: {backend}. Must be one of ['sequential', 'parallel']")

    def start(self) -> None:
        """Nothing to start: the batcher starts on the first request."""

    def cleanup(self) -> Closed:
        self.close()
        return CLOSED
