"""Options of the mock backend (kept import-light: listing backends must not import torch models)."""

from __future__ import annotations

from pydantic import Field

from genlm_core.config import BackendOptions


class MockOptions(BackendOptions):
    """Options of the ``mock`` backend."""

    seed: int = Field(0, description="Changes every distribution; the same seed gives the same model.")
    scale: float = Field(3.0, gt=0, description="Standard deviation of the logits (larger is peakier).")
    vocab_padding: int = Field(0, ge=0, description="Extra logit columns beyond the tokenizer, as padded models have.")
    delay: float = Field(0.0, ge=0, description="Seconds each batch takes, to simulate model latency.")
    keep_batches: int = Field(1000, ge=0, description="Most recent batches kept in `.batches` (memory stays bounded).")
