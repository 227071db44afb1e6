"""genlm backend for llama.cpp: GGUF models, each particle's context alive in a llama.cpp sequence
(llama-cpp-python and torch are imported only when :class:`LlamaCppLM` is asked for)."""

from typing import TYPE_CHECKING

from genlm_llamacpp.options import LlamaCppOptions

if TYPE_CHECKING:
    from genlm_llamacpp.lm import LlamaCppLM

__all__ = ["LlamaCppLM", "LlamaCppOptions"]


def __getattr__(name: str) -> object:
    if name == "LlamaCppLM":  # imports llama_cpp: only when asked for
        from genlm_llamacpp.lm import LlamaCppLM

        return LlamaCppLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
