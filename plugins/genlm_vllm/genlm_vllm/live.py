"""vLLM's resumable sessions as core's live sequences: an SMC step costs one decode step per particle.

Each row is computed as a chunk of a vLLM *resumable session* (``resumable=True``): when the chunk's
one sampled token is out, the scheduler parks the session with its KV blocks, and the next chunk with
the same request id appends its prompt tokens (the caller's new token) in place of that sampled
token, which is discarded. Which request continues, forks or copies which session, when a parked
session is aborted to make room and what a failed batch or row leaves behind is decided by core's
:class:`~genlm_core.live.LiveSequences`; :class:`SessionEngine` only supplies vLLM's primitives, and
returns the rows of each batch it runs (a failed chunk is a failed row of its request only):

- a sequence is a request id; releasing it aborts the request (its full blocks stay in the prefix cache);
- a copy is a fork: the new session's chunk names its source (:data:`~genlm_vllm.transport.keys.FORK`), and the
  engine copies the source's unfinished last block (:mod:`genlm_vllm.in_engine.forks`) while vLLM's prefix
  cache serves its full blocks, so only copies of a context less its last token are worth making;
- room is an up-front budget: parked sessions hold a scheduler slot and KV blocks that vLLM cannot
  preempt, so one slot and a longest context's worth of KV are kept for everything else.

Every chunk carries its context's length and hash, and the capture processor writes no row for a
chunk whose context in the engine differs: a bookkeeping error becomes a failed row of its request,
never a wrong one. The engine core is driven directly (``add_request`` / ``get_output`` / ``abort_requests``), so
this works wherever the core runs (this process, its own process, with TP/PP or Ray workers).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from genlm_core.live import LiveEngine, LiveOptions, LiveSequences, LiveStats, Piece, Ran
from genlm_core.rows import rows_block
from genlm_vllm.options import MAX_IDLE_BATCHES
from genlm_vllm.transport.channels import RowChannel
from genlm_vllm.transport.keys import AT, CONNECTOR, CONTEXT, FORK, context_fingerprint
from genlm_vllm.vllm_api.client import EngineCore, ResidentCore, chunk_params, resident_params

log = logging.getLogger(__name__)

#: The LoRA request of an adapter name (None: the base model), as vLLM's ``add_request`` takes it.
LoRAOf = Callable[[str | None], Any]


class SessionEngine(LiveEngine[str, torch.Tensor]):
    """The resumable sessions of one ``vllm.LLM`` engine core. A batch's result is its rows
    ``[pieces, width]``, brought back by the row channel (each chunk carries its tag); a chunk that
    vLLM ended early, or whose row is missing, fails only its own piece."""

    copies_any_prefix = False

    def __init__(self, core: EngineCore, rows: RowChannel, lora_of: LoRAOf, resident: ResidentCore | None = None):
        self.core = core
        #: where particles stay running requests between steps (None: every row is a session's chunk)
        self.resident = resident
        self._residents: dict[str, Any] = {}  # a live sequence that is a paused running request -> that request
        self.rows = rows
        self.lora_of = lora_of
        self.token_budget = core.token_budget
        self.max_live = core.max_num_seqs - 1
        self.block_size = core.block_size
        self.kv_budget = core.kv_blocks * core.block_size - core.max_model_len
        #: whether forks copy their source's unfinished block (:mod:`genlm_vllm.in_engine.forks` is plugged in)
        self.forks = core.kv_connector == CONNECTOR
        self._sources: dict[str, str] = {}  # a new session -> the session its chunk forks
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    def take(self) -> str:
        return f"genlm-{self._prefix}-{next(self._ids)}"

    def release(self, seqs: Sequence[str]) -> None:
        for seq in seqs:
            self._sources.pop(seq, None)
            self._residents.pop(seq, None)
        self.core.abort(list(seqs))

    def copy(self, source: str, target: str, length: int) -> bool:
        if self.forks:
            self._sources[target] = source
        return self.forks

    def room(self, sequences: int, tokens: int) -> bool:
        return sequences <= self.max_live and tokens + sequences * self.block_size <= self.kv_budget

    def run(self, pieces: Sequence[Piece[str]], make_room: Callable[[], bool]) -> Ran[torch.Tensor]:
        """Run each piece: a resident request that the piece extends by one token takes that token in
        place of the one vLLM sampled and runs again; every other piece is added as a request (a new
        resident one where it can be, else a session's chunk), its capture tag, context fingerprint,
        fork source and LoRA all from the piece. Step the engine until each has its token, and collect
        the rows."""
        ticket = self.rows.prepare(len(pieces))
        finished = False
        try:
            chunks: dict[str, int] = {}
            resumed: list[Any] = []
            computed = 0
            for piece, extra in zip(pieces, ticket.extra_args, strict=True):
                request = piece.request
                args = {**extra, CONTEXT: context_fingerprint(request.context)}
                chunks[piece.seq] = len(chunks)
                held = None if piece.fresh else self._residents.get(piece.seq)
                if held is not None:
                    if len(piece.new_tokens) == 1 and self._replace(held, piece, args):
                        resumed.append(held)
                        computed += 1
                        continue
                    self.core.abort([piece.seq])  # more than one new token: run the context again, same id
                    del self._residents[piece.seq]
                    tokens = request.token_ids  # vLLM's prefix cache serves its full blocks
                elif piece.fresh:
                    tokens = request.token_ids  # vLLM's prefix cache and the fork serve what is held
                    source = self._sources.pop(piece.seq, None)
                    if source is not None:
                        args[FORK] = source
                else:
                    tokens = piece.new_tokens
                    computed += len(tokens)
                self._add(piece, tokens, args, fresh=held is not None or piece.fresh)
            if resumed:
                assert self.resident is not None
                self.resident.resume(resumed)
            ended, work = self._wait(chunks, sum(len(p.request) for p in pieces))
            rows = self.rows.collect(ticket)
            finished = True
        finally:
            self.rows.release(ticket, finished)
        value, failed = _block(rows, pieces, ended)
        return Ran(value, failed, computed + work[0], work[2], work[1])

    def _add(self, piece: Piece[str], tokens: Sequence[int], args: dict[str, Any], fresh: bool) -> None:
        """Add a piece's request: a resident one (it keeps running, up to the engine's longest context)
        where the engine keeps them and the piece starts a sequence that stays live, else one chunk of a
        resumable session."""
        request = piece.request
        lora = self.lora_of(request.adapter)
        if fresh and piece.keep and self.resident is not None and request.adapter is None:
            params = resident_params(max(1, self.core.max_model_len - len(tokens)), args)
            self.core.add_chunk(piece.seq, tokens, params, lora, resumable=False)
            self._residents[piece.seq] = self.resident.request(piece.seq)
            return
        self.core.add_chunk(piece.seq, tokens, chunk_params(args), lora, resumable=piece.keep)

    def _replace(self, held: Any, piece: Piece[str], args: dict[str, Any]) -> bool:
        """Make the piece's one new token the resident request's next input, and its row wanted."""
        assert self.resident is not None
        wanted = {**args, AT: len(piece.request) - self.resident.prompt_length(held)}
        return self.resident.replace_sampled(held, piece.new_tokens[0], wanted)

    def _wait(self, chunks: dict[str, int], tokens: int) -> tuple[dict[int, BaseException], list[int]]:
        """Step the engine until every chunk has its token, pausing each resident request as soon as
        it has (it must not run again before its program chose its next token). The chunks that ended
        otherwise (aborted or failed in the engine), by piece, and the prefill tokens ``[computed,
        cached, copied]`` of fresh chunks."""
        pending, work = set(chunks), [0, 0, 0]
        ended: dict[int, BaseException] = {}
        idle, patience = 0, tokens // max(self.token_budget, 1) + 64  # steps with no output: prefill chunks
        while pending:
            outputs = self.core.step()
            idle = 0 if outputs else idle + 1
            if idle > patience:
                raise RuntimeError(f"vLLM made no progress on {len(pending)} requests in {idle} engine steps")
            done: set[Any] = set()
            for request_id, finished, sampled, counts in self.core.outcomes(outputs):
                if request_id not in pending:
                    continue
                pending.discard(request_id)
                resident = self._residents.get(request_id)
                if resident is not None:
                    if not finished:
                        done.add(resident)
                    else:  # vLLM finished it (the engine's longest context, or an error): it holds nothing
                        del self._residents[request_id]
                if not sampled:  # aborted or failed in the engine
                    ended[chunks[request_id]] = RuntimeError(f"vLLM ended request {request_id} early")
                if counts is not None:
                    work = [a + b for a, b in zip(work, counts, strict=True)]
            if done:
                assert self.resident is not None
                self.resident.pause(done)
        return ended, work


def _block(
    rows: Sequence[torch.Tensor | None], pieces: Sequence[Piece[str]], ended: dict[int, BaseException]
) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """The batch's rows as one block (without a copy where they are one already), and the failed
    pieces: those vLLM ended early, and those whose row is missing (the capture processor writes no
    row for a chunk whose context differs from its fingerprint). A failed piece's place in the block
    holds NaN; :meth:`~genlm_core.live.Ran.rows` puts a :class:`~genlm_core.rows.Failed` there."""
    failed = dict(ended)
    for i, row in enumerate(rows):
        if row is None and i not in failed:
            context = pieces[i].request.context
            failed[i] = RuntimeError(
                f"vLLM returned no logits for 1 of {len(rows)} requests (a context of {len(context)} tokens "
                f"ending {list(context.take(range(max(0, len(context) - 5), len(context))))})"
            )
    if not failed:
        return rows_block(rows), failed  # type: ignore[arg-type]
    good = next((row for i, row in enumerate(rows) if row is not None and i not in failed), None)
    if good is None:
        return torch.full((len(rows), 0), float("nan")), failed
    nan = torch.full_like(good, float("nan"))
    return torch.stack([nan if i in failed or row is None else row for i, row in enumerate(rows)]), failed


class Sessions:
    """Live sequences of one ``vllm.LLM`` engine, continued across batches of requests."""

    def __init__(
        self,
        llm: Any,
        rows: RowChannel,
        lora_of: LoRAOf,
        options: LiveOptions | None = None,
        resident: bool = True,
    ):
        core, why = ResidentCore.of(llm) if resident else (None, "resident_requests=False")
        #: why particles are not running requests ("" where they are), as logged once here
        self.not_resident = why
        if core is None and resident:
            log.info("genlm-vllm: particles continue as vLLM sessions, not running requests: %s", why)
        self.engine = SessionEngine(EngineCore.of(llm), rows, lora_of, core)
        self.core = self.engine.core
        self.live: LiveSequences[str, torch.Tensor] = LiveSequences(
            self.engine, options or LiveOptions.model_validate({"max_idle_batches": MAX_IDLE_BATCHES})
        )

    @property
    def stats(self) -> LiveStats:
        return self.live.stats

    def release_all(self) -> None:
        """Abort every live session (before anything else uses the engine: a parked session keeps
        ``LLM.generate`` from ever seeing an idle engine)."""
        self.live.release_all()
