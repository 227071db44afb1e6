"""genlm-llamacpp on a real pretrained model: SmolLM2-135M-Instruct, its shipped Q4_1 GGUF and the
same weights dequantized to float32, against genlm-hf on the float32 folder."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from genlm_core import load_model_by_name
from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_core.cli import main
from genlm_core.testing import bounds
from genlm_core.testing.live import particle_program
from genlm_core.testing.models import smollm2_dir

from .test_llamacpp import assert_rows_match


@pytest.fixture(scope="module")
def hf_smollm2():
    lm = load_model_by_name(str(smollm2_dir()), backend="hf", llm_opts={"dtype": "float32"})
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def f32_smollm2():
    lm = load_model_by_name("smollm2-f32", backend="llamacpp", llm_opts={"timeout": 0.001})
    yield lm
    lm.cleanup()


@pytest.mark.slow
@pytest.mark.realmodel
def test_float32_gguf_rows_equal_genlm_hf_through_a_particle_program(f32_smollm2, hf_smollm2):
    assert f32_smollm2.engine.config.cache_type == "f32"
    served = asyncio.run(particle_program(f32_smollm2, particles=8, steps=30, seed=5))
    assert f32_smollm2.sequences.stats.continued > 150
    assert_rows_match(served, hf_smollm2, "llamacpp smollm2: f32 gguf vs hf")


@pytest.mark.slow
@pytest.mark.realmodel
def test_the_byte_lm_on_llamacpp_equals_the_byte_lm_on_genlm_hf(f32_smollm2, hf_smollm2):
    text = b"The capital of France is Par"

    async def byte_lm(lm):
        beam = await ByteBeamState.initial(lm, BeamParams(K=5))
        after = await beam.prefill(text)
        logps = (await after.logp_next()).ps
        beam.cleanup()
        return after.logZ, torch.as_tensor(logps).exp()

    ours, theirs = asyncio.run(byte_lm(f32_smollm2)), asyncio.run(byte_lm(hf_smollm2))
    # logZ sums, over each beam's path, one row's log-probability per token: n tokens of rows within
    # delta (4 x the float32 error on the text's prefixes) move it by at most n delta; a byte's probability
    # is normalised by it, so moves by at most a factor exp(2 n delta). Holds while both beams keep the
    # same candidates (none within 2 n delta of the beam's cut).
    ids = hf_smollm2.tokenizer.encode(text.decode())
    n = len(ids) + 1
    delta = bounds.rows_bound(str(smollm2_dir()))([ids[:i] for i in range(1, len(ids) + 1)])
    bounds.within(
        "llamacpp smollm2: byte lm logZ", abs(ours[0] - theirs[0]), bounds.Bound(n * delta, f"{n} x {delta.basis}")
    )
    tol = bounds.Bound(math.expm1(2 * n * delta), f"exp(2 x {n} x {delta.basis}) - 1")
    bounds.within("llamacpp smollm2: byte lm probabilities", (ours[1] - theirs[1]).abs().max().item(), tol)
    assert int(ours[1][:256].argmax()) == ord("i")  # Par -> Paris


@pytest.mark.slow
@pytest.mark.realmodel
def test_the_shipped_q4_1_gguf_continues_like_the_model(capsys, hf_smollm2):
    assert main(["continue", "smollm2", "The capital of France is", "-b", "llamacpp", "-n", "12", "-K", "5"]) == 0
    assert capsys.readouterr().out.strip().startswith("The capital of France is Paris")
    lm = load_model_by_name("smollm2", backend="llamacpp")
    ids = lm.tokenizer.encode("The capital of France is")
    ours, theirs = lm.next_token_logprobs_sync(ids), hf_smollm2.next_token_logprobs_sync(ids)
    # 4-bit weights: another model, close to the dequantized float32 one, not a rounding of it; 0.1 in total
    # variation is the claim that it predicts like it (no rounding bound: quantization error is not small in u)
    assert 0.5 * (ours.exp() - theirs.exp()).abs().sum().item() < 0.1
    assert lm.byte_vocab[int(ours.argmax())] == b" Paris"
    lm.cleanup()
