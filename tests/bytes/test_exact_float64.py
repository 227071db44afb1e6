"""A wide beam is exact: log Z and logp_next equal enumeration over every tokenization to the float64
rounding of the two computations (:meth:`Enumerator.tolerance`, about 1e-12 relative at log Z = -200),
on prefixes whose log Z reaches -200, over GPT-2's vocabulary and a real 32k SentencePiece one (mock
backend with peaked distributions)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_core.testing import bounds
from genlm_core.testing.tokenizers import load_tokenizer

from .exact import Enumerator


def wide(lm):
    """A beam wide enough to be exact, ending text at the tokenizer's EOS."""
    return BeamParams(K=10**6, heal=False, eos_byte_strings=[lm.tokenizer.eos_token_id])


@pytest.fixture(scope="module", params=["gpt2", "mistral-v1"])
def peaked(request):
    from genlm_core.mock import MockAsyncLM

    lm = MockAsyncLM(load_tokenizer(request.param), scale=12.0, batch_size=256, timeout=0)
    yield lm, Enumerator(lm)
    lm.cleanup()


TEXTS = {
    "digits": b"12345678",
    "multi-byte UTF-8": "€éü€".encode(),
    "whitespace run": b"  \n\n   \t  ",
}


async def prefilled(lm, text):
    beam = await ByteBeamState.initial(lm, wide(lm))
    return beam, beam.states[0].lm_state.context, await beam.prefill(text)


@pytest.mark.parametrize("kind", list(TEXTS))
def test_log_z_equals_enumeration_to_1e_12_relative(peaked, kind):
    lm, exact = peaked
    text = TEXTS[kind]

    async def main():
        beam, context, after = await prefilled(lm, text)
        want = await exact.prefix_logmass(context, text)
        assert exact.same_rows()
        beam.cleanup()
        return after.logZ, want, exact.tolerance(len(text))

    got, want, tol = asyncio.run(main())
    bounds.within("byte lm float64: log Z vs enumeration", abs(got - want), tol, f"log Z {want:.4g}")


def test_some_prefix_reaches_log_z_minus_200(peaked):
    lm, exact = peaked

    async def main():
        beam, context, _ = await prefilled(lm, b"")
        zs = [await exact.prefix_logmass(context, text) for text in TEXTS.values()]
        beam.cleanup()
        return zs

    assert min(asyncio.run(main())) <= -200


@pytest.mark.parametrize("text", [b"1234", "€é".encode(), b"  \n "])
def test_logp_next_equals_enumeration_to_1e_12_relative(peaked, text):
    lm, exact = peaked
    eos = [lm.tokenizer.eos_token_id]

    async def main():
        beam, context, after = await prefilled(lm, text)
        got = (await after.logp_next()).ps
        want = await exact.next_byte(context, text, eos)
        assert exact.same_rows()
        beam.cleanup()
        return got, want, exact.tolerance(len(text), next_byte=True)

    got, want, tol = asyncio.run(main())
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    bounds.within_each("byte lm float64: next byte vs enumeration", got[finite], want[finite], tol, tol.basis)
