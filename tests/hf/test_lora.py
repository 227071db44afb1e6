"""LoRA adapters: each adapter's outputs match a plain peft forward; the adapter is part of every cache key."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from genlm_core.testing.models import tiny_model_dir
from genlm_hf import AsyncTransformer

peft = pytest.importorskip("peft", reason="LoRA needs genlm-hf[lora] (peft)")

TOL = 1e-4


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
        assert (seen[name].double() - expected[name]).abs().max() <= TOL
        longer = ctx + [9, 10]
        row = lm.next_token_logprobs_sync(longer)  # extends this adapter's own KV states
        assert (row.double() - reference(base, paths.get(name), longer)).abs().max() <= TOL
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
        assert (row.double() - reference(base, paths.get(name), ctx)).abs().max() <= TOL


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
        assert (row.double() - reference(base, path, ctx)).abs().max() <= TOL
    uncached = lm.next_token_logprobs_uncached(ctx, lora_name="x")
    assert (uncached.double() - reference(base, paths["a"], ctx)).abs().max() <= TOL
    batch = lm.batch_next_token_logprobs_sync([ctx, ctx[:2]], lora_name="y")
    assert (batch[1].double() - reference(base, paths["b"], ctx[:2])).abs().max() <= TOL
    lm.add_new_lora(paths["a"], "y")  # loading under a loaded name replaces that adapter
    row = lm.next_token_logprobs_sync(ctx, lora_name="y")
    assert (row.double() - reference(base, paths["a"], ctx)).abs().max() <= TOL
    lm.remove_lora("x")
    with pytest.raises(ValueError, match="not loaded"):
        lm.next_token_logprobs_sync(ctx, lora_name="x")
    with pytest.raises(ValueError, match="not loaded"):
        lm.remove_lora("x")
    lm.set_lora(paths["b"], "z")  # the older signature: load and activate
    row = lm.next_token_logprobs_sync(ctx)
    assert (row.double() - reference(base, paths["b"], ctx)).abs().max() <= TOL


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
            assert (row.double() - reference(base, paths.get(name), ids)).abs().max() <= TOL
