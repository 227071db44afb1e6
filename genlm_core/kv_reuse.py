"""Automatic KV reuse, framework-agnostic: which states to reuse and how a batch is laid out.

A backend that keeps KV states (transformers, MLX, ...) mixes in :class:`KVReuse` and implements
one tensor operation, :meth:`KVReuse.forward_new`: lay out the batch's cached prefixes, run the new
tokens, return last-position logits and the new block.

Layout of one batch: each row's cached prefix comes from some earlier *block* (the KV states one
forward pass produced, with a mask of which positions hold real tokens). Blocks are right-aligned
in a past of ``past_length`` positions; new tokens are left-padded to ``width`` so every row ends
at the last position. Real positions are explicit and a mask hides every pad, so holes are harmless
to the result; they cost time, and they pile up when blocks are extended again and again (a byte
beam's prefill), so a backend squeezes them out when :meth:`BatchPlan.worth_compacting` says so.
Two layouts serve a byte beam's batches, for backends that set ``packs_shared_tokens``: sequences that
share new tokens after one cached prefix are packed into one tree-masked row (:func:`pack_shared`), and
sequences whose cached prefixes are mostly the same tokens run as one row over a merged past that holds
each distinct prefix token once (:func:`plan_merged`).
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
    position holds a real token of the row (pads and holes are False). ``host_mask`` is the same mask
    as a numpy array, for backends that lay out pasts from it (those that pack shared tokens)."""

    __slots__ = ("host_mask", "kv", "mask", "nbytes")

    def __init__(self, kv: list[tuple[Any, Any]], mask: Any, host_mask: np.ndarray | None = None):
        self.kv = kv
        self.mask = mask
        self.host_mask = host_mask
        self.nbytes = int(sum(k.nbytes + v.nbytes for k, v in kv) + mask.nbytes)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


#: Where a cached sequence's states are: ``(block, row)`` when they are every real position of that
#: row, or ``(block, row, columns)`` when the row is packed with other sequences and only ``columns``
#: (ascending) are this sequence's.
Entry = tuple[Any, ...]


@dataclass
class KVRow:
    """One row of the batch: ``ids[:done]`` have states in ``entry``, the rest are new.

    A *packed* row holds several sequences that share ``ids[:done]`` and more: its new tokens are a
    tree, ``tree = (tokens, parents)`` with ``parents[j]`` the index of token ``j``'s parent among
    ``tokens`` (-1: the cached prefix), parents first. ``ids`` is then the shared prefix alone.
    """

    ids: tuple[int, ...]
    done: int = 0
    entry: Entry | None = None
    tree: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def new(self) -> tuple[int, ...]:
        """The tokens this row runs through the model."""
        return self.tree[0] if self.tree is not None else self.ids[self.done :]

    def ancestors(self, j: int) -> list[int]:
        """Indices among :attr:`new` of token ``j`` and the new tokens before it in its sequence."""
        if self.tree is None:
            return list(range(j + 1))
        chain = []
        while j >= 0:
            chain.append(j)
            j = self.tree[1][j]
        return chain[::-1]


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
    #: per batch row: the columns of its source row that are its past (None: all real ones)
    columns: list[np.ndarray | None] = field(default_factory=list)
    #: (batch row, column) of every logits row wanted, in order; default: each row's last column
    outputs: list[tuple[int, int]] = field(default_factory=list)
    #: bool [batch, width, width]: which new tokens each new token sees (packed rows); None: causal
    tree: np.ndarray | None = None
    #: every row's past merged into one (the batch is then one row): see :func:`plan_merged`
    merged: MergedPast | None = None

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def reuses_whole_block(self) -> Any | None:
        """The block whose rows are exactly this batch's pasts, in order (its states need no copy)."""
        if len(self.groups) == 1 and all(c is None for c in self.columns):
            block, dst, src = self.groups[0]
            if len(dst) == len(self.rows) and src == list(range(len(src))) and block.rows == len(src):
                return block
        return None

    @property
    def real_past_length(self) -> int:
        """The longest cached prefix among the rows: the past's length with every hole squeezed out."""
        return max((r.done for r in self.rows if r.entry is not None), default=0)

    def worth_compacting(self) -> bool:
        """Whether holes (pads of earlier batches) are over a quarter of the past: then copying the
        rows' real positions into a dense past costs less than attending over the holes again."""
        holes = self.past_length - self.real_past_length
        return holes > max(8, self.past_length // 4)


def lay_tree(sees: np.ndarray, positions: np.ndarray, start: int, parents: Sequence[int], done: int) -> None:
    """Write a token tree laid out from column ``start``: ``sees[start + j]`` marks token ``j`` and its
    ancestors, ``positions[start + j]`` its depth after ``done`` cached tokens (``parents`` as in
    :attr:`KVRow.tree`, parents first)."""
    for j, parent in enumerate(parents):
        if parent >= 0:
            sees[start + j] = sees[start + parent]
            positions[start + j] = positions[start + parent] + 1
        else:
            positions[start + j] = done
        sees[start + j, start + j] = True


def plan_batch(rows: list[KVRow], outputs: list[tuple[int, int]] | None = None) -> BatchPlan:
    """Lay out ``rows`` (each with at least one new token) as one batch. ``outputs``: ``(row, j)``
    for each logits row wanted, ``j`` indexing the row's new tokens (default: each row's last)."""
    width = max(len(r.new) for r in rows)
    n = len(rows)
    input_ids = np.zeros((n, width), np.int64)
    new_mask = np.zeros((n, width), bool)
    positions = np.zeros((n, width), np.int64)
    tree = np.zeros((n, width, width), bool) if any(r.tree is not None for r in rows) else None
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    columns: list[np.ndarray | None] = []
    for b, r in enumerate(rows):
        new = r.new
        start = width - len(new)
        input_ids[b, start:] = new
        new_mask[b, start:] = True
        if r.tree is None:
            positions[b, start:] = np.arange(r.done, r.done + len(new))
            if tree is not None:
                tree[b, start:, start:] = np.tri(len(new), dtype=bool)
        else:
            assert tree is not None
            lay_tree(tree[b], positions[b], start, r.tree[1], r.done)
        if tree is not None:
            tree[b, np.arange(start), np.arange(start)] = True  # a pad sees itself: no query sees nothing
        columns.append(r.entry[2] if r.entry is not None and len(r.entry) > 2 else None)
        if r.entry is not None:
            block, src = r.entry[0], r.entry[1]
            _, dst_rows, src_rows = groups.setdefault(id(block), (block, [], []))
            dst_rows.append(b)
            src_rows.append(src)
    past = max((block.length for block, _, _ in groups.values()), default=0)
    wanted = outputs if outputs is not None else [(b, len(r.new) - 1) for b, r in enumerate(rows)]
    at = [(b, width - len(rows[b].new) + j) for b, j in wanted]
    return BatchPlan(rows, input_ids, new_mask, positions, list(groups.values()), past, columns, at, tree)


def pack_shared(rows: list[KVRow], limit: int) -> tuple[list[KVRow], list[tuple[int, int]]]:
    """Rows for ``rows``' sequences in which each token shared by sequences with the same cached
    prefix runs once: such sequences become one packed row when that saves tokens and the tree has
    at most ``limit`` tokens. Returns the rows and, per sequence, ``(row, j)`` of its last token."""
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        key = None if r.entry is None else (id(r.entry[0]), r.entry[1], id(r.entry[2]) if len(r.entry) > 2 else None)
        groups.setdefault(key, []).append(i)
    out: list[KVRow] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(rows)
    for members in groups.values():
        nodes: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        last = []
        for i in members:
            node = -1
            for token in rows[i].new:
                edge = (node, token)
                if edge not in nodes:
                    nodes[edge] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = nodes[edge]
            last.append(node)
        if len(members) > 1 and len(tokens) < sum(len(rows[i].new) for i in members) and len(tokens) <= limit:
            first = rows[members[0]]
            tree = (tuple(tokens), tuple(parents))
            out.append(KVRow(first.ids[: first.done], first.done, first.entry, tree))
            for i, node in zip(members, last):
                where[i] = (len(out) - 1, node)
        else:
            for i in members:
                out.append(rows[i])
                where[i] = (len(out) - 1, len(rows[i].new) - 1)
    return out, where


@dataclass
class MergedPast:
    """The cached prefixes of several sequences as one past, each distinct prefix once.

    A byte beam's sequences share all but their last few tokens: run as separate rows, each would
    copy and attend over its own copy of the shared prefix. Merged, the batch is one row whose past
    holds every distinct prefix token once, and a mask lets each new token see only its own
    sequence's prefix. ``sources``: ``(block, row, columns of that row, positions in the merged
    past)``; ``seen``: bool ``[width, length]``, the merged positions each new token attends to;
    ``prefixes[i]``: input row ``i``'s prefix as merged positions, in order.
    """

    length: int
    sources: list[tuple[Any, int, np.ndarray, np.ndarray]]
    seen: np.ndarray
    prefixes: list[np.ndarray]
    offsets: list[int]  #: where input row ``i``'s new tokens start in the merged row


#: What one token of a batch costs (its weight reads and matrix products), in attention (query, key)
#: pairs: about 4,000 for a 135M-parameter model, more for larger ones (a conservative constant).
TOKEN_COST = 4000
#: What copying one past position of one row costs (every layer's keys and values), in attention pairs.
COPY_COST = 8


def plan_merged(rows: list[KVRow], outputs: list[tuple[int, int]] | None = None) -> BatchPlan | None:
    """``rows`` as one row over their merged past (:class:`MergedPast`) when that costs clearly less
    than the padded layout of :func:`plan_batch` (no pads run; attention spans every sequence's
    prefix), counting tokens at :data:`TOKEN_COST` attention pairs; else None. Needs blocks with a
    ``host_mask``. ``outputs`` as in :func:`plan_batch`."""
    width = sum(len(r.new) for r in rows)
    longest, past = max(len(r.new) for r in rows), max(r.done for r in rows)
    padded_cost = len(rows) * longest * (TOKEN_COST + past + longest)
    entries = [r.entry for r in rows if r.entry is not None]
    if not (len(entries) == len(rows) and all(len(e) == 2 and e[0] is entries[0][0] for e in entries)):
        padded_cost += COPY_COST * len(rows) * past  # the padded layout gathers each row's past

    def worth_it(length: int) -> bool:
        return width * (TOKEN_COST + length + width) + COPY_COST * length < padded_cost

    if not worth_it(past):  # the merged past is at least the longest prefix
        return None
    nodes: dict[tuple[int, int], int] = {}
    by_source: dict[tuple[int, int], tuple[Any, int, list[int], list[int]]] = {}
    prefixes = []
    for r in rows:
        path: list[int] = []
        if r.entry is not None and r.done:
            block, row = r.entry[0], r.entry[1]
            columns = r.entry[2] if len(r.entry) > 2 else np.flatnonzero(block.host_mask[row])
            if len(columns) != r.done:
                return None
            _, _, cols, at = by_source.setdefault((id(block), row), (block, row, [], []))
            node = -1
            for k in range(r.done):
                key = (node, r.ids[k])
                position = nodes.get(key)
                if position is None:
                    position = nodes[key] = len(nodes)
                    cols.append(int(columns[k]))
                    at.append(position)
                path.append(position)
                node = position
        prefixes.append(np.asarray(path, np.int64))
    length = len(nodes)
    if not worth_it(length):
        return None
    input_ids = np.zeros((1, width), np.int64)
    positions = np.zeros((1, width), np.int64)
    tree = np.zeros((1, width, width), bool)
    seen = np.zeros((width, length), bool)
    offsets = []
    at_token = 0
    for r, prefix in zip(rows, prefixes):
        offsets.append(at_token)
        new = r.new
        input_ids[0, at_token : at_token + len(new)] = new
        parents = r.tree[1] if r.tree is not None else tuple(range(-1, len(new) - 1))
        lay_tree(tree[0], positions[0], at_token, parents, r.done)
        seen[at_token : at_token + len(new), prefix] = True
        at_token += len(new)
    sources = [
        (block, row, np.asarray(c, np.int64), np.asarray(a, np.int64))
        for block, row, c, a in by_source.values()
        if a  # a row whose prefix is all in earlier rows' adds nothing
    ]
    wanted = outputs if outputs is not None else [(b, len(r.new) - 1) for b, r in enumerate(rows)]
    merged = MergedPast(length, sources, seen, prefixes, offsets)
    return BatchPlan(
        rows,
        input_ids,
        np.ones((1, width), bool),
        positions,
        outputs=[(0, offsets[b] + j) for b, j in wanted],
        tree=tree,
        merged=merged,
    )


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

    #: Whether :meth:`forward_new` runs packed rows (``plan.tree``) and its blocks carry ``host_mask``;
    #: a backend that can sets it, and shared new tokens (a byte beam's lookahead) then run once.
    packs_shared_tokens: bool = False

    @abc.abstractmethod
    def forward_new(self, plan: BatchPlan) -> tuple[Any, Any]:
        """Run ``plan``'s new tokens after its past; return the logits at ``plan.outputs``
        ``[len(outputs), vocab]`` (without packed rows: each row's last position, in order) and the
        new block holding every row's states."""

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
        if self.packs_shared_tokens and len(rows) > 1:
            packed, where = pack_shared(rows, chunk)
            if sum(len(r.new) for r in packed) <= chunk and (plan := plan_merged(packed, where)) is not None:
                return self._run(packed, namespace, list(sequences), where, plan)[0]
            if len(packed) < len(rows):
                return self._run(packed, namespace, list(sequences), where)[0]
        return self._run(rows, namespace)[0]

    def _run(
        self,
        rows: list[KVRow],
        namespace: Any,
        sequences: list[tuple[int, ...]] | None = None,
        where: list[tuple[int, int]] | None = None,
        plan: BatchPlan | None = None,
    ) -> tuple[Any, list[Entry]]:
        """One forward pass (of ``plan``, default: :func:`plan_batch` of the rows); stores and returns
        the entry of each sequence. Without ``sequences``, each row is one sequence (its last token);
        else ``where[i]`` is ``(row, j)`` of sequence ``i``'s last."""
        plan = plan if plan is not None else plan_batch(rows, where)
        self.forward_calls += 1
        self.tokens_computed += int(plan.new_mask.sum())
        logits, block = self.forward_new(plan)
        if sequences is None or where is None:
            entries: list[Entry] = [(block, b) for b in range(len(rows))]
            sequences = [r.ids for r in rows]
        else:
            entries = [self._entry(plan, block, b, j) for b, j in where]
        if self.reuse_kv:
            for ids, entry in zip(sequences, entries):
                self.kv.put(namespace, ids, entry, block, block.nbytes)
        return logits, entries

    @staticmethod
    def _entry(plan: BatchPlan, block: KVBlock, b: int, j: int) -> Entry:
        """Where the sequence ending at new token ``j`` of row ``b`` lives in ``block``."""
        row = plan.rows[b]
        if plan.merged is not None:
            m = plan.merged
            own = np.asarray(row.ancestors(j)) + m.length + m.offsets[b]
            return (block, 0, np.concatenate([m.prefixes[b], own]))
        if row.tree is None:
            return (block, b)
        assert block.host_mask is not None, "a backend that packs rows gives its blocks a host_mask"
        past = block.length - plan.width
        first = block.length - len(row.new)
        own = np.asarray(row.ancestors(j)) + first
        return (block, b, np.concatenate([np.flatnonzero(block.host_mask[b, :past]), own]))
