"""Streamed requests in flight (genlm_core.inflight): one computation per key, cancelled with its last caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from genlm_core import BatcherError, ClosedError
from genlm_core.inflight import InFlight

from .helpers import BigramLM
from .test_lm import check_row


class Starts:
    """A ``start`` that counts its calls and hands out futures the test resolves."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[int]] = []

    def __call__(self) -> concurrent.futures.Future[int]:
        self.futures.append(concurrent.futures.Future())
        return self.futures[-1]


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_equal_keys_share_one_computation_and_each_caller_gets_its_result():
    flight: InFlight[str, int] = InFlight()
    starts = Starts()
    callers = [asyncio.ensure_future(flight.run(key, starts)) for key in ["a", "b", "a", "a", "b"]]
    await settle()
    assert len(starts.futures) == 2 and len(flight) == 2
    starts.futures[0].set_result(1)
    starts.futures[1].set_result(2)
    assert await asyncio.gather(*callers) == [1, 2, 1, 1, 2]
    assert len(flight) == 0  # done: a later caller starts afresh
    later = asyncio.ensure_future(flight.run("a", starts))
    await settle()
    starts.futures[2].set_result(3)
    assert await later == 3 and len(starts.futures) == 3


async def test_the_computation_is_cancelled_only_with_its_last_caller():
    flight: InFlight[str, int] = InFlight()
    starts = Starts()
    first, second = (asyncio.ensure_future(flight.run("a", starts)) for _ in range(2))
    await settle()
    first.cancel()
    await settle()
    assert not starts.futures[0].cancelled() and len(flight) == 1  # the other caller still waits
    second.cancel()
    await settle()
    assert starts.futures[0].cancelled() and len(flight) == 0
    with pytest.raises(asyncio.CancelledError):
        await second
    third = asyncio.ensure_future(flight.run("a", starts))  # a new caller starts afresh
    await settle()
    assert len(starts.futures) == 2
    starts.futures[1].set_result(7)
    assert await third == 7


async def test_a_failure_fails_every_caller_and_fail_all_hands_them_its_error():
    flight: InFlight[str, int] = InFlight()
    starts = Starts()
    a1, a2, b = (asyncio.ensure_future(flight.run(key, starts)) for key in "aab")
    await settle()
    starts.futures[0].set_exception(ValueError("engine said no"))
    for caller in (a1, a2):
        with pytest.raises(ValueError, match="engine said no"):
            await asyncio.wait_for(caller, 5)
    flight.fail_all(BatcherError("dropped"))
    with pytest.raises(BatcherError, match="dropped"):
        await asyncio.wait_for(b, 5)
    assert starts.futures[1].cancelled() and len(flight) == 0


def test_callers_on_two_event_loops_in_two_threads_share_one_computation():
    flight: InFlight[str, int] = InFlight()
    starts = Starts()
    results: list[int] = []
    ready = threading.Barrier(3)

    def caller() -> None:
        async def one() -> int:
            waiting = asyncio.ensure_future(flight.run("a", starts))
            await settle()
            await asyncio.get_running_loop().run_in_executor(None, ready.wait)
            return await waiting

        results.append(asyncio.run(one()))

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    ready.wait(timeout=10)
    started = len(starts.futures)
    for future in starts.futures:  # (every one, so that no thread waits forever if the check fails)
        future.set_result(5)
    for thread in threads:
        thread.join(timeout=10)
    assert started == 1 and results == [5, 5]


class StreamingBigram(BigramLM):
    """BigramLM streaming each request (``forward_stream``), held until :attr:`go` is set."""

    streams = True

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.streamed: list[tuple[int, ...]] = []
        self.cancelled: list[tuple[int, ...]] = []
        self.go = asyncio.Event()

    async def forward_stream(self, request):
        self.streamed.append(request.token_ids)
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.token_ids)
            raise
        return self.forward_batch([request])[0]


async def test_a_streaming_backend_computes_each_context_once_and_aborts_what_nobody_wants(toy_tok):
    lm = StreamingBigram(toy_tok)
    contexts = [[1, 2], [3], [1, 2], [4, 4], [3]]
    callers = [asyncio.ensure_future(lm.next_token_logprobs(c)) for c in contexts]
    doomed = asyncio.ensure_future(lm.next_token_logprobs([9, 9]))
    await settle()
    assert sorted(lm.streamed) == [(1, 2), (3,), (4, 4), (9, 9)]
    doomed.cancel()
    await settle()
    assert lm.cancelled == [(9, 9)]  # its only caller was cancelled: the stream was aborted
    lm.go.set()
    for context, row in zip(contexts, await asyncio.gather(*callers), strict=True):
        check_row(lm, row, context)
    assert len(lm.streamed) == 4 and len(lm.in_flight) == 0
    assert lm.cached_logprobs([4, 4]) is not None  # cached once, for every caller


async def test_reset_and_cleanup_fail_streamed_requests_in_flight(toy_tok):
    lm = StreamingBigram(toy_tok)
    waiting = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
    await settle()
    lm.reset_async_queries()
    with pytest.raises(BatcherError, match="reset_async_queries"):
        await waiting
    await settle()
    assert lm.cancelled == [(1, 2)]
    waiting = asyncio.ensure_future(lm.next_token_logprobs([5]))
    await settle()
    lm.cleanup()
    with pytest.raises(ClosedError):
        await waiting
