"""genlm-hf: the Hugging Face transformers backend."""

from genlm_hf.lm import AsyncTransformer
from genlm_hf.options import HFOptions

__all__ = ["AsyncTransformer", "HFOptions"]
