"""A pytest plugin for running the genlm ecosystem's own test suites offline, on genlm.

``pytest -p genlm_compat.pytest_plugin`` maps the hub names those suites load to offline stand-ins from
``genlm_core.testing`` (a tiny random-weight Llama with the real GPT-2 tokenizer for GPT-2; the Llama-2
SentencePiece tokenizer, which has duplicate byte strings, for CodeLlama and llemma), then calls
:func:`genlm_compat.install` so the suites run on genlm. ``GENLM_COMPAT=off`` keeps the mapping but
leaves genlm-backend in place: the same suite then runs on genlm-backend, for comparison.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

# No model hub here: a name with no offline stand-in fails at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPT2_NAMES = {"gpt2", "openai-community/gpt2", "gpt2-medium"}
LLAMA2_TOKENIZER_NAMES = {"codellama/CodeLlama-7b-hf", "EleutherAI/llemma_7b"}


def offline_path(name: Any) -> Any:
    """The local folder standing in for hub model ``name``, or ``name`` unchanged."""
    if not isinstance(name, str):
        return name
    from genlm_core.testing.models import tiny_model_dir
    from genlm_core.testing.tokenizers import cache_dir, load_tokenizer

    if name in GPT2_NAMES:
        return str(tiny_model_dir("llama", tokenizer="gpt2"))
    if name in LLAMA2_TOKENIZER_NAMES:
        load_tokenizer("mistral-v1")  # built once per machine
        return str(Path(cache_dir()) / "tokenizers" / "mistral-v1")
    return name


def stand_in(name: str) -> Path:
    """The folder of ``name``'s offline stand-in (built once)."""
    return Path(offline_path(name))


def _map_first_argument(owner: type) -> None:
    original = owner.__dict__["from_pretrained"].__func__

    def from_pretrained(cls: type, name: Any, *args: Any, **kwargs: Any) -> Any:
        return original(cls, offline_path(name), *args, **kwargs)

    owner.from_pretrained = classmethod(from_pretrained)  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

    from genlm_core.hub import OFFLINE_MODELS, OfflineModel

    for owner in (AutoTokenizer, AutoModelForCausalLM, PreTrainedTokenizerBase, PreTrainedModel):
        _map_first_argument(owner)
    for name in GPT2_NAMES | LLAMA2_TOKENIZER_NAMES:  # genlm's backends look names up before from_pretrained
        OFFLINE_MODELS[name] = OfflineModel(f"offline stand-in for {name}", functools.partial(stand_in, name))
    if os.environ.get("GENLM_COMPAT", "on") != "off":
        import genlm_compat

        genlm_compat.install()


def pytest_report_header(config: pytest.Config) -> str:
    on = os.environ.get("GENLM_COMPAT", "on") != "off"
    return "genlm_compat: " + ("running on genlm (install())" if on else "running on genlm-backend")
