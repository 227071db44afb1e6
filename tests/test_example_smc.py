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

    async def batch_next_token_logprobs(self, contexts: list[list[int]]) -> torch.Tensor:
        return torch.stack([self.row(list(ids)) for ids in contexts])

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
    # a statistical tolerance: 600 seeded runs (the same on every machine), the mean of an unbiased estimator
    # within 4 standard errors of the exact Z (a normal tail of 6e-5); se < 5% of Z keeps the band narrow
    assert abs(mean - z) < 4 * se, (mean, z, se)
    assert 0 < z < 1 and se < 0.05 * z  # a test that can tell a biased estimate apart


def test_the_example_runs_end_to_end_on_the_mock_backend(capsys):
    example.main(["--backend", "mock", "--model", "gpt2", "--particles", "8", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert "log Z estimate" in out and "resampling steps" in out


def test_continuations_are_printed_without_the_eos_token_and_ended_particles_are_marked(capsys, monkeypatch):
    """Single-byte tokens and no resampling on the mock: one particle of 16 ends (this seed), the others run
    to --max-tokens. Each printed row is checked against the particle it shows."""
    runs = []

    async def recorded(lm, *args, **kwargs):
        result = await smc(lm, *args, **kwargs)
        runs.append((lm, args[4], result))  # args: prompt_ids, n, max_tokens, mask, eos_ids, seed
        return result

    smc = example.smc
    monkeypatch.setattr(example, "smc", recorded)
    argv = ["--backend", "mock", "--model", "gpt2", "--particles", "16", "--max-tokens", "12"]
    example.main([*argv, "--max-token-bytes", "1", "--seed", "3", "--ess-threshold", "0"])
    out = capsys.readouterr().out.splitlines()
    ((lm, eos_ids, result),) = runs
    eos_texts = [lm.tokenizer.decode([i]) for i in eos_ids]
    assert eos_texts == ["<|endoftext|>"]
    header = next(i for i, line in enumerate(out) if line.startswith("weight"))
    printed = out[header + 2 : header + 2 + len(result.particles)]
    expected = []
    for p in result.particles:
        ended = p.generated[-1] in eos_ids
        assert p.done == ended and sum(t in eos_ids for t in p.generated) == int(ended)
        text = b"".join(lm.byte_vocab[t] for t in p.generated if t not in eos_ids).decode("utf-8", "replace")
        expected.append((f"{p.log_weight:.3f}", repr(text) + (" [ended]" if ended else "")))
    shown = [(line.split()[1], line.split(None, 2)[2]) for line in printed]
    assert sorted(shown) == sorted(expected)
    assert not any(eos in line for line in out for eos in eos_texts)
    ended = sum(p.done for p in result.particles)
    assert 0 < ended < len(result.particles)  # both kinds of row are shown
    assert f"{ended} of 16 particles ended" in "\n".join(out)
