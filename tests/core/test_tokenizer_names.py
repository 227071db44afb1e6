"""genlm_core.hub.resolve_tokenizer: a backend whose model name is a tokenizer resolves it offline first and
fails at once, in one line, for a name nobody has (no retries of an unreachable hub)."""

from __future__ import annotations

import time

import pytest
from huggingface_hub import constants

from genlm_core import load_model_by_name
from genlm_core.errors import ModelNotFoundError
from genlm_core.hub import load_tokenizer_by_name, resolve_tokenizer
from genlm_core.testing.tokenizers import load_tokenizer


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_built_in_names_and_local_folders_resolve_to_themselves(tmp_path):
    assert resolve_tokenizer("gpt2") == "gpt2"
    load_tokenizer("gpt2").save_pretrained(tmp_path)
    assert resolve_tokenizer(str(tmp_path)) == str(tmp_path)
    assert len(load_tokenizer_by_name(str(tmp_path))) == len(load_tokenizer_by_name("gpt2")) == 50257


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("gtp2", r"^'gtp2' is not a local folder and not in the Hugging Face cache, .*did you mean 'gpt2'\?$"),
        ("./no/such/folder", r"^no such file or folder: './no/such/folder'"),
        ("mistral_v1", r"did you mean 'mistral-v1' or 'mistral-v3'\?"),
    ],
)
def test_an_unknown_name_fails_at_once_in_one_line(offline, name, message):
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match=message) as info:
        load_tokenizer_by_name(name)
    assert time.monotonic() - start < 5 and "\n" not in str(info.value)


def test_the_backends_whose_model_is_a_tokenizer_resolve_it_before_loading(offline):
    with pytest.raises(ModelNotFoundError, match=r"did you mean 'gpt2'\?"):
        load_model_by_name("gtp2", backend="mock")
    pytest.importorskip("genlm_example", reason="pip install -e examples/plugin_template")
    with pytest.raises(ModelNotFoundError, match=r"did you mean 'gpt2'\?"):
        load_model_by_name("gtp2", backend="example")
    lm = load_model_by_name("gpt2", backend="example", llm_opts={"timeout": 0.001})
    assert lm.vocab_size == 50257
    lm.cleanup()


def test_a_name_that_is_not_a_str_is_a_type_error():
    with pytest.raises(TypeError, match="non-empty str, got 3"):
        resolve_tokenizer(3)  # type: ignore[arg-type]
