"""genlm-example: a template backend plugin, written only against genlm-core's public API."""

from genlm_example.lm import BigramLM
from genlm_example.options import BigramOptions

__all__ = ["BigramLM", "BigramOptions"]
