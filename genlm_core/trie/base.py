"""What every trie engine shares: the index, maps between tokens, leaves and nodes, input checks."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from genlm_core.trie.index import END, TrieIndex
from genlm_core.validation import as_bytes, check_vocabulary


def check_weights(
    ws: Any,
    vocab_size: int,
    allow_neg_inf: bool = False,
    *,
    single: bool = False,
    copy: bool = False,
    check_values: bool = True,
) -> np.ndarray | torch.Tensor:
    """``ws`` as a 2-D ``[batch, vocab_size]`` float32/float64 array (numpy; a tensor on a non-CPU device).

    Takes numpy arrays, torch tensors and lists of numbers or of vectors. bfloat16 and float16
    are widened to float32, integers to float64; bool, complex and other dtypes are a TypeError.
    ValueError for a wrong shape (with ``single``, anything but one ``(vocab,)`` vector), and for
    NaN or infinity (``allow_neg_inf`` admits ``-inf``, log-space zero) unless not
    ``check_values``. With ``copy`` the result never shares memory with ``ws``: a snapshot.
    """
    fresh = False
    if isinstance(ws, (list, tuple)):
        if ws and all(isinstance(w, torch.Tensor) for w in ws):
            ws = torch.stack([w.detach() for w in ws])
        else:
            try:
                ws = np.asarray([np.asarray(w.detach().cpu() if isinstance(w, torch.Tensor) else w) for w in ws])
            except ValueError as exc:
                raise ValueError(f"weights: cannot make an array of the list given ({exc})") from None
        fresh = True
    elif not isinstance(ws, (np.ndarray, torch.Tensor)):
        raise TypeError(f"weights must be a numpy array, torch tensor or list of them, got {type(ws).__name__}")
    if isinstance(ws, torch.Tensor):
        if ws.dtype in (torch.bfloat16, torch.float16):
            ws, fresh = ws.float(), True
        elif ws.dtype == torch.bool or ws.is_complex():
            raise TypeError(f"weights must be real numbers, got a tensor of dtype {ws.dtype}")
        elif not ws.is_floating_point():
            ws, fresh = ws.double(), True
    else:
        kind = ws.dtype.kind
        if kind == "f" and ws.dtype not in (np.float32, np.float64):
            ws, fresh = ws.astype(np.float32 if ws.itemsize < 4 else np.float64), True
        elif kind in "iu":
            ws, fresh = ws.astype(np.float64), True
        elif kind != "f":
            raise TypeError(f"weights must be real numbers, got an array of dtype {ws.dtype}")
    if single and (ws.ndim != 1 or ws.shape[0] != vocab_size):
        hint = ": use the batch_ method for a batch" if ws.ndim == 2 else ""
        raise ValueError(f"expected one weight vector of shape ({vocab_size},), got {tuple(ws.shape)}{hint}")
    if ws.ndim not in (1, 2) or ws.shape[-1] != vocab_size:
        raise ValueError(f"expected weights of shape ({vocab_size},) or (batch, {vocab_size}), got {tuple(ws.shape)}")
    ws = ws if ws.ndim == 2 else ws[None]
    if isinstance(ws, torch.Tensor) and ws.device.type == "cpu":
        ws = ws.detach().numpy()
    if isinstance(ws, np.ndarray):
        contiguous = np.ascontiguousarray(ws)
        fresh = fresh or contiguous is not ws
        ws = contiguous.copy() if copy and not fresh else contiguous
    elif copy and not fresh:
        ws = ws.detach().clone()
    if check_values:
        _check_finite(ws, allow_neg_inf, vocab_size)
    return ws


def _check_finite(ws: np.ndarray | torch.Tensor, allow_neg_inf: bool, vocab_size: int) -> None:
    if isinstance(ws, np.ndarray):
        ok = (ws < np.inf) if allow_neg_inf else np.isfinite(ws)  # NaN fails both
    else:
        ok = (ws < float("inf")) if allow_neg_inf else torch.isfinite(ws)
    if not bool(ok.all()):
        where = int(np.flatnonzero(~np.asarray(ok.cpu() if isinstance(ok, torch.Tensor) else ok))[0])
        value = float(ws.reshape(-1)[where])
        allowed = "finite or -inf" if allow_neg_inf else "finite"
        raise ValueError(f"weight of token {where % vocab_size} is {value}: weights must be {allowed}")


class TrieBase(abc.ABC):
    """A token-character trie over ``decode`` (token id ``i`` is ``decode[i]``).

    ``weight_sum(ws)[n]`` is the sum of ``ws[i]`` over the tokens whose bytes start with node ``n``'s
    prefix (for a leaf: its token's weight); ``weight_max`` the max. Results are indexed by node.
    """

    root = 0

    def __init__(self, decode: Sequence[bytes], index: TrieIndex | None = None):
        self.decode = check_vocabulary(decode, "decode")
        self.index = index or TrieIndex.build(self.decode)
        self.num_nodes = self.index.num_nodes
        self.vocab_size = len(self.decode)

    # ---- maps -------------------------------------------------------------------------------

    @property
    def token_id_to_leaf(self) -> np.ndarray:
        """Leaf node of each token id."""
        return self.index.token_leaf

    @cached_property
    def leaf2token_id(self) -> dict[int, int]:
        """Token id of each leaf node."""
        leaves = np.flatnonzero(self.index.node_token >= 0)
        return dict(zip(leaves.tolist(), self.index.node_token[leaves].tolist()))

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """For each node, ``{byte: child}``; a token's leaf hangs under the key :data:`END` (256)."""
        kids: list[dict[int, int]] = [{} for _ in range(self.num_nodes)]
        parent, edge = self.index.parent.tolist(), self.index.edge.tolist()
        for node in range(1, self.num_nodes):
            kids[parent[node]][edge[node]] = node  # duplicate tokens: the last leaf wins here
        return kids

    @cached_property
    def node2prefix(self) -> list[bytes]:
        """The byte prefix of every node (a leaf's prefix is its token's bytes)."""
        prefixes = [b""] * self.num_nodes
        parent, edge = self.index.parent.tolist(), self.index.edge.tolist()
        for node in range(1, self.num_nodes):
            prefixes[node] = prefixes[parent[node]] + (bytes([edge[node]]) if edge[node] != END else b"")
        return prefixes

    def node_of_prefix(self, prefix: bytes | str) -> int | None:
        """The node whose prefix is ``prefix`` (a ``str`` is read as UTF-8), or None when no token
        starts with it."""
        node = self.root
        for b in as_bytes(prefix, "prefix"):
            child = self.children[node].get(b)
            if child is None:
                return None
            node = child
        return node

    # ---- weights ----------------------------------------------------------------------------

    def check_weights(
        self,
        ws: Any,
        allow_neg_inf: bool = False,
        *,
        single: bool = False,
        copy: bool = False,
        check_values: bool = True,
    ) -> np.ndarray | torch.Tensor:
        """:func:`check_weights` against this trie's vocabulary size."""
        return check_weights(ws, self.vocab_size, allow_neg_inf, single=single, copy=copy, check_values=check_values)

    def weight_sum(self, ws: Any) -> np.ndarray:
        """Per-node sum of the token weights ``ws`` (one vector, shape ``(vocab,)``) below each node."""
        return self._reduce(self.check_weights(ws, single=True), "sum")[0]

    def weight_max(self, ws: Any) -> np.ndarray:
        """Per-node max of ``ws`` (one vector) below each node; right for log-space weights (-inf allowed)."""
        return self._reduce(self.check_weights(ws, allow_neg_inf=True, single=True), "max")[0]

    def batch_weight_sum(self, ws: Any) -> np.ndarray:
        """:meth:`weight_sum` for a batch ``(batch, vocab)`` (or a list of vectors)."""
        return self._reduce(self.check_weights(ws), "sum")

    def batch_weight_max(self, ws: Any) -> np.ndarray:
        """:meth:`weight_max` for a batch ``(batch, vocab)`` (or a list of vectors)."""
        return self._reduce(self.check_weights(ws, allow_neg_inf=True), "max")

    def reduce_checked(self, ws: np.ndarray | torch.Tensor, op: str) -> Any:
        """Node values ``[batch, num_nodes]`` of weights already checked by :meth:`check_weights`
        (2-D); ``op`` is "sum" or "max". What :class:`AsyncTokenCharacterTrie` calls per batch."""
        return self._reduce(ws, op)

    @abc.abstractmethod
    def _reduce(self, ws: np.ndarray | torch.Tensor, op: str) -> Any:
        """Node values ``[batch, num_nodes]`` for checked 2-D weights; ``op`` is "sum" or "max"."""

    # ---- display ----------------------------------------------------------------------------

    def visualize(self, ws: Any = None, max_nodes: int = 500) -> Any:
        """A ``graphviz.Digraph`` of the trie, nodes labelled with ``weight_sum(ws)`` when given."""
        try:
            import graphviz
        except ImportError:
            raise ImportError("visualize needs the graphviz package: `pip install graphviz`") from None
        if self.num_nodes > max_nodes:
            raise ValueError(f"trie has {self.num_nodes} nodes, more than max_nodes={max_nodes}")
        values = None if ws is None else np.asarray(self.weight_sum(ws))
        dot = graphviz.Digraph(graph_attr={"rankdir": "LR"}, node_attr={"shape": "box", "fontsize": "10"})
        for node in range(self.num_nodes):
            token = int(self.index.node_token[node])
            label = f"#{node}" if token < 0 else f"token {token}"
            if values is not None:
                label += f"\n{values[node]:.4g}"
            dot.node(str(node), label, shape="box" if token < 0 else "ellipse")
            if node:
                e = int(self.index.edge[node])
                dot.edge(
                    str(int(self.index.parent[node])), str(node), label="EOT" if e == END else repr(bytes([e]))[2:-1]
                )
        return dot
