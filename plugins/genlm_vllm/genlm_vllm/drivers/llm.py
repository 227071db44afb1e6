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

import logging
from collections.abc import Callable, Sequence
from typing import Any

from genlm_core import Request, RowsOut
from genlm_vllm.drivers.base import EngineCall, EngineDriver, EngineOp
from genlm_vllm.drivers.launch import launch
from genlm_vllm.layout import Layout
from genlm_vllm.live import Sessions
from genlm_vllm.options import VLLMOptions
from genlm_vllm.transport.channels import open_channel
from genlm_vllm.vllm_api import client

log = logging.getLogger("genlm_vllm")

#: Each :data:`~genlm_vllm.drivers.base.EngineOp` on a ``vllm.LLM``.
OPS: dict[EngineOp, Callable[..., Any]] = {
    "collective_rpc": client.collective_rpc,
    "remove_lora": client.remove_lora,
    "reset_prefix_cache": client.reset_prefix_cache,
}


class LLMDriver(EngineDriver):
    """A ``vllm.LLM`` engine, driven from one thread at a time (it is not thread-safe)."""

    def __init__(self, llm: Any, options: VLLMOptions, lay: Layout):
        super().__init__(lay, options)
        self.engine = llm
        self.rows = open_channel(
            lay.capture,
            client.vocab_size(llm),
            pop=lambda tags, discard: client.collective_rpc(llm, "genlm_pop_rows", (tags, discard)),
        )
        #: the engine's live sequences (None: each batch is one ``generate``, prefix caching only)
        self.sessions = (
            Sessions(llm, self.rows, self.loras.get, options.live, options.resident_requests)
            if options.sessions_in(lay)
            else None
        )

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> LLMDriver:
        """Start a ``vllm.LLM`` for ``model`` in layout ``lay``."""
        return launch(model, options, lay, client.start_llm, lambda llm: cls(llm, options, lay))

    # ---- the primitives -----------------------------------------------------------------------

    def run(self, calls: Sequence[EngineCall]) -> list[Any]:
        """One ``LLM.generate`` (ends the live sessions first: they would keep it waiting)."""
        self.before_engine_use()
        prompts = [client.prompt(c.token_ids, c.cache_salt) for c in calls]
        loras = [self.loras.get(c.adapter) for c in calls]
        self.batches += 1
        outputs = client.generate(self.engine, prompts, [c.params for c in calls], loras if any(loras) else None)
        return [c.read(out) for c, out in zip(calls, outputs, strict=True)]

    def engine_call(self, op: EngineOp, *args: Any) -> list[Any]:
        return [OPS[op](self.engine, *args)]

    def before_engine_use(self) -> None:
        """End the engine's live sequences (before any other use of the engine)."""
        if self.sessions is not None:
            self.sessions.release_all()

    # ---- rows ---------------------------------------------------------------------------------

    def logits(self, requests: Sequence[Request]) -> RowsOut:
        """As chunks of live sessions (a request whose chunk failed is a ``Failed`` row, the others'
        sessions stay live), or by one plain ``generate``."""
        if self.sessions is None:
            return self.capture(requests)
        self.batches += 1
        try:
            return self.sessions.live.run(requests).rows()
        except BaseException:
            self.before_engine_use()  # a batch that raised leaves nothing alive that a later batch could continue
            raise

    def shutdown(self) -> None:
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
        log.info("removing the engine's Ray placement group: %s: %s", type(exc).__name__, exc)
