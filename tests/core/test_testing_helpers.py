"""genlm_core.testing's own helpers, against plain-Python references."""

from __future__ import annotations

import pytest
import torch

from genlm_core.testing import max_abs_diff


def brute_force(rows: list[list[float]], others: list[list[float]]) -> float:
    return max(abs(a - b) for row, other in zip(rows, others, strict=True) for a, b in zip(row, other, strict=True))


def test_max_abs_diff_of_two_rows_two_batches_and_two_lists_of_rows():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 50, generator=g).log_softmax(1), torch.randn(3, 50, generator=g).log_softmax(1)
    want = brute_force(a.double().tolist(), b.double().tolist())
    assert max_abs_diff(a, b) == want  # two batches
    assert max_abs_diff(list(a), list(b)) == want  # two lists of rows
    assert max_abs_diff(list(a), b) == want  # a list against a batch
    assert max_abs_diff(a[1], b[1]) == brute_force([a[1].double().tolist()], [b[1].double().tolist()])  # two rows
    assert max_abs_diff(a[1], a[1].clone()) == 0.0


def test_max_abs_diff_refuses_what_does_not_pair():
    row = torch.zeros(5)
    with pytest.raises(ValueError, match=r"shapes differ: \(5,\) and \(1, 5\)"):
        max_abs_diff(row, row[None])  # would broadcast
    with pytest.raises(ValueError, match="2 rows against 3"):
        max_abs_diff([row, row], [row, row, row])  # would drop a pair
    with pytest.raises(ValueError, match="shapes differ"):
        max_abs_diff([row], [torch.zeros(4)])
    with pytest.raises(ValueError, match="no rows"):
        max_abs_diff([], [])
    with pytest.raises(ValueError, match="no values"):
        max_abs_diff(torch.zeros(0), torch.zeros(0))
