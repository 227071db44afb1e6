"""Requests: a validated snapshot of a context, the key it is cached and batched under.

A particle program asks for a context, then for that context plus one token, and so on. What is
done per request here does not grow with the context for a :class:`~genlm_core.context.Context`
handle (checked when it was made, hashed from its parent's sample); for a list or tuple that extends
a context checked recently by a token it is one C-speed copy (the snapshot) and one ``memcmp`` of the
items' addresses against the checked context (:class:`ContextChecker`): a request's hash reads a fixed number of ids
(:func:`~genlm_core.context.sample_hash`), and only the new id is checked.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
import threading
from typing import Any

from genlm_core.context import HASH_SAMPLE, Context, as_context, sample_hash
from genlm_core.validation import check_token_ids

__all__ = ["HASH_SAMPLE", "ContextChecker", "Request", "context_hash", "untrack_ids"]


class Request:
    """One next-token request: the context (a :class:`~genlm_core.context.Context`) and the adapter
    active when it was made.

    A request is its own cache and batching key. Its hash is the context's (a fixed sample of its
    ids, so hashing costs the same for 24 tokens or 8,000) with the adapter; equality compares the
    whole context (shared storage by identity, at C speed) and the adapter, so two requests are
    equal exactly when their contexts are. Immutable. ``token_ids`` is the context as one tuple
    (made on first use); ``context`` is the handle, for code that should not read the whole context.
    """

    __slots__ = ("_hash", "_n", "adapter", "context")

    context: Context
    adapter: str | None
    _hash: int
    _n: int

    def __init__(self, token_ids: tuple[int, ...] | Context, adapter: str | None = None):
        """``token_ids``: a context, or a tuple of ids already checked by the caller (it is not read)."""
        context = as_context(token_ids)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "adapter", adapter)
        object.__setattr__(self, "_hash", context._hash if adapter is None else hash((context._hash, adapter)))
        object.__setattr__(self, "_n", context._n)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The context's ids as one tuple (made once per context, then kept)."""
        return self.context.ids

    def __len__(self) -> int:
        return self._n

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Request is immutable (cannot set {name!r})")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Request):
            return NotImplemented
        return self._hash == other._hash and self.adapter == other.adapter and self.context == other.context

    def __repr__(self) -> str:
        ids = self.context
        shown = (
            repr(ids.ids)
            if len(ids) <= 12
            else f"({', '.join(map(str, ids[:4]))}, ..., {', '.join(map(str, ids[-4:]))})"
        )
        return f"Request(token_ids={shown} [{len(ids)} tokens], adapter={self.adapter!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Request, (self.context, self.adapter))

    def prefix(self, length: int) -> Request:
        """The request for the first ``length`` tokens of this context, under the same adapter (the
        context's storage is shared, not copied)."""
        return Request(self.context.prefix(length), self.adapter)

    def new_tokens(self, start: int) -> tuple[int, ...]:
        """The ids from position ``start`` on (read from the end of the context: O(its length - start))."""
        return self.context[start:]


def context_hash(token_ids: tuple[int, ...], adapter: str | None = None, length: int | None = None) -> int:
    """The hash of the request for ``token_ids[:length]`` (all by default) under ``adapter``, without
    making that slice: equal to ``hash(Request(token_ids[:length], adapter))``."""
    h = sample_hash(token_ids, length)
    return h if adapter is None else hash((h, adapter))


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


#: Contexts at least this long are compared by their items' addresses (:func:`same_objects`) when they can be.
POINTER_COMPARE_MIN = 64


@functools.cache
def _memcmp() -> Any:
    """libc's ``memcmp``, called with the GIL held (no other thread changes a list while it reads), where
    CPython lays a list's and a tuple's item pointers out as this module reads them (checked here, on
    first use, on objects made for the purpose); else None."""
    if sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return None
    try:
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int
    items = [object() for _ in range(3)]
    probe = tuple(items)
    if [ctypes.c_void_p.from_address(id(probe) + 24 + 8 * i).value for i in range(3)] != list(map(id, items)):
        return None
    array = ctypes.c_void_p.from_address(id(items) + 24).value
    if array is None or ctypes.c_void_p.from_address(array).value != id(items[0]):
        return None
    return memcmp


def same_objects(snapshot: tuple[Any, ...], prefix: tuple[int, ...]) -> bool | None:
    """Whether ``snapshot`` starts with exactly the objects of ``prefix``, in order (so it starts with
    ``prefix``'s values: ints that ``prefix`` keeps alive), read in one ``memcmp`` of their item
    pointers, no object touched. Both are tuples, which no thread can change while it reads. None
    where this cannot be done (see :func:`_memcmp`)."""
    memcmp = _memcmp()
    if memcmp is None or type(snapshot) is not tuple or type(prefix) is not tuple:
        return None
    n = len(prefix)
    if len(snapshot) < n:
        return False
    return memcmp(id(snapshot) + 24, id(prefix) + 24, 8 * n) == 0


#: Most tokens, over all contexts, that :class:`ContextChecker` remembers as checked.
CHECKED_TOKENS = 2**23


class ContextChecker:
    """Validates contexts and snapshots them as requests, in time independent of a context's length
    for the usual step of a program (a context one token longer than one checked recently).

    A context that is not such an extension is checked whole by
    :func:`~genlm_core.validation.check_token_ids`. For an extension, the context checked before is
    found by the hash of the prefix (every id but the last: :func:`context_hash` reads a fixed
    number of ids), the request is built from that checked prefix and the new id, and it is compared
    whole with the caller's context: only an equal one is taken (so a hash is never trusted alone, and
    an engine always sees the exact ids that were checked). Then only the new id is checked. The
    comparison is by the items' addresses where the caller's snapshot holds the very int objects
    checked before (a program that appends to its list, or builds it from the last one: one
    ``memcmp``, see :func:`same_objects`), else by value (a position already checked is read by value:
    ``3.0`` where ``3`` was checked reads as ``3``). The cost: one C-speed copy (the snapshot, which
    becomes the request) and one ``memcmp``; by value, one more copy and a comparison.
    Remembers the most recent contexts, up to :data:`CHECKED_TOKENS` tokens in all.
    Thread-safe; a race costs a full check at most.
    """

    def __init__(self, vocab_size: int, max_tokens: int = CHECKED_TOKENS):
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.tokens = 0
        self.extended = 0  #: requests checked in their new token only
        self.checked = 0  #: requests checked whole
        self.handles = 0  #: requests of contexts checked when they were made (read nothing)
        self._known: dict[int, Request] = {}  # by the request's hash; a candidate, compared whole before use
        self._lock = threading.Lock()

    def request(self, token_ids: Any, adapter: str | None) -> Request:
        """The request for ``token_ids`` under ``adapter``: a snapshot, checked (TypeError, ValueError)."""
        kind = type(token_ids)
        if kind is Context:
            bound = token_ids._bound
            if bound is not None and bound <= self.vocab_size:  # checked when it was made: read nothing
                if not token_ids._n:
                    check_token_ids((), self.vocab_size)  # the empty context's error
                self.handles += 1
                return Request(token_ids, adapter)
            token_ids = token_ids.ids  # from a larger vocabulary, or never checked: checked whole
        elif kind is list or kind is tuple:
            n = len(token_ids)
            if n >= 2:
                last = token_ids[-1]
                if type(last) is int and 0 <= last < self.vocab_size:
                    parent = self._known.get(context_hash(token_ids, adapter, n - 1))
                    if parent is not None and parent.adapter == adapter and len(parent) == n - 1:
                        snapshot = tuple(token_ids)  # the caller's context at one instant
                        new = snapshot[-1]
                        if type(new) is int and 0 <= new < self.vocab_size:
                            checked = parent.token_ids
                            ids: tuple[int, ...] | None
                            if n >= POINTER_COMPARE_MIN and same_objects(snapshot, checked):
                                ids = snapshot  # the checked objects themselves, then the new id
                            else:  # by value: the checked ids, where the caller's equal them
                                ids = checked + (new,)
                                if ids != snapshot:
                                    ids = None
                            if ids is not None:
                                self.extended += 1
                                context = Context.trusted(untrack_ids(ids), self.vocab_size, parent.context)
                                return self._remember(Request(context, adapter))
        self.checked += 1
        ids = untrack_ids(check_token_ids(token_ids, self.vocab_size))
        return self._remember(Request(Context.trusted(ids, self.vocab_size), adapter))

    @staticmethod
    def _key(request: Request) -> int:
        """What a request is remembered under: the hash :func:`context_hash` gives its context."""
        return request._hash

    def _remember(self, request: Request) -> Request:
        key = self._key(request)
        with self._lock:
            known = self._known
            old = known.pop(key, None)  # the same context again, or another of the same hash
            if old is not None:
                self.tokens -= len(old)
            known[key] = request
            self.tokens += len(request)
            while self.tokens > self.max_tokens and len(known) > 1:
                oldest = known.pop(next(iter(known)))
                self.tokens -= len(oldest)
        return request

    def clear(self) -> None:
        """Forget every context checked (they are checked whole next time)."""
        with self._lock:
            self._known = {}
            self.tokens = 0
