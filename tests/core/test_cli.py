"""The genlm command."""

from __future__ import annotations

import json
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


@pytest.fixture
def only_registered(monkeypatch):
    """No installed plugin but the built-ins: ``--check`` imports only those and the test's own."""
    monkeypatch.setenv("GENLM_PLUGINS", "")
    from genlm_core.plugins import reset_plugins

    yield reset_plugins()
    reset_plugins()


def test_backends_lists_backends_engines_versions_and_failures(only_registered, capsys):
    class Broken:
        @hookimpl
        def register_backends(self, register):
            raise ImportError("needs libfoo")

    for argv, runs in ((["backends"], "installed"), (["backends", "--check"], "yes")):
        with registered(Broken(), "genlm-broken-plugin"):
            assert main(argv) == 0
        out = capsys.readouterr().out
        mock_line = next(line for line in out.splitlines() if line.startswith("mock "))
        assert "genlm-core" in mock_line and "0.1.0" in mock_line and f"  {runs}  " in mock_line
        assert any(line.startswith("numba ") and "trie engine" in line and runs in line for line in out.splitlines())
        assert "failed to load" in out and "genlm-broken-plugin" in out and "needs libfoo" in out
        assert ("`genlm backends --check` imports each engine" in out) == (runs == "installed")


def test_backends_prints_what_a_backend_can_do_here(only_registered, capsys):
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
        assert "on this machine:" not in capsys.readouterr().out  # a listing runs no probe
        assert main(["backends", "--check"]) == 0
    out = capsys.readouterr().out
    assert "fast on this machine: modes A and B" in out
    assert "absent on this machine" not in out  # a backend that cannot run here says nothing more
    assert "odd on this machine: could not tell: ZeroDivisionError" in out


def test_only_check_imports_a_factory_and_a_factory_that_does_not_import_is_no(
    only_registered, capsys, tmp_path, monkeypatch
):
    """A listing finds that the factory's module is there without importing it; ``--check`` imports it: a
    module that raises on import is "no" with its error, and a failure of its plugin."""
    (tmp_path / "genlm_test_broken_engine.py").write_text(
        "import sys\n"
        "sys.modules['genlm_test_broken_engine_ran'] = sys\n"
        "raise ImportError('libengine.so: no such file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class Engine:
        @hookimpl
        def register_backends(self, register):
            register.backend("engine", "genlm_test_broken_engine:Model", install="pip install engine-lib")

    with registered(Engine(), "genlm-engine"):
        assert main(["backends"]) == 0
        out = capsys.readouterr().out
        assert next(line for line in out.splitlines() if line.startswith("engine ")).split()[4] == "installed"
        assert "genlm_test_broken_engine_ran" not in sys.modules and "failed to load" not in out
        assert main(["backends", "--check"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("engine "))
    assert "no: its engine does not import (ImportError: libengine.so: no such file); install what it needs: " in line
    assert line.split("install what it needs: ")[1].startswith("pip install engine-lib")
    assert "genlm_test_broken_engine_ran" in sys.modules  # the module did run: --check imported it
    failures = out.split("plugins that failed to load:")[1]
    assert "genlm-engine" in failures and "'genlm_test_broken_engine:Model' of 'engine' does not resolve" in failures


#: What only using an engine may import: ``genlm backends`` and a mistyped model name import none of these.
HEAVY = ("torch", "transformers", "vllm", "mlx.core", "mlx_lm", "llama_cpp", "numba")


def in_fresh_interpreter(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, set]:
    """``genlm ARGV`` (as the console script runs it) in a new interpreter, and the heavy modules it imported
    (``sys.modules`` printed at exit, after everything the command did)."""
    program = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr))\n"
        "from genlm_core.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "GENLM_PLUGINS"}
    done = subprocess.run(
        [sys.executable, "-c", program, *argv], capture_output=True, text=True, timeout=300, env={**base, **(env or {})}
    )
    return done, set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_backends_lists_every_installed_plugin_without_importing_an_engine():
    import importlib.metadata

    installed = {ep.name for ep in importlib.metadata.entry_points(group="genlm")}
    done, imported = in_fresh_interpreter(["backends"])
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:] if line.strip()}
    assert installed <= set(rows) and "hf" in installed, done.stdout  # every plugin registered (the repo's, here)
    assert "failed to load" not in done.stdout, done.stdout
    assert imported == set(), f"genlm backends imported {sorted(imported)}"


@pytest.mark.parametrize(
    "argv", [["logprobs", "gpt3-typo", "x", "--backend", "hf"], ["continue", "smolm2", "x", "-b", "hf"]]
)
def test_a_mistyped_model_name_fails_before_anything_heavy_is_imported(tmp_path, argv):
    """The name is resolved (here: the hub is offline, the name is nowhere) before torch or the engine is
    imported, so it fails as fast as the interpreter starts (tests/core/test_hub.py times it with the hub)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "GENLM_CACHE_DIR": str(tmp_path / "genlm")}
    done, imported = in_fresh_interpreter(argv, env)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines()[0].startswith("genlm: error: ") and "offline mode is on" in done.stderr
    assert imported == set(), f"genlm {' '.join(argv)} imported {sorted(imported)} before the name failed"


@pytest.mark.slow
@pytest.mark.process
def test_backends_check_reports_what_each_installed_backend_says_here():
    """``--check`` gives each installed component's own verdict, as the listing did before it imported
    nothing: its check, its factory imported, and its ``details`` line (vLLM's modes)."""
    program = """
import json
from genlm_core.plugins import get_plugins

plugins, verdicts = get_plugins(), {}
for name, spec in [*plugins.backends().items(), *plugins.trie_engines().items()]:
    reason = spec.unavailable_reason()
    if reason is None:
        try:
            spec.load()
        except Exception as exc:
            reason = f"its engine does not import ({type(exc).__name__}"
    verdicts[name] = "yes" if reason is None else f"no: {reason}"
details = {name: spec.details_here() for name, spec in plugins.backends().items()}
print(json.dumps([verdicts, details]))
"""
    env = {k: v for k, v in os.environ.items() if k != "GENLM_PLUGINS"}
    reference = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600, env=env)
    assert reference.returncode == 0, reference.stderr
    expected, details = json.loads(reference.stdout.strip().splitlines()[-1])
    done, imported = in_fresh_interpreter(["backends", "--check"])
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.split("\n\n")[0].splitlines()[2:]}
    assert set(rows) == set(expected), done.stdout
    for name, verdict in expected.items():
        assert f"  {verdict}" in rows[name], (name, verdict, rows[name])
    for name, line in details.items():
        assert (f"\n{name} on this machine: {line}\n" in done.stdout) == (line is not None), (name, line)
    assert "torch" in imported and "failed to load" not in done.stdout


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
    # the same float32 row (same seed, same context, computed alone both times), printed with 4 decimals:
    # off by half the last digit, plus the parse's rounding
    for r, want in zip(rows, expected.values.tolist()):
        assert r[-2] == f"{want:.4f}"  # exact: the same row, printed the same way


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
