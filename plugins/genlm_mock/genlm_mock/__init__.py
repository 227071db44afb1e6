"""genlm-mock: a model-free backend for testing programs, batching and caching."""

from genlm_mock.lm import MockAsyncLM
from genlm_mock.options import MockOptions

__all__ = ["MockAsyncLM", "MockOptions"]
