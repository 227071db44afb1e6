"""The one AutoBatcher: every backend and every trie batches concurrent requests through it.

Requests are queued under a key; equal keys share one computation. When a batch is flushed is the
flush policy (:data:`FlushPolicy`): by default (``"idle"``) as soon as the program can submit nothing
more (every other task of the event loop is waiting), when ``batch_size`` distinct requests are
queued, or ``timeout`` seconds after the oldest queued one. Batches run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from genlm_core.config import FLUSH_POLICIES, FlushPolicy  # defined there: options models import no torch
from genlm_core.errors import BatcherError, ClosedError
from genlm_core.rows import Failed
from genlm_core.validation import check_batcher_numbers

__all__ = ["FLUSH_POLICIES", "AutoBatcher", "BatcherStats", "ContentKey", "Failed", "FlushPolicy", "flush_delay"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


ProcessFn = Callable[[list[T]], Sequence[Any] | Awaitable[Sequence[Any]]]


def loop_is_idle(loop: asyncio.AbstractEventLoop) -> bool | None:
    """Whether no callback but the caller's is ready to run in ``loop`` (so no other task can submit
    anything before the caller yields), or None where the loop does not tell (not CPython's asyncio)."""
    ready = getattr(loop, "_ready", None)
    return None if ready is None else not ready


#: How many recent batch sizes :class:`BatcherStats` keeps (its memory stays bounded).
RECENT_BATCHES = 1000


@dataclass
class BatcherStats:
    """Counters for observing batching (tests, benchmarks, logs); ``sizes`` holds the most recent
    :data:`RECENT_BATCHES` batch sizes only."""

    batches: int = 0
    items: int = 0
    submitted: int = 0
    full_flushes: int = 0  #: batches flushed because batch_size requests were queued
    timed_flushes: int = 0  #: batches flushed because the oldest request was timeout seconds old
    idle_flushes: int = 0  #: batches flushed because nothing else in the program could run ("idle")
    eager_flushes: int = 0  #: batches started as soon as the model was free ("eager")
    busy_seconds: float = 0.0  #: time the batch function was computing (the model's busy time)
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_BATCHES))


def flush_delay(oldest_queued_at: float, queued: int, now: float, batch_size: int, timeout: float) -> float:
    """The flush policy: seconds to wait before flushing ``queued`` requests whose oldest was queued at
    ``oldest_queued_at`` (0: flush now). Full queues flush at once; otherwise the timeout counts from
    the oldest request, not the newest, so a steady trickle cannot postpone a flush forever."""
    if queued >= batch_size:
        return 0.0
    return max(0.0, oldest_queued_at + timeout - now)


class ContentKey:
    """A batcher key for an array: equal to another exactly when the contents are equal.

    Hold a *snapshot* (an array nobody else writes to): the key then cannot come to stand for other
    values while its request lives, which an ``id()`` can (addresses are reused once an object is
    freed). Hashing samples at most 64 entries; equality compares every entry.
    """

    __slots__ = ("_hash", "array", "tag")

    def __init__(self, tag: Hashable, array: np.ndarray | torch.Tensor):
        self.tag = tag
        self.array = array
        flat = array.reshape(-1)
        sample = flat[:: max(1, flat.shape[0] // 64)]
        if isinstance(sample, torch.Tensor):
            sample = sample.detach().cpu().numpy()
        self._hash = hash((tag, tuple(array.shape), str(array.dtype), sample.tobytes()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ContentKey) or other._hash != self._hash or other.tag != self.tag:
            return False
        a, b = self.array, other.array
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if isinstance(a, torch.Tensor):
            return a.device == b.device and bool(torch.equal(a, b))
        return bool(np.array_equal(a, b))


class _Group:
    """The one future of a :meth:`AutoBatcher.submit_many` call: its results, in order, once every
    item has one; the first failure fails it."""

    __slots__ = ("future", "left", "results")

    def __init__(self, future: asyncio.Future[list[Any]], size: int):
        self.future = future
        self.results: list[Any] = [None] * size
        self.left = size

    def deliver(self, index: int, result: Any) -> None:
        future = self.future
        if future.done():
            return
        if isinstance(result, Failed):
            future.set_exception(result.error)
            return
        self.results[index] = result
        self.left -= 1
        if not self.left:
            future.set_result(self.results)


#: Who waits for a job: one caller's future, or the ``(group, index)`` of an item of a group.
Waiter = asyncio.Future[Any] | tuple[_Group, int]


class _Job:
    __slots__ = ("item", "key", "queued_at", "waiters")

    def __init__(self, key: Hashable, item: Any, queued_at: float):
        self.key = key
        self.item = item
        self.queued_at = queued_at
        self.waiters: list[Waiter] = []

    def resolve(self, result: Any) -> None:
        for waiter in self.waiters:
            if type(waiter) is tuple:
                waiter[0].deliver(waiter[1], result)
                continue
            assert isinstance(waiter, asyncio.Future)
            if waiter.done():
                continue
            if isinstance(result, Failed):
                waiter.set_exception(result.error)
            else:
                waiter.set_result(result)

    def cancel(self) -> None:
        for waiter in self.waiters:
            if type(waiter) is tuple:
                waiter[0].future.cancel()
            else:
                assert isinstance(waiter, asyncio.Future)
                waiter.cancel()


class AutoBatcher(Generic[T, R]):
    """Batches concurrent ``await batcher.submit(key, item)`` calls into ``process(items)`` calls.

    ``process`` takes a list of items and returns one result per item, in order (a :class:`Failed`
    fails only that item). It may be a coroutine function, or a plain function — run inline, or in
    a dedicated worker thread when ``run_in_thread`` so the event loop stays free while it computes.

    **Keys.** A key must be a *value* that stands for the request's result: hashable, equal to
    another key exactly when the two requests have the same result, and unchanging while the request
    lives (e.g. a tuple of token ids, or a :class:`ContentKey` over a snapshot of an array). Never
    use ``id()`` of a caller's object: once the object is freed its address is reused, and a new
    request would be handed the old one's result.

    Guarantees: equal keys queued or in flight are computed once; an exception from ``process``
    fails every waiter of that batch and the batcher keeps serving; a cancelled waiter is dropped
    (its request too, if nobody else waits for it and it has not started); if the worker itself
    stops on an unexpected error, every waiter fails with :class:`~genlm_core.errors.BatcherError`,
    and so does the next submit, so nothing waits forever; it follows the running event loop, so it
    works across ``asyncio.run`` calls; no task outlives the queue. After :meth:`close`, every
    submit raises :class:`~genlm_core.errors.ClosedError`.

    >>> import asyncio
    >>> batcher = AutoBatcher(lambda xs: [x * x for x in xs], batch_size=8, timeout=0.01)
    >>> async def main():
    ...     return await asyncio.gather(*(batcher.submit(x, x) for x in [1, 2, 3, 2]))
    >>> asyncio.run(main())
    [1, 4, 9, 4]
    >>> batcher.stats.batches, batcher.stats.items   # one batch; the repeated 2 computed once
    (1, 3)
    """

    def __init__(
        self,
        process: ProcessFn[T],
        *,
        batch_size: int = 32,
        timeout: float = 0.02,
        run_in_thread: bool = False,
        name: str = "batcher",
        flush: FlushPolicy = "idle",
    ):
        self.batch_size, self.timeout = check_batcher_numbers(batch_size, timeout)
        if flush not in FLUSH_POLICIES:
            raise ValueError(f"flush must be one of {', '.join(map(repr, FLUSH_POLICIES))}, got {flush!r}")
        self.flush = flush
        self.process = process
        self.run_in_thread = run_in_thread
        self.name = name
        self.stats = BatcherStats()
        self._is_async = inspect.iscoroutinefunction(process)
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[Hashable, _Job] = {}
        self._running: dict[Hashable, _Job] = {}
        self._held_back = 0  # "eager": requests of a split queue left for the next batch
        self._worker: asyncio.Task[None] | None = None
        self._full: asyncio.Future[None] | None = None
        self._failure: BatcherError | None = None  # the worker's death, raised once by the next submit
        self.closed = False

    def ensure_open(self) -> None:
        """Raise :class:`~genlm_core.errors.ClosedError` if :meth:`close` has been called."""
        if self.closed:
            raise ClosedError(f"{self.name} was closed (cleanup() was called); create a new one")

    async def submit(self, key: Hashable, item: T) -> R:
        """Queue ``item`` under ``key`` (see the class docstring for what a key must be) and wait
        for its result."""
        loop = self._ready()
        self.stats.submitted += 1
        job = self._pending.get(key) or self._running.get(key)
        if job is None:
            self._pending[key] = job = _Job(key, item, loop.time())
            self._kick(loop)
        waiter: asyncio.Future[R] = loop.create_future()
        job.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                job.waiters.remove(waiter)
                self._drop_unwaited(job)
            raise

    async def submit_many(self, keys: Sequence[Hashable], items: Sequence[T]) -> list[R]:
        """Queue every ``(key, item)`` pair (as :meth:`submit` does each) and wait for all their
        results, in order, through one future: a program's whole step is one submission. Equal keys
        are computed once, here and across callers. The first failure of an item fails the call;
        cancelling it drops the items nobody else waits for."""
        if len(keys) != len(items):
            self.ensure_open()
            raise ValueError(f"{self.name}: {len(keys)} keys for {len(items)} items")
        loop = self._ready()
        if not keys:
            return []
        self.stats.submitted += len(keys)
        group = _Group(loop.create_future(), len(keys))
        pending, running = self._pending, self._running
        jobs = []
        now = loop.time()
        for i, key in enumerate(keys):
            job = pending.get(key) or running.get(key)
            if job is None:
                pending[key] = job = _Job(key, items[i], now)
            job.waiters.append((group, i))
            jobs.append(job)
        self._kick(loop)
        try:
            return await group.future
        except asyncio.CancelledError:
            if group.future.cancelled():
                for job in jobs:
                    job.waiters = [w for w in job.waiters if type(w) is not tuple or w[0] is not group]
                    self._drop_unwaited(job)
            raise

    def _ready(self) -> asyncio.AbstractEventLoop:
        """The running event loop, this batcher bound to it; raises if closed, or the worker's death once."""
        self.ensure_open()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        return loop

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        """New requests were queued: start the worker, or wake it when a batch is full."""
        if self._worker is None:
            self._worker = loop.create_task(self._work(), name=f"genlm-{self.name}")
        elif len(self._pending) >= self.batch_size:
            self._wake()

    def _drop_unwaited(self, job: _Job) -> None:
        """Forget a queued request nobody waits for any more (one already running finishes)."""
        if not job.waiters and self._pending.get(job.key) is job:
            del self._pending[job.key]

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed() and old.is_running() and (self._pending or self._running):
            raise RuntimeError(f"{self.name}: in use by another running event loop")
        self._bind_fresh()
        self._loop = loop

    def _wake(self) -> None:
        if self._full is not None and not self._full.done():
            self._full.set_result(None)

    async def _wait_until_full(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self._full = loop.create_future()
        handle = loop.call_later(delay, self._wake)
        try:
            await self._full
        finally:
            handle.cancel()
            self._full = None

    async def _work(self) -> None:
        """The worker task: flush batches while requests are queued."""
        try:
            while self._pending:
                batch = await self._next_batch()
                if batch:
                    await self._finish(batch, self._launch(batch))
        except Exception as exc:  # a bug of ours: fail everyone now rather than leave them waiting
            log.error("%s: batch worker stopped: %r", self.name, exc, exc_info=exc)
            error = BatcherError(f"{self.name}: the batch worker stopped on an unexpected error: {exc!r}")
            error.__cause__ = exc
            self._failure = error
            for job in [*self._pending.values(), *self._running.values()]:
                job.resolve(Failed(error))
            self._pending, self._running = {}, {}
        finally:
            if self._worker is asyncio.current_task():
                self._worker = None

    async def _next_batch(self) -> list[_Job]:
        """The flush policy (:data:`FlushPolicy`): wait until a batch is due, then take up to
        ``batch_size`` queued requests, oldest first."""
        loop = asyncio.get_running_loop()
        quiet_passes = 0  # event-loop passes that queued nothing new (where the loop cannot say it is idle)
        while self._pending:
            if self.flush == "eager" and (self.run_in_thread or self._is_async):
                self.stats.eager_flushes += 1  # the model is free: no reason to wait
                queued = min(len(self._pending), self.batch_size)
                if not self._held_back and queued >= 2:  # the first half now, the rest as soon as it is done
                    self._held_back = queued // 2
                    return self._take(queued - self._held_back)
                self._held_back = 0
                break
            oldest = next(iter(self._pending.values()))
            delay = flush_delay(oldest.queued_at, len(self._pending), loop.time(), self.batch_size, self.timeout)
            if delay == 0:
                if len(self._pending) < self.batch_size:
                    if self.timeout == 0 and self.flush == "timeout":
                        await asyncio.sleep(0)  # let requests issued in this same step join
                    self.stats.timed_flushes += 1
                else:
                    self.stats.full_flushes += 1
                break
            if self.flush != "timeout":  # "idle", and "eager" with an inline batch function
                idle = loop_is_idle(loop)
                if idle or (idle is None and quiet_passes >= 2):
                    self.stats.idle_flushes += 1
                    break
                queued = len(self._pending)
                await asyncio.sleep(0)
                quiet_passes = quiet_passes + 1 if len(self._pending) == queued else 0
                continue
            await self._wait_until_full(delay)
        return self._take()

    def _take(self, limit: int | None = None) -> list[_Job]:
        keys = list(self._pending)[: min(limit or self.batch_size, self.batch_size)]
        return [self._pending.pop(k) for k in keys]

    def _launch(self, batch: list[_Job]) -> asyncio.Future[Sequence[Any]]:
        """Start computing ``batch``: in the worker thread, or as a task for a coroutine function (an
        inline batch function runs here, at once). The future of its results."""
        self._running.update((job.key, job) for job in batch)
        loop = asyncio.get_running_loop()
        items = [job.item for job in batch]
        computing: asyncio.Future[Sequence[Any]]
        if self._is_async:
            computing = loop.create_task(self._timed_async(items))
        elif self.run_in_thread:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"genlm-{self.name}")
            computing = loop.run_in_executor(self._executor, self._timed, items)
        else:
            computing = loop.create_future()
            try:
                computing.set_result(self._timed(items))
            except Exception as exc:
                computing.set_exception(exc)
        return computing

    def _timed(self, items: list[T]) -> Sequence[Any]:
        start = time.perf_counter()
        try:
            return self.process(items)  # type: ignore[return-value]
        finally:
            self.stats.busy_seconds += time.perf_counter() - start

    async def _timed_async(self, items: list[T]) -> Sequence[Any]:
        start = time.perf_counter()
        try:
            return await self.process(items)  # type: ignore[misc]
        finally:
            self.stats.busy_seconds += time.perf_counter() - start

    async def _finish(self, batch: list[_Job], computing: asyncio.Future[Sequence[Any]]) -> None:
        """Wait for ``batch``'s results and resolve its waiters (a failure fails this batch only)."""
        try:
            results = await computing
            if len(results) != len(batch):
                raise RuntimeError(
                    f"{self.name}: batch function returned {len(results)} results for {len(batch)} items"
                )
        except Exception as exc:
            log.debug("%s: batch of %d failed: %r", self.name, len(batch), exc)
            for job in batch:
                job.resolve(Failed(exc))
        except BaseException:
            for job in batch:
                job.cancel()
            raise
        else:
            for job, result in zip(batch, results):
                job.resolve(result)
        finally:
            for job in batch:
                if self._running.get(job.key) is job:
                    del self._running[job.key]
        self.stats.batches += 1
        self.stats.items += len(batch)
        self.stats.sizes.append(len(batch))

    def reset(self) -> None:
        """Drop every queued request that has not started: its waiters get BatcherError. Batches
        already running finish normally. Called outside the batcher's running event loop (e.g. after
        ``asyncio.run`` ended on an exception), it forgets the queue and starts afresh next time."""
        queued, self._pending = list(self._pending.values()), {}
        loop = self._loop
        try:
            in_loop = loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            in_loop = False
        if not in_loop:
            self._bind_fresh()
            return
        for job in queued:
            job.resolve(Failed(BatcherError(f"{self.name}: the request was dropped by reset_async_queries()")))

    def _bind_fresh(self) -> None:
        self._loop = None
        self._pending, self._running = {}, {}
        self._worker, self._full = None, None

    def queued(self) -> list[T]:
        """The items queued and not yet handed to the batch function, oldest first."""
        return [job.item for job in self._pending.values()]

    def release(self) -> None:
        """Stop the worker thread, if one was started, without closing: a later batch starts a new one
        (a batch still computing finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def close(self) -> None:
        """Stop for good: queued and running requests fail with ClosedError, and so does every
        later submit; the worker thread, if one was started, is stopped. Calling it again is harmless."""
        self.closed = True
        for job in [*self._pending.values(), *self._running.values()]:
            job.resolve(Failed(ClosedError(f"{self.name} was closed (cleanup() was called)")))
        self._pending, self._running = {}, {}
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
