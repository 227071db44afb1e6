"""The genlm command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import Field

from genlm_core import hookimpl
from genlm_core.cli import main, table
from genlm_core.live import LiveOptions
from genlm_core.mock import MockAsyncLM, MockOptions
from genlm_core.testing import registered
from genlm_core.testing.tokenizers import toy_tokenizer


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
    assert "genlm-core" in mock_line and "0.1.0" in mock_line and "yes" in mock_line
    assert any(line.startswith("numba ") and "trie engine" in line for line in out.splitlines())
    assert "failed to load" in out and "genlm-broken-plugin" in out and "needs libfoo" in out


def test_backends_prints_what_a_backend_can_do_here(fresh_plugins, capsys):
    class Modes:
        @hookimpl
        def register_backends(self, register):
            register.backend("fast", "genlm_core.mock:MockAsyncLM.from_options", details=lambda: "modes A and B")
            register.backend(
                "absent", "genlm_core.mock:MockAsyncLM.from_options", check=lambda: "no", details=lambda: "x"
            )
            register.backend("odd", "genlm_core.mock:MockAsyncLM.from_options", details=lambda: 1 / 0)

    with registered(Modes(), "genlm-modes-plugin"):
        assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fast on this machine: modes A and B" in out
    assert "absent on this machine" not in out  # a backend that cannot run here says nothing more
    assert "odd on this machine: could not tell: ZeroDivisionError" in out


def test_options_lists_schema(capsys):
    assert main(["options", "mock"]) == 0
    out = capsys.readouterr().out
    assert "vocab_padding" in out and "Extra logit columns" in out and "batch_size" in out


def test_logprobs_prints_top_k_table_matching_the_model(capsys):
    from genlm_core.mock import MockAsyncLM

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


def assert_one_line_error(capsys, argv, message, code=2):
    """The command fails with exit status ``code`` and exactly one line on stderr, no traceback."""
    assert main(argv) == code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("genlm") and "Traceback" not in captured.err
    assert message in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["backends", "extra"], "unrecognized arguments: extra"),
        (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
        ([], "required: command"),
    ],
)
def test_backends_and_parser_usage_errors_are_one_line(capsys, argv, message):
    assert_one_line_error(capsys, argv, message)


def test_options_of_a_missing_backend_is_one_line(capsys):
    assert_one_line_error(capsys, ["options", "nosuch"], "pip install genlm-nosuch")


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("hff", "backend 'hff' is not installed; did you mean 'hf'? available: ["),
        ("mokc", "did you mean 'mock'?"),
        ("vllmm", "did you mean 'vllm'?"),
    ],
)
def test_a_misspelled_backend_gets_did_you_mean(capsys, backend, message):
    assert_one_line_error(capsys, ["logprobs", "gpt2", "x", "-b", backend], message)
    assert "pip install" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.process
def test_each_warning_is_printed_once(tmp_path):
    """A library that prints its own log records (huggingface_hub does) and a warnings.warn: once each."""
    program = """
import logging, sys, warnings
from genlm_core import hookimpl
from genlm_core.cli import main
from genlm_core.testing import registered

def factory(name, options):
    library = logging.getLogger("somelib.http")
    logging.getLogger("somelib").addHandler(logging.StreamHandler())
    library.warning("retrying the request")
    logging.getLogger("quietlib").addHandler(logging.NullHandler())  # the usual library set-up: it prints nothing
    logging.getLogger("quietlib.sub").warning("a library warning with no handler of its own")
    warnings.warn("this argument is deprecated", FutureWarning)
    raise OSError("no model")

class Noisy:
    @hookimpl
    def register_backends(self, register):
        register.backend("noisy", factory)

with registered(Noisy(), "genlm-noisy"):
    sys.exit(main(["logprobs", "m", "x", "-b", "noisy"]))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("retrying the request") == 1, done.stderr
    assert done.stderr.count("this argument is deprecated") == 1, done.stderr
    assert done.stderr.count("a library warning with no handler of its own") == 1, done.stderr
    assert done.stderr.splitlines()[-1] == "genlm: error: OSError: no model"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["logprobs", "gpt2", "x", "-b", "mock", "--top", "-5"], "argument --top/-k: must be >= 1, got -5"),
        (["logprobs", "gpt2", "x", "-b", "mock", "--top", "0"], "must be >= 1, got 0"),
        (["logprobs", "gpt2", "x", "-b", "mock", "--top", "two"], "expected an integer, got 'two'"),
        (["logprobs", "gpt2", "", "-b", "mock"], "TEXT gives no tokens"),
        (
            ["logprobs", "no-such-model", "x", "-b", "mock"],
            "'no-such-model' is not a local folder and not in the Hugging Face cache",
        ),
        (["logprobs", "gpt2", "x", "-b", "mock", "-o", "batch_size=1.5"], "option 'batch_size'"),
        (["logprobs", "gpt2", "x", "-b", "mock", "-o", "timeout=Infinity"], "option 'timeout'"),
        (["logprobs", "gpt2", "x", "-b", "mock", "-o", "novalue"], "must look like key=value"),
    ],
)
def test_logprobs_user_errors_are_one_line(capsys, argv, message):
    assert_one_line_error(capsys, argv, message)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["continue", "gpt2", "x", "-b", "mock", "-K", "0"], "argument --beam/-K: must be >= 1, got 0"),
        (["continue", "gpt2", "x", "-b", "mock", "--prune", "1.5"], "argument --prune: must be >= 0.0 and < 1.0"),
        (["continue", "gpt2", "x", "-b", "mock", "--prune", "nan"], "argument --prune: must be"),
        (["continue", "gpt2", "x", "-b", "mock", "--sample", "--seed", "-1"], "argument --seed: must be >= 0"),
        (["continue", "gpt2", "x", "-b", "mock", "-n", "-3"], "argument --bytes/-n: must be >= 0, got -3"),
        (
            ["continue", "no-such-model", "x", "-b", "mock"],
            "'no-such-model' is not a local folder and not in the Hugging Face cache",
        ),
    ],
)
def test_continue_user_errors_are_one_line(capsys, argv, message):
    assert_one_line_error(capsys, argv, message)


def test_top_larger_than_the_vocabulary_shows_the_whole_vocabulary(capsys, tmp_path):
    """Documented choice: --top is capped at the vocabulary size rather than refused."""
    from genlm_core.testing.tokenizers import toy_tokenizer

    folder = tmp_path / "toy"
    toy_tokenizer().save_pretrained(folder)
    assert main(["logprobs", str(folder), "ab", "-b", "mock", "--top", "100000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    from genlm_core.mock import MockAsyncLM

    assert len(lines) - 3 == MockAsyncLM.from_name(str(folder)).vocab_size


def test_continue_with_empty_text_starts_from_nothing(capsys):
    assert main(["continue", "gpt2", "", "-b", "mock", "-n", "3", "-K", "2"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_internal_errors_are_one_line_with_a_hint(capsys, monkeypatch):
    import genlm_core.cli as cli

    def broken():
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "get_plugins", broken)
    line = assert_one_line_error(capsys, ["backends"], "ZeroDivisionError: a bug", code=1)
    assert "rerun with -v" in line


def run_cli(*argv: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "genlm_core.cli", *argv], capture_output=True, timeout=300, env={**os.environ}
    )


@pytest.mark.slow
@pytest.mark.process
def test_real_process_exit_codes_and_raw_non_utf8_text():
    bad = run_cli("continue", "gpt2", "x", "-b", "mock", "-n", "-3")
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr.decode().count("\n") == 1 and b"Traceback" not in bad.stderr
    raw = b"caf\xe9"  # Latin-1, not UTF-8: the byte LM continues the raw bytes
    ok = run_cli("continue", "gpt2", raw, "-b", "mock", "-n", "2", "-K", "2")
    assert ok.returncode == 0, ok.stderr
    refused = run_cli("logprobs", "gpt2", raw, "-b", "mock")
    assert refused.returncode == 2 and b"TEXT is not valid UTF-8: b'caf\\xe9'" in refused.stderr
    assert refused.stderr.count(b"\n") == 1 and b"Traceback" not in refused.stderr


class LiveMockOptions(MockOptions):
    """The mock's options with a nested options model, as a live backend has."""

    live: LiveOptions = Field(default_factory=lambda: LiveOptions.model_validate({}), description="Live sequences.")


LOADED: list = []


def live_mock(name, options):
    lm = MockAsyncLM(toy_tokenizer(), options)
    LOADED.append(lm)
    return lm


class LiveMock:
    @hookimpl
    def register_backends(self, register):
        register.backend("livemock", live_mock, options=LiveMockOptions)


def test_a_nested_option_s_field_is_key_dot_field_on_the_command_line(fresh_plugins, capsys):
    argv = ["logprobs", "m", "ab", "-b", "livemock", "-o", "live.lookback=2", "-o", 'live={"max_sequences": 4}']
    with registered(LiveMock(), "genlm-livemock"):
        assert main([*argv, "-o", "live.enabled=false", "-o", "batch_size=3"]) == 0
        live = LOADED[-1].options.live
        assert (live.lookback, live.max_sequences, live.enabled) == (2, 4, False)
        assert LOADED[-1].options.batch_size == 3
        assert main(["options", "livemock"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("live.lookback ") and "Most tokens" in line for line in out.splitlines())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["live.lookback=0"],
            "invalid options for backend 'livemock': option 'live.lookback': Input should be greater than 0 (got 0)",
        ),
        (['live={"lookback": 0}'], "option 'live.lookback': Input should be greater than 0 (got 0)"),
        (
            ["live.lookbak=2"],
            "unknown option 'live.lookbak' (known in 'live': enabled, lookback, max_idle_batches, max_sequences); "
            "did you mean 'live.lookback'?",
        ),
        (["live.lookback=2", "live.lookback=3"], "option 'live.lookback' is given twice (2 and 3)"),
        (["live=3", "live.lookback=2"], "option 'live.lookback' sets a field of 'live', which is given as 3"),
        (["live.lookback=2", 'live={"lookback": 3}'], "option 'live.lookback' is given twice (2 and 3)"),
    ],
)
def test_an_option_error_is_one_clean_line(fresh_plugins, capsys, options, message):
    argv = ["logprobs", "m", "ab", "-b", "livemock"] + [a for o in options for a in ("-o", o)]
    with registered(LiveMock(), "genlm-livemock"):
        line = assert_one_line_error(capsys, argv, message)
    assert line.count("invalid options") <= 1 and line.count("(got") <= 1 and "Value error" not in line, line
