"""The out-of-tree template plugin (examples/plugin_template), installed like a third party's."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from genlm_core import load_model_by_name
from genlm_core.cli import main
from genlm_core.testing import bounds, check_lm_contract
from genlm_core.testing.tokenizers import load_tokenizer

pytest.importorskip("genlm_example", reason="install it: pip install -e examples/plugin_template")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    load_tokenizer("gpt2").save_pretrained(folder)
    return str(folder)


def test_backends_lists_the_template(capsys, monkeypatch):
    from genlm_core.plugins import reset_plugins

    monkeypatch.setenv("GENLM_PLUGINS", "example")  # --check imports only the built-ins and the template
    reset_plugins()
    try:
        for argv, runs in ((["backends"], "installed"), (["backends", "--check"], "yes")):
            assert main(argv) == 0
            line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("example "))
            assert "genlm-example" in line and f"  {runs}  " in line
    finally:
        monkeypatch.delenv("GENLM_PLUGINS")
        reset_plugins()


def test_rows_are_the_smoothed_bigram_probabilities(tokenizer_dir, tmp_path):
    text = "the cat sat on the mat and the cat ran off the mat " * 3
    (tmp_path / "corpus.txt").write_text(text)
    k = 0.5
    lm = load_model_by_name(
        tokenizer_dir, backend="example", llm_opts={"corpus": str(tmp_path / "corpus.txt"), "smoothing": k}
    )
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    pairs = Counter(itertools.pairwise(ids))
    firsts = Counter(ids[:-1])
    vocab = lm.vocab_size
    the, cat = ids[0], ids[1]
    row = lm.next_token_logprobs_sync([5, the])

    def tol(logits_size, logprob):
        """float64 logits (``log(count + k)``) rounded to float32 (U32 |x| each, which moves a logprob by at
        most twice the largest), then a float32 log_softmax over the vocabulary, against a float64 closed form"""
        return bounds.Bound(
            2 * bounds.U32 * logits_size
            + float(bounds.log_softmax_error(vocab, logprob))
            + 8 * bounds.U64 * abs(logprob),
            f"float32 rounding of logits <= {logits_size:.3g} + float32 log_softmax over V={vocab}",
        )

    largest = max(abs(math.log(k)), math.log(max(pairs.values()) + k))
    for nxt in (cat, ids[-1], 0):
        expected = math.log((pairs[(the, nxt)] + k) / (firsts[the] + k * vocab))
        bounds.within("template: smoothed bigram row", abs(row[nxt].item() - expected), tol(largest, expected))
    unseen = lm.next_token_logprobs_sync([7])  # a token never seen first: uniform
    want = -math.log(vocab)
    bounds.within("template: uniform row", abs(unseen.max().item() - want), tol(abs(math.log(k)), want))
    lm.cleanup()


def test_the_template_passes_the_whole_contract(tokenizer_dir):
    lm = load_model_by_name(tokenizer_dir, backend="example", llm_opts={"timeout": 0.001})
    the = lm.tokenizer.encode(" The", add_special_tokens=False)
    check_lm_contract(lm, [the, [5, 6, 7], list(range(100, 140))], close=True)


def test_the_template_options_are_validated(tokenizer_dir):
    from genlm_core import OptionsError

    with pytest.raises(OptionsError, match="option 'smoothing'"):
        load_model_by_name(tokenizer_dir, backend="example", llm_opts={"smoothing": 0})


def test_the_recurrent_template_passes_the_live_check_with_its_reference_and_not_without():
    """The template's forward_uncached (the model's own loop) is the reference that makes the live check
    mean something; left to AsyncLM's default (forward_batch: the live path) the check refuses to run."""
    from genlm_core import AsyncLM
    from genlm_core.testing.live import check_live_sequences
    from genlm_core.testing.tokenizers import toy_tokenizer
    from genlm_example.recurrent import RecurrentLM

    lm = RecurrentLM(toy_tokenizer(), timeout=0.001)
    stats = check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=20)
    assert stats.continued > 0 and stats.rows == stats.continued + stats.forked + stats.copied + stats.fresh

    class WithoutReference(RecurrentLM):
        forward_uncached = AsyncLM.forward_uncached

    lm = WithoutReference(toy_tokenizer(), timeout=0.001)
    with pytest.raises(TypeError, match=r"WithoutReference\.forward_uncached is AsyncLM's default"):
        check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=20)
