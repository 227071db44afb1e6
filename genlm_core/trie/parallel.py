"""The torch engine: level-by-level bottom-up reductions, on CPU or CUDA."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm_core.trie.base import TrieBase
from genlm_core.trie.index import TrieIndex


class ParallelTokenCharacterTrie(TrieBase):
    """torch trie engine on ``device`` (default: CUDA if available, else CPU).

    Reduces one depth level at a time, deepest first: each level is one ``index_add_`` (sum) or
    ``index_reduce_`` (max) over the whole batch. Results come back as numpy float arrays (like the
    CPU engine), or as tensors on the device with ``output="torch"``.
    """

    def __init__(
        self,
        decode: Sequence[bytes],
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float64,
        output: str = "numpy",
        index: TrieIndex | None = None,
    ):
        super().__init__(decode, index)
        if output not in ("numpy", "torch"):
            raise ValueError(f"output must be 'numpy' or 'torch', got {output!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.output = output
        depth, parent = self.index.depth, self.index.parent
        order = np.argsort(-depth[1:], kind="stable") + 1  # every non-root node, deepest first
        bounds = np.flatnonzero(np.diff(depth[order])) + 1
        self.levels = [
            (
                torch.as_tensor(nodes, device=self.device),
                torch.as_tensor(parent[nodes].astype(np.int64), device=self.device),
            )
            for nodes in np.split(order.astype(np.int64), bounds)
        ]
        warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta", category=UserWarning)
        self.token_leaf = torch.as_tensor(self.index.token_leaf.astype(np.int64), device=self.device)

    def _reduce(self, ws: np.ndarray | torch.Tensor, op: str) -> Any:
        w = torch.as_tensor(ws).to(device=self.device, dtype=self.dtype)
        fill = float("-inf") if op == "max" else 0.0
        out = torch.full((w.shape[0], self.num_nodes), fill, dtype=self.dtype, device=self.device)
        out[:, self.token_leaf] = w
        for nodes, parents in self.levels:
            if op == "max":
                out.index_reduce_(1, parents, out[:, nodes], "amax", include_self=True)
            else:
                out.index_add_(1, parents, out[:, nodes])
        return out if self.output == "torch" else out.cpu().numpy()
