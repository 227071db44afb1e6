"""Tiny float32 Llamas written as GGUF files (the same weights genlm-hf loads from their folders)."""

from __future__ import annotations

import pytest

from genlm_core.testing.models import tiny_model_dir
from genlm_llamacpp.testing import llama_gguf


@pytest.fixture(scope="session", params=["gpt2", "mistral-v1"])
def tiny(request):
    """``(hf folder, f32 GGUF)`` of a tiny Llama with a byte-level BPE or a SentencePiece tokenizer."""
    folder = tiny_model_dir("llama", request.param)
    return str(folder), str(llama_gguf(folder))


@pytest.fixture(scope="session")
def tiny_gpt2():
    folder = tiny_model_dir("llama", "gpt2")
    return str(folder), str(llama_gguf(folder))
