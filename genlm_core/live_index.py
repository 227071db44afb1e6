"""The index of an engine's live sequences: one owner of what each sequence holds and who extends it.

:class:`~genlm_core.live.LiveSequences` asks four questions of its live sequences, answered here from
one set of maps kept in step in one place (:meth:`LiveIndex.keep` and :meth:`LiveIndex.forget`):

- which live sequence a request continues (the nearest earlier context it extends by at most
  ``lookback`` tokens, each continued by at most one request of a batch: :meth:`LiveIndex.plan`);
- which sequence holds a context less its last few tokens (the parent a sibling forks, or copies);
- which sequence shares the longest prefix with a request (for an engine that copies any prefix);
- which sequence to give up next (kept longest ago first; idle for too many batches).

Matching is on exact token tuples and adapter (:class:`~genlm_core.request.Request` keys), never
on object identity. A *handle* is the engine's name of a sequence; a handle is either **live**
(between batches, unclaimed), **claimed** (continued by the batch being planned and run: it still
holds its old context until :meth:`LiveIndex.keep` records the new one), or not in the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

from genlm_core.lineage import Continuation, nearest_prefix, prefixes
from genlm_core.request import Request

H = TypeVar("H")  #: the engine's handle of one sequence (hashable; never None, which is what ``take`` gives for none)


class LiveIndex(Generic[H]):
    """What each sequence of an engine holds, by handle and by context.

    ``lookback``: most tokens by which a request may extend a live sequence (also how many shorter
    prefixes of each held context are indexed, for siblings). ``max_idle_batches``: batches in a
    row a live sequence may go unclaimed before :meth:`plan` lets it go (None: until evicted).
    ``arrays``: let :meth:`longest_prefix` search any prefix of every held context (engines that copy
    any prefix); it makes each held context's array when it first searches it (kept until the
    handle holds another), so a batch that only continues and forks reads no whole context."""

    def __init__(self, lookback: int = 1, max_idle_batches: int | None = None, arrays: bool = False):
        self.lookback = lookback
        self.max_idle_batches = max_idle_batches
        self.arrays = arrays
        self._held: dict[H, Request] = {}  # every handle in the index -> the context it holds
        self._live: dict[Request, H] = {}  # unclaimed handles by context, kept longest ago first
        self._idle: dict[H, int] = {}  # batches since each live handle was last kept
        self._parents: dict[Request, H] = {}  # a held context less 1..lookback tokens -> its holder
        self._parent_keys: dict[H, list[Request]] = {}  # each handle's keys in ``_parents``
        self._array: dict[H, np.ndarray] = {}  # held contexts as arrays, made by longest_prefix

    # ---- reads -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Live sequences (between batches: every sequence in the index)."""
        return len(self._live)

    def contexts(self) -> list[Request]:
        """The live sequences' contexts, kept longest ago first (the order of :meth:`evict`)."""
        return list(self._live)

    def items(self) -> list[tuple[Request, H]]:
        """``(context, handle)`` of each live sequence, kept longest ago first."""
        return list(self._live.items())

    def held(self, handle: H) -> Request | None:
        """The context ``handle`` holds (live or claimed), or None if it is not in the index."""
        return self._held.get(handle)

    def live_tokens(self) -> int:
        """Tokens the live sequences hold in all."""
        return sum(len(context) for context in self._live)

    def extends_live(self, request: Request) -> bool:
        """Whether ``request`` extends a live context by 1 to ``lookback`` tokens."""
        return any(key in self._live for _, key in prefixes(request, self.lookback, shortest_cut=1))

    def longest_prefix(self, request: Request) -> tuple[H, int] | None:
        """A sequence in the index and the length of the longest prefix of ``request`` it holds,
        leaving at least the request's last token to compute: a held context less at most
        ``lookback`` tokens first, else (with ``arrays``) the longest common prefix of any held
        context under the same adapter; None if none shares a token."""
        hit = nearest_prefix(self._parents.get, request, self.lookback, shortest_cut=1)
        if hit is not None:
            return hit[1], len(request) - hit[0]
        if not self.arrays or not self._held:
            return None
        target = np.asarray(request.token_ids, np.int64)
        best, source = 0, None
        arrays = self._array
        for handle, context in self._held.items():
            if context.adapter != request.adapter:
                continue
            n = min(len(context), len(target) - 1)
            if n <= best:
                continue
            held = arrays.get(handle)
            if held is None:
                held = arrays[handle] = np.asarray(context.token_ids, np.int64)
            differ = np.flatnonzero(held[:n] != target[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best:
                best, source = common, handle
        return None if source is None else (source, best)

    # ---- a batch -----------------------------------------------------------------------------

    def plan(self, requests: Sequence[Request]) -> tuple[list[Continuation[H] | None], list[H]]:
        """One :class:`~genlm_core.lineage.Continuation` (or None: no live sequence to extend) per
        request, and the handles of sequences idle for more than ``max_idle_batches`` (forgotten:
        release them). A continued sequence is claimed (no longer live, still held) until
        :meth:`keep` or :meth:`forget`; a request extending a sequence that an earlier request of
        the batch continues gets a ``fork``."""
        live, idle = self._live, self._idle
        continued: dict[Request, H] = {}
        plan: list[Continuation[H] | None] = []
        for request in requests:
            step: Continuation[H] | None = None
            n = len(request)
            for cut, key in prefixes(request, self.lookback, shortest_cut=1):
                handle = live.pop(key, None)  # a live sequence is continued once; later requests fork it
                if handle is not None:
                    continued[key] = handle
                    idle.pop(handle, None)
                    fork = False
                else:
                    handle = continued.get(key)
                    if handle is None:
                        continue
                    fork = True
                step = Continuation(handle, request.new_tokens(n - cut), fork)
                break
            plan.append(step)
        released = []
        for handle in live.values():
            idle[handle] = batches = idle.get(handle, 0) + 1
            if self.max_idle_batches is not None and batches > self.max_idle_batches:
                released.append(handle)
        self.forget(released)
        return plan, released

    def keep(self, request: Request, handle: H) -> H | None:
        """``handle`` now holds ``request``'s context, live for the next batch (the newest in line);
        what it held before is forgotten. Returns the handle that held the same context live
        before, if any (forgotten: release it)."""
        # the new keys first: they are the shorter contexts the handle held until now, while still alive
        keys = [prefix for _, prefix in prefixes(request, self.lookback, shortest_cut=1)]
        self._forget_one(handle)
        before = self._live.get(request)
        if before is not None:
            self._forget_one(before)
        self._live[request] = handle
        self._idle[handle] = 0
        self._held[handle] = request
        for key in keys:
            self._parents[key] = handle
        self._parent_keys[handle] = keys
        return before

    def forget(self, handles: Sequence[H]) -> None:
        """Forget these handles (live or claimed) and everything indexed about them."""
        for handle in handles:
            self._forget_one(handle)

    def evict(self) -> tuple[H, Request] | None:
        """Forget the live sequence kept longest ago: its handle (to release) and what it held, or None."""
        if not self._live:
            return None
        request, handle = next(iter(self._live.items()))
        self._forget_one(handle)
        return handle, request

    def release_all(self) -> list[H]:
        """Forget every sequence (live or claimed); their handles, to release."""
        handles = list(self._held)
        self._held, self._live, self._idle, self._parents, self._parent_keys, self._array = {}, {}, {}, {}, {}, {}
        return handles

    def _forget_one(self, handle: H) -> None:
        request = self._held.pop(handle, None)
        if request is None:
            return
        self._array.pop(handle, None)
        self._idle.pop(handle, None)
        if self._live.get(request) == handle:
            del self._live[request]
        parents = self._parents
        for key in self._parent_keys.pop(handle):
            if parents.get(key) == handle:
                del parents[key]
