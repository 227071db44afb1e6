"""Which vLLM engine arguments genlm-vllm starts an engine with: ours first, the user's over them.

Ours plug our engine-side code in by name (:mod:`genlm_vllm.transport.keys`): the capture processor for the
model runner, the worker extension that brings rows back by RPC, and, for live sessions, the fork
connector. The rest follows :class:`~genlm_vllm.VLLMOptions` (dtype, memory, block size, LoRA, async
scheduling, how workers wait: :data:`~genlm_vllm.transport.keys.WORKER_NAP` in ``additional_config``);
``engine_opts`` go over everything (an ``additional_config`` of theirs is merged over ours).
"""

from __future__ import annotations

from typing import Any

from genlm_vllm.layout import Layout
from genlm_vllm.options import VLLMOptions
from genlm_vllm.transport.keys import CONNECTOR, CONNECTOR_MODULE, EXTENSION, PROCESSORS, WORKER_NAP
from genlm_vllm.vllm_api import release

#: The smallest KV block vLLM's CPU attention accepts (it takes multiples of 32; its default is 128).
CPU_BLOCK_SIZE = 32
#: How long a napping worker sleeps between checks for the next step (``worker_wait="nap"``).
NAP_S = 0.0005


def engine_kwargs(model: str, options: VLLMOptions, lay: Layout, runner: str | None = None) -> dict[str, Any]:
    """vLLM engine arguments for ``options``: ours first, ``engine_opts`` over them. ``runner``
    ("v1"/"v2") picks the capture processor; None leaves it out (for asking vLLM which runner)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": options.dtype,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enable_prefix_caching": options.enable_prefix_caching,
    }
    if runner is not None:
        kwargs["logits_processors"] = [PROCESSORS[runner]]  # by name: spawned processes import it themselves
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    block_size = options.block_size or (CPU_BLOCK_SIZE if release.on_cpu_build() else None)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if options.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank)
    sessions = options.sessions_in(lay)
    if sessions:
        kwargs["kv_transfer_config"] = release.kv_transfer_config(CONNECTOR, CONNECTOR_MODULE)  # forks share a block
    if options.async_scheduling is not None or sessions:
        kwargs["async_scheduling"] = bool(options.async_scheduling)  # see VLLMOptions.async_scheduling
    theirs = options.engine_opts.get("worker_extension_cls")
    if theirs is None:
        kwargs["worker_extension_cls"] = EXTENSION  # rows by RPC, and genlm_where() for checking a cluster
    elif lay.capture == "rpc":
        raise ValueError("capture='rpc' needs worker_extension_cls for itself; drop yours from engine_opts")
    ours = {WORKER_NAP: NAP_S} if naps(options, lay) else {}
    kwargs.update(options.engine_opts)
    theirs = options.engine_opts.get("additional_config")
    if ours and (theirs is None or isinstance(theirs, dict)):
        kwargs["additional_config"] = {**ours, **(theirs or {})}
    return kwargs


def naps(options: VLLMOptions, lay: Layout) -> bool:
    """Whether the workers of an engine laid out as ``lay`` nap between checks for the next step
    (:attr:`~genlm_vllm.VLLMOptions.worker_wait`): only an engine with worker processes has any."""
    if not (lay.spawns or lay.ray) or options.worker_wait == "spin":
        return False
    return options.worker_wait == "nap" or release.on_cpu_build()
