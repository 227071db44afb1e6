import copy
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from genlm_core import Token


def test_seed_constructor_and_helpers():
    tok = Token(7, b"ab")
    assert tok.token_id == 7 and tok.byte_string == b"ab" and type(tok.byte_string) is bytes
    assert Token(token_id=7, byte_string=b"ab") == tok
    assert Token.as_bytes(tok) == b"ab" and type(Token.as_bytes(tok)) is bytes
    assert Token.as_bytes(b"cd") == b"cd"
    assert Token.is_plain_bytes(b"ab") and not Token.is_plain_bytes(tok) and not Token.is_plain_bytes("ab")
    assert Token(np.int64(3), b"x").token_id == 3


@pytest.mark.parametrize("bad", [(b"ab", 7), (1.0, b"a"), (True, b"a"), ("1", b"a"), (1, "a")])
def test_constructor_rejects_wrong_types(bad):
    with pytest.raises(TypeError, match="Token"):
        Token(*bad)


def test_plain_bytes_find_tokens_consistently():
    tok = Token(7, b"ab")
    assert tok == b"ab" and b"ab" == tok and tok == bytearray(b"ab")
    assert hash(tok) == hash(b"ab")
    # genlm-backend's Token hashes by id, so there the set lookup disagrees with == and list lookup
    assert (b"ab" in {tok}) == (b"ab" in [tok]) == (b"ab" == tok) is True
    assert tok in {b"ab"} and tok in {b"ab": 1}
    assert b"zz" not in {tok} and b"zz" not in [tok] and tok != b"zz"


def test_duplicate_byte_strings_stay_distinct():
    a, b = Token(1, b"x"), Token(2, b"x")
    assert a != b and len({a, b}) == 2 and {a: 1, b: 2}[b] == 2
    assert a == Token(1, b"x") and a != Token(1, b"y")
    assert a.index(b"x") == 0 and [a, b].index(b) == 1


@given(st.lists(st.tuples(st.integers(0, 5), st.binary(max_size=2)), max_size=12), st.binary(max_size=2))
def test_contract_is_consistent(pairs, probe):
    """Equal objects hash equally; Token==Token by (id, bytes); Token==bytes by content."""
    toks = [Token(i, b) for i, b in pairs]
    for x in toks:
        for y in toks:
            assert (x == y) == ((x.token_id, bytes(x)) == (y.token_id, bytes(y)))
            if x == y:
                assert hash(x) == hash(y)
        assert (x == probe) == (bytes(x) == probe) and ((x == probe) <= (hash(x) == hash(probe)))
    assert len(set(toks)) == len({(t.token_id, bytes(t)) for t in toks})
    assert (probe in set(toks)) == (probe in toks) == any(bytes(t) == probe for t in toks)


def test_token_behaves_as_bytes():
    tok = Token(3, b"\xe4\xbd\xa0")
    assert isinstance(tok, bytes) and tok.decode() == "你" and tok[:1] == b"\xe4"
    assert b"".join([Token(1, b"a"), Token(2, b"b")]) == b"ab"
    assert repr(tok) == "Token(token_id=3, byte_string=b'\\xe4\\xbd\\xa0')"


def test_token_pickles_and_copies_with_id():
    tok = Token(42, b"hi")
    for back in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok), copy.copy(tok)):
        assert type(back) is Token and back == tok and back.token_id == 42
    assert pickle.loads(pickle.dumps([tok, tok]))[1].token_id == 42
