"""``wrap(lm)``: a genlm :class:`~genlm_core.AsyncLM` seen through genlm-backend's interface."""

from __future__ import annotations

import asyncio
import importlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from genlm.backend.tokenization import Token as SeedToken

from genlm_core import AsyncLM, get_plugins
from genlm_core.closing import Closed
from genlm_core.validation import check_batcher_numbers

#: genlm backend name -> the genlm-backend class its wrapper subclasses (for llamppl's isinstance checks);
#: about the seed library, so written here. Any other installed backend's wrapper subclasses ``BASE_CLASS``.
SEED_CLASSES = {
    "hf": "genlm.backend.llm.hf:AsyncTransformer",
    "vllm": "genlm.backend.llm.vllm:AsyncVirtualLM",
    "mock": "genlm.backend.llm.base:MockAsyncLM",
    "mlx": "genlm.backend.llm.mlx:AsyncMlxLM",
}
BASE_CLASS = "genlm.backend.llm.base:AsyncLM"


def seed_class(backend: str | None) -> type:
    """The genlm-backend class of ``backend`` (its base ``AsyncLM`` for backends it does not have)."""
    module, _, name = SEED_CLASSES.get(backend or "", BASE_CLASS).partition(":")
    return getattr(importlib.import_module(module), name)


def factory_place(factory: Any) -> tuple[str, str]:
    """``(module, qualified name)`` of a backend factory, read without importing a lazy one."""
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        return module, attr
    owner = getattr(factory, "__self__", None)  # a classmethod is bound to its class
    if isinstance(owner, type):
        return owner.__module__, f"{owner.__qualname__}.{getattr(factory, '__name__', '')}"
    return getattr(factory, "__module__", None) or "", getattr(factory, "__qualname__", "")


def backend_of(lm: AsyncLM | type) -> str | None:
    """The installed genlm backend that ``lm`` (a model or its class) belongs to: the nearest class of its
    MRO whose method is a backend's factory, else the nearest defined in a factory's module."""
    classes = (lm if isinstance(lm, type) else type(lm)).__mro__
    places = {name: factory_place(spec.factory) for name, spec in get_plugins().backends().items()}
    for cls in classes:
        for name, (module, qualname) in places.items():
            if cls.__module__ == module and qualname.startswith(cls.__qualname__ + "."):
                return name
    for cls in classes:
        for name, (module, _) in places.items():
            if cls.__module__ == module:
                return name
    return None


class CompatLM:
    """genlm-backend's ``AsyncLM`` interface over a genlm :class:`~genlm_core.AsyncLM` (``genlm_lm``).

    Each wrapper class also subclasses the matching genlm-backend class, so ``isinstance`` checks
    written against genlm-backend pass; none of that class's code runs (every method it has is
    defined here). Vocabulary entries are genlm-backend ``Token`` objects, built once. Sampling follows
    genlm-backend's contract: a multinomial draw from ``softmax(logprobs / temperature)`` with a
    ``torch.Generator`` seeded by ``seed``, stopping (and dropping) the EOS, every prompt of
    ``batch_sample`` with the same seed. Anything else is looked up on ``genlm_lm``.
    """

    genlm_lm: AsyncLM

    def __init__(self, lm: AsyncLM):  # genlm-backend's own __init__ is bypassed on purpose
        self.genlm_lm = lm
        self.tokenizer = lm.tokenizer
        self.byte_vocab = [SeedToken(int(t.token_id), bytes(t)) for t in lm.byte_vocab]
        self.str_vocab = lm.str_vocab
        self._added: set[asyncio.Task[torch.Tensor]] = set()  # add_query's requests still computing

    def __getattr__(self, name: str) -> Any:
        if name == "genlm_lm":  # not set yet: during unpickling or a failed __init__
            raise AttributeError(name)
        return getattr(self.genlm_lm, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.genlm_lm!r})"

    # ---- logprobs ------------------------------------------------------------------------------

    async def next_token_logprobs(self, token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        return await self.genlm_lm.next_token_logprobs(token_ids, lora_name)

    def next_token_logprobs_sync(self, token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        return self.genlm_lm.next_token_logprobs_sync(token_ids, lora_name)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        rows = await self.genlm_lm.batch_next_token_logprobs(token_ids_list, lora_name)
        return rows if rows._base is None else rows.clone()  # a tensor of its own, as genlm-backend's

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        return self.genlm_lm.batch_next_token_logprobs_sync(token_ids_list, lora_name)

    def next_token_logprobs_uncached(self, token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        return self.genlm_lm.next_token_logprobs_uncached(token_ids, lora_name)

    # ---- sampling, with genlm-backend's draws ---------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        lm = self.genlm_lm
        max_tokens, eos, temperature, seed = lm.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        context = list(lm.request(prompt_token_ids, lora_name).token_ids)
        out: list[int] = []
        for _ in range(max_tokens):
            logprobs = await lm.next_token_logprobs(context + out, lora_name)
            if temperature == 0:
                token = int(logprobs.argmax())
            else:
                probs = torch.softmax(logprobs / temperature, dim=-1)
                token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            if token in eos:
                break
            out.append(token)
        return out

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Sequence[int]],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(
                    self.sample(p, max_tokens, eos_token_ids, temperature, seed, lora_name)
                    for p in prompt_token_ids_list
                )
            )
        )

    # ---- caches, adapters, lifecycle ------------------------------------------------------------

    def clear_cache(self) -> None:
        self.genlm_lm.clear_cache()

    def clear_kv_cache(self) -> None:
        self.genlm_lm.clear_kv_cache()

    def reset_async_queries(self) -> None:
        for task in self._added:
            task.cancel()  # as genlm-backend: a query dropped before it ran leaves its future pending
        self._added.clear()
        self.genlm_lm.reset_async_queries()

    # ---- genlm-backend's batching attributes --------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Most requests in one batch (the model's batcher; settable, as on genlm-backend)."""
        return self.genlm_lm.batcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        batcher = self.genlm_lm.batcher
        batcher.batch_size, _ = check_batcher_numbers(value, batcher.timeout)

    @property
    def timeout(self) -> float:
        """Seconds the oldest queued request waits at most for its batch (settable, as on genlm-backend)."""
        return self.genlm_lm.batcher.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        batcher = self.genlm_lm.batcher
        _, batcher.timeout = check_batcher_numbers(batcher.batch_size, value)

    @property
    def queries(self) -> list[Any]:
        """The requests queued and not yet computed (genlm-backend's queue)."""
        return [*self.genlm_lm.batcher.queued(), *(t for t in self._added if not t.done())]

    @queries.setter
    def queries(self, value: list[Any]) -> None:
        if len(value):
            raise TypeError("genlm_compat: the queue can only be emptied (queries = []); submit with add_query")
        self.reset_async_queries()

    def add_query(self, query: Sequence[int], future: asyncio.Future[Any], past: Any = None) -> None:
        """Queue ``query``; its row is set on ``future`` (genlm-backend's ``AsyncTransformer.add_query``;
        ``past`` is ignored: genlm finds reusable KV itself)."""

        def deliver(task: asyncio.Task[torch.Tensor]) -> None:
            self._added.discard(task)
            if future.done() or task.cancelled():
                return
            if task.exception() is not None:
                future.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                future.set_result(task.result())

        task = asyncio.ensure_future(self.genlm_lm.next_token_logprobs(query))
        self._added.add(task)
        task.add_done_callback(deliver)

    def cache_kv(self, prompt_tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Compute ``prompt_tokens`` now, so that later contexts extending it reuse its work."""
        self.genlm_lm.next_token_logprobs_sync(prompt_tokens, lora_name)

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        self._lora("add_new_lora")(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        self._lora("remove_lora")(lora_name)

    def set_lora(self, lora_path: str | None, lora_name: str = "lora_1") -> None:
        self._lora("set_lora")(lora_path, lora_name)

    def clear_lora(self) -> None:
        self._lora("clear_lora")()

    def _lora(self, name: str) -> Any:
        method = getattr(self.genlm_lm, name, None)
        if method is None:
            raise NotImplementedError(f"{type(self.genlm_lm).__name__} does not support LoRA adapters")
        return method

    def cleanup(self) -> Closed:
        return self.genlm_lm.cleanup()

    def __del__(self) -> None:  # genlm-backend's classes shut down in __del__; ours close explicitly
        pass

    async def __aenter__(self) -> CompatLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cleanup()

    def __enter__(self) -> CompatLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


_classes: dict[str | None, type] = {}
# The wrapper holds its model, so the model is the key and the wrapper the weak value: a model is freed
# once its last wrapper is.
_wrappers: weakref.WeakValueDictionary[AsyncLM, CompatLM] = weakref.WeakValueDictionary()


def wrapper_class(backend: str | None) -> type:
    """The wrapper class for a genlm backend: :class:`CompatLM` first, then its genlm-backend class."""
    cls = _classes.get(backend)
    if cls is None:
        seed = seed_class(backend)
        cls = type(f"Compat{seed.__name__}", (CompatLM, seed), {"__module__": __name__})
        _classes[backend] = cls
    return cls


def wrap(lm: AsyncLM) -> CompatLM:
    """``lm`` as an object genlm-control, genlm-bytes and llamppl accept wherever they take a
    genlm-backend LM; the same wrapper each time for the same ``lm``. A wrapper is returned as is.

    >>> from genlm_core.mock import MockAsyncLM
    >>> from genlm.backend.llm import MockAsyncLM as SeedMock
    >>> lm = wrap(MockAsyncLM.from_name("gpt2"))
    >>> isinstance(lm, SeedMock), type(lm.byte_vocab[0]).__module__, lm.byte_vocab[13]
    (True, 'genlm.backend.tokenization.token', Token(token_id=13, byte_string=b'.'))
    """
    if isinstance(lm, CompatLM):
        return lm
    if not isinstance(lm, AsyncLM):
        raise TypeError(f"wrap() takes a genlm AsyncLM, got {type(lm).__name__}")
    wrapper = _wrappers.get(lm)
    if wrapper is None:
        wrapper = _wrappers[lm] = wrapper_class(backend_of(lm))(lm)
    return wrapper
