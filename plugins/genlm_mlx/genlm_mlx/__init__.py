"""genlm-mlx: the MLX backend."""

from genlm_mlx.options import MLXOptions

__all__ = ["AsyncMlxLM", "MLXOptions"]


def __getattr__(name: str) -> object:
    if name == "AsyncMlxLM":  # imports mlx: only when asked for
        from genlm_mlx.lm import AsyncMlxLM

        return AsyncMlxLM
    raise AttributeError(name)
