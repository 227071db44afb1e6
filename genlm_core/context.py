"""Context handles: immutable token sequences that genlm owns, O(1) to extend, hash and compare.

A particle program asks for a context, then for that context plus one token, and so on. With plain
lists every request reads the whole context again (a snapshot, a check, a comparison): the cost of a
run grows with the square of its length. A :class:`Context` is extended instead: ``ctx.extend(t)``
makes a new context that shares its parent's storage (full chunks of :data:`CHUNK` ids, shared by
reference, and a short tail of its own), checks only the new ids, and computes its hash from its
parent's sample in O(1). Requests built from contexts are keyed, deduplicated, cached and matched
to their parent (live sequences, lineage) without reading the whole context.

A context is a read-only ``Sequence[int]``: ``len``, iteration, indexing, slicing (slices are tuples),
``in``, and equality with lists, tuples and other contexts by content. Its hash is its own (a sample
of its ids, the same for every way of building the same ids): don't mix contexts and tuples as keys
of one dict. Make one with :meth:`genlm_core.AsyncLM.context` (checked against that model's
vocabulary), or :class:`Context` ``(ids, vocab_size)``.

>>> ctx = Context([1, 2, 3], vocab_size=10)
>>> child = ctx.extend(4)
>>> child, len(child), child[-1], child[1:3]
(Context([1, 2, 3, 4]), 4, 4, (2, 3))
>>> child == [1, 2, 3, 4] and child == (1, 2, 3, 4) and child == Context([1, 2, 3, 4], 10)
True
>>> (ctx + [4, 5]).prefix(4) == child
True
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, overload

import numpy as np

from genlm_core.validation import _show, check_token_ids, is_int

#: Ids per shared chunk: extending copies at most this many ids (the tail) plus one reference per chunk.
CHUNK = 128

#: Ids sampled into a context's hash: the last ones and as many spread over the whole.
HASH_SAMPLE = 32

#: Most links :meth:`Context.prefix` follows back to a context this one was extended from (a live
#: sequence's few shorter prefixes) before it slices instead.
PARENT_STEPS = 8


def sample_hash(token_ids: Sequence[int], length: int | None = None) -> int:
    """The hash of ``token_ids[:length]`` (all of it by default) that :class:`Context` uses: it reads
    the length, the last :data:`HASH_SAMPLE` ids and as many spread evenly over the rest, so it costs
    the same for 24 ids or 8,000. Equal sequences hash alike; a hash is never trusted alone."""
    n = len(token_ids) if length is None else length
    return hash((n, tuple(token_ids[max(0, n - HASH_SAMPLE) : n]), tuple(token_ids[0 : n : n // HASH_SAMPLE + 1])))


class Context(Sequence[int]):
    """An immutable sequence of token ids, O(1) to extend and to hash (see the module's docstring).

    Immutable: no public name changes it (its fields are private; the tuple of its ids is made once,
    lazily). Build new contexts with :meth:`extend`, ``+`` and :meth:`prefix`.

    ``vocab_size``: the ids are checked to lie in ``[0, vocab_size)`` (TypeError for what is not an
    integer id, ValueError for one out of range); a model accepts the context without reading it
    again when its vocabulary is at least that large. An empty context is allowed (a root to extend);
    a request needs at least one token.
    """

    __slots__ = ("__weakref__", "_bound", "_chunks", "_flat", "_hash", "_n", "_parent", "_spread", "_tail")

    _n: int
    _hash: int
    _bound: int | None
    _flat: tuple[int, ...] | None
    _chunks: tuple[tuple[int, ...], ...] | None
    _tail: tuple[int, ...] | None
    _spread: tuple[int, ...]
    _parent: weakref.ref[Context] | None

    def __init__(self, token_ids: Any = (), vocab_size: int | None = None):
        if vocab_size is None:
            raise TypeError("Context needs vocab_size (or make one with lm.context(token_ids))")
        bound = _check_bound(vocab_size)
        if type(token_ids) is Context and token_ids._bound is not None and token_ids._bound <= bound:
            ids = token_ids.ids
        elif isinstance(token_ids, Sequence) and len(token_ids) == 0 and not isinstance(token_ids, (str, bytes)):
            ids = ()
        else:
            ids = check_token_ids(list(token_ids) if type(token_ids) is Context else token_ids, bound)
        _init_root(self, ids, bound)

    @classmethod
    def trusted(
        cls, token_ids: tuple[int, ...], vocab_size: int | None = None, parent: Context | None = None
    ) -> Context:
        """A context over ``token_ids``, a tuple of ints the caller has already checked (against
        ``vocab_size``, or None: not known to be checked, so a model checks it again). Reads nothing.

        ``parent``: a context the caller has checked to hold exactly ``token_ids[:-1]``: kept (weakly)
        as this one's parent, so that :meth:`prefix` of one token less is ``parent`` itself (O(1),
        and equal to it by identity), as for a context made by :meth:`extend`."""
        ctx = object.__new__(cls)
        _init_root(ctx, token_ids, vocab_size)
        if parent is not None:
            ctx._parent = weakref.ref(parent)
        return ctx

    # ---- extending -------------------------------------------------------------------------------

    def extend(self, tokens: int | Iterable[int]) -> Context:
        """This context followed by ``tokens`` (one id, or several): a new context sharing this one's
        storage. Only the new ids are checked."""
        if type(tokens) is int and 0 <= tokens < (self._bound or 2**63):  # the usual step: one plain id
            return self._extended((tokens,))
        new = self._check_new((tokens,) if is_int(tokens) else tokens)  # type: ignore[arg-type]
        return self._extended(new) if new else self

    def __add__(self, tokens: Iterable[int]) -> Context:
        """``ctx + [t, u]``: :meth:`extend` by several ids."""
        if is_int(tokens):
            return NotImplemented
        return self.extend(tokens)

    def __radd__(self, other: Any) -> Any:
        """``[a, b] + ctx`` / ``(a, b) + ctx``: a plain list or tuple, as the left operand's type."""
        if isinstance(other, list):
            return other + list(self)
        if isinstance(other, tuple):
            return other + self.ids
        return NotImplemented

    def prefix(self, length: int) -> Context:
        """The context of this one's first ``length`` ids, sharing its storage (no copy of the whole)."""
        n = self._n
        if not 0 <= length <= n:
            raise ValueError(f"prefix length must be in [0, {n}], got {length}")
        if length == n:
            return self
        ref = self._parent
        for _ in range(PARENT_STEPS):  # the contexts this one was extended from, if still alive: no copy
            ancestor = ref() if ref is not None else None
            if ancestor is None or ancestor._n < length:
                break
            if ancestor._n == length:
                return ancestor
            ref = ancestor._parent
        if self._chunks is None and self._flat is not None:  # a flat one (from a tuple): a slice, as a tuple's
            return Context.trusted(self._flat[:length], self._bound)
        chunks, tail = self._chunked()
        full = length // CHUNK
        if full < len(chunks):
            head, rest = chunks[:full], chunks[full][: length - full * CHUNK]
        else:
            head, rest = chunks, tail[: length - full * CHUNK]
        return _make(head, rest, length, self._bound, None, None)

    # ---- Sequence --------------------------------------------------------------------------------

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids as one tuple (made once, on first use, then kept)."""
        flat = self._flat
        if flat is None:
            assert self._chunks is not None and self._tail is not None
            flat = tuple(chain(chain.from_iterable(self._chunks), self._tail))
            self._flat = flat
        return flat

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if self._flat is None and step == 1 and start >= self._n - len(self._tail or ()):
                tail = self._tail or ()
                base = self._n - len(tail)
                return tail[start - base : max(start, stop) - base]
            return self.ids[index]
        if not is_int(index):
            raise TypeError(f"Context indices must be integers or slices, not {type(index).__name__}")
        i = int(index)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"Context index {index} out of range for {self._n} ids")
        if self._flat is not None:
            return self._flat[i]
        assert self._chunks is not None and self._tail is not None
        full = len(self._chunks) * CHUNK
        return self._tail[i - full] if i >= full else self._chunks[i // CHUNK][i % CHUNK]

    def __iter__(self) -> Iterator[int]:
        if self._flat is not None:
            return iter(self._flat)
        assert self._chunks is not None and self._tail is not None
        return chain(chain.from_iterable(self._chunks), self._tail)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.ids)

    def __contains__(self, value: object) -> bool:
        return value in self.ids

    def take(self, positions: Iterable[int]) -> list[int]:
        """The ids at ``positions`` (each in ``[0, len)``), read in place: a sample of a long context
        without making its tuple."""
        if self._flat is not None:
            flat = self._flat
            return [flat[i] for i in positions]
        assert self._chunks is not None and self._tail is not None
        return _read(self._chunks, self._tail, positions)

    def tolist(self) -> list[int]:
        """The ids as a new list."""
        return list(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.fromiter(self, dtype=np.int64 if dtype is None else dtype, count=self._n)

    # ---- equality and hashing --------------------------------------------------------------------

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is Context:
            if self._n != other._n or self._hash != other._hash:
                return False
            if (
                self._chunks is not None
                and other._chunks is not None
                and self._flat is None
                and other._flat is None
                and len(self._chunks) == len(other._chunks)
            ):  # shared chunks compare by identity, at C speed
                return self._chunks == other._chunks and self._tail == other._tail
            return self.ids == other.ids
        if isinstance(other, tuple):
            return len(other) == self._n and self.ids == other
        if isinstance(other, list):
            return len(other) == self._n and list(self.ids) == other
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __reduce__(self) -> tuple[Any, ...]:
        return (Context.trusted, (self.ids, self._bound))

    def __repr__(self) -> str:
        n = self._n
        if n <= 12:
            return f"Context({list(self)})"
        return f"Context([{', '.join(map(str, self[:4]))}, ..., {', '.join(map(str, self[n - 4 :]))}] ({n} ids))"

    @property
    def vocab_size(self) -> int | None:
        """The bound its ids were checked against (None: not checked; a model checks them whole)."""
        return self._bound

    # ---- internals -------------------------------------------------------------------------------

    def _check_new(self, tokens: Iterable[int]) -> tuple[int, ...]:
        if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Iterable):
            raise TypeError(f"tokens must be a token id or an iterable of ids, got {_show(tokens)}")
        new = tuple(tokens)
        if not new:
            return new
        return check_token_ids(new, 2**63 if self._bound is None else self._bound, "tokens")

    def _chunked(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """The chunked form (made from the flat one once, for a context built from a tuple)."""
        if self._chunks is None:
            flat = self._flat
            assert flat is not None
            full = len(flat) - len(flat) % CHUNK
            chunks = tuple(flat[i : i + CHUNK] for i in range(0, full, CHUNK))
            self._tail = flat[full:]  # before _chunks: another thread reads _tail once it sees _chunks
            self._chunks = chunks
        assert self._chunks is not None and self._tail is not None
        return self._chunks, self._tail

    def _extended(self, new: tuple[int, ...]) -> Context:
        chunks, tail = (self._chunks, self._tail) if self._chunks is not None else self._chunked()
        tail = tail + new  # type: ignore[operator]
        if len(tail) >= CHUNK:
            full = len(tail) - len(tail) % CHUNK
            chunks = chunks + tuple(tail[i : i + CHUNK] for i in range(0, full, CHUNK))
            tail = tail[full:]
        m, n = self._n, self._n + len(new)
        stride = n // HASH_SAMPLE + 1
        if stride == m // HASH_SAMPLE + 1:  # the same sample positions, and any new ones among the new ids
            first = -(-m // stride) * stride
            spread = self._spread + new[first - m :: stride] if first < n else self._spread
        else:
            spread = None
        return _make(chunks, tail, n, self._bound, spread, weakref.ref(self))


def as_context(tokens: Sequence[int]) -> Context:
    """``tokens`` as a context: a handle as it is, anything else as a tuple wrapped without a check."""
    return tokens if type(tokens) is Context else Context.trusted(tuple(tokens))


def _read(chunks: tuple[tuple[int, ...], ...], tail: tuple[int, ...], positions: Iterable[int]) -> list[int]:
    """The ids at ``positions`` of the chunked form ``chunks`` + ``tail``."""
    full = len(chunks) * CHUNK
    return [tail[i - full] if i >= full else chunks[i // CHUNK][i % CHUNK] for i in positions]


def _check_bound(vocab_size: Any) -> int:
    if not is_int(vocab_size) or int(vocab_size) < 1:
        raise TypeError(f"vocab_size must be a positive integer, got {_show(vocab_size)}")
    return int(vocab_size)


def _init_root(ctx: Context, ids: tuple[int, ...], bound: int | None) -> None:
    n = len(ids)
    spread = ids[0 : n : n // HASH_SAMPLE + 1]
    ctx._n, ctx._bound, ctx._flat, ctx._chunks, ctx._tail = n, bound, ids, None, None
    ctx._spread, ctx._parent = spread, None
    ctx._hash = hash((n, ids[max(0, n - HASH_SAMPLE) :], spread))


def _make(
    chunks: tuple[tuple[int, ...], ...],
    tail: tuple[int, ...],
    n: int,
    bound: int | None,
    spread: tuple[int, ...] | None,
    parent: weakref.ref[Context] | None,
) -> Context:
    """A chunked context of ``n`` ids; ``spread``: its hash sample, if known (else read: O(1) per id)."""
    if len(tail) >= HASH_SAMPLE or not chunks:
        last = tail[-HASH_SAMPLE:]
    else:
        last = chunks[-1][len(tail) - HASH_SAMPLE :] + tail
    if spread is None:
        spread = tuple(_read(chunks, tail, range(0, n, n // HASH_SAMPLE + 1)))
    ctx = object.__new__(Context)
    ctx._n, ctx._bound, ctx._flat, ctx._chunks, ctx._tail = n, bound, None, chunks, tail
    ctx._spread, ctx._parent = spread, parent
    ctx._hash = hash((n, last, spread))
    return ctx
