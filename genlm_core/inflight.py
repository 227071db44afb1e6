"""Requests in flight, streamed to an engine one by one: shared by equal keys, cancelled with their last caller.

A backend that streams requests (:attr:`~genlm_core.lm.AsyncLM.streams`) has no batch to
deduplicate in, and a cancelled caller must not leave work running that nobody wants. One
implementation of both, for core's streaming path and any engine driver that streams
(:mod:`genlm_vllm.drivers.async_llm`): :class:`InFlight`.

- **deduplication**: concurrent callers of one key share one computation (started once);
- **waiter counting and cancellation**: a cancelled caller stops waiting; when the last caller of
  a computation is cancelled, the computation is cancelled (an engine aborts its request) and a
  later caller of that key starts afresh;
- **failing everything**: :meth:`InFlight.fail_all` cancels every computation and hands its callers
  the error (a reset, or a closing engine), so nothing waits forever.

A computation is a ``concurrent.futures.Future`` (callers on any thread and any event loop may
share it: each waits on a future of its own loop that follows it), or an ``asyncio.Future`` (to be
shared only by callers on its own loop). Keys follow the batcher's rule: a value that stands for the result (a
:class:`~genlm_core.request.Request`), never ``id()`` of a caller's object.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from genlm_core.errors import BatcherError

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

#: A computation in flight: a thread-safe future, or a future of the running event loop.
Computation = concurrent.futures.Future[R] | asyncio.Future[R]


class _Shared(Generic[R]):
    """One computation and how many callers wait for it."""

    __slots__ = ("failure", "future", "waiters")

    def __init__(self, future: Computation[R]):
        self.future = future
        self.waiters = 0
        self.failure: BaseException | None = None  # what callers get when it is cancelled by fail_all

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.future.cancel()


class InFlight(Generic[K, R]):
    """The computations in flight, by key (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._shared: dict[K, _Shared[R]] = {}
        self._lock = threading.RLock()  # (a done callback may run at once, in the thread that adds it)

    def __len__(self) -> int:
        """Keys in flight."""
        return len(self._shared)

    async def run(self, key: K, start: Callable[[], Computation[R]]) -> R:
        """The result of ``key``'s computation: the one in flight, else ``start()`` (called once,
        here). Cancelling the caller cancels the computation when no other caller waits for it."""
        with self._lock:
            shared = self._shared.get(key)
            if shared is None:
                shared = self._shared[key] = _Shared(start())
                shared.future.add_done_callback(functools.partial(self._forget, key, shared))
            shared.waiters += 1
        try:
            return await _follow(shared)
        except asyncio.CancelledError:
            with self._lock:
                shared.waiters -= 1
                abandoned = shared.waiters == 0
                if abandoned and self._shared.get(key) is shared:
                    del self._shared[key]  # a new caller starts afresh, not on the cancelled one
            if abandoned:  # nobody wants it any more
                shared.future.cancel()
            raise

    def fail_all(self, error: BaseException) -> None:
        """Cancel every computation in flight; their callers get ``error``."""
        with self._lock:
            pending, self._shared = list(self._shared.values()), {}
        for shared in pending:
            shared.fail(error)

    def _forget(self, key: K, shared: _Shared[R], _: object = None) -> None:
        with self._lock:
            if self._shared.get(key) is shared:
                del self._shared[key]


def _follow(shared: _Shared[R]) -> asyncio.Future[R]:
    """A future of the running loop that follows ``shared.future`` and can be cancelled alone."""
    loop = asyncio.get_running_loop()
    mine: asyncio.Future[R] = loop.create_future()

    def copy(done: Computation[R]) -> None:
        if mine.done():
            return
        if done.cancelled():
            mine.set_exception(shared.failure or BatcherError("the request was cancelled"))
        elif done.exception() is not None:
            mine.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            mine.set_result(done.result())

    def follow(done: Computation[R]) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the caller's loop is gone
            pass

    shared.future.add_done_callback(follow)
    return mine
