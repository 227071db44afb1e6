"""genlm-hf against an uncached, unbatched forward pass of the same model: max |Δ logprob| within 4 x the
model's float32-vs-float64 error on the same contexts (genlm_core.testing.bounds.rows_bound)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from genlm_core import OptionsError, load_model_by_name
from genlm_core.testing import bounds, check_lm_contract
from genlm_core.testing import concurrent_logprobs as gather
from genlm_core.testing.models import tiny_model_dir
from genlm_hf import AsyncTransformer
from genlm_hf.lm import kv_reuse_problem, load_kwargs
from genlm_hf.options import HFOptions

from .conftest import Reference, check_rows, max_error


def make(path, **kwargs):
    return AsyncTransformer.from_name(path, **{"batch_size": 16, "timeout": 0.005, **kwargs})


@pytest.fixture(scope="module", autouse=True)
def tokenizers_loaded_once(loaded_once):
    """Every test builds its own model through ``from_name``; only the tokenizer, which genlm-hf reads and
    never changes, is loaded once per model folder and its arguments (0.6 s a load here, 21 builds a model)."""
    from genlm_hf import transformers_api

    with loaded_once(transformers_api, "load_tokenizer"):
        yield


def test_contract(tiny):
    path, _ = tiny
    check_lm_contract(make(path), [[1], [5, 6, 7], list(range(100, 140))], atol=bounds.rows_bound(path), close=True)


def test_concurrent_ragged_batches(tiny):
    path, ref = tiny
    lm = make(path)
    g = torch.Generator().manual_seed(0)
    contexts = [
        torch.randint(0, 5000, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (24,), generator=g)
    ]
    rows = gather(lm, contexts)
    check_rows("concurrent_ragged_batches", rows, contexts, ref)
    assert lm.forward_calls == 2  # 24 requests, batch size 16


@pytest.mark.sized(steps=(6, 20))
def test_deep_prefix_reuse_computes_only_new_tokens(tiny, steps):
    path, ref = tiny
    lm = make(path)
    prompt = list(range(1000, 1400))  # 400 tokens
    lm.next_token_logprobs_sync(prompt)
    ctx = list(prompt)
    for step in range(steps):
        ctx.append(step * 7 + 3)
        before = lm.tokens_computed
        row = lm.next_token_logprobs_sync(ctx)
        assert lm.tokens_computed - before == 1  # only the new token went through the model
        check_rows("deep_prefix_reuse_computes_only_new_tokens", [row], [ctx], ref)
    # branching off deep inside the cached context reuses the longest cached prefix
    branch = prompt + [5, 5, 5]
    before = lm.tokens_computed
    check_rows("deep_prefix_reuse_computes_only_new_tokens", [lm.next_token_logprobs_sync(branch)], [branch], ref)
    assert lm.tokens_computed - before == 3


def test_mixed_sync_and_async_calls(tiny):
    path, ref = tiny
    lm = make(path, timeout=0.001)
    base = list(range(200, 260))
    async_contexts = [base + [i, i + 1] for i in range(30)]
    sync_contexts = [base + [i] * (1 + i % 4) for i in range(30)]
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("rows", gather(lm, async_contexts)))
    thread.start()
    sync_rows = [lm.next_token_logprobs_sync(c) for c in sync_contexts]
    thread.join(120)
    check_rows("mixed_sync_and_async_calls", box["rows"], async_contexts, ref)
    check_rows("mixed_sync_and_async_calls", sync_rows, sync_contexts, ref)


def test_different_cached_prefixes_identical_suffixes(tiny):
    path, ref = tiny
    lm = make(path)
    a, b = list(range(10, 40)), list(range(600, 650))
    gather(lm, [a, b])
    contexts = [a + [7, 8, 9], b + [7, 8, 9], [7, 8, 9]]
    rows = gather(lm, contexts)
    check_rows("different_cached_prefixes_identical_suffixes", rows, contexts, ref)
    assert not torch.allclose(rows[0], rows[1])  # the seed's dedup ignored the prefix here


def test_correct_after_eviction(tiny):
    path, ref = tiny
    lm = make(path, kv_cache_entries=3, cache_size=0)
    contexts = [[i] * 5 + list(range(20)) for i in range(12)]
    for c in contexts:
        lm.next_token_logprobs_sync(c)
    assert len(lm.kv) <= 3
    again = [c + [1] for c in contexts]  # most prefixes were evicted: recomputed from scratch
    check_rows("correct_after_eviction", gather(lm, again), again, ref)
    lm_bytes = make(path, kv_cache_bytes=1, cache_size=0)  # every older block evicted at once
    for c in contexts:
        lm_bytes.next_token_logprobs_sync(c)
    check_rows("correct_after_eviction", gather(lm_bytes, again), again, ref)


def test_resampled_particles_reuse_their_rows(tiny):
    path, ref = tiny
    lm = make(path)
    particles = [[1, 2, i] for i in range(8)]
    gather(lm, particles)
    resampled = [particles[i] + [9] for i in (3, 3, 0, 7, 7, 7, 1, 2)]  # duplicated and reordered
    before = lm.tokens_computed
    rows = gather(lm, resampled)
    check_rows("resampled_particles_reuse_their_rows", rows, resampled, ref)
    assert lm.tokens_computed - before == 5  # distinct new contexts, one token each


def test_an_smc_step_runs_as_hf_s_own_decode_step(tiny, monkeypatch):
    """Particles of one prompt, each extended by a token a step (an SMC step; a resampled one gathers its
    past): the model gets no mask and no positions, as in HF's own decode, and the rows are exact. A
    ragged batch (pads, and rows whose past is shorter than the batch's) still gets both. (Merging the
    rows' pasts into one row, which the particles' shared prompt would choose, is turned off here.)"""
    import genlm_core.kv_reuse

    monkeypatch.setattr(genlm_core.kv_reuse, "plan_merged", lambda rows, outputs=None: None)
    path, ref = tiny
    lm = make(path)
    calls = []
    forward = lm.model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs["input_ids"].shape, kwargs.get("attention_mask"), kwargs.get("position_ids")))
        return forward(*args, **kwargs)

    monkeypatch.setattr(lm.model, "forward", spy)
    prompt = list(range(300, 340))
    particles = [prompt + [i] for i in range(6)]
    steps = [[prompt], particles]
    steps.append([p + [7 + i] for i, p in enumerate(particles)])  # each row of the stored block, in order
    steps.append([steps[-1][i] + [1] for i in (5, 5, 0, 2, 2, 3)])  # resampled: gathered, same length
    for contexts in steps:
        check_rows("an_smc_step_runs_as_hf_s_own_decode_step", gather(lm, contexts), contexts, ref)
    assert [tuple(shape) for shape, _, _ in calls] == [(1, 40), (6, 1), (6, 1), (4, 1)]
    assert all(mask is None and positions is None for _, mask, positions in calls)
    calls.clear()
    ragged = [steps[-1][0] + [4, 5], steps[-1][3] + [6], [9, 8]]
    check_rows("an_smc_step_runs_as_hf_s_own_decode_step", gather(lm, ragged), ragged, ref)
    ((shape, mask, positions),) = calls
    assert tuple(shape) == (3, 2) and mask is not None and positions is not None
    assert positions.tolist() == [[43, 44], [0, 43], [0, 1]]


def test_decode_room_writes_smc_steps_in_place_and_never_over_another_s_states(tiny, monkeypatch):
    """With ``decode_room``, SMC steps of the same rows write their states into the room after their past
    (one buffer for several steps, then a copy into a new one); a stored block extended twice, by two
    batches, is written in place only by the first: the second copies, and the first's states stay
    right (rows against the uncached reference throughout, the second extension's and the first's).
    (Merging the rows' pasts into one row, which particles packed with their shared prompt would keep
    choosing, is turned off here: a merged step is not a plain one.)"""
    import genlm_core.kv_reuse

    monkeypatch.setattr(genlm_core.kv_reuse, "plan_merged", lambda rows, outputs=None: None)
    path, ref = tiny
    lm = make(path, decode_room=3)
    prompt = list(range(300, 330))
    contexts = [prompt + [i] for i in range(5)]
    buffers = []
    for step in range(8):
        check_rows(
            "decode_room_writes_smc_steps_in_place_and_never_over_another_s_states", gather(lm, contexts), contexts, ref
        )
        block = lm.kv.longest_prefix(None, tuple(contexts[0]), len(contexts[0])).value.block
        buffers.append(block.kv[0][0].data_ptr())
        contexts = [c + [10 + step + i] for i, c in enumerate(contexts)]
    assert len(set(buffers[2:])) == 2  # a copy with room 3, four steps in it, a copy, two more steps
    first = [c + [1] for c in contexts]
    second = [c + [2] for c in contexts]  # the same stored block again: copied, not written over first
    check_rows("decode_room_writes_smc_steps_in_place_and_never_over_another_s_states", gather(lm, first), first, ref)
    check_rows("decode_room_writes_smc_steps_in_place_and_never_over_another_s_states", gather(lm, second), second, ref)
    after_first = [c + [3] for c in first]  # the first's stored block as it is: its states intact
    check_rows(
        "decode_room_writes_smc_steps_in_place_and_never_over_another_s_states",
        gather(lm, after_first),
        after_first,
        ref,
    )


def test_holes_left_by_ragged_batches_are_squeezed_out(tiny, monkeypatch):
    """Two rows extended by one and by three tokens in turn: the shorter gets pads in its block each
    step (a byte beam's prefill does this hundreds of times). The past must stay about as long as
    the contexts: left alone it would grow by the batch's width per step (123 positions here).
    (Merging the rows' pasts into one row, which has no pads, is turned off here.)"""
    import genlm_core.kv_reuse

    monkeypatch.setattr(genlm_core.kv_reuse, "plan_merged", lambda rows, outputs=None: None)
    path, ref = tiny
    lm = make(path)
    a, b = [7, 8, 9], [7, 8, 10]
    for step in range(40):
        one, three = [20 + step], [40 + step, 41, 42]
        a, b = (a + three, b + one) if step % 2 else (a + one, b + three)
        rows = gather(lm, [a, b])
        check_rows("holes_left_by_ragged_batches_are_squeezed_out", rows, [a, b], ref)
    block = lm.kv.longest_prefix(None, tuple(a), len(a)).value.block
    assert len(a) == len(b) == 83 and block.length <= 1.4 * 83


def test_a_padded_batch_gathers_rows_of_several_blocks_beside_fresh_rows(tiny, monkeypatch):
    """Particles of two programs, stored by two batches, and a fresh context in one padded batch: each
    block's rows are gathered into their places in one past, the fresh row's past is zeros, all masked.
    (Merging the rows' pasts into one row is turned off here.)"""
    import genlm_core.kv_reuse

    monkeypatch.setattr(genlm_core.kv_reuse, "plan_merged", lambda rows, outputs=None: None)
    path, ref = tiny
    lm = make(path)
    p, q = list(range(100, 160)), list(range(300, 340))
    gather(lm, [p + [1], p + [2]])
    gather(lm, [q + [1], q + [2], q + [3]])  # another batch, another block
    plans = []
    forward_new = lm.forward_new
    lm.forward_new = lambda plan: plans.append(plan) or forward_new(plan)
    contexts = [q + [3, 5], p + [1, 5], [7, 8, 9], q + [1, 5], p + [2, 5]]
    before = lm.tokens_computed
    check_rows("a_padded_batch_gathers_rows_of_several_blocks_beside_fresh_rows", gather(lm, contexts), contexts, ref)
    assert lm.tokens_computed - before == 7 and len(plans) == 1
    parts = plans[0].past.gather.parts  # each program's prompt ran once, in a packed row
    assert [(part.rows.tolist(), part.into.tolist()) for part in parts] == [([0, 0], [0, 3]), ([0, 0], [1, 4])]


@pytest.mark.parametrize("plain_head", [True, False])
def test_shared_new_tokens_run_once_in_a_packed_row(tiny, plain_head):
    """A byte beam's lookahead asks for c+a, c+a+b, c+a+d, ... together: a runs once, each sequence's
    row is exact, and a later extension of a sequence that lived in a packed row reuses its states.
    Both ways to the wanted logits: the head on wanted positions, or the model's logits_to_keep."""
    path, ref = tiny
    lm = make(path)
    assert lm.plain_head  # Llama and GPT-2: logits are the output embedding of the last hidden state
    lm.plain_head = plain_head
    prompt = [11, 12, 13, 14]
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [5], prompt + [5, 6], prompt + [5, 7], prompt + [5, 7, 9], prompt + [8], [30, 31, 32]]
    before = lm.tokens_computed
    rows = gather(lm, contexts)
    check_rows("shared_new_tokens_run_once_in_a_packed_row", rows, contexts, ref)
    assert lm.tokens_computed - before == 5 + 3  # 5, 6, 7, 9, 8 once each; the unrelated context alone
    for grown in (prompt + [5, 7, 10], prompt + [5, 6, 3, 4]):
        before = lm.tokens_computed
        check_rows("shared_new_tokens_run_once_in_a_packed_row", [lm.next_token_logprobs_sync(grown)], [grown], ref)
        assert lm.tokens_computed - before == len(grown) - len(prompt) - 2


@pytest.mark.parametrize("plain_head", [True, False])
def test_sequences_in_different_blocks_run_over_one_merged_past(tiny, plain_head):
    """A beam's sequences share a long prefix but were stored by different batches: their next batch
    is one row over a merged past that holds the shared prefix once. Rows are exact, each token runs
    once, and later extensions reuse the states stored from that row."""
    path, ref = tiny
    lm = make(path)
    lm.plain_head = plain_head
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    lm.next_token_logprobs_sync(prompt + [5])
    lm.next_token_logprobs_sync(prompt + [6])  # another batch, another block
    plans = []
    forward_new = lm.forward_new

    def spy(plan):
        plans.append(plan)
        return forward_new(plan)

    lm.forward_new = spy
    contexts = [prompt + [5, 7], prompt + [6, 8], prompt + [6, 9, 10]]
    before = lm.tokens_computed
    rows = gather(lm, contexts)
    check_rows("sequences_in_different_blocks_run_over_one_merged_past", rows, contexts, ref)
    assert lm.tokens_computed - before == 4
    assert len(plans) == 1 and plans[0].merged is not None and plans[0].merged.length == len(prompt) + 2
    for grown in (prompt + [5, 7, 11], prompt + [6, 9, 10, 12]):
        before = lm.tokens_computed
        check_rows(
            "sequences_in_different_blocks_run_over_one_merged_past", [lm.next_token_logprobs_sync(grown)], [grown], ref
        )
        assert lm.tokens_computed - before == 1


def test_a_head_that_is_not_the_output_embedding_is_detected(tiny):
    path, _ = tiny
    lm = make(path)
    plain = lm.model.get_output_embeddings()
    scaled = torch.nn.Linear(plain.in_features, plain.out_features, bias=False)
    scaled.weight = torch.nn.Parameter(plain.weight * 2)
    lm.model.get_output_embeddings = lambda: scaled
    assert not lm._has_plain_head()


@pytest.mark.slow
@pytest.mark.breadth
def test_long_context_over_4000_tokens_in_chunks(tiny):
    path, ref = tiny
    lm = make(path, prefill_chunk_size=1024)
    ctx = [(i * 37) % 3000 + 5 for i in range(4100)]
    check_rows("long_context_over_4000_tokens_in_chunks", [lm.next_token_logprobs_sync(ctx)], [ctx], ref)
    assert lm.forward_calls == 5
    more = ctx + [42]
    check_rows("long_context_over_4000_tokens_in_chunks", [lm.next_token_logprobs_sync(more)], [more], ref)


def test_padded_model_vocabulary():
    path = tiny_model_dir("llama", vocab_size=50257 + 71)
    ref = Reference(path)
    lm = make(str(path))
    assert len(lm.byte_vocab) == 50257 and lm.model.config.vocab_size == 50257 + 71
    rows = gather(lm, [[1, 2, 3], [4]])
    for row in rows:
        assert row.shape == (50257,)
        total = abs(torch.logsumexp(row.double(), 0).item())  # normalised over the tokenizer's ids alone
        bounds.within("hf: padded vocabulary normalised", total, bounds.normalisation_error(row.numel()))
    check_rows("padded_model_vocabulary", rows, [[1, 2, 3], [4]], ref)  # reference renormalised over them too


def test_bfloat16_weights_give_float32_logprobs(tiny):
    path, ref = tiny
    lm = make(path, dtype="bfloat16")
    row = lm.next_token_logprobs_sync([1, 2, 3])
    assert lm.model.dtype == torch.bfloat16 and row.dtype == torch.float32
    bounds.within(
        "hf: bf16 normalised", abs(torch.logsumexp(row.double(), 0).item()), bounds.normalisation_error(row.numel())
    )
    # bf16 weights and activations: the same model to first order in u, so the float32 run's error against
    # float64 scaled by bfloat16's unit roundoff over float32's, twice (bounds.lower_precision)
    tol = bounds.lower_precision(bounds.float32_error(path, [[1, 2, 3]]), bounds.U_BF16)
    bounds.within("hf: bf16 weights vs float32", max_error([row], [[1, 2, 3]], ref), tol)


def test_sampling_batched_and_stops_on_eos(tiny):
    path, ref = tiny
    lm = make(path)
    prompt = [5, 6, 7]
    ctx, greedy = list(prompt), []
    for _ in range(6):  # greedy continuation from the reference
        token = int(ref(ctx).argmax())
        greedy.append(token)
        ctx.append(token)
    out = asyncio.run(lm.sample(prompt, 6, eos_token_ids=[], temperature=0))
    assert out == greedy
    eos = greedy[3]
    stop_at = greedy.index(eos)
    assert asyncio.run(lm.sample(prompt, 6, eos_token_ids=[eos], temperature=0)) == greedy[:stop_at]
    lm.clear_cache()
    calls = lm.forward_calls
    outs = asyncio.run(lm.batch_sample([prompt, [8, 9], [10]], 5, eos_token_ids=[], seed=3))
    assert [len(o) for o in outs] == [5, 5, 5]
    assert lm.forward_calls - calls <= 6  # the three samplers shared one batch per step


def test_cache_kv_explicit_prefill(tiny):
    path, ref = tiny
    lm = make(path)
    prompt = list(range(50, 150))
    lm.cache_kv(prompt)
    before = lm.tokens_computed
    row = lm.next_token_logprobs_sync(prompt + [3])
    assert lm.tokens_computed - before == 1
    check_rows("cache_kv_explicit_prefill", [row], [prompt + [3]], ref)


def test_bad_ids_fail_before_model_work(tiny):
    path, _ = tiny
    lm = make(path)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.next_token_logprobs_sync([1, len(lm.byte_vocab)])
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(lm.next_token_logprobs([]))
    assert lm.forward_calls == 0


def test_loads_through_registry_and_validates_options(tiny):
    path, _ = tiny
    lm = load_model_by_name(path, backend="hf", llm_opts={"batch_size": 4, "kv_cache_entries": 10})
    assert isinstance(lm, AsyncTransformer) and lm.batcher.batch_size == 4 and lm.kv.max_entries == 10
    with pytest.raises(OptionsError, match=r"backend 'hf'.*unknown option 'batchsize'"):
        load_model_by_name(path, backend="hf", llm_opts={"batchsize": 4})
    with pytest.raises(OptionsError, match=r"option 'dtype'"):
        load_model_by_name(path, backend="hf", llm_opts={"dtype": "float8"})


def test_sliding_window_models_fall_back_to_recompute(caplog):
    from transformers import MistralConfig

    path = tiny_model_dir("llama")
    ref = Reference(path)
    lm = make(str(path))
    lm.model.config.__class__ = MistralConfig  # only the config check changes
    lm.model.config.sliding_window = 16
    assert "sliding-window" in kv_reuse_problem(lm.model)
    with caplog.at_level(logging.WARNING):
        fallback = AsyncTransformer(lm.model, lm.tokenizer, batch_size=8)
    assert "KV reuse disabled" in caplog.text and not fallback.reuse_kv
    lm.model.config.__class__ = type(Reference(path).model.config)
    contexts = [[1, 2, 3], [1, 2, 3, 4]]
    check_rows("sliding_window_models_fall_back_to_recompute", gather(fallback, contexts), contexts, ref)
    assert len(fallback.kv) == 0


def test_quantization_options_map_to_bitsandbytes_config():
    kwargs = load_kwargs(HFOptions(load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16", device="cpu"))
    config = kwargs["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert load_kwargs(HFOptions(device="cpu"))["dtype"] == torch.float32
    assert load_kwargs(HFOptions(hf_opts={"attn_implementation": "eager"}))["attn_implementation"] == "eager"
