"""Particles that stay alive in llama.cpp: a request that extends a live context by a token costs one token.

Each row's context is kept as a llama.cpp sequence after its batch. Who continues what is decided
by core's :class:`~genlm_core.lineage.LiveContexts` on exact token tuples (the design vLLM's
sessions use): a live sequence is continued in place by at most one request; its other children
(siblings after resampling) fork it first by ``llama_memory_seq_cp``, which with the unified KV
cache only adds the new sequence to the parent's cells. A request that extends no live sequence
starts a free sequence with a copy of the longest prefix it shares with any live sequence (a
particle that went back to an older context, a new prompt after the same system text) and computes
the rest.

Sequences nobody continues stay live, oldest first in line to be removed when a sequence id or
KV room is needed. When the batch itself does not fit in the KV cache, its rows are computed one
at a time (each still continuing or sharing what is live): slower, never wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from genlm_core import Request
from genlm_core.lineage import Continuation, LiveContexts
from genlm_llamacpp.engine import DecodeError, LlamaEngine, stream

log = logging.getLogger(__name__)


@dataclass
class SequenceStats:
    """What the sequences computed."""

    batches: int = 0
    rows: int = 0
    continued: int = 0  #: rows that extended a live sequence in place
    forked: int = 0  #: rows that extended a copy of a live sequence
    fresh: int = 0  #: rows that extended no live sequence
    shared: int = 0  #: fresh rows that started from a prefix copied from a live sequence
    tokens_computed: int = 0  #: tokens llama.cpp ran for rows
    tokens_copied: int = 0  #: positions forks and shared prefixes took from live sequences instead of computing them
    evicted: int = 0  #: live sequences removed to make room
    alone: int = 0  #: rows computed one by one because their batch did not fit in the KV cache


class NoRoom(RuntimeError):
    """The KV cache cannot hold a batch even with every other sequence removed."""


class Sequences:
    """The live sequences of one llama.cpp context."""

    def __init__(self, engine: LlamaEngine, live: bool = True, lookback: int = 1):
        self.engine = engine
        self.keep_live = live
        self.live: LiveContexts[int] = LiveContexts(lookback, keep_unclaimed=True)
        self.free = list(range(engine.config.n_seq_max - 1, -1, -1))
        #: what each sequence holds between batches (a live one's context), as an array for prefix search
        self.contents: dict[int, np.ndarray] = {}
        self.stats = SequenceStats()
        self._warned = False

    def rows(self, requests: Sequence[Request]) -> np.ndarray:
        """Logits ``[len(requests), n_vocab]``, continuing live sequences where a request extends
        one; afterwards each request's sequence is live (unless ``live`` is off)."""
        self.stats.batches += 1
        self.stats.rows += len(requests)
        if not self.keep_live:
            return self._fresh(requests)
        try:
            return self._run(requests)
        except NoRoom:
            pass
        self.stats.alone += len(requests)
        if not self._warned:
            self._warned = True
            log.warning(
                "llama.cpp's KV cache (n_ctx=%d) cannot hold a batch of %d rows: computing them one at a time; "
                "raise n_ctx for speed",
                self.engine.n_ctx,
                len(requests),
            )
        return np.concatenate([self._run([r]) for r in requests])

    def _run(self, requests: Sequence[Request]) -> np.ndarray:
        """One decode of every request's new tokens; raises NoRoom (with this batch's sequences
        removed) when the cache cannot hold them."""
        plan, released = self.live.plan(requests)
        for seq in released:
            self._release(seq)
        seqs: list[int] = []
        try:
            pieces = [self._place(r, c, seqs) for r, c in zip(requests, plan, strict=True)]
            logits = self._decode(pieces)
        except BaseException:  # the batch's sequences hold unknown positions: none may stay
            for seq in seqs:
                self._release(seq)
            raise
        for request, seq in zip(requests, seqs):
            self.contents[seq] = np.asarray(request.token_ids, np.int64)
            displaced = self.live.keep(request, seq)
            if displaced is not None:
                self._release(displaced)
        return logits

    def _fresh(self, requests: Sequence[Request]) -> np.ndarray:
        """Every request from its whole context, in sequences removed afterwards (one at a time if
        the batch does not fit)."""
        seqs = [self._take() for _ in requests]
        try:
            logits = self._decode([(r.token_ids, 0, seq) for r, seq in zip(requests, seqs)])
        except NoRoom:
            logits = None
        finally:
            for seq in seqs:
                self._release(seq)
        self.stats.fresh += len(requests)
        if logits is None:
            return np.concatenate([self.uncached(r)[None] for r in requests])
        return logits

    def _place(self, request: Request, continuation: Continuation[int] | None, seqs: list[int]) -> tuple:
        """The sequence and new tokens of one request (forking or taking a sequence as needed)."""
        if continuation is not None and not continuation.fork:
            seq, new = continuation.handle, continuation.new_tokens
            self.stats.continued += 1
        else:
            seq = self._take()
            if continuation is None:
                shared = self._copy_longest_prefix(request.token_ids, seq)
                new = request.token_ids[shared:]
                self.stats.fresh += 1
            else:
                new = continuation.new_tokens
                self.engine.copy_sequence(continuation.handle, seq)
                self.stats.forked += 1
                self.stats.tokens_copied += len(request.token_ids) - len(new)
        seqs.append(seq)
        return new, len(request.token_ids) - len(new), seq

    def _copy_longest_prefix(self, ids: tuple[int, ...], seq: int) -> int:
        """Copy into empty ``seq`` the longest prefix of ``ids`` (leaving at least its last token)
        that a sequence holds; its length (0: none)."""
        if not self.contents:
            return 0
        target = np.asarray(ids, np.int64)
        best, source = 0, -1
        for other, held in self.contents.items():
            n = min(len(held), len(target) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(held[:n] != target[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best:
                best, source = common, other
        if best:
            self.engine.copy_sequence(source, seq, best)
            self.stats.shared += 1
            self.stats.tokens_copied += best
        return best

    def _decode(self, pieces: list[tuple]) -> np.ndarray:
        """Run the pieces' tokens, removing live sequences (oldest first) while the cache has no
        room; NoRoom when none is left to remove."""
        tokens = stream(pieces)
        try:
            logits = self.engine.decode_stream(*tokens, make_room=self._evict_one)
        except DecodeError as exc:
            if exc.no_room:
                raise NoRoom(str(exc)) from None
            raise
        self.stats.tokens_computed += len(tokens[0])
        return logits

    def _evict_one(self) -> bool:
        """Remove the live sequence kept longest ago; False if none is live."""
        victim = self.live.evict()
        if victim is None:
            return False
        self._release(victim)
        self.stats.evicted += 1
        return True

    def _take(self) -> int:
        """A free sequence id, removing the oldest live sequence if none is free."""
        if not self.free and not self._evict_one():
            raise RuntimeError("every llama.cpp sequence is in use by this batch (n_seq_max < batch size)")
        return self.free.pop()

    def _release(self, seq: int) -> None:
        self.engine.remove_sequence(seq)
        self.contents.pop(seq, None)
        self.free.append(seq)

    def uncached(self, request: Request) -> np.ndarray:
        """The request's logits from its whole context, alone, in a sequence removed afterwards."""
        seq = self._take()
        try:
            return self._decode([(request.token_ids, 0, seq)])[0]
        finally:
            self._release(seq)

    def clear(self) -> None:
        """Remove every sequence."""
        self.live.release_all()
        self.contents.clear()
        self.engine.clear()
        self.free = list(range(self.engine.config.n_seq_max - 1, -1, -1))
