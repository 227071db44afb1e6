"""``AsyncVirtualLM``: vLLM V1 behind the AsyncLM protocol, full-vocabulary logprobs from inside the engine.

Each batch of requests becomes one ``LLM.generate`` of one token per prompt, run from the batcher's
single worker thread (``generate`` is not thread-safe; the event loop keeps running meanwhile).
:class:`~genlm_vllm.capture.CaptureLogits`, a V1 logits processor, copies each request's logits by
tag, so results never depend on how the scheduler orders, splits or chunks the batch. Prefix
caching is vLLM's own. The engine lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the captured rows are reachable; tensor/pipeline parallel options pass through to vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from genlm_core import AsyncLM, AutoBatcher, LoRASelection, Request, Tokenizer
from genlm_vllm.options import VLLMOptions
from genlm_vllm.plugin import INSTALL

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the capture processor runs in this process
try:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"genlm-vllm needs the vllm module ({exc}): {INSTALL}") from exc

from genlm_vllm.capture import TAG, CaptureLogits

log = logging.getLogger(__name__)

if not torch.cuda.is_available():  # vLLM's CPU build: the V1 model runner (no Triton CPU backend here)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


@contextlib.contextmanager
def _hidden_from_vllm_kernel_scan() -> Iterator[None]:
    """Starting an engine, vLLM's kernel dispatcher scans every module in ``sys.modules`` and calls
    ``vars()`` on their attributes; llvmlite's lazy FFI object (``llvmlite.binding.ffi.lib``, loaded
    once numba has compiled anything, e.g. a trie) answers that with a function wrapper and the scan
    crashes. Hide that one module from the scan; code holding it keeps its own reference."""
    name = "llvmlite.binding.ffi"
    module = sys.modules.pop(name, None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules[name] = module


class AsyncVirtualLM(LoRASelection, AsyncLM):
    """A vLLM engine: batched, exact full-vocabulary next-token logprobs; batched sampling."""

    Options = VLLMOptions
    options: VLLMOptions

    def __init__(self, llm: Any, tokenizer: Tokenizer, options: VLLMOptions | None = None, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        o = self.options
        self.llm = llm
        self.sampler: AutoBatcher[tuple[Any, ...], list[int]] = AutoBatcher(
            self._sample_batch, batch_size=o.batch_size, timeout=o.timeout, run_in_thread=True, name="vllm-sample"
        )
        self.generate_calls = 0
        # vLLM needs room for the one token it generates after the context
        max_model_len = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "max_model_len", None)
        self.context_limit = None if max_model_len is None else int(max_model_len) - 1
        self._tags = itertools.count()
        self.adapters: dict[str, Any] = {}  # loaded LoRA adapters: name -> LoRARequest
        self._lora_ids = 0

    @classmethod
    def from_name(cls, model: str, /, engine_opts: dict[str, Any] | None = None, **kwargs: Any) -> AsyncVirtualLM:
        """Start an engine for ``model`` with :class:`VLLMOptions` as keywords; ``engine_opts`` go to ``vllm.LLM``."""
        return cls.from_options(model, VLLMOptions(**kwargs, engine_opts=engine_opts or {}))

    @classmethod
    def from_options(cls, model: str, options: VLLMOptions) -> AsyncVirtualLM:
        """The registry factory."""
        from transformers import AutoTokenizer

        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": options.dtype,
            "gpu_memory_utilization": options.gpu_memory_utilization,
            "enable_prefix_caching": options.enable_prefix_caching,
            "logits_processors": [CaptureLogits],
        }
        if options.max_model_len is not None:
            kwargs["max_model_len"] = options.max_model_len
        if options.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank)
        kwargs.update(options.engine_opts)
        log.info("starting vLLM engine for %s", model)
        with _hidden_from_vllm_kernel_scan():
            llm = vllm.LLM(**kwargs)
        return cls(llm, AutoTokenizer.from_pretrained(model), options)

    # ---- logprobs -------------------------------------------------------------------------------

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        tags = [f"{id(self)}-{next(self._tags)}" for _ in requests]
        params = [SamplingParams(max_tokens=1, detokenize=False, extra_args={TAG: tag}) for tag in tags]
        self._generate([r.token_ids for r in requests], params, [r.adapter for r in requests])
        with CaptureLogits.lock:
            rows = [CaptureLogits.rows.pop(tag, None) for tag in tags]
        missing = sum(row is None for row in rows)
        if missing:
            raise RuntimeError(f"vLLM returned no logits for {missing} of {len(rows)} requests")
        return torch.stack(rows)  # type: ignore[arg-type]

    def _generate(self, contexts: Sequence[Sequence[int]], params: list[Any], adapters: Iterable[str | None]) -> Any:
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        loras = [self.adapters[a] if a is not None else None for a in adapters]
        self.generate_calls += 1
        return self.llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)

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
        """vLLM's own sampling; concurrent calls share one ``generate``. Stops at one of
        ``eos_token_ids`` (not included in the result, as in genlm-backend), not on the model's EOS
        otherwise."""
        request = self.request(prompt_token_ids, lora_name)
        max_tokens, eos, temperature, seed = self.check_sampling(max_tokens, eos_token_ids, temperature, seed)
        if max_tokens == 0:
            return []
        item = (request, max_tokens, tuple(sorted(eos)), temperature, seed)
        return await self.sampler.submit(object(), item)

    def _sample_batch(self, items: list[tuple[Any, ...]]) -> list[list[int]]:
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                stop_token_ids=list(eos),
                ignore_eos=True,
                detokenize=False,
            )
            for _, max_tokens, eos, temperature, seed in items
        ]
        with self.model_lock:
            outputs = self._generate([r.token_ids for r, *_ in items], params, [r.adapter for r, *_ in items])
        results = []
        for (_, _, eos, *_), out in zip(items, outputs):
            ids = list(out.outputs[0].token_ids)
            results.append(ids[:-1] if ids and ids[-1] in eos else ids)
        return results

    # ---- LoRA -----------------------------------------------------------------------------------

    def load_lora(self, path: str, name: str = "lora_1") -> None:
        """Register a LoRA adapter (needs ``enable_lora=True``); it applies per request once active."""
        self.ensure_open()
        if not self.options.enable_lora:
            raise ValueError("this engine was started without enable_lora=True")
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1  # vLLM keys adapters by int id: never reuse one
        self.adapters[name] = LoRARequest(name, self._lora_ids, path)

    def unload_lora(self, name: str) -> None:
        self.llm.llm_engine.remove_lora(self.adapters[name].lora_int_id)

    # ---- lifecycle ------------------------------------------------------------------------------

    def clear_backend_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close_backend(self) -> None:
        self.sampler.close()
        self.llm = None
