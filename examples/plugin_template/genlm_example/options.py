"""Options of the ``example`` backend (import-light: listing backends imports only this)."""

from __future__ import annotations

from pydantic import Field

from genlm_core import BackendOptions


class BigramOptions(BackendOptions):
    """Options of the ``example`` backend; batching and output-cache options come from core."""

    corpus: str | None = Field(None, description="UTF-8 text file to count bigrams in (default: a built-in text).")
    smoothing: float = Field(0.1, gt=0, description="Add-k smoothing: every bigram count gets this much.")
