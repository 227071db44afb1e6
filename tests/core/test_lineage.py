"""Core's lineage: which request continues which live context (the live index's plan, and nearest_prefix)."""

from genlm_core import Request
from genlm_core.lineage import Continuation, nearest_prefix
from genlm_core.live_index import LiveIndex


def test_each_live_context_is_continued_once_by_exact_tokens_and_adapter():
    live: LiveIndex[str] = LiveIndex(lookback=2)
    live.keep(Request((1, 2, 3)), "a")
    live.keep(Request((1, 2, 3), "lora"), "b")
    live.keep(Request((7, 8)), "c")
    requests = [
        Request((1, 2, 3, 4)),
        Request((1, 2, 3, 5)),  # a sibling: forks "a"
        Request((1, 2, 3, 4, 6), "lora"),
        Request((1, 2, 3)),  # the live context itself: computed afresh
        Request((1, 2, 3, 7), "other"),  # another adapter: no relation
    ]
    plan, released = live.plan(requests)
    assert plan == [Continuation("a", (4,)), Continuation("a", (5,), fork=True), Continuation("b", (4, 6)), None, None]
    assert released == [] and live.contexts() == [Request((7, 8))]  # "c" was not continued: it stays live
    assert nearest_prefix({Request((1, 2)): "x"}.get, Request((1, 2, 3, 4)), lookback=1) is None
    assert nearest_prefix({Request((1, 2)): "x"}.get, Request((1, 2, 3, 4)), lookback=2) == (2, "x")
    assert nearest_prefix({Request((1,)): "x"}.get, Request((1,)), lookback=5) == (0, "x")
    assert nearest_prefix({Request((1, 2), "a"): "x"}.get, Request((1, 2, 3)), lookback=2) is None  # adapter


def test_unclaimed_contexts_stay_live_until_evicted_oldest_first():
    live: LiveIndex[str] = LiveIndex()
    live.keep(Request((1, 2)), "a")
    live.keep(Request((5, 6)), "b")
    live.keep(Request((8,)), "c")
    plan, released = live.plan([Request((5, 6, 7))])  # continues "b"; "a" and "c" wait
    assert plan == [Continuation("b", (7,))] and released == []
    assert live.keep(Request((5, 6, 7)), "b") is None
    plan, released = live.plan([Request((1, 2, 3)), Request((1, 2, 4))])  # a later batch still continues "a"
    assert plan == [Continuation("a", (3,)), Continuation("a", (4,), fork=True)] and released == []
    live.keep(Request((1, 2, 3)), "a")
    live.keep(Request((1, 2, 4)), "d")
    assert live.keep(Request((8,)), "e") == "c"  # a fresh sequence for a live context displaces the old one
    assert [live.evict() for _ in range(5)] == [
        ("b", Request((5, 6, 7))),
        ("a", Request((1, 2, 3))),
        ("d", Request((1, 2, 4))),
        ("e", Request((8,))),
        None,
    ]


def test_unclaimed_contexts_are_released_after_max_idle_batches():
    live: LiveIndex[str] = LiveIndex(max_idle_batches=2)
    live.keep(Request((1, 2)), "a")
    live.keep(Request((5, 6)), "b")
    assert live.plan([Request((9,))]) == ([None], [])  # idle for one batch: both stay
    plan, released = live.plan([Request((5, 6, 7))])  # "b" continued, "a" idle for two
    assert plan == [Continuation("b", (7,))] and released == []
    live.keep(Request((5, 6, 7)), "b")
    assert live.plan([Request((9,))]) == ([None], ["a"])  # a third idle batch: released
    assert live.plan([Request((5, 6, 7, 8))]) == ([Continuation("b", (8,))], [])  # "b"'s count restarted
