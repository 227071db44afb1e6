"""genlm-vllm: the vLLM backend (imports vllm only when the model is used)."""

from genlm_vllm.options import VLLMOptions

__all__ = ["AsyncVirtualLM", "VLLMOptions"]


def __getattr__(name: str) -> object:
    if name == "AsyncVirtualLM":
        from genlm_vllm.lm import AsyncVirtualLM

        return AsyncVirtualLM
    raise AttributeError(name)
