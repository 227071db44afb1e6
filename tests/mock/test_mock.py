"""The mock backend: deterministic, context-dependent, non-flat, batched through the core."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from genlm_core import load_model_by_name
from genlm_core.mock import MockAsyncLM, MockOptions
from genlm_core.testing import bounds, check_lm_contract


@pytest.fixture(scope="module")
def gpt2():
    from genlm_core.testing.tokenizers import load_tokenizer

    return load_tokenizer("gpt2")


def reference(lm: MockAsyncLM, context) -> torch.Tensor:
    """Independent float64 log-softmax of the mock's raw logits, cut to the tokenizer."""
    logits = torch.from_numpy(lm.logits(context)).double()[: lm.vocab_size]
    return torch.log_softmax(logits, 0)


def check_row(lm: MockAsyncLM, row: torch.Tensor, context) -> None:
    """``row`` (float32 log_softmax of the mock's float32 logits) against :func:`reference` (float64, the
    same logits): each off the exact value by :func:`bounds.log_softmax_error` at the row's most negative
    entry, in its own precision."""
    want = reference(lm, context)
    worst = float(want.min())
    tol = bounds.Bound(
        float(bounds.log_softmax_error(lm.vocab_size, worst))
        + float(bounds.log_softmax_error(lm.vocab_size, worst, bounds.U64)),
        f"float32 log_softmax over V={lm.vocab_size} at {worst:.3g}, against float64",
    )
    bounds.within("mock: row vs float64 log_softmax", bounds.row_difference(row, want), tol, f"context {context}")


def test_loads_by_name_through_the_registry(gpt2):
    lm = load_model_by_name("gpt2", backend="mock", llm_opts={"seed": 3, "batch_size": 16})
    assert isinstance(lm, MockAsyncLM) and lm.options.seed == 3 and lm.batcher.batch_size == 16
    assert len(lm.byte_vocab) == len(gpt2)


def test_contract_on_real_tokenizer(gpt2):
    check_lm_contract(MockAsyncLM(gpt2), [[50256], [464, 3139], list(range(100, 400))], close=True)


async def test_concurrent_batch_matches_reference_and_is_observable(gpt2):
    lm = MockAsyncLM(gpt2, batch_size=64, timeout=0.01)
    contexts = [[50256, i] for i in range(10)] + [[50256, 3]]  # one duplicate
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    for c, row in zip(contexts, rows):
        check_row(lm, row, c)
    assert len(lm.batches) == 1 and len(lm.batches[0]) == 10  # one batch, duplicate computed once


def test_deterministic_context_dependent_non_flat(gpt2):
    a, b = MockAsyncLM(gpt2), MockAsyncLM(gpt2)
    other_seed = MockAsyncLM(gpt2, seed=1)
    x = a.next_token_logprobs_sync([1, 2, 3])
    assert torch.equal(x, b.next_token_logprobs_sync([1, 2, 3]))
    assert not torch.allclose(x, a.next_token_logprobs_sync([1, 2, 4]))
    assert not torch.allclose(x, a.next_token_logprobs_sync([2, 3]))
    assert not torch.allclose(x, other_seed.next_token_logprobs_sync([1, 2, 3]))
    entropy = -(x.exp() * x).sum().item()
    assert entropy < math.log(len(gpt2)) - 2  # far from uniform


async def test_vocab_padding_and_delay(gpt2):
    lm = MockAsyncLM(gpt2, vocab_padding=128, delay=0.01)
    row = await lm.next_token_logprobs([5])
    assert row.shape == (len(gpt2),)
    check_row(lm, row, [5])


def test_options_are_validated():
    with pytest.raises(ValueError, match="scale"):
        MockOptions(scale=-1)
    with pytest.raises(ValueError, match=r"unknown option .sead. \(known: batch_size"):
        MockOptions(sead=1)


def test_unknown_model_name_is_explained():
    with pytest.raises(OSError, match=r"^no such file or folder: 'no/such/model'$"):
        MockAsyncLM.from_name("no/such/model")
    with pytest.raises(OSError, match=r"not in the Hugging Face cache.*did you mean 'mistral-v3' or 'mistral-v1'\?$"):
        MockAsyncLM.from_name("mistral-v2")


def test_local_tokenizer_folder(tmp_path, toy_tok):
    toy_tok.save_pretrained(tmp_path)
    lm = MockAsyncLM.from_name(str(tmp_path))
    assert len(lm.byte_vocab) == len(toy_tok)
