"""The AsyncLM protocol and the base class every backend builds on.

A backend implements :meth:`AsyncLM.forward_batch` (logits for a batch of contexts) and model
loading; validation, batching, deduplication, the output cache, float32 normalisation and the
sampling loop are done here, once, for every backend.
"""

from __future__ import annotations

import abc
import asyncio
import gc
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple, Self

import numpy as np
import torch

from genlm_core.batching import AutoBatcher, Failed
from genlm_core.cache import OutputCache
from genlm_core.config import BackendOptions
from genlm_core.errors import ClosedError
from genlm_core.tokenization import Token, Tokenizer, decode_vocabulary
from genlm_core.validation import (
    check_int,
    check_seed,
    check_temperature,
    check_token_id_set,
    check_token_ids,
)

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


class Request(NamedTuple):
    """One next-token request: the context and the adapter active when it was made."""

    token_ids: tuple[int, ...]
    adapter: str | None = None


def logits_to_logprobs(logits: torch.Tensor, vocab_size: int, missing_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Raw logits ``[..., W]`` (any float dtype, ``W >= vocab_size``) to float32 logprobs ``[..., vocab_size]``.

    Columns past ``vocab_size`` (padded model vocabularies) are dropped before normalising; ids in
    ``missing_ids`` get ``-inf``. The result sums to one in probability space, in float32.
    """
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"model returned {logits.shape[-1]} logits, fewer than the vocabulary's {vocab_size}")
    x = logits[..., :vocab_size].to(torch.float32)
    if missing_ids is not None and len(missing_ids):
        x = x.index_fill(-1, missing_ids.to(x.device), float("-inf"))
    return torch.log_softmax(x, dim=-1)


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
        self.cache = OutputCache(o.cache_size, o.cache_bytes, move_to_cpu=cache_to_cpu)
        self.batcher: AutoBatcher[Request, torch.Tensor] = AutoBatcher(
            self.compute_rows,
            batch_size=o.batch_size,
            timeout=o.timeout,
            run_in_thread=run_in_thread,
            name=type(self).__name__,
        )
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

    @abc.abstractmethod
    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor | Sequence[torch.Tensor]:
        """Next-token logits for each request: ``[len(requests), W]`` with ``W >= vocab_size``.

        Any float dtype and device. Called with validated, distinct requests, under a lock.
        """

    def clear_backend_cache(self) -> None:  # noqa: B027 - optional hook, nothing to drop by default
        """Drop backend-held state such as KV caches (called by :meth:`clear_cache`)."""

    def close_backend(self) -> None:  # noqa: B027 - optional hook
        """Release the model and its memory (called by :meth:`cleanup`)."""

    @property
    def active_adapter(self) -> str | None:
        """Name of the active LoRA adapter; part of every cache key. ``None`` without adapters."""
        return None

    # ---- the protocol ------------------------------------------------------------------------

    def ensure_open(self) -> None:
        """Raise :class:`~genlm_core.errors.ClosedError` if :meth:`cleanup` has closed this model."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} was closed by cleanup(); load the model again to use it")

    def request(self, token_ids: TokenIds) -> Request:
        """Validate ``token_ids`` and make the request (and cache key) for it: a snapshot, so later
        changes to the caller's list or array do not change it.

        Raises TypeError for what is not a sequence of integer ids (sets, strings, bools, floats),
        ValueError for an empty context, an id outside ``[0, len(byte_vocab))``, or a context
        longer than :attr:`context_limit`.
        """
        self.ensure_open()
        ids = check_token_ids(token_ids, self.vocab_size)
        if self.context_limit is not None and len(ids) > self.context_limit:
            raise ValueError(
                f"token_ids has {len(ids)} tokens, more than this model's limit of {self.context_limit} positions"
            )
        return Request(ids, self.active_adapter)

    async def next_token_logprobs(self, token_ids: TokenIds) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids``, batched with concurrent calls."""
        request = self.request(token_ids)
        cached = self.cache.get(request)
        if cached is not None:
            return cached
        return await self.batcher.submit(request, request)

    def next_token_logprobs_sync(self, token_ids: TokenIds) -> torch.Tensor:
        """Synchronous :meth:`next_token_logprobs` (computed directly, sharing caches and the lock)."""
        return self._rows_sync([token_ids])[0]

    async def batch_next_token_logprobs(self, token_ids_list: Iterable[TokenIds]) -> torch.Tensor:
        """Logprobs for several contexts at once, ``[len(token_ids_list), vocab_size]``."""
        requests = [self.request(ids) for ids in _iterable(token_ids_list, "token_ids_list")]
        rows = await asyncio.gather(*(self.next_token_logprobs(r.token_ids) for r in requests))
        return self._stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list: Iterable[TokenIds]) -> torch.Tensor:
        """Synchronous :meth:`batch_next_token_logprobs`, in chunks of the batch size."""
        return self._stack(self._rows_sync(token_ids_list))

    def _rows_sync(self, token_ids_list: Iterable[TokenIds]) -> list[torch.Tensor]:
        requests = [self.request(ids) for ids in _iterable(token_ids_list, "token_ids_list")]
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
        return torch.stack(rows)

    def compute_rows(self, requests: list[Request]) -> list[torch.Tensor | Failed]:
        """Run :meth:`forward_batch` on distinct, validated requests (from :meth:`request`), under
        :attr:`model_lock`; normalise, check and cache each row. One row, or a :class:`Failed`, per
        request. The batcher calls it; a backend may too (e.g. to fill the cache ahead of time)."""
        with self.model_lock:
            out = self.forward_batch(requests)
        logits = out if isinstance(out, torch.Tensor) else torch.stack(list(out))
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise RuntimeError(
                f"{type(self).__name__}.forward_batch returned shape {tuple(logits.shape)} for {len(requests)} requests"
            )
        logprobs = logits_to_logprobs(logits, self.vocab_size, self._missing_ids)
        bad = torch.isnan(logprobs.sum(dim=-1)).tolist()  # a NaN anywhere makes the row's sum NaN
        rows: list[torch.Tensor | Failed] = []
        for r, row, is_bad in zip(requests, logprobs, bad):
            if is_bad:
                rows.append(
                    Failed(
                        FloatingPointError(
                            f"{type(self).__name__} produced NaN logits for context of {len(r.token_ids)} tokens"
                        )
                    )
                )
            else:
                rows.append(self.cache.put(r, row.clone() if len(requests) > 1 else row))
        return rows

    # ---- sampling ------------------------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        """Sample up to ``max_tokens`` tokens after the prompt; stop after one of ``eos_token_ids``.

        Returns the generated ids (a final EOS included). ``temperature=0`` is greedy. Concurrent
        calls are batched step by step through the same batcher.
        """
        context = list(self.request(prompt_token_ids).token_ids)
        max_tokens, eos, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        generator = torch.Generator().manual_seed(random.getrandbits(63) if seed is None else seed)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context)
            token = sample_token(logprobs, temperature, generator)
            generated.append(token)
            context.append(token)
            if token in eos:
                break
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Iterable[TokenIds],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` for several prompts concurrently; prompt ``i`` uses seed ``seed + i``
        (modulo ``2**63``)."""
        prompts = [self.request(p).token_ids for p in _iterable(prompt_token_ids_list, "prompt_token_ids_list")]
        max_tokens, eos_set, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        eos = sorted(eos_set)
        return list(
            await asyncio.gather(
                *(
                    self.sample(p, max_tokens, eos, temperature, None if seed is None else (seed + i) % 2**63)
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

    def cleanup(self) -> None:
        """Release the model, caches and worker thread. The object is unusable afterwards; calling
        this again does nothing."""
        if self._closed:
            return
        self._closed = True
        self.batcher.close()
        with self.model_lock:
            self.cache.clear()
            self.clear_backend_cache()
            self.close_backend()
        gc.collect()  # models hold large reference cycles; free them now, not at some later collection
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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

    def set_lora(self, name: str) -> None:
        """Make adapter ``name`` active for the following requests."""
        self.ensure_open()
        if name not in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        self._active_lora = name

    def clear_lora(self) -> None:
        """Use the base model again for the following requests."""
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
