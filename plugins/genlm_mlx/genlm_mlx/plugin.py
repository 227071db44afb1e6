"""Registers the ``mlx`` backend (mlx is imported only when it is used)."""

from genlm_core import Register, hookimpl
from genlm_mlx.options import MLXOptions

INSTALL = "pip install genlm-mlx (Apple silicon) or 'genlm-mlx[cpu]' (Linux)"


def unavailable_reason() -> str | None:
    """Why MLX cannot run here (its modules are not installed), or None; found without importing MLX, as
    every ``genlm backends`` runs it (``genlm backends --check`` imports the backend, and MLX with it)."""
    import importlib.util

    for module in ("mlx.core", "mlx_lm"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # mlx.core's package is missing, or is not a package
            found = False
        if not found:
            return f"{module} is not installed: {INSTALL}"
    return None


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "mlx",
        "genlm_mlx.lm:AsyncMlxLM.from_options",
        resolve_name="genlm_core.hub:resolve_model",
        options=MLXOptions,
        description="MLX via mlx-lm (Apple silicon; CPU on Linux); automatic KV reuse.",
        check=unavailable_reason,
        default_priority=0,  # the default only when no other backend ranks higher
        install=INSTALL,
    )
