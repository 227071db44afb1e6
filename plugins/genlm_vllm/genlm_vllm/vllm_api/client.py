"""The caller's side of vLLM: starting engines, requests and their parameters, ``vllm.LLM``,
``AsyncLLM``, and the engine core driven directly (resumable sessions, resident requests).

Every call or attribute read on a vLLM object made from the caller's process is here; what runs
inside the model's processes is :mod:`genlm_vllm.vllm_api.worker`. Imports no vLLM at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from genlm_vllm.vllm_api import release
from genlm_vllm.vllm_api.worker import hash_again_past

# ---- how the engine's processes start -----------------------------------------------------------

#: Modules that import vLLM's ``get_mp_context`` (the multiprocessing context its engine core, workers
#: and data-parallel coordinator start from); those this release has are imported before a start.
MP_CONTEXT_USERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor", "vllm.v1.engine.coordinator")


def engine_process_modules() -> list[str]:
    """What vLLM's own processes run, for a fork server to import once: the engine core, the
    multiprocess executor's workers and this platform's worker."""
    worker = "vllm.v1.worker.cpu_worker" if release.on_cpu_build() else "vllm.v1.worker.gpu_worker"
    return ["vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", worker]


@contextlib.contextmanager
def processes_from(choose: Callable[[], Any] | None) -> Iterator[None]:
    """While an engine starts: each process vLLM would spawn starts from the context ``choose()``
    returns when vLLM asks for one (None, or ``choose`` None: spawned, as vLLM would). vLLM takes its
    context from ``vllm.utils.system_utils.get_mp_context`` (spawn, as genlm-vllm asks, or fork if its
    own checks allow it), after it has set what its processes inherit (its CPU build puts its
    allocator and OpenMP library in ``LD_PRELOAD``); every loaded vLLM module holding that function is
    given one that asks ``choose`` where vLLM's would spawn, and the original is put back after."""
    if choose is None:
        yield
        return
    from vllm.utils import system_utils

    original = system_utils.get_mp_context
    for name in MP_CONTEXT_USERS:
        with contextlib.suppress(ModuleNotFoundError):
            __import__(name)

    def get_mp_context() -> Any:
        found = original()
        return (choose() or found) if found.get_start_method() == "spawn" else found

    holders: list[Any] = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("vllm.") and getattr(module, "get_mp_context", None) is original
    ]
    for module in holders:
        module.get_mp_context = get_mp_context
    try:
        yield
    finally:
        for module in holders:
            module.get_mp_context = original


# ---- requests: prompts, parameters, outputs, adapters -----------------------------------------------


def SamplingParams(**kwargs: Any) -> Any:
    """vLLM's ``SamplingParams(**kwargs)`` (vLLM is loaded on the first call, not when this is imported)."""
    return release.loaded().SamplingParams(**kwargs)


def prompt(token_ids: Any, cache_salt: str | None = None) -> Any:
    """vLLM's prompt for a token list (a fresh list: the scheduler may extend it)."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    return release.loaded().TokensPrompt(prompt_token_ids=list(token_ids), **salt)


def row_params(extra_args: dict[str, Any] | None = None) -> Any:
    """Parameters of a request whose row is captured: one token, no text, our ``extra_args``."""
    return SamplingParams(max_tokens=1, detokenize=False, extra_args=extra_args)


def chunk_params(extra_args: dict[str, Any]) -> Any:
    """Parameters of one chunk of a live session: one greedy token (genlm discards it), our ``extra_args``."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra_args)


def resident_params(max_tokens: int, extra_args: dict[str, Any]) -> Any:
    """Parameters of a resident request: greedy tokens up to ``max_tokens`` (each replaced by the
    program's own), the model's EOS ignored, our ``extra_args``."""
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False, extra_args=extra_args
    )


def top_params(k: int) -> Any:
    """Parameters that ask vLLM's sampler for the ``k`` most likely first tokens' logprobs."""
    return SamplingParams(max_tokens=1, logprobs=k, detokenize=False)


def sample_params(max_tokens: int, eos: Sequence[int], temperature: float, seed: int | None) -> Any:
    """Parameters for ``sample``: stop at ``eos`` only, not at the model's EOS."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=list(eos),
        ignore_eos=True,
        detokenize=False,
    )


def first_token_logprobs(output: Any) -> dict[int, float]:
    """The ``logprobs=k`` vLLM returned for the first generated token of a ``RequestOutput``."""
    return {token: float(lp.logprob) for token, lp in output.outputs[0].logprobs[0].items()}


def sampled_tokens(output: Any, eos: Sequence[int]) -> list[int]:
    """The tokens a ``RequestOutput`` sampled, without the EOS that stopped it (as genlm-backend
    returns them)."""
    ids = list(output.outputs[0].token_ids)
    return ids[:-1] if ids and ids[-1] in eos else ids


class LoRARequests:
    """vLLM's ``LoRARequest`` of each loaded adapter, by name (vLLM keys adapters by an int id: never reused)."""

    def __init__(self) -> None:
        self.by_name: dict[str, Any] = {}
        self._ids = 0

    def add(self, name: str, path: str) -> None:
        self._ids += 1
        self.by_name[name] = release.loaded().LoRARequest(lora_name=name, lora_int_id=self._ids, lora_path=path)

    def get(self, name: str | None) -> Any:
        """The request of adapter ``name``; None for the base model."""
        return None if name is None else self.by_name[name]

    def pop_id(self, name: str) -> int:
        """Forget adapter ``name``; the id vLLM knows it by."""
        return int(self.by_name.pop(name).lora_int_id)


# ---- engines: vllm.LLM -----------------------------------------------------------------------------


def engine_config(engine: Any) -> Any:
    """The ``VllmConfig`` of an ``LLM`` or an ``AsyncLLM``."""
    inner = getattr(engine, "llm_engine", engine)
    return inner.vllm_config


def longest_context(config: Any) -> int | None:
    """The longest context (prompt and output tokens) an engine with this ``VllmConfig`` takes."""
    limit = getattr(config.model_config, "max_model_len", None)
    return None if limit is None else int(limit)


def vocab_size(engine: Any) -> int:
    """The width of the model's logits rows (the model's vocabulary, padding included)."""
    return int(engine_config(engine).model_config.get_vocab_size())


def start_llm(kwargs: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` with these engine arguments."""
    return release.loaded().LLM(**kwargs)


def generate(llm: Any, prompts: list[Any], params: list[Any], loras: list[Any] | None) -> Any:
    """``LLM.generate`` of prompts with their own parameters and adapters, quietly."""
    return llm.generate(prompts, params, lora_request=loras, use_tqdm=False)


def decode(llm: Any, token_ids: Any, n: int, steps: int) -> Any:
    """vLLM's own decode of ``n`` sequences of ``steps`` tokens from one prompt: the engine's raw speed."""
    params = SamplingParams(n=n, max_tokens=steps, ignore_eos=True, detokenize=False, seed=0)
    return llm.generate([prompt(token_ids)], params, use_tqdm=False)


def collective_rpc(llm: Any, method: str, args: tuple[Any, ...]) -> list[Any]:
    """Run a worker-extension ``method`` on every worker of an ``LLM``; their replies."""
    return list(llm.collective_rpc(method, args=args))


def reset_prefix_cache(llm: Any) -> None:
    """Drop an ``LLM``'s prefix cache."""
    llm.reset_prefix_cache()


def remove_lora(llm: Any, lora_id: int) -> None:
    """Forget adapter ``lora_id`` in an ``LLM``."""
    llm.llm_engine.remove_lora(lora_id)


def placement_group(llm: Any) -> Any:
    """The Ray placement group an ``LLM``'s executor made in this process, if any."""
    return getattr(llm.llm_engine.vllm_config.parallel_config, "placement_group", None)


def shutdown_llm(llm: Any) -> None:
    """Shut an ``LLM``'s engine core (and its processes) down now, not when the collector runs: an
    in-process engine's teardown of vLLM's process-wide parallel groups must precede the next engine."""
    llm.llm_engine.engine_core.shutdown()


# ---- engines: AsyncLLM (each call on the loop that drives it) -----------------------------------------


def start_async_llm(kwargs: dict[str, Any]) -> Any:
    """vLLM's ``AsyncLLM`` with these engine arguments (call on the loop that will drive it)."""
    release.loaded()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


async def run_async(engine: Any, token_ids: Any, params: Any, request_id: str, **options: Any) -> Any:
    """One request through an ``AsyncLLM`` to its end; its final ``RequestOutput``. ``options``:
    ``cache_salt`` (share no cached KV block), ``lora`` (the adapter's ``LoRARequest``)."""
    final = None
    request = prompt(token_ids, options.get("cache_salt"))
    async for out in engine.generate(request, params, request_id, lora_request=options.get("lora")):
        final = out
    return final


async def every_worker_async(engine: Any, method: str, args: tuple[Any, ...], data_parallel: int) -> list[Any]:
    """``collective_rpc`` on every worker of an ``AsyncLLM``; with vLLM's data parallel, on every
    engine's workers (AsyncLLM's own ``collective_rpc`` reaches engine 0 only)."""
    if data_parallel > 1:
        per_engine = await utility_on_every_engine(engine.engine_core, "collective_rpc", method, None, args, None)
        return [reply for replies in per_engine for reply in replies]
    return list(await engine.collective_rpc(method, args=args))


async def utility_on_every_engine(client: Any, method: str, *args: Any) -> list[Any]:
    """A utility call on every engine an ``AsyncLLM``'s core client manages, one reply each: the
    client's ``call_utility_all_async`` (vLLM 0.32 on), else its per-engine call (0.26)."""
    if hasattr(client, "call_utility_all_async"):
        return list(await client.call_utility_all_async(method, *args))
    calls = [client._call_utility_async(method, *args, engine=engine) for engine in client.core_engines]
    return list(await asyncio.gather(*calls))


async def remove_lora_async(engine: Any, lora_id: int) -> None:
    """Forget adapter ``lora_id`` in an ``AsyncLLM``."""
    await engine.remove_lora(lora_id)


async def reset_prefix_cache_async(engine: Any) -> None:
    """Drop an ``AsyncLLM``'s prefix cache."""
    await engine.reset_prefix_cache()


def shutdown_async_llm(engine: Any) -> None:
    """Shut an ``AsyncLLM`` and its processes down."""
    engine.shutdown()


# ---- the engine core, driven directly (resumable sessions) ----------------------------------------


@dataclass
class EngineCore:
    """The parts of an ``LLM``'s engine that :mod:`genlm_vllm.live` drives: its core client (in
    this process or another), its input processor, and the scheduler's limits."""

    client: Any
    inputs: Any
    tasks: Any
    token_budget: int
    max_num_seqs: int
    kv_blocks: int
    block_size: int
    max_model_len: int
    kv_connector: str | None

    @classmethod
    def of(cls, llm: Any) -> EngineCore:
        engine = llm.llm_engine
        config = engine.vllm_config
        cache = config.cache_config
        transfer = config.kv_transfer_config
        return cls(
            client=engine.engine_core,
            inputs=engine.input_processor,
            tasks=engine.get_supported_tasks(),
            token_budget=config.scheduler_config.max_num_batched_tokens,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            kv_blocks=cache.num_gpu_blocks or 0,
            block_size=cache.block_size,
            max_model_len=config.model_config.max_model_len,
            kv_connector=None if transfer is None else transfer.kv_connector,
        )

    def add_chunk(self, request_id: str, token_ids: Any, params: Any, lora: Any, resumable: bool) -> None:
        """Add one request (a session's next chunk when ``request_id`` is a live session's)."""
        request = self.inputs.process_inputs(
            request_id,
            prompt(token_ids),
            params,
            supported_tasks=self.tasks,
            lora_request=lora,
            resumable=resumable,
        )
        request.external_req_id = request_id
        self.client.add_request(request)

    def step(self) -> list[Any]:
        """One engine step's outputs (``EngineCoreOutput``: read them with :meth:`outcomes`)."""
        return list(self.client.get_output().outputs)

    @staticmethod
    def outcomes(outputs: list[Any]) -> list[tuple[str, bool, bool, tuple[int, int, int] | None]]:
        """A step's outputs, each as ``(request id, whether vLLM finished it, whether it produced a
        token, its prefill's tokens computed/cached/copied if any: see :func:`prefill_counts`)``."""
        return [
            (out.request_id, out.finish_reason is not None, bool(out.new_token_ids), prefill_counts(out))
            for out in outputs
        ]

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.client.abort_requests(request_ids)


class ResidentCore:
    """The scheduler and the model runner of an engine whose core and one worker run in this process,
    for :mod:`genlm_vllm.live` to keep particles as *running* requests (resident requests).

    A resident request decodes as vLLM's own do: each engine step computes its last token and samples
    the next. Between steps it is paused (out of the scheduler's running list, keeping its KV blocks
    and its place in the model runner's persistent batch), and the token the program chose replaces
    the one vLLM sampled, in the scheduler's request (its tokens and block hashes) and in the model
    runner's cached state and batch, before it is resumed. No request is added, validated or
    re-entered into the persistent batch for it. :meth:`of` says why an engine cannot do this."""

    def __init__(self, scheduler: Any, runner: Any):
        self.scheduler = scheduler
        self.runner = runner

    @classmethod
    def of(cls, llm: Any) -> tuple[ResidentCore | None, str]:
        """This engine's resident core, or None and why not."""
        engine = llm.llm_engine
        client = engine.engine_core
        core = getattr(client, "engine_core", None)
        if type(client).__name__ != "InprocClient" or core is None:
            return None, "the engine core runs in another process"
        if getattr(core, "batch_queue", None) is not None:
            return None, "the engine core queues batches (pipeline parallel or async scheduling)"
        worker = getattr(getattr(core.model_executor, "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        if type(core.model_executor).__name__ != "UniProcExecutor" or runner is None:
            return None, "the model runs in worker processes"
        batch = getattr(runner, "input_batch", None)
        if not hasattr(batch, "token_ids_cpu") or not isinstance(getattr(runner, "requests", None), dict):
            return None, "the model runner is not vLLM's V1 runner (Model Runner V2 keeps its tokens on the device)"
        if getattr(runner, "use_async_scheduling", False) or getattr(runner, "speculative_config", None) is not None:
            return None, "the model runner schedules ahead (async scheduling or speculative decoding)"
        return cls(core.scheduler, runner), ""

    @staticmethod
    def prompt_length(request: Any) -> int:
        """The prompt tokens of one of the scheduler's requests."""
        return int(request.num_prompt_tokens)

    def request(self, request_id: str) -> Any:
        """The scheduler's request of this id (None once it is finished)."""
        request = self.scheduler.requests.get(request_id)
        return None if request is None or request.is_finished() else request

    def pause(self, requests: set[Any]) -> None:
        """Take these requests out of the scheduler's running list (they keep their KV blocks)."""
        if requests:
            self.scheduler.running = [r for r in self.scheduler.running if r not in requests]

    def resume(self, requests: list[Any]) -> None:
        """Put paused requests back into the running list, to compute their last token next step."""
        self.scheduler.running.extend(requests)

    def replace_sampled(self, request: Any, token: int, args: dict[str, Any]) -> bool:
        """Make ``token`` the last token of paused ``request`` in place of the one vLLM sampled, and
        ``args`` its ``extra_args``, in the scheduler and the model runner. False (nothing changed) where
        the request does not hold exactly one token it has not computed."""
        position = request.num_tokens - 1
        state = self.runner.requests.get(request.request_id)
        if (
            request.num_computed_tokens != position
            or position < request.num_prompt_tokens
            or state is None
            or state.num_tokens != position + 1
        ):
            return False
        request._output_token_ids[-1] = token
        request._all_token_ids[-1] = token
        hash_again_past(request, position, self.scheduler.hash_block_size)
        state.output_token_ids[-1] = token
        index = self.runner.input_batch.req_id_to_index.get(request.request_id)
        if index is not None:
            self.runner.input_batch.token_ids_cpu[index, position] = token
        for params in (request.sampling_params, state.sampling_params):
            params.extra_args.clear()  # one dict in this process, or a copy of it: both say the same
            params.extra_args.update(args)
        return True


def prefill_counts(output: Any) -> tuple[int, int, int] | None:
    """(tokens computed, from the prefix cache, from a KV connector) of an output's prefill, if any."""
    stats = output.prefill_stats
    if stats is None:
        return None
    return stats.num_computed_tokens, stats.num_local_cached_tokens, stats.num_external_cached_tokens
