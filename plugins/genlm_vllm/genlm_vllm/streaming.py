"""``engine="async"``: vLLM's AsyncLLM, each request streamed into the running engine as it comes.

There is no batch barrier of ours: vLLM's scheduler batches whatever is in flight at each step. The
AsyncLLM lives on an event loop of its own in a daemon thread (:class:`EngineThread`), so it works
whatever loop, thread or ``asyncio.run`` the caller uses, and its output handler never dies with a
caller's loop. Concurrent requests for the same context share one engine request; a request whose
every caller was cancelled is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from genlm_core import BatcherError, ClosedError, Request, Tokenizer
from genlm_core.batching import Failed
from genlm_vllm.lm import (
    AsyncVirtualLM,
    _hidden_from_vllm_kernel_scan,
    first_token_logprobs,
    sampling_params,
    stack_rows,
    without_stop,
)
from genlm_vllm.options import VLLMOptions
from genlm_vllm.processes import Layout, engine_start
from genlm_vllm.rows import RowChannel, RpcRows, SharedMemoryRows

log = logging.getLogger(__name__)

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


class _Shared:
    """One engine request and the callers waiting for it."""

    __slots__ = ("failure", "future", "waiters")

    def __init__(self, future: concurrent.futures.Future[torch.Tensor]):
        self.future = future
        self.waiters = 0
        self.failure: BaseException | None = None  # what waiters get when we cancel it ourselves

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.future.cancel()


async def every_worker(engine: Any, lay: Layout, method: str, args: tuple[Any, ...]) -> list[Any]:
    """``collective_rpc`` on every worker; with vLLM's data parallel, on every engine's workers
    (AsyncLLM's own ``collective_rpc`` reaches engine 0 only)."""
    if lay.data_parallel > 1:
        per_engine = await engine.engine_core.call_utility_all_async("collective_rpc", method, None, args, None)
        return [reply for replies in per_engine for reply in replies]
    return await engine.collective_rpc(method, args=args)


class StreamingVirtualLM(AsyncVirtualLM):
    """:class:`~genlm_vllm.AsyncVirtualLM` on vLLM's AsyncLLM (``engine="async"``)."""

    def __init__(
        self,
        engine: Any,
        thread: EngineThread,
        tokenizer: Tokenizer,
        options: VLLMOptions,
        *,
        rows: RowChannel,
        engine_layout: Layout,
    ):
        super().__init__(engine, tokenizer, options, rows=rows, engine_layout=engine_layout)
        self.engine_thread = thread
        self._inflight: dict[Request, _Shared] = {}
        self._inflight_lock = threading.Lock()

    @classmethod
    def start(cls, kwargs: dict[str, Any], tokenizer: Tokenizer, options: VLLMOptions, lay: Layout) -> Any:
        """Start an AsyncLLM with engine arguments ``kwargs`` on a new engine thread."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        thread = EngineThread()

        async def build() -> Any:  # on the engine loop, so AsyncLLM's output handler runs there
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        try:
            with engine_start(lay), _hidden_from_vllm_kernel_scan():
                engine = thread.call(build())
        except BaseException:
            thread.stop()
            raise
        rows: RowChannel
        if lay.capture == "rpc":

            async def pop(tags: list[str], discard: list[str]) -> list[Any]:
                return await every_worker(engine, lay, "genlm_pop_rows", (tags, discard))

            rows = RpcRows(pop_async=pop)
        else:
            rows = SharedMemoryRows(engine.model_config.get_vocab_size())
        return cls(engine, thread, tokenizer, options, rows=rows, engine_layout=lay)

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a ``RowsExtension`` method on every worker of every engine; their replies."""
        return self.engine_thread.call(every_worker(self.llm, self.layout, method, args))

    # ---- logprobs -------------------------------------------------------------------------------

    async def request_logprobs(self, request: Request) -> torch.Tensor:
        cached = self.cache.get(request)
        if cached is not None:
            return cached
        with self._inflight_lock:
            shared = self._inflight.get(request)
            if shared is None:
                self.ensure_open()
                shared = self._inflight[request] = _Shared(self.engine_thread.submit(self._row(request)))
                shared.future.add_done_callback(functools.partial(self._forget, request, shared))
            shared.waiters += 1
        try:
            return await _result_of(shared)
        except asyncio.CancelledError:
            with self._inflight_lock:
                shared.waiters -= 1
                abandoned = shared.waiters == 0
                if abandoned and self._inflight.get(request) is shared:
                    del self._inflight[request]  # a new caller starts afresh, not on this aborted one
            if abandoned:  # nobody wants it any more: abort it in the engine
                shared.future.cancel()
            raise

    def _forget(self, request: Request, shared: _Shared, _: object = None) -> None:
        with self._inflight_lock:
            if self._inflight.get(request) is shared:
                del self._inflight[request]

    async def _row(self, request: Request) -> torch.Tensor:
        """On the engine loop: one request's row, normalised and cached."""
        logits = await self._logits(request)
        row = self.finish_rows([request], logits[None])[0]
        if isinstance(row, Failed):
            raise row.error
        return row

    async def _logits(self, request: Request) -> torch.Tensor:
        from vllm.inputs import TokensPrompt

        ticket = self.rows.prepare(1)
        params = sampling_params(1, (), 1.0, None)
        params.extra_args = ticket.extra_args[0]
        adapter = self.lora_request(request.adapter)
        self.generate_calls += 1
        finished = False
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.token_ids))
            async for _ in self.llm.generate(prompt, params, ticket.tags[0], lora_request=adapter):
                pass
            rows = await self.rows.collect_async(ticket)
            finished = True
        finally:
            # AsyncLLM has sent the abort of a cancelled request by now: later requests reach the
            # engine after it, so the slot can be handed out again
            self.rows.release(ticket, finished or isinstance(self.rows, SharedMemoryRows))
        return stack_rows(rows, [request])[0]

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        """The synchronous path (``next_token_logprobs_sync`` and friends): stream them all, wait."""

        async def logits() -> list[torch.Tensor]:
            return list(await asyncio.gather(*(self._logits(r) for r in requests)))

        return torch.stack(self.engine_thread.call(logits()))

    def engine_top_logprobs(self, contexts: Sequence[Sequence[int]], k: int = 20) -> list[dict[int, float]]:
        """vLLM's own ``logprobs=k`` for the next token after each context (see the LLM engine's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        async def one(context: Sequence[int], tag: str) -> dict[int, float]:
            params = SamplingParams(max_tokens=1, logprobs=k, detokenize=False)
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(context)), params, tag):
                final = out
            assert final is not None
            return first_token_logprobs(final)

        async def every() -> list[dict[int, float]]:
            tags = self.rows.new_tags(len(contexts))
            return list(await asyncio.gather(*(one(c, t) for c, t in zip(contexts, tags))))

        return self.engine_thread.call(every())

    def reset_async_queries(self) -> None:
        """Fail every request still in flight with :class:`~genlm_core.errors.BatcherError` (and
        abort it in the engine)."""
        super().reset_async_queries()
        with self._inflight_lock:
            pending, self._inflight = list(self._inflight.values()), {}
        for shared in pending:
            shared.fail(BatcherError("reset_async_queries() dropped this request"))

    # ---- sampling -------------------------------------------------------------------------------

    async def sample_request(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """Streamed like every request; cancelling the caller aborts it in the engine."""
        params = sampling_params(max_tokens, eos, temperature, seed)
        return await asyncio.wrap_future(self.engine_thread.submit(self._sample_one(request, params)))

    async def _sample_one(self, request: Request, params: Any) -> list[int]:
        from vllm.inputs import TokensPrompt

        adapter = self.lora_request(request.adapter)
        self.generate_calls += 1
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(request.token_ids))
        async for out in self.llm.generate(prompt, params, self.rows.new_tags(1)[0], lora_request=adapter):
            final = out
        assert final is not None
        return without_stop(final.outputs[0].token_ids, params.stop_token_ids)

    # ---- engine calls ---------------------------------------------------------------------------

    def unload_lora(self, name: str) -> None:
        self.engine_thread.call(self.llm.remove_lora(self.adapters[name].lora_int_id))

    def clear_backend_cache(self) -> None:
        self.engine_thread.call(self.llm.reset_prefix_cache())

    def close_backend(self) -> None:
        self.sampler.close()
        with self._inflight_lock:
            pending, self._inflight = list(self._inflight.values()), {}
        for shared in pending:
            shared.fail(ClosedError("the model was closed by cleanup() while this request ran"))
        engine, self.llm = self.llm, None

        async def shutdown() -> None:
            engine.shutdown()

        try:
            self.engine_thread.call(shutdown(), timeout=60)
        except Exception as exc:  # a crashed engine: still free what is ours
            log.warning("vLLM AsyncLLM shutdown failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.engine_thread.stop()
            self.release_files()


def _result_of(shared: _Shared) -> asyncio.Future[torch.Tensor]:
    """A future on the running loop that follows ``shared.future`` and can be cancelled alone."""
    loop = asyncio.get_running_loop()
    mine: asyncio.Future[torch.Tensor] = loop.create_future()

    def copy(done: concurrent.futures.Future[torch.Tensor]) -> None:
        if mine.done():
            return
        if done.cancelled():
            mine.set_exception(shared.failure or BatcherError("the request was cancelled"))
        elif done.exception() is not None:
            mine.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            mine.set_result(done.result())

    def follow(done: concurrent.futures.Future[torch.Tensor]) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the caller's loop is gone
            pass

    shared.future.add_done_callback(follow)
    return mine
