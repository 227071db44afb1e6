"""The AsyncLM base: contract, validation, caching, failures, sampling, lifecycle."""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter

import pytest
import torch

from genlm_core import Request, logits_to_logprobs
from genlm_core.lm import sample_token
from genlm_core.testing import bounds, check_lm_contract

from .helpers import BigramLM


def reference(lm: BigramLM, context) -> torch.Tensor:
    """Closed-form logprobs of BigramLM, computed independently in float64."""
    v = lm.vocab_size
    z = math.log(math.exp(lm.peak) + v - 1)
    out = torch.full((v,), -z, dtype=torch.float64)
    out[(context[-1] + 1) % v] = lm.peak - z
    return out


def check_row(lm: BigramLM, row: torch.Tensor, context, name: str = "bigram row vs closed form") -> None:
    """``row`` against :func:`reference`: the float32 ``log_softmax`` of exact logits (0 and ``peak``) is off
    by at most :func:`bounds.log_softmax_error` at the most negative entry, ``-z``; the float64 closed form
    by a few roundings of ``z`` (exp, add, log: ``8 U64 z`` covers them with room)."""
    want = reference(lm, context)
    z = -float(want.min())
    tol = bounds.Bound(
        float(bounds.log_softmax_error(lm.vocab_size, z)) + 8 * bounds.U64 * z,
        f"float32 log_softmax of exact logits over V={lm.vocab_size} + a float64 closed form",
    )
    bounds.within(name, bounds.row_difference(row, want), tol, f"context {list(context)}")


@pytest.fixture
def lm(toy_tok):
    return BigramLM(toy_tok, batch_size=8, timeout=0.005)


def test_contract(lm):
    check_lm_contract(lm, [[1], [5, 6], [3, 3, 3], [0]], close=True)


async def test_concurrent_requests_match_reference_and_are_batched(lm):
    contexts = [[i, i + 1] for i in range(20)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    for c, row in zip(contexts, rows):
        assert row.dtype == torch.float32 and row.shape == (lm.vocab_size,)
        check_row(lm, row, c)
    assert [len(c) for c in lm.calls] == [8, 8, 4]


async def test_padded_model_vocabulary_is_cut_to_the_tokenizer(toy_tok):
    lm = BigramLM(toy_tok, width=toy_tok.vocab_size + 37)
    row = await lm.next_token_logprobs([4])
    assert row.shape == (lm.vocab_size,)
    check_row(lm, row, [4])


def test_logits_to_logprobs_masks_missing_ids_and_renormalises():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]], dtype=torch.bfloat16)
    out = logits_to_logprobs(logits, 4, torch.tensor([1]))
    assert out.dtype == torch.float32 and out.shape == (1, 4)
    assert out[0, 1] == float("-inf")
    expected = torch.log_softmax(torch.tensor([1.0, 3.0, 4.0], dtype=torch.float64), 0)
    # bfloat16 1, 3, 4 are exact: a float32 log_softmax over 3 terms against float64 (~1e-16 of its own)
    tol = bounds.log_softmax_error(3, float(expected.min()))
    bounds.within("logits_to_logprobs vs float64", bounds.row_difference(out[0, [0, 2, 3]], expected), tol)
    assert logits[0, 1] == 2.0  # the input is not modified
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        logits_to_logprobs(logits, 6)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([], ValueError, "empty"),
        ([1, -1], ValueError, "token id -1 at position 1 is outside"),
        ([1, 10**6], ValueError, "token id 1000000 at position 1"),
        ([1.5], TypeError, "sequence of ints"),
        (["a"], TypeError, "sequence of ints"),
        (7, TypeError, "sequence of ints"),
    ],
)
async def test_bad_token_ids_raise_before_any_model_work(lm, bad, error, message):
    with pytest.raises(error, match=message):
        await lm.next_token_logprobs(bad)
    with pytest.raises(error, match=message):
        lm.next_token_logprobs_sync(bad)
    with pytest.raises(error, match=message):
        await lm.batch_next_token_logprobs([[1], bad])
    with pytest.raises(error, match=message):
        lm.batch_next_token_logprobs_sync([[1], bad])
    assert lm.calls == []


def test_accepts_numpy_and_torch_ids(lm):
    import numpy as np

    a = lm.next_token_logprobs_sync(np.array([3, 4]))
    b = lm.next_token_logprobs_sync(torch.tensor([3, 4]))
    c = lm.next_token_logprobs_sync([np.int64(3), 4])
    assert a is b is c  # one cache entry: the keys are equal
    assert len(lm.calls) == 1


async def test_output_cache_and_adapter_in_key(toy_tok):
    class AdapterLM(BigramLM):
        adapter = None

        @property
        def active_adapter(self):
            return self.adapter

    lm = AdapterLM(toy_tok)
    first = await lm.next_token_logprobs([2])
    assert await lm.next_token_logprobs([2]) is first and len(lm.calls) == 1
    lm.adapter = "lora-a"
    await lm.next_token_logprobs([2])
    assert len(lm.calls) == 2 and lm.calls[-1][0] == Request((2,), "lora-a")
    lm.clear_cache()
    await lm.next_token_logprobs([2])
    assert len(lm.calls) == 3


async def test_exception_in_forward_fails_its_batch_then_recovers(toy_tok):
    class Flaky(BigramLM):
        fail = True

        def forward_batch(self, requests):
            if self.fail:
                self.fail = False
                raise RuntimeError("device fell over")
            return super().forward_batch(requests)

    lm = Flaky(toy_tok, batch_size=4, timeout=0.005)
    results = await asyncio.gather(*(lm.next_token_logprobs([i]) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "device fell over" in str(r) for r in results)
    assert not len(lm.cache)  # nothing half-cached
    rows = await asyncio.gather(*(lm.next_token_logprobs([i]) for i in range(3)))
    check_row(lm, rows[2], [2])


async def test_nan_logits_fail_only_their_request(toy_tok):
    class NanOnFive(BigramLM):
        def forward_batch(self, requests):
            logits = super().forward_batch(requests)
            for row, r in enumerate(requests):
                if r.token_ids[-1] == 5:
                    logits[row, 3] = float("nan")
            return logits

    lm = NanOnFive(toy_tok, batch_size=4, timeout=0.005)
    ok, bad = await asyncio.gather(lm.next_token_logprobs([1]), lm.next_token_logprobs([5]), return_exceptions=True)
    assert isinstance(bad, FloatingPointError) and "NaN" in str(bad)
    check_row(lm, ok, [1])
    assert Request((5,)) not in lm.cache


async def test_cancelled_request_does_not_disturb_others(toy_tok):
    lm = BigramLM(toy_tok, batch_size=8, timeout=0.05)
    doomed = asyncio.ensure_future(lm.next_token_logprobs([9]))
    kept = asyncio.ensure_future(lm.next_token_logprobs([10]))
    await asyncio.sleep(0)
    doomed.cancel()
    row = await kept
    check_row(lm, row, [10])
    assert [r.token_ids for r in lm.calls[0]] == [(10,)]


def test_sync_and_async_calls_never_overlap_in_the_model(toy_tok):
    class Exclusive(BigramLM):
        busy = False

        def forward_batch(self, requests):
            assert not self.busy, "two forwards at once"
            self.busy = True
            try:
                import time

                time.sleep(0.002)
                return super().forward_batch(requests)
            finally:
                self.busy = False

    lm = Exclusive(toy_tok, batch_size=4, timeout=0.001, cache_size=0)

    async def async_side():
        return await asyncio.gather(*(lm.next_token_logprobs([i, 1]) for i in range(40)))

    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("rows", asyncio.run(async_side())))
    thread.start()
    sync_rows = [lm.next_token_logprobs_sync([i, 2]) for i in range(40)]
    thread.join(30)
    for i, row in enumerate(box["rows"]):
        check_row(lm, row, [i, 1])
    for i, row in enumerate(sync_rows):
        check_row(lm, row, [i, 2])


async def test_greedy_sampling_follows_the_model_and_stops_on_eos(lm):
    out = await lm.sample([10], max_tokens=5, eos_token_ids=[], temperature=0)
    assert out == [11, 12, 13, 14, 15]
    out = await lm.sample([10], max_tokens=50, eos_token_ids=[13], temperature=0)
    assert out == [11, 12]  # it stops at the EOS token, which is not returned (genlm-backend's contract)
    assert await lm.sample([10], max_tokens=0, eos_token_ids=[]) == []


async def test_seeded_sampling_is_reproducible_and_batched(toy_tok):
    lm = BigramLM(toy_tok, peak=1.0, batch_size=16, timeout=0.01)
    a = await lm.batch_sample([[1], [2], [3]], max_tokens=6, eos_token_ids=[0], seed=7)
    b = await lm.batch_sample([[1], [2], [3]], max_tokens=6, eos_token_ids=[0], seed=7)
    assert a == b and all(1 <= len(x) <= 6 for x in a)
    assert a[0] == await lm.sample([1], max_tokens=6, eos_token_ids=[0], seed=7)
    assert max(len(c) for c in lm.calls) > 1  # concurrent samplers shared batches


def test_sample_token_matches_distribution():
    logprobs = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, -30.0]), 0)
    gen = torch.Generator().manual_seed(0)
    counts = Counter(sample_token(logprobs, 1.0, gen) for _ in range(20_000))
    probs = logprobs.exp()
    # a seeded generator (the same draws on every run); 0.015 is over 4 standard errors of a frequency
    # of 20,000 draws (sqrt(p (1 - p) / n) <= 0.5 / sqrt(20,000) = 0.0035): a sampler off by 0.015 fails
    for i in range(3):
        assert abs(counts[i] / 20_000 - probs[i].item()) < 0.015
    hot = Counter(sample_token(logprobs, 0.5, gen) for _ in range(20_000))
    sharp = torch.softmax(torch.tensor([0.0, 2.0, 4.0, -60.0]), 0)
    assert abs(hot[2] / 20_000 - sharp[2].item()) < 0.015


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"eos_token_ids": [10**7]}, "eos_token_ids entry 10000000 is outside"),
    ],
)
async def test_bad_sampling_arguments(lm, kwargs, message):
    args = {"max_tokens": 3, "eos_token_ids": [], **kwargs}
    with pytest.raises(ValueError, match=message):
        await lm.sample([1], **args)


async def test_context_managers_clean_up(toy_tok):
    class Closing(BigramLM):
        closed = 0

        def close_backend(self):
            self.closed += 1

    with Closing(toy_tok) as lm:
        lm.next_token_logprobs_sync([1])
    assert lm.closed == 1 and not len(lm.cache)
    lm.cleanup()  # a second cleanup does nothing
    assert lm.closed == 1
    async with Closing(toy_tok) as lm2:
        await lm2.next_token_logprobs([1])
    assert lm2.closed == 1
