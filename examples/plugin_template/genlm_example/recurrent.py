"""``RecurrentLM``: a toy recurrent model that keeps its particles alive through core's public protocol.

Its row after a context depends on every token of it (``state = tanh(embed[t] + decay * state)``,
``logits = state @ out``), so a particle's states play the part of a KV cache: computing ``ids + [t]``
from the states of ``ids`` costs one step. :class:`StateSequences` is all a third party writes for
that (take, release, copy, run, room, and a count of the steps it ran); matching, forks, copies,
eviction, fallbacks and stats are genlm-core's :class:`~genlm_core.live.LiveSequences`. The backend's
:meth:`RecurrentLM.forward_uncached` is the reference that checks it, so it runs the model's own loop
over the whole context and never the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import Field, PositiveInt

from genlm_core import AsyncLM, BackendOptions, Request, RowsOut, Tokenizer
from genlm_core.live import LiveEngine, LiveOptions, LiveSequences, NoRoom, Piece, Ran


class RecurrentOptions(BackendOptions):
    """Options of the toy recurrent backend."""

    dim: PositiveInt = Field(16, description="Size of the recurrent state.")
    sequences: PositiveInt = Field(64, description="Sequences the engine holds at once.")
    positions: PositiveInt | None = Field(None, description="States the engine holds in all (None: no limit).")
    live: LiveOptions = Field(default_factory=lambda: LiveOptions.model_validate({}))


class StateSequences(LiveEngine[int, torch.Tensor]):
    """Each sequence id holds the states of one context, position by position."""

    def __init__(self, model: RecurrentLM, sequences: int, positions: int | None):
        self.model, self.positions = model, positions
        self.held: dict[int, list[torch.Tensor]] = {}
        self.free = list(range(sequences))
        self.taken: set[int] = set()

    def take(self) -> int | None:
        if not self.free:
            return None
        seq = self.free.pop()
        self.taken.add(seq)
        return seq

    def release(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            if seq not in self.taken:  # core releases each sequence it took exactly once
                raise RuntimeError(f"sequence {seq} released but not taken")
            self.taken.remove(seq)
            self.held.pop(seq, None)
            self.free.append(seq)

    def copy(self, source: int, target: int, length: int) -> bool:
        self.held[target] = self.held[source][:length]
        return True

    def room(self, sequences: int, tokens: int) -> bool:
        return self.positions is None or tokens <= self.positions

    def evaluated_tokens(self) -> int:
        return self.model.steps  # counted by the model: the check compares it with what core planned

    def run(self, pieces: Sequence[Piece[int]], make_room: Callable[[], bool]) -> Ran[torch.Tensor]:
        new = sum(len(p.new_tokens) for p in pieces)
        while self.positions is not None and self.size() + new > self.positions:  # room first, then work
            if not make_room():
                raise NoRoom(f"{self.positions} states cannot hold this batch")
        for piece in pieces:
            states = self.held.setdefault(piece.seq, [])
            if len(states) != piece.start:
                raise RuntimeError(f"sequence {piece.seq} holds {len(states)} states, not {piece.start}")
            for token in piece.new_tokens:
                states.append(self.model.step(states[-1] if states else None, token))
        return Ran(torch.stack([self.held[p.seq][-1] for p in pieces]) @ self.model.out)

    def size(self) -> int:
        """States held in all."""
        return sum(map(len, self.held.values()))


class RecurrentLM(AsyncLM):
    """A seeded random recurrent model over a real tokenizer, its particles kept alive between batches."""

    Options = RecurrentOptions
    options: RecurrentOptions

    def __init__(self, tokenizer: Tokenizer, options: RecurrentOptions | None = None, seed: int = 0, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        o, g = self.options, torch.Generator().manual_seed(seed)
        self.embed = torch.randn(self.vocab_size, o.dim, generator=g)
        self.out = torch.randn(o.dim, self.vocab_size, generator=g) * 3
        self.steps = 0  #: model steps run for the engine (the reference's are not counted)
        self.states = StateSequences(self, o.sequences, o.positions)
        self.sequences: LiveSequences[int, torch.Tensor] = LiveSequences(self.states, o.live)

    def cell(self, state: torch.Tensor | None, token: int) -> torch.Tensor:
        """The model: one token on the state of the context before it (None: the empty context)."""
        return torch.tanh(self.embed[token] + (0 if state is None else 0.9 * state))

    def step(self, state: torch.Tensor | None, token: int) -> torch.Tensor:
        """:meth:`cell` for the engine, counted in :attr:`steps`."""
        self.steps += 1
        return self.cell(state, token)

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        return self.sequences.run(requests).rows()

    def forward_uncached(self, request: Request) -> torch.Tensor:
        """The reference row: the model's loop over the whole context, sharing nothing with the engine.
        A live backend must have one (AsyncLM's default runs ``forward_batch``, the live path itself,
        and ``check_live_sequences`` refuses it)."""
        state = None
        for token in request.token_ids:
            state = self.cell(state, token)
        assert state is not None  # a request has at least one token
        return state @ self.out

    def clear_backend_cache(self) -> None:
        self.sequences.release_all()
