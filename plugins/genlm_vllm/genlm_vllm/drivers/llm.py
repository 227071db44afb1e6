"""``vllm.LLM`` behind the driver interface: in-process, multiprocess, tensor/pipeline parallel, Ray.

A batch of requests becomes one row-sized chunk per request of the engine's resumable sessions
(:mod:`genlm_vllm.live`): a request that extends a context of the previous batch continues that
sequence in the engine, computing only its new tokens, and the session engine returns the batch's rows
as core's live path asks (a request whose chunk failed is a failed row, its own). With
``live={'enabled': False}`` a batch is one plain ``generate`` (prefix caching only). Either way the
capture processor (:mod:`genlm_vllm.in_engine.capture`) copies each request's logits by tag wherever the model
runs, and the row channel (:mod:`genlm_vllm.transport.channels`) brings them back.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from genlm_core import AutoBatcher, Request, RowsOut
from genlm_vllm.drivers.base import EngineDriver
from genlm_vllm.drivers.launch import launch
from genlm_vllm.layout import Layout
from genlm_vllm.live import Sessions
from genlm_vllm.options import VLLMOptions
from genlm_vllm.transport.channels import open_channel, stack
from genlm_vllm.vllm_api import client, release

#: One ``sample`` call: (request, max_tokens, eos ids, temperature, seed).
SampleCall = tuple[Request, int, tuple[int, ...], float, "int | None"]


class LLMDriver(EngineDriver):
    """A ``vllm.LLM`` engine, driven from one thread at a time (it is not thread-safe)."""

    def __init__(self, llm: Any, options: VLLMOptions, lay: Layout):
        super().__init__(lay)
        self.engine = llm
        self.rows = open_channel(
            lay.capture,
            client.vocab_size(llm),
            pop=lambda tags, discard: client.collective_rpc(llm, "genlm_pop_rows", (tags, discard)),
        )
        self.loras = client.LoRARequests()
        #: the engine's live sequences (None: each batch is one ``generate``, prefix caching only)
        self.sessions = (
            Sessions(llm, self.rows, self.loras.get, options.live, options.resident_requests)
            if options.sessions_in(lay)
            else None
        )
        self.sampler: AutoBatcher[SampleCall, list[int]] = AutoBatcher(
            self._sample_batch,
            batch_size=options.batch_size,
            timeout=options.timeout,
            run_in_thread=True,
            flush=options.flush,
            name="vllm-sample",
        )

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> LLMDriver:
        """Start a ``vllm.LLM`` for ``model`` in layout ``lay``."""
        return launch(model, options, lay, client.start_llm, lambda llm: cls(llm, options, lay))

    # ---- rows ---------------------------------------------------------------------------------

    def logits(self, requests: Sequence[Request]) -> RowsOut:
        """As chunks of live sessions (a request whose chunk failed is a ``Failed`` row, the others'
        sessions stay live), or by one plain ``generate``."""
        if self.sessions is None:
            return self.capture(requests)
        self.batches += 1
        try:
            return self.sessions.run(requests).rows()
        except BaseException:
            self.release_sessions()  # a batch that raised leaves nothing alive that a later batch could continue
            raise

    def uncached_logits(self, request: Request) -> torch.Tensor:
        return self.capture([request], cache_salt=uuid.uuid4().hex)[0]

    def capture(self, requests: Sequence[Request], cache_salt: str | None = None) -> torch.Tensor:
        """Logits of each request by a plain ``generate``, captured in the engine (with
        ``cache_salt``: sharing no cached block with other requests)."""
        assert self.rows is not None
        ticket = self.rows.prepare(len(requests))
        finished = False
        try:
            params = [client.row_params(a) for a in ticket.extra_args]
            self.generate([r.token_ids for r in requests], params, [r.adapter for r in requests], cache_salt)
            rows = self.rows.collect(ticket)
            finished = True
            return stack(rows, requests)
        finally:
            self.rows.release(ticket, finished)

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: list[Any],
        adapters: Iterable[str | None],
        cache_salt: str | None = None,
    ) -> Any:
        """One plain ``LLM.generate`` (ends the live sessions first: they would keep it waiting)."""
        self.release_sessions()
        prompts = [client.prompt(c, cache_salt) for c in contexts]
        loras = [self.loras.get(a) for a in adapters]
        self.batches += 1
        return client.generate(self.engine, prompts, params, loras if any(loras) else None)

    def release_sessions(self) -> None:
        """End the engine's live sequences (before any other use of the engine)."""
        if self.sessions is not None:
            self.sessions.release_all()

    # ---- sampling and the rest ----------------------------------------------------------------

    async def sample(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """Concurrent calls share one ``generate``."""
        return await self.sampler.submit(object(), (request, max_tokens, eos, temperature, seed))

    def _sample_batch(self, calls: list[SampleCall]) -> list[list[int]]:
        params = [client.sample_params(*call[1:]) for call in calls]
        with self.lock:
            outputs = self.generate([r.token_ids for r, *_ in calls], params, [r.adapter for r, *_ in calls])
        return [client.sampled_tokens(out, call[2]) for call, out in zip(calls, outputs)]

    def top_logprobs(self, contexts: Sequence[Sequence[int]], k: int) -> list[dict[int, float]]:
        params = [client.top_params(k) for _ in contexts]
        with self.lock:
            outputs = self.generate(contexts, params, [None] * len(contexts))
        return [client.first_token_logprobs(out) for out in outputs]

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        return client.collective_rpc(self.engine, method, args)

    def load_lora(self, name: str, path: str) -> None:
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.release_sessions()
        client.remove_lora(self.engine, self.loras.pop_id(name))

    def reset_prefix_cache(self) -> None:
        self.release_sessions()  # parked sessions hold blocks: the prefix cache cannot be reset under them
        client.reset_prefix_cache(self.engine)

    def shutdown(self) -> None:
        self.sampler.close()
        llm, self.engine = self.engine, None
        self.sessions = None  # it holds the engine core (and, with Ray, its mapped queues)
        # vLLM's Ray executor leaves the placement group it made for an in-process engine
        group = client.placement_group(llm) if self.layout.ray and not self.layout.multiprocess else None
        try:
            client.shutdown_llm(llm)
        finally:
            if group is not None:
                remove_placement_group(group)


def remove_placement_group(group: Any) -> None:
    """Remove a Ray placement group (logged, not raised, if Ray has already let it go)."""
    import ray

    try:
        ray.util.remove_placement_group(group)
    except Exception as exc:
        release.log.info("removing the engine's Ray placement group: %s: %s", type(exc).__name__, exc)
