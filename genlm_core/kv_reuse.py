"""Automatic KV reuse, framework-agnostic: which states to reuse and how a batch is laid out.

A backend that keeps KV states (transformers, MLX, ...) mixes in :class:`KVReuse` and implements
two tensor operations: :meth:`KVReuse.gather_past` (lay out the batch's cached prefixes) and
:meth:`KVReuse.forward_new` (run the new tokens, return last-position logits and the new block).

Layout of one batch: each row's cached prefix comes from some earlier *block* (the KV states one
forward pass produced, with a mask of which positions hold real tokens). Blocks are right-aligned
in a past of ``past_length`` positions; new tokens are left-padded to ``width`` so every row ends
at the last position. Real positions are explicit and a mask hides every pad, so holes are harmless.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field, PositiveInt

from genlm_core.config import BackendOptions
from genlm_core.prefix_cache import PrefixCache


def default_kv_cache_bytes() -> int:
    """At most 4 GiB, and at most a sixth of this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 2**30
    return int(min(4 * 2**30, total // 6))


class KVReuseOptions(BackendOptions):
    """Options of every backend built on :class:`KVReuse` (the hf and mlx backends inherit them)."""

    kv_cache_bytes: int | None = Field(
        default_factory=default_kv_cache_bytes,
        ge=0,
        description="Most bytes of KV states kept for reuse (None: no limit). Default: min(4 GiB, RAM / 6).",
    )
    kv_cache_entries: PositiveInt = Field(4096, description="Most token sequences whose KV states are kept.")
    reuse_kv: bool = Field(True, description="Reuse KV states of cached prefixes automatically.")
    prefill_chunk_size: PositiveInt = Field(2048, description="Longest stretch of new tokens run in one forward pass.")


class KVBlock:
    """The KV states one forward pass produced: per layer ``(keys, values)`` arrays of shape
    ``[rows, heads, length, head_dim]`` (torch, MLX, ...), and ``mask[row, position]``: whether that
    position holds a real token of the row (pads and holes are False)."""

    __slots__ = ("kv", "mask", "nbytes")

    def __init__(self, kv: list[tuple[Any, Any]], mask: Any):
        self.kv = kv
        self.mask = mask
        self.nbytes = int(sum(k.nbytes + v.nbytes for k, v in kv) + mask.nbytes)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


@dataclass
class KVRow:
    """One sequence of the batch: ``ids[:done]`` have states in ``entry`` (block, row), the rest are new."""

    ids: tuple[int, ...]
    done: int = 0
    entry: tuple[Any, int] | None = None


@dataclass
class BatchPlan:
    """Everything a backend needs to run one forward pass over the rows' new tokens."""

    rows: list[KVRow]
    input_ids: np.ndarray  #: int64 [batch, width], left-padded with 0
    new_mask: np.ndarray  #: bool [batch, width], True on real tokens
    positions: np.ndarray  #: int64 [batch, width], real position of every new token (0 on pads)
    #: source block -> (block, batch rows, rows in that block), in first-use order
    groups: list[tuple[Any, list[int], list[int]]] = field(default_factory=list)
    past_length: int = 0

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def reuses_whole_block(self) -> Any | None:
        """The block whose rows are exactly this batch's rows, in order (its states need no copy)."""
        if len(self.groups) == 1:
            block, dst, src = self.groups[0]
            if len(dst) == len(self.rows) and src == list(range(len(src))) and block.rows == len(src):
                return block
        return None

    def reuses_one_block(self) -> bool:
        """Every row extends a row of the same block (rows may repeat or be reordered)."""
        return len(self.groups) == 1 and len(self.groups[0][1]) == len(self.rows)


def plan_batch(rows: list[KVRow]) -> BatchPlan:
    """Lay out ``rows`` (each with at least one new token) as one batch."""
    width = max(len(r.ids) - r.done for r in rows)
    n = len(rows)
    input_ids = np.zeros((n, width), np.int64)
    new_mask = np.zeros((n, width), bool)
    positions = np.zeros((n, width), np.int64)
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    for b, r in enumerate(rows):
        new = r.ids[r.done :]
        input_ids[b, width - len(new) :] = new
        new_mask[b, width - len(new) :] = True
        positions[b, width - len(new) :] = np.arange(r.done, len(r.ids))
        if r.entry is not None:
            block, src = r.entry
            _, dst_rows, src_rows = groups.setdefault(id(block), (block, [], []))
            dst_rows.append(b)
            src_rows.append(src)
    past = max((block.length for block, _, _ in groups.values()), default=0)
    return BatchPlan(rows, input_ids, new_mask, positions, list(groups.values()), past)


class KVReuse(abc.ABC):
    """Mixin: next-token logits for token sequences, computing only what no cached prefix covers."""

    kv: PrefixCache
    reuse_kv: bool
    prefill_chunk_size: int
    forward_calls: int
    tokens_computed: int

    def init_kv_reuse(self, options: KVReuseOptions, reuse: bool | None = None) -> None:
        """Set up the KV cache from ``options``; ``reuse`` overrides ``options.reuse_kv`` (a backend
        turns reuse off for models whose cache cannot be extended)."""
        self.kv = PrefixCache(options.kv_cache_entries, options.kv_cache_bytes)
        self.reuse_kv = options.reuse_kv if reuse is None else reuse
        self.prefill_chunk_size = options.prefill_chunk_size
        self.forward_calls = 0  # forward passes run
        self.tokens_computed = 0  # real (non-pad) tokens those passes computed

    @abc.abstractmethod
    def forward_new(self, plan: BatchPlan) -> tuple[Any, Any]:
        """Run ``plan``'s new tokens after its past (see :meth:`gather_past`); return the logits at
        the last position ``[batch, width]`` and the new block holding every row's states."""

    def clear_backend_cache(self) -> None:
        """Forget every stored KV state (AsyncLM.clear_cache and cleanup call this)."""
        self.kv.clear()

    def kv_logits(self, sequences: Sequence[tuple[int, ...]], namespace: Any = None) -> Any:
        """Last-position logits for each sequence, reusing and then storing KV states under ``namespace``."""
        rows = []
        for ids in sequences:
            hit = self.kv.longest_prefix(namespace, ids, len(ids) - 1) if self.reuse_kv else None
            rows.append(KVRow(ids, hit.length, hit.value) if hit else KVRow(ids))
        chunk = self.prefill_chunk_size
        while long := [r for r in rows if len(r.ids) - r.done > chunk]:
            entries = self._run([KVRow(r.ids[: r.done + chunk], r.done, r.entry) for r in long], namespace)[1]
            for r, entry in zip(long, entries):
                r.done, r.entry = r.done + chunk, entry
        return self._run(rows, namespace)[0]

    def _run(self, rows: list[KVRow], namespace: Any) -> tuple[Any, list[tuple[Any, int]]]:
        plan = plan_batch(rows)
        self.forward_calls += 1
        self.tokens_computed += int(plan.new_mask.sum())
        logits, block = self.forward_new(plan)
        entries = [(block, b) for b in range(len(rows))]
        if self.reuse_kv:
            for b, r in enumerate(rows):
                self.kv.put(namespace, r.ids, entries[b], block, block.nbytes)
        return logits, entries
