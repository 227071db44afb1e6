"""End to end on a real pretrained model: SmolLM2-135M-Instruct (converted offline from a PyPI wheel)."""

from __future__ import annotations

import asyncio

import pytest

from genlm_core import load_model_by_name
from genlm_core.testing.models import smollm2_dir


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_knows_the_capital_of_france():
    lm = load_model_by_name(str(smollm2_dir()), backend="hf")
    ids = lm.tokenizer.encode("The capital of France is")
    out = asyncio.run(lm.sample(ids, 8, eos_token_ids=[lm.tokenizer.eos_token_id], temperature=0))
    text = b"".join(lm.byte_vocab[i] for i in out).decode("utf-8", "replace")
    assert "Paris" in text
    top = int(lm.next_token_logprobs_sync(ids).argmax())
    assert lm.byte_vocab[top] == b" Paris"
