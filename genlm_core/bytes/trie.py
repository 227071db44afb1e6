"""``TokenByteTrie``: the token-character trie, seen as a byte-level automaton with EOT and EOS.

Built on the core trie engines. Two modes: ``WITHOUT_EOS`` treats EOS tokens as ordinary tokens
(their bytes are text, as during prefill); ``WITH_EOS`` moves their mass to a virtual EOS node
below the root, reached by the EOS symbol (257) instead of by their bytes. Atomic tokens (e.g.
special tokens whose text must not be spelled out byte by byte) are never entered by bytes:
their mass counts at the root only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

import numba
import numpy as np
import torch

from genlm_core.plugins import get_plugins
from genlm_core.trie.base import TrieBase
from genlm_core.trie.batched import BatchedTrie
from genlm_core.trie.index import END
from genlm_core.validation import as_bytes, check_batcher_numbers, check_int, check_token_id_set, check_vocabulary

from .probs import EOS, EOT


@numba.njit(cache=True, nogil=True)
def _gather_leaves(
    p: np.ndarray, order: np.ndarray, out: np.ndarray
) -> tuple[float, int]:  # pragma: no cover - compiled
    """``out[i] = p[order[i]]`` in float64; returns the float64 total and the first token id whose
    probability is not finite and >= 0 (-1 when all are)."""
    total = 0.0
    for i in range(order.shape[0]):
        x = np.float64(p[order[i]])
        if not (x >= 0.0 and x < np.inf):
            return total, order[i]
        out[i] = x
        total += x
    return total, -1


def _one_of(value: Any, alias: Any, name: str, alias_name: str) -> Any:
    """The value given under ``name`` or its older name ``alias_name``; TypeError when both are given."""
    if alias is not None:
        if value is not None:
            raise TypeError(f"give {name} or its older name {alias_name}, not both")
        return alias
    return value


def check_mode(mode: Any) -> TrieMode:
    """``mode`` as a :class:`TrieMode` (its value strings are accepted too); None means WITHOUT_EOS, as in
    genlm-bytes."""
    if mode is None:
        return TrieMode.WITHOUT_EOS
    try:
        return TrieMode(mode)
    except ValueError:
        raise ValueError(f"mode must be TrieMode.WITH_EOS or TrieMode.WITHOUT_EOS, got {mode!r}") from None


class Masses:
    """Node masses of one next-token distribution, computed on demand.

    Every subtree is a contiguous run of leaves in preorder, so a node's mass is one float64 sum
    over a slice of the leaf-ordered probabilities: a beam pays for the nodes it visits, not for
    the whole trie, and tiny masses keep full relative precision (no differences are taken).
    """

    __slots__ = ("eos", "leaf_probs", "total", "trie")

    def __init__(self, trie: TokenByteTrie, leaf_probs: np.ndarray, total: float, eos: float):
        self.trie = trie
        self.leaf_probs = leaf_probs
        self.total = total  # the root's mass: every token, EOS and atomic ones included
        self.eos = eos

    def __getitem__(self, node: int) -> float:
        if node == self.trie.root:
            return self.total
        if node == self.trie.eos_node:
            return self.eos
        return float(self.leaf_probs[self.trie.leaf_lo[node] : self.trie.leaf_hi[node]].sum())

    def log_all(self) -> np.ndarray:
        """Log-masses of every node, ``[num_nodes]`` with the EOS node last: genlm-bytes' ``mass`` array
        (computed from the leaves by one tree sum; use ``masses[node]`` for a few nodes)."""
        t = self.trie
        probs = np.zeros((1, len(t.decode)))
        probs[0, t.leaf_tokens] = self.leaf_probs
        out = np.empty(t.num_nodes)
        out[: t.eos_node] = t.trie._reduce(probs, "sum")[0]
        out[t.root], out[t.eos_node] = self.total, self.eos
        with np.errstate(divide="ignore"):
            return np.log(out)

    def children(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        """``(edge labels, masses)`` of all children of ``node`` (leaves have label END)."""
        t = self.trie
        lo, hi = t.kid_ptr[node], t.kid_ptr[node + 1]
        if lo == hi:
            return t.kid_edge[lo:hi], np.zeros(0)
        first = t.leaf_lo[node]
        sums = np.add.reduceat(self.leaf_probs[first : t.leaf_hi[node]], t.leaf_lo[t.kid_node[lo:hi]] - first)
        return t.kid_edge[lo:hi], sums


class TrieMode(Enum):
    """How EOS tokens are treated."""

    WITHOUT_EOS = "without_eos"  #: EOS tokens are ordinary tokens, spelled by their bytes
    WITH_EOS = "with_eos"  #: EOS tokens' mass moves to the EOS node (symbol 257) below the root


class TokenByteTrie:
    """A byte-level view of the vocabulary ``decode`` (token id ``i`` is ``decode[i]``).

    Node values are masses: ``weight_sum(probs, mode)`` gives one value per node (``num_nodes``), where
    ``masses[n]`` is the probability that the next token starts with node ``n``'s bytes, and
    ``masses[eos_node]`` that it is an EOS token (WITH_EOS; 0 WITHOUT_EOS). The EOS node is a virtual
    node just past the engine's nodes, reached from the root by the EOS symbol.

    The arguments are genlm-bytes' (``decode, device, atomic_byte_strings, eot_sentinel,
    eos_byte_strings, max_batch_size``) plus ours: ``engine`` picks the trie engine (default ``"numba"``
    on CPU; ``device="cuda"`` alone picks ``"torch"``), ``eos_token_ids`` names EOS tokens by id (where
    byte strings are ambiguous), and ``engine_kwargs`` go to the engine. genlm-bytes' older keyword names
    ``atomic_tokens``, ``eot_token`` and ``eos_tokens`` are accepted too.
    """

    def __init__(
        self,
        decode: Sequence[bytes],
        device: str | None = None,
        atomic_byte_strings: Iterable[bytes] | None = None,
        eot_sentinel: Any = None,
        eos_byte_strings: Iterable[bytes] | None = None,
        max_batch_size: int = 64,
        *,
        engine: str | None = None,
        eos_token_ids: Iterable[int] = (),
        atomic_tokens: Iterable[bytes] | None = None,
        eot_token: Any = None,
        eos_tokens: Iterable[bytes] | None = None,
        **engine_kwargs: Any,
    ):
        atomic_byte_strings = _one_of(atomic_byte_strings, atomic_tokens, "atomic_byte_strings", "atomic_tokens")
        eos_byte_strings = _one_of(eos_byte_strings, eos_tokens, "eos_byte_strings", "eos_tokens")
        if _one_of(eot_sentinel, eot_token, "eot_sentinel", "eot_token") is not None:
            raise ValueError(
                "eot_sentinel: only None is supported; the end of a token is the symbol EOT (256) in "
                "genlm_core.bytes, whatever the sentinel"
            )
        self.max_batch_size = check_int(max_batch_size, "max_batch_size", 1)
        if engine is None:
            engine = "torch" if device is not None and str(device) != "cpu" else "numba"
        if device is not None and engine != "numba":
            engine_kwargs["device"] = device
        self.decode = check_vocabulary(decode, "decode")
        if not self.decode:
            raise ValueError("cannot build a byte trie over an empty vocabulary")
        self.trie: TrieBase = get_plugins().load_trie_engine(engine)(self.decode, **engine_kwargs)
        index = self.trie.index
        by_bytes: dict[bytes, list[int]] = {}
        for i, t in enumerate(self.decode):
            by_bytes.setdefault(bytes(t), []).append(i)

        def ids_of(strings: Iterable[bytes], what: str) -> set[int]:
            out: set[int] = set()
            for s in strings:  # a Token here counts by its bytes, like any bytes
                if bytes(s) not in by_bytes:
                    raise ValueError(f"{what} byte string {bytes(s)!r} is not in the vocabulary")
                out.update(by_bytes[bytes(s)])
            return out

        self.eos_token_ids = sorted(
            ids_of(eos_byte_strings or (), "EOS") | check_token_id_set(eos_token_ids, len(self.decode), "eos_token_ids")
        )
        self.atomic_token_ids = sorted(ids_of(atomic_byte_strings or (), "atomic"))
        #: the byte strings of the EOS tokens (genlm-bytes' attribute)
        self.eos_byte_strings: set[bytes] = {bytes(self.decode[i]) for i in self.eos_token_ids}
        self.root = self.trie.root
        self.eos_node = self.trie.num_nodes
        self.num_nodes = self.trie.num_nodes + 1
        # children in CSR form: the children of n are kid_node[kid_ptr[n]:kid_ptr[n + 1]]
        parent = index.parent[1:]
        order = np.argsort(parent, kind="stable") + 1
        self.kid_ptr = np.zeros(self.num_nodes + 1, np.int64)
        np.cumsum(np.bincount(parent, minlength=self.num_nodes), out=self.kid_ptr[1:])
        self.kid_node = order.astype(np.int64)
        self.kid_edge = index.edge[order].astype(np.int64)
        self._children: list[dict[int, int] | None] = [None] * self.num_nodes
        # leaves in preorder, and each node's run of them: the leaves below n are leaf_order[leaf_lo[n]:leaf_hi[n]]
        leaves = np.flatnonzero(index.node_token >= 0)
        self.leaf_tokens = index.node_token[leaves].astype(np.int64)
        nodes = np.arange(self.trie.num_nodes)
        self.leaf_lo = np.searchsorted(leaves, nodes).astype(np.int64)
        self.leaf_hi = np.searchsorted(leaves, index.subtree_end).astype(np.int64)
        self._zeroed = {
            TrieMode.WITHOUT_EOS: np.array(self.atomic_token_ids, np.int64),
            TrieMode.WITH_EOS: np.array(sorted(set(self.atomic_token_ids) | set(self.eos_token_ids)), np.int64),
        }
        rank = np.empty(len(self.decode), np.int64)
        rank[self.leaf_tokens] = np.arange(len(self.decode))
        self._zeroed_ranks = {mode: rank[ids] for mode, ids in self._zeroed.items()}

    @property
    def node2prefix(self) -> list[bytes]:
        return self.trie.node2prefix

    def children(self, node: int) -> dict[int, int]:
        """``{byte: child}`` of ``node`` (EOT leaves excluded; see :meth:`eot_edges`)."""
        kids = self._children[node]
        if kids is None:
            lo, hi = self.kid_ptr[node], self.kid_ptr[node + 1]
            kids = {int(e): int(n) for e, n in zip(self.kid_edge[lo:hi], self.kid_node[lo:hi]) if e != END}
            self._children[node] = kids
        return kids

    def node_of(self, prefix: bytes | str) -> int | None:
        """The node of byte string ``prefix`` (a ``str`` is read as UTF-8), or None when no token starts with it."""
        node = self.root
        for b in as_bytes(prefix, "prefix"):
            found = self.children(node).get(b)
            if found is None:
                return None
            node = found
        return node

    def eot_edges(self, node: int) -> list[tuple[int, int]]:
        """``(leaf, token_id)`` of every token whose bytes are exactly ``node``'s prefix."""
        lo, hi = self.kid_ptr[node], self.kid_ptr[node + 1]
        kids = self.kid_node[lo:hi][self.kid_edge[lo:hi] == END]
        return [(int(leaf), int(self.trie.index.node_token[leaf])) for leaf in kids]

    def masses(self, probs: Any, mode: TrieMode = TrieMode.WITHOUT_EOS, *, log: bool = False) -> Masses:
        """Lazy :class:`Masses` of one probability vector over the vocabulary (numpy or torch, any
        float dtype); with ``log``, of the exponentials of a log-probability vector, taken in float64
        (so a float32 row loses nothing). ValueError for a wrong shape or a probability that is NaN,
        infinite or negative.

        The work is numpy's and numba's, on the calling thread: torch's thread pool stays free for the
        model computing the next batch meanwhile."""
        mode = check_mode(mode)
        p = self.trie.check_weights(probs, single=True, check_values=False)[0]
        if isinstance(p, torch.Tensor):
            p = p.cpu().numpy()
        if log:
            leaf_probs = p[self.leaf_tokens].astype(np.float64)
            np.exp(leaf_probs, out=leaf_probs)
            total = float(leaf_probs.sum())
            bad = -1 if math.isfinite(total) else int(self.leaf_tokens[np.flatnonzero(~np.isfinite(leaf_probs))[0]])
        else:
            leaf_probs = np.empty(len(self.leaf_tokens))
            total, bad = _gather_leaves(p, self.leaf_tokens, leaf_probs)
        if bad >= 0:
            value = f"exp({p[bad]})" if log else p[bad]
            raise ValueError(f"probability of token {bad} is {value}: probabilities must be finite and >= 0")
        leaf_probs[self._zeroed_ranks[mode]] = 0.0
        eos = 0.0
        if mode is TrieMode.WITH_EOS:
            at_eos = p[self.eos_token_ids].astype(np.float64)
            eos = float((np.exp(at_eos) if log else at_eos).sum())
        return Masses(self, leaf_probs, total, eos)

    def logp_next(self, node: int, mass: Masses, mode: TrieMode) -> np.ndarray:
        """Log-probabilities of the 256 bytes, EOT and EOS at ``node`` (258 entries, not renormalised)."""
        out = np.zeros(258)
        edges, sums = mass.children(node)
        np.add.at(out, edges, sums)
        if node == self.root and mode is TrieMode.WITH_EOS:
            out[EOS] = mass.eos
        with np.errstate(divide="ignore"):
            return np.log(out) - math.log(mass[node])

    def _prepare(self, ws: np.ndarray, mode: TrieMode) -> np.ndarray:
        zeroed = self._zeroed[mode]
        if len(zeroed):
            ws = np.array(ws, dtype=np.float64)
            ws[..., zeroed] = 0.0
        return ws

    def batch_weight_sum(self, ws: Any, mode: TrieMode | None = None) -> np.ndarray:
        """Masses ``[batch, num_nodes]`` for probability vectors ``ws`` ``[batch, vocab]`` (see :meth:`weight_sum`)."""
        return self._masses(self.trie.check_weights(ws), check_mode(mode))

    def weight_sum(self, ws: Any, mode: TrieMode | None = None) -> np.ndarray:
        """Masses ``[num_nodes]`` of one probability vector; the last entry (``eos_node``) is the EOS mass.

        ``mode`` None is WITHOUT_EOS. A batch is refused: use :meth:`batch_weight_sum`."""
        return self._masses(self.trie.check_weights(ws, single=True), check_mode(mode))[0]

    def batch_weight_max(self, ws: Any) -> np.ndarray:
        """Per-node max ``[batch, num_nodes]`` of weights ``ws`` (log space welcome; the EOS node gets -inf)."""
        out = np.asarray(self.trie.batch_weight_max(ws), dtype=np.float64)
        return np.concatenate([out, np.full((out.shape[0], 1), -np.inf)], axis=1)

    def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node max ``[num_nodes]`` of one weight vector (see :meth:`batch_weight_max`)."""
        out = np.asarray(self.trie.weight_max(ws), dtype=np.float64)
        return np.append(out, -np.inf)

    def _masses(self, checked: Any, mode: TrieMode) -> np.ndarray:
        if isinstance(checked, torch.Tensor):
            checked = checked.detach().cpu().numpy()
        out = np.empty((checked.shape[0], self.num_nodes))
        for lo in range(0, checked.shape[0], self.max_batch_size):
            rows = checked[lo : lo + self.max_batch_size]
            out[lo : lo + len(rows), : self.eos_node] = self.trie._reduce(self._prepare(rows, mode), "sum")
        out[:, self.root] = checked.sum(axis=1, dtype=np.float64)  # EOS and atomic mass count at the root
        if mode is TrieMode.WITH_EOS and self.eos_token_ids:
            out[:, self.eos_node] = checked[:, self.eos_token_ids].sum(axis=1, dtype=np.float64)
        else:
            out[:, self.eos_node] = 0.0
        return out


class AsyncTokenByteTrie(BatchedTrie):
    """Concurrent ``await trie.weight_sum(probs, mode)`` calls, batched by the core AutoBatcher."""

    ops = (*TrieMode, "max")

    def __init__(self, trie: TokenByteTrie, batch_size: int = 128, timeout: float = 0.0):
        if not isinstance(trie, TokenByteTrie):
            raise TypeError(f"trie must be a TokenByteTrie, got {type(trie).__name__}")
        self.trie = trie
        # timeout 0: the requests of one beam step are all issued before the event loop turns
        super().__init__(trie.trie, batch_size, timeout, name="byte-trie")

    @classmethod
    def from_vocab(
        cls, vocab: Sequence[bytes], batch_size: int = 128, timeout: float = 0.0, **trie_kwargs: Any
    ) -> AsyncTokenByteTrie:
        """Build a :class:`TokenByteTrie` (``trie_kwargs``: engine, eos_byte_strings, ...) and wrap it."""
        check_batcher_numbers(batch_size, timeout)  # before the (slower) build
        return cls(TokenByteTrie(vocab, **trie_kwargs), batch_size=batch_size, timeout=timeout)

    def _compute(self, op: Any, rows: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.trie._masses(rows, op) if isinstance(op, TrieMode) else self.trie.batch_weight_max(rows)

    async def weight_sum(self, ws: Any, mode: TrieMode | None = None) -> np.ndarray:
        """:meth:`TokenByteTrie.weight_sum` of one probability vector, batched with concurrent calls.

        ``ws`` is checked and copied when submitted: a bad vector fails alone, at once, and later changes
        to the caller's array do not change the result."""
        self.batcher.ensure_open()  # a closed trie says so before it looks at the mode
        return await self._submit(check_mode(mode), ws)

    async def weight_max(self, ws: Any) -> np.ndarray:
        """:meth:`TokenByteTrie.weight_max` of one weight vector, batched with concurrent calls."""
        return await self._submit("max", ws, allow_neg_inf=True)

    def release(self) -> None:
        """Stop the worker thread but stay usable: the next call starts a new one (genlm-bytes' cleanup)."""
        self.batcher.release()


__all__ = ["EOS", "EOT", "AsyncTokenByteTrie", "TokenByteTrie", "TrieMode"]
