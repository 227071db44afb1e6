"""``AsyncVirtualLM``: vLLM V1 behind the AsyncLM protocol, full-vocabulary logprobs from inside the engine.

Each batch of requests becomes one row-sized chunk per request of the engine's resumable sessions
(:mod:`genlm_vllm.sessions`): a request that extends the context of a request of the previous batch
continues that sequence in the engine, computing only its new tokens. The engine is driven from the
batcher's single worker thread (it is not thread-safe; the event loop keeps running meanwhile).
:class:`~genlm_vllm.capture.CaptureLogits`, a V1 logits processor, copies each request's logits by
tag wherever the model runs (this process, vLLM's engine-core process, tensor/pipeline-parallel
workers), and a row channel (:mod:`genlm_vllm.rows`) brings them back; results never depend on how
the scheduler orders, splits or chunks the batch. Prefix caching is vLLM's own. With
``engine="async"`` the engine is vLLM's AsyncLLM instead (:mod:`genlm_vllm.streaming`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from genlm_core import AsyncLM, AutoBatcher, LoRASelection, Request, Tokenizer
from genlm_core.hub import resolve_model
from genlm_vllm.options import VLLMOptions
from genlm_vllm.plugin import INSTALL
from genlm_vllm.processes import (
    EngineFiles,
    Layout,
    check_main_guard,
    engine_start,
    layout,
    on_cpu_build,
)

try:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"genlm-vllm needs the vllm module ({exc}): {INSTALL}") from exc

from genlm_vllm.forks import kv_transfer_config
from genlm_vllm.rows import LocalRows, RowChannel, RpcRows, SharedMemoryRows
from genlm_vllm.sessions import Sessions

log = logging.getLogger(__name__)

if on_cpu_build():  # vLLM's CPU build: the V1 model runner (no Triton CPU backend here)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

#: The smallest KV block vLLM's CPU attention accepts (it takes multiples of 32; its default is 128).
CPU_BLOCK_SIZE = 32

PROCESSOR = "genlm_vllm.capture:CaptureLogits"
EXTENSION = "genlm_vllm.capture.RowsExtension"  # vLLM wants a dotted path here


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


def max_model_len(engine: Any) -> int | None:
    """The engine's context length (LLM or AsyncLLM), or None if it does not say."""
    config = getattr(engine, "model_config", None) or getattr(getattr(engine, "llm_engine", None), "model_config", None)
    value = getattr(config, "max_model_len", None)
    return None if value is None else int(value)


def engine_kwargs(model: str, options: VLLMOptions, lay: Layout) -> dict[str, Any]:
    """vLLM engine arguments for ``options``: ours first, ``engine_opts`` over them."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": options.dtype,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enable_prefix_caching": options.enable_prefix_caching,
        "logits_processors": [PROCESSOR],  # by name: spawned processes import it themselves
    }
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    block_size = options.block_size or (CPU_BLOCK_SIZE if on_cpu_build() else None)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if options.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank)
    if options.live_sessions and not lay.streaming:
        kwargs["kv_transfer_config"] = kv_transfer_config()  # forks share their parent's block
    theirs = options.engine_opts.get("worker_extension_cls")
    if theirs is None:
        kwargs["worker_extension_cls"] = EXTENSION  # rows by RPC, and genlm_where() for checking a cluster
    elif lay.capture == "rpc":
        raise ValueError("capture='rpc' needs worker_extension_cls for itself; drop yours from engine_opts")
    kwargs.update(options.engine_opts)
    return kwargs


class AsyncVirtualLM(LoRASelection, AsyncLM):
    """A vLLM engine: batched, exact full-vocabulary next-token logprobs; batched sampling.

    Runs in every layout vLLM offers (in-process, multiprocess, tensor and pipeline parallel, and
    AsyncLLM with ``engine="async"``); see :class:`~genlm_vllm.VLLMOptions`."""

    Options = VLLMOptions
    options: VLLMOptions

    def __init__(
        self,
        llm: Any,
        tokenizer: Tokenizer,
        options: VLLMOptions | None = None,
        *,
        rows: RowChannel | None = None,
        engine_layout: Layout | None = None,
        **kwargs: Any,
    ):
        """``llm``: a started engine whose ``logits_processors`` include
        :class:`~genlm_vllm.capture.CaptureLogits`; ``rows``: the channel that reaches it (default:
        the engine runs in this process)."""
        super().__init__(tokenizer, options, **kwargs)
        o = self.options
        self.llm = llm
        self.layout = engine_layout or layout(o)
        self.rows = rows or LocalRows()
        self.sampler: AutoBatcher[tuple[Any, ...], list[int]] = AutoBatcher(
            self._sample_batch, batch_size=o.batch_size, timeout=o.timeout, run_in_thread=True, name="vllm-sample"
        )
        self.generate_calls = 0  #: batches handed to the engine: generate calls and session runs
        limit = max_model_len(llm)  # vLLM needs room for the one token it generates after the context
        self.context_limit = None if limit is None else limit - 1
        self.adapters: dict[str, Any] = {}  # loaded LoRA adapters: name -> LoRARequest
        #: the engine's live sequences (None: each batch is one ``generate``, prefix caching only)
        self.sessions = Sessions(llm) if o.live_sessions and isinstance(llm, vllm.LLM) else None
        self._lora_ids = 0
        #: shared-memory files vLLM's processes made for this engine (removed at cleanup if orphaned)
        self.engine_files: EngineFiles | None = None
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
        if options.replicas > 1:
            from genlm_vllm.replicas import ReplicatedLM

            return ReplicatedLM.start(model, options)
        lay = layout(options)
        if lay.spawns:
            check_main_guard()
        kwargs = engine_kwargs(model, options, lay)
        tokenizer = AutoTokenizer.from_pretrained(model)
        log.info("starting vLLM engine for %s (%s)", model, lay.describe())
        files = EngineFiles()
        if lay.streaming:
            from genlm_vllm.streaming import StreamingVirtualLM

            lm: AsyncVirtualLM = StreamingVirtualLM.start(kwargs, tokenizer, options, lay)
        else:
            with engine_start(lay), _hidden_from_vllm_kernel_scan():
                llm = vllm.LLM(**kwargs)
            lm = cls(llm, tokenizer, options, rows=cls.row_channel(llm, lay), engine_layout=lay)
        if lay.spawns:
            files.started()
            lm.engine_files = files
        return lm

    @staticmethod
    def row_channel(llm: Any, lay: Layout) -> RowChannel:
        """The channel that brings rows back from where ``llm`` runs its model."""
        if lay.capture == "local":
            return LocalRows()
        if lay.capture == "shm":
            return SharedMemoryRows(llm.llm_engine.model_config.get_vocab_size())
        return RpcRows(lambda tags, discard: llm.collective_rpc("genlm_pop_rows", args=(tags, discard)))

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a ``RowsExtension`` method (e.g. ``"genlm_where"``) on every worker; their replies."""
        return list(self.llm.collective_rpc(method, args=args))

    def engine_top_logprobs(self, contexts: Sequence[Sequence[int]], k: int = 20) -> list[dict[int, float]]:
        """vLLM's own ``logprobs=k`` for the next token after each context (its sampler's path, not
        our capture): an independent reference for :mod:`genlm_vllm.selftest`."""
        params = [SamplingParams(max_tokens=1, logprobs=k, detokenize=False) for _ in contexts]
        with self.model_lock:
            outputs = self._generate(contexts, params, [None] * len(contexts))
        return [first_token_logprobs(out) for out in outputs]

    # ---- logprobs -------------------------------------------------------------------------------

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        return self.capture_rows(requests, live=self.sessions is not None)

    def forward_uncached(self, request: Request) -> torch.Tensor:
        """The row of one context from a plain ``generate`` of it alone, salted so that no cached
        KV block is reused: the reference for the sessions and the prefix cache."""
        return self.capture_rows([request], live=False, cache_salt=uuid.uuid4().hex)[0]

    def capture_rows(self, requests: Sequence[Request], live: bool, cache_salt: str | None = None) -> torch.Tensor:
        """Logits of each request, captured in the engine: as chunks of live sessions, or by a plain
        ``generate`` (with ``cache_salt``: sharing no cached block with other requests)."""
        ticket = self.rows.prepare(len(requests))
        finished = False
        try:
            if live:
                assert self.sessions is not None
                self.generate_calls += 1
                self.sessions.run(requests, ticket.extra_args, [self.lora_request(r.adapter) for r in requests])
            else:
                params = [SamplingParams(max_tokens=1, detokenize=False, extra_args=a) for a in ticket.extra_args]
                self._generate([r.token_ids for r in requests], params, [r.adapter for r in requests], cache_salt)
            rows = self.rows.collect(ticket)
            finished = True
            return stack_rows(rows, requests)
        except BaseException:
            self.release_sessions()  # a failed batch leaves nothing alive that a later batch could continue
            raise
        finally:
            self.rows.release(ticket, finished)

    def _generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: list[Any],
        adapters: Iterable[str | None],
        cache_salt: str | None = None,
    ) -> Any:
        self.release_sessions()
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        prompts = [TokensPrompt(prompt_token_ids=list(c), **salt) for c in contexts]  # type: ignore[typeddict-item]
        loras = [self.lora_request(a) for a in adapters]
        self.generate_calls += 1
        return self.llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)

    def lora_request(self, adapter: str | None) -> Any:
        """vLLM's ``LoRARequest`` for a loaded adapter's name (None: the base model)."""
        return None if adapter is None else self.adapters[adapter]

    def release_sessions(self) -> None:
        """End the engine's live sequences (before any other use of the engine)."""
        if self.sessions is not None:
            self.sessions.release_all()

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
        return await self.sample_request(request, max_tokens, tuple(sorted(eos)), temperature, seed)

    async def sample_request(
        self, request: Request, max_tokens: int, eos: tuple[int, ...], temperature: float, seed: int | None
    ) -> list[int]:
        """Sample for a validated request: here batched with concurrent calls into one ``generate``."""
        return await self.sampler.submit(object(), (request, max_tokens, eos, temperature, seed))

    def _sample_batch(self, items: list[tuple[Any, ...]]) -> list[list[int]]:
        params = [sampling_params(*item[1:]) for item in items]
        with self.model_lock:
            outputs = self._generate([r.token_ids for r, *_ in items], params, [r.adapter for r, *_ in items])
        return [without_stop(out.outputs[0].token_ids, item[2]) for item, out in zip(items, outputs)]

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
        self.release_sessions()
        self.llm.llm_engine.remove_lora(self.adapters[name].lora_int_id)

    # ---- lifecycle ------------------------------------------------------------------------------

    def clear_backend_cache(self) -> None:
        self.release_sessions()  # parked sessions hold blocks: the prefix cache cannot be reset under them
        self.llm.reset_prefix_cache()

    def close_backend(self) -> None:
        self.sampler.close()
        group = None
        try:
            if self.layout.ray and not self.layout.multiprocess:
                group = self.llm.llm_engine.vllm_config.parallel_config.placement_group
            # Now, not when the garbage collector runs: an engine's processes, and an in-process
            # engine's teardown of vLLM's process-wide parallel groups, which a later one reuses.
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # a crashed engine: still free what is ours
            log.warning("vLLM engine shutdown failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.llm = None
            self.sessions = None  # it holds the engine core (and, with Ray, its mapped queues)
            if group is not None:  # vLLM's Ray executor leaves the placement group it made here
                remove_placement_group(group)
            self.release_files()

    def release_files(self) -> None:
        """Remove our shared-memory files, and those the engine's processes left behind."""
        self.rows.close()  # its callbacks hold the engine
        gc.collect()  # vLLM's objects hold each other in cycles: this process unmaps their queues now
        if self.engine_files is not None:
            self.engine_files.remove_orphans(grace=30.0 if self.layout.ray else 0.0)


def _cleanup_if_alive(ref: weakref.ref[AsyncVirtualLM]) -> None:
    lm = ref()
    if lm is not None:
        lm.cleanup()  # does nothing if it was closed already


def first_token_logprobs(output: Any) -> dict[int, float]:
    """The ``logprobs=k`` vLLM returned for the first generated token of a ``RequestOutput``."""
    return {token: float(lp.logprob) for token, lp in output.outputs[0].logprobs[0].items()}


def remove_placement_group(group: Any) -> None:
    """Remove a Ray placement group (logged, not raised, if Ray has already let it go)."""
    import ray

    try:
        ray.util.remove_placement_group(group)
    except Exception as exc:
        log.info("removing the engine's Ray placement group: %s: %s", type(exc).__name__, exc)


def sampling_params(max_tokens: int, eos: Sequence[int], temperature: float, seed: int | None) -> Any:
    """vLLM's parameters for :meth:`AsyncVirtualLM.sample`: stop at ``eos`` only, not the model's EOS."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=list(eos),
        ignore_eos=True,
        detokenize=False,
    )


def without_stop(token_ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """A sample without the EOS that stopped it (as genlm-backend returns them)."""
    ids = list(token_ids)
    return ids[:-1] if ids and ids[-1] in eos else ids


def stack_rows(rows: Sequence[torch.Tensor | None], requests: Sequence[Request]) -> torch.Tensor:
    """The rows of a batch as one tensor; a missing row fails the batch, naming the request."""
    missing = [i for i, row in enumerate(rows) if row is None]
    if missing:
        first = requests[missing[0]].token_ids
        raise RuntimeError(
            f"vLLM returned no logits for {len(missing)} of {len(rows)} requests (the first: a context of "
            f"{len(first)} tokens ending {list(first[-5:])})"
        )
    return torch.stack(rows)  # type: ignore[arg-type]
