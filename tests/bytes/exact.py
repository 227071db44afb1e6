"""Exact byte-prefix probabilities by enumerating every tokenization: the reference for the byte LM."""

from __future__ import annotations

import bisect
import math

import numpy as np

from genlm_core.bytes import EOS
from genlm_core.testing import bounds


class Enumerator:
    """Exact masses by enumerating tokenizations, with the vocabulary indexed by bytes. Each row is
    the distribution its float32 logprobs define, normalised in float64 (what the beam uses)."""

    def __init__(self, lm):
        self.lm = lm
        vocab = [bytes(t) for t in lm.byte_vocab]
        self.by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            self.by_bytes.setdefault(b, []).append(i)
        self.sorted = sorted((b, i) for i, b in enumerate(vocab))
        self.keys = [b for b, _ in self.sorted]
        self.rows: dict[tuple[int, ...], np.ndarray] = {}
        self.fresh: list[tuple[int, ...]] = []  # contexts whose row was not in the model's cache when read
        self.most_negative = 0.0  # the most negative log-probability of a tokenization summed so far
        self.most_terms = 1  # the most tokenizations one log-sum-exp has summed

    async def row(self, ctx):
        key = tuple(ctx)
        if key not in self.rows:
            if self.lm.cached_logprobs(list(ctx)) is None:
                self.fresh.append(key)
            lp = (await self.lm.next_token_logprobs(list(ctx))).double()
            self.rows[key] = (lp - lp.logsumexp(0)).numpy()
        return self.rows[key]

    def starting_with(self, rest):
        at = bisect.bisect_left(self.keys, rest)
        while at < len(self.keys) and self.keys[at].startswith(rest):
            yield self.sorted[at][1]
            at += 1

    async def prefix_logmass(self, context, x, exclude_last=frozenset()):
        """log P(the text starts with x): every token sequence spelling a proper prefix of x, then a
        token whose bytes start with the rest (not one of ``exclude_last``)."""
        terms, stack = [], [(tuple(context), 0, 0.0)]
        while stack:
            ctx, m, lp = stack.pop()
            row, rest = await self.row(ctx), x[m:]
            terms += [lp + row[t] for t in self.starting_with(rest) if t not in exclude_last]
            for k in range(1, len(rest)):
                stack += [(ctx + (t,), m + k, lp + row[t]) for t in self.by_bytes.get(rest[:k], ())]
        self._saw(terms)
        return float(np.logaddexp.reduce(terms)) if terms else -math.inf

    def _saw(self, terms):
        finite = [t for t in terms if math.isfinite(t)]
        if finite:
            self.most_negative = min(self.most_negative, min(finite))
            self.most_terms = max(self.most_terms, len(finite))

    async def spellings(self, context, x):
        """(context, log probability) of every token sequence spelling exactly x."""
        out, stack = [], [(tuple(context), 0, 0.0)]
        while stack:
            ctx, m, lp = stack.pop()
            if m == len(x):
                out.append((ctx, lp))
                continue
            row = await self.row(ctx)
            for k in range(1, len(x) - m + 1):
                stack += [(ctx + (t,), m + k, lp + row[t]) for t in self.by_bytes.get(x[m : m + k], ())]
        return out

    async def next_byte(self, context, x, eos_ids):
        out = np.full(258, -np.inf)
        for b in range(256):
            out[b] = await self.prefix_logmass(context, x + bytes([b]), frozenset(eos_ids))
        eos = [lp + (await self.row(ctx))[e] for ctx, lp in await self.spellings(context, x) for e in eos_ids]
        self._saw(eos)
        out[EOS] = np.logaddexp.reduce(eos) if eos else -np.inf
        return out - np.logaddexp.reduce(out[np.isfinite(out)])

    def tolerance(self, length: int, next_byte: bool = False) -> bounds.Bound:
        """Bound on ``|beam - enumeration|`` of a log Z after ``length`` bytes (``next_byte``: of an entry of
        the normalised next-byte distribution), when both read the same float32 rows (check it with
        :meth:`same_rows`): two float64 computations, each off the exact value by:

        - the beam: every hypothesis's log weight is built by at most ``n = 2 (length + 1)`` updates
          (a byte, or a token committed), each ``+ log m_child - log m_node`` with node masses float64
          sums of at most ``V`` exponentials (relative ``FN_ULPS_U u`` each, then :func:`bounds.sum_error`
          of ``V`` terms: ``s_V``); a log adds ``u |log m|``, an addition ``u |w|``. With ``M`` bounding
          every log weight and log mass (``2 |most negative tokenization| + log V``): ``n (2 c u + 2 s_V
          + 4 u M)``, then the log-sum-exp over the hypotheses (``c u + s_m + 2 u M``).
        - the enumeration: each tokenization is a float64 sum of at most ``n`` entries of rows
          normalised in float64 (:func:`bounds.log_softmax_error` at ``M``, in float64, each), plus
          ``gamma_n M`` for the sum; ``np.logaddexp.reduce`` over ``m`` of them adds at most ``(c + 2) u
          (M + 1)`` per step, ``min(m, lam sqrt(m))`` steps' worth (Higham-Mary, as for sums).

        A next-byte entry is such a log-mass minus a log-sum-exp of the 258 of them: twice the bound
        (for ``length + 1`` bytes), plus that normaliser's own rounding."""
        u, c, vocab = bounds.U64, bounds.FN_ULPS_U, len(self.lm.byte_vocab)
        n = 2 * (length + 2 if next_byte else length + 1)
        big = 2 * abs(self.most_negative) + math.log(vocab)
        m = self.most_terms
        beam = beam_float64_error(vocab, n, big, m)
        rows = n * float(bounds.log_softmax_error(vocab, big, u)) + bounds.gamma(n, u) * big
        enum = rows + min(m, bounds.LAMBDA * math.sqrt(m)) * (c + 2) * u * (big + 1)
        one = beam + enum
        if next_byte:
            one = 2 * one + c * u + float(bounds.sum_error(258, 1.0, u)) + 2 * u * big
        return bounds.Bound(
            one, f"two float64 computations from the same float32 rows: {n} weight updates, V={vocab}, M={big:.3g}"
        )

    def same_rows(self) -> bool:
        """Whether every row the enumeration read was in the model's output cache already (so it is the
        row the beam read, bit for bit): :meth:`tolerance` assumes it. True to sit in an ``assert``."""
        assert not self.fresh, f"rows the beam did not read: {self.fresh[:3]}"
        return True


def beam_float64_error(vocab: int, updates: int, magnitude: float, states: int) -> float:
    """The beam's part of :meth:`Enumerator.tolerance`: a log Z from hypotheses whose log weights took at
    most ``updates`` updates each, over rows of ``vocab`` entries, every log weight and log mass at most
    ``magnitude`` in size, summed over ``states`` hypotheses (see there)."""
    u, c = bounds.U64, bounds.FN_ULPS_U
    s_v = float(bounds.sum_error(vocab, 1.0, u))
    per_state = updates * (2 * c * u + 2 * s_v + 4 * u * magnitude)
    return per_state + c * u + float(bounds.sum_error(states, 1.0, u)) + 2 * u * magnitude


def lattice(states, upcoming):
    """Every context a beam of ``states`` could ask for while consuming ``upcoming``, pruning aside
    (brute force: every hypothesis followed through every token boundary)."""
    trie = states[0].trie.trie
    frontier, out = [(s.lm_state, s.node) for s in states], set()
    for b in upcoming:
        following = []
        for lm_state, node in frontier:
            if (child := trie.children(node).get(b)) is not None:
                following.append((lm_state, child))
            for _, token_id in trie.eot_edges(node):
                committed = lm_state << token_id
                out.add(tuple(committed.context))
                if (child := trie.children(trie.root).get(b)) is not None:
                    following.append((committed, child))
        frontier = following
    return out
