"""Shared fixtures: real offline tokenizers (built once per machine) and a fresh plugin manager."""

from __future__ import annotations

import os

# Nothing here comes from a model hub: an unknown name fails at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from genlm_core.plugins import reset_plugins
from genlm_core.testing.tokenizers import load_tokenizer, toy_tokenizer

REAL_TOKENIZERS = ["gpt2", "mistral-v1", "mistral-v3", "tekken"]


@pytest.fixture(scope="session")
def toy_tok():
    return toy_tokenizer()


@pytest.fixture(scope="session", params=REAL_TOKENIZERS)
def real_tokenizer(request):
    return request.param, load_tokenizer(request.param)


@pytest.fixture
def fresh_plugins():
    """A new plugin manager for the test, restored to a new default one afterwards."""
    plugins = reset_plugins()
    yield plugins
    reset_plugins()
