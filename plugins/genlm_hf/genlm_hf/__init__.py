"""genlm-hf: the Hugging Face transformers backend (transformers and torch are imported only when
:class:`AsyncTransformer` is asked for: registering the plugin imports its options alone)."""

from typing import TYPE_CHECKING

from genlm_hf.options import HFOptions

if TYPE_CHECKING:
    from genlm_hf.lm import AsyncTransformer

__all__ = ["AsyncTransformer", "HFOptions"]


def __getattr__(name: str) -> object:
    if name == "AsyncTransformer":  # imports transformers: only when asked for
        from genlm_hf.lm import AsyncTransformer

        return AsyncTransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
