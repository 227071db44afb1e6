"""Options of the ``llamacpp`` backend."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, PositiveInt, model_validator

from genlm_core.config import BackendOptions, LiveOptions  # import-light: registering the plugin imports no torch

#: llama.cpp's most sequences per context (``LLAMA_MAX_SEQ``).
MAX_SEQUENCES = 256


class LlamaCppOptions(BackendOptions):
    """Options of the ``llamacpp`` backend (llama.cpp through llama-cpp-python)."""

    n_ctx: PositiveInt | None = Field(
        None,
        description="KV cache cells shared by all live sequences, and the longest context "
        "(None: the model's training context, at most 16384).",
    )
    n_seq_max: int = Field(
        64,
        ge=1,
        le=MAX_SEQUENCES,
        description="Sequences in the context: particles kept alive in llama.cpp (at least batch_size).",
    )
    n_batch: PositiveInt = Field(2048, description="Most tokens in one llama_decode call.")
    n_ubatch: PositiveInt = Field(512, description="Most tokens llama.cpp computes at once (its physical batch).")
    n_threads: PositiveInt | None = Field(
        None, description="Threads for decoding a few tokens per sequence (None: every CPU this process may use)."
    )
    n_threads_batch: PositiveInt | None = Field(
        None, description="Threads for long prompts (None: every CPU this process may use)."
    )
    cache_type: Literal["auto", "f32", "f16", "bf16", "q8_0"] = Field(
        "auto",
        description="KV cache element type; 'auto' is f32 for a float32 GGUF (rows as exact as the weights) "
        "and llama.cpp's f16 otherwise.",
    )
    flash_attn: bool | None = Field(
        None,
        description="llama.cpp's flash attention (its CPU kernel rounds queries to f16); "
        "None: off for an f32 cache, llama.cpp's choice otherwise.",
    )
    n_gpu_layers: int = Field(0, ge=-1, description="Layers offloaded to a GPU by a GPU build of llama.cpp (-1: all).")
    live: LiveOptions = Field(
        default_factory=lambda: LiveOptions.model_validate({}),
        description="Particles kept alive as llama.cpp sequences, so that a request extending a row's context "
        "by a token computes one token (core's live sequences: enabled, lookback, limits).",
    )
    tokenizer: str | None = Field(
        None,
        description="A Hugging Face tokenizer (folder or hub name) to use instead of the one in the GGUF; "
        "its bytes must match llama.cpp's.",
    )
    use_mmap: bool = Field(True, description="Map the GGUF file instead of reading it into memory.")
    repack_weights: bool | None = Field(
        None,
        description="Let llama.cpp repack quantized weights into its faster CPU layouts (rows agree up to rounding). "
        "None: yes, except on CPUs with AMX, where llama.cpp's AMX kernels can segfault (llama.cpp issue 20824).",
    )

    @model_validator(mode="after")
    def _sizes_fit(self) -> Self:
        if self.batch_size > self.n_seq_max:
            raise ValueError(
                f"batch_size={self.batch_size} needs at least as many sequences: raise n_seq_max "
                f"(now {self.n_seq_max}, at most {MAX_SEQUENCES}) or lower batch_size"
            )
        if self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch={self.n_ubatch} is larger than n_batch={self.n_batch}")
        return self
