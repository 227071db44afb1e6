"""``RecurrentLM``: a toy recurrent model that keeps its particles alive through core's public protocol.

Its row after a context depends on every token of it (``state = tanh(embed[t] + decay * state)``,
``logits = state @ out``), so a particle's states play the part of a KV cache: computing ``ids + [t]``
from the states of ``ids`` costs one step. :class:`StateSequences` is all a third party writes for
that (take, release, copy, run, room); matching, forks, copies, eviction, fallbacks and stats are
genlm-core's :class:`~genlm_core.live.LiveSequences`.
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

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.held.pop(seq, None)
            self.free.append(seq)

    def copy(self, source: int, target: int, length: int) -> bool:
        self.held[target] = self.held[source][:length]
        return True

    def room(self, sequences: int, tokens: int) -> bool:
        return self.positions is None or tokens <= self.positions

    def run(self, pieces: Sequence[Piece[int]], make_room: Callable[[], bool]) -> Ran[torch.Tensor]:
        for piece in pieces:
            states = self.held.setdefault(piece.seq, [])
            if len(states) != piece.start:
                raise RuntimeError(f"sequence {piece.seq} holds {len(states)} states, not {piece.start}")
            while (
                self.positions is not None
                and sum(map(len, self.held.values())) + len(piece.new_tokens) > self.positions
            ):
                if not make_room():
                    raise NoRoom(f"{self.positions} states cannot hold this batch")
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
        self.states = StateSequences(self, o.sequences, o.positions)
        self.sequences: LiveSequences[int, torch.Tensor] = LiveSequences(self.states, o.live)

    def step(self, state: torch.Tensor | None, token: int) -> torch.Tensor:
        return torch.tanh(self.embed[token] + (0 if state is None else 0.9 * state))

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        return self.sequences.run(requests).rows()

    def forward_uncached(self, request: Request) -> torch.Tensor:
        state = None
        for token in request.token_ids:
            state = self.step(state, token)
        assert state is not None  # a request has at least one token
        return state @ self.out

    def clear_backend_cache(self) -> None:
        self.sequences.release_all()
