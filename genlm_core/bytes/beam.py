"""``ByteBeamState``: a language model over bytes, from any token-level AsyncLM.

The probability of a byte prefix is the sum, over every tokenization consistent with it, of the
token sequence's probability; the beam keeps the ``K`` heaviest hypotheses (exact when nothing is
pruned). Every model call and trie sum of one step is issued concurrently, so they batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from genlm_core.lm import AsyncLM

from .heal import TokenHealer
from .probs import EOS, EOT, LazyByteProbs, logsumexp
from .trie import AsyncTokenByteTrie, TrieMode
from .trie_state import LazyTrieState

log = logging.getLogger(__name__)


@dataclass
class BeamParams:
    """Parameters of the byte beam.

    ``K``: beam width. ``prune_threshold``: drop hypotheses whose share of the beam's mass is at most
    this. ``eos_tokens``: EOS tokens (``Token`` objects, ids or byte strings); by default the
    tokenizer's EOS. ``heal``: re-tokenize when no hypothesis can take the next byte, backing off at
    most ``heal_max_backoff`` bytes and committing at most ``heal_max_splits`` extra tokens.
    ``verbose``: log the beam after every byte (logger ``genlm_core.bytes.beam``, INFO).
    """

    K: int
    prune_threshold: float = 0.0
    eos_tokens: Iterable[Any] | None = None
    heal: bool = True
    heal_max_backoff: int | None = None
    heal_max_splits: int | None = None
    verbose: bool = False
    log_prune_threshold: float = field(init=False)

    def __post_init__(self) -> None:
        if self.K < 1:
            raise ValueError(f"K must be >= 1, got {self.K}")
        if not 0.0 <= self.prune_threshold < 1.0:
            raise ValueError(f"prune_threshold must be in [0, 1), got {self.prune_threshold}")
        self.log_prune_threshold = math.log(self.prune_threshold) if self.prune_threshold > 0 else -math.inf


def eos_spec(lm: AsyncLM, eos_tokens: Iterable[Any] | None) -> tuple[list[int], list[bytes]]:
    """EOS token ids and byte strings from ``eos_tokens`` (Tokens keep their id; ints are ids; bytes
    mean every token with those bytes). Default: the tokenizer's EOS token."""
    if eos_tokens is None:
        eos_id = getattr(lm.tokenizer, "eos_token_id", None)
        return ([int(eos_id)] if eos_id is not None else []), []
    ids, strings = [], []
    for t in eos_tokens:
        if hasattr(t, "token_id"):
            ids.append(int(t.token_id))
        elif isinstance(t, (int, np.integer)):
            ids.append(int(t))
        elif isinstance(t, (bytes, bytearray)):
            strings.append(bytes(t))
        else:
            raise TypeError(f"EOS tokens must be Tokens, token ids or bytes, got {type(t).__name__}")
    return ids, strings


class ByteBeamState:
    """A beam of :class:`LazyTrieState` hypotheses, heaviest first. ``await (beam << b)`` advances by a byte."""

    def __init__(self, states: list[LazyTrieState], params: BeamParams):
        self.states = sorted(states, key=lambda s: -s.weight)
        self.params = params

    @classmethod
    async def initial(
        cls,
        lm: AsyncLM,
        params: BeamParams,
        *,
        trie: AsyncTokenByteTrie | None = None,
        initial_context: list[int] | None = None,
        max_context_length: int | None = None,
        trie_opts: dict[str, Any] | None = None,
    ) -> ByteBeamState:
        """The beam before any byte. ``trie`` can be shared between beams over the same model and EOS;
        ``trie_opts`` go to :meth:`AsyncTokenByteTrie.from_vocab` (engine, atomic_byte_strings, ...)."""
        if trie is None:
            ids, strings = eos_spec(lm, params.eos_tokens)
            trie = AsyncTokenByteTrie.from_vocab(
                lm.byte_vocab, eos_token_ids=ids, eos_byte_strings=strings, **(trie_opts or {})
            )
        state = LazyTrieState.initial(lm, trie, TrieMode.WITH_EOS, initial_context, max_context_length)
        return cls([await state.materialize()], params)

    def __iter__(self) -> Iterator[LazyTrieState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    @cached_property
    def logZ(self) -> float:
        """Log-probability of the bytes consumed so far (exact when nothing was pruned)."""
        return float(logsumexp([s.weight for s in self.states])) if self.states else -math.inf

    async def extend(self, log_z: float) -> list[LazyTrieState]:
        """Commit every hypothesis's unfinished token, if it is a whole token; materialize (concurrently,
        so the model calls batch) those whose share of the mass is above the prune threshold."""
        extensions = [e for s in self.states for e in s.extend_all()]
        if extensions:
            log_z = float(np.logaddexp(log_z, logsumexp([e.weight for e in extensions])))
        keep = [e for e in extensions if e.weight - log_z > self.params.log_prune_threshold]
        return list(await asyncio.gather(*(e.materialize() for e in keep)))

    async def __lshift__(self, b: int) -> ByteBeamState:
        """The beam after byte ``b`` (0..255) or EOS (257)."""
        advanced = [n for s in self.states if (n := s << b) is not None]
        log_z = float(logsumexp([s.weight for s in advanced])) if advanced else -math.inf
        advanced += [n for e in await self.extend(log_z) if (n := e << b) is not None]
        beam = ByteBeamState(advanced, self.params)
        if not beam.states and self.params.heal and b != EOS:
            healer = TokenHealer(self.params.heal_max_backoff, self.params.heal_max_splits)
            for state in self.states:
                healed = await healer.try_heal(state, b)
                if healed is not None:
                    log.info("healed the beam at byte %r", bytes([b]))
                    beam = ByteBeamState([healed], self.params)
                    break
        if self.params.verbose:
            log.info("after %r:\n%r", bytes([b]) if b < 256 else "EOS", beam)
        return beam

    async def logp_next(self) -> LazyByteProbs:
        """Log-probabilities of the next byte (and EOS), marginalising over the beam's tokenizations."""
        if not self.states:
            raise ValueError("the beam is empty: no hypothesis is consistent with the bytes so far")
        rows = []
        for s in self.states:
            row = s.logp_next.ps + s.weight
            row[EOT] = -math.inf  # ending the token is represented by the extended hypotheses below
            rows.append(row)
        rows += [e.logp_next.ps + e.weight for e in await self.extend(self.logZ)]
        total = logsumexp(np.stack(rows), axis=0)
        return LazyByteProbs(total - logsumexp(total))

    def prune(self) -> ByteBeamState:
        """The ``K`` heaviest hypotheses whose share of the mass is above the threshold."""
        log_z = self.logZ
        kept = [s for s in self.states if s.weight - log_z > self.params.log_prune_threshold][: self.params.K]
        return ByteBeamState(kept, self.params)

    def with_mode(self, mode: TrieMode) -> ByteBeamState:
        return ByteBeamState([s.with_mode(mode) for s in self.states], self.params)

    async def _materialized(self) -> ByteBeamState:
        await asyncio.gather(*(s.materialize() for s in self.states))
        return self

    async def prefill(self, data: bytes, lookahead: int = 2) -> ByteBeamState:
        """The beam after ``data``, pruning before each byte; EOS tokens count as text meanwhile.

        The text is known in advance, so whenever a byte needs model calls, the contexts the next
        ``lookahead - 1`` bytes could need are requested in the same batch (a superset, found from
        the trie alone). Results are identical; the model runs about ``lookahead`` times less often.
        """
        beam = await self.with_mode(TrieMode.WITHOUT_EOS)._materialized()
        for i, b in enumerate(data):
            beam = beam.prune()
            prefetch = beam._prefetch(data[i : i + lookahead]) if lookahead > 1 else []
            beam = await (beam << b)
            for task in prefetch:
                await task
        return await beam.with_mode(TrieMode.WITH_EOS)._materialized()

    def _prefetch(self, upcoming: bytes) -> list[asyncio.Future[Any]]:
        """Start model calls for every context the beam could ask for while consuming ``upcoming``,
        if the first byte needs a model call anyway (else the earlier prefetch covered it)."""
        if not self.states:
            return []
        trie = self.states[0].trie.trie
        lm = self.states[0].lm_state.model
        frontier = [(s.lm_state, s.node) for s in self.states]
        contexts: dict[tuple[int, ...], None] = {}
        needed_now = False
        for depth, b in enumerate(upcoming):
            following = []
            for lm_state, node in frontier:
                child = trie.children(node).get(b)
                if child is not None:
                    following.append((lm_state, child))
                for _, token_id in trie.eot_edges(node):
                    committed = lm_state << token_id
                    key = tuple(committed.context)
                    if depth == 0 and lm.cache.get(lm.request(key)) is None:
                        needed_now = True
                    contexts[key] = None
                    child = trie.children(trie.root).get(b)
                    if child is not None:
                        following.append((committed, child))
            frontier = following
        if not needed_now:
            return []
        return [asyncio.ensure_future(lm.next_token_logprobs(c)) for c in contexts]

    async def greedy(self, context: bytes, steps: int) -> bytes:
        """``context`` followed by up to ``steps`` most probable bytes (stops at EOS)."""
        return await self._generate(context, steps, lambda q: q.argmax())

    async def sample(
        self, context: bytes, steps: int, draw: Callable[[LazyByteProbs], int] | None = None, seed: int | None = None
    ) -> bytes:
        """``context`` followed by up to ``steps`` sampled bytes (stops at EOS). ``draw`` picks a byte from
        the next-byte distribution (default: sampling with ``numpy.random.default_rng(seed)``)."""
        rng = np.random.default_rng(seed)

        def sample_byte(q: LazyByteProbs) -> int:
            p = np.exp(q.ps)
            return int(rng.choice(258, p=p / p.sum()))

        return await self._generate(context, steps, draw or sample_byte)

    async def _generate(self, context: bytes, steps: int, pick: Callable[[LazyByteProbs], int]) -> bytes:
        out = bytearray(context)
        beam = await self.prefill(context)
        for _ in range(steps):
            b = pick(await beam.logp_next())
            if b == EOS:
                break
            if b == EOT:
                raise RuntimeError("the next-byte distribution put mass on EOT")
            beam = await (beam.prune() << b)
            out.append(b)
        return bytes(out)

    def cleanup(self) -> None:
        """Stop the byte trie's worker thread (shared by every beam built from this one)."""
        if self.states:
            self.states[0].trie.cleanup()

    def __repr__(self) -> str:
        lines = [f"logZ: {self.logZ:.4f}"]
        for s in self.states:
            lines.append(f"  ({math.exp(s.weight - self.logZ):.4f}) {s!r}")
        return "\n".join(lines)
