"""``engine="async"``: vLLM's AsyncLLM behind the driver interface; each request streams in as it comes.

There is no batch barrier of ours: vLLM's scheduler batches whatever is in flight at each step. The
AsyncLLM lives on an event loop of its own in a daemon thread (:class:`EngineThread`), so it works
whatever loop, thread or ``asyncio.run`` the caller uses, and its output handler never dies with a
caller's loop. Concurrent requests for the same context share one engine request, and a request whose
every caller was cancelled is aborted in the engine: core's :class:`~genlm_core.inflight.InFlight`,
for streamed requests and the synchronous path alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from genlm_core import Request
from genlm_core.inflight import InFlight
from genlm_vllm.drivers.base import EngineCall, EngineDriver, EngineOp
from genlm_vllm.drivers.launch import launch
from genlm_vllm.layout import Layout
from genlm_vllm.options import VLLMOptions
from genlm_vllm.transport.channels import SharedMemoryRows, open_channel, stack
from genlm_vllm.vllm_api import client

T = TypeVar("T")


class EngineThread:
    """An asyncio loop in a daemon thread; coroutines for the engine run there."""

    def __init__(self, name: str = "genlm-vllm-engine"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine loop and wait for it (from any other thread)."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


class AsyncLLMDriver(EngineDriver):
    """vLLM's AsyncLLM (``engine="async"``), on an engine thread of its own."""

    streams = True

    def __init__(self, engine: Any, thread: EngineThread, options: VLLMOptions, lay: Layout):
        super().__init__(lay, options)
        self.engine = engine
        self.engine_thread = thread

        async def pop(tags: list[str], discard: list[str]) -> list[Any]:
            return await client.every_worker_async(engine, "genlm_pop_rows", (tags, discard), lay.data_parallel)

        self.rows = open_channel(lay.capture, client.vocab_size(engine), pop_async=pop)
        #: engine requests in flight, by request (shared by equal ones, aborted with their last caller)
        self.in_flight: InFlight[Request, torch.Tensor] = InFlight()

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> AsyncLLMDriver:
        """Start an AsyncLLM for ``model`` on a new engine thread."""
        thread = EngineThread()

        async def build(kwargs: dict[str, Any]) -> Any:  # on the engine loop: AsyncLLM's output handler runs there
            return client.start_async_llm(kwargs)

        try:
            return launch(
                model, options, lay, lambda kwargs: thread.call(build(kwargs)), lambda e: cls(e, thread, options, lay)
            )
        except BaseException:
            thread.stop()  # (a driver that failed its check has stopped it already)
            raise

    # ---- the primitives -----------------------------------------------------------------------

    def run(self, calls: Sequence[EngineCall]) -> list[Any]:
        """Every call streamed into the running engine at once, and waited for."""

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(self._run_one(c) for c in calls)))

        return self.engine_thread.call(every())

    async def _run_one(self, call: EngineCall) -> Any:
        """On the engine loop: one engine request to its end, its output read."""
        assert self.rows is not None
        self.batches += 1
        request_id = call.request_id or self.rows.new_tags(1)[0]
        final = await client.run_async(
            self.engine,
            call.token_ids,
            call.params,
            request_id,
            cache_salt=call.cache_salt,
            lora=self.loras.get(call.adapter),
        )
        assert final is not None
        return call.read(final)

    def engine_call(self, op: EngineOp, *args: Any) -> list[Any]:
        if op == "collective_rpc":
            method, rpc_args = args
            reply = client.every_worker_async(self.engine, method, rpc_args, self.layout.data_parallel)
        else:
            reply = ASYNC_OPS[op](self.engine, *args)
        return [self.engine_thread.call(reply)]

    # ---- rows ---------------------------------------------------------------------------------

    async def stream_logits(self, request: Request) -> torch.Tensor:
        """The request's row from the running engine; concurrent callers of one context share one
        engine request, and it is aborted once every caller has been cancelled."""
        return await self.in_flight.run(request, lambda: self._submit(request))

    def _submit(self, request: Request) -> concurrent.futures.Future[torch.Tensor]:
        """Start one request's row on the engine loop (cancelling the future aborts it in the engine)."""
        if self.engine is None:
            raise RuntimeError("this engine is closed")
        return self.engine_thread.submit(self._logits(request))

    async def _logits(self, request: Request, cache_salt: str | None = None) -> torch.Tensor:
        """On the engine loop: one request's raw row (``cache_salt``: sharing no cached KV block)."""
        assert self.rows is not None
        ticket = self.rows.prepare(1)
        call = EngineCall(
            request.token_ids, client.row_params(ticket.extra_args[0]), request.adapter, cache_salt, ticket.tags[0]
        )
        finished = False
        try:
            await self._run_one(call)
            rows = await self.rows.collect_async(ticket)
            finished = True
        finally:
            # AsyncLLM has sent the abort of a cancelled request by now: later requests reach the
            # engine after it, so the slot can be handed out again
            self.rows.release(ticket, finished or isinstance(self.rows, SharedMemoryRows))
        return stack(rows, [request])[0]

    def logits(self, requests: Sequence[Request]) -> torch.Tensor:
        """The synchronous path (``next_token_logprobs_sync`` and friends): stream them all, sharing
        engine requests with those in flight, and wait."""

        async def every() -> list[torch.Tensor]:
            return list(await asyncio.gather(*(self.stream_logits(r) for r in requests)))

        return torch.stack(self.engine_thread.call(every()))

    def uncached_logits(self, request: Request) -> torch.Tensor:
        """The row of one context alone, salted so that no cached KV block is reused (streamed: rows
        from other hosts come back asynchronously here)."""
        return self.engine_thread.call(self._logits(request, cache_salt=uuid.uuid4().hex))

    def fail_in_flight(self, error: BaseException) -> None:
        self.in_flight.fail_all(error)

    # ---- sampling: streamed, as every request ---------------------------------------------------

    async def sample(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """Streamed like every request (no batch of ours); cancelling the caller aborts it in the engine."""
        call = EngineCall(
            request.token_ids,
            client.sample_params(max_tokens, eos, temperature, seed),
            request.adapter,
            read=functools.partial(client.sampled_tokens, eos=eos),
        )
        return await asyncio.wrap_future(self.engine_thread.submit(self._run_one(call)))

    def shutdown(self) -> None:
        from genlm_core import ClosedError

        self.fail_in_flight(ClosedError("the model was closed by cleanup() while this request ran"))
        engine, self.engine = self.engine, None

        async def shutdown() -> None:
            client.shutdown_async_llm(engine)

        try:
            self.engine_thread.call(shutdown(), timeout=60)
        finally:
            self.engine_thread.stop()


#: Each :data:`~genlm_vllm.drivers.base.EngineOp` on an ``AsyncLLM`` (``collective_rpc`` reaches every
#: data-parallel engine: :meth:`AsyncLLMDriver.engine_call`), each a coroutine for the engine loop.
ASYNC_OPS: dict[EngineOp, Callable[..., Any]] = {
    "remove_lora": client.remove_lora_async,
    "reset_prefix_cache": client.reset_prefix_cache_async,
}
