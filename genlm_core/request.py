"""Requests: a validated snapshot of a context, the key it is cached and batched under.

A particle program asks for a context, then for that context plus one token, and so on. What is
done per request here costs the same for a context of 24 tokens or 8,000, apart from C-speed copies
and comparisons: a request's hash reads a fixed number of ids (:func:`context_hash`), and a context
that extends one checked recently by a token is checked in that token only (:class:`ContextChecker`).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
from typing import Any

from genlm_core.validation import check_token_ids

#: Token ids sampled into a context's hash: the last ones and as many spread over the whole.
HASH_SAMPLE = 32


class Request:
    """One next-token request: the context (a tuple of ids) and the adapter active when it was made.

    A request is its own cache and batching key. Its hash is computed once, from the context's
    length, its last :data:`HASH_SAMPLE` ids and as many spread over the rest, so hashing costs the
    same for a context of 24 tokens or 8,000; equality compares the whole context (and adapter), so
    two requests are equal exactly when their contexts are. Immutable.
    """

    __slots__ = ("_hash", "adapter", "token_ids")

    token_ids: tuple[int, ...]
    adapter: str | None
    _hash: int

    def __init__(self, token_ids: tuple[int, ...], adapter: str | None = None):
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "adapter", adapter)
        object.__setattr__(self, "_hash", context_hash(token_ids, adapter))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Request is immutable (cannot set {name!r})")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Request):
            return NotImplemented
        return self._hash == other._hash and self.adapter == other.adapter and self.token_ids == other.token_ids

    def __repr__(self) -> str:
        ids = self.token_ids
        shown = repr(ids)
        if len(ids) > 12:
            shown = f"({', '.join(map(str, ids[:4]))}, ..., {', '.join(map(str, ids[-4:]))})"
        return f"Request(token_ids={shown} [{len(ids)} tokens], adapter={self.adapter!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Request, (self.token_ids, self.adapter))

    def prefix(self, length: int) -> Request:
        """The request for the first ``length`` tokens of this context, under the same adapter."""
        return Request(self.token_ids[:length], self.adapter)


def context_hash(token_ids: tuple[int, ...], adapter: str | None = None, length: int | None = None) -> int:
    """A hash of a context that reads at most ``2 * HASH_SAMPLE`` of its ids (see :class:`Request`):
    equal contexts hash alike; different ones usually differ in length or in their last ids. With
    ``length``: the hash of ``token_ids[:length]``, without making that slice."""
    n = len(token_ids) if length is None else length
    return hash((n, adapter, token_ids[max(0, n - HASH_SAMPLE) : n], token_ids[0 : n : n // HASH_SAMPLE + 1]))


def _untracker() -> Any:
    """CPython's ``PyObject_GC_UnTrack``, or None elsewhere."""
    if sys.implementation.name != "cpython":
        return None
    try:
        untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:
        return None
    untrack.argtypes = [ctypes.py_object]
    untrack.restype = None
    return untrack


_untrack = _untracker()


def untrack_ids(token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """``token_ids`` (a tuple of ints) taken out of the cyclic garbage collector's view at once.

    A tuple of ints can be part of no reference cycle. CPython untracks such tuples itself, but only
    once a collection has traversed them, every id of every young context: for 256 particles with
    8,000-token contexts that was most of a step's host time. Returns its argument.
    """
    if _untrack is not None and gc.is_tracked(token_ids):
        _untrack(token_ids)
    return token_ids


#: Most tokens, over all contexts, that :class:`ContextChecker` remembers as checked.
CHECKED_TOKENS = 2**23


class ContextChecker:
    """Validates contexts and snapshots them as requests, in time independent of a context's length
    for the usual step of a program (a context one token longer than one checked recently).

    A context that is not such an extension is checked whole by
    :func:`~genlm_core.validation.check_token_ids`. For an extension, the context checked before is
    found by the hash of the prefix (every id but the last: :func:`context_hash` reads a fixed
    number of ids), the request is built from that checked prefix and the new id, and it is compared
    whole, by value, with the caller's context: only an equal one is taken (so a hash is never trusted
    alone, and an engine always sees the exact ids that were checked; a position already checked is
    read by value: ``3.0`` where ``3`` was checked reads as ``3``). Then only the new id is checked.
    The cost: one copy of the caller's context, one of the checked prefix, one comparison, all at C
    speed. Remembers the most recent contexts, up to :data:`CHECKED_TOKENS` tokens in all.
    Thread-safe; a race costs a full check at most.
    """

    def __init__(self, vocab_size: int, max_tokens: int = CHECKED_TOKENS):
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.tokens = 0
        self.extended = 0  #: requests checked in their new token only
        self.checked = 0  #: requests checked whole
        self._known: dict[int, Request] = {}  # by the request's hash; a candidate, compared whole before use
        self._lock = threading.Lock()

    def request(self, token_ids: Any, adapter: str | None) -> Request:
        """The request for ``token_ids`` under ``adapter``: a snapshot, checked (TypeError, ValueError)."""
        if type(token_ids) is list or type(token_ids) is tuple:
            n = len(token_ids)
            if n >= 2:
                last = token_ids[-1]
                if type(last) is int and 0 <= last < self.vocab_size:
                    snapshot = tuple(token_ids)
                    parent = self._known.get(context_hash(snapshot, adapter, n - 1))
                    if parent is not None and parent.adapter == adapter and len(parent.token_ids) == n - 1:
                        ids = parent.token_ids + (last,)
                        if ids == snapshot:
                            self.extended += 1
                            return self._remember(Request(untrack_ids(ids), adapter))
        self.checked += 1
        return self._remember(Request(untrack_ids(check_token_ids(token_ids, self.vocab_size)), adapter))

    def _remember(self, request: Request) -> Request:
        with self._lock:
            known = self._known
            old = known.pop(request._hash, None)  # the same context again, or another of the same hash
            if old is not None:
                self.tokens -= len(old.token_ids)
            known[request._hash] = request
            self.tokens += len(request.token_ids)
            while self.tokens > self.max_tokens and len(known) > 1:
                oldest = known.pop(next(iter(known)))
                self.tokens -= len(oldest.token_ids)
        return request

    def clear(self) -> None:
        """Forget every context checked (they are checked whole next time)."""
        with self._lock:
            self._known = {}
            self.tokens = 0
