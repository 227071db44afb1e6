"""Which request continues which context: the lineage of particles across the steps of a program.

A particle program asks for ``ids``, picks a token ``t``, then asks for ``ids + [t]``. An engine that
keeps sequences alive between calls (:class:`~genlm_core.live_index.LiveIndex`) continues the live
sequence of ``ids`` with ``[t]`` instead of computing ``ids + [t]`` again; a router
(:mod:`genlm_vllm.drivers.replicas`) sends ``ids + [t]`` where ``ids`` was computed. Both ask the same
question, answered here once: the nearest earlier context that a request extends by at most
``lookback`` tokens (:func:`prefixes`, :func:`nearest_prefix`); :class:`Continuation` is the answer for a live sequence.

Matching is on the exact token tuple (and adapter), never on object identity, so a row always
belongs to exactly the context the caller gave. Contexts are keyed by :class:`~genlm_core.request.Request`,
whose hash reads a fixed number of ids. A request's prefix a few tokens back is, where it can be, the
very context it was made from (:meth:`~genlm_core.context.Context.prefix`: a handle's parent, or the
checked context a list extends by one token): then the lookup makes nothing and compares by identity;
otherwise it costs a C-speed slice and comparison of the context, never a Python pass over it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from genlm_core.request import Request

V = TypeVar("V")
H = TypeVar("H")

#: A context and the adapter it runs under: what a live sequence is known by.
LineageKey = Request


def prefixes(request: Request, lookback: int, shortest_cut: int = 0) -> Iterator[tuple[int, Request]]:
    """``request``'s context less ``shortest_cut``, ``shortest_cut + 1``, ..., ``lookback`` trailing
    tokens (never the empty context), nearest first, as requests under the same adapter:
    ``(tokens cut, prefix)``. A caller that decides as it goes (the live index's plan) reads these
    itself; :func:`nearest_prefix` looks each up."""
    n = len(request)
    for cut in range(shortest_cut, min(lookback, n - 1) + 1):
        yield cut, (request if cut == 0 else request.prefix(n - cut))


def nearest_prefix(
    lookup: Callable[[Request], V | None], request: Request, lookback: int, shortest_cut: int = 0
) -> tuple[int, V] | None:
    """The first hit of ``lookup`` on :func:`prefixes` of ``request``: ``(tokens cut, value)``, or None."""
    for cut, prefix in prefixes(request, lookback, shortest_cut):
        value = lookup(prefix)
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
