"""The AsyncLM protocol and the base class every backend builds on.

A backend implements :meth:`AsyncLM.forward_batch` (logits for a batch of contexts) and model
loading; validation, batching, deduplication, the output cache, float32 normalisation and the
sampling loop are done here, once, for every backend.
"""

from __future__ import annotations

import abc
import asyncio
import gc
import logging
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import torch

from genlm_core.batching import AutoBatcher
from genlm_core.cache import OutputCache
from genlm_core.closing import CLOSED, Closed
from genlm_core.config import BackendOptions
from genlm_core.context import Context
from genlm_core.errors import BatcherError, ClosedError
from genlm_core.inflight import InFlight
from genlm_core.request import ContextChecker, Request
from genlm_core.rows import Failed, RowMemory, RowsOut, nan_rows, normalise, rows_block
from genlm_core.tokenization import Token, Tokenizer, decode_vocabulary
from genlm_core.validation import (
    check_int,
    check_seed,
    check_temperature,
    check_token_id_set,
)

TokenIds = Sequence[int] | Context | np.ndarray | torch.Tensor

log = logging.getLogger(__name__)


def logits_to_logprobs(logits: torch.Tensor, vocab_size: int, missing_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Raw logits ``[..., W]`` (any float dtype, ``W >= vocab_size``) to float32 logprobs ``[..., vocab_size]``.

    Columns past ``vocab_size`` (padded model vocabularies) are dropped before normalising; ids in
    ``missing_ids`` get ``-inf``. The result sums to one in probability space, in float32.
    """
    return normalise(logits, vocab_size, missing_ids)


class AsyncLM(abc.ABC):
    """A language model that answers next-token distributions, batched automatically.

    Every logprob vector is 1-D, float32, normalised, with exactly ``len(byte_vocab)`` entries.
    Returned tensors are shared with the output cache: treat them as read-only.

    Every argument is checked before any model work: a bad one raises ``TypeError`` or
    ``ValueError`` naming it. After :meth:`cleanup`, every call raises
    :class:`~genlm_core.errors.ClosedError`.
    """

    #: Most tokens a context may have (the model's position limit), or None for no fixed limit.
    #: A backend whose model cannot go past a length (learned absolute positions) sets it.
    context_limit: int | None = None

    #: The backend's options model: :meth:`from_name` keywords and constructor keywords are
    #: validated by it. A backend sets its own :class:`~genlm_core.BackendOptions` subclass.
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(
        self,
        tokenizer: Tokenizer,
        options: BackendOptions | None = None,
        *,
        cache_to_cpu: bool = False,
        run_in_thread: bool = True,
        **option_values: Any,
    ):
        """``options``: validated options (an instance of :attr:`Options`), or give them as keywords
        (``batch_size=64, timeout=0.0, ...``), validated here. Either way they are ``self.options``."""
        self.options = o = self.make_options(options, option_values)
        self.tokenizer = tokenizer
        vocab = decode_vocabulary(tokenizer)
        self.byte_vocab: list[Token] = vocab.byte_vocab
        self.str_vocab: list[str] = vocab.str_vocab
        self.vocab_size = len(self.byte_vocab)
        self._missing_ids = torch.tensor(vocab.missing_ids, dtype=torch.long) if vocab.missing_ids else None
        #: Checks and snapshots contexts (see :class:`~genlm_core.request.ContextChecker`).
        self.contexts = ContextChecker(self.vocab_size)
        #: Host memory for rows, reused across batches (see :meth:`finish_rows`).
        self.row_memory = RowMemory()
        self.cache = OutputCache(o.cache_size, o.cache_bytes, move_to_cpu=cache_to_cpu)
        self.batcher: AutoBatcher[Request, torch.Tensor] = AutoBatcher(
            self.compute_rows,
            batch_size=o.batch_size,
            timeout=o.timeout,
            run_in_thread=run_in_thread,
            name=type(self).__name__,
            flush=o.flush,
        )
        #: Streamed requests in flight (backends that :attr:`streams`): equal ones share one
        #: :meth:`forward_stream`, cancelled when its last caller is.
        self.in_flight: InFlight[Request, torch.Tensor] = InFlight()
        #: Serialises model work: the batcher's thread, synchronous callers and a backend's own
        #: engine calls (sampling, adapter loading) never overlap. Reentrant.
        self.model_lock = threading.RLock()
        self._closed = False

    @classmethod
    def make_options(cls, options: BackendOptions | None, values: dict[str, Any]) -> Any:
        """``options`` if given (then no keyword options may be), else ``cls.Options(**values)``;
        raises OptionsError naming a bad option."""
        if options is None:
            return cls.Options(**values)
        if values:
            raise TypeError(f"{cls.__name__}: give options or keyword options, not both (got {sorted(values)})")
        if not isinstance(options, cls.Options):
            raise TypeError(f"{cls.__name__}: options must be {cls.Options.__name__}, got {type(options).__name__}")
        return options

    @classmethod
    def from_name(cls, model_name: str, /, **option_values: Any) -> Self:
        """Load ``model_name`` with options given as keywords (validated by :attr:`Options`)."""
        return cls.from_options(model_name, cls.Options(**option_values))

    @classmethod
    def from_options(cls, model_name: str, options: Any, /) -> Self:
        """Load ``model_name`` with validated options: the factory a backend registers
        (``"package.module:Class.from_options"``). Every backend implements it."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_options")

    # ---- what a backend implements ---------------------------------------------------------

    #: :meth:`forward_batch` (and :meth:`forward_stream`) return float32 logprobs already normalised
    #: over the first ``vocab_size`` columns (an engine that normalises where it computes): they are
    #: used as they are. A backend whose answer changes at run time makes it a property.
    rows_normalised: bool = False

    #: The backend streams rows: each request goes to :meth:`forward_stream` as it comes, with no
    #: batch barrier (an engine with its own continuous batching). The batcher is not used for rows.
    streams: bool = False

    @abc.abstractmethod
    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        """Next-token logits for each request: ``[len(requests), W]`` with ``W >= vocab_size``, or
        a sequence of ``len(requests)`` rows ``[W]`` in which a row that could not be computed is a
        :class:`~genlm_core.rows.Failed` (its request alone fails; the others are answered).

        Any float dtype and device. Called with validated, distinct requests, under a lock.
        """

    async def forward_stream(self, request: Request) -> torch.Tensor:
        """Logits ``[W]`` of one request, computed as it comes (backends with :attr:`streams`).
        Called outside :attr:`model_lock`: the engine serialises its own work."""
        raise NotImplementedError(f"{type(self).__name__} sets streams but does not implement forward_stream")

    def forward_uncached(self, request: Request) -> torch.Tensor:
        """Logits ``[W]`` of one request from a plain forward pass with no reused state. The default
        runs :meth:`forward_batch` on it alone; backends with KV reuse override it."""
        row = self.forward_batch([request])[0]
        if isinstance(row, Failed):
            raise row.error
        return row

    def clear_backend_cache(self) -> None:  # noqa: B027 - optional hook, nothing to drop by default
        """Drop backend-held state such as KV caches (called by :meth:`clear_cache`)."""

    def close_backend(self) -> None:  # noqa: B027 - optional hook
        """Release the model and its memory (called by :meth:`cleanup`)."""

    @property
    def active_adapter(self) -> str | None:
        """Name of the active LoRA adapter; part of every cache key. ``None`` without adapters."""
        return None

    def adapter_for(self, lora_name: str | None) -> str | None:
        """The adapter a request runs with: ``lora_name`` when given (it must be loaded), else
        :attr:`active_adapter`. A backend without adapters refuses any name."""
        if lora_name is None:
            return self.active_adapter
        raise ValueError(f"{type(self).__name__} has no LoRA adapters; lora_name={lora_name!r} cannot be used")

    # ---- the protocol ------------------------------------------------------------------------

    def ensure_open(self) -> None:
        """Raise :class:`~genlm_core.errors.ClosedError` if :meth:`cleanup` has closed this model."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} was closed by cleanup(); load the model again to use it")

    def request(self, token_ids: TokenIds, lora_name: str | None = None) -> Request:
        """Validate ``token_ids`` and make the request (and cache key) for it: a snapshot, so later
        changes to the caller's list or array do not change it. ``lora_name`` picks a loaded LoRA
        adapter for this request (None: the active adapter, or the base model).

        Raises TypeError for what is not a sequence of integer ids (sets, strings, bools, floats),
        ValueError for an empty context, an id outside ``[0, len(byte_vocab))``, or a context
        longer than :attr:`context_limit`.
        """
        self.ensure_open()
        request = self.contexts.request(token_ids, self.adapter_for(lora_name))
        if self.context_limit is not None and len(request) > self.context_limit:  # len: no tuple made
            raise ValueError(
                f"token_ids has {len(request)} tokens, more than this model's limit of {self.context_limit} positions"
            )
        return request

    def context(self, token_ids: TokenIds | Context = ()) -> Context:
        """A :class:`~genlm_core.context.Context` handle of ``token_ids`` (default: empty), checked
        against this model's vocabulary once, here. Extend it with ``ctx.extend(token)`` or
        ``ctx + [tokens]`` (only new ids are checked) and pass it wherever token ids go: a request
        of a handle reads none of its ids again, and finds the context it extends directly.

        Raises TypeError/ValueError as :meth:`request` does (an empty context is allowed here)."""
        if isinstance(token_ids, (list, tuple, Context)) and not token_ids:
            self.ensure_open()
            return Context((), self.vocab_size)
        return self.request(token_ids).context  # checked as any request's ids (a handle of ours: as it is)

    async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids``, batched with concurrent calls."""
        request = self.request(token_ids, lora_name)
        return await self.request_logprobs(request)

    async def request_logprobs(self, request: Request) -> torch.Tensor:
        """The row of a request made by :meth:`request`: from the output cache, else batched (or
        streamed, for a backend that :attr:`streams`)."""
        cached = self.cache.get(request)
        if cached is not None:
            return cached
        if not self.streams:
            return await self.batcher.submit(request, request)
        self.ensure_open()
        loop = asyncio.get_running_loop()
        return await self.in_flight.run(
            request, lambda: asyncio.run_coroutine_threadsafe(self._streamed_row(request), loop)
        )

    async def _streamed_row(self, request: Request) -> torch.Tensor:
        """One streamed request's row, checked and cached (once for every caller of the request)."""
        row = self.finish_rows([request], [await self.forward_stream(request)])[0]
        if isinstance(row, Failed):
            raise row.error
        return row

    def cached_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor | None:
        """The row of ``token_ids`` if the output cache holds it, else None; computes nothing. For
        callers that plan work around what is already known (the byte beam's prefetch)."""
        return self.cache.get(self.request(token_ids, lora_name))

    def cached_row(self, request: Request) -> torch.Tensor | None:
        """:meth:`cached_logprobs` of a request made by :meth:`request`."""
        return self.cache.get(request)

    def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Synchronous :meth:`next_token_logprobs` (computed directly, sharing caches and the lock)."""
        return self._rows_sync([token_ids], lora_name)[0]

    async def batch_next_token_logprobs(
        self, token_ids_list: Iterable[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Logprobs for several contexts at once, ``[len(token_ids_list), vocab_size]``: a program's
        whole step in one submission (one future, not one per context). Contexts the output cache
        holds are not computed again; equal contexts are computed once. Where the rows were computed
        together, in order, the result is their block as computed (on the model's device where the
        backend keeps rows there), not a copy: treat it as read-only."""
        requests = [self.request(ids, lora_name) for ids in _iterable(token_ids_list, "token_ids_list")]
        return await self.requests_logprobs(requests)

    async def requests_logprobs(self, requests: Sequence[Request]) -> torch.Tensor:
        """:meth:`batch_next_token_logprobs` of requests made by :meth:`request`."""
        if not requests:
            return self._stack([])
        if self.streams:
            return self._stack(list(await asyncio.gather(*(self.request_logprobs(r) for r in requests))))
        rows: list[torch.Tensor | None] = self.cache.get_many(requests)
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            todo = requests if len(missing) == len(requests) else [requests[i] for i in missing]
            for i, row in zip(missing, await self.batcher.submit_many(todo, todo), strict=True):
                rows[i] = row
        return rows_block(rows, self.row_memory)  # type: ignore[arg-type]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Iterable[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous :meth:`batch_next_token_logprobs`, in chunks of the batch size."""
        return self._stack(self._rows_sync(token_ids_list, lora_name))

    def next_token_logprobs_uncached(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """The row of ``token_ids`` computed now, alone, by :meth:`forward_uncached`: no output cache,
        no batcher, no KV reuse. A reference for checking the cached paths, and what genlm-backend's
        method of this name does."""
        request = self.request(token_ids, lora_name)
        with self.model_lock:
            logits = self.forward_uncached(request)
        row = normalise(logits.reshape(1, -1), self.vocab_size, self._missing_ids)[0]
        if nan_rows(row[None])[0]:
            raise FloatingPointError(
                f"{type(self).__name__} produced NaN logits for context of {len(token_ids)} tokens"
            )
        return row

    def reset_async_queries(self) -> None:
        """Fail every request still waiting in the batcher, or streaming (genlm-backend's name): use it
        after an exception stopped an inference program halfway, so no stale request runs later. The
        waiters get :class:`~genlm_core.errors.BatcherError`; the model stays usable."""
        self.ensure_open()
        self.batcher.reset()
        self.in_flight.fail_all(BatcherError("reset_async_queries() dropped this request"))

    def clear_kv_cache(self) -> None:
        """Drop the backend's KV / prefix caches but keep the output cache (genlm-backend's name)."""
        self.ensure_open()
        with self.model_lock:
            self.clear_backend_cache()

    def _rows_sync(self, token_ids_list: Iterable[TokenIds], lora_name: str | None = None) -> list[torch.Tensor]:
        requests = [self.request(ids, lora_name) for ids in _iterable(token_ids_list, "token_ids_list")]
        found: dict[Request, torch.Tensor] = {}
        todo = []
        for r in requests:
            if r not in found:
                found[r] = self.cache.get(r)
                if found[r] is None:
                    todo.append(r)
        size = self.batcher.batch_size
        for start in range(0, len(todo), size):
            chunk = todo[start : start + size]
            for r, row in zip(chunk, self.compute_rows(chunk)):
                if isinstance(row, Failed):
                    raise row.error
                found[r] = row
        return [found[r] for r in requests]

    def _stack(self, rows: list[torch.Tensor]) -> torch.Tensor:
        if not rows:
            return torch.empty((0, self.vocab_size), dtype=torch.float32)
        return rows_block(rows, self.row_memory)

    def compute_rows(self, requests: list[Request]) -> list[torch.Tensor | Failed]:
        """Run :meth:`forward_batch` on distinct, validated requests (from :meth:`request`), under
        :attr:`model_lock`; normalise, check and cache each row. One row, or a :class:`Failed`, per
        request. The batcher calls it; a backend may too (e.g. to fill the cache ahead of time)."""
        with self.model_lock:
            out = self.forward_batch(requests)
        return self.finish_rows(requests, out)

    def finish_rows(
        self,
        requests: Sequence[Request],
        out: RowsOut,
        normalised: bool | None = None,
    ) -> list[torch.Tensor | Failed]:
        """Turn backend logits for ``requests`` into rows: normalise, check for NaN, cache. Used by
        :meth:`compute_rows`, and by backends that compute rows outside the batcher (streaming engines).

        One pass over the rows: the log-softmax is written into host memory reused across batches
        (:class:`~genlm_core.rows.RowMemory`), or where the logits are (an accelerator's rows stay
        on it), and the rows handed out are views of that block, not copies. ``normalised``: ``out``
        already holds float32 logprobs over the first ``vocab_size`` columns (an engine that
        normalised where it computed them); they are used as they are, unless this vocabulary has
        ids the tokenizer does not cover (then they are normalised again, without those ids); None:
        :attr:`rows_normalised`. A :class:`~genlm_core.rows.Failed` in ``out`` fails its request
        alone."""
        if normalised is None:
            normalised = self.rows_normalised
        if not isinstance(out, torch.Tensor):
            if len(out) != len(requests):
                raise RuntimeError(
                    f"{type(self).__name__}.forward_batch returned {len(out)} rows for {len(requests)} requests"
                )
            done = [i for i, row in enumerate(out) if not isinstance(row, Failed)]
            if len(done) < len(out):
                rows: list[torch.Tensor | Failed] = list(out)
                if done:
                    finished = self.finish_rows([requests[i] for i in done], [out[i] for i in done], normalised)
                    for i, row in zip(done, finished, strict=True):
                        rows[i] = row
                return rows
        logits = out if isinstance(out, torch.Tensor) else torch.stack(list(out))  # type: ignore[arg-type]
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise RuntimeError(
                f"{type(self).__name__}.forward_batch returned shape {tuple(logits.shape)} for {len(requests)} requests"
            )
        if normalised and self._missing_ids is None and logits.dtype == torch.float32:
            if logits.shape[-1] < self.vocab_size:
                raise ValueError(
                    f"model returned {logits.shape[-1]} logprobs, fewer than the vocabulary's {self.vocab_size}"
                )
            logprobs = logits[:, : self.vocab_size]
        else:
            memory = self.row_memory.take(len(requests), self.vocab_size, logits.device)
            logprobs = normalise(logits, self.vocab_size, self._missing_ids, out=memory)
        bad = nan_rows(logprobs)
        rows = list(logprobs)
        if any(bad):
            for i, r in enumerate(requests):
                if bad[i]:
                    rows[i] = Failed(
                        FloatingPointError(f"{type(self).__name__} produced NaN logits for context of {len(r)} tokens")
                    )
            good = [i for i in range(len(requests)) if not bad[i]]
            for i, row in zip(good, self.cache.put_many([requests[i] for i in good], [rows[i] for i in good])):
                rows[i] = row
            return rows
        return self.cache.put_many(requests, rows)

    # ---- sampling ------------------------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Sample up to ``max_tokens`` tokens after the prompt, stopping at one of ``eos_token_ids``.

        Returns the generated ids; the EOS that stopped it is not included (as in genlm-backend).
        ``temperature=0`` is greedy. Concurrent calls are batched step by step through the same batcher.
        """
        request = self.request(prompt_token_ids, lora_name)
        max_tokens, eos, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        generator = torch.Generator().manual_seed(random.getrandbits(63) if seed is None else seed)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.request_logprobs(request)
            token = sample_token(logprobs, temperature, generator)
            if token in eos:
                break
            generated.append(token)
            request = self.request(request.context.extend(token), lora_name)
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Iterable[TokenIds],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` for several prompts concurrently; prompt ``i`` uses seed ``seed + i``
        (modulo ``2**63``), so equal prompts give independent samples. (genlm-backend gives every
        prompt the same seed; ``genlm_compat.wrap`` keeps that.)"""
        prompts = [
            self.request(p, lora_name).token_ids for p in _iterable(prompt_token_ids_list, "prompt_token_ids_list")
        ]
        max_tokens, eos_set, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        eos = sorted(eos_set)
        return list(
            await asyncio.gather(
                *(
                    self.sample(
                        p, max_tokens, eos, temperature, None if seed is None else (seed + i) % 2**63, lora_name
                    )
                    for i, p in enumerate(prompts)
                )
            )
        )

    def check_sampling(
        self, max_tokens: Any, eos_token_ids: Any, temperature: Any, seed: Any = None
    ) -> tuple[int, set[int], float, int | None]:
        """Validated ``(max_tokens, eos ids, temperature, seed)`` for :meth:`sample`; backends that
        sample themselves call it too. TypeError/ValueError name the bad argument."""
        self.ensure_open()
        return (
            check_int(max_tokens, "max_tokens", 0),
            check_token_id_set(eos_token_ids, self.vocab_size, "eos_token_ids"),
            check_temperature(temperature),
            check_seed(seed),
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    def clear_cache(self) -> None:
        """Forget every cached output and backend cache."""
        self.ensure_open()
        with self.model_lock:
            self.cache.clear()
            self.clear_backend_cache()

    def cleanup(self) -> Closed:
        """Release the model, caches and worker thread. The object is unusable afterwards; calling
        this again does nothing. The result may be awaited (``await lm.cleanup()``) or ignored."""
        if self._closed:
            return CLOSED
        self._closed = True
        self.batcher.close()
        self.in_flight.fail_all(ClosedError(f"{type(self).__name__} was closed by cleanup() while this request ran"))
        with self.model_lock:
            self.cache.clear()
            self.row_memory.clear()  # the blocks it follows, free or not, are the model's to release
            try:
                self.clear_backend_cache()
            except Exception as exc:  # a crashed engine cannot clear its cache, but must still be released
                log.warning(
                    "%s: clearing the backend cache failed at cleanup: %s: %s",
                    type(self).__name__,
                    type(exc).__name__,
                    exc,
                )
            self.close_backend()
        gc.collect()  # models hold large reference cycles; free them now, not at some later collection
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return CLOSED

    def __enter__(self) -> AsyncLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> AsyncLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cleanup()


class LoRASelection:
    """Which LoRA adapter is active, for backends that load adapters. ``adapters`` maps each loaded
    name to the backend's handle; the active name becomes part of every cache key."""

    adapters: dict[str, Any]
    ensure_open: Callable[[], None]  # AsyncLM's
    _active_lora: str | None = None

    @property
    def active_adapter(self) -> str | None:
        return self._active_lora

    def adapter_for(self, lora_name: str | None) -> str | None:
        if lora_name is None:
            return self._active_lora
        if not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str or None, got {type(lora_name).__name__}")
        if lora_name not in self.adapters:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded; loaded: {sorted(self.adapters)}")
        return lora_name

    def load_lora(self, path: str, name: str = "lora_1") -> None:
        """Load a LoRA adapter from ``path`` under ``name``; it is used where a request names it."""
        raise NotImplementedError

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` in the backend (called by :meth:`remove_lora`)."""

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load the adapter at ``lora_path`` as ``lora_name`` (genlm-backend's name); loading under a
        loaded name replaces that adapter. Use it per call with ``lora_name=``."""
        if lora_name in self.adapters:
            self.remove_lora(lora_name)
        self.load_lora(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        """Unload adapter ``lora_name`` and drop the rows cached for it."""
        self.ensure_open()
        if lora_name not in self.adapters:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded; loaded: {sorted(self.adapters)}")
        with self.model_lock:  # type: ignore[attr-defined]
            self.unload_lora(lora_name)
            del self.adapters[lora_name]
            self.cache.clear()  # type: ignore[attr-defined]
            self.clear_backend_cache()  # type: ignore[attr-defined]  # KV states computed under it
            if self._active_lora == lora_name:
                self._active_lora = None

    def set_lora(self, lora_path: str | None, lora_name: str = "lora_1") -> None:
        """Make adapter ``lora_name`` active for requests that name none, loading it from ``lora_path``
        first if it is not loaded (genlm-backend's ``set_lora(lora_path, lora_name)``). For an adapter
        already loaded, ``lora_path`` may be None. Per-request ``lora_name=`` needs no active adapter."""
        self.ensure_open()
        if lora_path is not None and lora_name not in self.adapters:
            self.load_lora(lora_path, lora_name)
        self._active_lora = self.adapter_for(lora_name)

    def clear_lora(self) -> None:
        """Use the base model again for requests that name no adapter."""
        self.ensure_open()
        self._active_lora = None


def sample_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Draw one token id from ``logprobs`` at ``temperature`` (0 means argmax).

    The row's maximum is subtracted before dividing, so any positive temperature, however small,
    gives a proper distribution (the top tokens keep weight 1 instead of overflowing).
    """
    if temperature == 0:
        return int(torch.argmax(logprobs))
    x = logprobs.detach().cpu().to(torch.float64)
    probs = torch.softmax((x - x.max()) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _iterable(value: Any, name: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of token id sequences, got {type(value).__name__}")
    return list(value)
