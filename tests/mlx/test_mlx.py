"""genlm-mlx against genlm-hf on the same tiny float32 models: max |Δ logprob| within 4 x the model's
float32-vs-float64 error on the same contexts (genlm_core.testing.bounds.rows_bound)."""

from __future__ import annotations

import asyncio

import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="MLX cannot be imported on this machine")

from genlm_core import OptionsError, load_model_by_name  # noqa: E402
from genlm_core.testing import bounds, check_lm_contract  # noqa: E402
from genlm_core.testing import concurrent_logprobs as gather  # noqa: E402
from genlm_core.testing import max_abs_diff as max_diff  # noqa: E402
from genlm_core.testing.bad_input import check_rejects_generated_bad_input  # noqa: E402
from genlm_core.testing.models import tiny_model_dir  # noqa: E402
from genlm_hf import AsyncTransformer  # noqa: E402
from genlm_mlx import AsyncMlxLM  # noqa: E402


def tol(contexts, path=None) -> bounds.Bound:
    """Two float32 runs of one model (MLX and torch, or MLX batched and alone): 4 x its float32-vs-float64
    error on ``contexts`` (bounds.rows_bound); ``path`` defaults to the tiny Llama of ``pair``."""
    return bounds.rows_bound(path or str(tiny_model_dir("llama")))(contexts)


@pytest.fixture(scope="module")
def pair():
    path = str(tiny_model_dir("llama"))
    return AsyncMlxLM.from_name(path, batch_size=16, timeout=0.005), AsyncTransformer.from_name(path, batch_size=16)


def test_single(pair):
    mlx_lm, hf = pair
    for ctx in ([1], [5, 6, 7], list(range(100, 180))):
        bounds.within(
            "mlx: single",
            max_diff([mlx_lm.next_token_logprobs_sync(ctx)], [hf.next_token_logprobs_sync(ctx)]),
            tol([ctx]),
        )


def test_concurrent_ragged_batches(pair):
    mlx_lm, hf = pair
    g = torch.Generator().manual_seed(1)
    contexts = [
        torch.randint(0, 5000, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (20,), generator=g)
    ]
    calls = mlx_lm.forward_calls
    bounds.within(
        "mlx: concurrent_ragged_batches", max_diff(gather(mlx_lm, contexts), gather(hf, contexts)), tol(contexts)
    )
    assert mlx_lm.forward_calls - calls == 2  # batched: 20 requests, batch size 16


def test_deep_prefix_reuse_and_resampling(pair):
    mlx_lm, hf = pair
    prompt = list(range(2000, 2300))
    mlx_lm.next_token_logprobs_sync(prompt)
    ctx = list(prompt)
    for step in range(10):
        ctx.append(step + 40)
        before = mlx_lm.tokens_computed
        row = mlx_lm.next_token_logprobs_sync(ctx)
        assert mlx_lm.tokens_computed - before == 1
        bounds.within(
            "mlx: deep_prefix_reuse_and_resampling", max_diff([row], [hf.next_token_logprobs_sync(ctx)]), tol([ctx])
        )
    particles = [ctx + [i] for i in range(6)]
    gather(mlx_lm, particles)
    resampled = [particles[i] + [7] for i in (5, 5, 0, 2, 2, 1)]  # duplicated and reordered rows
    before = mlx_lm.tokens_computed
    bounds.within(
        "mlx: deep_prefix_reuse_and_resampling",
        max_diff(gather(mlx_lm, resampled), gather(hf, resampled)),
        tol(resampled),
    )
    assert mlx_lm.tokens_computed - before == 4
    mixed = [prompt[:50] + [1, 2], ctx + [3], [9, 9]]  # different cached prefixes and none
    bounds.within(
        "mlx: deep_prefix_reuse_and_resampling", max_diff(gather(mlx_lm, mixed), gather(hf, mixed)), tol(mixed)
    )


def test_a_batch_gathers_rows_of_several_blocks_beside_fresh_rows(pair):
    """Particles of two programs, stored by two batches, and a fresh context in one batch: each block's
    rows are gathered into their places in one past, the fresh row's past is zeros, all masked."""
    mlx_lm, hf = pair
    p, q = list(range(100, 160)), list(range(300, 340))
    gather(mlx_lm, [p + [1], p + [2]])
    gather(mlx_lm, [q + [1], q + [2], q + [3]])
    contexts = [q + [3, 5], p + [1, 5], [7, 8, 9], q + [1, 5], p + [2, 5]]
    before, calls = mlx_lm.tokens_computed, mlx_lm.forward_calls
    bounds.within(
        "mlx: a_batch_gathers_rows_of_several_blocks_beside_fresh_rows",
        max_diff(gather(mlx_lm, contexts), gather(hf, contexts)),
        tol(contexts),
    )
    assert mlx_lm.tokens_computed - before == 7 and mlx_lm.forward_calls - calls == 1


def test_uncached_rows_run_the_plain_model(pair):
    mlx_lm, hf = pair
    ctx = list(range(500, 540))
    mlx_lm.next_token_logprobs_sync(ctx[:-1])
    before = mlx_lm.tokens_computed
    row = mlx_lm.next_token_logprobs_uncached(ctx)
    assert mlx_lm.tokens_computed == before  # not through KV reuse
    bounds.within(
        "mlx: uncached_rows_run_the_plain_model", max_diff([row], [hf.next_token_logprobs_uncached(ctx)]), tol([ctx])
    )


@pytest.mark.slow
@pytest.mark.breadth
def test_rope_parameters_block_is_not_ignored():
    import mlx_lm

    path = str(tiny_model_dir("llama", rope_theta=500000.0))
    hf = AsyncTransformer.from_name(path)
    ours = AsyncMlxLM.from_name(path)
    ctx = list(range(300, 420))
    want = hf.next_token_logprobs_sync(ctx)
    bounds.within(
        "mlx: rope_parameters_block_is_not_ignored",
        max_diff([ours.next_token_logprobs_sync(ctx)], [want]),
        tol([ctx], path),
    )
    plain, _ = mlx_lm.load(path)  # what a bare mlx-lm load gives: rope_theta silently 10000
    naive = torch.log_softmax(torch.from_numpy(__import__("numpy").array(plain(mx.array([ctx]))[0, -1])), -1)
    assert (naive.double() - want.double()).abs().max().item() > 1e-3


@pytest.mark.slow
@pytest.mark.breadth
def test_unplanned_model_type_falls_back_exactly(monkeypatch, caplog):
    monkeypatch.setattr("genlm_mlx.lm.PLANNED_MODEL_TYPES", set())  # as for an architecture not vetted
    path = str(tiny_model_dir("llama"))
    ours = AsyncMlxLM.from_name(path)
    assert not ours.planned and not ours.reuse_kv and "computed alone" in caplog.text
    hf = AsyncTransformer.from_name(path)
    contexts = [[1, 2, 3], [4], [5, 6]]
    bounds.within(
        "mlx: unplanned_model_type_falls_back_exactly",
        max_diff(gather(ours, contexts), gather(hf, contexts)),
        tol(contexts, path),
    )


def test_sampling_batched_and_stops_on_eos(pair):
    mlx_lm, hf = pair
    greedy = asyncio.run(hf.sample([5, 6], 6, eos_token_ids=[], temperature=0))
    assert asyncio.run(mlx_lm.sample([5, 6], 6, eos_token_ids=[], temperature=0)) == greedy
    stop = greedy[2]
    out = asyncio.run(mlx_lm.sample([5, 6], 6, eos_token_ids=[stop], temperature=0))
    assert out == greedy[: greedy.index(stop)]  # the EOS that stopped it is dropped
    calls = mlx_lm.forward_calls
    outs = asyncio.run(mlx_lm.batch_sample([[1], [2, 3], [4, 5, 6]], 4, eos_token_ids=[], seed=0))
    assert [len(o) for o in outs] == [4, 4, 4] and mlx_lm.forward_calls - calls <= 5


def test_rejects_bad_input_without_hanging_and_answers_after(pair):
    mlx_lm, _ = pair
    check_lm_contract(
        mlx_lm, [[1], [5, 6, 7], list(range(100, 140))], atol=bounds.rows_bound(str(tiny_model_dir("llama")))
    )
    check_rejects_generated_bad_input(
        mlx_lm, [1, 2, 3], max_examples=25, atol=bounds.rows_bound(str(tiny_model_dir("llama")))
    )


def test_registry_and_options():
    path = str(tiny_model_dir("llama"))
    lm = load_model_by_name(path, backend="mlx", llm_opts={"batch_size": 3, "kv_cache_entries": 7})
    assert isinstance(lm, AsyncMlxLM) and lm.batcher.batch_size == 3 and lm.kv.max_entries == 7
    with pytest.raises(OptionsError, match=r"backend 'mlx'.*unknown option 'chunk'"):
        load_model_by_name(path, backend="mlx", llm_opts={"chunk": 3})


@pytest.mark.slow
@pytest.mark.breadth
def test_sliding_window_model_is_computed_alone_and_exactly(caplog):
    path = str(tiny_model_dir("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    ours = AsyncMlxLM.from_name(path)
    assert not ours.planned and "sliding-window" in caplog.text
    import mlx_lm
    import numpy as np

    model, _ = mlx_lm.load(path)
    ctx = list(range(30, 60))  # longer than the window
    want = torch.log_softmax(torch.from_numpy(np.array(model(mx.array([ctx]))[0, -1])), -1)
    bounds.within(
        "mlx: sliding_window_model_is_computed_alone_and_exactly",
        max_diff([ours.next_token_logprobs_sync(ctx)], [want]),
        tol([ctx], path),
    )
