"""genlm-compat: genlm models and tries behind genlm-backend's interface, and two real client programs
that give genlm-backend's outputs on genlm."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

genlm_compat = pytest.importorskip("genlm_compat", reason="genlm-compat (and genlm-backend) not installed")
from genlm.backend.llm import AsyncTransformer as SeedTransformer  # noqa: E402
from genlm.backend.llm import MockAsyncLM as SeedMock  # noqa: E402
from genlm.backend.tokenization import Token as SeedToken  # noqa: E402

from genlm_core import load_model_by_name  # noqa: E402
from genlm_core.testing import bounds  # noqa: E402
from genlm_core.testing.models import tiny_model_dir  # noqa: E402

from .programs import control_program, llamppl_program  # noqa: E402
from .replay import Recorder, replay  # noqa: E402


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("llama", tokenizer="gpt2"))


@pytest.fixture(scope="module")
def seed_lm(model_dir):
    lm = SeedTransformer.from_name(model_dir)
    yield lm


@pytest.fixture(scope="module")
def ours(model_dir):
    lm = genlm_compat.load(model_dir, "hf")
    yield lm
    lm.cleanup()


def test_wrap_has_the_seed_interface(ours, seed_lm, model_dir):
    assert isinstance(ours, SeedTransformer) and genlm_compat.wrap(ours) is ours
    assert genlm_compat.wrap(ours.genlm_lm) is ours  # one wrapper (and one Token list) per model
    assert all(type(t) is SeedToken for t in ours.byte_vocab)
    assert ours.byte_vocab == seed_lm.byte_vocab and ours.str_vocab == seed_lm.str_vocab
    ctx = seed_lm.tokenizer.encode("Hello there, how are")
    want = seed_lm.next_token_logprobs_uncached(ctx)
    # two float32 passes of one model (genlm-backend's and genlm's, alone or in a batch of 2)
    tol = bounds.model_difference(bounds.float32_error(model_dir, [ctx, ctx[:2]]), what="the tiny llama")
    for got in (
        ours.next_token_logprobs_sync(ctx),
        ours.next_token_logprobs_uncached(ctx),
        asyncio.run(ours.next_token_logprobs(ctx)),
        ours.batch_next_token_logprobs_sync([ctx[:2], ctx])[1],
    ):
        bounds.within("compat: row vs genlm-backend's", bounds.row_difference(got, want), tol)
    ours.cache_kv(ctx[:3])
    ours.clear_kv_cache()
    ours.reset_async_queries()


def test_a_batch_is_the_callers_own_tensor_as_genlm_backends_is(ours, model_dir):
    """genlm's step call returns the rows' block (shared with its output cache); through the wrapper a
    program may write into the batch, as genlm-backend allowed, without changing any later row."""
    ours.clear_cache()
    contexts = [[5, 6, i] for i in range(4)]
    want = [ours.next_token_logprobs_uncached(c) for c in contexts]

    async def main():
        first = await ours.batch_next_token_logprobs(contexts)
        assert first._base is None
        first.fill_(0.0)  # a program masking in place
        return await ours.batch_next_token_logprobs(contexts), await ours.next_token_logprobs(contexts[1])

    again, one = asyncio.run(main())
    # rows of a batch of 4 against rows computed alone: two float32 passes of one model
    tol = bounds.model_difference(bounds.float32_error(model_dir, contexts), what="the tiny llama")
    for got, expected in zip([*again, one], [*want, want[1]]):
        bounds.within("compat: batch row vs uncached", bounds.row_difference(got, expected), tol)


def test_sampling_follows_the_seeds_contract(ours, seed_lm):
    """Same draws as genlm-backend: the EOS is dropped and batch_sample gives every prompt one seed."""
    ctx = seed_lm.tokenizer.encode("Once upon a")
    for seed in (1, 2, 3):
        want = asyncio.run(seed_lm.sample(ctx, 6, [13], temperature=0.9, seed=seed))
        assert asyncio.run(ours.sample(ctx, 6, [13], temperature=0.9, seed=seed)) == want
    want = asyncio.run(seed_lm.batch_sample([ctx, ctx], 4, [], seed=5))
    assert asyncio.run(ours.batch_sample([ctx, ctx], 4, [], seed=5)) == want and want[0] == want[1]


def test_install_routes_the_seeds_loaders_and_uninstall_restores(model_dir):
    from genlm.backend import load_model_by_name as seed_load
    from genlm.backend.trie import AsyncTokenCharacterTrie

    original_from_name = SeedMock.__dict__["from_name"]
    genlm_compat.install()
    genlm_compat.install()  # twice is harmless
    try:
        import genlm.backend as gb
        import genlm.backend.trie as gbt

        lm = gb.load_model_by_name(model_dir, backend="hf")
        assert isinstance(lm, genlm_compat.CompatLM) and isinstance(lm, SeedTransformer)
        mock = SeedMock.from_name("gpt2")
        assert isinstance(mock.genlm_lm, load_model_by_name("gpt2", backend="mock").__class__)
        assert gbt.AsyncTokenCharacterTrie is genlm_compat.CompatAsyncCharacterTrie
        lm.cleanup()
    finally:
        genlm_compat.uninstall()
        genlm_compat.uninstall()
    import genlm.backend as gb
    import genlm.backend.trie as gbt

    assert gb.load_model_by_name is seed_load and gbt.AsyncTokenCharacterTrie is AsyncTokenCharacterTrie
    assert SeedMock.__dict__["from_name"] is original_from_name and not genlm_compat.installed()


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
async def test_tries_match_genlm_backends_structure_and_values(ours, backend):
    """Same nodes, children, word2leaf and masses as genlm-backend's tries, EOS marker included."""
    from genlm.backend.trie import AsyncTokenCharacterTrie as SeedAsyncTrie
    from genlm.control.constant import EOS

    vocab = [*ours.byte_vocab[:3000], EOS]
    seed = SeedAsyncTrie.from_vocab(vocab, backend=backend)
    mine = genlm_compat.CompatAsyncCharacterTrie.from_vocab(vocab, backend=backend)
    s, m = seed.trie, mine.trie
    assert len(s.children) == len(m.children) == m.num_nodes
    assert set(s.word2leaf) == set(m.word2leaf)

    def shape(trie, node):  # the subtree below node, by labels only (node numbers may differ)
        return {label: shape(trie, child) for label, child in trie.children[node].items()}

    assert shape(s, s.root) == shape(m, m.root)
    ws = np.random.default_rng(0).random(len(vocab))
    got, want = await mine.weight_sum(ws), await seed.weight_sum(ws)
    # positive weights: genlm-backend's sequential weight_max starts from 0, wrong for log weights
    got_max, want_max = await mine.weight_max(ws), await seed.weight_max(ws)
    # genlm-backend's parallel trie rounds the weights to float32 (U32 w each) and sums in float32, its
    # sequential one sums in float64; ours sums in float64. A node sums at most len(vocab) weights, all
    # positive: sum_error of that many terms, relative to the node's mass. A max rounds nothing but the
    # float32 input.
    u, rounds_input = (bounds.U32, 1.0) if backend == "parallel" else (bounds.U64, 0.0)

    def sum_tol(n, mass):
        theirs = rounds_input * u * mass + float(bounds.sum_error(n, mass, u))
        return bounds.Bound(theirs + float(bounds.sum_error(n, mass, bounds.U64)), f"{backend} trie: {n} terms")

    for word, leaf in s.word2leaf.items():  # one token each: ours exact, theirs the weight rounded to float32
        got_leaf = got[m.word2leaf[word]]
        assert want[leaf] == (float(np.float32(got_leaf)) if backend == "parallel" else got_leaf)
    for prefix in ([], [ord(" ")], [ord(" "), ord("t")], [EOS]):
        ns, nm = s.root, m.root
        for letter in prefix:
            ns, nm = s.children[ns][letter], m.children[nm][letter]
        bounds.within("compat: node mass vs genlm-backend's", abs(got[nm] - want[ns]), sum_tol(len(vocab), got[nm]))
        max_tol = bounds.Bound(rounds_input * u * abs(got_max[nm]), "a max of float32-rounded weights")
        bounds.within("compat: node max vs genlm-backend's", abs(got_max[nm] - want_max[ns]), max_tol)
    await mine.cleanup()
    await seed.cleanup()


def check_rows_are_genlm_backends(name, rows, seed_lm, model_dir):
    """Every row genlm served equals genlm-backend's uncached row of its context within two float32 passes'
    bound (bounds.rows_bound: 4 x the tiny model's float32-vs-float64 error on those contexts)."""
    assert rows
    tol = bounds.rows_bound(model_dir)(list(rows))
    diff = max(bounds.row_difference(row, seed_lm.next_token_logprobs_uncached(list(c))) for c, row in rows.items())
    bounds.within(f"compat: {name} rows vs genlm-backend's", diff, tol)


def assert_same_outputs(got, want, path="outputs"):
    """Equal to the bit: strings, tuples and numbers with ==, arrays element by element (NaN where NaN)."""
    if isinstance(got, dict):
        assert got.keys() == want.keys(), path
        for key in got:
            assert_same_outputs(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(got, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=path)
    else:
        assert got == want or (got != got and want != want), f"{path}: {got!r} != {want!r}"


@pytest.mark.slow
@pytest.mark.clients
def test_control_program_gives_genlm_backends_outputs(ours, seed_lm, model_dir, monkeypatch):
    """genlm-control's SMC (direct sampler and AWRS) on genlm: the rows it got are genlm-backend's within
    the float32 bound, and the same program on genlm-backend given those rows gives every output to the bit
    (its weights are functions of the rows with no bounded sensitivity: see replay.py)."""
    recorded = Recorder(ours, monkeypatch)
    got = asyncio.run(control_program(ours, seed=3))
    check_rows_are_genlm_backends("control program", recorded.rows, seed_lm, model_dir)
    asked = replay(seed_lm, recorded.rows, monkeypatch)
    assert_same_outputs(asyncio.run(control_program(seed_lm, seed=3)), got)
    assert set(asked) == set(recorded.rows)  # the replayed run took the recorded path, all of it


@pytest.mark.slow
@pytest.mark.clients
def test_llamppl_program_gives_genlm_backends_outputs(ours, seed_lm, model_dir, monkeypatch):
    recorded = Recorder(ours, monkeypatch)
    got = asyncio.run(llamppl_program(ours, seed=4))
    check_rows_are_genlm_backends("llamppl program", recorded.rows, seed_lm, model_dir)
    asked = replay(seed_lm, recorded.rows, monkeypatch)
    assert_same_outputs(asyncio.run(llamppl_program(seed_lm, seed=4)), got)
    assert set(asked) == set(recorded.rows)


@pytest.mark.slow
@pytest.mark.clients
def test_genlm_bytes_beam_runs_on_genlms_byte_lm(ours, seed_lm, model_dir, monkeypatch):
    """install() turns genlm-bytes' ByteBeamState.initial(llm, params) into genlm's byte LM: the rows it
    used are genlm-backend's within the float32 bound, and genlm-bytes on genlm-backend given those rows has
    the same log Z and next-byte distribution within the bound of its float32 trie sums (ours are float64).

    That bound: genlm-bytes rounds each token's probability to float32 (``u`` relative) and sums a node's
    at most V of them in float32 (:func:`bounds.sum_error`, relative to the node's mass, all terms
    positive), ours sums in float64; so a node's mass is off by a relative ``e = u + s_V(u) + s_V(u64)``.
    Prefilling ``n`` bytes moves each beam item down the trie one byte at a time, its weight multiplied by
    a child's mass over its node's (off by at most ``2e / (1 - e)`` in log), and a weight is renormalised
    at each token boundary by the same masses; the next-byte distribution is one more such ratio. So log Z
    and every next-byte log-probability are off by at most ``2 (n + 1) (2e / (1 - e))``: 2 for the
    masses of the two sides' items, ``n + 1`` steps."""
    import genlm.bytes as gb

    text = b"The capital of France is"
    eos = [b"<|endoftext|>"]

    async def run(beam_cls, params_cls, lm):
        beam = await beam_cls.initial(lm, params_cls(K=8, eos_byte_strings=eos, heal=False))
        beam = await beam.prefill(text)
        logp = await beam.logp_next()
        out = (float(beam.logZ), np.asarray(logp.ps, dtype=np.float64), len(beam))
        await beam.cleanup()
        return out

    recorded = Recorder(ours.genlm_lm, monkeypatch)
    genlm_compat.install()
    try:
        assert gb.ByteBeamState is genlm_compat.CompatByteBeamState
        got = asyncio.run(run(gb.ByteBeamState, gb.BeamParams, ours))
    finally:
        genlm_compat.uninstall()
    assert gb.ByteBeamState is not genlm_compat.CompatByteBeamState
    check_rows_are_genlm_backends("genlm-bytes beam", recorded.rows, seed_lm, model_dir)
    replay(seed_lm, recorded.rows, monkeypatch)
    want = asyncio.run(run(gb.ByteBeamState, gb.BeamParams, seed_lm))
    vocab = len(seed_lm.byte_vocab)
    e = bounds.U32 + float(bounds.sum_error(vocab, 1.0)) + float(bounds.sum_error(vocab, 1.0, bounds.U64))
    tol = bounds.Bound(
        2 * (len(text) + 1) * 2 * e / (1 - e), f"float32 trie sums of V={vocab} over {len(text) + 1} byte steps"
    )
    bounds.within("compat: genlm-bytes beam log Z vs genlm-backend's", abs(got[0] - want[0]), tol)
    finite = np.isfinite(want[1])
    assert (np.isfinite(got[1]) == finite).all()
    next_byte = float(np.abs(got[1][finite] - want[1][finite]).max())
    bounds.within("compat: genlm-bytes next byte vs genlm-backend's", next_byte, tol)


@pytest.mark.slow
@pytest.mark.process
def test_importing_genlm_backend_leaves_the_environment_alone():
    """genlm-backend sets VLLM_USE_V2_MODEL_RUNNER=1 on import, which stops vLLM's CPU build from starting."""
    import os
    import subprocess
    import sys

    code = "import os, genlm_compat; print(os.environ.get('VLLM_USE_V2_MODEL_RUNNER'))"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "None"


def test_a_dropped_wrapper_frees_its_model():
    import gc
    import weakref

    lm = load_model_by_name("gpt2", backend="mock")
    alive = weakref.ref(lm)
    wrapped = genlm_compat.wrap(lm)
    assert genlm_compat.wrap(lm) is wrapped
    del lm, wrapped
    gc.collect()
    assert alive() is None


#: The genlm-backend class each of genlm's backends stands in for; every other backend gets the base class.
SEED_CLASS_OF = {
    "hf": "genlm.backend.llm.hf:AsyncTransformer",
    "vllm": "genlm.backend.llm.vllm:AsyncVirtualLM",
    "mock": "genlm.backend.llm.base:MockAsyncLM",
    "mlx": "genlm.backend.llm.mlx:AsyncMlxLM",
}


def named(ref):
    module, _, name = ref.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


INSTALLED = sorted(__import__("genlm_core").get_plugins().backends())


@pytest.mark.parametrize("backend", INSTALLED)
def test_every_installed_backend_is_recognised_and_wrapped(backend):
    """The backend a model's class belongs to comes from the registry (llamacpp and third-party backends
    included), and its wrapper subclasses genlm-backend's class for it, or genlm-backend's base."""
    from genlm_compat.lm import backend_of, wrapper_class

    from genlm_core import get_plugins
    from genlm_core.registry import resolve

    factory = get_plugins().backend(backend).factory
    cls = resolve(factory.rpartition(".")[0]) if isinstance(factory, str) else factory.__self__
    assert isinstance(cls, type), f"{backend}'s factory {factory!r} is not a method of its model class"
    assert backend_of(cls) == backend
    assert backend_of(type("UserSubclass", (cls,), {})) == backend  # a user's subclass keeps its backend
    wrapper = wrapper_class(backend)
    assert issubclass(wrapper, genlm_compat.CompatLM)
    assert issubclass(wrapper, named(SEED_CLASS_OF.get(backend, "genlm.backend.llm.base:AsyncLM")))


def test_a_third_party_backend_is_wrapped_with_the_base_class(toy_tok):
    from genlm.backend.llm.base import AsyncLM as SeedAsyncLM

    from genlm_core import AsyncLM, BackendOptions, hookimpl
    from genlm_core.testing import registered

    class ThirdPartyLM(AsyncLM):
        @classmethod
        def from_options(cls, model, options):
            return cls(toy_tok, options)

        def forward_batch(self, requests):
            return torch.zeros(len(requests), self.vocab_size)

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register.backend("thirdparty", ThirdPartyLM.from_options, options=BackendOptions)

    with registered(Plugin()):
        lm = load_model_by_name("anything", backend="thirdparty")
        wrapped = genlm_compat.wrap(lm)
        assert genlm_compat.lm.backend_of(lm) == "thirdparty"
        assert isinstance(wrapped, SeedAsyncLM) and not isinstance(wrapped, (SeedMock, SeedTransformer))
        # uniform float32 logprobs, each off -log V by log_softmax_error; exp (FN_ULPS_U u32 each) and a
        # float32 sum of V terms
        row = wrapped.next_token_logprobs_sync([1])
        v = row.numel()
        entry = float(bounds.log_softmax_error(v, math.log(v)))
        tol = math.expm1(entry) + bounds.FN_ULPS_U * bounds.U32 + float(bounds.sum_error(v, 1.0 + entry))
        bounds.within("compat: wrapped row sums to 1", abs(row.exp().sum().item() - 1.0), tol)
        lm.cleanup()
