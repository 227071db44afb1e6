"""decode_vocab on real tokenizers: round trip for any text, duplicates, errors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_core import Token, VocabDecodingError, decode_vocab, decode_vocabulary
from genlm_core.tokenization.vocab import encode_ids

# Emoji, CJK, combining marks, control characters, runs of spaces and newlines, accents, RTL.
ASCII = [*"abcXYZ019 .,'\"!?-_"]
WHITESPACE_AND_CONTROL = [" ", "  ", "    ", "\n", "\n\n", "\t", "\r\n", "\x00", "\x07", "\x1b", "\x7f"]
ACCENTS_AND_COMBINING = ["é", "ü", "ß", "ñ", "e\u0301", "\u0301", "\u0308", "\u200d", "\ufeff"]
CJK_AND_OTHER_SCRIPTS = ["你", "好", "世界", "日本語", "한국어", "ไทย", "עברית", "العربية"]
EMOJI_AND_ASTRAL = ["🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "😀", "𝔘", "\U0010ffff"]
ALPHABET = st.sampled_from(
    [*ASCII, *WHITESPACE_AND_CONTROL, *ACCENTS_AND_COMBINING, *CJK_AND_OTHER_SCRIPTS, *EMOJI_AND_ASTRAL]
)
TEXTS = st.lists(ALPHABET, max_size=40).map("".join)
SENTENCEPIECE = {"mistral-v1", "mistral-v3"}


class Decoded:
    """A tokenizer with its byte vocabulary (short repr: hypothesis prints fixtures on failure)."""

    def __init__(self, name, tok):
        self.name, self.tok, self.byte_vocab = name, tok, decode_vocab(tok)[0]

    def __iter__(self):
        return iter((self.name, self.tok, self.byte_vocab))

    def __repr__(self):
        return f"Decoded({self.name})"


@pytest.fixture(scope="module")
def decoded(real_tokenizer):
    return Decoded(*real_tokenizer)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_round_trip(decoded, text):
    name, tok, byte_vocab = decoded
    joined = b"".join(byte_vocab[i] for i in encode_ids(tok, text))
    expected = text.encode("utf-8")
    if name in SENTENCEPIECE and text and not text.startswith(" "):
        # These SentencePiece tokenizers prepend a dummy-prefix "▁" to text that does not already
        # start with a space (Metaspace, prepend_scheme="first"): that space is the true byte
        # content of the first token, so the bytes carry exactly one extra leading space.
        expected = b" " + expected
    assert joined == expected


def test_vocab_shape_and_ids(decoded):
    _, tok, byte_vocab = decoded
    assert len(byte_vocab) == len(tok)
    assert all(type(t) is Token and t.token_id == i for i, t in enumerate(byte_vocab))


def test_special_tokens_are_their_text(decoded):
    _, tok, byte_vocab = decoded
    assert byte_vocab[tok.eos_token_id] == tok.eos_token.encode()
    for i, added in tok.added_tokens_decoder.items():
        assert byte_vocab[i] == added.content.encode()


def test_byte_fallback_pieces():
    from genlm_core.testing.tokenizers import load_tokenizer

    tok = load_tokenizer("mistral-v1")
    byte_vocab, str_vocab = decode_vocab(tok)
    for b in (0x00, 0x0A, 0x41, 0xFF):
        i = tok.convert_tokens_to_ids(f"<0x{b:02X}>")
        assert byte_vocab[i] == bytes([b])
    i = tok.convert_tokens_to_ids("▁the")
    assert byte_vocab[i] == b" the" and str_vocab[i] == " the"


def _bpe_tokenizer(vocab, merges=(), decoder="ByteLevel"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if decoder == "ByteLevel":
        bpe.decoder = decoders.ByteLevel()
    elif decoder == "WordPiece":
        bpe.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def test_duplicate_byte_strings_are_distinct_tokens():
    from genlm_core.testing.tokenizers import toy_tokenizer

    tok = toy_tokenizer.__wrapped__()  # a private copy: this test adds a token
    regular = tok.convert_tokens_to_ids("Ġthe")
    tok.add_tokens([" the"])  # an added token with the same bytes as a regular one
    added = tok.convert_tokens_to_ids(" the")
    byte_vocab, _ = decode_vocab(tok)
    assert added != regular
    assert byte_vocab[regular] == b" the" and byte_vocab[added] == b" the"
    assert byte_vocab[regular] != byte_vocab[added]  # same bytes, different ids: distinct Tokens
    assert (byte_vocab[regular].token_id, byte_vocab[added].token_id) == (regular, added)


def test_unsupported_decoder_is_named():
    from genlm_core.tokenization.vocab import byte_level_alphabet

    vocab = {c: i for i, c in enumerate(byte_level_alphabet())}
    tok = _bpe_tokenizer(vocab, decoder="WordPiece")
    with pytest.raises(VocabDecodingError, match=rf"{type(tok).__name__}.*WordPiece"):
        decode_vocab(tok)


def test_tokenizer_without_backend_is_named():
    class SlowTokenizer:
        def __len__(self):
            return 3

    with pytest.raises(VocabDecodingError, match=r"SlowTokenizer.*backend_tokenizer"):
        decode_vocab(SlowTokenizer())


def test_stray_characters_fail_loudly():
    from genlm_core.tokenization.vocab import byte_level_alphabet

    vocab = {c: i for i, c in enumerate(byte_level_alphabet())}
    vocab["a b"] = len(vocab)  # a raw space is not in the byte-level alphabet
    with pytest.raises(VocabDecodingError, match="outside the byte alphabet"):
        decode_vocab(_bpe_tokenizer(vocab))


def test_round_trip_check_catches_wrong_vocab(toy_tok, monkeypatch):
    import genlm_core.tokenization.vocab as vocab_mod

    real = vocab_mod.byte_level_alphabet()
    swapped = dict(real)
    swapped["a"], swapped["b"] = real["b"], real["a"]  # a silently wrong byte table
    monkeypatch.setattr(vocab_mod, "byte_level_alphabet", lambda: swapped)
    with pytest.raises(VocabDecodingError, match="round trip"):
        decode_vocabulary(toy_tok)


def test_bare_tokenizers_object(toy_tok):
    bare = toy_tok.backend_tokenizer
    assert decode_vocab(bare)[0] == decode_vocab(toy_tok)[0]


def test_gpt2_is_built_without_tiktoken_exactly_as_transformers_builds_it_with_tiktoken():
    from tiktoken.load import load_tiktoken_bpe
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from genlm_core.testing.tokenizers import GPT2_PATTERN, WHISPER, byte_level_bpe, package_file, read_rank_file

    path = str(package_file(WHISPER, "whisper/assets/gpt2.tiktoken"))
    assert read_rank_file(path) == load_tiktoken_bpe(path)
    ours = byte_level_bpe(read_rank_file(path), GPT2_PATTERN, ["<|endoftext|>"])
    theirs = TikTokenConverter(vocab_file=path, pattern=GPT2_PATTERN, extra_special_tokens=["<|endoftext|>"])
    assert ours.to_str() == theirs.converted().to_str()
