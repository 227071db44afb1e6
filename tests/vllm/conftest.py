"""The tiny float32 Llama on vLLM's CPU build: one in-process engine shared by the whole test session.

Starting an engine costs 10 to 30 s here, so every test that needs the plain in-process engine shares one
(``engine``). vLLM keeps process-wide state (its parallel groups), so a test that starts an in-process engine
of its own first closes the shared one (``alone``); the next test that asks for ``engine`` starts it again.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import pytest

from genlm_core import AsyncLM, ClosedError, load_model_by_name
from genlm_core.testing.models import tiny_model_dir

MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64 for CPU attention
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 256 * 2**20,
    "enforce_eager": True,
}


class SharedEngine:
    """The session's in-process engine, started when first asked for and again after it was closed."""

    def __init__(self) -> None:
        self.lm: AsyncLM | None = None

    def get(self, config: pytest.Config | None = None) -> AsyncLM:
        """The engine, started if it is not running (its start counted as the session's, not the test's,
        by tests/conftest.py's time budget)."""
        if self.lm is not None:
            try:
                self.lm.ensure_open()
                return self.lm
            except ClosedError:  # a test closed it
                self.lm = None
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')")
        start = time.perf_counter()
        self.lm = load_model_by_name(
            str(tiny_model_dir("llama", **MODEL)),
            backend="vllm",
            llm_opts={
                "dtype": "float32",
                "max_model_len": 2048,
                "batch_size": 1024,
                "timeout": 0.01,
                "engine_opts": ENGINE,
            },
        )
        budget = config.pluginmanager.get_plugin("genlm-time-budget") if config is not None else None
        if budget is not None:
            budget.shared("the in-process vLLM engine", time.perf_counter() - start)
        return self.lm

    def close(self) -> None:
        if self.lm is not None:
            self.lm.cleanup()
            self.lm = None


@pytest.fixture(scope="session")
def shared_engine() -> Iterator[SharedEngine]:
    shared = SharedEngine()
    yield shared
    shared.close()


@pytest.fixture
def engine(shared_engine: SharedEngine, request: pytest.FixtureRequest) -> AsyncLM:
    """The shared in-process engine on the tiny Llama (``path``)."""
    return shared_engine.get(request.config)


@pytest.fixture
def alone(shared_engine: SharedEngine) -> None:
    """For a test that starts an engine of its own: the shared one is closed first (a module-scoped
    fixture that starts one calls ``shared_engine.close()`` itself)."""
    shared_engine.close()


@pytest.fixture
def engine_opts():
    """The tiny engine's vLLM arguments, for a test that starts another engine like it."""
    return dict(ENGINE)


@pytest.fixture(scope="module")
def path():
    return str(tiny_model_dir("llama", **MODEL))
