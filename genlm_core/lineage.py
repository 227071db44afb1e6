"""Which request continues which context: the lineage of particles across the steps of a program.

A particle program asks for ``ids``, picks a token ``t``, then asks for ``ids + [t]``. An engine that
keeps sequences alive between calls (vLLM's resumable sessions) continues the live sequence of
``ids`` with ``[t]`` instead of computing ``ids + [t]`` again; a router sends ``ids + [t]`` where
``ids`` was computed. Both ask the same question, answered here once: the nearest earlier context
that a request extends by at most ``lookback`` tokens.

Matching is on the exact token tuple (and adapter), never on object identity, so a row always
belongs to exactly the context the caller gave. Contexts are keyed by :class:`~genlm_core.request.Request`,
whose hash reads a fixed number of ids: a lookup costs a C-speed slice and comparison of the context,
never a Python pass over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from genlm_core.request import Request

V = TypeVar("V")
H = TypeVar("H")

#: A context and the adapter it runs under: what a live sequence is known by.
LineageKey = Request


def nearest_prefix(
    lookup: Callable[[Request], V | None], request: Request, lookback: int, shortest_cut: int = 0
) -> tuple[int, V] | None:
    """The first hit of ``lookup`` on ``request``'s context less ``shortest_cut``, ``shortest_cut + 1``,
    ..., ``lookback`` trailing tokens (never the empty context), as requests under the same
    adapter: ``(tokens cut, value)``, or None."""
    n = len(request)
    for cut in range(shortest_cut, min(lookback, n - 1) + 1):
        value = lookup(request if cut == 0 else request.prefix(n - cut))
        if value is not None:
            return cut, value
    return None


@dataclass(frozen=True)
class Continuation(Generic[H]):
    """A request that extends a live sequence: feed ``new_tokens`` to ``handle``. With ``fork``,
    another request of the batch continues ``handle``: this one starts a sequence of its own, which
    may share ``handle``'s cached context (a particle's sibling after resampling)."""

    handle: H
    new_tokens: tuple[int, ...]
    fork: bool = False


class LiveContexts(Generic[H]):
    """The sequences an engine holds alive, by exact context; each is continued by at most one
    request of a batch.

    :meth:`plan` matches a batch against them; afterwards the caller :meth:`keep` s the sequences the
    batch left alive. Sequences nobody continued stay live, oldest first in line for :meth:`evict`,
    so a particle whose row comes in a later batch still continues its sequence;
    ``max_idle_batches`` bounds how many batches in a row a sequence may go unclaimed before
    :meth:`plan` lets it go (None: until evicted)."""

    def __init__(self, lookback: int = 1, max_idle_batches: int | None = None):
        self.lookback = lookback
        self.max_idle_batches = max_idle_batches
        self._live: dict[LineageKey, H] = {}
        self._idle: dict[LineageKey, int] = {}  # batches since each live sequence was last kept

    def __len__(self) -> int:
        return len(self._live)

    def plan(self, requests: Sequence[Request]) -> tuple[list[Continuation[H] | None], list[H]]:
        """One :class:`Continuation` (or None: no live sequence to extend) per request, and the
        handles of sequences idle for more than ``max_idle_batches`` (release them). A request
        extending a sequence that an earlier request of the batch continues gets a ``fork``."""
        live = self._live
        continued: dict[LineageKey, H] = {}
        plan: list[Continuation[H] | None] = []
        for request in requests:

            def claim(key: Request) -> tuple[H, bool] | None:
                if key in live:  # a live sequence is continued once; later requests fork it
                    continued[key] = live.pop(key)
                    return continued[key], False
                return (continued[key], True) if key in continued else None

            hit = nearest_prefix(claim, request, self.lookback, shortest_cut=1)
            if hit is None:
                plan.append(None)
            else:
                cut, (handle, fork) = hit
                plan.append(Continuation(handle, request.new_tokens(len(request) - cut), fork))
        released = []
        for key in continued:
            self._idle.pop(key, None)
        for key in list(live):
            self._idle[key] = idle = self._idle.get(key, 0) + 1
            if self.max_idle_batches is not None and idle > self.max_idle_batches:
                released.append(live.pop(key))
                del self._idle[key]
        return plan, released

    def keep(self, request: Request, handle: H) -> H | None:
        """``handle`` holds ``request``'s context alive for the next batch (the newest in line).
        Returns the handle that held the same context before, if any: release it."""
        before = self._live.pop(request, None)
        self._live[request] = handle
        self._idle[request] = 0
        return before if before != handle else None

    def items(self) -> list[tuple[LineageKey, H]]:
        """``(context, handle)`` of each live sequence, kept longest ago first."""
        return list(self._live.items())

    def contexts(self) -> list[LineageKey]:
        """The live sequences' contexts (as requests), kept longest ago first (the order of :meth:`evict`)."""
        return list(self._live)

    def evict(self) -> H | None:
        """Forget the live sequence kept longest ago and return its handle (to release), or None."""
        if not self._live:
            return None
        key = next(iter(self._live))
        self._idle.pop(key, None)
        return self._live.pop(key)

    def release_all(self) -> list[H]:
        """Forget every live sequence; their handles, to release."""
        handles, self._live, self._idle = list(self._live.values()), {}, {}
        return handles
