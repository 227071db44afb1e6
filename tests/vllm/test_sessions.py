"""Live sessions: particles continue their sequence in the engine, and every row stays exact.

On the tiny engine of ``conftest.py``. The reference for each row is ``next_token_logprobs_uncached``:
a plain generate of the full context alone, salted so that it shares no cached KV block with anything.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core.testing import bounds
from genlm_vllm.start.engine_args import CPU_BLOCK_SIZE


def check_rows(engine, seen: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """Every row equals the uncached row of its context, within 4 x the model's float32 error on them (the
    session's KV was computed in other steps and batches: bounds.rows_bound)."""
    worst = max(bounds.row_difference(row, engine.next_token_logprobs_uncached(list(c))) for c, row in seen)
    tol = bounds.rows_bound(engine.tokenizer.name_or_path)([c for c, _ in seen])
    bounds.within("vllm sessions: rows vs uncached", worst, tol)


def test_cpu_default_block_size_is_the_smallest_the_engine_accepts(engine):
    assert engine.driver.engine.llm_engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE


@pytest.mark.sized(steps=(50, 300))
async def test_smc_with_resampling_cancellation_and_early_stops_is_exact(engine, steps):
    """``steps`` steps of 12 particles: each step continues live sessions; resampling forks; some
    requests are cancelled, some particles stop, one goes back to an older context, two race."""
    rng = random.Random(0)
    engine.clear_cache()
    sessions = engine.driver.sessions
    sessions.stats.__init__()
    prompt = tuple(rng.randrange(100, 5000) for _ in range(40))
    particles = [prompt] * 12
    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []
    cancelled = 0
    for step in range(steps):
        contexts = list(particles)
        if step % 37 == 5:
            contexts.append(contexts[0][:-2] if len(contexts[0]) > len(prompt) + 2 else prompt)  # an older context
        if step % 11 == 3 and len(contexts) > 1:
            contexts.append(contexts[1])  # two particles racing on one context
        tasks = [asyncio.ensure_future(engine.next_token_logprobs(list(c))) for c in contexts]
        doomed = {i for i in range(len(tasks)) if rng.random() < 0.05}
        await asyncio.sleep(0)  # submitted: the batch is being computed
        for i in doomed:
            tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        next_particles = []
        for i, (context, row) in enumerate(zip(contexts, results, strict=True)):
            if isinstance(row, asyncio.CancelledError):
                cancelled += 1
                continue
            seen.append((context, row))
            if i < len(particles):
                if rng.random() < 0.01 and len(particles) > 4:
                    continue  # this particle stops early
                token = int(torch.multinomial(row.exp(), 1, generator=torch.Generator().manual_seed(step * 97 + i)))
                next_particles.append((*context, token))
        if step % 10 == 9 and next_particles:  # multinomial resampling: forks of equal contexts
            next_particles = [rng.choice(next_particles) for _ in range(len(particles))]
        particles = next_particles or [prompt]
        if step % 97 == 96:
            engine.clear_cache()  # the output cache and the sessions, dropped now and then
    assert cancelled > 0
    stats = sessions.stats
    assert stats.continued >= 0.8 * stats.rows, stats  # particles really stayed alive
    assert stats.tokens_cached > 0, stats  # forks and fallbacks hit vLLM's prefix cache
    assert stats.tokens_copied > 0, stats  # forks copied their parent's unfinished block
    check_rows(engine, rng.sample(seen, min(400, len(seen))))  # every row of a short run


async def test_forks_compute_only_their_own_token(engine):
    """Children of one parent: one continues it; each other child takes the parent's full blocks
    from the prefix cache and its unfinished block by copy (genlm_vllm.in_engine.forks), and runs one token."""
    engine.clear_cache()
    base = tuple(range(200, 300))  # 100 tokens: three full blocks of 32, four tokens over
    await engine.next_token_logprobs(list(base))
    stats = engine.driver.sessions.stats
    stats.__init__()
    children = [(*base, t) for t in (5, 6, 7, 8)]
    rows = await asyncio.gather(*(engine.next_token_logprobs(list(c)) for c in children))
    assert stats.continued == 1
    assert stats.tokens_computed == 4, stats
    assert stats.tokens_cached == 3 * 3 * CPU_BLOCK_SIZE, stats
    assert stats.tokens_copied == 3 * (len(base) - 3 * CPU_BLOCK_SIZE), stats
    grandchildren = [(*c, 9) for c in children] + [(*children[0], 10)]  # every child's session lives on
    more = await asyncio.gather(*(engine.next_token_logprobs(list(c)) for c in grandchildren))
    assert stats.continued == 1 + 4 and stats.tokens_copied == 3 * 4 + 5, stats
    check_rows(engine, list(zip(children + grandchildren, rows + more, strict=True)))


def test_continued_particles_stay_running_requests_and_only_forks_are_added(engine, monkeypatch):
    """A particle continued by one token keeps its vLLM request running (its next input the program's
    token): no request is added for it, and a step of continued particles is one engine step. After
    resampling only the forks (second and later children of a parent) are added. Every row is exact."""
    engine.clear_cache()
    sessions = engine.driver.sessions
    assert sessions.engine.resident is not None  # the in-process engine keeps particles as running requests
    assert sessions.not_resident == ""
    core = sessions.core
    added: list[str] = []
    steps: list[int] = []
    add_chunk, step = core.add_chunk, core.step

    def counting_add(request_id, *args, **kwargs):
        added.append(request_id)
        return add_chunk(request_id, *args, **kwargs)

    def counting_step():
        steps[-1] += 1
        return step()

    monkeypatch.setattr(core, "add_chunk", counting_add)
    monkeypatch.setattr(core, "step", counting_step)
    rng = random.Random(3)
    particles = [(*range(700, 745), t) for t in range(8)]  # 46 tokens: a block and a part
    seen = []
    for n in range(8):
        before = len(added)
        steps.append(0)
        rows = engine.batch_next_token_logprobs_sync([list(p) for p in particles])
        seen += list(zip(particles, rows, strict=True))
        if n == 0:
            assert len(added) - before == len(particles)  # new contexts
        elif n % 3 == 0:  # the step after resampling: one request per fork
            assert len(added) - before == len(particles) - len(set(p[:-1] for p in particles)), (n, added)
        else:
            assert (len(added) - before, steps[-1]) == (0, 1), (n, added[before:], steps)
        if n % 3 == 2:  # multinomial resampling: duplicated, reordered parents
            particles = [rng.choice(particles) for _ in particles]
        particles = [(*p, rng.randrange(1000, 30000)) for p in particles]
    check_rows(engine, seen)


def test_a_token_replaced_where_it_completes_a_block_is_cached_as_the_programs(engine):
    """vLLM samples its own token after each row of a running request; where that token completes a KV
    block, vLLM hashes the block with it. The program's token replaces it, and the block must enter the
    prefix cache under the program's token: a later context that holds vLLM's token there must not be
    served the program's KV (its row would be another context's)."""
    engine.clear_cache()
    context = list(range(900, 900 + CPU_BLOCK_SIZE - 1))  # its next token completes the first block
    row = engine.next_token_logprobs_sync(context)
    sampled = int(row.argmax())  # what vLLM's greedy sampler drew: the block's hash was taken with it
    chosen = next(t for t in range(5, 50) if t != sampled)
    rows = [engine.next_token_logprobs_sync([*context, chosen]), engine.next_token_logprobs_sync([*context, chosen, 7])]
    other = [*context, sampled, 7]  # shares the first block's hash only if it was left as vLLM's
    seen = [(tuple(context), row), ((*context, chosen), rows[0]), ((*context, chosen, 7), rows[1])]
    seen.append((tuple(other), engine.next_token_logprobs_sync(other)))
    check_rows(engine, seen)


def test_a_resampled_steps_rows_come_back_as_one_block_without_a_copy(engine, monkeypatch):
    """After resampling, the engine's batch holds the particles in another order than the caller's; the
    capture gathers each step's rows in the caller's order (by tag), so they come back as consecutive rows
    of one block and are not stacked again (issue 58 point 3); every row is still its context's."""
    import genlm_vllm.live as sessions

    engine.clear_cache()
    base = tuple(range(300, 340))
    parents = [(*base, t) for t in range(6)]
    engine.batch_next_token_logprobs_sync([list(base)])
    engine.batch_next_token_logprobs_sync([list(p) for p in parents])
    copies: list[bool] = []
    rows_block = sessions.rows_block

    def watched(rows):
        out = rows_block(rows)
        copies.append(out.data_ptr() != rows[0].data_ptr())
        return out

    monkeypatch.setattr(sessions, "rows_block", watched)
    seen = []
    for step in range(3):  # children of a resampled population: duplicated, reordered parents
        children = [(*parents[i], 50 + step) for i in (5, 5, 0, 2, 2, 1)]
        children[1] = (*children[1][:-1], 60 + step)
        rows = engine.batch_next_token_logprobs_sync([list(c) for c in children])
        seen += list(zip(children, rows, strict=True))
        parents = children
    assert copies and not any(copies), copies
    check_rows(engine, seen)


def test_an_in_process_engines_rows_come_back_up_the_call_that_asked(engine, monkeypatch):
    """The engine runs in this process: each batch's rows (continued, forked and fresh sessions, and the
    uncached reference's plain batch) come back in the inbox that batch opened, none through the
    process-wide mailbox by tag (issue 57 point 4); every row is its context's."""
    from genlm_vllm.transport import mailbox

    assert engine.driver.layout.capture == "local"
    kept: list[str] = []
    keep = mailbox.keep
    monkeypatch.setattr(mailbox, "keep", lambda tag, row: (kept.append(tag), keep(tag, row)))
    engine.clear_cache()
    base = tuple(range(400, 430))
    seen = []
    contexts = [(*base, t) for t in range(4)]
    for step in range(3):
        rows = engine.batch_next_token_logprobs_sync([list(c) for c in contexts])
        seen += list(zip(contexts, rows, strict=True))
        contexts = [(*contexts[i], 70 + step) for i in (0, 0, 3, 1)]  # a fork, a dropped particle
    check_rows(engine, seen)
    assert kept == [] and mailbox.waiting() == 0


async def test_a_fork_at_a_block_boundary_copies_nothing(engine):
    engine.clear_cache()
    base = tuple(range(600, 600 + 2 * CPU_BLOCK_SIZE))
    await engine.next_token_logprobs(list(base))
    stats = engine.driver.sessions.stats
    stats.__init__()
    children = [(*base, t) for t in (5, 6, 7)]
    rows = await asyncio.gather(*(engine.next_token_logprobs(list(c)) for c in children))
    assert stats.tokens_copied == 0 and stats.tokens_computed == 3, stats  # all from the prefix cache
    check_rows(engine, list(zip(children, rows, strict=True)))


async def test_a_fork_naming_the_wrong_parent_recomputes(engine, monkeypatch):
    """The connector checks the parent's tokens: a fork pointed at another sequence loads nothing."""
    engine.clear_cache()
    a, b = tuple(range(700, 740)), tuple(range(800, 840))
    await asyncio.gather(engine.next_token_logprobs(list(a)), engine.next_token_logprobs(list(b)))
    sessions = engine.driver.sessions
    handles = {key.token_ids: h for key, h in sessions.live.sequences()}
    other = {handles[a]: handles[b], handles[b]: handles[a]}
    copy = sessions.engine.copy

    def crossed(source, target, length):  # each fork names the other parent
        return copy(other.get(source, source), target, length)

    monkeypatch.setattr(sessions.engine, "copy", crossed)
    stats = engine.driver.sessions.stats
    stats.__init__()
    children = [(*a, 1), (*a, 2), (*b, 1), (*b, 2)]
    rows = await asyncio.gather(*(engine.next_token_logprobs(list(c)) for c in children))
    assert stats.continued == 2 and stats.tokens_copied == 0, stats
    assert stats.tokens_computed == 2 + 2 * (len(a) + 1 - CPU_BLOCK_SIZE), stats
    check_rows(engine, list(zip(children, rows, strict=True)))


async def test_sampling_and_cache_clearing_between_steps_release_sessions(engine):
    engine.clear_cache()
    ids = list(range(300, 340))
    row = await engine.next_token_logprobs(ids)
    assert len(engine.driver.sessions.live) == 1
    sample = await engine.sample(ids, 5, eos_token_ids=[], seed=1)  # a generate: needs an idle engine
    assert len(sample) == 5 and len(engine.driver.sessions.live) == 0
    rows = await asyncio.gather(*(engine.next_token_logprobs(ids + [t]) for t in (1, 2)))
    check_rows(engine, [(tuple(ids), row), ((*ids, 1), rows[0]), ((*ids, 2), rows[1])])


def test_a_chunk_on_another_context_than_its_tag_gets_no_row(engine, monkeypatch):
    """The capture processor checks each chunk's context: a bookkeeping slip is a missing row."""
    engine.clear_cache()
    ids = list(range(400, 420))
    engine.next_token_logprobs_sync(ids)
    assert len(engine.driver.sessions.live) == 1
    monkeypatch.setattr("genlm_vllm.live.context_fingerprint", lambda ids: [len(ids), 12345])
    with pytest.raises(RuntimeError, match="no logits for 1 of 1"):
        engine.next_token_logprobs_sync([*ids, 9])
    monkeypatch.undo()
    assert len(engine.driver.sessions.live) == 0  # a failed batch leaves no session alive
    check_rows(engine, [((*ids, 9), engine.next_token_logprobs_sync([*ids, 9]))])


def test_a_batch_failing_midway_leaves_nothing_parked(engine, monkeypatch):
    engine.clear_cache()
    ids = list(range(500, 530))
    engine.next_token_logprobs_sync(ids)  # one live session, continued by the failing batch below
    real = engine.driver.sessions.core.inputs.process_inputs

    def fails_the_new_context(request_id, prompt, *args, **kwargs):
        if list(prompt["prompt_token_ids"]) == [7, 8, 9]:  # after the continued one was given its token
            raise ValueError("rejected by the engine")
        return real(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine.driver.sessions.core.inputs, "process_inputs", fails_the_new_context)
    with pytest.raises(ValueError, match="rejected by the engine"):
        engine.batch_next_token_logprobs_sync([[*ids, 1], [7, 8, 9]])
    monkeypatch.undo()
    assert not engine.driver.engine.llm_engine.has_unfinished_requests()  # the continued session was aborted too
    assert len(engine.driver.sessions.live) == 0
    check_rows(engine, [((*ids, 1), engine.next_token_logprobs_sync([*ids, 1]))])


def test_a_step_split_across_batches_still_continues_every_session(engine):
    """A step's particles may reach the engine in several batches ("eager" flushes, or a program that
    awaits something else first): a session nobody continued in one batch is still there for the
    next, so every row computes one token. Sessions idle for MAX_IDLE_BATCHES batches are aborted."""
    from genlm_vllm.options import MAX_IDLE_BATCHES

    engine.clear_cache()
    prompt = list(range(1000, 1020))  # under one block: nothing would come from the prefix cache
    particles = [[*prompt, t] for t in range(8)]
    engine.batch_next_token_logprobs_sync(particles)
    stats = engine.driver.sessions.stats
    stats.__init__()
    seen = []
    for step in range(3):
        particles = [[*p, 7 + step] for p in particles]
        for part in (particles[:3], particles[3:5], particles[5:]):  # one step in three batches
            seen += zip(map(tuple, part), engine.batch_next_token_logprobs_sync(part), strict=True)
    assert (stats.rows, stats.continued, stats.tokens_computed) == (24, 24, 24), stats
    assert stats.tokens_cached == stats.tokens_copied == 0, stats
    # Resampled: particle 0's two children, one per batch. The second forks the session that moved past
    # its context in the first batch (it still holds that context): it copies it instead of computing it.
    first, second = [*particles[0], 1], [*particles[0], 2]
    seen += [(tuple(first), engine.next_token_logprobs_sync(first))]
    seen += [(tuple(second), engine.next_token_logprobs_sync(second))]
    assert (stats.rows, stats.continued, stats.tokens_computed) == (26, 25, 26), stats
    assert stats.tokens_copied == len(particles[0]), stats
    for _ in range(MAX_IDLE_BATCHES + 1):  # batches that continue nothing: the 8 sessions expire
        engine.cache.clear()
        engine.next_token_logprobs_sync([5, 6, 7])
    assert len(engine.driver.sessions.live) == 1  # only [5, 6, 7]'s own session is parked
    check_rows(engine, seen)


@pytest.mark.parametrize("flush", ["idle", "eager", "timeout"])
async def test_smc_is_exact_under_every_flush_policy(engine, flush):
    """A particle program that works on each row (blocking the event loop a little) under each flush
    policy: every row equals the fresh full-context row."""
    import time

    engine.clear_cache()
    batcher = engine.batcher
    before = batcher.flush
    batcher.flush = flush
    rng = random.Random(1)
    seen = []
    try:
        particles = [tuple(range(300, 330))] * 8

        async def step(context, i, s):
            row = await engine.next_token_logprobs(list(context))
            time.sleep(0.002)  # the particle's own work
            seen.append((context, row))
            g = torch.Generator().manual_seed(s * 31 + i)
            return (*context, int(torch.multinomial(row.exp(), 1, generator=g)))

        for s in range(12):
            particles = await asyncio.gather(*(step(c, i, s) for i, c in enumerate(particles)))
            if s % 4 == 3:
                particles = [rng.choice(particles) for _ in particles]
    finally:
        batcher.flush = before
    if flush == "eager":
        assert batcher.stats.eager_flushes > 0
    check_rows(engine, seen)


def test_the_shared_particle_check_of_core_passes_on_vllm_sessions(engine):
    """genlm_core.testing.live: the randomised program every live-sequence engine passes (rows equal the
    uncached rows, every placement ran, no session left in the engine once released)."""
    from genlm_core.testing.live import check_live_sequences

    engine.clear_cache()
    llm_engine = engine.driver.engine.llm_engine
    stats = check_live_sequences(
        engine,
        engine.driver.sessions.live,
        in_use=lambda: int(llm_engine.has_unfinished_requests()),
        steps=30,
        atol=bounds.rows_bound(engine.tokenizer.name_or_path),
    )
    assert stats.tokens_computed < stats.rows * 3, stats  # continued and forked rows computed their own token


async def test_a_chunk_vllm_ends_early_fails_only_its_request(engine, monkeypatch):
    """vLLM ends one chunk of a batch without its token (injected: its output has no new token). That
    request fails alone; the others' rows are exact and their sessions stay live and are continued by
    the next step, and the failed context computes again from the start when asked again."""
    engine.clear_cache()
    prompt = list(range(1100, 1120))
    particles = [[*prompt, t] for t in range(4)]
    engine.batch_next_token_logprobs_sync(particles)  # four live sessions
    sessions = engine.driver.sessions
    stats = sessions.stats
    stats.__init__()
    core = sessions.core
    step = core.step
    victims = {seq for request, seq in sessions.live.sequences() if request.token_ids == tuple(particles[3])}

    def step_ending_the_victim():
        outputs = step()
        for out in outputs:
            if out.request_id in victims:
                out.new_token_ids = []
        return outputs

    monkeypatch.setattr(core, "step", step_ending_the_victim)
    contexts = [[*p, 7] for p in particles[:3]] + [[*particles[3], 99]]
    results = await asyncio.gather(*(engine.next_token_logprobs(c) for c in contexts), return_exceptions=True)
    monkeypatch.undo()
    assert len(victims) == 1 and stats.batches == 1, (victims, stats)
    assert isinstance(results[3], RuntimeError) and "ended request" in str(results[3]), results[3]
    assert all(isinstance(row, torch.Tensor) for row in results[:3]), results
    assert (stats.rows, stats.continued) == (4, 4), stats
    assert sorted(c.token_ids for c in sessions.live.contexts()) == sorted(tuple(c) for c in contexts[:3])
    seen = list(zip(map(tuple, contexts[:3]), results[:3], strict=True))
    again = [[*c, 8] for c in contexts[:3]] + [contexts[3]]  # the survivors' next step, and the victim again
    rows = engine.batch_next_token_logprobs_sync(again)
    assert (stats.rows, stats.continued, stats.fresh) == (8, 7, 1), stats
    assert stats.tokens_computed == 4 + 3 + len(contexts[3]), stats
    seen += list(zip(map(tuple, again), rows, strict=True))
    check_rows(engine, seen)


# ---- resident requests (issue 58): the shapes a program's step can take -----------------------------


def added_requests(monkeypatch: pytest.MonkeyPatch, core) -> list[str]:
    """The request ids added to the engine from now on (new contexts, forks, re-runs)."""
    added: list[str] = []
    add_chunk = core.add_chunk

    def counting(request_id, *args, **kwargs):
        added.append(request_id)
        return add_chunk(request_id, *args, **kwargs)

    monkeypatch.setattr(core, "add_chunk", counting)
    return added


def run_step(engine, contexts, seen) -> list[torch.Tensor]:
    rows = engine.batch_next_token_logprobs_sync([list(c) for c in contexts])
    seen += list(zip(map(tuple, contexts), rows, strict=True))
    return rows


def test_a_particle_that_skips_a_step_stays_a_running_request(engine, monkeypatch):
    """A particle left out of a step keeps its request paused through an engine step it is not in
    (holding the token vLLM sampled); one token later it continues in place: nothing is added, and its
    row is its context's."""
    engine.clear_cache()
    added = added_requests(monkeypatch, engine.driver.sessions.core)
    particles = [(*range(1300, 1340), t) for t in range(4)]
    seen: list = []
    run_step(engine, particles, seen)
    before = len(added)
    run_step(engine, [(*p, 11) for p in particles[:3]], seen)  # the fourth skips this step
    run_step(engine, [(*p, 11, 12) for p in particles[:3]] + [(*particles[3], 13)], seen)
    run_step(engine, [(*p, 11, 12, 14) for p in particles[:3]] + [(*particles[3], 13, 15)], seen)
    assert added[before:] == [], added[before:]
    assert len(engine.driver.sessions.engine._residents) == 4
    check_rows(engine, seen)


def test_forks_of_a_fork_and_a_context_two_tokens_ahead_in_one_step(engine, monkeypatch):
    """One step holds three children of a fork made the step before (one continues the fork's request,
    two are forks of it) and a context two tokens past its particle's (its request runs again under the
    same id); the step after, all four continue in place. Every row is its context's."""
    engine.clear_cache()
    sessions = engine.driver.sessions
    added = added_requests(monkeypatch, sessions.core)
    base = tuple(range(1400, 1445))
    seen: list = []
    run_step(engine, [base], seen)
    a, b = (*base, 1), (*base, 2)
    run_step(engine, [a, b], seen)  # b is a fork of base's request
    before = len(added)
    step = [(*b, 3), (*b, 4), (*b, 5), (*a, 6, 7)]
    run_step(engine, step, seen)
    assert len(added) - before == 3, added[before:]  # two forks of the fork, one re-run
    before = len(added)
    run_step(engine, [(*c, 8) for c in step], seen)
    assert added[before:] == [], added[before:]
    check_rows(engine, seen)


def test_a_particle_that_takes_eos_runs_on_like_any_other(engine, monkeypatch):
    """Resident requests ignore EOS, vLLM's own sampled one and the program's: a program that keeps
    going past an EOS token (a multi-sentence particle, or one that asks what follows) continues the
    same request, and every row is its context's."""
    engine.clear_cache()
    added = added_requests(monkeypatch, engine.driver.sessions.core)
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    context: tuple[int, ...] = tuple(range(1500, 1530))
    seen: list = []
    for token in (eos, 17, eos, eos, 18):
        context = (*context, token)
        run_step(engine, [context], seen)
    assert len(added) == 1, added  # the first context only
    check_rows(engine, seen)


def test_a_particle_reaching_max_model_len_gets_each_row_then_a_clear_error(engine, monkeypatch):
    """A resident request may run to the engine's max_model_len: every row of a context shorter than that
    is its own (the last one ends vLLM's request); a context of max_model_len tokens has no next-token row
    in this engine, and asking for it fails that request alone with an error that says so."""
    engine.clear_cache()
    limit = engine.driver.sessions.core.max_model_len
    added = added_requests(monkeypatch, engine.driver.sessions.core)
    rng = random.Random(5)
    context = tuple(rng.randrange(100, 5000) for _ in range(limit - 4))
    seen: list = []
    for _ in range(3):
        context = (*context, rng.randrange(100, 5000))
        run_step(engine, [context, context[:40]], seen)  # a short particle beside it
    assert len(context) == limit - 1 and len(added) == 2, (len(context), added)
    too_long = [*context, 7]
    with pytest.raises(ValueError, match=str(limit)):
        engine.next_token_logprobs_sync(too_long)
    seen += [((*context[:40], 9), engine.next_token_logprobs_sync([*context[:40], 9]))]
    check_rows(engine, seen)


def test_residents_make_room_when_the_kv_budget_fills(engine, monkeypatch):
    """When the particles' contexts outgrow the engine's KV budget, live sequences keep what fits (the
    rest are released, aborted in vLLM, or never kept) and compute the others again from vLLM's prefix
    cache: what stays live always fits, vLLM holds no request beyond those, and no row is ever wrong."""
    engine.clear_cache()
    sessions = engine.driver.sessions
    monkeypatch.setattr(sessions.engine, "kv_budget", 6 * 64)  # six contexts of about 60 tokens
    stats = sessions.stats
    stats.__init__()
    rng = random.Random(9)
    particles = [tuple(rng.randrange(100, 5000) for _ in range(50)) for _ in range(4)]
    seen: list = []
    for step in range(12):
        if step % 4 == 3:  # new particles arrive while the old ones grow
            particles += [tuple(rng.randrange(100, 5000) for _ in range(50))]
        run_step(engine, particles, seen)
        particles = [(*p, rng.randrange(100, 5000)) for p in particles]
        live = list(sessions.live.sequences())
        assert sessions.engine.room(len(live), sum(len(key.token_ids) for key, _ in live)), step
        llm = engine.driver.engine.llm_engine.engine_core.engine_core
        assert set(llm.scheduler.requests) <= {seq for _, seq in live}
    assert stats.fresh > 5 + stats.evicted, stats  # contexts the budget could not keep live ran again
    check_rows(engine, seen)
