"""genlm-vllm on vLLM's CPU build against genlm-hf on the same tiny float32 model: the session's shared in-process
engine, then engines started and stopped in this process (marked ``layouts``)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core import ClosedError, load_model_by_name
from genlm_core.testing import bounds, check_lm_contract
from genlm_core.testing import concurrent_logprobs as gather
from genlm_core.testing import max_abs_diff as max_diff
from genlm_core.testing.bad_input import check_rejects_generated_bad_input
from genlm_hf import AsyncTransformer


@pytest.fixture(scope="module")
def hf(path):
    return AsyncTransformer.from_name(path, batch_size=64)


def test_matches_hf_single_and_batched(engine, hf, path):
    contexts = [[1], [5, 6, 7], list(range(100, 160)), [3, 3, 3, 3]]
    singles = []
    for c in contexts:
        engine.clear_cache()
        singles.append(engine.next_token_logprobs_sync(c))
    tol = bounds.rows_bound(path)(contexts)  # two float32 runs of the model: 4 x its float32 error
    bounds.within("vllm: single vs hf", max_diff(singles, [hf.next_token_logprobs_sync(c) for c in contexts]), tol)
    engine.clear_cache()
    batched = gather(engine, contexts)
    bounds.within("vllm: batched vs single", max_diff(batched, singles), tol)
    for row in batched:
        assert row.dtype == torch.float32 and row.shape == (len(engine.byte_vocab),)


@pytest.mark.sized(distinct=(100, 300))
def test_concurrent_requests_over_distinct_prompts(engine, hf, path, distinct):
    """``distinct`` prompts asked for by ten requests to every three (1,000 over 300 in the whole
    suite), far more than ``max_num_seqs`` (16): rows against genlm-hf's, in one batch."""
    engine.clear_cache()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 5000, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (distinct,), generator=g)
    ]
    order = torch.randint(0, distinct, (distinct * 10 // 3,), generator=g).tolist()
    calls = engine.driver.batches
    rows = gather(engine, [prompts[i] for i in order])
    reference = {i: hf.next_token_logprobs_sync(prompts[i]) for i in set(order)}
    tol = bounds.rows_bound(path)(prompts)
    bounds.within("vllm: concurrent requests vs hf", max_diff(rows, [reference[i] for i in order]), tol)
    # more prompts than max_num_seqs: vLLM split them over many scheduler steps, matched by tag
    assert engine.driver.batches - calls == 1


def test_prompt_longer_than_max_num_batched_tokens(engine, hf, path):
    ctx = [(i * 13) % 4000 + 5 for i in range(1500)]  # 3 prefill chunks of 512
    diff = max_diff([engine.next_token_logprobs_sync(ctx)], [hf.next_token_logprobs_sync(ctx)])
    bounds.within("vllm: chunked prefill vs hf", diff, bounds.rows_bound(path)([ctx]))


def test_sampling_batched_and_stops_on_eos(engine, hf):
    greedy = asyncio.run(hf.sample([5, 6], 6, eos_token_ids=[], temperature=0))
    assert asyncio.run(engine.sample([5, 6], 6, eos_token_ids=[], temperature=0)) == greedy
    stop = greedy[2]
    assert asyncio.run(engine.sample([5, 6], 6, eos_token_ids=[stop], temperature=0)) == greedy[: greedy.index(stop)]
    calls = engine.driver.batches
    outs = asyncio.run(engine.batch_sample([[1], [2, 3], [4, 5, 6]], 4, eos_token_ids=[], seed=0))
    assert [len(o) for o in outs] == [4, 4, 4] and engine.driver.batches - calls == 1


def test_missing_vllm_names_both_extras(monkeypatch):
    from genlm_vllm.plugin import unavailable_reason

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    reason = unavailable_reason()
    assert "genlm-vllm[cuda]" in reason and "genlm-vllm[cpu]" in reason


def test_contract_and_bad_input(engine, path):
    check_lm_contract(engine, [[1], [5, 6, 7], list(range(100, 140))], atol=bounds.rows_bound(path))
    check_rejects_generated_bad_input(engine, [1, 2, 3], max_examples=25, atol=bounds.rows_bound(path))


def test_tiny_temperature_samples_instead_of_crashing(engine):
    """vLLM raises temperatures below 0.01 to 0.01 itself; either way a token comes back."""
    out = asyncio.run(engine.sample([1, 2, 3], 4, [], temperature=1e-310, seed=1))
    assert len(out) == 4 and all(0 <= t < engine.vocab_size for t in out)


def test_context_past_max_model_len_is_refused_before_the_engine(engine):
    """vLLM needs room for the generated token: max_model_len=2048 admits contexts of 2047 tokens."""
    assert engine.context_limit == 2047
    calls = engine.driver.batches
    with pytest.raises(ValueError, match="2048 tokens, more than this model's limit of 2047 positions"):
        engine.next_token_logprobs_sync([1] * 2048)
    assert engine.driver.batches == calls


@pytest.mark.slow
@pytest.mark.layouts
def test_an_engine_collected_after_the_next_one_started_leaves_it_working(
    path, hf, engine_opts, shared_engine, request
):
    """cleanup() tears an in-process engine down at once (twice is fine; the closed model refuses every
    call): were it left to the garbage collector, its teardown would destroy vLLM's process-wide parallel
    groups under whichever engine runs then. A second and a third engine start in the same process.

    The first engine is the session's shared one (started here if no test has yet): closed here, it is
    started again by the next test that asks for it."""
    options = {"dtype": "float32", "max_model_len": 2048, "engine_opts": engine_opts}
    first = shared_engine.get(request.config)
    first.next_token_logprobs_sync([7, 8])
    core = first.driver.engine.llm_engine.engine_core
    first.cleanup()
    first.cleanup()  # twice is fine
    shared_engine.close()  # a third time; the session's fixture lets go of it (the next test to ask starts another)
    with pytest.raises(ClosedError, match="closed by cleanup"):
        first.next_token_logprobs_sync([7, 8])
    with pytest.raises(ClosedError, match="closed by cleanup"):
        asyncio.run(first.sample([7, 8], 2, []))
    assert not core._finalizer.alive  # shut down now: the garbage collector has nothing left to tear down
    del core
    second = load_model_by_name(path, backend="vllm", llm_opts=options)
    try:
        del first
        gc.collect()  # the first engine goes now, while the second runs
        contexts = [[7, 8], [7, 8, 9], [1, 2, 3, 4]]
        rows = second.batch_next_token_logprobs_sync(contexts)
        tol = bounds.rows_bound(path)(contexts)
        bounds.within("vllm: second engine vs hf", max_diff(rows, hf.batch_next_token_logprobs_sync(contexts)), tol)
    finally:
        second.cleanup()
    third = load_model_by_name(path, backend="vllm", llm_opts=options)  # failed: "... group is not initialized"
    try:
        rows = third.batch_next_token_logprobs_sync(contexts)
        bounds.within("vllm: third engine vs hf", max_diff(rows, hf.batch_next_token_logprobs_sync(contexts)), tol)
    finally:
        third.cleanup()


def mixed_particles_continue_exactly(lm: Any, path: str, adapter_dir: Any, ctx: list[int]) -> None:
    """Two particles per step in one batch, one under the base model and one under adapter ``a``, for
    four steps: the base one continues as a running vLLM request, the adapted one as a session (running
    requests take no adapter). Each row against the HF model (base) or the PEFT model (adapter) in
    float64, within the float32 error of either model on those contexts (measured, times four)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    steps = 4
    base_contexts = [[*ctx, *range(10, 10 + k)] for k in range(steps)]
    lora_contexts = [[*ctx, *range(20, 20 + k)] for k in range(steps)]
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        adapted = {
            dtype: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), adapter_dir)
            for dtype in (torch.float32, torch.float64)
        }

        def row(model: Any, context: list[int]) -> torch.Tensor:
            return torch.log_softmax(model(torch.tensor([context])).logits[0, -1].double(), -1)

        want_base = [row(plain, c) for c in base_contexts]
        want_lora = [row(adapted[torch.float64], c) for c in lora_contexts]
        lora32 = [row(adapted[torch.float32], c) for c in lora_contexts]
    measured = max(bounds.float32_error(path, base_contexts), max_diff(lora32, want_lora))
    tol = bounds.model_difference(measured, what="the base and the adapted model")
    lm.clear_cache()
    sessions = lm.driver.sessions
    assert sessions.engine.resident is not None  # the in-process engine: running requests for the base model

    async def both(k: int) -> list[torch.Tensor]:
        return list(
            await asyncio.gather(
                lm.next_token_logprobs(base_contexts[k]), lm.next_token_logprobs(lora_contexts[k], lora_name="a")
            )
        )

    before = sessions.stats.continued
    for k in range(steps):
        got = asyncio.run(both(k))
        bounds.within(f"vllm lora: mixed step {k}", max_diff(got, [want_base[k], want_lora[k]]), tol)
        live = {seq: request for request, seq in sessions.live.sequences()}
        running = [live[seq].token_ids for seq in live if seq in sessions.engine._residents]
        assert running == [tuple(base_contexts[k])], running  # the base particle's request, kept running
    assert sessions.stats.continued - before == 2 * (steps - 1), sessions.stats  # both particles continued


@pytest.mark.slow
@pytest.mark.layouts
def test_lora_per_request_matches_peft(path, tmp_path, engine_opts, alone):
    """Runs after the other engines are gone (one engine at a time in a process)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(tmp_path)
    ctx = [3, 4, 5, 6]
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        want_base = torch.log_softmax(plain(torch.tensor([ctx])).logits[0, -1], -1)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path)
        want_lora = torch.log_softmax(adapted(torch.tensor([ctx])).logits[0, -1], -1)
        exact_lora = torch.log_softmax(adapted.double()(torch.tensor([ctx])).logits[0, -1], -1)
    assert (want_lora - want_base).abs().max() > 0.1  # the adapter really changes the model
    # Two float32 runs of the base model or of the adapted one: 4 x the larger float32-vs-float64 error.
    measured = max(bounds.float32_error(path, [ctx]), max_diff(want_lora, exact_lora))
    tol = bounds.model_difference(measured, what="the base and the adapted model")
    lm = load_model_by_name(
        path,
        backend="vllm",
        llm_opts={
            "dtype": "float32",
            "max_model_len": 1024,
            "enable_lora": True,
            "max_lora_rank": 8,
            "engine_opts": {**engine_opts, "kv_cache_memory_bytes": 128 * 2**20},
        },
    )
    try:
        lm.load_lora(str(tmp_path), "a")
        bounds.within("vllm lora: base", max_diff([lm.next_token_logprobs_sync(ctx)], [want_base]), tol)
        lm.set_lora(None, "a")
        bounds.within(
            "vllm lora: adapter a", max_diff([lm.next_token_logprobs_sync(ctx)], [want_lora]), tol
        )  # adapter part of the cache key
        lm.clear_lora()
        bounds.within(
            "vllm lora: base after clear_lora", max_diff([lm.next_token_logprobs_sync(ctx)], [want_base]), tol
        )
        with pytest.raises(ValueError, match="not loaded"):
            lm.set_lora(None, "b")

        async def one_batch():  # plain and adapted requests in one engine step (vLLM's CPU kernels needed a fix)
            return await asyncio.gather(lm.next_token_logprobs(ctx), lm.next_token_logprobs(ctx, lora_name="a"))

        lm.clear_cache()
        bounds.within("vllm lora: one batch of both", max_diff(asyncio.run(one_batch()), [want_base, want_lora]), tol)
        mixed_particles_continue_exactly(lm, path, tmp_path, ctx)
        lm.add_new_lora(str(tmp_path), "c")  # genlm-backend's names: per-request lora_name, then remove
        bounds.within(
            "vllm lora: adapter c", max_diff([lm.next_token_logprobs_sync(ctx, lora_name="c")], [want_lora]), tol
        )
        bounds.within("vllm lora: base beside c", max_diff([lm.next_token_logprobs_sync(ctx)], [want_base]), tol)
        lm.remove_lora("c")
        with pytest.raises(ValueError, match="not loaded"):
            lm.next_token_logprobs_sync(ctx, lora_name="c")
    finally:
        lm.cleanup()
