"""Generated bad input at the core's other entry points: the batcher, options and configs, the tries,
the byte beam. Each must raise TypeError/ValueError naming the value, never hang, never change a
later answer."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_core import (
    AutoBatcher,
    BatcherError,
    ClosedError,
    ConfigError,
    OptionsError,
    load_model,
    load_model_by_name,
)
from genlm_core.bytes import AsyncTokenByteTrie, BeamParams, ByteBeamState, TokenByteTrie, TrieMode
from genlm_core.testing import bounds
from genlm_core.testing.tokenizers import toy_tokenizer
from genlm_core.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

SETTINGS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VOCAB = [b"a", b"ab", b"abc", b"b", b"ba", b"c", b"\xe2\x82", b"\xe2\x82\xac"]
V = len(VOCAB)

not_a_count = st.one_of(
    st.integers(max_value=0),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.integers(min_value=1).map(float),
)
not_a_timeout = st.one_of(
    st.floats(max_value=-1e-300),
    st.just(float("inf")),
    st.just(float("nan")),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


# ---- the batcher and the options that reach it --------------------------------------------------


@SETTINGS
@given(batch_size=not_a_count)
def test_batcher_refuses_a_batch_size_that_is_not_a_positive_integer(batch_size):
    with pytest.raises((TypeError, ValueError), match="batch_size"):
        AutoBatcher(lambda xs: xs, batch_size=batch_size)
    with pytest.raises((TypeError, ValueError), match="batch_size"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, batch_size=batch_size)
    with pytest.raises((TypeError, ValueError), match="batch_size"):
        AsyncTokenByteTrie.from_vocab(VOCAB, batch_size=batch_size)


@SETTINGS
@given(timeout=not_a_timeout)
def test_batcher_refuses_a_timeout_that_is_not_finite_and_non_negative(timeout):
    with pytest.raises((TypeError, ValueError), match="timeout"):
        AutoBatcher(lambda xs: xs, timeout=timeout)
    with pytest.raises((TypeError, ValueError), match="timeout"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, timeout=timeout)


@settings(max_examples=40, deadline=None, database=None)
@given(
    option=st.sampled_from(["batch_size", "timeout", "cache_size", "keep_batches", "scale"]),
    value=st.one_of(
        st.just(float("inf")), st.just(float("nan")), st.just(-1), st.just(1.5), st.booleans(), st.just("x")
    ),
)
def test_backend_options_refuse_non_finite_fractional_and_boolean_numbers(option, value):
    if option in ("timeout", "scale") and value == 1.5:
        return  # a valid float
    with pytest.raises(OptionsError, match=f"option '{option}'"):
        load_model_by_name("gpt2", backend="mock", llm_opts={option: value})


def test_toml_config_with_an_infinite_timeout_is_refused(tmp_path):
    config = tmp_path / "model.toml"
    config.write_text('backend = "mock"\nmodel = "gpt2"\n[options]\ntimeout = inf\n')
    with pytest.raises(OptionsError, match=r"option 'timeout'.*finite"):
        load_model(config)
    config.write_text('backend = "mock"\nmodel = "gpt2"\n[options]\ntimeout = 0.5\n')
    lm = load_model(config)
    assert lm.batcher.timeout == 0.5
    lm.cleanup()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "got NoneType"),
        (5, "got int"),
        ([], "got list"),
        ({"model": ""}, "model: String should have at least 1 character"),
        ({"backend": "mock"}, "model: Field required"),
        ({"model": "gpt2", "colour": 1}, "colour: Extra inputs"),
        ({"model": "gpt2", "options": 3}, "options: Input should be a valid dictionary"),
        ("nosuch.toml", "cannot read config file nosuch.toml"),
        ("model.yaml", "must end in .toml or .json"),
    ],
)
def test_bad_configs_are_config_errors_naming_the_problem(config, message):
    with pytest.raises(ConfigError, match=message):
        load_model(config)


def test_bad_config_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("model = ")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML"):
        load_model(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a dict"):
        load_model(listed)


@pytest.mark.parametrize(("name", "error"), [(None, TypeError), ("", TypeError), (5, TypeError)])
def test_load_model_by_name_refuses_a_name_that_is_not_a_string_before_any_loading(name, error):
    with pytest.raises(error, match="name must be a model name or path"):
        load_model_by_name(name, backend="hf")


async def test_a_dead_batch_worker_fails_every_waiter_and_says_so_on_the_next_submit(monkeypatch):
    batcher = AutoBatcher(lambda xs: [x * 2 for x in xs], batch_size=4, timeout=0.01)

    async def broken_flush_policy():
        raise RuntimeError("flush policy bug")

    monkeypatch.setattr(batcher, "_next_batch", broken_flush_policy)
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit(i, i) for i in range(3)), return_exceptions=True), 5
    )
    assert all(isinstance(r, BatcherError) and "flush policy bug" in str(r) for r in results)
    assert isinstance(results[0].__cause__, RuntimeError)
    monkeypatch.undo()
    with pytest.raises(BatcherError, match="flush policy bug"):
        await batcher.submit(1, 1)  # says so once
    assert await asyncio.wait_for(batcher.submit(5, 5), 5) == 10  # then serves again


async def test_a_closed_batcher_refuses_new_work_and_fails_queued_work():
    batcher = AutoBatcher(lambda xs: xs, batch_size=8, timeout=0.05)
    queued = asyncio.ensure_future(batcher.submit(1, 1))
    await asyncio.sleep(0)
    batcher.close()
    with pytest.raises(ClosedError):
        await queued
    with pytest.raises(ClosedError):
        await batcher.submit(2, 2)
    batcher.close()  # twice is fine


async def test_batcher_statistics_stay_bounded():
    batcher = AutoBatcher(lambda xs: xs, batch_size=1, timeout=0)
    for i in range(3000):
        await batcher.submit(i, i)
    assert batcher.stats.batches == 3000 and len(batcher.stats.sizes) == 1000


# ---- trie weights -------------------------------------------------------------------------------

ENGINES = {
    "numba": TokenCharacterTrie,
    "torch": lambda vocab: ParallelTokenCharacterTrie(vocab, device="cpu"),
}


@st.composite
def bad_weights(draw):
    kind = draw(st.sampled_from(["nonfinite", "length", "dtype", "type", "ndim"]))
    if kind == "nonfinite":
        w = draw(st.lists(st.floats(0, 1), min_size=V, max_size=V))
        w[draw(st.integers(0, V - 1))] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        return np.array(w)
    if kind == "length":
        return np.ones(draw(st.integers(0, 20).filter(lambda n: n != V)))
    if kind == "dtype":
        return draw(
            st.sampled_from([np.ones(V, dtype=bool), np.ones(V, dtype=complex), np.array(["x"] * V), torch.ones(V) > 0])
        )
    if kind == "ndim":
        return np.ones((2, 2, V))
    return draw(st.sampled_from([None, "weights", 3.0, {1: 2}]))


def only_neg_inf(ws):
    """Whether ``ws`` is one float vector whose only non-finite entries are -inf."""
    if not (isinstance(ws, np.ndarray) and ws.dtype == np.float64 and ws.shape == (V,)):
        return False
    return bool(np.all(np.isfinite(ws) | np.isneginf(ws)))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_trie_engines_refuse_bad_weights_and_answer_correctly_after(engine):
    trie = ENGINES[engine](VOCAB)
    good = np.linspace(0.1, 0.8, V)
    expected = trie.weight_sum(good).copy()

    @SETTINGS
    @given(ws=bad_weights())
    def refused(ws):
        for op in ("weight_sum", "batch_weight_sum", "weight_max"):
            if op == "weight_max" and only_neg_inf(ws):
                continue  # -inf is log-space zero: valid for weight_max
            with pytest.raises((TypeError, ValueError)):
                getattr(trie, op)(ws)
        np.testing.assert_array_equal(trie.weight_sum(good), expected)  # exact: the same sums of the same input

    refused()


async def test_async_tries_refuse_bad_weights_alone_and_keep_serving():
    char = AsyncTokenCharacterTrie.from_vocab(VOCAB)
    byte = AsyncTokenByteTrie.from_vocab(VOCAB)
    good = np.linspace(0.1, 0.8, V)
    for bad in (np.ones(V + 1), np.array([np.nan] * V), np.ones((2, V)), np.ones(V, dtype=bool), None):
        results = await asyncio.wait_for(
            asyncio.gather(char.weight_sum(good), char.weight_sum(bad), byte.weight_sum(bad), return_exceptions=True), 5
        )
        np.testing.assert_array_equal(results[0], char.trie.weight_sum(good))  # exact: same sums, batched or not
        assert all(isinstance(r, (TypeError, ValueError)) for r in results[1:]), results[1:]
    # mode None is WITHOUT_EOS, as in genlm-bytes (it used to return None)
    np.testing.assert_array_equal(await byte.weight_sum(good, mode=None), byte.trie.weight_sum(good))
    with pytest.raises(ValueError, match="mode must be TrieMode"):
        await byte.weight_sum(good, mode="sideways")
    char.cleanup()
    byte.cleanup()
    with pytest.raises(ClosedError):
        await char.weight_sum(good)
    with pytest.raises(ClosedError):
        await byte.weight_sum(good)


@SETTINGS
@given(
    values=st.lists(st.floats(1e-3, 1.0), min_size=V, max_size=V),  # float16 normal range
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    engine=st.sampled_from(list(ENGINES)),
)
def test_half_precision_weights_work_and_match_float32(values, dtype, engine):
    """What GPU models emit: exactly the float32 answer for the same (rounded) values."""
    trie = ENGINES[engine](VOCAB)
    half = torch.tensor(values, dtype=dtype)
    # exact: half precision widens to float32 (and float64) exactly, then the same sums
    np.testing.assert_array_equal(trie.weight_sum(half), trie.weight_sum(half.float()))
    # against the unrounded values: each weight rounded to half precision (relative U_half: 2**-8 for
    # bfloat16, 2**-11 for float16; all positive, so a node's sum moves by at most U_half x its mass),
    # plus two float64 trie sums in any order
    u_half = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    want = trie.weight_sum(np.array(values))
    tol = u_half * want + 2 * bounds.tree_sum_error(trie.index.parent, trie.index.depth, want)
    bounds.within_each("half weights vs unrounded", trie.weight_sum(half), want, tol, f"{dtype} rounding + 2 trie sums")
    logs = half.log()  # computed in half precision: compare with the same values widened
    np.testing.assert_array_equal(trie.weight_max(logs), trie.weight_max(logs.float()))
    byte = TokenByteTrie(VOCAB)
    masses = byte.masses(half)
    reference = byte.masses(half.float())
    assert all(masses[n] == reference[n] for n in range(byte.trie.num_nodes))  # exact, as above


async def test_async_tries_take_half_precision_weights():
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB)
    w = torch.linspace(0.1, 0.8, V, dtype=torch.bfloat16)
    np.testing.assert_array_equal(await trie.weight_sum(w), trie.trie.weight_sum(w.float()))  # exact widening
    trie.cleanup()


@SETTINGS
@given(probs=bad_weights())
def test_byte_trie_masses_refuse_what_weight_sum_refuses(probs):
    with pytest.raises((TypeError, ValueError)):
        TokenByteTrie(VOCAB).masses(probs)


def test_byte_trie_masses_refuse_negative_probabilities():
    p = np.full(V, 1.0 / V)
    p[3] = -0.1
    with pytest.raises(ValueError, match=r"probability of token 3 is -0\.1"):
        TokenByteTrie(VOCAB).masses(p)


@pytest.mark.parametrize("mode", list(TrieMode))
def test_byte_trie_masses_of_log_probabilities_equal_those_of_their_exponentials(mode):
    """``masses(logp, log=True)`` (numpy's exp in float64 of a float32 row) against the float64
    exponentials summed by the probability path: every node, the root's total and EOS."""
    logp = torch.log_softmax(torch.linspace(-3.0, 4.0, V) ** 2, 0)
    trie = TokenByteTrie(VOCAB, eos_token_ids=[1])
    got, reference = trie.masses(logp, mode, log=True), trie.masses(logp.double().exp().numpy(), mode)
    # Two float64 exps (numpy's and torch's, each within FN_ULPS_U u of the exact value: 2 FN_ULPS_U u
    # apart, relative) summed twice (the total in other orders; a node's slice the same way, but of
    # other inputs): 2 FN_ULPS_U U64 S + 2 sum_error(n terms, S) for a node of n leaves.
    exps = 2 * bounds.FN_ULPS_U * bounds.U64

    def tol(n, s):
        return bounds.Bound(exps * s + 2 * float(bounds.sum_error(n, s, bounds.U64)), f"2 float64 exps + 2 sums of {n}")

    t = trie
    bounds.within("masses(log=True): total", abs(got.total - reference.total), tol(len(t.leaf_tokens), reference.total))
    bounds.within("masses(log=True): EOS", abs(got.eos - reference.eos), tol(len(t.eos_token_ids), reference.eos))
    for n in range(t.trie.num_nodes):
        if n not in (t.root, t.eos_node):
            leaves = int(t.leaf_hi[n] - t.leaf_lo[n])
            bounds.within("masses(log=True): node", abs(got[n] - reference[n]), tol(leaves, reference[n]), f"node {n}")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_byte_trie_masses_of_log_probabilities_name_the_token_whose_exponential_is_bad(bad):
    logp = torch.full((V,), -math.log(V))
    logp[4] = bad
    with pytest.raises(ValueError, match=rf"probability of token 4 is exp\({bad}\)"):
        TokenByteTrie(VOCAB).masses(logp, log=True)


@SETTINGS
@given(text=st.text(max_size=4))
def test_a_str_prefix_means_its_utf8_bytes(text):
    trie = TokenCharacterTrie(VOCAB)
    assert trie.node_of_prefix(text) == trie.node_of_prefix(text.encode("utf-8"))
    byte = TokenByteTrie(VOCAB)
    assert byte.node_of(text) == byte.node_of(text.encode("utf-8"))


@pytest.mark.parametrize("prefix", [5, None, [97], 1.5])
def test_a_prefix_that_is_not_text_is_refused(prefix):
    with pytest.raises(TypeError, match="prefix must be bytes"):
        TokenCharacterTrie(VOCAB).node_of_prefix(prefix)


# ---- the byte beam ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_lm():
    lm = load_model_by_name("gpt2", backend="mock", llm_opts={"timeout": 0})
    # the mock over a small real tokenizer keeps each beam step cheap
    from genlm_core.mock import MockAsyncLM

    small = MockAsyncLM(toy_tokenizer(), timeout=0)
    lm.cleanup()
    yield small
    small.cleanup()


not_a_symbol = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=258),
    st.just(256),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.binary(min_size=1, max_size=2),
)


def test_beam_refuses_bad_symbols_and_stays_correct(toy_lm):
    async def run():
        beam = await ByteBeamState.initial(toy_lm, BeamParams(K=4))
        beam = await beam.prefill(b"ab")
        expected = (await beam.logp_next()).ps.copy()

        @SETTINGS
        @given(b=not_a_symbol)
        def refused(b):
            async def shift():
                return await (beam << b)

            with pytest.raises((TypeError, ValueError), match="a byte must be"):
                asyncio.run(shift())

        await asyncio.to_thread(refused)
        np.testing.assert_array_equal((await beam.logp_next()).ps, expected)
        after = await (beam << ord("c"))
        assert math.isfinite(after.logZ)
        beam.cleanup()

    asyncio.run(run())


def test_beam_reads_a_str_as_its_utf8_bytes(toy_lm):
    async def run(text):
        beam = await ByteBeamState.initial(toy_lm, BeamParams(K=8))
        a = await beam.prefill(text)
        b = await beam.prefill(text.encode("utf-8"))
        greedy_str = await beam.greedy(text, 3)
        greedy_bytes = await beam.greedy(text.encode(), 3)
        beam.cleanup()
        return a.logZ, b.logZ, greedy_str, greedy_bytes

    for text in ["Hello", "€ café", ""]:
        za, zb, ga, gb = asyncio.run(run(text))
        assert za == zb and math.isfinite(za) and ga == gb


@SETTINGS
@given(
    field=st.sampled_from(["K", "prune_threshold", "heal_max_backoff", "heal_max_splits", "heal", "eos_byte_strings"]),
    value=st.one_of(
        st.floats(),
        st.integers(-3, 0),
        st.booleans(),
        st.none(),
        st.text(max_size=2),
        st.binary(min_size=1, max_size=4),
    ),
)
def test_beam_params_refuse_bad_values(field, value):
    args = {"K": 2, field: value}
    valid = {
        "K": lambda v: type(v) is int and v >= 1,
        "prune_threshold": lambda v: type(v) in (int, float) and 0 <= v < 1,
        "heal_max_backoff": lambda v: v is None or (type(v) is int and v >= 0),
        "heal_max_splits": lambda v: v is None or (type(v) is int and v >= 0),
        "heal": lambda v: type(v) is bool,
        "eos_byte_strings": lambda v: v is None,
    }[field]
    if valid(value):
        BeamParams(**args)
    else:
        with pytest.raises((TypeError, ValueError), match=field):
            BeamParams(**args)


def test_eos_given_as_bare_bytes_is_refused_not_read_as_ids(toy_lm):
    with pytest.raises(TypeError, match=r"write \[b'</s>'\]"):
        BeamParams(K=2, eos_byte_strings=b"</s>")
    params = BeamParams(K=2, eos_byte_strings=[b"<eos>"])

    async def run():
        beam = await ByteBeamState.initial(toy_lm, params)
        ids = beam.states[0].trie.trie.eos_token_ids
        beam.cleanup()
        return ids

    assert asyncio.run(run()) == [0]  # the toy tokenizer's <eos> is id 0


def test_closed_beam_raises_closed_error_on_every_call(toy_lm):
    async def run():
        beam = await ByteBeamState.initial(toy_lm, BeamParams(K=2))
        beam = await beam.prefill(b"a")
        beam.cleanup()
        beam.cleanup()  # twice is fine
        for call in (
            lambda: beam << 98,
            beam.logp_next,
            lambda: beam.prefill(b"b"),
            lambda: beam.greedy(b"a", 2),
            lambda: beam.sample(b"a", 2, seed=0),
            lambda: beam.extend(beam.logZ),
        ):
            with pytest.raises(ClosedError, match="closed by cleanup"):
                await call()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"steps": -1}, "steps"), ({"steps": 1.5}, "steps"), ({"seed": -1}, "seed")]
)
def test_generation_arguments_are_checked(toy_lm, kwargs, message):
    async def run():
        beam = await ByteBeamState.initial(toy_lm, BeamParams(K=2))
        try:
            await beam.sample(b"a", **{"steps": 2, **kwargs})
        finally:
            beam.cleanup()

    with pytest.raises((TypeError, ValueError), match=message):
        asyncio.run(run())


def test_mode_is_checked_on_the_sync_byte_trie():
    trie = TokenByteTrie(VOCAB)
    with pytest.raises(ValueError, match="mode must be TrieMode"):
        trie.weight_sum(np.ones(V), mode="sideways")
    np.testing.assert_array_equal(
        trie.weight_sum(np.ones(V), mode="with_eos"), trie.weight_sum(np.ones(V), TrieMode.WITH_EOS)
    )


# ---- constructors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TokenByteTrie(VOCAB, eos_token_ids=[1.5]), "eos_token_ids entry must be an integer, got 1.5"),
        (lambda: TokenByteTrie(VOCAB, eos_token_ids=1), "eos_token_ids must be an iterable"),
        (lambda: TokenByteTrie(VOCAB, eos_token_ids=[V]), f"eos_token_ids entry {V} is outside"),
        (lambda: TokenByteTrie(None), "decode must be a sequence of byte strings"),
        (lambda: TokenCharacterTrie(b"abc"), "decode must be a sequence of byte strings"),
        (lambda: AsyncTokenCharacterTrie.from_vocab(None), "vocab must be a sequence of byte strings"),
    ],
)
def test_trie_constructors_check_their_arguments(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_eos_ids_are_not_truncated():
    """``eos_token_ids=[1.5]`` used to make token 1 the EOS."""
    assert TokenByteTrie(VOCAB, eos_token_ids=[np.int64(1)]).eos_token_ids == [1]


@pytest.mark.parametrize("size", [-1, 1.5, True, None])
def test_cache_bounds_are_checked(size):
    from genlm_core import OutputCache
    from genlm_core.prefix_cache import PrefixCache

    with pytest.raises((TypeError, ValueError), match="maxsize"):
        OutputCache(size)
    with pytest.raises((TypeError, ValueError), match="max_entries"):
        PrefixCache(size)


def test_options_built_directly_raise_options_errors_naming_the_option():
    from genlm_core.mock import MockAsyncLM

    with pytest.raises(OptionsError, match=r"invalid options for MockOptions: option 'batch_size'"):
        MockAsyncLM.from_name("gpt2", batch_size=1.5)
    with pytest.raises(OptionsError, match=r"unknown option 'sead' \(known: batch_size"):
        MockAsyncLM.from_name("gpt2", sead=1)


@pytest.mark.parametrize("bad", [5, None, "ab"])
def test_batch_entry_points_need_a_list_of_contexts(toy_lm, bad):
    with pytest.raises(TypeError, match="token_ids_list must be an iterable of token id sequences"):
        toy_lm.batch_next_token_logprobs_sync(bad)
    with pytest.raises(TypeError, match="token_ids_list must be an iterable of token id sequences"):
        asyncio.run(toy_lm.batch_next_token_logprobs(bad))
