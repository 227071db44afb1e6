"""The one place a driver is chosen: :func:`start_driver` picks an engine driver from the options.

Each kind is imported here, only when it is picked, and never imports this module back: a replica
starts its own :class:`~genlm_vllm.drivers.llm.LLMDriver` directly.
"""

from __future__ import annotations

from genlm_vllm.drivers.base import EngineDriver
from genlm_vllm.layout import Layout, layout
from genlm_vllm.options import VLLMOptions


def driver_class(options: VLLMOptions, lay: Layout) -> type[EngineDriver]:
    """The driver that runs an engine laid out as ``lay`` with ``options``."""
    if options.replicas > 1:
        from genlm_vllm.drivers.replicas import ReplicaDriver

        return ReplicaDriver
    if lay.streaming:
        from genlm_vllm.drivers.async_llm import AsyncLLMDriver

        return AsyncLLMDriver
    from genlm_vllm.drivers.llm import LLMDriver

    return LLMDriver


def start_driver(model: str, options: VLLMOptions) -> EngineDriver:
    """Start the engine ``options`` ask for, on a local ``model`` folder."""
    lay = layout(options)
    return driver_class(options, lay).start(model, options, lay)
