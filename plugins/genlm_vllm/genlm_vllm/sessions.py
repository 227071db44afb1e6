"""Particles that stay alive in the engine: an SMC step costs one decode step per particle.

A particle program asks for the row after ``ids``, draws ``t``, and asks for ``ids + [t]``. Submitted
as a new request, ``ids + [t]`` would be computed again from its last cached block. Instead each row
is computed as a chunk of a vLLM *resumable session* (``resumable=True``): when the chunk's one
sampled token is out, the scheduler parks the session with its KV blocks, and the next chunk with
the same request id appends its prompt tokens (here: the caller's ``t``) in place of that sampled
token, which is discarded. The continuation computes exactly the new tokens.

Who continues what is decided by core's :class:`~genlm_core.lineage.LiveContexts` on exact token
tuples: a live session is continued by at most one request of a later batch; other requests with
the same parent (forks after resampling) start sessions of their own whose full blocks come from
vLLM's prefix cache and whose unfinished last block is copied from the parent's in the engine
(:mod:`genlm_vllm.forks`), so they too compute only their new token; a sibling that comes in a later
batch than the one continuing the parent forks the session that moved past its context (it still
holds that context's KV). A session nobody continued
stays parked for :data:`MAX_IDLE_BATCHES` batches (a step's particles may come in several batches:
the ``"eager"`` flush policy, or a program that awaits something else first), or until its slot or
KV is needed; then it is aborted (its full blocks stay in the prefix cache). Every chunk also carries its context's
length and hash, and the capture processor writes no row for a chunk whose context in the engine
differs: a bookkeeping error becomes a missing-row error, never a wrong row.

The engine core is driven directly (``add_request`` / ``get_output`` / ``abort_requests``), so this
works wherever the core runs (this process, its own process, with TP/PP or Ray workers). vLLM's
output processor is bypassed: rows come back through the capture channel, and in-process it would
share the session's prompt list with the scheduler and extend it twice.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from genlm_core import Request
from genlm_core.lineage import Continuation, LineageKey, LiveContexts, nearest_prefix
from genlm_vllm.capture import CONTEXT, context_fingerprint
from genlm_vllm.forks import CONNECTOR, FORK
from genlm_vllm.vllm_api import EngineCore, SamplingParams, prefill_counts

#: Batches in a row a parked session may go unclaimed before it is aborted.
MAX_IDLE_BATCHES = 4


@dataclass
class SessionStats:
    """What the sessions computed: rows, how many continued a live session, and prompt tokens by
    where their KV came from."""

    batches: int = 0
    rows: int = 0
    continued: int = 0
    tokens_computed: int = 0  #: tokens the model ran (continuations' new tokens, fresh prompts' uncached part)
    tokens_cached: int = 0  #: fresh prompts' tokens served by vLLM's prefix cache
    tokens_copied: int = 0  #: forks' tokens copied from their parent's unfinished block (:mod:`genlm_vllm.forks`)


class Sessions:
    """Live sequences of one ``vllm.LLM`` engine, continued across batches of requests."""

    def __init__(self, llm: Any, lookback: int = 1):
        self.core = core = EngineCore.of(llm)
        self.live: LiveContexts[str] = LiveContexts(lookback, keep_unclaimed=True, max_idle_batches=MAX_IDLE_BATCHES)
        #: per recent batch: context -> the session that continued past it (a fork source for later siblings)
        self.moved: deque[dict[LineageKey, str]] = deque(maxlen=MAX_IDLE_BATCHES)
        self.lookback = lookback
        self.stats = SessionStats()
        self.token_budget = core.token_budget
        # Parked sessions hold a scheduler slot and KV blocks that vLLM cannot preempt. Keep one slot
        # and a longest context's worth of KV for everything else, so that the scheduler never waits
        # on parked sessions for ever.
        self.max_live = core.max_num_seqs - 1
        self.block_size = core.block_size
        self.kv_budget = core.kv_blocks * core.block_size - core.max_model_len
        #: whether forks copy their parent's unfinished block (:mod:`genlm_vllm.forks` is plugged in)
        self.forks = core.kv_connector == CONNECTOR
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    def run(self, requests: Sequence[Request], extra_args: Sequence[dict[str, Any]], loras: Sequence[Any]) -> None:
        """Compute one row per request (captured by its ``extra_args``' tag), continuing live
        sessions where a request extends one; on return the batch's sessions are the live ones."""
        plan, released = self.live.plan(requests)
        moved: dict[LineageKey, str] = {}
        for request, c in zip(requests, plan, strict=True):
            if c is not None and not c.fork:
                moved[request.prefix(len(request.token_ids) - len(c.new_tokens))] = c.handle
        released += self._make_room(requests)
        self.core.abort(released)
        self.stats.batches += 1
        chunks: dict[str, int] = {}  # request id -> index in the batch
        resumable: list[bool] = []
        try:
            self._submit(requests, plan, extra_args, loras, chunks, resumable)
            failed = self._wait(chunks, sum(len(r.token_ids) for r in requests))
        except BaseException:  # nothing of this batch may stay parked in the engine
            self.core.abort([*chunks, *(c.handle for c in plan if c is not None)])
            self.core.abort(self.live.release_all())
            self.moved.clear()
            raise
        self.stats.rows += len(requests)
        self.moved.append(moved)
        self.core.abort([rid for rid, i in chunks.items() if resumable[i] and rid in failed])
        for rid, i in chunks.items():
            if resumable[i] and rid not in failed:
                before = self.live.keep(requests[i], rid)
                if before is not None:
                    self.core.abort([before])

    def _moved_past(self, request: Request) -> str | None:
        """A session of a recent batch that continued past a context ``request`` extends (its sibling's),
        newest first; the fork connector checks that it still holds exactly that context."""

        def lookup(key: Request) -> str | None:
            return next((batch[key] for batch in reversed(self.moved) if key in batch), None)

        hit = nearest_prefix(lookup, request, self.lookback, shortest_cut=1)
        return None if hit is None else hit[1]

    def _make_room(self, requests: Sequence[Request]) -> list[str]:
        """The parked sessions (those :meth:`LiveContexts.plan` left live: nobody continued them) to abort,
        oldest first, so that this batch's chunks find a scheduler slot and KV each beside those that stay."""
        slots = self.max_live - len(requests)
        kv = self.kv_budget - sum(len(r.token_ids) + self.block_size for r in requests)
        sizes = [len(live.token_ids) for live in self.live.contexts()]  # oldest first, as evict() goes
        parked, held = len(sizes), sum(sizes)
        evicted = []
        for size in sizes:
            if parked <= slots and held <= kv:
                break
            victim = self.live.evict()
            assert victim is not None  # sizes came from the live sessions
            evicted.append(victim)
            parked, held = parked - 1, held - size
        return evicted

    def _submit(
        self,
        requests: Sequence[Request],
        plan: Sequence[Continuation[str] | None],
        extra_args: Sequence[dict[str, Any]],
        loras: Sequence[Any],
        chunks: dict[str, int],
        resumable: list[bool],
    ) -> None:
        """Add one chunk per request to the engine (filling ``chunks`` and ``resumable`` as it goes)."""
        held = sum(len(live.token_ids) for live in self.live.contexts())  # KV of the sessions that stay parked
        live_slots, kv_left = self.max_live - len(self.live), self.kv_budget - held
        for i, (request, continuation) in enumerate(zip(requests, plan, strict=True)):
            kv = len(request.token_ids) + self.block_size
            args = {**extra_args[i], CONTEXT: context_fingerprint(request.token_ids)}
            if continuation is not None and not continuation.fork:
                rid, tokens, keep = continuation.handle, continuation.new_tokens, True
                self.stats.continued += 1
                self.stats.tokens_computed += len(tokens)
            else:
                rid, tokens = f"genlm-{self._prefix}-{next(self._ids)}", request.token_ids
                keep = live_slots > 0 and kv <= kv_left
                parent = continuation.handle if continuation is not None else self._moved_past(request)
                if parent is not None and self.forks:
                    args[FORK] = parent  # share the parent's unfinished block
            if keep:
                live_slots, kv_left = live_slots - 1, kv_left - kv
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=args)
            self.core.add_chunk(rid, tokens, params, loras[i], resumable=keep)
            chunks[rid] = i
            resumable.append(keep)

    def _wait(self, chunks: dict[str, int], tokens: int) -> set[str]:
        """Step the engine until every chunk has its token; the ids of chunks that ended otherwise
        (their rows are missing, and the caller's error names them)."""
        pending, failed = set(chunks), set()
        idle, patience = 0, tokens // max(self.token_budget, 1) + 64  # steps with no output: prefill chunks
        while pending:
            outputs = self.core.step()
            idle = 0 if outputs else idle + 1
            if idle > patience:
                raise RuntimeError(f"vLLM made no progress on {len(pending)} requests in {idle} engine steps")
            for out in outputs:
                if out.request_id not in pending:
                    continue
                if not out.new_token_ids:  # aborted or failed in the engine
                    failed.add(out.request_id)
                pending.discard(out.request_id)
                counts = prefill_counts(out)
                if counts is not None:
                    self.stats.tokens_computed += counts[0]
                    self.stats.tokens_cached += counts[1]
                    self.stats.tokens_copied += counts[2]
        return failed

    def release_all(self) -> None:
        """Abort every live session (before anything else uses the engine: a parked session keeps
        ``LLM.generate`` from ever seeing an idle engine)."""
        self.core.abort(self.live.release_all())
        self.moved.clear()
