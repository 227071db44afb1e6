"""Generated bad input at every LM entry point, on each backend that runs here (vllm and mlx: in
their own test files, beside their shared engines): a typed error, no hang, correct answers after."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_core import ClosedError, load_model_by_name
from genlm_core.testing.bad_input import check_rejects_bad_input, check_rejects_generated_bad_input
from genlm_core.testing.models import tiny_model_dir


@pytest.fixture(scope="module")
def mock():
    lm = load_model_by_name("gpt2", backend="mock", llm_opts={"timeout": 0.001})
    yield lm
    lm.cleanup()


# The fast tier runs genlm-hf's bad input on the tiny Llama; GPT-2's architecture is in the full suite.
@pytest.fixture(scope="module", params=["llama", pytest.param("gpt2", marks=[pytest.mark.slow, pytest.mark.arch])])
def hf(request):
    lm = load_model_by_name(str(tiny_model_dir(request.param)), backend="hf", llm_opts={"timeout": 0.001})
    yield lm
    lm.cleanup()


@pytest.mark.sized(examples=(10, 150))
def test_mock_rejects_generated_bad_input(mock, examples):
    check_rejects_generated_bad_input(mock, [464, 3139], max_examples=examples)


def test_hf_rejects_fixed_and_generated_bad_input(hf):
    check_rejects_bad_input(hf, [1, 2, 3])
    check_rejects_generated_bad_input(hf, [1, 2, 3], max_examples=40)


@pytest.mark.slow
@pytest.mark.arch  # GPT-2's learned positions
def test_hf_context_longer_than_learned_positions_is_refused_before_model_work():
    """GPT-2's position table has n_positions rows: a longer context used to hit a raw IndexError."""
    path = tiny_model_dir("gpt2")
    lm = load_model_by_name(str(path), backend="hf")
    limit = lm.model.config.n_positions
    assert lm.context_limit == limit
    longest = list(range(1, limit + 1))
    row = lm.next_token_logprobs_sync(longest)  # exactly the limit works
    assert torch.isfinite(row.logsumexp(0))
    with pytest.raises(ValueError, match=f"{limit + 1} tokens, more than this model's limit of {limit} positions"):
        lm.next_token_logprobs_sync([*longest, 5])
    with pytest.raises(ValueError, match="limit"):
        asyncio.run(lm.sample(longest, 3, []))  # the first generated token would go past the table
    lm.cleanup()
    llama = load_model_by_name(str(tiny_model_dir("llama")), backend="hf")
    assert llama.context_limit is None  # rotary positions: no hard limit to enforce
    llama.cleanup()


@pytest.mark.parametrize("backend", ["mock", "hf"])
def test_closed_model_raises_closed_error_on_every_call(backend):
    name = "gpt2" if backend == "mock" else str(tiny_model_dir("llama"))
    lm = load_model_by_name(name, backend=backend)
    ids = [5, 6]
    before = lm.next_token_logprobs_sync(ids)
    assert before.shape == (lm.vocab_size,)

    async def waiting_when_closed():
        task = asyncio.ensure_future(lm.next_token_logprobs([7, 8, 9]))
        await asyncio.sleep(0)  # queued, not yet computed
        lm.cleanup()
        return await asyncio.gather(task, return_exceptions=True)

    (queued,) = asyncio.run(waiting_when_closed())
    assert isinstance(queued, ClosedError) and "closed" in str(queued)
    lm.cleanup()  # twice is fine
    calls = {
        "next_token_logprobs_sync": lambda: lm.next_token_logprobs_sync(ids),
        "next_token_logprobs": lambda: asyncio.run(lm.next_token_logprobs(ids)),
        "batch_next_token_logprobs_sync": lambda: lm.batch_next_token_logprobs_sync([ids]),
        "batch_next_token_logprobs": lambda: asyncio.run(lm.batch_next_token_logprobs([ids])),
        "sample": lambda: asyncio.run(lm.sample(ids, 2, [])),
        "batch_sample": lambda: asyncio.run(lm.batch_sample([ids], 2, [])),
        "clear_cache": lm.clear_cache,
    }
    if backend == "hf":
        calls["cache_kv"] = lambda: lm.cache_kv(ids)
        calls["set_lora"] = lambda: lm.set_lora(None, "x")
        calls["load_lora"] = lambda: lm.load_lora("/nonexistent")
    for name, call in calls.items():
        with pytest.raises(ClosedError, match="closed by cleanup"):
            call()
        assert name  # every call checked


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_tiny_temperatures_sample_the_argmax_instead_of_crashing(mock, temperature):
    ids = [464, 3139]
    greedy = asyncio.run(mock.sample(ids, 5, [], temperature=0))
    assert asyncio.run(mock.sample(ids, 5, [], temperature=temperature, seed=3)) == greedy


def test_numpy_integers_are_accepted_where_ints_are(mock):
    import numpy as np

    ids = np.array([464, 3139], dtype=np.int32)
    row = mock.next_token_logprobs_sync(ids)
    assert torch.equal(row, mock.next_token_logprobs_sync([464, 3139]))
    out = asyncio.run(mock.sample(ids, np.int64(3), [np.int16(5)], temperature=np.float32(0.5), seed=np.uint8(7)))
    assert out == asyncio.run(mock.sample([464, 3139], 3, [5], temperature=0.5, seed=7))


def test_mock_keeps_a_bounded_record_of_batches():
    lm = load_model_by_name("gpt2", backend="mock", llm_opts={"keep_batches": 5})
    for i in range(20):
        lm.next_token_logprobs_sync([i + 1])
    assert len(lm.batches) == 5 and lm.batches[-1][0].token_ids == (20,)
    lm.cleanup()
