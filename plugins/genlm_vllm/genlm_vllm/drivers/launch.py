"""Starting one vLLM engine in this process, and checking it started as asked.

The steps every driver that runs an engine here (:class:`~genlm_vllm.drivers.llm.LLMDriver`,
:class:`~genlm_vllm.drivers.async_llm.AsyncLLMDriver`) shares, in order: refuse a script that spawned
processes would re-run (:mod:`genlm_vllm.start.processes`), pick the model runner and the engine arguments
(:mod:`genlm_vllm.start.engine_args`), start the engine in its environment (:mod:`genlm_vllm.start.env`),
mark the shared-memory files its processes make with the engine's tag, and check what it started with
(:func:`check_started`); a driver that fails the check is closed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from genlm_vllm.drivers.base import EngineDriver
from genlm_vllm.layout import Layout
from genlm_vllm.options import VLLMOptions
from genlm_vllm.start.engine_args import engine_kwargs
from genlm_vllm.start.env import engine_start
from genlm_vllm.start.files import EngineFiles, remove_files_of_dead_engines
from genlm_vllm.start.processes import check_main_guard
from genlm_vllm.vllm_api.client import engine_config, longest_context
from genlm_vllm.vllm_api.release import engine_facts, resolve_runner

log = logging.getLogger("genlm_vllm")

D = TypeVar("D", bound=EngineDriver)


def launch(
    model: str,
    options: VLLMOptions,
    lay: Layout,
    start_engine: Callable[[dict[str, Any]], Any],
    make_driver: Callable[[Any], D],
) -> D:
    """Start an engine for ``model`` with ``start_engine(engine arguments)`` and wrap it with
    ``make_driver(engine)``; the driver, checked (:func:`check_started`)."""
    if lay.spawns:
        check_main_guard()
    runner = resolve_runner(options.model_runner, engine_kwargs(model, options, lay))
    kwargs = engine_kwargs(model, options, lay, runner)
    log.info("starting vLLM engine for %s (%s; model runner %s)", model, lay.describe(), runner.upper())
    files = EngineFiles() if lay.spawns else None
    if files is not None:
        remove_files_of_dead_engines()
    marking = files.marking(ray=lay.ray) if files is not None else contextlib.nullcontext()
    with marking, engine_start(lay, runner, options.start_method):
        engine = start_engine(kwargs)
    driver = make_driver(engine)
    driver.files = files
    try:
        check_started(driver, engine_config(engine), runner, options.sessions_in(lay))
    except BaseException:
        driver.close()
        raise
    return driver


def check_started(driver: EngineDriver, config: Any, runner: str, sessions: bool) -> None:
    """After start: the engine uses the runner whose processor it was given, and no async scheduling
    under live sessions; log vLLM's version, runner and scheduling; note the runner and the longest
    context on the driver."""
    facts = engine_facts(config)
    if facts.runner != runner:
        raise RuntimeError(
            f"vLLM started its {facts.runner.upper()} model runner, but genlm-vllm prepared the capture for "
            f"{runner.upper()}: pass model_runner='{facts.runner}'"
        )
    if sessions and facts.async_scheduling:
        raise RuntimeError("vLLM turned async scheduling on, which live sessions cannot run with")
    driver.runner = runner
    log.info("vLLM engine up: %s", facts.describe())
    limit = longest_context(config)
    driver.context_limit = None if limit is None else limit - 1  # room for the one token vLLM generates
