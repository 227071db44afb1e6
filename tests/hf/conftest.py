"""Tiny float32 models (Llama and GPT-2 architectures) and an uncached, unbatched reference."""

from __future__ import annotations

import pytest
import torch

from genlm_core.testing import bounds
from genlm_core.testing.models import tiny_model_dir


class Reference:
    """Next-token logprobs from one plain forward pass over the whole context, in float64 (the output
    layer on the last position only: the row asked for, not one per position of a 4000-token context)."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.path = str(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def __call__(self, ids, vocab_size=None):
        with torch.no_grad():
            logits = self.model(torch.tensor([list(ids)]), logits_to_keep=1).logits[0, -1].double()
        return torch.log_softmax(logits[:vocab_size] if vocab_size else logits, -1)


def max_error(rows, contexts, reference):
    return max((row.double() - reference(c, len(row))).abs().max().item() for row, c in zip(rows, contexts))


def check_rows(name, rows, contexts, reference):
    """genlm-hf's rows (batched, padded, from cached KV) against the reference's unbatched float32 forward
    pass: two float32 runs of one model, within 4 x its float32-vs-float64 error on ``contexts``
    (bounds.rows_bound)."""
    bounds.within(f"hf: {name}", max_error(rows, contexts, reference), bounds.rows_bound(reference.path)(contexts))


# The fast tier runs genlm-hf on the tiny Llama; the same checks on GPT-2's architecture are in the full suite.
@pytest.fixture(scope="session", params=["llama", pytest.param("gpt2", marks=[pytest.mark.slow, pytest.mark.arch])])
def tiny(request):
    path = tiny_model_dir(request.param)
    return str(path), Reference(path)
