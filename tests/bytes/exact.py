"""Exact byte-prefix probabilities by enumerating every tokenization: the reference for the byte LM."""

from __future__ import annotations

import bisect
import math

import numpy as np

from genlm_core.bytes import EOS


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

    async def row(self, ctx):
        key = tuple(ctx)
        if key not in self.rows:
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
        return float(np.logaddexp.reduce(terms)) if terms else -math.inf

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
        out[EOS] = np.logaddexp.reduce(eos) if eos else -np.inf
        return out - np.logaddexp.reduce(out[np.isfinite(out)])


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
