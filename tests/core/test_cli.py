"""The genlm command."""

from __future__ import annotations

import pytest

from genlm_core import hookimpl
from genlm_core.cli import main, table
from genlm_core.testing import registered


def test_table_aligns_columns():
    out = table(["a", "long header"], [[1, "x"], ["wide cell", 2]]).splitlines()
    assert out[0].index("long header") == out[2].index("x") == out[3].index("2")
    assert set(out[1]) <= {"-", " "}


def test_backends_lists_backends_engines_versions_and_failures(fresh_plugins, capsys):
    class Broken:
        @hookimpl
        def register_backends(self, register):
            raise ImportError("needs libfoo")

    with registered(Broken(), "genlm-broken-plugin"):
        assert main(["backends"]) == 0
    out = capsys.readouterr().out
    mock_line = next(line for line in out.splitlines() if line.startswith("mock "))
    assert "genlm-mock" in mock_line and "0.1.0" in mock_line and "yes" in mock_line
    assert any(line.startswith("numba ") and "trie engine" in line for line in out.splitlines())
    assert "failed to load" in out and "genlm-broken-plugin" in out and "needs libfoo" in out


def test_options_lists_schema(capsys):
    assert main(["options", "mock"]) == 0
    out = capsys.readouterr().out
    assert "vocab_padding" in out and "Extra logit columns" in out and "batch_size" in out


def test_logprobs_prints_top_k_table_matching_the_model(capsys):
    from genlm_mock import MockAsyncLM

    assert main(["logprobs", "gpt2", "Hello world", "-b", "mock", "-k", "3", "-o", "seed=5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[3:]]
    assert len(rows) == 3
    lm = MockAsyncLM.from_name("gpt2", seed=5)
    expected = lm.next_token_logprobs_sync(lm.tokenizer.encode("Hello world")).topk(3)
    assert [int(r[1]) for r in rows] == expected.indices.tolist()
    assert [float(r[-2]) for r in rows] == pytest.approx(expected.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["logprobs", "gpt2", "x", "-b", "nosuch"], "pip install genlm-nosuch"),
        (["logprobs", "gpt2", "x", "-b", "mock", "-o", "sead=1"], "unknown option 'sead'"),
    ],
)
def test_errors_are_short_and_helpful(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
