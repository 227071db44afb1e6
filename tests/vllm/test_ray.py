"""genlm-vllm across machines, on a two-node Ray cluster simulated on this machine (loopback
addresses 127.0.0.2 and .3; see ``ray_cluster.py`` and the test-only ``ray_shim``).

Engines: vLLM's Ray executor with TP=2 (eager) and PP=2 (compiled) spread over both nodes, TP=2 with
the engine core in its own process, ``replicas=2`` (two engines as Ray actors behind one client) and
vLLM's own data parallel under AsyncLLM (DP=2, Ray backend). Rows are compared with genlm-hf on the
same weights; where the ranks sit and how they talk is asked of the workers themselves.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'genlm-vllm[ray]')", allow_module_level=True)

from genlm_core import Request, load_model_by_name
from genlm_core.testing import bounds, check_lm_contract, max_abs_diff
from genlm_core.testing.models import tiny_model_dir
from genlm_hf import AsyncTransformer
from genlm_vllm.drivers.replicas import ReplicaError
from genlm_vllm.start.files import left_since

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
BASE = {"dtype": "float32", "max_model_len": 1024, "timeout": 0.01}
SMALL_KV = {"kv_cache_memory_bytes": 64 * 2**20, "max_num_seqs": 16}
RAY = {"distributed_executor_backend": "ray"}
ENGINES = {
    "tp2": {"engine_opts": {**RAY, "tensor_parallel_size": 2, "enforce_eager": True}},
    "pp2": {"engine_opts": {**RAY, "pipeline_parallel_size": 2}},  # compiled: eager PP is a vLLM CPU bug
    "tp2-multiprocess": {
        "engine_opts": {**RAY, "tensor_parallel_size": 2, "enforce_eager": True},
        "multiprocess": True,
    },
}
CONTEXTS = [[1], [5, 6, 7], list(range(100, 160)), [3, 3, 3, 3], [2000, 2, 250]]


def tol(contexts) -> bounds.Bound:
    """The rows' tolerance on ``contexts``: two float32 runs of the tiny model (this layout and genlm-hf),
    4 x its float32-vs-float64 error on them (bounds.rows_bound)."""
    return bounds.rows_bound(str(tiny_model_dir("llama", **MODEL)))(contexts)


@pytest.fixture(scope="module")
def cluster(shared_engine):
    shared_engine.close()  # one in-process engine at a time
    spec = importlib.util.spec_from_file_location("genlm_test_ray_cluster", Path(__file__).parent / "ray_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = set(os.listdir("/dev/shm"))
    nodes = module.LoopbackCluster().start()
    yield nodes
    nodes.stop()
    assert nodes.processes() == []
    assert left_since(before) == set()


@pytest.fixture(scope="module")
def path():
    return str(tiny_model_dir("llama", **MODEL))


@pytest.fixture(scope="module")
def hf(path):
    return AsyncTransformer.from_name(path, batch_size=64)


def start(path, options):
    return load_model_by_name(
        path,
        backend="vllm",
        llm_opts={**BASE, **options, "engine_opts": {**SMALL_KV, **options.get("engine_opts", {})}},
    )


def ours_left(shm_before: set[str]) -> dict[str, object]:
    """Ray actors and placement groups still alive, and /dev/shm files made since ``shm_before`` that no other
    process uses (this one's hold does not keep them: the engines are closed)."""
    import ray
    from ray.util.state import list_actors

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return {
        "actors": [a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")])],
        "placement groups": groups,
        "files": sorted(left_since(shm_before, other_than=os.getpid())),  # this process holds none either
    }


def assert_nothing_left(shm_before: set[str]) -> None:
    import time

    deadline = time.monotonic() + 30  # Ray reports actors dead a moment after they are killed
    while (left := ours_left(shm_before)) != {"actors": [], "placement groups": [], "files": []}:
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


async def gather(lm, contexts, return_exceptions=False):
    return await asyncio.gather(*[lm.next_token_logprobs(c) for c in contexts], return_exceptions=return_exceptions)


LIVE_ENGINES: list = []


def release_engines() -> None:
    """Close the ``engine`` fixture's last engine: pytest keeps a module-scoped parametrized fixture
    until the module ends, and its placement group holds both nodes' GPU slots."""
    while LIVE_ENGINES:
        LIVE_ENGINES.pop().cleanup()


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, cluster, path):
    shm_before = set(os.listdir("/dev/shm"))
    lm = start(path, ENGINES[request.param])
    LIVE_ENGINES.append(lm)
    yield lm
    release_engines()
    assert_nothing_left(shm_before)


def test_the_whole_public_surface(engine, hf):
    contexts = [[1], [5, 6, 7], list(range(100, 140))]
    check_lm_contract(engine, contexts, atol=tol)
    uncached = [engine.next_token_logprobs_uncached(c) for c in contexts]
    diff = max(max_abs_diff(u, hf.next_token_logprobs_sync(c)) for u, c in zip(uncached, contexts))
    bounds.within("vllm ray: uncached vs hf", diff, tol(contexts))


def test_ranks_sit_on_both_nodes_and_talk_over_the_network(engine):
    where = engine.call_workers("genlm_where")
    assert {w["node"] for w in where} == {"127.0.0.2", "127.0.0.3"}
    paths = {w["tp_path"] or w["pp_path"] for w in where}
    assert paths == {"torch.distributed"}  # not vLLM's CPU shared-memory collectives
    assert sum(w["writer"] for w in where) == 1
    assert engine.driver.layout.capture == "rpc"
    # the model runs on Ray's workers: particles continue as sessions, and the engine says why
    sessions = engine.driver.sessions
    assert sessions.engine.resident is None
    assert sessions.not_resident == (
        "the engine core runs in another process"
        if engine.driver.layout.multiprocess
        else "the engine core queues batches (pipeline parallel or async scheduling)"
        if engine.driver.layout.pipeline_parallel > 1
        else "the model runs in worker processes"
    )


def test_rows_match_hf(engine, hf):
    rows = asyncio.run(gather(engine, CONTEXTS))
    for context, row in zip(CONTEXTS, rows):
        bounds.within("vllm ray: rows vs hf", max_abs_diff(row, hf.next_token_logprobs_sync(context)), tol([context]))


def test_the_selftest_passes_across_the_nodes(engine):
    from genlm_vllm.tools import selftest

    report = selftest.check(engine, CONTEXTS, batch_tol=tol(CONTEXTS))
    assert report.ok, report.lines()
    assert {w["node"] for w in report.workers} == {"127.0.0.2", "127.0.0.3"}


def test_a_row_that_never_arrives_is_an_error_naming_the_request(engine, hf):
    rows = engine.driver.rows
    collect = rows.collect

    def collect_after_a_stray_fetch(ticket):
        engine.call_workers("genlm_pop_rows", ticket.tags[:1], [])  # someone else takes the first row
        return collect(ticket)

    rows.collect = collect_after_a_stray_fetch
    try:
        with pytest.raises(RuntimeError, match=r"no logits for 1 of 2 requests .* ending \[7, 8, 9\]"):
            engine.batch_next_token_logprobs_sync([[7, 8, 9], [10, 11]])
    finally:
        rows.collect = collect
    bounds.within(
        "vllm ray: rows vs hf",
        max_abs_diff(engine.next_token_logprobs_sync([7, 8, 9]), hf.next_token_logprobs_sync([7, 8, 9])),
        tol([[7, 8, 9]]),
    )


def test_replicas_split_a_batch_keep_lineages_together_and_fail_alone(cluster, path, hf):
    import ray

    release_engines()
    shm_before = set(os.listdir("/dev/shm"))
    lm = start(path, {"replicas": 2, "engine_opts": {"enforce_eager": True}})
    try:
        assert {i["node"] for i in lm.driver.infos} == {"127.0.0.2", "127.0.0.3"}
        check_lm_contract(lm, [[1], [5, 6, 7], list(range(100, 140))], atol=tol)
        bounds.within(
            "vllm ray: rows vs hf",
            max_abs_diff(lm.next_token_logprobs_uncached([5, 6, 7]), hf.next_token_logprobs_sync([5, 6, 7])),
            tol([[5, 6, 7]]),
        )
        lm.clear_cache()
        parents = [[i, i + 1, i + 2] for i in range(10, 26)]
        rows = asyncio.run(gather(lm, parents))
        for context, row in zip(parents, rows):
            bounds.within(
                "vllm ray: rows vs hf", max_abs_diff(row, hf.next_token_logprobs_sync(context)), tol([context])
            )
        placed = [lm.driver.router._known(Request(tuple(c))) for c in parents]
        assert sorted(placed) == [0] * 8 + [1] * 8  # both replicas served, evenly

        children = [c + [42] for c in parents]  # the next SMC step goes where its prefix is cached
        assert lm.driver.router.assign(children) == placed
        rows = asyncio.run(gather(lm, [c + [43] for c in parents]))
        for context, row in zip(parents, rows):
            bounds.within(
                "vllm ray: rows vs hf",
                max_abs_diff(row, hf.next_token_logprobs_sync(context + [43])),
                tol([context + [43]]),
            )

        ray.kill(lm.driver.actors[1])
        results = asyncio.run(gather(lm, [c + [44] for c in parents], return_exceptions=True))
        for where, result in zip(placed, results):
            if where == 1:
                assert isinstance(result, ReplicaError) and "replica 1 of 2" in str(result)
            else:
                assert isinstance(result, torch.Tensor)
        fresh = asyncio.run(gather(lm, [[900, 901], [902, 903]]))  # new contexts go to the live replica
        bounds.within(
            "vllm ray: rows vs hf", max_abs_diff(fresh[1], hf.next_token_logprobs_sync([902, 903])), tol([[902, 903]])
        )
    finally:
        lm.cleanup()
    assert_nothing_left(shm_before)


def test_vllm_data_parallel_returns_every_row_from_both_engines(cluster, path, hf):
    release_engines()
    shm_before = set(os.listdir("/dev/shm"))
    dp = {"data_parallel_size": 2, "data_parallel_backend": "ray", "data_parallel_size_local": 1}
    lm = start(path, {"engine": "async", "engine_opts": {**dp, "enforce_eager": True}})
    try:
        check_lm_contract(lm, [[1], [5, 6, 7], list(range(100, 140))], atol=tol)
        contexts = [[i, i + 7] for i in range(40)]
        rows = asyncio.run(gather(lm, contexts))
        for context, row in zip(contexts, rows):
            bounds.within(
                "vllm ray: rows vs hf", max_abs_diff(row, hf.next_token_logprobs_sync(context)), tol([context])
            )
        writers = [w for w in lm.call_workers("genlm_where") if w["writer"]]
        assert len(writers) == 2 and {w["node"] for w in writers} == {"127.0.0.2", "127.0.0.3"}
        assert all(w["rows_written"] > 0 for w in writers)  # both engines served
        assert sum(w["rows_written"] for w in writers) >= len(contexts)
    finally:
        lm.cleanup()
    assert_nothing_left(shm_before)


EXITS_WITHOUT_CLEANUP = """
import json, sys
from genlm_core import load_model_by_name

if __name__ == "__main__":
    lm = load_model_by_name(sys.argv[1], backend="vllm", llm_opts=json.loads(sys.argv[2]))
    print("row", tuple(lm.next_token_logprobs_sync([1, 2, 3]).shape))
"""


def test_interpreter_exit_without_cleanup_leaves_nothing(cluster, path, tmp_path):
    import json
    import subprocess
    import sys

    release_engines()
    shm_before = set(os.listdir("/dev/shm"))
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITHOUT_CLEANUP)
    options = {**BASE, **ENGINES["tp2"], "ray_address": cluster.address}
    options["engine_opts"] = {**SMALL_KV, **options["engine_opts"]}
    done = subprocess.run(
        [sys.executable, str(script), path, json.dumps(options)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "row (" in done.stdout
    assert_nothing_left(shm_before)
