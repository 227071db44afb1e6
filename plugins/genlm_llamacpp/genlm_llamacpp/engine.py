"""The one module that calls llama.cpp (through llama-cpp-python's low-level ctypes bindings).

:class:`LlamaEngine` owns a model and one context with many sequences in a unified KV cache. It
offers what :mod:`genlm_llamacpp.sequences` needs and nothing else: decode a batch of tokens with
positions and sequence ids and return the logits of the marked tokens; copy a sequence (a fork:
with a unified cache only the cells' sequence sets change); remove a sequence; the vocabulary's
bytes. Batches are built in numpy arrays that the ``llama_batch`` struct points into, so filling a
batch costs no Python loop over its tokens.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
llama_log = logging.getLogger("genlm_llamacpp.llama_cpp")

#: llama-cpp-python releases this module is tested against (pyproject admits later 0.3.x, with a warning).
TESTED_VERSIONS = "==0.3.36"

#: KV cache element types by name (ggml's type ids).
CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}

# ggml log levels (none, debug, info, warn, error) -> logging levels; 5 continues the previous message.
# llama.cpp's INFO lines (hundreds at load) are DEBUG records here.
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_log_state = {"level": logging.DEBUG}
_log_callback: Any = None
_init_lock = threading.Lock()


def bindings() -> Any:
    """``llama_cpp.llama_cpp`` with llama.cpp's own log routed to the ``genlm_llamacpp.llama_cpp``
    logger (llama.cpp's load-time INFO lines become DEBUG records, not stderr noise)."""
    global _log_callback
    from llama_cpp import llama_cpp as lib

    with _init_lock:
        if _log_callback is None:
            check_version()

            def route(level: int, text: bytes, _user: Any) -> None:
                if level != 5:
                    _log_state["level"] = _LEVELS.get(level, logging.DEBUG)
                    if b"failed to find a memory slot" in text:  # DecodeError(no_room): handled by the caller
                        _log_state["level"] = logging.DEBUG
                if not llama_log.isEnabledFor(_log_state["level"]):
                    return
                message = text.decode("utf-8", "replace").rstrip()
                if message:
                    llama_log.log(_log_state["level"], "%s", message)

            _log_callback = lib.llama_log_callback(route)
            lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
            lib.llama_backend_init()
    return lib


def check_version() -> None:
    """Warn when the installed llama-cpp-python is outside :data:`TESTED_VERSIONS` (its ctypes
    structs follow llama.cpp's C API, which changes between releases)."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    installed = version("llama-cpp-python")
    if installed not in SpecifierSet(TESTED_VERSIONS):
        log.warning(
            "llama-cpp-python %s is not a release genlm-llamacpp is tested with (%s)", installed, TESTED_VERSIONS
        )


class DecodeError(RuntimeError):
    """``llama_decode`` failed; ``no_room`` when the KV cache had no room for the batch (the cache is
    then as before the call)."""

    def __init__(self, code: int, tokens: int):
        self.code, self.no_room = code, code == 1
        reason = "no room in the KV cache" if self.no_room else f"llama_decode returned {code}"
        super().__init__(f"llama.cpp could not decode a batch of {tokens} tokens: {reason}")


#: Longest default context (KV cells) when the model's training context is longer.
DEFAULT_MAX_CTX = 16384
_F32_FILE_TYPE = "0"  # GGUF general.file_type of an all-float32 model


@dataclass(frozen=True)
class EngineConfig:
    """How to open a GGUF file: the context's sizes, threads and cache type. ``None`` and ``"auto"``
    are decided from the model by :meth:`for_model`."""

    n_seq_max: int = 64
    n_ctx: int | None = None  #: KV cells shared by all sequences; None: the training context, at most 16384
    n_batch: int = 2048  #: most tokens in one llama_decode call
    n_ubatch: int = 512
    n_threads: int | None = None  #: None: every CPU this process may use
    n_threads_batch: int | None = None
    cache_type: str = "auto"  #: a key of CACHE_TYPES, or "auto": f32 for a float32 model, else f16
    flash_attn: bool | None = (
        None  #: None: off with an f32 cache (its CPU kernel rounds to f16), else llama.cpp's choice
    )
    n_gpu_layers: int = 0
    use_mmap: bool = True
    repack_weights: bool | None = None  #: None: on unless llama.cpp would use its AMX kernels (see below)

    def for_model(self, n_ctx_train: int, file_type: str | None) -> EngineConfig:
        """This config with every default decided for a model."""
        cpus = available_cpus()
        cache = self.cache_type
        if cache == "auto":
            cache = "f32" if file_type == _F32_FILE_TYPE else "f16"
        flash = self.flash_attn
        if flash is None and cache == "f32":
            flash = False
        return replace(
            self,
            n_ctx=self.n_ctx or min(n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX),
            n_threads=self.n_threads or cpus,
            n_threads_batch=self.n_threads_batch or cpus,
            cache_type=cache,
            flash_attn=flash,
        )


def repack_weights(asked: bool | None, system_info: str) -> bool:
    """Whether llama.cpp may repack quantized weights into its faster layouts (its "extra buffer types").

    ``None`` decides from llama.cpp's system info: off where it reports ``AMX_INT8 = 1``, because on such
    machines it repacks Q4_0/Q4_1/Q8_0 weights for its AMX matrix multiply, which can segfault on the first
    decode (llama.cpp issue 20824; seen here with SmolLM2's Q4_1 GGUF on a Sapphire Rapids virtual machine).
    Rows agree either way up to rounding; only speed differs.
    """
    if asked is not None:
        return asked
    amx = "AMX_INT8 = 1" in system_info
    if amx:
        log.info("llama.cpp reports AMX: weights are not repacked (repack_weights=True asks for them)")
    return not amx


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


class LlamaEngine:
    """A llama.cpp model and one context whose sequences hold particles' contexts."""

    def __init__(self, path: str | Path, config: EngineConfig):
        self.lib = lib = bindings()
        self.path = str(path)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.use_mmap = config.use_mmap
        mparams.use_extra_bufts = repack_weights(config.repack_weights, lib.llama_print_system_info().decode())
        model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ValueError(f"llama.cpp could not load {self.path!r} (not a GGUF model it supports; see the log)")
        self.model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        self.config = config = config.for_model(self.n_ctx_train, self.metadata("general.file_type"))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_ubatch
        cparams.n_seq_max = config.n_seq_max
        cparams.n_threads = config.n_threads
        cparams.n_threads_batch = config.n_threads_batch
        cparams.type_k = cparams.type_v = CACHE_TYPES[config.cache_type]
        cparams.flash_attn_type = {None: -1, False: 0, True: 1}[config.flash_attn]
        cparams.kv_unified = True  # forks share cells: a copy is metadata only
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise ValueError(
                f"llama.cpp could not make a context for {self.path!r} with n_ctx={config.n_ctx}, "
                f"n_seq_max={config.n_seq_max}, cache_type={config.cache_type!r} (see the log)"
            )
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self.n_ctx = int(lib.llama_n_ctx(ctx))
        self.n_batch = int(lib.llama_n_batch(ctx))
        self.tokens_decoded = 0  #: tokens llama.cpp ran
        self.decode_calls = 0
        n = self.n_batch
        self._token = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._n_seq_id = np.ones(n, np.int32)
        self._seq = np.zeros(n, np.int32)
        self._seq_ptrs = self._seq.ctypes.data + 4 * np.arange(n, dtype=np.uint64)
        self._logits = np.zeros(n, np.int8)
        batch = lib.llama_batch()
        batch.token = self._token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        batch.embd = ctypes.POINTER(ctypes.c_float)()
        batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        batch.n_seq_id = self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch

    # ---- the model -------------------------------------------------------------------------

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None."""
        buf = ctypes.create_string_buffer(4096)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes as llama.cpp detokenizes it (special tokens as their text)."""
        lib, vocab = self.lib, self.vocab
        buf = ctypes.create_string_buffer(256)
        out = []
        for token in range(self.n_vocab):
            n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
            if n < 0:  # longer than the buffer: -n is the length it needs
                buf = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
            out.append(buf.raw[:n])
        return out

    def special_ids(self) -> dict[str, int]:
        """BOS/EOS/EOT ids the GGUF declares (absent ones left out)."""
        lib, vocab = self.lib, self.vocab
        ids = {"bos": lib.llama_vocab_bos(vocab), "eos": lib.llama_vocab_eos(vocab), "eot": lib.llama_vocab_eot(vocab)}
        return {k: int(v) for k, v in ids.items() if v >= 0}

    # ---- sequences -------------------------------------------------------------------------

    def copy_sequence(self, src: int, dst: int, length: int = -1) -> None:
        """Make ``dst`` hold ``src``'s first ``length`` positions (all with -1); ``dst`` must be empty."""
        self.lib.llama_memory_seq_cp(self.memory, src, dst, 0 if length >= 0 else -1, length)

    def remove_sequence(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def sequence_length(self, seq: int) -> int:
        """Positions ``seq`` holds (0 when empty)."""
        return int(self.lib.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def clear(self) -> None:
        """Empty every sequence."""
        self.lib.llama_memory_clear(self.memory, True)

    # ---- decoding --------------------------------------------------------------------------

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray) -> np.ndarray:
        """Run ``tokens`` (at most :attr:`n_batch`), each at its position in its sequence; return
        the logits ``[outputs.sum(), n_vocab]`` (float32) of the tokens where ``outputs`` is set, in
        batch order. Raises :class:`DecodeError`; the cache is unchanged when it says ``no_room``."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"a decode call takes 1 to {self.n_batch} tokens, got {n}")
        self._token[:n] = tokens
        self._pos[:n] = positions
        self._seq[:n] = seqs
        self._logits[:n] = outputs
        self._batch.n_tokens = n
        code = self.lib.llama_decode(self.ctx, self._batch)
        if code != 0:
            raise DecodeError(code, n)
        self.decode_calls += 1
        self.tokens_decoded += n
        wanted = int(np.count_nonzero(outputs))
        if not wanted:
            return np.zeros((0, self.n_vocab), np.float32)
        pointer = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(pointer, shape=(wanted, self.n_vocab)).copy()

    def decode_stream(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seqs: np.ndarray,
        outputs: np.ndarray,
        make_room: Callable[[], bool] | None = None,
    ) -> np.ndarray:
        """:meth:`decode` for any number of tokens, in calls of at most :attr:`n_batch` (a sequence's
        tokens may span calls; they run in order). When the cache has no room, ``make_room()`` may
        free some (True) and the call is tried again; otherwise :class:`DecodeError` is raised."""
        rows = []
        for i in range(0, len(tokens), self.n_batch):
            part = slice(i, i + self.n_batch)
            while True:
                try:
                    rows.append(self.decode(tokens[part], positions[part], seqs[part], outputs[part]))
                    break
                except DecodeError as exc:
                    if not (exc.no_room and make_room is not None and make_room()):
                        raise
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the bindings may be gone already
            pass


def stream(pieces: Sequence[tuple[Sequence[int], int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lay out ``(tokens, first position, sequence)`` pieces as one token stream whose last token of
    each piece is an output: ``(tokens, positions, seqs, outputs)``."""
    lengths = np.array([len(t) for t, _, _ in pieces], np.int64)
    total = int(lengths.sum())
    tokens = np.fromiter((t for toks, _, _ in pieces for t in toks), np.int32, total)
    starts = np.repeat(np.array([p for _, p, _ in pieces], np.int64), lengths)
    offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = (starts + offsets).astype(np.int32)
    seqs = np.repeat(np.array([s for _, _, s in pieces], np.int32), lengths)
    outputs = np.zeros(total, np.int8)
    outputs[np.cumsum(lengths) - 1] = 1
    return tokens, positions, seqs, outputs
