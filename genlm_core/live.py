"""Particles kept alive in an engine: one design for every engine that holds sequences between batches.

A particle program asks for the row after ``ids``, draws ``t``, then asks for ``ids + [t]``. An engine
that keeps each row's context alive (llama.cpp's sequences, vLLM's resumable sessions, a toy engine
in a plugin) computes only ``[t]`` for it. Everything but the engine's own primitives is here:

- **matching** (:class:`~genlm_core.lineage.LiveContexts`, on exact token tuples and adapter): a live
  sequence is *continued* in place by at most one request of a batch; its other children *fork* it
  (a copy of its context, then their own tokens);
- **placement** of every other request: a copy of the longest prefix it shares with a live sequence
  (a sibling whose row comes in a later batch, a particle that went back, a repeated context), else a
  *fresh* sequence computed from the start;
- **room**: sequences nobody continued stay live, oldest first in line to be evicted when the engine
  says it has no room (before the batch, for a sequence id, or in the middle of running it);
- **failure**: a batch the engine cannot hold even with every other sequence evicted is computed one
  request at a time; a row that failed, or a batch that raised, leaves none of its sequences live.
  Nothing here can make a wrong row: a sequence holds exactly the tokens recorded for it, or none;
- **one options model** (:class:`LiveOptions`) and **one stats type** (:class:`LiveStats`).

An engine implements :class:`LiveEngine`: take a sequence, release sequences, copy a prefix of one
into another, run a batch of :class:`Piece` s, and (optionally) say how much it can hold. Then::

    live = LiveSequences(MyEngine(...), LiveOptions(lookback=1))
    def forward_batch(self, requests):  # the backend's
        return live.run(requests).rows()
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from genlm_core.batching import Failed
from genlm_core.lineage import Continuation, LiveContexts, nearest_prefix
from genlm_core.request import Request
from genlm_core.rows import RowsOut

log = logging.getLogger(__name__)

H = TypeVar("H")  #: the engine's handle of one sequence
R = TypeVar("R")  #: what the engine's run returns for a batch (its rows)


class LiveOptions(BaseModel):
    """How an engine keeps particles alive (a backend nests it as its ``live`` option)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(
        True,
        description="Keep each row's context alive in the engine, so that a request extending it computes only "
        "its new tokens; False computes every row from its whole context.",
    )
    lookback: PositiveInt = Field(1, description="Most tokens by which a request may extend a live sequence.")
    max_idle_batches: PositiveInt | None = Field(
        None,
        description="Batches in a row a live sequence may go unclaimed before it is released (None: until evicted).",
    )
    max_sequences: PositiveInt | None = Field(
        None, description="Most sequences kept alive between batches (None: as many as the engine holds)."
    )


@dataclass
class LiveStats:
    """What the live sequences computed, the same for every engine (``rows`` = ``continued + forked +
    copied + fresh``)."""

    batches: int = 0
    rows: int = 0
    continued: int = 0  #: rows that extended a live sequence in place
    forked: int = 0  #: rows that extended a copy of a sequence another row of the batch continued
    copied: int = 0  #: rows that started from a prefix copied from a live sequence
    fresh: int = 0  #: rows computed from the start of their context
    evicted: int = 0  #: live sequences released to make room
    alone: int = 0  #: rows computed one at a time because their batch did not fit
    tokens_computed: int = 0  #: tokens the engine ran for rows
    tokens_copied: int = 0  #: positions taken from live sequences instead of computed
    tokens_cached: int = 0  #: positions an engine's own prefix cache served

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class NoRoom(RuntimeError):
    """The engine cannot hold a batch even with every other sequence released."""


@dataclass(frozen=True)
class Piece(Generic[H]):
    """One request of a batch as the engine runs it: ``request.token_ids[start:]`` go into sequence
    ``seq``, which holds ``request.token_ids[:start]`` already (``fresh``: taken for this batch, holding
    only what was copied into it). ``keep``: the sequence stays live after the batch (else the engine
    may let it go once its row is out). ``index``: the request's place in the batch."""

    index: int
    request: Request
    seq: H
    start: int
    fresh: bool
    keep: bool = True

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return self.request.token_ids[self.start :]


@dataclass
class Ran(Generic[R]):
    """What :meth:`LiveEngine.run` returns: its rows (``value``), the pieces whose row failed (by
    index, with the error; their sequences are released, the others' rows stand), and token counts
    where the engine knows better than the pieces (None: the pieces' new tokens are what it computed)."""

    value: R
    failed: dict[int, BaseException] = field(default_factory=dict)
    tokens_computed: int | None = None
    tokens_copied: int | None = None
    tokens_cached: int = 0

    def rows(self) -> RowsOut:
        """``value`` (an array or tensor of rows) as :meth:`~genlm_core.lm.AsyncLM.forward_batch`
        returns it: the block, or one row per request with a :class:`~genlm_core.batching.Failed`
        for each failed one."""
        value = self.value
        block = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"rows() needs an array or tensor of rows, not {type(value).__name__}")
        if not self.failed:
            return block
        return [Failed(self.failed[i]) if i in self.failed else row for i, row in enumerate(block)]


class LiveEngine(abc.ABC, Generic[H, R]):
    """What an engine implements to keep particles alive (see the module docstring)."""

    #: Copies of any prefix are worth making (a shared-cell copy); False: only the copies that
    #: siblings need (a context less its last few tokens), as an engine with a prefix cache of its own.
    copies_any_prefix: bool = True

    @abc.abstractmethod
    def take(self) -> H | None:
        """An empty sequence, or None when none is free (core releases a live one and asks again)."""

    @abc.abstractmethod
    def release(self, seqs: Sequence[H]) -> None:
        """Forget these sequences (live ones, or ones of a batch that failed); their ids may be reused."""

    @abc.abstractmethod
    def copy(self, source: H, target: H, length: int) -> bool:
        """Make empty ``target`` hold ``source``'s first ``length`` positions (at the latest when the
        batch runs). False: this engine cannot, and ``target`` stays empty."""

    @abc.abstractmethod
    def run(self, pieces: Sequence[Piece[H]], make_room: Callable[[], bool]) -> Ran[R]:
        """Run every piece's new tokens; the row of each piece's last token, in piece order. When the
        engine runs out of room, ``make_room()`` releases a live sequence of no piece (True) or finds
        none (False: raise :class:`NoRoom`, leaving nothing of this batch behind)."""

    def room(self, sequences: int, tokens: int) -> bool:
        """Whether ``sequences`` sequences holding ``tokens`` tokens in all fit at once (the batch's and
        the live ones). Engines that find out while running (``make_room``) keep the default."""
        return True

    def join(self, parts: Sequence[R]) -> R:
        """One result of the one-request batches that :class:`LiveSequences` ran when a batch did not
        fit. The default concatenates arrays or tensors."""
        first = parts[0]
        if isinstance(first, np.ndarray):
            return np.concatenate(parts)  # type: ignore[arg-type,return-value]
        if isinstance(first, torch.Tensor):
            return torch.cat(parts)  # type: ignore[arg-type,return-value]
        raise TypeError(f"{type(self).__name__} must implement join() for results of type {type(first).__name__}")


class LiveSequences(Generic[H, R]):
    """The live sequences of one engine: what each holds, who continues which, and the stats."""

    def __init__(self, engine: LiveEngine[H, R], options: LiveOptions | None = None):
        self.engine = engine
        self.options = o = options or LiveOptions.model_validate({})
        self.live: LiveContexts[H] = LiveContexts(o.lookback, max_idle_batches=o.max_idle_batches)
        self.stats = LiveStats()
        #: what each live sequence holds (its context), and the same as arrays for prefix search
        self._held: dict[H, Request] = {}
        self._arrays: dict[H, np.ndarray] = {}
        #: a context less its last 1..lookback tokens -> the live sequence that extends it (for siblings)
        self._parents: dict[Request, H] = {}
        self._warned = False

    def __len__(self) -> int:
        return len(self.live)

    def run(self, requests: Sequence[Request]) -> Ran[R]:
        """The engine's rows for ``requests`` (validated, distinct), continuing live sequences where a
        request extends one; afterwards each request's sequence is live (when the options keep any).
        ``.rows()`` of the result is what a backend's ``forward_batch`` returns."""
        self.stats.batches += 1
        self.stats.rows += len(requests)
        if not self.options.enabled:
            return self._fresh(requests)
        try:
            return self._run(requests)
        except NoRoom:
            pass
        self.stats.alone += len(requests)
        if not self._warned:
            self._warned = True
            log.warning(
                "%s cannot hold a batch of %d rows: computing them one at a time (slower, never wrong); "
                "give the engine more room for speed",
                type(self.engine).__name__,
                len(requests),
            )
        parts = [self._run([r]) for r in requests]
        failed = {i: part.failed[0] for i, part in enumerate(parts) if part.failed}
        return Ran(self.engine.join([part.value for part in parts]), failed)

    def uncached(self, request: Request) -> R:
        """The request's row from its whole context, alone, in a sequence released afterwards."""
        seq = self._take()
        try:
            pieces = [Piece(0, request, seq, 0, True, keep=False)]
            ran = self.engine.run(pieces, self._evict_one)
        finally:
            self.engine.release([seq])
        self._count(pieces, ran)
        return ran.value

    def release_all(self) -> None:
        """Release every live sequence."""
        seqs = self.live.release_all()
        self._held.clear()
        self._arrays.clear()
        self._parents.clear()
        if seqs:
            self.engine.release(seqs)

    # ---- a batch -----------------------------------------------------------------------------

    def _run(self, requests: Sequence[Request]) -> Ran[R]:
        """Plan, place, run, commit; raises NoRoom with none of this batch's sequences left."""
        plan, idle = self.live.plan(requests)
        self._drop(idle)
        batch = [c.handle for c in plan if c is not None and not c.fork]  # every sequence the batch uses
        # what stays held once the batch runs: the live sequences nobody claimed, then each piece's
        sequences, tokens = self._make_room(requests, batch)
        pieces: list[Piece[H]] = []
        kinds: list[str] = []  # how each piece was placed, counted once the batch ran
        try:
            for i, (request, continuation) in enumerate(zip(requests, plan, strict=True)):
                n = len(request.token_ids)
                keep = (continuation is not None and not continuation.fork) or self.engine.room(
                    sequences + 1, tokens + n
                )
                if keep:
                    sequences, tokens = sequences + 1, tokens + n
                piece, kind = self._place(i, request, continuation, keep, batch)
                pieces.append(piece)
                kinds.append(kind)
            ran = self.engine.run(pieces, self._evict_one)
        except BaseException:  # the batch's sequences hold unknown positions: none may stay
            self._drop(list(dict.fromkeys(batch)))
            raise
        self._count(pieces, ran)
        for kind in kinds:
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        failed = set(ran.failed)
        dropped = []
        for piece in pieces:
            if piece.index in failed or not piece.keep:
                dropped.append(piece.seq)
            else:
                self._keep(piece.request, piece.seq)
        self._drop(dropped)
        return ran

    def _fresh(self, requests: Sequence[Request]) -> Ran[R]:
        """Every request from its whole context, in sequences released afterwards."""
        self.stats.fresh += len(requests)
        seqs: list[H] = []
        try:
            for _ in requests:
                seqs.append(self._take())
            pieces = [Piece(i, r, seq, 0, True, keep=False) for i, (r, seq) in enumerate(zip(requests, seqs))]
            ran = self.engine.run(pieces, lambda: False)
        except NoRoom:
            self.stats.alone += len(requests)
            return Ran(self.engine.join([self.uncached(r) for r in requests]))
        finally:
            if seqs:
                self.engine.release(seqs)
        self._count(pieces, ran)
        return ran

    def _place(
        self, index: int, request: Request, continuation: Continuation[H] | None, keep: bool, batch: list[H]
    ) -> tuple[Piece[H], str]:
        """The piece of one request, and how it was placed (a :class:`LiveStats` field): continue its
        live sequence, or take one (forking, copying a prefix, or empty)."""
        n = len(request.token_ids)
        if continuation is not None and not continuation.fork:
            return Piece(index, request, continuation.handle, n - len(continuation.new_tokens), False), "continued"
        seq = self._take()
        batch.append(seq)
        if continuation is not None and self.engine.copy(continuation.handle, seq, n - len(continuation.new_tokens)):
            return Piece(index, request, seq, n - len(continuation.new_tokens), True, keep), "forked"
        source = self._longest_prefix(request)
        if source is not None and self.engine.copy(source[0], seq, source[1]):
            return Piece(index, request, seq, source[1], True, keep), "copied"
        return Piece(index, request, seq, 0, True, keep), "fresh"

    def _longest_prefix(self, request: Request) -> tuple[H, int] | None:
        """A live sequence and the length of the longest prefix of ``request`` it holds (leaving at
        least the last token to compute), or None."""
        hit = nearest_prefix(self._parents.get, request, self.options.lookback, shortest_cut=1)
        if hit is not None:
            return hit[1], len(request.token_ids) - hit[0]
        if not self.engine.copies_any_prefix or not self._arrays:
            return None
        target = np.asarray(request.token_ids, np.int64)
        best, source = 0, None
        for seq, held in self._arrays.items():
            if self._held[seq].adapter != request.adapter:
                continue
            n = min(len(held), len(target) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(held[:n] != target[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best:
                best, source = common, seq
        return None if source is None else (source, best)

    def _count(self, pieces: Sequence[Piece[H]], ran: Ran[R]) -> None:
        s = self.stats
        computed, copied = ran.tokens_computed, ran.tokens_copied
        s.tokens_computed += sum(len(p.new_tokens) for p in pieces) if computed is None else computed
        s.tokens_copied += sum(p.start for p in pieces if p.fresh) if copied is None else copied
        s.tokens_cached += ran.tokens_cached

    # ---- room ----------------------------------------------------------------------------------

    def _make_room(self, requests: Sequence[Request], batch: Sequence[H]) -> tuple[int, int]:
        """Evict unclaimed live sequences, oldest first, until the batch fits beside the rest (for
        engines that say how much they hold) and at most ``max_sequences`` would stay live. Returns the
        sequences and tokens the unclaimed ones that stay hold."""
        cap = self.options.max_sequences
        claimed = set(batch)
        parked = len(self._held) - len(claimed)
        held = sum(len(r.token_ids) for seq, r in self._held.items() if seq not in claimed)
        asked = sum(len(r.token_ids) for r in requests)
        while not (
            self.engine.room(parked + len(requests), held + asked) and (cap is None or parked + len(requests) <= cap)
        ):
            seq = self.live.evict()
            if seq is None:
                break
            request = self._held.get(seq)
            parked, held = parked - 1, held - (0 if request is None else len(request.token_ids))
            self.stats.evicted += 1
            self._drop([seq])
        return parked, held

    # ---- bookkeeping -------------------------------------------------------------------------

    def _take(self) -> H:
        """An empty sequence, evicting the oldest live one while none is free."""
        while True:
            seq = self.engine.take()
            if seq is not None:
                return seq
            if not self._evict_one():
                raise RuntimeError(
                    f"every sequence of {type(self.engine).__name__} is in use by this batch "
                    "(it holds fewer sequences than the batch size)"
                )

    def _evict_one(self) -> bool:
        """Release the live sequence kept longest ago; False if none is live."""
        seq = self.live.evict()
        if seq is None:
            return False
        self.stats.evicted += 1
        self._drop([seq])
        return True

    def _keep(self, request: Request, seq: H) -> None:
        displaced = self.live.keep(request, seq)
        if displaced is not None:
            self._drop([displaced])
        self._forget_held(seq)
        self._held[seq] = request
        if self.engine.copies_any_prefix:
            self._arrays[seq] = np.asarray(request.token_ids, np.int64)
        n = len(request.token_ids)
        for cut in range(1, min(self.options.lookback, n - 1) + 1):
            self._parents[request.prefix(n - cut)] = seq

    def _drop(self, seqs: Sequence[H]) -> None:
        for seq in seqs:
            self._forget_held(seq)
        if seqs:
            self.engine.release(seqs)

    def _forget_held(self, seq: H) -> None:
        request = self._held.pop(seq, None)
        self._arrays.pop(seq, None)
        if request is None:
            return
        n = len(request.token_ids)
        for cut in range(1, min(self.options.lookback, n - 1) + 1):
            key = request.prefix(n - cut)
            if self._parents.get(key) == seq:
                del self._parents[key]
