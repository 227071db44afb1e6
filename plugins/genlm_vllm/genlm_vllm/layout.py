"""Where an engine's processes run and how its rows come back: :func:`layout` decides from the options.

An engine runs in one of these layouts:

- in-process (the default): the engine core and the model live in the caller's process;
- multiprocess: vLLM's engine core runs in a process of its own (vLLM's own default; always so
  for ``AsyncLLM``);
- tensor/pipeline parallel: one worker process per rank, spawned by the engine core;
- with vLLM's Ray executor, those workers may sit on other hosts; ``replicas=N`` runs N engines as
  Ray actors.

Nothing here imports vLLM: the options model validates a layout before any engine is started.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class ParallelSettings(BaseModel):
    """The parts of ``engine_opts`` (vLLM's own engine arguments, passed on unchanged) that decide an
    engine's layout, read typed: a wrong type is an error naming the argument, before any engine starts."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    tensor_parallel_size: PositiveInt = Field(1, description="vLLM's tensor-parallel ranks.")
    pipeline_parallel_size: PositiveInt = Field(1, description="vLLM's pipeline stages.")
    data_parallel_size: PositiveInt = Field(1, description="vLLM's data-parallel engines (AsyncLLM only).")
    distributed_executor_backend: str | None = Field(None, description="'mp', 'ray', ... (vLLM's choice if None).")
    data_parallel_backend: str | None = Field(None, description="'mp' or 'ray' for vLLM's data parallel.")

    @property
    def ray(self) -> bool:
        """Whether vLLM runs this engine's workers or engines through Ray."""
        return self.distributed_executor_backend == "ray" or self.data_parallel_backend == "ray"


@dataclass(frozen=True)
class Layout:
    """How an engine is laid out over processes, and how its rows come back."""

    streaming: bool  #: AsyncLLM (requests stream in) rather than LLM (one generate per batch)
    multiprocess: bool  #: the engine core runs in its own process
    tensor_parallel: int
    pipeline_parallel: int
    ray: bool  #: vLLM's Ray executor: workers may sit on other hosts
    capture: str  #: "local", "shm" or "rpc"
    data_parallel: int = 1  #: vLLM's data-parallel engines (AsyncLLM only)
    ray_address: str | None = None  #: the Ray cluster to join, if one was named

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def spawns(self) -> bool:
        """Whether starting the engine starts other processes."""
        return self.multiprocess or self.world_size > 1 or self.data_parallel > 1

    def describe(self) -> str:
        parts = ["AsyncLLM" if self.streaming else "LLM", "multiprocess" if self.multiprocess else "in-process"]
        if self.tensor_parallel > 1:
            parts.append(f"TP={self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(f"PP={self.pipeline_parallel}")
        if self.data_parallel > 1:
            parts.append(f"DP={self.data_parallel}")
        if self.ray:
            parts.append("Ray")
        return ", ".join(parts) + f"; rows by {self.capture}"


def layout(options: Any) -> Layout:
    """The layout ``options`` (:class:`~genlm_vllm.VLLMOptions`) ask for; ValueError if impossible."""
    parallel = ParallelSettings.model_validate(options.engine_opts)
    streaming = options.engine == "async"
    multiprocess = options.multiprocess
    if multiprocess is None:
        multiprocess = streaming
    if streaming and not multiprocess:
        raise ValueError("engine='async' (AsyncLLM) always runs its engine core in its own process: multiprocess=False")
    tp, pp, dp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size
    if dp > 1 and not streaming:
        raise ValueError(
            "data_parallel_size > 1 runs only under AsyncLLM (vLLM refuses it for LLM): set engine='async', "
            "or use replicas=N for N independent engines behind one client"
        )
    if getattr(options, "replicas", 1) > 1 and (streaming or dp > 1):
        raise ValueError(
            "replicas=N runs N LLM engines as Ray actors: use it with engine='llm' and no data_parallel_size "
            "(for vLLM's own data parallel, use engine='async' with data_parallel_size instead)"
        )
    ray = parallel.ray
    automatic = "rpc" if ray else "local" if not multiprocess and tp * pp == 1 else "shm"
    capture = automatic if options.capture == "auto" else options.capture
    if capture == "local" and automatic != "local":
        raise ValueError(
            "capture='local' needs the model in this process (engine='llm', multiprocess=False, no TP/PP); "
            f"this engine would run it elsewhere: use capture='shm' or 'rpc' (or 'auto': {automatic!r})"
        )
    if capture == "shm" and ray:
        raise ValueError("capture='shm' cannot reach Ray workers on other hosts: use capture='rpc'")
    address = getattr(options, "ray_address", None) or os.environ.get("RAY_ADDRESS")
    return Layout(streaming, multiprocess, tp, pp, ray, capture, dp, address)


@cache
def modes_here() -> str:
    """Which execution modes this machine can run, for ``genlm backends`` and the docs."""
    import torch

    if torch.cuda.is_available():
        devices = torch.cuda.device_count()
        where = f"{devices} CUDA device(s)"
        runner = "model runner V2 unless vLLM picks V1 (model_runner='auto'), or 'v1'/'v2'; every layout on both"
    else:
        devices = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        where = f"vLLM's CPU build on {devices} core(s)"
        runner = "model runner V1 (vLLM's CPU build has no Triton for V2)"
    modes = ["in-process", "multiprocess", "AsyncLLM (engine='async')"]
    if devices > 1:
        modes.append(f"tensor/pipeline parallel up to {devices} ranks")
    else:
        modes.append("TP/PP only with ranks sharing one device (slow)")
    ray = (
        "Ray executor, replicas and data parallel available"
        if importlib.util.find_spec("ray")
        else "no Ray (pip install 'genlm-vllm[ray]') for multi-node"
    )
    return f"{where}: {', '.join(modes)}; {ray}; {runner}"
