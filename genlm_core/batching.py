"""The one AutoBatcher: every backend and every trie batches concurrent requests through it.

Requests are queued under a key; identical keys share one computation. A batch is flushed when
``batch_size`` distinct requests are queued, or ``timeout`` seconds after the oldest queued one.
Batches run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Failed:
    """A per-item failure a batch function may return in place of a result."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


ProcessFn = Callable[[list[T]], Sequence[Any] | Awaitable[Sequence[Any]]]


@dataclass
class BatcherStats:
    """Counters for observing batching (tests, benchmarks, logs)."""

    batches: int = 0
    items: int = 0
    submitted: int = 0
    sizes: list[int] = field(default_factory=list)


class _Job:
    __slots__ = ("item", "key", "queued_at", "waiters")

    def __init__(self, key: Hashable, item: Any, queued_at: float):
        self.key = key
        self.item = item
        self.queued_at = queued_at
        self.waiters: list[asyncio.Future[Any]] = []

    def resolve(self, result: Any) -> None:
        for waiter in self.waiters:
            if waiter.done():
                continue
            if isinstance(result, Failed):
                waiter.set_exception(result.error)
            else:
                waiter.set_result(result)


class AutoBatcher(Generic[T, R]):
    """Batches concurrent ``await batcher.submit(key, item)`` calls into ``process(items)`` calls.

    ``process`` takes a list of items and returns one result per item, in order (a :class:`Failed`
    fails only that item). It may be a coroutine function, or a plain function — run inline, or in
    a dedicated worker thread when ``run_in_thread`` so the event loop stays free while it computes.

    Guarantees: identical keys queued or in flight are computed once; an exception from ``process``
    fails every waiter of that batch and the batcher keeps serving; a cancelled waiter is dropped
    (its request too, if nobody else waits for it and it has not started); it follows the running
    event loop, so it works across ``asyncio.run`` calls; no task outlives the queue.

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
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        self.process = process
        self.batch_size = batch_size
        self.timeout = timeout
        self.run_in_thread = run_in_thread
        self.name = name
        self.stats = BatcherStats()
        self._is_async = inspect.iscoroutinefunction(process)
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[Hashable, _Job] = {}
        self._running: dict[Hashable, _Job] = {}
        self._worker: asyncio.Task[None] | None = None
        self._full: asyncio.Future[None] | None = None

    async def submit(self, key: Hashable, item: T) -> R:
        """Queue ``item`` under ``key`` and wait for its result."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        self.stats.submitted += 1
        job = self._pending.get(key) or self._running.get(key)
        if job is None:
            job = _Job(key, item, loop.time())
            self._pending[key] = job
            if self._worker is None:
                self._worker = loop.create_task(self._work(), name=f"genlm-{self.name}")
            elif len(self._pending) >= self.batch_size:
                self._wake()
        waiter: asyncio.Future[R] = loop.create_future()
        job.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                job.waiters.remove(waiter)
                if not job.waiters and self._pending.get(key) is job:
                    del self._pending[key]
            raise

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed() and old.is_running() and (self._pending or self._running):
            raise RuntimeError(f"{self.name}: in use by another running event loop")
        self._loop = loop
        self._pending, self._running = {}, {}
        self._worker, self._full = None, None

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
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                if len(self._pending) < self.batch_size:
                    oldest = next(iter(self._pending.values()))
                    delay = oldest.queued_at + self.timeout - loop.time()
                    if delay > 0:
                        await self._wait_until_full(delay)
                        continue
                    if self.timeout == 0:
                        await asyncio.sleep(0)  # let requests issued in this same step join
                keys = list(self._pending)[: self.batch_size]
                batch = [self._pending.pop(k) for k in keys]
                self._running.update((job.key, job) for job in batch)
                try:
                    results = await self._call([job.item for job in batch])
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
                        for waiter in job.waiters:
                            waiter.cancel()
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
        finally:
            if self._worker is asyncio.current_task():
                self._worker = None

    async def _call(self, items: list[T]) -> Sequence[Any]:
        if self._is_async:
            return await self.process(items)  # type: ignore[misc, no-any-return]
        if not self.run_in_thread:
            return self.process(items)  # type: ignore[return-value]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"genlm-{self.name}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.process, items)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the worker thread, if one was started. Queued requests on a live loop are failed."""
        for job in [*self._pending.values(), *self._running.values()]:
            job.resolve(Failed(RuntimeError(f"{self.name} was closed")))
        self._pending, self._running = {}, {}
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
