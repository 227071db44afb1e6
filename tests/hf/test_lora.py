"""LoRA adapters: each adapter's outputs match a plain peft forward; the adapter is part of every cache key."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from genlm_core.testing import bounds
from genlm_core.testing.models import tiny_model_dir
from genlm_hf import AsyncTransformer

peft = pytest.importorskip("peft", reason="LoRA needs genlm-hf[lora] (peft)")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    out = {}
    for i, name in enumerate(["a", "b"]):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(base, config)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(folder)
        out[name] = str(folder)
    return str(path), out


@functools.cache
def reference_model(base_path, adapter_path):
    """The plain transformers model (under peft's adapter), loaded once per base and adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_path:
        model = PeftModel.from_pretrained(model, adapter_path)
    return model.eval()


def reference(base_path, adapter_path, ids):
    with torch.no_grad():
        logits = reference_model(base_path, adapter_path)(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


@functools.cache
def exact_model(base_path, adapter_path):
    """The reference model (under its adapter) in float64."""
    import copy

    return copy.deepcopy(reference_model(base_path, adapter_path)).double()


@functools.cache
def adapted_error(base_path, adapter_path, ids):
    """The adapted model's float32-vs-float64 error over every prefix's row of ``ids`` and the base model's
    fixed probe (as bounds.float32_error measures a model it loads by folder)."""
    model, exact = reference_model(base_path, adapter_path), exact_model(base_path, adapter_path)
    return max(max(bounds.position_errors(model, exact, ids)), adapted_probe_error(base_path, adapter_path))


@functools.cache
def adapted_probe_error(base_path, adapter_path):
    """The adapted model's error on the base model's probe: measured once per adapter."""
    model, exact = reference_model(base_path, adapter_path), exact_model(base_path, adapter_path)
    return max(max(bounds.position_errors(model, exact, c)) for c in bounds.probe_contexts(base_path))


def check(name, row, base_path, adapter_path, ids):
    """``row`` (genlm-hf, batched, from cached KV, under an adapter) against the reference's unbatched
    float32 forward pass: two float32 runs of one model, within 4 x that model's float32-vs-float64 error
    on ``ids``'s rows and the model's probe (bounds.model_difference)."""
    want = reference(base_path, adapter_path, ids)
    measured = adapted_error(base_path, adapter_path, tuple(ids))
    bounds.within(f"hf lora: {name}", (row.double() - want).abs().max().item(), bounds.model_difference(measured))


def test_switching_adapters(adapters):
    base, paths = adapters
    lm = AsyncTransformer.from_name(base, lora=paths, batch_size=8)
    ctx = [3, 4, 5, 6, 7]
    expected = {name: reference(base, paths.get(name), ctx) for name in (None, "a", "b")}
    assert (expected["a"] - expected[None]).abs().max() > 1e-2  # the adapters really change the model
    seen = {}
    for name in (None, "a", "b", None, "b", "a"):  # switch back and forth: cached results stay per adapter
        lm.clear_lora() if name is None else lm.set_lora(None, name)
        seen[name] = lm.next_token_logprobs_sync(ctx)
        check("switching_adapters", seen[name], base, paths.get(name), ctx)
        longer = ctx + [9, 10]
        row = lm.next_token_logprobs_sync(longer)  # extends this adapter's own KV states
        check("switching_adapters", row, base, paths.get(name), longer)
    with pytest.raises(ValueError, match="not loaded"):
        lm.set_lora(None, "c")


def test_adapters_in_one_batch(adapters):
    base, paths = adapters
    lm = AsyncTransformer.from_name(base, lora=paths, batch_size=8, timeout=0.01)
    ctx = [11, 12, 13]

    async def under(name):
        lm.clear_lora() if name is None else lm.set_lora(None, name)
        return await lm.next_token_logprobs(ctx)

    async def main():
        return await asyncio.gather(under("a"), under("b"), under(None))

    rows = asyncio.run(main())
    for name, row in zip(("a", "b", None), rows):
        check("adapters_in_one_batch", row, base, paths.get(name), ctx)


def test_seed_lora_methods_and_per_request_lora_name(adapters):
    """genlm-backend's API: add_new_lora(path, name), lora_name= per call, remove_lora(name)."""
    base, paths = adapters
    lm = AsyncTransformer.from_name(base, batch_size=8, timeout=0.01)
    ctx = [11, 12, 13, 14]
    lm.add_new_lora(paths["a"], "x")
    lm.add_new_lora(paths["b"], "y")

    async def main():
        return await asyncio.gather(
            lm.next_token_logprobs(ctx, lora_name="x"),
            lm.next_token_logprobs(ctx, lora_name="y"),
            lm.next_token_logprobs(ctx),
        )

    rows = asyncio.run(main())
    for path, row in zip((paths["a"], paths["b"], None), rows):
        check("seed_lora_methods_and_per_request_lora_name", row, base, path, ctx)
    uncached = lm.next_token_logprobs_uncached(ctx, lora_name="x")
    check("seed_lora_methods_and_per_request_lora_name", uncached, base, paths["a"], ctx)
    batch = lm.batch_next_token_logprobs_sync([ctx, ctx[:2]], lora_name="y")
    check("seed_lora_methods_and_per_request_lora_name", batch[1], base, paths["b"], ctx[:2])
    lm.add_new_lora(paths["a"], "y")  # loading under a loaded name replaces that adapter
    row = lm.next_token_logprobs_sync(ctx, lora_name="y")
    check("seed_lora_methods_and_per_request_lora_name", row, base, paths["a"], ctx)
    lm.remove_lora("x")
    with pytest.raises(ValueError, match="not loaded"):
        lm.next_token_logprobs_sync(ctx, lora_name="x")
    with pytest.raises(ValueError, match="not loaded"):
        lm.remove_lora("x")
    lm.set_lora(paths["b"], "z")  # the older signature: load and activate
    row = lm.next_token_logprobs_sync(ctx)
    check("seed_lora_methods_and_per_request_lora_name", row, base, paths["b"], ctx)


@pytest.mark.slow
@pytest.mark.breadth
def test_packed_rows_under_adapters(adapters):
    """Sequences sharing new tokens run as one packed row (its head on the wanted positions) under each
    adapter, and under none, once peft wraps the model."""
    base, paths = adapters
    lm = AsyncTransformer.from_name(base, lora=paths, batch_size=16, timeout=0.01)
    assert lm.packs_shared_tokens and lm.plain_head
    prompt = [21, 22, 23]
    contexts = [prompt + [5], prompt + [5, 6], prompt + [5, 7]]
    for name in (None, "a", "b"):
        lm.clear_lora() if name is None else lm.set_lora(None, name)
        lm.next_token_logprobs_sync(prompt)
        before = lm.tokens_computed
        rows = lm.batch_next_token_logprobs_sync(contexts)
        assert lm.tokens_computed - before == 3  # 5 once, then 6 and 7
        for row, ids in zip(rows, contexts):
            check("packed_rows_under_adapters", row, base, paths.get(name), ids)
