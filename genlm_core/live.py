"""Particles kept alive in an engine: one design for every engine that holds sequences between batches.

A particle program asks for the row after ``ids``, draws ``t``, then asks for ``ids + [t]``. An engine
that keeps each row's context alive (llama.cpp's sequences, vLLM's resumable sessions, a toy engine
in a plugin) computes only ``[t]`` for it. Everything but the engine's own primitives is here:

- **matching** (:class:`~genlm_core.live_index.LiveIndex`, the one index of what each live sequence
  holds, on exact token tuples and adapter): a live sequence is *continued* in place by at most one
  request of a batch; its other children *fork* it (a copy of its context, then their own tokens);
- **placement** of every other request: a copy of the longest prefix it shares with a live sequence
  (a sibling whose row comes in a later batch, a particle that went back, a repeated context), else a
  *fresh* sequence computed from the start;
- **room**: sequences nobody continued stay live, oldest first in line to be evicted when the engine
  says it has no room (before the batch, for a sequence id, or in the middle of running it);
- **failure**: a batch the engine cannot hold even with every other sequence evicted (too few
  sequences for the batch size, too little memory) is split into batches it can hold, down to one
  request at a time; a row that failed, or a batch that raised, leaves none of its sequences live.
  Nothing here can make a wrong row: a sequence holds exactly the tokens recorded for it, or none;
- **one options model** (:class:`LiveOptions`) and **one stats type** (:class:`LiveStats`).

An engine implements :class:`LiveEngine`: take a sequence, release sequences, copy a prefix of one
into another, run a batch of :class:`Piece` s, and (optionally) say how much it can hold and how many
positions it evaluated. Then::

    live = LiveSequences(MyEngine(...), LiveOptions(lookback=1))
    def forward_batch(self, requests):  # the backend's
        return live.run(requests).rows()

The backend must also override :meth:`~genlm_core.lm.AsyncLM.forward_uncached` with a forward pass
that shares nothing with the live path (a fresh sequence computed from its first token, or the
model's plain forward): AsyncLM's default runs :meth:`~genlm_core.lm.AsyncLM.forward_batch`, which
here *is* the live path, and :func:`genlm_core.testing.live.check_live_sequences` refuses a reference
that cannot tell a wrong live row from a right one.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from genlm_core.config import LiveOptions  # defined there: options import no torch
from genlm_core.lineage import Continuation
from genlm_core.live_index import LiveIndex
from genlm_core.request import Request
from genlm_core.rows import Failed, RowsOut

log = logging.getLogger(__name__)

H = TypeVar("H")  #: the engine's handle of one sequence
R = TypeVar("R")  #: what the engine's run returns for a batch (its rows)


@dataclass
class LiveStats:
    """What the live sequences computed, the same for every engine. ``rows`` = ``continued + forked +
    copied + fresh`` always: a row is counted once the engine ran it (a batch that raised counts
    none, a batch split in parts counts each row once)."""

    batches: int = 0  #: batches asked of :meth:`LiveSequences.run` (a split batch counts once)
    rows: int = 0  #: rows the engine ran
    continued: int = 0  #: rows that extended a live sequence in place
    forked: int = 0  #: rows that extended a copy of a sequence another row of the batch continued
    copied: int = 0  #: rows that started from a prefix copied from a live sequence
    fresh: int = 0  #: rows computed from the start of their context
    evicted: int = 0  #: live sequences released to make room
    alone: int = 0  #: rows run in a part of their batch, because the engine could not hold it whole
    tokens_computed: int = 0  #: tokens the engine ran for rows
    tokens_copied: int = 0  #: positions taken from live sequences instead of computed
    tokens_cached: int = 0  #: positions an engine's own prefix cache served

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class NoRoom(RuntimeError):
    """The engine cannot hold a batch even with every other sequence released. ``fits``: how many
    requests it could hold at once, when known (core then splits the batch in parts of that size)."""

    def __init__(self, message: str, fits: int | None = None):
        super().__init__(message)
        self.fits = fits


@dataclass(frozen=True)
class Piece(Generic[H]):
    """One request of a batch as the engine runs it: ``request.token_ids[start:]`` go into sequence
    ``seq``, which holds ``request.token_ids[:start]`` already (``fresh``: taken for this batch, holding
    only what was copied into it). ``keep``: the sequence stays live after the batch; False: core
    releases it (through :meth:`LiveEngine.release`) once the batch's rows are out, so the engine need
    not keep what the run adds to it, and never releases it itself. ``index``: the request's place in
    the batch. ``new_tokens``: ``request.token_ids[start:]``, what the engine runs (read once here, so
    that an engine reading it calls nothing of core's)."""

    index: int
    request: Request
    seq: H
    start: int
    fresh: bool
    keep: bool = True
    new_tokens: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "new_tokens", self.request.new_tokens(self.start))


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
        returns it: the block, or one row per request with a :class:`~genlm_core.rows.Failed`
        for each failed one."""
        value = self.value
        block = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"rows() needs an array or tensor of rows, not {type(value).__name__}")
        if not self.failed:
            return block
        return [Failed(self.failed[i]) if i in self.failed else row for i, row in enumerate(block)]


class LiveEngine(abc.ABC, Generic[H, R]):
    """What an engine implements to keep particles alive (see the module docstring).

    **Who releases.** Core does, always: every sequence :meth:`take` hands out comes back through
    :meth:`release` exactly once (a live sequence when it is evicted, idle or displaced; a ``keep=False``
    piece's after its batch; every sequence of a batch that raised), and :meth:`release` never sees an
    id it did not hand out, nor one already released since (an engine may treat either as a bug and
    raise). An engine never frees a sequence on its own.

    **An engine that keeps only each sequence's last state** (a recurrent model that does not store a
    state per position) is allowed: its :meth:`copy` returns True only for a ``length`` equal to
    everything the source holds (what a fork copies: a sibling's parent, copied before the batch
    extends it) and False for a shorter prefix. Set :attr:`copies_any_prefix` False so that core looks
    only for the copies siblings need. The cost: a particle that goes back, a sibling whose row
    comes in a later batch than its parent's, and a repeated context are computed from their first
    token (``fresh``) instead of copied; continued and forked rows still cost their new tokens only.

    **The reference.** The backend that runs this engine must override
    :meth:`~genlm_core.lm.AsyncLM.forward_uncached` with a forward pass that does not use it (or uses
    only a fresh sequence computed from the first token, as :meth:`LiveSequences.uncached` does).
    """

    #: Copies of any prefix are worth making (a shared-cell copy); False: only the copies that
    #: siblings need (a context less its last few tokens), as an engine with a prefix cache of its own
    #: or one that keeps only each sequence's last state.
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

    def evaluated_tokens(self) -> int | None:
        """Positions the model has evaluated for this engine in all, counted where the model evaluates
        them rather than from the pieces; None (the default): not counted.
        :func:`~genlm_core.testing.live.check_live_sequences` compares it with
        :attr:`LiveStats.tokens_computed`, so that a copy that recomputes its prefix, or a
        continuation that recomputes its context, fails the check instead of passing as copied. (A
        run that raises :class:`NoRoom` should raise before evaluating anything: work it threw
        away counts here and in no stat.)"""
        return None

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
        #: the one index of what each sequence holds (read it through the methods below)
        self._index: LiveIndex[H] = LiveIndex(o.lookback, o.max_idle_batches, arrays=engine.copies_any_prefix)
        self.stats = LiveStats()
        self._warned = False

    def __len__(self) -> int:
        """Live sequences."""
        return len(self._index)

    def contexts(self) -> list[Request]:
        """The live sequences' contexts (as requests), kept longest ago first (the first to be evicted)."""
        return self._index.contexts()

    def sequences(self) -> list[tuple[Request, H]]:
        """``(context, engine handle)`` of each live sequence, kept longest ago first."""
        return self._index.items()

    def run(self, requests: Sequence[Request]) -> Ran[R]:
        """The engine's rows for ``requests`` (validated, distinct), continuing live sequences where a
        request extends one; afterwards each request's sequence is live (when the options keep any).
        A batch the engine cannot hold at once (fewer sequences than requests, too little memory) is
        run in parts it can hold. ``.rows()`` of the result is what a backend's ``forward_batch``
        returns."""
        self.stats.batches += 1
        return self._fit(requests, self._run if self.options.enabled else self._fresh)

    def uncached(self, request: Request) -> R:
        """The request's row from its whole context, alone, in a fresh sequence released afterwards
        (a live sequence is evicted if none is free): a reference a backend's ``forward_uncached``
        may use. It counts nothing in :attr:`stats`."""
        return self._alone(request)[1].value

    def release_all(self) -> None:
        """Release every live sequence."""
        seqs = self._index.release_all()
        if seqs:
            self.engine.release(seqs)

    # ---- a batch -----------------------------------------------------------------------------

    def _fit(
        self, requests: Sequence[Request], runner: Callable[[Sequence[Request], bool], Ran[R]], part: bool = False
    ) -> Ran[R]:
        """``runner(requests, part)``; when the engine cannot hold them (NoRoom), the same in parts of
        the size it said it holds (else halves; a part that does not fit is split again), each planned
        on what the parts before it left live. The requests that continue a live sequence go in the
        first parts (while their sequences are still live), when the engine's results are arrays or
        tensors that core can put back in order. One request that does not fit alone raises NoRoom."""
        try:
            return runner(requests, part)
        except NoRoom as exc:
            if len(requests) == 1:
                raise
            fits = exc.fits
        size = max(1, min(fits or (len(requests) + 1) // 2, len(requests) - 1))
        if not self._warned:
            self._warned = True
            log.warning(
                "%s cannot hold a batch of %d rows: computing it in parts of %d (slower, never wrong); "
                "give the engine more room (sequences, memory) for speed",
                type(self.engine).__name__,
                len(requests),
                size,
            )
        order = list(range(len(requests)))
        if type(self.engine).join is LiveEngine.join:  # arrays or tensors: rows can be put back in order
            order.sort(key=lambda i: not self._index.extends_live(requests[i]))
        values, failed = [], {}
        for start in range(0, len(requests), size):
            indices = order[start : start + size]
            ran = self._fit([requests[i] for i in indices], runner, True)
            values.append(ran.value)
            failed.update({indices[i]: error for i, error in ran.failed.items()})
        value = self.engine.join(values)
        if order != sorted(order):
            back = np.argsort(np.asarray(order))
            value = value[torch.from_numpy(back) if isinstance(value, torch.Tensor) else back]  # type: ignore[index]
        return Ran(value, failed)

    def _run(self, requests: Sequence[Request], part: bool = False) -> Ran[R]:
        """Plan, place, run, commit; raises NoRoom with none of this batch's sequences left (when
        there are too few sequences for it, before anything runs: the live sequences stay as they
        were)."""
        plan, idle = self._index.plan(requests)
        self._drop(idle)
        claimed = [c.handle for c in plan if c is not None and not c.fork]
        # what stays held once the batch runs: the live sequences nobody claimed, then each piece's
        sequences, tokens = self._make_room(requests)
        # every other request takes its sequence now, before anything is copied into one
        taken = self._take_for(sum(c is None or c.fork for c in plan), claimed)
        batch = claimed + taken  # every sequence the batch uses
        free = iter(taken)
        pieces: list[Piece[H]] = []
        kinds: list[str] = []  # how each piece was placed, counted once the batch ran
        try:
            for i, (request, continuation) in enumerate(zip(requests, plan, strict=True)):
                n = len(request)
                keep = (continuation is not None and not continuation.fork) or self.engine.room(
                    sequences + 1, tokens + n
                )
                if keep:
                    sequences, tokens = sequences + 1, tokens + n
                piece, kind = self._place(i, request, continuation, keep, free)
                pieces.append(piece)
                kinds.append(kind)
            ran = self.engine.run(pieces, self._evict_one)
        except BaseException:  # the batch's sequences hold unknown positions: none may stay
            self._drop(list(dict.fromkeys(batch)))
            raise
        self._count(pieces, ran, part)
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

    def _fresh(self, requests: Sequence[Request], part: bool = False) -> Ran[R]:
        """Every request from its whole context, in sequences released afterwards (live sequences off)."""
        seqs = self._take_for(len(requests), [])
        try:
            pieces = [Piece(i, r, seq, 0, True, keep=False) for i, (r, seq) in enumerate(zip(requests, seqs))]
            ran = self.engine.run(pieces, self._evict_one)
        finally:
            self.engine.release(seqs)
        self.stats.fresh += len(requests)
        self._count(pieces, ran, part)
        return ran

    def _alone(self, request: Request) -> tuple[list[Piece[H]], Ran[R]]:
        """One request from its whole context in a sequence of its own, released afterwards."""
        seq = self._take_for(1, [])[0]
        try:
            pieces = [Piece(0, request, seq, 0, True, keep=False)]
            ran = self.engine.run(pieces, self._evict_one)
        finally:
            self.engine.release([seq])
        return pieces, ran

    def _place(
        self, index: int, request: Request, continuation: Continuation[H] | None, keep: bool, free: Iterator[H]
    ) -> tuple[Piece[H], str]:
        """The piece of one request, and how it was placed (a :class:`LiveStats` field): continue its
        live sequence, or fill one of the batch's free sequences (forking, copying a prefix, or empty)."""
        n = len(request)
        if continuation is not None and not continuation.fork:
            return Piece(index, request, continuation.handle, n - len(continuation.new_tokens), False), "continued"
        seq = next(free)
        if continuation is not None and self.engine.copy(continuation.handle, seq, n - len(continuation.new_tokens)):
            return Piece(index, request, seq, n - len(continuation.new_tokens), True, keep), "forked"
        source = self._index.longest_prefix(request)
        if source is not None and self.engine.copy(source[0], seq, source[1]):
            return Piece(index, request, seq, source[1], True, keep), "copied"
        return Piece(index, request, seq, 0, True, keep), "fresh"

    def _count(self, pieces: Sequence[Piece[H]], ran: Ran[R], part: bool) -> None:
        """Count a batch the engine ran: its rows (``alone`` too when it was a part of a split batch)
        and its tokens."""
        s = self.stats
        s.rows += len(pieces)
        if part:
            s.alone += len(pieces)
        computed, copied = ran.tokens_computed, ran.tokens_copied
        s.tokens_computed += sum(len(p.new_tokens) for p in pieces) if computed is None else computed
        s.tokens_copied += sum(p.start for p in pieces if p.fresh) if copied is None else copied
        s.tokens_cached += ran.tokens_cached

    # ---- room ----------------------------------------------------------------------------------

    def _make_room(self, requests: Sequence[Request]) -> tuple[int, int]:
        """Evict unclaimed live sequences, oldest first, until the batch fits beside the rest (for
        engines that say how much they hold) and at most ``max_sequences`` would stay live. Returns the
        sequences and tokens the unclaimed ones that stay hold."""
        cap = self.options.max_sequences
        parked, held = len(self._index), self._index.live_tokens()  # (the batch's claimed ones are not live)
        asked = sum(len(r) for r in requests)
        while not (
            self.engine.room(parked + len(requests), held + asked) and (cap is None or parked + len(requests) <= cap)
        ):
            evicted = self._index.evict()
            if evicted is None:
                break
            parked, held = parked - 1, held - len(evicted[1])
            self.stats.evicted += 1
            self.engine.release([evicted[0]])
        return parked, held

    # ---- bookkeeping -------------------------------------------------------------------------

    def _take_for(self, count: int, claimed: Sequence[H]) -> list[H]:
        """``count`` empty sequences, evicting the oldest live ones while none is free. When the engine
        has no more (every one is in use by this batch), raises :class:`NoRoom` saying how many the
        batch could have held, after giving back what it took and putting ``claimed`` (live sequences
        the batch's plan claimed; nothing ran in them) back among the live ones."""
        taken: list[H] = []
        while len(taken) < count:
            seq = self.engine.take()
            if seq is not None:
                taken.append(seq)
            elif not self._evict_one():
                if taken:
                    self.engine.release(taken)
                for seq in claimed:
                    self._keep(self._index.held(seq), seq)  # type: ignore[arg-type]  # claimed: held
                fits = len(claimed) + len(taken)
                raise NoRoom(
                    f"{type(self.engine).__name__} holds {fits} sequences at once, fewer than the "
                    f"{len(claimed) + count} this batch needs",
                    fits=fits,
                )
        return taken

    def _evict_one(self) -> bool:
        """Release the live sequence kept longest ago; False if none is live."""
        evicted = self._index.evict()
        if evicted is None:
            return False
        self.stats.evicted += 1
        self.engine.release([evicted[0]])
        return True

    def _keep(self, request: Request, seq: H) -> None:
        displaced = self._index.keep(request, seq)
        if displaced is not None:
            self.engine.release([displaced])

    def _drop(self, seqs: Sequence[H]) -> None:
        self._index.forget(seqs)
        if seqs:
            self.engine.release(seqs)
