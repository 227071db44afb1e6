"""Model names resolve offline first, and a missing model fails fast in one line that says why.

The hub is played by a loopback HTTP server that answers as the Hugging Face API does; nothing leaves
this machine.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from genlm_core import hookimpl, hub, load_model_by_name
from genlm_core.errors import MissingDependencyError, ModelNotFoundError
from genlm_core.testing import registered


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Knows one model, ``known/model``; any other repo is 'RepoNotFound', as the hub says it."""

    def do_GET(self) -> None:
        if self.path.startswith("/api/models/known/model"):
            body = b'{"id": "known/model", "sha": "0123456789abcdef0123456789abcdef01234567", "siblings": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Point huggingface_hub at an endpoint and an empty cache of this test's own."""
    hub._probe_cache.clear()
    hub._found_on_hub.clear()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def point(endpoint: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)

    yield point
    hub._probe_cache.clear()
    hub._found_on_hub.clear()


def cache_snapshot(cache: Path, repo_id: str) -> Path:
    """A snapshot of ``repo_id`` laid out as huggingface_hub's cache keeps it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "a" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_local_folder_is_used_as_it_is(tmp_path, hub_at):
    hub_at(f"http://127.0.0.1:{closed_port()}")
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_missing_path_is_no_such_folder_without_asking_the_hub(tmp_path, hub_at):
    hub_at(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ModelNotFoundError, match=r"^no such file or folder: '.*/nonexistent/model'$"):
        hub.resolve_model(str(tmp_path / "nonexistent" / "model"))
    assert hub._probe_cache == {}  # decided without the network


def test_offline_mode_fails_at_once_and_suggests_close_names(hub_at, monkeypatch):
    hub_at("https://huggingface.co")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as info:
        hub.resolve_model("smolm2")
    assert time.perf_counter() - start < 0.5
    message = str(info.value)
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    assert message.endswith("did you mean 'smollm2'?") and "\n" not in message


def test_an_unreachable_hub_fails_in_under_two_seconds(hub_at):
    hub_at(f"http://127.0.0.1:{closed_port()}")
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="cannot be reached"):
        hub.resolve_model("org/some-model")
    assert time.perf_counter() - start < 2


def test_a_silent_hub_counts_as_unreachable_after_the_probe_time(hub_at, monkeypatch):
    hub_at(f"http://127.0.0.1:{closed_port()}")  # on loopback a connect is refused at once: make it hang

    def hang(*args: object, **kwargs: object) -> None:
        time.sleep(3)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match=r"did not answer within 1\.5 s"):
        hub.resolve_model("org/some-model")
    assert time.perf_counter() - start < 2


def test_a_name_the_hub_does_not_have_is_not_found_on_the_hub(fake_hub, hub_at):
    hub_at(fake_hub)
    with pytest.raises(ModelNotFoundError, match="the Hugging Face hub has no model by that name"):
        hub.resolve_model("nobody/SmolLM2")
    assert hub.resolve_model("known/model") == "known/model"  # the hub has it: the loader downloads it


def test_a_cached_model_loads_from_its_snapshot_when_the_hub_cannot_be_used(hub_at, fake_hub):
    snapshot = cache_snapshot(Path(constants.HF_HUB_CACHE), "org/cached")
    hub_at(f"http://127.0.0.1:{closed_port()}")
    assert hub.resolve_model("org/cached") == str(snapshot)  # nothing waits on the network
    hub._probe_cache.clear()
    hub_at(fake_hub)
    assert hub.resolve_model("org/cached") == "org/cached"  # online: the loader may check for updates
    assert "org/cached" in hub.cached_models()


def test_cached_names_are_suggested(hub_at):
    cache_snapshot(Path(constants.HF_HUB_CACHE), "acme/tiny-llama")
    hub_at(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ModelNotFoundError, match="did you mean 'acme/tiny-llama'"):
        hub.resolve_model("acme/tiny-lama")


def test_a_missing_offline_build_dependency_is_named_unless_the_model_is_built(monkeypatch, tmp_path):
    real = hub._missing
    monkeypatch.setattr(hub, "_missing", lambda module: module == "gguf" or real(module))
    monkeypatch.setenv("GENLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(MissingDependencyError, match=r"needs gguf: pip install gguf$"):
        hub.resolve_model("smollm2")
    built = tmp_path / "models" / "SmolLM2-135M-Instruct-float32"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    assert hub.resolve_model("smollm2") == str(built)  # converted earlier: gguf is not needed any more


def test_load_model_by_name_resolves_before_loading_the_backend(hub_at, fresh_plugins):
    hub_at(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ModelNotFoundError, match="did you mean 'gpt2'"):
        load_model_by_name("gpt3", backend="mock")
    with pytest.raises(ModelNotFoundError, match="did you mean 'smollm2'"):
        load_model_by_name("smolm2", backend="hf")
    loaded: list[str] = []

    def missing(name: str) -> str:
        raise ModelNotFoundError(f"no {name}")

    def factory(name: str, options: object) -> None:
        loaded.append(name)

    class Slow:
        @hookimpl
        def register_backends(self, register):
            register.backend("slow", factory, resolve_name=missing)
            register.backend("passthrough", factory)

    with registered(Slow(), "genlm-slow"):
        with pytest.raises(ModelNotFoundError, match=r"^no x$"):
            load_model_by_name("x", backend="slow")
        assert loaded == []  # the factory was never reached
        with pytest.raises(TypeError, match="not an AsyncLM"):
            load_model_by_name("any name", backend="passthrough")
        assert loaded == ["any name"]  # no resolver: the name as given


@pytest.mark.slow
@pytest.mark.process
def test_the_cli_says_it_in_one_line_fast(tmp_path):
    """The whole command, interpreter start included, against a hub that refuses connections."""
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "HF_HOME": str(tmp_path),
        "GENLM_CACHE_DIR": str(tmp_path / "genlm"),
    }
    env.pop("HF_HUB_OFFLINE", None)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "genlm_core.cli", "continue", "smolm2", "hi", "-b", "hf"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "cannot be reached" in done.stderr and "did you mean 'smollm2'?" in done.stderr
    assert elapsed < 10, f"{elapsed:.1f} s"  # 1.4-1.8 s here; a retrying hub client took 50 s
