"""The AutoBatcher: flush rules, dedup, failures, cancellation, event loops, stress."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from genlm_core import AutoBatcher, Failed
from genlm_core.batching import flush_delay


class Recorder:
    """A batch function that records its batches and squares its inputs."""

    def __init__(self, fail_on=None, delay=0.0):
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.delay = delay

    def __call__(self, items):
        self.batches.append(list(items))
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in items:
            raise ValueError(f"boom on {self.fail_on}")
        return [x * x for x in items]


async def test_flushes_at_batch_size_without_waiting_for_timeout():
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=4, timeout=600)
    out = await asyncio.wait_for(asyncio.gather(*(b.submit(i, i) for i in range(8))), 60)
    assert out == [i * i for i in range(8)]
    assert rec.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (b.stats.full_flushes, b.stats.timed_flushes) == (2, 0)  # neither waited for the timeout


def test_flush_policy_counts_the_timeout_from_the_oldest_request():
    """The policy as a function of an injected clock: requests queued at t=0 and t=0.1, timeout 0.2."""
    assert flush_delay(0.0, 2, now=0.1, batch_size=100, timeout=0.2) == 0.1  # exact: 0.2 - 0.1 rounds to 0.1
    assert flush_delay(0.0, 2, now=0.2, batch_size=100, timeout=0.2) == 0.0  # not 0.3: the oldest decides
    assert flush_delay(0.0, 100, now=0.0, batch_size=100, timeout=0.2) == 0.0  # full: at once
    assert flush_delay(5.0, 1, now=0.0, batch_size=100, timeout=0.0) == 5.0  # a clock behind waits


async def test_partial_batch_flushes_after_timeout_with_later_requests_joining():
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=100, timeout=0.2, flush="timeout")
    first = asyncio.ensure_future(b.submit(1, 1))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(b.submit(2, 2))
    assert await first == 1 and await second == 4
    assert rec.batches == [[1, 2]]
    assert (b.stats.full_flushes, b.stats.timed_flushes) == (0, 1)


async def test_zero_timeout_still_batches_one_gather():
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=64, timeout=0)
    await asyncio.gather(*(b.submit(i, i) for i in range(10)))
    assert rec.batches == [list(range(10))]


async def test_idle_flush_sends_a_lone_request_at_once_when_the_program_waits():
    """Under "idle" nobody waits for a timer: the program sleeps, so nothing else can be queued."""
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=100, timeout=600)
    waiter = asyncio.ensure_future(b.submit(1, 1))
    await asyncio.sleep(0.05)  # the event loop has nothing else to run
    assert waiter.done() and waiter.result() == 1
    assert (b.stats.idle_flushes, b.stats.timed_flushes, b.stats.full_flushes) == (1, 0, 0)


async def test_idle_flush_waits_while_the_program_still_runs():
    """Tasks that reach their submit after several event-loop passes still join the same batch: the
    loop was never idle until all of them waited (under "timeout" with timeout=0 they would not)."""

    async def particle(i):
        for _ in range(i):  # work interleaved with other tasks
            await asyncio.sleep(0)
        return await b.submit(i, i)

    for flush, batches in (("idle", [list(range(10))]), ("timeout", None)):
        rec = Recorder()
        b = AutoBatcher(rec, batch_size=64, timeout=600 if flush == "idle" else 0, flush=flush)
        assert await asyncio.gather(*(particle(i) for i in range(10))) == [i * i for i in range(10)]
        if batches is not None:
            assert rec.batches == batches and b.stats.idle_flushes == 1
        else:
            assert len(rec.batches) > 1


@pytest.mark.parametrize("flush", ["eager", "idle"])
async def test_eager_flush_computes_the_second_half_while_the_program_works_on_the_first(flush):
    """Eight particles ask at once. Under "eager" the model takes the first half, then the second as
    soon as the first is done, and computes it while a particle of the first half works on its row
    (that work waits to see the second batch start); under "idle" the eight are one batch."""
    second_started = threading.Event()
    batches, overlapped = [], []

    def process(items):
        batches.append(list(items))
        if len(batches) == 2:
            second_started.set()
        return [x * x for x in items]

    b = AutoBatcher(process, batch_size=64, timeout=600, run_in_thread=True, flush=flush)

    async def particle(i):
        row = await b.submit(i, i)
        if i == 0:  # the particle's own work, blocking the event loop
            overlapped.append(second_started.wait(timeout=5 if flush == "eager" else 0.2))
        return row

    out = await asyncio.wait_for(asyncio.gather(*(particle(i) for i in range(8))), 30)
    b.close()
    assert out == [i * i for i in range(8)]
    if flush == "eager":
        assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]] and overlapped == [True]
        assert b.stats.eager_flushes == 2
    else:
        assert batches == [list(range(8))] and overlapped == [False]


async def test_busy_seconds_count_the_time_the_model_computes():
    rec = Recorder(delay=0.05)
    b = AutoBatcher(rec, batch_size=2, timeout=0, run_in_thread=True)
    await asyncio.gather(*(b.submit(i, i) for i in range(6)))  # three batches
    assert b.stats.batches == 3
    assert 0.15 <= b.stats.busy_seconds < 5
    b.close()


async def test_identical_requests_computed_once():
    rec = Recorder(delay=0.05)
    b = AutoBatcher(rec, batch_size=8, timeout=0.01, run_in_thread=True)
    first = asyncio.gather(*(b.submit("k", 3) for _ in range(5)))
    await asyncio.sleep(0.03)  # the first batch is now running in the worker thread
    late = await b.submit("k", 3)  # joins the in-flight computation
    assert await first == [9] * 5 and late == 9
    assert rec.batches == [[3]]
    b.close()


async def test_exception_fails_whole_batch_and_batcher_keeps_serving():
    rec = Recorder(fail_on=2)
    b = AutoBatcher(rec, batch_size=3, timeout=0.01)
    results = await asyncio.gather(*(b.submit(i, i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ValueError) and "boom on 2" in str(r) for r in results)
    assert await asyncio.gather(*(b.submit(i, i) for i in (5, 6))) == [25, 36]


async def test_per_item_failure_only_fails_that_item():
    def process(items):
        return [Failed(KeyError(x)) if x < 0 else x for x in items]

    b = AutoBatcher(process, batch_size=4, timeout=0.01)
    ok, bad = await asyncio.gather(b.submit(1, 1), b.submit(-1, -1), return_exceptions=True)
    assert ok == 1 and isinstance(bad, KeyError)


async def test_wrong_result_count_is_an_error_for_everyone():
    b = AutoBatcher(lambda items: [1], batch_size=2, timeout=0.01)
    results = await asyncio.gather(b.submit(1, 1), b.submit(2, 2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "1 results for 2 items" in str(r) for r in results)


async def test_cancelled_waiter_is_dropped_and_others_unaffected():
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=10, timeout=0.1)
    doomed = asyncio.ensure_future(b.submit("doomed", 100))
    shared_a = asyncio.ensure_future(b.submit("shared", 7))
    shared_b = asyncio.ensure_future(b.submit("shared", 7))
    keep = asyncio.ensure_future(b.submit("keep", 2))
    await asyncio.sleep(0)
    doomed.cancel()
    shared_a.cancel()
    assert await keep == 4 and await shared_b == 49
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert rec.batches == [[7, 2]]  # the doomed request never ran; "shared" still had a waiter


async def test_async_process_function():
    async def process(items):
        await asyncio.sleep(0.001)
        return [x + 1 for x in items]

    b = AutoBatcher(process, batch_size=4, timeout=0.001)
    assert await asyncio.gather(*(b.submit(i, i) for i in range(6))) == [1, 2, 3, 4, 5, 6]


async def test_thread_mode_keeps_event_loop_free():
    rec = Recorder(delay=0.2)
    b = AutoBatcher(rec, batch_size=1, timeout=0, run_in_thread=True)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.ensure_future(ticker())
    assert await b.submit(3, 3) == 9
    t.cancel()
    assert ticks >= 10  # the loop kept running while the batch computed in the worker thread
    assert rec.batches == [[3]]
    b.close()


def test_works_across_asyncio_run_calls():
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=4, timeout=0.01, run_in_thread=True)

    async def step(offset):
        return await asyncio.wait_for(asyncio.gather(*(b.submit(i, i + offset) for i in range(6))), 5)

    for round_ in range(3):
        assert asyncio.run(step(round_)) == [(i + round_) ** 2 for i in range(6)]
    b.close()


def test_loop_interrupted_mid_batch_leaves_batcher_usable():
    rec = Recorder(delay=0.2)
    b = AutoBatcher(rec, batch_size=2, timeout=0, run_in_thread=True)

    async def abandon():
        task = asyncio.ensure_future(b.submit(1, 1))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(abandon())
    assert asyncio.run(asyncio.wait_for(b.submit(2, 2), 5)) == 4
    b.close()


@pytest.mark.parametrize("flush", ["idle", "eager", "timeout"])
def test_stress_10k_concurrent_requests_no_hang_no_leaked_tasks(flush):
    rec = Recorder()
    b = AutoBatcher(rec, batch_size=128, timeout=0.001, run_in_thread=True, flush=flush)

    async def main():
        keys = [i % 7000 for i in range(10_000)]  # some duplicates too
        out = await asyncio.wait_for(asyncio.gather(*(b.submit(k, k) for k in keys)), 60)
        assert out == [k * k for k in keys]
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert sum(len(x) for x in rec.batches) == 7000  # each distinct key computed once
    assert max(len(x) for x in rec.batches) <= 128
    b.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(f"genlm-{b.name}")]


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="batch_size"):
        AutoBatcher(lambda x: x, batch_size=0)
    with pytest.raises(ValueError, match="timeout"):
        AutoBatcher(lambda x: x, timeout=-1)
    with pytest.raises(ValueError, match="flush must be one of 'idle', 'eager', 'timeout'"):
        AutoBatcher(lambda x: x, flush="soon")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.soak
async def test_memory_stays_bounded_over_a_million_requests():
    """Live objects after 100,000 and after 1,000,000 requests are the same: nothing is kept per
    request or per batch (statistics keep the last RECENT_BATCHES sizes only)."""
    import gc

    from genlm_core.batching import RECENT_BATCHES

    b = AutoBatcher(lambda xs: xs, batch_size=1000, timeout=0)
    live = {}
    for n, start in enumerate(range(0, 1_000_000, 10_000)):
        await asyncio.gather(*(b.submit(i, i) for i in range(start, start + 10_000)))
        if n in (9, 99):
            gc.collect()
            live[n] = len(gc.get_objects())
    assert b.stats.submitted == b.stats.items == 1_000_000 and b.stats.batches == 1000
    assert len(b.stats.sizes) <= RECENT_BATCHES and not b._pending and not b._running
    assert abs(live[99] - live[9]) < 100, live


async def test_submit_many_mixed_with_submits_answers_each_key_once_in_order():
    """Random steps of ``submit_many`` (with repeated keys) beside single submits, flushed at random
    batch sizes: every caller gets f(key) for each of its keys, in order, and each distinct key in
    flight is computed once."""
    import random

    rng = random.Random(4)
    computed: list[int] = []

    def square(items):
        computed.extend(items)
        return [Failed(ValueError(f"bad {x}")) if x % 97 == 13 else x * x for x in items]

    for batch_size in (1, 3, 8, 64):
        batcher = AutoBatcher(square, batch_size=batch_size, timeout=0.0)
        computed.clear()
        groups = [[rng.randrange(200) for _ in range(rng.randrange(0, 12))] for _ in range(20)]
        singles = [rng.randrange(200) for _ in range(20)]
        results = await asyncio.gather(
            *(batcher.submit_many(g, g) for g in groups),
            *(batcher.submit(k, k) for k in singles),
            return_exceptions=True,
        )
        for keys, got in zip(groups, results[: len(groups)]):
            bad = [k for k in keys if k % 97 == 13]
            if bad:
                assert isinstance(got, ValueError) and str(got) in {f"bad {k}" for k in bad}
            else:
                assert got == [k * k for k in keys]
        for k, got in zip(singles, results[len(groups) :]):
            if k % 97 == 13:
                assert isinstance(got, ValueError)
            else:
                assert got == k * k
        assert len(computed) == len(set(computed))  # everything was in flight at once: each key once
        assert set(computed) == {k for g in groups for k in g} | set(singles)
        batcher.close()


async def test_a_cancelled_submit_many_leaves_shared_keys_to_their_other_waiters():
    release = threading.Event()
    batcher = AutoBatcher(
        lambda items: (release.wait(5), [x + 1 for x in items])[1], batch_size=1, timeout=0.0, run_in_thread=True
    )
    first = asyncio.ensure_future(batcher.submit(0, 0))  # occupies the model
    await asyncio.sleep(0.05)
    group = asyncio.ensure_future(batcher.submit_many([1, 2, 3], [1, 2, 3]))
    other = asyncio.ensure_future(batcher.submit(2, 2))
    await asyncio.sleep(0.01)
    group.cancel()
    await asyncio.sleep(0.01)
    assert batcher.queued() == [2]  # 1 and 3 had no other waiter
    release.set()
    assert await first == 1 and await other == 3
    with pytest.raises(asyncio.CancelledError):
        await group
    assert await batcher.submit_many([], []) == []
    with pytest.raises(ValueError, match="2 keys for 1 items"):
        await batcher.submit_many([1, 2], [1])
    batcher.close()
