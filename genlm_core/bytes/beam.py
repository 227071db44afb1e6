"""``ByteBeamState``: a language model over bytes, from any token-level AsyncLM.

The probability of a byte prefix is the sum, over every tokenization consistent with it, of the
token sequence's probability; the beam keeps the ``K`` heaviest hypotheses (exact when nothing is
pruned). Every model call and trie sum of one step is issued concurrently, so they batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from genlm_core.closing import CLOSED, Closed
from genlm_core.context import Context
from genlm_core.errors import ClosedError
from genlm_core.lm import AsyncLM
from genlm_core.validation import as_bytes, check_bool, check_int, check_real, check_seed, is_int

from .heal import TokenHealer
from .prefetch import prefetch
from .probs import EOS, EOT, LazyByteProbs, check_symbol, logsumexp
from .trie import AsyncTokenByteTrie, Masses, TrieMode
from .trie_state import LazyTrieState

log = logging.getLogger(__name__)


#: Prefill stops speculating after the byte at which more than this many new contexts are wanted.
PREFETCH_BUDGET = 24


@dataclass
class BeamParams:
    """Parameters of the byte beam; the fields, their order and defaults are genlm-bytes'.

    ``K``: beam width. ``prune_threshold``: drop hypotheses whose share of the beam's mass is at most
    this. ``verbose``: log the beam after every byte (logger ``genlm_core.bytes.beam``, INFO).
    ``eos_byte_strings``: the tokens that end the text (byte strings, ``Token`` objects or token ids;
    a byte string means every token with those bytes), kept as a set as genlm-bytes does; None or an
    empty set means none, so the text never ends. ``heal``: re-tokenize when no hypothesis can take
    the next byte, backing off at most ``heal_max_backoff`` bytes and committing at most
    ``heal_max_splits`` extra tokens.
    ``eos_tokens``: genlm-bytes' older name for ``eos_byte_strings`` (DeprecationWarning).

    Every field is checked at construction: ``K`` an integer >= 1, ``prune_threshold`` in
    ``[0, 1)``, the healing limits None or integers >= 0, the EOS tokens a collection (a bare
    ``b"</s>"`` would be read as four token ids, so it is a TypeError).
    """

    K: int
    prune_threshold: float = 0.0
    verbose: bool = False
    eos_byte_strings: Iterable[Any] | None = None
    heal: bool = True
    heal_max_backoff: int | None = None
    heal_max_splits: int | None = None
    eos_tokens: Iterable[Any] | None = None
    log_prune_threshold: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.K = check_int(self.K, "K", 1)
        self.prune_threshold = check_real(self.prune_threshold, "prune_threshold", 0.0, below=1.0)
        self.heal = check_bool(self.heal, "heal")
        self.verbose = check_bool(self.verbose, "verbose")
        for name in ("heal_max_backoff", "heal_max_splits"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_int(value, name, 0))
        if self.eos_tokens is not None:
            if self.eos_byte_strings is not None:
                raise TypeError(
                    "Cannot specify both 'eos_byte_strings' and the deprecated 'eos_tokens' (its older name)"
                )
            warnings.warn("BeamParams: 'eos_tokens' is deprecated; use 'eos_byte_strings'", DeprecationWarning, 2)
            self.eos_byte_strings, self.eos_tokens = self.eos_tokens, None
        given = self.eos_byte_strings
        self.eos_byte_strings = eos_set(check_eos_tokens(given) if given is not None else [])
        self.log_prune_threshold = math.log(self.prune_threshold) if self.prune_threshold > 0 else -math.inf


def check_eos_tokens(eos_tokens: Any) -> list[Any]:
    """EOS tokens as a list of Tokens, ids (integers >= 0) and byte strings; TypeError/ValueError otherwise."""
    if isinstance(eos_tokens, (bytes, bytearray, str)) or is_int(eos_tokens):
        raise TypeError(
            f"eos_byte_strings must be a list of tokens, got the single value {eos_tokens!r}: write [{eos_tokens!r}]"
        )
    if not isinstance(eos_tokens, Iterable):
        raise TypeError(f"eos_byte_strings must be a list of Tokens, token ids or byte strings, got {eos_tokens!r}")
    out: list[Any] = []
    for t in eos_tokens:
        if isinstance(t, (bytes, bytearray)):  # a Token is bytes too, and keeps its id
            out.append(t)
        elif is_int(t):
            out.append(check_int(t, "eos_byte_strings entry", 0))
        else:
            raise TypeError(f"eos_byte_strings entries must be Tokens, token ids or byte strings, got {t!r}")
    return out


def eos_set(tokens: list[Any]) -> set[Any]:
    """EOS tokens as a set, as genlm-bytes keeps them. A ``Token`` equals its plain bytes, so plain byte
    strings go in first: a Token whose bytes are listed plainly too (every token with them) adds nothing."""
    plain = [t for t in tokens if type(t) in (bytes, bytearray)]
    return {bytes(t) for t in plain} | {t for t in tokens if type(t) not in (bytes, bytearray) and t not in plain}


def eos_spec(lm: AsyncLM, eos_tokens: Iterable[Any] | None) -> tuple[list[int], list[bytes]]:
    """EOS token ids and byte strings from ``eos_tokens`` (Tokens keep their id; ints are ids; bytes
    mean every token with those bytes). None: no EOS."""
    if eos_tokens is None:
        return [], []
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

    def __init__(self, states: list[LazyTrieState], params: BeamParams, trie: AsyncTokenByteTrie | None = None):
        self.states = sorted(states, key=lambda s: -s.weight)
        self.params = params
        self.trie = trie if trie is not None else (states[0].trie if states else None)
        self._masses_seen: dict[Context, Masses] = {}  # by context, from prefill's prefetch

    def _ensure_open(self) -> None:
        if self.trie is not None and self.trie.closed:
            raise ClosedError("this byte beam was closed by cleanup() (its byte trie is shut down)")

    @classmethod
    async def initial(
        cls,
        lm: AsyncLM,
        params: BeamParams,
        trie_opts: dict[str, Any] | None = None,
        *,
        trie: AsyncTokenByteTrie | None = None,
        initial_context: list[int] | None = None,
        max_context_length: int | None = None,
    ) -> ByteBeamState:
        """The beam before any byte. ``trie`` can be shared between beams over the same model and EOS;
        ``trie_opts`` go to :meth:`AsyncTokenByteTrie.from_vocab` (engine, atomic_byte_strings, ...)."""
        if not isinstance(lm, AsyncLM):
            raise TypeError(f"lm must be an AsyncLM, got {type(lm).__name__}")
        if not isinstance(params, BeamParams):
            raise TypeError(f"params must be BeamParams, got {type(params).__name__}")
        lm.ensure_open()
        if initial_context is not None:
            initial_context = list(lm.request(initial_context).token_ids)
        if max_context_length is not None:
            max_context_length = check_int(max_context_length, "max_context_length", 1)
        if trie is None:
            ids, strings = eos_spec(lm, params.eos_byte_strings)
            trie = AsyncTokenByteTrie.from_vocab(
                lm.byte_vocab, eos_token_ids=ids, eos_byte_strings=strings, **(trie_opts or {})
            )
        state = LazyTrieState.initial(lm, trie, TrieMode.WITH_EOS, initial_context, max_context_length)
        return cls([await state.materialize()], params, trie)

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
        self._ensure_open()
        keep = [e for e in extensions if e.weight - log_z > self.params.log_prune_threshold]
        if self._masses_seen:  # computed by the prefetch from the same rows
            for e in keep:
                if e.masses is None:
                    e.masses = self._masses_seen.get(e.lm_state.context)
        return list(await asyncio.gather(*(e.materialize() for e in keep)))

    async def __lshift__(self, b: int) -> ByteBeamState:
        """The beam after byte ``b`` (0..255) or EOS (257); anything else is a TypeError/ValueError."""
        b = check_symbol(b)
        self._ensure_open()
        advanced = [n for s in self.states if (n := s << b) is not None]
        log_z = float(logsumexp([s.weight for s in advanced])) if advanced else -math.inf
        advanced += [n for e in await self.extend(log_z) if (n := e << b) is not None]
        beam = type(self)(advanced, self.params, self.trie)
        if not beam.states and self.params.heal and b != EOS:
            healer = TokenHealer(self.params.heal_max_backoff, self.params.heal_max_splits)
            for state in self.states:
                healed = await healer.try_heal(state, b)
                if healed is not None:
                    log.info("healed the beam at byte %r", bytes([b]))
                    beam = type(self)([healed], self.params, self.trie)
                    break
        if self.params.verbose:
            log.info("after %r:\n%r", bytes([b]) if b < 256 else "EOS", beam)
        return beam

    async def logp_next(self) -> LazyByteProbs:
        """Log-probabilities of the next byte (and EOS), marginalising over the beam's tokenizations."""
        self._ensure_open()
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
        return type(self)(kept, self.params, self.trie)

    def with_mode(self, mode: TrieMode) -> ByteBeamState:
        return type(self)([s.with_mode(mode) for s in self.states], self.params, self.trie)

    async def _materialized(self) -> ByteBeamState:
        await asyncio.gather(*(s.materialize() for s in self.states))
        return self

    async def prefill(self, data: bytes, lookahead: int | None = None) -> ByteBeamState:
        """The beam after ``data``, pruning before each byte; EOS tokens count as text meanwhile.

        The text is known in advance, so whenever a byte needs model calls, the contexts the next
        ``lookahead - 1`` bytes could still need are requested in the same batch (found from the trie
        and the rows at hand, leaving out hypotheses that are surely pruned by then; see
        :mod:`genlm_core.bytes.prefetch`), up to :data:`PREFETCH_BUDGET` new contexts. Results are the
        same rows; the model runs less often, on more tokens. Default: 6 on a backend that runs shared tokens
        once (``packs_shared_tokens``, genlm-hf), else 2 (the fastest on SmolLM2 on CPU: see
        ``benchmarks/bench_bytes.py``). A ``str`` is read as its UTF-8 bytes.
        """
        data = as_bytes(data, "data")
        self._ensure_open()
        if lookahead is None:
            lm = self.states[0].lm_state.model if self.states else None
            lookahead = 6 if getattr(lm, "packs_shared_tokens", False) else 2
        lookahead = check_int(lookahead, "lookahead", 1)
        beam = await self.with_mode(TrieMode.WITHOUT_EOS)._materialized()
        for i, b in enumerate(data):
            beam = beam.prune()
            requests: list[asyncio.Future[Any]] = []
            if lookahead > 1:
                requests, beam._masses_seen = prefetch(
                    beam.states, beam.params.K, data[i : i + lookahead], PREFETCH_BUDGET
                )
            beam = await (beam << b)
            for request in requests:
                await request
        return await beam.with_mode(TrieMode.WITH_EOS)._materialized()

    async def greedy(self, context: bytes, steps: int) -> bytes:
        """``context`` (bytes, or a str read as UTF-8) followed by up to ``steps`` most probable bytes
        (stops at EOS)."""
        return await self._generate(context, steps, lambda q: q.argmax())

    async def sample(
        self, context: bytes, steps: int, draw: Callable[[LazyByteProbs], int] | None = None, seed: int | None = None
    ) -> bytes:
        """``context`` followed by up to ``steps`` sampled bytes (stops at EOS). ``draw`` picks a byte from
        the next-byte distribution (default: sampling with ``numpy.random.default_rng(seed)``)."""
        rng = np.random.default_rng(check_seed(seed))

        def sample_byte(q: LazyByteProbs) -> int:
            p = np.exp(q.ps)
            return int(rng.choice(258, p=p / p.sum()))

        return await self._generate(context, steps, draw or sample_byte)

    async def _generate(self, context: bytes, steps: int, pick: Callable[[LazyByteProbs], int]) -> bytes:
        context = as_bytes(context, "context")
        steps = check_int(steps, "steps", 0)
        out = bytearray(context)
        beam = await self.prefill(context)
        for _ in range(steps):
            b = check_symbol(pick(await beam.logp_next()))
            if b == EOS:
                break
            if b == EOT:
                raise RuntimeError("the next-byte distribution put mass on EOT")
            beam = await (beam.prune() << b)
            out.append(b)
        return bytes(out)

    def close(self) -> None:
        """Stop the byte trie's worker thread (shared by every beam built from this one): every later
        call on those beams raises ClosedError. Calling it again is harmless."""
        if self.trie is not None:
            self.trie.close()

    def cleanup(self) -> Closed:
        """:meth:`close`; the result may be awaited, as genlm-bytes' ``await beam.cleanup()``."""
        self.close()
        return CLOSED

    def __repr__(self) -> str:
        lines = [f"logZ: {self.logZ:.4f}"]
        for s in self.states:
            lines.append(f"  ({math.exp(s.weight - self.logZ):.4f}) {s!r}")
        return "\n".join(lines)
