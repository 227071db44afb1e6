"""Automatic KV reuse, framework-agnostic: which states to reuse, how a batch is laid out, and the
forward step that runs it, written once for every backend that keeps KV states (hf, mlx).

A backend mixes in :class:`KVReuse`, calls :meth:`KVReuse.kv_forward_batch` from its
``forward_batch``, and implements two tensor operations, with host (numpy) index arrays in:

- :meth:`KVReuse.gather_kv`: copy stored keys and values into a new past, by a :class:`Gather`;
- :meth:`KVReuse.run_step`: run a :class:`Step` (new tokens after a past, under a mask) and return
  the logits wanted and every layer's keys and values;

and, with LoRA adapters, :meth:`KVReuse.adapter_context`. Everything else is here: grouping requests
by adapter, prefix-cache lookups, chunked prefill, the layout, the gather index, the masks, what is
stored, and the counters (``forward_calls``, ``tokens_computed``).

Layout of one batch: each row's cached prefix comes from some earlier *block* (the KV states one
forward pass produced, with a mask of which positions hold real tokens). New tokens are left-padded
to ``width`` so every row ends at the last position, with their real positions explicit. The past is
either a stored block as it is (when the batch is exactly its rows, in order: no copy), or each row's
real positions gathered and right-aligned, with room after them for the new tokens. A mask hides every
pad and hole, so holes are harmless to the result; they cost time and pile up when blocks are extended
again and again (a byte beam's prefill), so a block is reused as it is only while holes are at most a
quarter of it. Two layouts serve a byte beam's batches, for backends that set ``packs_shared_tokens``:
sequences that share new tokens after one cached prefix are packed into one tree-masked row
(:func:`pack_shared`), and sequences whose cached prefixes are mostly the same tokens run as one row
over a merged past that holds each distinct prefix token once (:func:`plan_merged`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from genlm_core.config import KVReuseOptions  # defined there: options import no torch
from genlm_core.prefix_cache import PrefixCache
from genlm_core.request import Request

#: Per layer ``(keys, values)``, each ``[rows, heads, positions, head_dim]`` (torch, MLX, ...).
KV = list[tuple[Any, Any]]


class KVBlock:
    """The KV states one forward pass produced: ``kv`` (per layer, ``[rows, heads, length, head_dim]``)
    and ``mask``, a numpy bool ``[rows, length]`` on the host: whether a position holds a real token of
    the row (pads and holes are False)."""

    __slots__ = ("kv", "mask", "nbytes")

    def __init__(self, kv: KV, mask: np.ndarray):
        self.kv = kv
        self.mask = mask
        self.nbytes = int(sum(k.nbytes + v.nbytes for k, v in kv) + mask.nbytes)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


@dataclass(frozen=True, eq=False)
class Entry:
    """Where one cached sequence's states are: row ``row`` of ``block``, at every real position of the
    row, or, when the row is packed with other sequences, at ``columns`` only (ascending)."""

    block: KVBlock
    row: int
    columns: np.ndarray | None = None

    def positions(self) -> np.ndarray:
        """The block's columns holding this sequence's states, in order."""
        return self.columns if self.columns is not None else np.flatnonzero(self.block.mask[self.row])


class TokenTree(NamedTuple):
    """New tokens shared by several sequences: ``parents[j]`` is the index of token ``j``'s parent
    among ``tokens`` (-1: the cached prefix), parents first."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]


@dataclass
class KVRow:
    """One row of the batch: ``ids[:done]`` have states in ``entry``, the rest are new.

    A *packed* row holds several sequences that share ``ids[:done]``: its new tokens are ``tree``, and
    ``ids`` is the shared prefix alone.
    """

    ids: Sequence[int]
    done: int = 0
    entry: Entry | None = None
    tree: TokenTree | None = None

    @property
    def new(self) -> tuple[int, ...]:
        """The tokens this row runs through the model."""
        return self.tree.tokens if self.tree is not None else tuple(self.ids[self.done :])

    def ancestors(self, j: int) -> list[int]:
        """Indices among :attr:`new` of token ``j`` and the new tokens before it in its sequence."""
        if self.tree is None:
            return list(range(j + 1))
        chain = []
        while j >= 0:
            chain.append(j)
            j = self.tree.parents[j]
        return chain[::-1]


@dataclass(frozen=True, eq=False)
class GatherPart:
    """Stored states copied into the past: ``past[into[i], :, at + j] = block.kv[rows[i], :, columns[i, j]]``
    in every layer (``i`` over ``rows``, ``j`` over ``columns.shape[1]``)."""

    block: KVBlock
    rows: np.ndarray  #: int64 ``[k]``, rows of ``block``
    into: np.ndarray  #: int64 ``[k]``, rows of the past
    columns: np.ndarray  #: int64 ``[k, m]``, columns of ``block``
    at: int = 0  #: the first position of the past written


@dataclass(frozen=True, eq=False)
class Gather:
    """How a batch's past is copied from stored states: ``rows`` x ``length + room`` positions, written
    by ``parts``. The ``room`` positions after the past are for the new tokens' states (they need not be
    written: the step writes them before reading). Other positions no part writes must be zeros (they
    are masked; any finite value would do, but never NaN); when ``complete``, parts write them all."""

    rows: int
    length: int
    room: int
    parts: list[GatherPart]
    complete: bool

    def whole(self) -> GatherPart | None:
        """The one part that writes the whole past (room included), row by row in order: its copy *is*
        the past."""
        if len(self.parts) != 1:
            return None
        part = self.parts[0]
        full = part.at == 0 and part.columns.shape[1] == self.length + self.room
        return part if full and np.array_equal(part.into, np.arange(self.rows)) else None


@dataclass(frozen=True, eq=False)
class Past:
    """A batch's past: none (``length`` 0), a stored block as it is (``block``), or a ``gather``."""

    mask: np.ndarray  #: bool ``[rows, length]``: which past positions are real tokens
    block: KVBlock | None = None
    gather: Gather | None = None
    #: bool ``[width, length]``, for a merged past (one row): which past positions each new token sees;
    #: None: each token sees its row's real positions
    seen: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


@dataclass(frozen=True, eq=False)
class Step:
    """One forward pass, as a backend's :meth:`KVReuse.run_step` runs it. Index arrays are numpy, on the
    host; the backend moves them where its model runs."""

    input_ids: np.ndarray  #: int64 ``[rows, width]``, left-padded with 0
    positions: np.ndarray  #: int64 ``[rows, width]``: each new token's position in its sequence (0 on pads)
    past: KV | None  #: ``[rows, heads, >= past_length, head_dim]`` per layer; None: no past
    past_length: int  #: how many positions of ``past`` are the past
    #: the new tokens' states are written into ``past`` right after ``past_length`` (it was gathered
    #: with room for them); else ``past`` is a stored block, never written: they are appended to a copy
    room: bool
    keys: np.ndarray  #: bool ``[rows, past_length + width]``: real tokens (pads and holes False); the new block's mask
    #: bool ``[rows, width, past_length + width]``: which keys each new token attends to (packed rows,
    #: merged pasts); None: causal attention over ``keys``
    sees: np.ndarray | None
    outputs: list[tuple[int, int]]  #: ``(row, column)`` of each logits row wanted, in order

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def plain(self) -> bool:
        """Whether this step is a plain decode or prefill: every key a real token (no pad, no hole),
        causal attention, each row's new tokens at positions ``past_length, past_length + 1, ...``. A
        model given no mask and no positions assumes exactly this (HF's own decode step), so a backend
        may leave both out (an SMC step: every particle one token after a past of the same length)."""
        if self.sees is not None:
            return False
        positions = np.arange(self.past_length, self.past_length + self.width)
        return bool((self.positions == positions).all() and self.keys.all())

    def outputs_last_in_order(self) -> bool:
        """Whether the logits wanted are each row's last position, row by row in order (the model's
        last-position logits as they are, with no index)."""
        last = self.width - 1
        return len(self.outputs) == len(self.input_ids) and all(
            b == i and c == last for i, (b, c) in enumerate(self.outputs)
        )

    def attention(self) -> np.ndarray:
        """``sees``, or the causal mask over ``keys``, as one bool ``[rows, width, past_length + width]``;
        a pad sees itself (a query that sees nothing would give NaN)."""
        if self.sees is not None:
            return self.sees
        width, past = self.width, self.past_length
        allowed = np.concatenate([np.ones((width, past), bool), np.tri(width, dtype=bool)], axis=1)
        itself = np.concatenate([np.zeros((width, past), bool), np.eye(width, dtype=bool)], axis=1)
        return (allowed[None] & self.keys[:, None, :]) | itself[None]


@dataclass(eq=False)
class BatchPlan:
    """Everything one forward pass over the rows' new tokens needs, on the host."""

    rows: list[KVRow]
    input_ids: np.ndarray  #: int64 ``[batch, width]``, left-padded with 0
    new_mask: np.ndarray  #: bool ``[batch, width]``, True on real tokens
    positions: np.ndarray  #: int64 ``[batch, width]``, real position of every new token (0 on pads)
    past: Past
    #: ``(batch row, column)`` of every logits row wanted, in order
    outputs: list[tuple[int, int]]
    #: bool ``[batch, width, width]``: which new tokens each new token sees (packed rows); None: causal
    tree: np.ndarray | None = None
    #: every row's past merged into one (the batch is then one row): see :func:`plan_merged`
    merged: MergedPast | None = None

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def real_past_length(self) -> int:
        """The longest cached prefix among the rows: the past's length with every hole squeezed out."""
        return max((r.done for r in self.rows if r.entry is not None), default=0)

    def step(self, past: KV | None) -> Step:
        """The :class:`Step` that runs this plan over ``past``: the states :attr:`past` names."""
        p = self.past
        keys = np.concatenate([p.mask, self.new_mask], axis=1)
        sees = None
        if self.tree is not None:  # each new token sees its row's past (or its own prefix) and its ancestors
            n, width = self.input_ids.shape
            seen = p.seen[None] if p.seen is not None else np.broadcast_to(p.mask[:, None, :], (n, width, p.length))
            sees = np.concatenate([seen, self.tree], axis=2)
        return Step(self.input_ids, self.positions, past, p.length, p.gather is not None, keys, sees, self.outputs)


def lay_tree(sees: np.ndarray, positions: np.ndarray, start: int, parents: Sequence[int], done: int) -> None:
    """Write a token tree laid out from column ``start``: ``sees[start + j]`` marks token ``j`` and its
    ancestors, ``positions[start + j]`` its depth after ``done`` cached tokens (``parents`` as in
    :class:`TokenTree`)."""
    for j, parent in enumerate(parents):
        if parent >= 0:
            sees[start + j] = sees[start + parent]
            positions[start + j] = positions[start + parent] + 1
        else:
            positions[start + j] = done
        sees[start + j, start + j] = True


def lay_past(rows: list[KVRow], width: int) -> Past:
    """The past of a padded batch: the one block whose rows are the batch's, in order, as it is (unless
    holes, pads of earlier batches, are over a quarter of it: then copying costs less than attending over
    them again); else each row's cached positions gathered, right-aligned, with room for ``width`` new
    tokens after them. In the gather index, a row's pads and room repeat its first column (any column
    would do: pads are masked, room is overwritten), so each block's rows are one copy per layer."""
    n = len(rows)
    cached = [(b, r.entry) for b, r in enumerate(rows) if r.entry is not None]
    if not cached:
        return Past(np.zeros((n, 0), bool))
    block = cached[0][1].block
    length = max(r.done for r in rows if r.entry is not None)
    if len(cached) == n == block.rows and all(e.block is block and e.row == b and e.columns is None for b, e in cached):
        if block.length - length <= max(8, block.length // 4):
            return Past(block.mask, block=block)
    mask = np.zeros((n, length), bool)
    by_block: dict[int, tuple[KVBlock, list[int], list[int], list[np.ndarray]]] = {}
    for b, entry in cached:
        columns = entry.positions()
        index = np.full(length + width, columns[0], np.int64)
        index[length - len(columns) : length] = columns
        mask[b, length - len(columns) :] = True
        _, into, src, index_rows = by_block.setdefault(id(entry.block), (entry.block, [], [], []))
        into.append(b)
        src.append(entry.row)
        index_rows.append(index)
    parts = [
        GatherPart(blk, np.asarray(src, np.int64), np.asarray(into, np.int64), np.stack(index))
        for blk, into, src, index in by_block.values()
    ]
    return Past(mask, gather=Gather(n, length, width, parts, complete=len(cached) == n))


def plan_batch(rows: list[KVRow], outputs: list[tuple[int, int]] | None = None) -> BatchPlan:
    """Lay out ``rows`` (each with at least one new token) as one batch. ``outputs``: ``(row, j)``
    for each logits row wanted, ``j`` indexing the row's new tokens (default: each row's last)."""
    width = max(len(r.new) for r in rows)
    n = len(rows)
    input_ids = np.zeros((n, width), np.int64)
    new_mask = np.zeros((n, width), bool)
    positions = np.zeros((n, width), np.int64)
    tree = np.zeros((n, width, width), bool) if any(r.tree is not None for r in rows) else None
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
            lay_tree(tree[b], positions[b], start, r.tree.parents, r.done)
        if tree is not None:
            tree[b, np.arange(start), np.arange(start)] = True  # a pad sees itself: no query sees nothing
    wanted = outputs if outputs is not None else [(b, len(r.new) - 1) for b, r in enumerate(rows)]
    at = [(b, width - len(rows[b].new) + j) for b, j in wanted]
    return BatchPlan(rows, input_ids, new_mask, positions, lay_past(rows, width), at, tree)


def pack_shared(rows: list[KVRow], limit: int) -> tuple[list[KVRow], list[tuple[int, int]]]:
    """Rows for ``rows``' sequences in which each token shared by sequences with the same cached
    prefix runs once: such sequences become one packed row when that saves tokens and the tree has
    at most ``limit`` tokens. Returns the rows and, per sequence, ``(row, j)`` of its last token."""
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        e = r.entry
        key = None if e is None else (id(e.block), e.row, None if e.columns is None else id(e.columns))
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
            out.append(
                KVRow(first.ids[: first.done], first.done, first.entry, TokenTree(tuple(tokens), tuple(parents)))
            )
            for i, node in zip(members, last):
                where[i] = (len(out) - 1, node)
        else:
            for i in members:
                out.append(rows[i])
                where[i] = (len(out) - 1, len(rows[i].new) - 1)
    return out, where


@dataclass(frozen=True, eq=False)
class MergedPast:
    """The cached prefixes of several sequences as one past, each distinct prefix token once.

    A byte beam's sequences share all but their last few tokens: run as separate rows, each would
    copy and attend over its own copy of the shared prefix. Merged, the batch is one row whose past
    holds every distinct prefix token once (gathered by the plan's :class:`Gather`), and a mask lets
    each new token see only its own sequence's prefix. ``prefixes[i]``: input row ``i``'s prefix as
    merged positions, in order.
    """

    length: int
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
    prefix), counting tokens at :data:`TOKEN_COST` attention pairs; else None. ``outputs`` as in
    :func:`plan_batch`."""
    width = sum(len(r.new) for r in rows)
    longest, past = max(len(r.new) for r in rows), max(r.done for r in rows)
    padded_cost = len(rows) * longest * (TOKEN_COST + past + longest)
    entries = [r.entry for r in rows if r.entry is not None]
    if not (len(entries) == len(rows) and all(e.columns is None and e.block is entries[0].block for e in entries)):
        padded_cost += COPY_COST * len(rows) * past  # the padded layout gathers each row's past

    def worth_it(length: int) -> bool:
        return width * (TOKEN_COST + length + width) + COPY_COST * length < padded_cost

    if not worth_it(past):  # the merged past is at least the longest prefix
        return None
    nodes: dict[tuple[int, int], int] = {}
    by_source: dict[tuple[int, int], tuple[Entry, list[int], list[int]]] = {}
    prefixes = []
    for r in rows:
        path: list[int] = []
        if r.entry is not None and r.done:
            columns = r.entry.positions()
            if len(columns) != r.done:
                return None
            _, cols, at = by_source.setdefault((id(r.entry.block), r.entry.row), (r.entry, [], []))
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
        parents = r.tree.parents if r.tree is not None else tuple(range(-1, len(new) - 1))
        lay_tree(tree[0], positions[0], at_token, parents, r.done)
        seen[at_token : at_token + len(new), prefix] = True
        at_token += len(new)
    parts = []  # each source row's columns, one part per run of consecutive merged positions
    for entry, cols, at in by_source.values():
        if not at:  # a row whose prefix is all in earlier rows' adds nothing
            continue
        breaks = np.flatnonzero(np.diff(at) != 1) + 1
        for lo, hi in zip([0, *breaks], [*breaks, len(at)]):
            one = np.asarray([entry.row], np.int64)
            parts.append(
                GatherPart(entry.block, one, np.zeros(1, np.int64), np.asarray([cols[lo:hi]], np.int64), at[lo])
            )
    wanted = outputs if outputs is not None else [(b, len(r.new) - 1) for b, r in enumerate(rows)]
    gather = Gather(1, length, width, parts, complete=True) if length else None
    return BatchPlan(
        rows,
        input_ids,
        np.ones((1, width), bool),
        positions,
        Past(np.ones((1, length), bool), gather=gather, seen=seen),
        [(0, offsets[b] + j) for b, j in wanted],
        tree,
        MergedPast(length, prefixes, offsets),
    )


class KVReuse(abc.ABC):
    """Mixin: next-token logits for token sequences, computing only what no cached prefix covers.

    What a backend implements: :meth:`gather_kv` and :meth:`run_step` (and :meth:`adapter_context` with
    LoRA adapters, :attr:`packs_shared_tokens` if its steps take any mask); it calls
    :meth:`init_kv_reuse` when built and :meth:`kv_forward_batch` from ``forward_batch``.
    """

    kv: PrefixCache[Entry]
    reuse_kv: bool
    prefill_chunk_size: int
    forward_calls: int
    tokens_computed: int

    #: Whether :meth:`run_step` takes ``sees`` masks (packed rows, merged pasts) and outputs at any
    #: column; a backend that can sets it, and shared new tokens (a byte beam's lookahead) then run once.
    packs_shared_tokens: bool = False

    def init_kv_reuse(self, options: KVReuseOptions, reuse: bool | None = None) -> None:
        """Set up the KV cache from ``options``; ``reuse`` overrides ``options.reuse_kv`` (a backend
        turns reuse off for models whose cache cannot be extended)."""
        self.kv = PrefixCache(options.kv_cache_entries, options.kv_cache_bytes)
        self.reuse_kv = options.reuse_kv if reuse is None else reuse
        self.prefill_chunk_size = options.prefill_chunk_size
        self.forward_calls = 0  # forward passes run
        self.tokens_computed = 0  # real (non-pad) tokens those passes computed

    # ---- what a backend implements -------------------------------------------------------------

    @abc.abstractmethod
    def gather_kv(self, gather: Gather) -> KV:
        """The past ``gather`` describes: per layer, keys and values
        ``[gather.rows, heads, gather.length + gather.room, head_dim]``."""

    @abc.abstractmethod
    def run_step(self, step: Step) -> tuple[torch.Tensor, KV]:
        """Run ``step``'s new tokens after its past; return the logits at ``step.outputs``
        (``[len(outputs), vocab]``, any float dtype and device) and, per layer, the keys and values of
        the past and the new tokens (``[rows, heads, past_length + width, head_dim]``)."""

    def adapter_context(self, adapter: str | None) -> AbstractContextManager[Any]:
        """A context in which the model runs LoRA adapter ``adapter`` (None: the base model)."""
        return contextlib.nullcontext()

    # ---- the forward step, written once ---------------------------------------------------------

    def clear_backend_cache(self) -> None:
        """Forget every stored KV state (AsyncLM.clear_cache and cleanup call this)."""
        self.kv.clear()

    def kv_forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        """Logits ``[len(requests), W]`` for ``forward_batch``: each adapter's requests run under
        :meth:`adapter_context`, their states kept apart under that adapter's name."""
        by_adapter: dict[str | None, list[int]] = {}
        for i, r in enumerate(requests):
            by_adapter.setdefault(r.adapter, []).append(i)
        out: torch.Tensor | None = None
        for adapter, rows in by_adapter.items():
            with self.adapter_context(adapter):
                logits = self.kv_logits([requests[i].context for i in rows], adapter)
            if len(by_adapter) == 1:  # the logits as the model computed them: core normalises them in one pass
                return logits
            if out is None:
                out = logits.new_empty(len(requests), logits.shape[-1], dtype=torch.float32)
            out[rows] = logits.float()
        assert out is not None
        return out

    def kv_logits(self, sequences: Sequence[Sequence[int]], namespace: Any = None) -> torch.Tensor:
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

    def forward_new(self, plan: BatchPlan) -> tuple[torch.Tensor, KVBlock]:
        """Run ``plan``: its past gathered (or a stored block as it is), then its step; the logits at
        ``plan.outputs`` and the new block."""
        p = plan.past
        past = p.block.kv if p.block is not None else self.gather_kv(p.gather) if p.gather is not None else None
        step = plan.step(past)
        logits, kv = self.run_step(step)
        return logits, KVBlock(kv, step.keys)

    def _run(
        self,
        rows: list[KVRow],
        namespace: Any,
        sequences: list[Sequence[int]] | None = None,
        where: list[tuple[int, int]] | None = None,
        plan: BatchPlan | None = None,
    ) -> tuple[torch.Tensor, list[Entry]]:
        """One forward pass (of ``plan``, default: :func:`plan_batch` of the rows); stores and returns
        the entry of each sequence. Without ``sequences``, each row is one sequence (its last token);
        else ``where[i]`` is ``(row, j)`` of sequence ``i``'s last."""
        plan = plan if plan is not None else plan_batch(rows, where)
        self.forward_calls += 1
        self.tokens_computed += int(plan.new_mask.sum())
        logits, block = self.forward_new(plan)
        if sequences is None or where is None:
            entries = [Entry(block, b) for b in range(len(rows))]
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
            return Entry(block, 0, np.concatenate([m.prefixes[b], own]))
        if row.tree is None:
            return Entry(block, b)
        past = plan.past.length
        own = np.asarray(row.ancestors(j)) + block.length - len(row.new)
        return Entry(block, b, np.concatenate([np.flatnonzero(block.mask[b, :past]), own]))
