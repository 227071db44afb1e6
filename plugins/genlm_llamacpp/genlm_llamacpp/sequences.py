"""llama.cpp's sequences as core's live sequences: the primitives :mod:`genlm_core.live` asks for.

Each row's context is kept as a sequence of one llama.cpp context whose KV cache is unified, so a
copy (``llama_memory_seq_cp``) only adds the new sequence to the source's cells: a fork or a shared
prefix costs no compute and no memory. Which request continues, forks or copies what, when to evict
and what to do when a batch does not fit is core's (:class:`~genlm_core.live.LiveSequences`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from genlm_core.live import LiveEngine, NoRoom, Piece, Ran
from genlm_llamacpp.engine import DecodeError, LlamaEngine, stream


class LlamaSequences(LiveEngine[int, np.ndarray]):
    """The sequence ids of one llama.cpp context; a batch's result is its logits ``[pieces, n_vocab]``."""

    def __init__(self, engine: LlamaEngine):
        self.engine = engine
        self.free: list[int] = []
        self.thrown_away = 0  #: tokens decoded by runs that raised
        self.clear()

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.engine.remove_sequence(seq)
            self.free.append(seq)

    def copy(self, source: int, target: int, length: int) -> bool:
        self.engine.copy_sequence(source, target, length)
        return True

    def run(self, pieces: Sequence[Piece[int]], make_room: Callable[[], bool]) -> Ran[np.ndarray]:
        tokens = stream([(p.new_tokens, p.start, p.seq) for p in pieces])
        decoded = self.engine.tokens_decoded
        try:
            return Ran(self.engine.decode_stream(*tokens, make_room=make_room))
        except DecodeError as exc:
            self.thrown_away += self.engine.tokens_decoded - decoded  # a batch that raised: no stat counts it
            if exc.no_room:
                raise NoRoom(f"{exc} (n_ctx={self.engine.n_ctx}; raise it for speed)") from None
            raise

    def evaluated_tokens(self) -> int:
        """Tokens llama.cpp decoded for runs that returned (counted by the engine's ``llama_decode`` calls)."""
        return self.engine.tokens_decoded - self.thrown_away

    def clear(self) -> None:
        """Empty every sequence and free every id."""
        self.engine.clear()
        self.free = list(range(self.engine.config.n_seq_max - 1, -1, -1))
