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
import threading
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from genlm_core import Request
from genlm_core.inflight import InFlight
from genlm_vllm.drivers.base import EngineDriver
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

    def __init__(self, engine: Any, thread: EngineThread, lay: Layout):
        super().__init__(lay)
        self.engine = engine
        self.engine_thread = thread

        async def pop(tags: list[str], discard: list[str]) -> list[Any]:
            return await client.every_worker_async(engine, "genlm_pop_rows", (tags, discard), lay.data_parallel)

        self.rows = open_channel(lay.capture, client.vocab_size(engine), pop_async=pop)
        self.loras = client.LoRARequests()
        #: engine requests in flight, by request (shared by equal ones, aborted with their last caller)
        self.in_flight: InFlight[Request, torch.Tensor] = InFlight()

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> AsyncLLMDriver:
        """Start an AsyncLLM for ``model`` on a new engine thread."""
        thread = EngineThread()

        async def build(kwargs: dict[str, Any]) -> Any:  # on the engine loop: AsyncLLM's output handler runs there
            return client.start_async_llm(kwargs)

        try:
            return launch(model, options, lay, lambda kwargs: thread.call(build(kwargs)), lambda e: cls(e, thread, lay))
        except BaseException:
            thread.stop()  # (a driver that failed its check has stopped it already)
            raise

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
        params = client.row_params(ticket.extra_args[0])
        self.batches += 1
        finished = False
        try:
            lora = self.loras.get(request.adapter)
            await client.run_async(
                self.engine, request.token_ids, params, ticket.tags[0], cache_salt=cache_salt, lora=lora
            )
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
        """The row of one context alone, salted so that no cached KV block is reused."""
        return self.engine_thread.call(self._logits(request, cache_salt=uuid.uuid4().hex))

    def fail_in_flight(self, error: BaseException) -> None:
        self.in_flight.fail_all(error)

    # ---- sampling and the rest ----------------------------------------------------------------

    async def sample(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """Streamed like every request; cancelling the caller aborts it in the engine."""
        params = client.sample_params(max_tokens, eos, temperature, seed)
        return await asyncio.wrap_future(self.engine_thread.submit(self._sample_one(request, params, eos)))

    async def _sample_one(self, request: Request, params: Any, eos: tuple[int, ...]) -> list[int]:
        assert self.rows is not None
        self.batches += 1
        lora = self.loras.get(request.adapter)
        final = await client.run_async(self.engine, request.token_ids, params, self.rows.new_tags(1)[0], lora=lora)
        assert final is not None
        return client.sampled_tokens(final, eos)

    def top_logprobs(self, contexts: Sequence[Sequence[int]], k: int) -> list[dict[int, float]]:
        assert self.rows is not None

        async def one(context: Sequence[int], tag: str) -> dict[int, float]:
            return client.first_token_logprobs(await client.run_async(self.engine, context, client.top_params(k), tag))

        async def every() -> list[dict[int, float]]:
            tags = self.rows.new_tags(len(contexts))  # type: ignore[union-attr]
            return list(await asyncio.gather(*(one(c, t) for c, t in zip(contexts, tags))))

        return self.engine_thread.call(every())

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Every worker of every engine (vLLM's data parallel included)."""
        return self.engine_thread.call(client.every_worker_async(self.engine, method, args, self.layout.data_parallel))

    def load_lora(self, name: str, path: str) -> None:
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine_thread.call(client.remove_lora_async(self.engine, self.loras.pop_id(name)))

    def reset_prefix_cache(self) -> None:
        self.engine_thread.call(client.reset_prefix_cache_async(self.engine))

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
