import pickle

from genlm_core import Token


def test_token_is_its_bytes_for_eq_and_hash():
    tok = Token(b"ab", 7)
    assert tok == b"ab" and b"ab" == tok
    assert hash(tok) == hash(b"ab")
    # the seed library's Token makes these two disagree
    assert (b"ab" in {tok}) == (b"ab" in [tok]) == (b"ab" == tok) is True
    assert (tok in {b"ab"}) and (tok in {b"ab": 1})
    assert b"zz" not in {tok} and b"zz" not in [tok]


def test_duplicates_are_equal_but_keep_their_ids():
    a, b = Token(b"x", 1), Token(b"x", 2)
    assert a == b and len({a, b}) == 1
    assert {t.token_id for t in (a, b)} == {1, 2}


def test_token_behaves_as_bytes():
    tok = Token(b"\xe4\xbd\xa0", 3)
    assert isinstance(tok, bytes) and tok.decode() == "你" and tok[:1] == b"\xe4"
    assert b"".join([Token(b"a", 1), Token(b"b", 2)]) == b"ab"
    assert repr(tok) == "Token(b'\\xe4\\xbd\\xa0', token_id=3)"


def test_token_pickles_with_id():
    tok = Token(b"hi", 42)
    back = pickle.loads(pickle.dumps(tok))
    assert type(back) is Token and back == tok and back.token_id == 42
    assert pickle.loads(pickle.dumps([tok, tok]))[1].token_id == 42
