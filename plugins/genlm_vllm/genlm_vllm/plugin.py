"""Registers the ``vllm`` backend (vllm is imported only when it is used)."""

from genlm_core import Register, hookimpl
from genlm_vllm.options import VLLMOptions
from genlm_vllm.vllm_api.release import INSTALL


def unavailable_reason() -> str | None:
    """Why vLLM cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"the vllm module is not installed: {INSTALL}"
    return None


def default_priority() -> int:
    """The default backend with CUDA (above genlm-hf's 10); without it, only when nothing ranks higher."""
    import torch

    return 20 if torch.cuda.is_available() else 0


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "vllm",
        "genlm_vllm.lm:AsyncVirtualLM.from_options",
        resolve_name="genlm_core.hub:resolve_model",
        options=VLLMOptions,
        description="vLLM (CUDA with either model runner, or its CPU build); logits captured inside the engine.",
        check=unavailable_reason,
        details="genlm_vllm.layout:modes_here",
        default_priority=default_priority,
        install=INSTALL,
    )
