"""The engine driver: the one interface :class:`~genlm_vllm.AsyncVirtualLM` runs vLLM through.

A driver owns one way of running vLLM and everything that comes with it (the engine, the row
channel, live sessions, files its processes leave). Its kinds, one module each, picked by
:func:`genlm_vllm.drivers.select.start_driver`:

- :class:`~genlm_vllm.drivers.llm.LLMDriver`: ``vllm.LLM``, one engine batch per batch of requests,
  particles kept alive as sessions (every layout but AsyncLLM);
- :class:`~genlm_vllm.drivers.async_llm.AsyncLLMDriver`: vLLM's ``AsyncLLM``; each request streams into the
  running engine (``engine="async"``, vLLM's data parallel);
- :class:`~genlm_vllm.drivers.replicas.ReplicaDriver`: ``replicas=N`` engines as Ray actors, each an
  ``LLMDriver``, behind a router that keeps lineages together.

As vLLM's executors share ``collective_rpc``, the drivers share two primitives and differ in little
else: :meth:`EngineDriver.run` (plain engine requests, :class:`EngineCall`, each read where its output
is produced) and :meth:`EngineDriver.engine_call` (an operation on every engine, :data:`EngineOp`).
Sampling, vLLM's own top logprobs, a plain captured batch, worker calls, adapters and the prefix cache
are written once here on those two. What each kind writes itself is where its engine differs: how a
batch's rows are computed (:meth:`~EngineDriver.logits`: live sessions, streamed requests, or routed
to replicas), and a streaming engine's sampling.

Every kind starts through :meth:`EngineDriver.start` (the two that run an engine here share
:func:`genlm_vllm.drivers.launch.launch`), returns raw logits rows (normalised in the engine where
:attr:`~EngineDriver.rows_normalised`), and closes through :meth:`EngineDriver.close`. Drivers never
import the LM or the selector.
"""

from __future__ import annotations

import abc
import functools
import gc
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from genlm_core import AutoBatcher, Request, RowsOut
from genlm_vllm.layout import Layout
from genlm_vllm.options import VLLMOptions
from genlm_vllm.start.files import EngineFiles
from genlm_vllm.transport.channels import RowChannel, stack
from genlm_vllm.vllm_api import client

log = logging.getLogger("genlm_vllm")

#: The operations :meth:`EngineDriver.engine_call` runs on every engine: each driver maps them to its
#: engine's adapter call (``vllm.LLM``'s, ``AsyncLLM``'s, or a replica's own driver).
EngineOp = Literal["collective_rpc", "remove_lora", "reset_prefix_cache"]


def output(out: Any) -> Any:
    """An engine output as it is (the default :attr:`EngineCall.read`)."""
    return out


@dataclass(frozen=True)
class EngineCall:
    """One plain engine request: a context, vLLM's parameters for it, an adapter name, a cache salt, and
    how its output is read (where it is produced: in a replica's process, only the result travels)."""

    token_ids: Sequence[int]
    params: Any
    adapter: str | None = None
    cache_salt: str | None = None
    #: the request id to use where the engine takes one (None: a fresh one)
    request_id: str | None = None
    read: Callable[[Any], Any] = output


class EngineDriver(abc.ABC):
    """One way of running vLLM: logits rows by request, sampling, adapters, and one close path."""

    #: Whether requests go straight to the engine (:meth:`stream_logits`) rather than in batches.
    streams = False

    def __init__(self, lay: Layout, options: VLLMOptions):
        self.layout = lay
        self.options = options
        self.loras = client.LoRARequests()  #: adapters loaded in this driver's engine, by name
        #: concurrent ``sample`` calls, one :meth:`run` a batch (a streaming driver streams them instead)
        self.sampling: AutoBatcher[EngineCall, Any] = AutoBatcher(
            self._run_locked,
            batch_size=options.batch_size,
            timeout=options.timeout,
            run_in_thread=True,
            flush=options.flush,
            name="vllm-sample",
        )
        #: Serialises use of the engine (it is not thread-safe); the LM uses it as its model lock.
        self.lock = threading.RLock()
        self.batches = 0  #: batches handed to the engine: generate calls and session runs
        self.context_limit: int | None = None  #: longest context the engine accepts
        self.rows: RowChannel | None = None  #: where captured rows come back
        self.files: EngineFiles | None = None  #: shared-memory files the engine's processes made
        self.runner: str | None = None  #: "v1" or "v2": the model runner the engine uses
        self._closed = False

    @classmethod
    @abc.abstractmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> EngineDriver:
        """Start this kind of driver's engine(s) for a local ``model`` folder, laid out as ``lay``."""

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

    # ---- the two primitives ------------------------------------------------------------------

    @abc.abstractmethod
    def run(self, calls: Sequence[EngineCall]) -> list[Any]:
        """Run plain engine requests as one batch (no live session); each call's output read by its
        :attr:`EngineCall.read`, in order."""

    @abc.abstractmethod
    def engine_call(self, op: EngineOp, *args: Any) -> list[Any]:
        """Operation ``op`` (:data:`EngineOp`) on every engine behind this driver; their replies."""

    def before_engine_use(self) -> None:  # noqa: B027 - only a driver with live sessions has any
        """Called before anything else uses the engine (a parked session would keep it waiting)."""

    # ---- rows ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def logits(self, requests: Sequence[Request]) -> RowsOut:
        """Logits (logprobs where :attr:`rows_normalised`), one row per request: a tensor, or a
        sequence with a :class:`~genlm_core.Failed` for each request that failed alone; raises if the
        whole batch failed."""

    def uncached_logits(self, request: Request) -> torch.Tensor:
        """The row of one context computed alone, salted so that it shares no cached KV block."""
        return self.capture([request], cache_salt=uuid.uuid4().hex)[0]

    def capture(self, requests: Sequence[Request], cache_salt: str | None = None) -> torch.Tensor:
        """Logits of each request by one plain batch (:meth:`run`), captured in the engine (with
        ``cache_salt``: sharing no cached block with other requests)."""
        assert self.rows is not None
        ticket = self.rows.prepare(len(requests))
        finished = False
        try:
            calls = [
                EngineCall(r.token_ids, client.row_params(a), r.adapter, cache_salt, tag)
                for r, a, tag in zip(requests, ticket.extra_args, ticket.tags, strict=True)
            ]
            self.run(calls)
            rows = self.rows.collect(ticket)
            finished = True
            return stack(rows, requests)
        finally:
            self.rows.release(ticket, finished)

    async def stream_logits(self, request: Request) -> torch.Tensor:
        """One request's row, streamed into the running engine (drivers with :attr:`streams`)."""
        raise NotImplementedError(f"{type(self).__name__} computes rows in batches")

    def fail_in_flight(self, error: BaseException) -> None:  # noqa: B027 - only streaming drivers hold any
        """Fail every request still in flight with ``error``."""

    # ---- written once on the primitives -------------------------------------------------------

    async def sample(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """vLLM's own sampling from a validated request; stops at (and drops) one of ``eos``.
        Concurrent calls share one engine batch (:meth:`run`)."""
        call = EngineCall(
            request.token_ids,
            client.sample_params(max_tokens, eos, temperature, seed),
            request.adapter,
            read=functools.partial(client.sampled_tokens, eos=eos),
        )
        return await self.sampling.submit(object(), call)  # never shared: each draw is its own

    def _run_locked(self, calls: list[EngineCall]) -> list[Any]:
        with self.lock:
            return self.run(calls)

    def top_logprobs(self, contexts: Sequence[Sequence[int]], k: int) -> list[dict[int, float]]:
        """vLLM's own ``logprobs=k`` for the token after each context: its sampler's path, not our
        capture (an independent reference for :mod:`genlm_vllm.tools.selftest`)."""
        params = client.top_params(k)
        with self.lock:
            return self.run([EngineCall(tuple(c), params, read=client.first_token_logprobs) for c in contexts])

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a :class:`~genlm_vllm.in_engine.capture.RowsExtension` method on every worker; their replies."""
        return [reply for replies in self.engine_call("collective_rpc", method, args) for reply in replies]

    def load_lora(self, name: str, path: str) -> None:
        """Make adapter ``name`` (a PEFT folder) usable per request."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` in the engine."""
        self.before_engine_use()
        self.engine_call("remove_lora", self.loras.pop_id(name))

    def reset_prefix_cache(self) -> None:
        """Drop what the engine caches between requests (prefix cache, live sessions)."""
        self.before_engine_use()  # parked sessions hold blocks: the prefix cache cannot be reset under them
        self.engine_call("reset_prefix_cache")

    # ---- the one close path -------------------------------------------------------------------

    def close(self, collect: bool = True) -> None:
        """Stop the engine and free everything of ours, also after a crash; idempotent.

        vLLM's objects hold each other in cycles, so this process unmaps the engine's queues only at a
        garbage collection: one runs here unless ``collect`` is False, for a caller that runs one right
        after (``AsyncLM.cleanup`` does, after ``close_backend``; a full pass takes about 0.5 s in a
        process that imported vLLM). The engine's files are removed either way: this process's own
        hold never keeps one (:meth:`EngineFiles.remove_orphans`)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sampling.close()
            self.shutdown()
        except Exception as exc:  # a crashed engine: still free what is ours
            log.warning("%s: vLLM engine shutdown failed: %s: %s", type(self).__name__, type(exc).__name__, exc)
        finally:
            if self.rows is not None:
                self.rows.close()  # its callbacks hold the engine
            if collect:
                gc.collect()
            if self.files is not None:
                self.files.remove_orphans(grace=30.0 if self.layout.ray else 0.0)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its processes now, dropping every reference to it."""
