"""genlm backend for llama.cpp: GGUF models, each particle's context alive in a llama.cpp sequence."""

from genlm_llamacpp.lm import LlamaCppLM
from genlm_llamacpp.options import LlamaCppOptions

__all__ = ["LlamaCppLM", "LlamaCppOptions"]
