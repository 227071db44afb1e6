"""The byte beam's prefetch: during prefill, ask the model now for the rows the coming bytes could need.

The text is known in advance, so when a byte needs model calls anyway, the contexts the beam could
still ask for over the next few bytes are requested in the same batch. The beam's future is
simulated with bounds: a hypothesis whose context has a row (already in the model's output cache,
read through :meth:`AsyncLM.cached_logprobs <genlm_core.lm.AsyncLM.cached_logprobs>`) has an exact
weight; one without keeps the weight it was made with, an upper bound (weights only fall). A
hypothesis whose bound is below the ``K``-th exact weight of hypotheses that surely exist is surely
pruned, and its continuations are not requested.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from genlm_core.context import Context
from genlm_core.lm import AsyncLM

from .lm_state import StatefulTokenizedLM
from .trie import Masses, TokenByteTrie, TrieMode
from .trie_state import LazyTrieState


class Bound(NamedTuple):
    """A hypothesis of the simulated beam. ``weight`` is exact when ``masses`` (of its context's next
    token) are known, else an upper bound; ``sure``: the hypothesis surely exists at this byte (before
    pruning), so its exact weight may rule others out."""

    lm_state: StatefulTokenizedLM
    node: int
    weight: float
    masses: Masses | None
    sure: bool


class Prefetched(NamedTuple):
    """What a prefetch started: the model ``requests`` (none when the first byte needed no new row),
    and the node ``masses`` of every cached row it looked at, by context, for the beam to reuse."""

    requests: list[asyncio.Future[Any]]
    masses: dict[Context, Masses]


class CachedMasses:
    """Node masses of the rows the model's output cache already holds, each context looked up once;
    counts the contexts without a row (the ones a prefetch would request)."""

    def __init__(self, lm: AsyncLM, trie: TokenByteTrie, mode: TrieMode):
        self.lm, self.trie, self.mode = lm, trie, mode
        self.by_context: dict[Context, Masses | None] = {}
        self.missing = 0

    def __call__(self, context: Context) -> Masses | None:
        if context not in self.by_context:
            row = self.lm.cached_logprobs(context)
            self.by_context[context] = None if row is None else self.trie.masses(row, self.mode, log=True)
            self.missing += row is None
        return self.by_context[context]

    def found(self) -> dict[Context, Masses]:
        """The masses of every context looked up that had a row."""
        return {context: m for context, m in self.by_context.items() if m is not None}

    def request_missing(self) -> list[asyncio.Future[Any]]:
        """Start a model call for every context looked up that had no row, in the order first seen."""
        return [asyncio.ensure_future(self.lm.next_token_logprobs(c)) for c, m in self.by_context.items() if m is None]


def descend(
    lm_state: StatefulTokenizedLM, node: int, child: int, weight: float, masses: Masses | None, sure: bool
) -> Bound | None:
    """The hypothesis moved from ``node`` to ``child`` of the trie: exact weight when ``masses`` are known
    (None when the child has no mass), else the same weight as a bound, not surely existing."""
    if masses is None:
        return Bound(lm_state, child, weight, None, False)
    if masses[child] <= 0.0:
        return None
    return Bound(lm_state, child, weight + math.log(masses[child]) - math.log(masses[node]), masses, sure)


def drop_surely_pruned(frontier: list[Bound], K: int) -> list[Bound]:
    """``frontier`` less the hypotheses lighter than the ``K``-th exact weight of those that surely exist."""
    sure = sorted((h.weight for h in frontier if h.sure), reverse=True)
    if len(sure) < K:
        return frontier
    return [h for h in frontier if h.weight >= sure[K - 1]]


def surely_kept(frontier: list[Bound], K: int) -> list[bool]:
    """Whether each hypothesis surely stays in the beam pruned to ``K``: it surely exists, and fewer
    than ``K`` others can weigh as much."""
    ranks = sorted(-h.weight for h in frontier)  # negated weights, ascending
    return [h.sure and bisect.bisect_right(ranks, -h.weight) <= K for h in frontier]


def commits(h: Bound, trie: TokenByteTrie, root_child: int | None, cached: CachedMasses, kept: bool) -> list[Bound]:
    """``h`` ending its token at each token whose bytes it spelled, then starting the next token with the
    byte that leads to ``root_child`` (None: no token starts with it, so only the commit is looked up)."""
    out = []
    for leaf, token_id in trie.eot_edges(h.node):
        made = descend(h.lm_state, h.node, leaf, h.weight, h.masses, kept)
        if made is None:
            continue
        committed = h.lm_state << token_id
        masses = cached(committed.context)
        if root_child is not None:
            following = descend(committed, trie.root, root_child, made.weight, masses, kept)
            if following is not None:
                out.append(following)
    return out


def advance(frontier: list[Bound], kept: list[bool], b: int, trie: TokenByteTrie, cached: CachedMasses) -> list[Bound]:
    """The simulated beam after byte ``b``: each hypothesis inside its token, then through each commit."""
    root_child = trie.children(trie.root).get(b)
    following: list[Bound] = []
    for h, k in zip(frontier, kept):
        child = trie.children(h.node).get(b)
        if child is not None and (inside := descend(h.lm_state, h.node, child, h.weight, h.masses, k)) is not None:
            following.append(inside)
        following += commits(h, trie, root_child, cached, k)
    return following


def prefetch(states: Sequence[LazyTrieState], K: int, upcoming: bytes, budget: int | None = None) -> Prefetched:
    """Start model calls for every context a beam of ``states`` pruned to ``K`` could still ask for while
    consuming ``upcoming``, if the first byte needs a model call anyway (else an earlier prefetch covered
    it). Stops after the byte at which more than ``budget`` new contexts are wanted (None: no limit)."""
    if not states:
        return Prefetched([], {})
    first = states[0]
    trie = first.trie.trie
    cached = CachedMasses(first.lm_state.model, trie, first.mode)
    frontier = [Bound(s.lm_state, s.node, s.weight, s.masses, True) for s in states]
    for depth, b in enumerate(upcoming):
        if depth:
            frontier = drop_surely_pruned(frontier, K)
            kept = surely_kept(frontier, K)
        else:
            kept = [h.sure for h in frontier]
        frontier = advance(frontier, kept, b, trie, cached)
        if (depth == 0 and cached.missing == 0) or (budget is not None and cached.missing > budget):
            break
    return Prefetched(cached.request_missing(), cached.found())
