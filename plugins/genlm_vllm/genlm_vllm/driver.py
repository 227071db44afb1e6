"""Engine drivers: the one interface :class:`~genlm_vllm.AsyncVirtualLM` runs vLLM through.

A driver owns one way of running vLLM and everything that comes with it (the engine, the row
channel, live sessions, files its processes leave). :func:`start_driver` picks one from the options:

- :class:`~genlm_vllm.llm_driver.LLMDriver`: ``vllm.LLM``, one engine batch per batch of requests,
  particles kept alive as sessions (every layout but AsyncLLM);
- :class:`~genlm_vllm.async_driver.AsyncLLMDriver`: vLLM's ``AsyncLLM``; each request streams into the
  running engine (``engine="async"``, vLLM's data parallel);
- :class:`~genlm_vllm.replicas.ReplicaDriver`: ``replicas=N`` engines as Ray actors, each an
  ``LLMDriver``, behind a router that keeps lineages together.

Drivers return raw logits rows; normalising, caching and validation are the LM's. They never import
the LM. Every driver closes through :meth:`EngineDriver.close`.
"""

from __future__ import annotations

import abc
import gc
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from genlm_core import Request
from genlm_core.batching import Failed
from genlm_vllm.layout import Layout, layout
from genlm_vllm.options import VLLMOptions
from genlm_vllm.rows import RowChannel
from genlm_vllm.shm_files import EngineFiles

log = logging.getLogger("genlm_vllm")

#: The smallest KV block vLLM's CPU attention accepts (it takes multiples of 32; its default is 128).
CPU_BLOCK_SIZE = 32

EXTENSION = "genlm_vllm.capture.RowsExtension"  # vLLM wants a dotted path here

#: One ``sample`` call: (request, max_tokens, eos ids, temperature, seed).
SampleCall = tuple[Request, int, tuple[int, ...], float, "int | None"]


class EngineDriver(abc.ABC):
    """One way of running vLLM: logits rows by request, sampling, adapters, and one close path."""

    #: Whether requests go straight to the engine (:meth:`stream_logits`) rather than in batches.
    streams = False

    def __init__(self, lay: Layout):
        self.layout = lay
        #: Serialises use of the engine (it is not thread-safe); the LM uses it as its model lock.
        self.lock = threading.RLock()
        self.batches = 0  #: batches handed to the engine: generate calls and session runs
        self.context_limit: int | None = None  #: longest context the engine accepts
        self.rows: RowChannel | None = None  #: where captured rows come back
        self.files: EngineFiles | None = None  #: shared-memory files the engine's processes made
        self.runner: str | None = None  #: "v1" or "v2": the model runner the engine uses
        self._closed = False

    def normalise_rows(self, vocab_size: int, on_device: bool = False) -> None:
        """Have the engine normalise each row over the first ``vocab_size`` columns where it computes
        it (and, ``on_device``, keep it on the model's device: an in-process engine only)."""
        if self.rows is not None:
            self.rows.vocab_size = vocab_size
            self.rows.on_device = on_device and self.layout.capture == "local"

    @property
    def rows_normalised(self) -> bool:
        """Whether :meth:`logits` and :meth:`stream_logits` return rows normalised in the engine."""
        return self.rows is not None and self.rows.vocab_size is not None

    @property
    def engine_count(self) -> int:
        """Engines behind this driver (vLLM's data-parallel engines, or replicas)."""
        return max(1, self.layout.data_parallel)

    # ---- rows ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def logits(self, requests: Sequence[Request]) -> torch.Tensor | list[torch.Tensor | Failed]:
        """Logits (logprobs where :attr:`rows_normalised`), one row per request: a tensor, or a
        list with a :class:`Failed` for each request that failed alone; raises if the whole batch failed."""

    @abc.abstractmethod
    def uncached_logits(self, request: Request) -> torch.Tensor:
        """The row of one context computed alone, sharing no cached KV block with anything."""

    async def stream_logits(self, request: Request) -> torch.Tensor:
        """One request's row, streamed into the running engine (drivers with :attr:`streams`)."""
        raise NotImplementedError(f"{type(self).__name__} computes rows in batches")

    def fail_in_flight(self, error: BaseException) -> None:  # noqa: B027 - only streaming drivers hold any
        """Fail every request still in flight with ``error``."""

    # ---- everything else ----------------------------------------------------------------------

    @abc.abstractmethod
    async def sample(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """vLLM's own sampling from a validated request; stops at (and drops) one of ``eos``."""

    @abc.abstractmethod
    def top_logprobs(self, contexts: Sequence[Sequence[int]], k: int) -> list[dict[int, float]]:
        """vLLM's own ``logprobs=k`` for the token after each context: its sampler's path, not our
        capture (an independent reference for :mod:`genlm_vllm.selftest`)."""

    @abc.abstractmethod
    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a :class:`~genlm_vllm.capture.RowsExtension` method on every worker; their replies."""

    @abc.abstractmethod
    def load_lora(self, name: str, path: str) -> None:
        """Make adapter ``name`` (a PEFT folder) usable per request."""

    @abc.abstractmethod
    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` in the engine."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Drop what the engine caches between requests (prefix cache, live sessions)."""

    def confirm_started(self, config: Any, runner: str, sessions: bool) -> None:
        """:func:`check_started` on a driver just built; a driver that fails it is closed."""
        try:
            check_started(self, config, runner, sessions)
        except BaseException:
            self.close()
            raise

    # ---- the one close path -------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine and free everything of ours, also after a crash; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.shutdown()
        except Exception as exc:  # a crashed engine: still free what is ours
            log.warning("%s: vLLM engine shutdown failed: %s: %s", type(self).__name__, type(exc).__name__, exc)
        finally:
            if self.rows is not None:
                self.rows.close()  # its callbacks hold the engine
            gc.collect()  # vLLM's objects hold each other in cycles: this process unmaps their queues now
            if self.files is not None:
                self.files.remove_orphans(grace=30.0 if self.layout.ray else 0.0)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its processes now, dropping every reference to it."""


def engine_kwargs(model: str, options: VLLMOptions, lay: Layout, runner: str | None = None) -> dict[str, Any]:
    """vLLM engine arguments for ``options``: ours first, ``engine_opts`` over them. ``runner``
    ("v1"/"v2") picks the capture processor; None leaves it out (for asking vLLM which runner)."""
    from genlm_vllm.capture import PROCESSORS
    from genlm_vllm.forks import kv_transfer_config
    from genlm_vllm.vllm_api import on_cpu_build

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
    block_size = options.block_size or (CPU_BLOCK_SIZE if on_cpu_build() else None)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if options.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank)
    sessions = options.sessions_in(lay)
    if sessions:
        kwargs["kv_transfer_config"] = kv_transfer_config()  # forks share their parent's block
    if options.async_scheduling is not None or sessions:
        kwargs["async_scheduling"] = bool(options.async_scheduling)  # see VLLMOptions.async_scheduling
    theirs = options.engine_opts.get("worker_extension_cls")
    if theirs is None:
        kwargs["worker_extension_cls"] = EXTENSION  # rows by RPC, and genlm_where() for checking a cluster
    elif lay.capture == "rpc":
        raise ValueError("capture='rpc' needs worker_extension_cls for itself; drop yours from engine_opts")
    kwargs.update(options.engine_opts)
    return kwargs


def start_driver(model: str, options: VLLMOptions) -> EngineDriver:
    """Start the engine ``options`` ask for, on a local ``model`` folder (the one selector)."""
    lay = layout(options)
    if options.replicas > 1:
        from genlm_vllm.replicas import ReplicaDriver

        return ReplicaDriver.start(model, options, lay)
    from genlm_vllm.main_guard import check_main_guard
    from genlm_vllm.vllm_api import resolve_runner

    if lay.spawns:
        check_main_guard()
    runner = resolve_runner(options.model_runner, engine_kwargs(model, options, lay))
    kwargs = engine_kwargs(model, options, lay, runner)
    log.info("starting vLLM engine for %s (%s; model runner %s)", model, lay.describe(), runner.upper())
    files = EngineFiles() if lay.spawns else None
    driver: EngineDriver
    if lay.streaming:
        from genlm_vllm.async_driver import AsyncLLMDriver

        driver = AsyncLLMDriver.start(kwargs, options, lay, runner)
    else:
        from genlm_vllm.llm_driver import LLMDriver

        driver = LLMDriver.start(kwargs, options, lay, runner)
    if files is not None:
        files.started()
        driver.files = files
    return driver


def check_started(driver: EngineDriver, config: Any, runner: str, sessions: bool) -> None:
    """After start: the engine uses the runner whose processor it was given, and no async scheduling
    under live sessions; log vLLM's version, runner and scheduling."""
    from genlm_vllm.vllm_api import engine_facts

    facts = engine_facts(config)
    if facts.runner != runner:
        raise RuntimeError(
            f"vLLM started its {facts.runner.upper()} model runner, but genlm-vllm prepared the capture for "
            f"{runner.upper()}: pass model_runner='{facts.runner}'"
        )
    if sessions and facts.async_scheduling:
        raise RuntimeError("vLLM turned async scheduling on, which live sessions cannot run with")
    driver.runner = runner
    log.info("vLLM engine up: %s", facts.describe())
    limit = getattr(config.model_config, "max_model_len", None)
    driver.context_limit = None if limit is None else int(limit) - 1  # room for the one token vLLM generates


def sampling_params(max_tokens: int, eos: Sequence[int], temperature: float, seed: int | None) -> Any:
    """vLLM's parameters for ``sample``: stop at ``eos`` only, not the model's EOS."""
    from genlm_vllm.vllm_api import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=list(eos),
        ignore_eos=True,
        detokenize=False,
    )


def first_token_logprobs(output: Any) -> dict[int, float]:
    """The ``logprobs=k`` vLLM returned for the first generated token of a ``RequestOutput``."""
    return {token: float(lp.logprob) for token, lp in output.outputs[0].logprobs[0].items()}


def stack(rows: Sequence[torch.Tensor | None], requests: Sequence[Request]) -> torch.Tensor:
    """The rows of a batch as one tensor; a missing row fails the batch, naming the request."""
    missing = [i for i, row in enumerate(rows) if row is None]
    if missing:
        first = requests[missing[0]].token_ids
        raise RuntimeError(
            f"vLLM returned no logits for {len(missing)} of {len(rows)} requests (the first: a context of "
            f"{len(first)} tokens ending {list(first[-5:])})"
        )
    return as_block(rows)  # type: ignore[arg-type]


def as_block(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(rows)``, without a copy where the rows already are consecutive rows of one block
    (as :meth:`~genlm_vllm.rows.SharedMemoryRows.collect` returns them)."""
    first = rows[0]
    if first.dim() == 1 and first.stride(0) == 1:
        step = first.shape[0] if len(rows) == 1 else rows[1].data_ptr() - first.data_ptr()
        size = first.element_size()
        if step % size == 0 and step // size >= first.shape[0]:
            stride = step // size
            ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
            if all(
                r.dim() == 1
                and r.shape == first.shape
                and r.stride(0) == 1
                and r.dtype == first.dtype
                and r.device == first.device
                and r.data_ptr() == ptr + i * step
                and r.untyped_storage().data_ptr() == storage
                for i, r in enumerate(rows)
            ):
                return first.as_strided((len(rows), first.shape[0]), (stride, 1))
    return torch.stack(list(rows))


def without_stop(token_ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """A sample without the EOS that stopped it (as genlm-backend returns them)."""
    ids = list(token_ids)
    return ids[:-1] if ids and ids[-1] in eos else ids
