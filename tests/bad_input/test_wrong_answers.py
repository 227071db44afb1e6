"""Regression tests for answers given for other input than the caller's (each failed before the fix)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from genlm_core.bytes import AsyncTokenByteTrie, TokenByteTrie, TrieMode
from genlm_core.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

VOCAB = [bytes([a]) for a in range(97, 123)] + [bytes([a, b]) for a in range(97, 110) for b in range(97, 110)]
V = len(VOCAB)


def slow_engine(monkeypatch, engine, seconds=0.02):
    """Make every engine batch take ``seconds``, so that requests are reliably in flight meanwhile."""
    reduce = engine._reduce

    def slowly(ws, op):
        time.sleep(seconds)
        return reduce(ws, op)

    monkeypatch.setattr(engine, "_reduce", slowly)


def random_logprobs(rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(V)).float().log_softmax(0)


async def one_step_with_cancellations(trie, rng, weight_sum):
    """Particles submit ``lp.exp()`` temporaries; two are cancelled while their batch runs, then new
    particles submit new temporaries (whose objects may reuse the freed ones' addresses)."""
    first = [random_logprobs(rng) for _ in range(6)]
    tasks = [asyncio.ensure_future(weight_sum(lp.exp())) for lp in first]
    await asyncio.sleep(0.01)  # the batch is running in the engine thread now
    victims = set(rng.choice(len(tasks), 2, replace=False).tolist())
    second = [random_logprobs(rng) for _ in range(6)]
    for v in victims:
        tasks[v].cancel()
    await asyncio.sleep(0)  # the cancelled coroutines finish
    for v in victims:
        tasks[v] = None  # the program drops its cancelled particles: nothing holds their tensors
    tasks += [asyncio.ensure_future(weight_sum(lp.exp())) for lp in second]
    lps = first + second
    kept = [i for i in range(len(tasks)) if i not in victims]
    results = await asyncio.gather(*(tasks[i] for i in kept))
    return [(lps[i], r) for i, r in zip(kept, results)]


@pytest.mark.parametrize("wrapper", ["char", "byte"])
async def test_cancelled_requests_never_hand_their_result_to_a_new_request(monkeypatch, wrapper):
    """The async tries used to key requests on ``id(ws)``: a request cancelled mid-batch freed its
    tensor, a new tensor reused the address, and got the cancelled request's masses."""
    if wrapper == "char":
        trie, seed = AsyncTokenCharacterTrie.from_vocab(VOCAB, batch_size=64, timeout=0.001), 0
        slow_engine(monkeypatch, trie.trie)
        reference = TokenCharacterTrie(VOCAB)
    else:
        trie, seed = AsyncTokenByteTrie.from_vocab(VOCAB, batch_size=64, timeout=0.001), 1
        slow_engine(monkeypatch, trie.trie.trie)
        reference = TokenByteTrie(VOCAB)
    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(40):
        for lp, result in await one_step_with_cancellations(trie, rng, trie.weight_sum):
            # exact: the same engine sums each row the same way in a batch or alone
            wrong += not np.array_equal(result, reference.weight_sum(lp.exp()))
    trie.cleanup()
    assert wrong == 0, f"{wrong} results were for another request's weights"


@pytest.mark.parametrize("wrapper", ["char", "byte"])
async def test_result_is_for_the_weights_as_they_were_when_submitted(monkeypatch, wrapper):
    """Changing the caller's array after submitting, or resubmitting the same buffer with new
    values, must not change an earlier request's result."""
    if wrapper == "char":
        trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, timeout=0.005)

        def reference(w):
            return trie.trie.weight_sum(w)

        def masses(r):
            return r
    else:
        trie = AsyncTokenByteTrie.from_vocab(VOCAB, timeout=0.005)

        def reference(w):
            return trie.trie.weight_sum(w)

        def masses(r):
            return r

    rng = np.random.default_rng(2)
    for buffer in (rng.random(V), torch.from_numpy(rng.random(V)).float()):
        original = buffer.copy() if isinstance(buffer, np.ndarray) else buffer.clone()
        first = asyncio.ensure_future(trie.weight_sum(buffer))
        await asyncio.sleep(0)  # submitted and queued, not yet computed
        buffer[:] = 0.5  # the caller reuses its buffer in place
        second = asyncio.ensure_future(trie.weight_sum(buffer))
        a, b = await asyncio.gather(first, second)
        # exact: the same engine, batched or alone (a float32 buffer widens exactly)
        np.testing.assert_array_equal(masses(a), reference(original))
        np.testing.assert_array_equal(masses(b), reference(np.full(V, 0.5)))
    trie.cleanup()


async def test_equal_weights_submitted_together_are_still_computed_once():
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, timeout=0.005)
    w = np.random.default_rng(3).random(V)
    a, b = await asyncio.gather(trie.weight_sum(w), trie.weight_sum(w.copy()))  # two objects, one value
    assert a is b and trie.batcher.stats.items == 1
    trie.cleanup()


ENGINES = [TokenCharacterTrie, lambda vocab: ParallelTokenCharacterTrie(vocab, device="cpu")]


@pytest.mark.parametrize("make", ENGINES, ids=["numba", "torch"])
@pytest.mark.parametrize("op", ["weight_sum", "weight_max"])
def test_single_vector_methods_refuse_a_batch_instead_of_returning_its_first_row(make, op):
    trie = make(VOCAB)
    batch = np.random.default_rng(4).random((3, V))
    with pytest.raises(ValueError, match=r"one weight vector of shape .* got \(3, \d+\): use the batch_"):
        getattr(trie, op)(batch)
    rows = getattr(trie, f"batch_{op}")(batch)
    for row, w in zip(rows, batch):  # exact: each row of a batch is reduced as it is alone
        np.testing.assert_array_equal(row, getattr(trie, op)(w))


def test_byte_trie_weight_sum_refuses_a_batch():
    trie = TokenByteTrie(VOCAB)
    batch = np.random.default_rng(5).random((2, V))
    with pytest.raises(ValueError, match="use the batch_"):
        trie.weight_sum(batch, TrieMode.WITHOUT_EOS)
    masses = trie.batch_weight_sum(batch)
    for row, w in zip(masses, batch):  # exact, as above
        np.testing.assert_array_equal(row, trie.weight_sum(w))
