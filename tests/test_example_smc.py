"""examples/smc.py: its SMC estimates Z without bias (checked against exact enumeration on a small
model), keeps every particle inside the constraint, and runs end to end on the mock backend."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

import torch

from genlm_core import Context

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "smc.py"
spec = importlib.util.spec_from_file_location("genlm_example_smc", EXAMPLE)
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example  # dataclasses look their module up
spec.loader.exec_module(example)

VOCAB, EOS, STEPS = 5, 4, 4
MASK = torch.tensor([True, False, False, True, True])  # tokens 1 and 2 are forbidden; EOS allowed


class SmallLM:
    """A fixed next-token distribution per context over 5 tokens (no real model needed)."""

    def row(self, ids: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(ids)) % 2**31)
        return torch.log_softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, 0).float()

    async def next_token_logprobs(self, ids: list[int]) -> torch.Tensor:
        return self.row(ids)

    def context(self, ids: list[int]) -> Context:
        return Context(ids, VOCAB)


def exact_z(lm: SmallLM, ids: list[int], steps: int) -> float:
    """P(the first ``steps`` tokens, or those up to EOS, all lie in MASK), by enumeration."""
    probs = lm.row(ids).double().exp()
    total = 0.0
    for token in range(VOCAB):
        if MASK[token]:
            rest = 1.0 if token == EOS or steps == 1 else exact_z(lm, [*ids, token], steps - 1)
            total += float(probs[token]) * rest
    return total


def test_smc_estimates_z_without_bias_and_stays_inside_the_constraint():
    lm = SmallLM()
    z = exact_z(lm, [0], STEPS)
    estimates, resamples = [], 0
    for seed in range(600):
        result = asyncio.run(example.smc(lm, [0], 6, STEPS, MASK, {EOS}, seed, ess_threshold=1.0))
        estimates.append(math.exp(result.log_z))
        resamples += result.resamples
        for p in result.particles:
            assert all(MASK[t] for t in p.generated)
            assert p.done == (p.generated[-1] == EOS) and len(p.generated) <= STEPS
    mean = sum(estimates) / len(estimates)
    se = (sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1) / len(estimates)) ** 0.5
    assert resamples > 100  # the estimate went through resampling, not plain importance sampling
    assert abs(mean - z) < 4 * se, (mean, z, se)
    assert 0 < z < 1 and se < 0.05 * z  # a test that can tell a biased estimate apart


def test_the_example_runs_end_to_end_on_the_mock_backend(capsys):
    example.main(["--backend", "mock", "--model", "gpt2", "--particles", "8", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert "log Z estimate" in out and "resampling steps" in out
