"""genlm-example: a template backend plugin, written only against genlm-core's public API.

The package imports only its options: ``genlm backends`` imports the plugin module (``plugin.py``) and
through it this package, so the model (``lm.py``, which imports torch) is imported when it is asked for.
"""

from typing import TYPE_CHECKING

from genlm_example.options import BigramOptions

if TYPE_CHECKING:
    from genlm_example.lm import BigramLM

__all__ = ["BigramLM", "BigramOptions"]


def __getattr__(name: str) -> object:
    if name == "BigramLM":  # imports torch: only when asked for
        from genlm_example.lm import BigramLM

        return BigramLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
