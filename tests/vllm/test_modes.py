"""genlm-vllm in every layout beyond one process, against genlm-hf on the same tiny float32 Llama.

One engine per layout (module-scoped, parametrized: pytest runs each layout's tests together and
stops its engine before starting the next): the multiprocess engine, AsyncLLM, tensor parallel
(TP=2), pipeline parallel (PP=2) and the ``collective_rpc`` channel forced on TP=2 and on
AsyncLLM. The model has 2 attention heads so that TP=2 can split them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from pathlib import Path

import psutil
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core import ClosedError, load_model_by_name
from genlm_core.testing import bounds, check_lm_contract
from genlm_core.testing import concurrent_logprobs as gather
from genlm_core.testing import max_abs_diff as max_diff
from genlm_core.testing.models import tiny_model_dir
from genlm_hf import AsyncTransformer
from genlm_vllm.start import processes as start_processes
from genlm_vllm.start.env import allowed_cores, threads_bind
from genlm_vllm.start.files import left_since
from genlm_vllm.transport.channels import RpcRows, SharedMemoryRows
from genlm_vllm.transport.shm import leftover_files

pytestmark = [pytest.mark.slow, pytest.mark.layouts]
MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}  # head_dim 64; 2 heads for TP=2
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 128 * 2**20,
    "enforce_eager": True,
}
MODES = {
    "multiprocess": {"multiprocess": True},
    "async": {"engine": "async"},
    "tp2": {"engine_opts": {"tensor_parallel_size": 2}},
    "pp2": {"engine_opts": {"pipeline_parallel_size": 2}},  # eager: needs genlm_vllm.vllm_api.fixes on CPU
    "tp2-rpc": {"engine_opts": {"tensor_parallel_size": 2}, "capture": "rpc"},
    "async-rpc": {"engine": "async", "capture": "rpc", "start_method": "spawn", "worker_wait": "spin"},
}
THREADS_AFTER_START: dict[str, tuple[int, int]] = {}  # mode -> (torch threads before, after)
SHM_BEFORE_START: dict[str, set[str]] = {}  # mode -> /dev/shm's files before its engine started


def tol(contexts) -> bounds.Bound:
    """The rows' tolerance on ``contexts``: two float32 runs of the tiny model (another layout, batch split
    or backend), 4 x its float32-vs-float64 error on them (bounds.rows_bound). A LoRA adapter's rank-4
    products on two projections round like the base model's, whose error stands for them."""
    return bounds.rows_bound(str(tiny_model_dir("llama", **MODEL)))(contexts)


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def path():
    return str(tiny_model_dir("llama", **MODEL))


@pytest.fixture(scope="module")
def adapter(path, tmp_path_factory):
    """A LoRA adapter that really changes the model (random B, not zeros)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    out = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def hf(path, adapter):
    lm = AsyncTransformer.from_name(path, batch_size=128)
    lm.load_lora(adapter, "a")
    return lm


@pytest.fixture(scope="module", params=list(MODES))
def lm(request, path, adapter, shared_engine):
    shared_engine.close()  # one in-process engine at a time
    mode = MODES[request.param]
    options = {
        "dtype": "float32",
        "max_model_len": 2048,
        "batch_size": 1024,
        "timeout": 0.01,
        "enable_lora": True,
        "max_lora_rank": 8,
        **mode,
        "engine_opts": {**ENGINE, **mode.get("engine_opts", {})},
    }
    threads = torch.get_num_threads()
    SHM_BEFORE_START[request.param] = shm_names()
    engine = load_model_by_name(path, backend="vllm", llm_opts=options)
    THREADS_AFTER_START[request.param] = (threads, torch.get_num_threads())
    engine.load_lora(adapter, "a")
    yield engine
    engine.cleanup()
    assert leftover_files(os.getpid()) == []


def kept_rows(lm) -> int:
    """Rows waiting on the engine's side: shared-memory slots held, or rows on the writing rank."""
    if isinstance(lm.driver.rows, SharedMemoryRows):
        return lm.driver.rows.in_use
    assert isinstance(lm.driver.rows, RpcRows)
    replies = [r for r in lm.call_workers("genlm_kept_rows") if r is not None]
    assert len(replies) == 1  # exactly one writing rank
    return replies[0]


def test_particles_continue_in_the_engine_in_every_llm_layout(lm, hf):
    """A request continues the previous batch's sequence of its parent, under the same adapter only;
    rows match genlm-hf. AsyncLLM streams requests one by one and has no sessions."""
    if lm.driver.layout.streaming:
        assert getattr(lm.driver, "sessions", None) is None
        return
    lm.clear_cache()
    stats = lm.driver.sessions.stats
    before = stats.continued
    contexts = [[21, 22, 23], [21, 22, 24]]
    asked = [[*c, *range(30, 30 + n)] for n in range(4) for c in contexts]
    seen = []
    for step in range(4):
        for adapter in (None, "a"):
            rows = lm.batch_next_token_logprobs_sync(contexts, lora_name=adapter)
            want = hf.batch_next_token_logprobs_sync(contexts, lora_name=adapter)
            seen += [(r, w) for r, w in zip(rows, want, strict=True)]
        contexts = [[*c, 30 + step] for c in contexts]
    diff = max(bounds.row_difference(r, w) for r, w in seen)
    bounds.within("vllm modes: continued vs hf", diff, tol(asked))  # never continued under another adapter
    # Each adapter's sequences stay parked through the other adapter's batch: from step 1 on, every request
    # continues its parent under its own adapter (2 contexts x 2 adapters x 3 steps).
    assert stats.continued - before == 12
    before = stats.continued
    seen = []
    for adapter in (None, "a"):  # the same adapter step after step: every request continues its parent
        contexts = [[21, 22, 23, 40], [21, 22, 24, 40]]
        lm.batch_next_token_logprobs_sync(contexts, lora_name=adapter)
        children = [[*c, 41] for c in contexts]
        rows = lm.batch_next_token_logprobs_sync(children, lora_name=adapter)
        seen += list(zip(rows, hf.batch_next_token_logprobs_sync(children, lora_name=adapter), strict=True))
    assert stats.continued - before == 4
    diff = max(bounds.row_difference(r, w) for r, w in seen)
    bounds.within("vllm modes: continued again vs hf", diff, tol([[21, 22, 23, 40, 41], [21, 22, 24, 40, 41]]))


def test_forks_copy_their_parents_block_in_every_llm_layout(lm, hf):
    """After resampling, siblings of one live parent copy its unfinished KV block on every rank that
    holds a share of it (TP) or a stage of it (PP), under the parent's adapter; rows match genlm-hf."""
    if lm.driver.layout.streaming:
        return
    lm.clear_cache()
    stats = lm.driver.sessions.stats
    copied = stats.tokens_copied
    parents = [list(range(50, 90)), list(range(60, 100))]  # 40 tokens: one full block of 32, 8 over
    seen = []
    for adapter in (None, "a"):
        lm.batch_next_token_logprobs_sync(parents, lora_name=adapter)
        children = [[*p, t] for p in parents for t in (1, 2, 3)]
        rows = lm.batch_next_token_logprobs_sync(children, lora_name=adapter)
        seen += list(zip(rows, hf.batch_next_token_logprobs_sync(children, lora_name=adapter), strict=True))
    assert stats.tokens_copied - copied == 2 * 2 * 2 * 8  # per adapter, per parent: two forks of 8 tokens
    diff = max(bounds.row_difference(r, w) for r, w in seen)
    bounds.within("vllm modes: forks vs hf", diff, tol([[*p, t] for p in parents for t in (1, 2, 3)]))


def test_the_whole_public_surface(lm, hf):
    """check_lm_contract (rows on every path, output cache, sampling, bad input, cancellation) and the
    uncached reference row, in this layout."""
    contexts = [[1], [5, 6, 7], list(range(100, 140))]
    check_lm_contract(lm, contexts, atol=tol)
    uncached = [lm.next_token_logprobs_uncached(c) for c in contexts]
    diff = max_diff(uncached, [hf.next_token_logprobs_sync(c) for c in contexts])
    bounds.within("vllm modes: uncached vs hf", diff, tol(contexts))


def test_layout_is_what_was_asked(lm):
    lay = lm.driver.layout
    assert lm.driver.runner == "v1"  # vLLM's CPU build: the V1 runner, and its capture
    assert lay.capture == ("rpc" if lm.options.capture == "rpc" else "shm")
    assert lay.spawns and (lay.multiprocess or lay.world_size == 2)


def test_where_particles_cannot_be_running_requests_sessions_serve_and_say_why(lm):
    """No layout here runs the model in this process, so particles continue as resumable sessions (the rows
    are checked above), and the engine keeps the one reason it logged, the one this layout has."""
    lay = lm.driver.layout
    if lay.streaming:  # AsyncLLM streams requests one by one: no sessions, nothing to say
        return
    sessions = lm.driver.sessions
    assert sessions.engine.resident is None
    if lay.multiprocess:
        want = "the engine core runs in another process"
    elif lay.pipeline_parallel > 1:
        want = "the engine core queues batches (pipeline parallel or async scheduling)"
    else:
        want = "the model runs in worker processes"
    assert sessions.not_resident == want


def rank_cores(world_size: int) -> list[set[int]]:
    """The cores genlm-vllm binds each rank of an engine in this process to (``VLLM_CPU_OMP_THREADS_BIND``)."""
    ranks = []
    for part in threads_bind(world_size, allowed_cores()).split("|"):
        cores: set[int] = set()
        for piece in part.split(","):
            first, _, last = piece.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        ranks.append(cores)
    return ranks


def test_engine_processes_start_as_asked(lm):
    """start_method 'auto' on vLLM's CPU build: an engine core is forked from this process's fork server (which
    imported vLLM once), and so are the tensor/pipeline-parallel workers of an engine in this process where each
    rank has one core (2 cores here); each thread of a worker runs on its rank's cores, as OpenMP binds a spawned
    one. Everything of an engine asked to spawn is spawned by this process, and an engine core's workers by the
    engine core."""
    processes = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    cores = [p for p in processes if p.name().startswith("VLLM::EngineCore")]
    assert len(cores) == lm.driver.layout.multiprocess
    server = start_processes._server_pid
    forked = lm.options.start_method == "auto"
    for core in cores:
        assert core.ppid() == (server if forked else os.getpid()), (core.name(), server)
    workers = [p for p in processes if p not in cores]
    assert workers
    ranks = rank_cores(lm.driver.layout.world_size)
    one_core_each = all(len(r) == 1 for r in ranks)  # GNU OpenMP then binds every thread of a rank alike
    for worker in workers:
        if cores:
            assert worker.ppid() in {core.pid for core in cores}, worker.name()
        else:
            assert worker.ppid() == (server if forked and one_core_each else os.getpid()), (worker.name(), server)
    if lm.driver.layout.world_size > 1:
        for worker in workers:
            rank = int(worker.name()[-1])  # VLLM::Worker_TP1
            on = {t.id: os.sched_getaffinity(t.id) for t in worker.threads()}
            assert all(threads <= ranks[rank] for threads in on.values()), (worker.name(), ranks, on)


def test_workers_nap_between_steps_unless_asked_to_spin(lm):
    """worker_wait 'auto' on vLLM's CPU build: in the second after a step, when vLLM's workers would spin
    for the next one, they sleep between checks and use a small share of a core; the layout that asks for
    'spin' (vLLM's own wait) keeps each worker runnable all the while.

    The bound for a napper: each check sleeps NAP_S (0.5 ms) and then costs some CPU; at half a core a
    check would cost as much as the nap itself, where one costs 15-50 µs (3% of a core on a quiet machine,
    9% on a CI machine, 5x under the bound), while a spinner on its rank's core reads 100%. CPU time is read
    per thread in nanoseconds (schedstat), not in 10 ms clock ticks, and over the time actually slept."""
    workers = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::Worker")]
    assert workers

    def schedstat(worker: psutil.Process) -> tuple[float, float]:
        # (on a CPU, on a CPU plus waiting for one) in seconds, over the worker's threads
        # (/proc/<pid>/task/*/schedstat): a spinner that yields stays runnable however busy the machine is,
        # while its CPU time is whatever share it gets.
        on_cpu = waiting = 0
        for task in Path(f"/proc/{worker.pid}/task").iterdir():
            ran, waited, _ = (task / "schedstat").read_text().split()
            on_cpu, waiting = on_cpu + int(ran), waiting + int(waited)
        return on_cpu / 1e9, (on_cpu + waiting) / 1e9

    lm.clear_cache()
    lm.next_token_logprobs_sync([1, 2, 3])
    before, start = [schedstat(w) for w in workers], time.monotonic()
    time.sleep(0.8)  # within the second after the step
    after, elapsed = [schedstat(w) for w in workers], time.monotonic() - start
    share = [(a[0] - b[0]) / elapsed for a, b in zip(after, before, strict=True)]
    runnable = [(a[1] - b[1]) / elapsed for a, b in zip(after, before, strict=True)]
    if lm.options.worker_wait == "spin":
        assert min(runnable) > 0.6, runnable
    else:
        assert max(share) < 0.5, share


def test_the_callers_torch_threads_are_left_as_they_were(lm, request):
    # vLLM's executor sets them to 1 in the process it runs in; an in-process CPU engine started
    # later in this process then failed with "thread_num == thread_num (2 vs. 1)".
    before, after = THREADS_AFTER_START[request.node.callspec.params["lm"]]
    assert after == before


def test_rows_match_hf_single_and_batched(lm, hf):
    contexts = [[1], [5, 6, 7], list(range(100, 160)), [3, 3, 3, 3], [50000, 2, 50256]]
    want = [hf.next_token_logprobs_sync(c) for c in contexts]
    singles = []
    for c in contexts:
        lm.clear_cache()
        singles.append(lm.next_token_logprobs_sync(c))
    bounds.within("vllm modes: single vs hf", max_diff(singles, want), tol(contexts))
    lm.clear_cache()
    batched = gather(lm, contexts)
    bounds.within("vllm modes: batched vs hf", max_diff(batched, want), tol(contexts))
    for row in batched:
        assert row.dtype == torch.float32 and row.shape == (len(lm.byte_vocab),)
    assert kept_rows(lm) == 0


def test_300_concurrent_requests_over_100_contexts(lm, hf):
    lm.clear_cache()
    g = torch.Generator().manual_seed(1)
    contexts = [
        torch.randint(0, 50257, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (100,), generator=g)
    ]
    order = [i % 100 for i in range(300)]
    order = [order[i] for i in torch.randperm(300, generator=g).tolist()]
    calls = lm.driver.batches
    rows = gather(lm, [contexts[i] for i in order])
    want = hf.batch_next_token_logprobs_sync(contexts)
    bounds.within("vllm modes: 300 concurrent vs hf", max_diff(rows, [want[i] for i in order]), tol(contexts))
    # equal contexts share one row: one generate of 100 prompts, or 100 streamed requests
    assert lm.driver.batches - calls == (100 if lm.driver.layout.streaming else 1)
    assert kept_rows(lm) == 0


def test_prompt_longer_than_max_num_batched_tokens(lm, hf):
    """1,500 tokens with a 512-token budget: three prefill chunks, each producing a row; the last stays."""
    ctx = [(i * 13) % 4000 + 5 for i in range(1500)]
    diff = max_diff([lm.next_token_logprobs_sync(ctx)], [hf.next_token_logprobs_sync(ctx)])
    bounds.within("vllm modes: chunked prefill vs hf", diff, tol([ctx]))


def test_lora_per_request(lm, hf):
    lm.clear_cache()
    contexts = [[3, 4, 5, 6], [7, 8], [3, 4, 5, 6]]
    adapters = [None, "a", "a"]

    async def both():
        return await asyncio.gather(*(lm.next_token_logprobs(c, lora_name=a) for c, a in zip(contexts, adapters)))

    rows = asyncio.run(both())
    want = [hf.next_token_logprobs_sync(c, lora_name=a) for c, a in zip(contexts, adapters)]
    bounds.within("vllm modes: lora per request vs hf", max_diff(rows, want), tol(contexts))
    assert max_diff([rows[0]], [rows[2]]) > 0.05  # the adapter really changed the row


def test_sample(lm, hf):
    greedy = asyncio.run(hf.sample([5, 6], 6, eos_token_ids=[], temperature=0))
    assert asyncio.run(lm.sample([5, 6], 6, eos_token_ids=[], temperature=0)) == greedy
    stop = greedy[2]
    assert asyncio.run(lm.sample([5, 6], 6, eos_token_ids=[stop], temperature=0)) == greedy[: greedy.index(stop)]
    outs = asyncio.run(lm.batch_sample([[1], [2, 3], [4, 5, 6]], 4, eos_token_ids=[], seed=0))
    assert [len(o) for o in outs] == [4, 4, 4]
    lora = asyncio.run(lm.sample([5, 6], 6, eos_token_ids=[], temperature=0, lora_name="a"))
    assert lora == asyncio.run(hf.sample([5, 6], 6, eos_token_ids=[], temperature=0, lora_name="a"))


def test_rows_of_failed_or_cancelled_requests_are_freed(lm, hf, monkeypatch):
    lm.clear_cache()
    contexts = [[11, i, i + 1] for i in range(40)]
    if lm.driver.layout.streaming:

        async def cancel_half():
            tasks = [asyncio.ensure_future(lm.next_token_logprobs(c)) for c in contexts]
            await asyncio.sleep(0.05)
            for t in tasks[::2]:
                t.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(cancel_half())
        kept = [(c, r) for c, r in zip(contexts, results) if isinstance(r, torch.Tensor)]
        assert len(kept) >= 20  # the uncancelled half, and cancelled ones that had finished
        diff = max_diff([r for _, r in kept], [hf.next_token_logprobs_sync(c) for c, _ in kept])
        bounds.within("vllm modes: beside cancelled vs hf", diff, tol([c for c, _ in kept]))
    else:
        owner, name = (
            (lm.driver.sessions.live, "run") if lm.driver.sessions is not None else (lm.driver, "generate")
        )  # runs the batch
        run = getattr(owner, name)

        def fails_after_running(*args, **kwargs):
            run(*args, **kwargs)
            raise RuntimeError("lost on the way back")

        monkeypatch.setattr(owner, name, fails_after_running)
        with pytest.raises(RuntimeError, match="lost on the way back"):
            lm.batch_next_token_logprobs_sync(contexts)
        monkeypatch.undo()
    lm.clear_cache()
    after = [[12, 13], [14]]
    diff = max_diff(gather(lm, after), [hf.next_token_logprobs_sync(c) for c in after])
    bounds.within("vllm modes: after a failed batch vs hf", diff, tol(after))
    assert kept_rows(lm) == 0  # rpc: the failed rows were dropped with the next fetch; shm: no slot held


def test_exactly_one_rank_writes_rows(lm):
    where = lm.call_workers("genlm_where")
    assert len(where) == lm.driver.layout.world_size
    writers = [w for w in where if w["writer"]]
    assert len(writers) == 1
    assert writers[0]["tp_rank"] == 0 and writers[0]["pp_rank"] == lm.driver.layout.pipeline_parallel - 1


def test_the_selftest_passes_and_catches_a_row_that_disagrees_with_vllm(lm, monkeypatch):
    from genlm_vllm.tools import selftest

    contexts = selftest.contexts_for(lm.vocab_size, n=4)
    report = selftest.check(lm, contexts, batch_tol=tol(contexts))
    assert report.ok, report.lines()
    assert report.max_diff_vs_engine <= report.tolerance_vs_engine  # two log-softmaxes of the same logits
    assert len(report.workers) == lm.driver.layout.world_size
    engine_top = lm.engine_top_logprobs

    def shifted(contexts, k):  # as if the rows had been computed for other weights
        return [{i: lp + 0.01 for i, lp in top.items()} for top in engine_top(contexts, k)]

    monkeypatch.setattr(lm, "engine_top_logprobs", shifted)
    report = selftest.check(lm, contexts, batch_tol=tol(contexts))
    assert not report.ok and "differs from vLLM's logprobs by 1.00e-02" in report.problems[0]


def test_the_selftest_command_reports_and_exits_by_its_result(lm, path, monkeypatch, capsys):
    import genlm_core
    from genlm_vllm.tools import selftest

    asked = {}

    def load(name, backend, llm_opts):
        asked.update(name=name, backend=backend, llm_opts=llm_opts)
        return lm

    monkeypatch.setattr(genlm_core, "load_model_by_name", load)
    monkeypatch.setattr(lm, "cleanup", lambda: asked.update(cleaned=True))  # the fixture closes it
    assert selftest.main([path, "--options", '{"replicas": 1}']) == 0
    assert asked == {"name": path, "backend": "vllm", "llm_opts": {"replicas": 1}, "cleaned": True}
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("OK") and "(writes rows)" in printed


# Last in this module, so last for its layout: it kills the engine the layout's other tests shared (pytest
# runs a module-scoped fixture's tests param by param, in the order they are written here).
@pytest.mark.parametrize("lm", ["multiprocess", "async"], indirect=True)
def test_killed_worker_fails_requests_and_cleanup_leaves_nothing(lm, request):
    """A worker of a multiprocess engine is killed: requests fail clearly, and cleanup() leaves no process
    and no shared-memory file behind (ours, or those vLLM's processes made)."""
    before = SHM_BEFORE_START[request.node.callspec.params["lm"]]
    me = psutil.Process()
    engine_processes = [p for p in me.children(recursive=True) if p.name().startswith("VLLM::")]
    worker = next(p for p in engine_processes if "Worker" in p.name())
    lm.clear_cache()
    lm.next_token_logprobs_sync([1, 2, 3])
    assert lm.driver.files is not None and lm.driver.files.files()  # vLLM made queues at start, with the tag
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
    assert left_since(before) == set()  # vLLM's queue files of the dead processes too
    with pytest.raises(ClosedError):
        asyncio.run(lm.next_token_logprobs([1]))
