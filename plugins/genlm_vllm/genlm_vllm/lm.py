"""``AsyncVirtualLM``: vLLM behind the AsyncLM protocol, full-vocabulary logprobs from inside the engine.

Where a request goes (every step but the two driver calls is core's :class:`~genlm_core.AsyncLM`)::

    lm.next_token_logprobs(ids)          # core: validate, output cache
      ├─ batching driver: AutoBatcher -> forward_batch -> driver.logits(batch)   (a row may be Failed)
      └─ streaming driver (AsyncLLM):  InFlight (core: equal requests share one, cancelled with the last caller)
           -> forward_stream -> driver.stream_logits(request) (the driver's InFlight: engine requests), no batch barrier
           -> rows normalised in the engine (rows_normalised) -> finish_rows (check, cache)

The driver (:mod:`genlm_vllm.drivers.base`) is chosen once, from the options, by
:func:`~genlm_vllm.drivers.select.start_driver`:

- ``vllm.LLM`` (:class:`~genlm_vllm.drivers.llm.LLMDriver`): in-process, multiprocess, TP/PP, Ray;
  particles stay alive in the engine as sessions;
- ``engine="async"`` (:class:`~genlm_vllm.drivers.async_llm.AsyncLLMDriver`): vLLM's AsyncLLM, requests
  streamed in as they come (vLLM's data parallel too);
- ``replicas=N`` (:class:`~genlm_vllm.drivers.replicas.ReplicaDriver`): N engines as Ray actors.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from genlm_core import AsyncLM, BatcherError, LoRASelection, Request, RowsOut, Tokenizer
from genlm_core.hub import resolve_model
from genlm_vllm.drivers.base import EngineDriver
from genlm_vllm.drivers.select import start_driver
from genlm_vllm.options import VLLMOptions


class AsyncVirtualLM(LoRASelection, AsyncLM):
    """A vLLM engine: batched, exact full-vocabulary next-token logprobs; batched sampling.

    Runs in every layout vLLM offers (in-process, multiprocess, tensor and pipeline parallel, Ray,
    AsyncLLM with ``engine="async"``, replicas) on either model runner; see
    :class:`~genlm_vllm.VLLMOptions`."""

    Options = VLLMOptions
    options: VLLMOptions

    def __init__(self, driver: EngineDriver, tokenizer: Tokenizer, options: VLLMOptions | None = None, **kwargs: Any):
        """``driver``: a started engine (see :func:`~genlm_vllm.drivers.select.start_driver`)."""
        super().__init__(tokenizer, options, **kwargs)
        self.driver = driver
        self.model_lock = driver.lock  # the engine is not thread-safe: one lock for every use of it
        self.context_limit = driver.context_limit
        driver.normalise_rows(self.vocab_size, self.options.rows_on_device)
        #: whether requests stream into the engine (AsyncLLM) rather than going through the batcher
        self.streams = driver.streams
        #: whether the engine hands back rows it normalised where it computed them
        self.rows_normalised = driver.rows_normalised
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        atexit.register(_cleanup_if_alive, weakref.ref(self))  # engine processes, Ray actors, files

    @classmethod
    def from_name(cls, model: str, /, engine_opts: dict[str, Any] | None = None, **kwargs: Any) -> AsyncVirtualLM:
        """Start an engine for ``model`` with :class:`VLLMOptions` as keywords; ``engine_opts`` go to vLLM."""
        return cls.from_options(model, VLLMOptions(**kwargs, engine_opts=engine_opts or {}))

    @classmethod
    def from_options(cls, model: str, options: VLLMOptions) -> AsyncVirtualLM:
        """The registry factory: starts the engine in the layout ``options`` ask for (``model``: a local
        folder, ``smollm2``, or a hub id; see :func:`genlm_core.hub.resolve_model`)."""
        from transformers import AutoTokenizer

        model = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        driver = start_driver(model, options)
        try:
            return cls(driver, tokenizer, options)
        except BaseException:
            driver.close()
            raise

    # ---- logprobs -------------------------------------------------------------------------------

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        """The driver's rows for a batch; a request that failed alone (a replica's) is a ``Failed`` row."""
        return self.driver.logits(requests)

    async def forward_stream(self, request: Request) -> torch.Tensor:
        """One request's row, streamed into the running engine (AsyncLLM)."""
        return await self.driver.stream_logits(request)

    def forward_uncached(self, request: Request) -> torch.Tensor:
        """The row of one context computed alone, salted so that no cached KV block is reused: the
        reference for the sessions and the prefix cache."""
        return self.driver.uncached_logits(request)

    def engine_top_logprobs(self, contexts: Sequence[Sequence[int]], k: int = 20) -> list[dict[int, float]]:
        """vLLM's own ``logprobs=k`` for the next token after each context (its sampler's path, not
        our capture): an independent reference for :mod:`genlm_vllm.tools.selftest`."""
        self.ensure_open()
        with self.model_lock:
            return self.driver.top_logprobs(contexts, k)

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a ``RowsExtension`` method (e.g. ``"genlm_where"``) on every worker; their replies."""
        self.ensure_open()
        return self.driver.call_workers(method, *args)

    def reset_async_queries(self) -> None:
        """Fail every request still waiting (in the batcher, or streaming in the engine) with
        :class:`~genlm_core.errors.BatcherError`; the model stays usable."""
        super().reset_async_queries()
        self.driver.fail_in_flight(BatcherError("reset_async_queries() dropped this request"))

    # ---- sampling -------------------------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: Any,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """vLLM's own sampling; concurrent calls share one engine batch. Stops at one of
        ``eos_token_ids`` (not included in the result, as in genlm-backend), not on the model's EOS
        otherwise."""
        request = self.request(prompt_token_ids, lora_name)
        max_tokens, eos, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        if max_tokens == 0:
            return []
        return await self.driver.sample(request, max_tokens, tuple(sorted(eos)), temperature, seed)

    # ---- LoRA -----------------------------------------------------------------------------------

    def load_lora(self, path: str, name: str = "lora_1") -> None:
        """Register a LoRA adapter (needs ``enable_lora=True``); it applies per request once active."""
        self.ensure_open()
        if not self.options.enable_lora:
            raise ValueError("this engine was started without enable_lora=True")
        with self.model_lock:
            self.driver.load_lora(name, path)
        self.adapters[name] = path

    def unload_lora(self, name: str) -> None:
        self.driver.remove_lora(name)

    # ---- lifecycle ------------------------------------------------------------------------------

    def clear_backend_cache(self) -> None:
        self.driver.reset_prefix_cache()

    def close_backend(self) -> None:
        self.driver.close(collect=False)  # AsyncLM.cleanup collects right after this


def _cleanup_if_alive(ref: weakref.ref[AsyncVirtualLM]) -> None:
    lm = ref()
    if lm is not None:
        lm.cleanup()  # does nothing if it was closed already
