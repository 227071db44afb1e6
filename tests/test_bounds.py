"""genlm_core.testing.bounds: each bound holds against a float64 reference for computations in other orders,
and is tight enough to catch a row moved by ten times it; ``within`` asserts and records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from genlm_core.testing import bounds
from genlm_core.testing.models import tiny_model_dir


def float32_sums(x: torch.Tensor) -> dict[str, float]:
    """A float32 sum of ``x`` in several orders: left to right and right to left (numpy's cumsum rounds
    each addition in turn), pairwise (numpy's sum), in 16 lanes then across them."""
    x32 = x.float().numpy()
    pad = (-x32.size) % 16
    lanes = np.cumsum(np.concatenate([x32, np.zeros(pad, np.float32)]).reshape(-1, 16), axis=0)[-1]
    return {
        "left": float(np.cumsum(x32)[-1]),
        "right": float(np.cumsum(x32[::-1])[-1]),
        "pairwise": float(np.sum(x32)),
        "lanes": float(np.cumsum(lanes)[-1]),
    }


@pytest.mark.parametrize("n", [10, 1000, 5000])
def test_a_float32_sum_in_any_order_is_within_its_bound(n):
    g = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=g, dtype=torch.float64).float().double()  # float32 inputs, summed exactly
    exact = float(x.sum())
    worst = bounds.sum_error(n, float(x.abs().sum()), probabilistic=False)
    likely = bounds.sum_error(n, float(x.abs().sum()))
    assert likely <= worst  # the probabilistic constant never exceeds the worst case's
    for order, got in float32_sums(x).items():
        bounds.within(f"bounds: float32 sum of {n}, {order}", abs(got - exact), likely)


def log_softmax_float32(logits: torch.Tensor, order: str) -> torch.Tensor:
    """A float32 log_softmax of ``logits`` with its sum of exponentials in ``order``."""
    x = logits.float()
    d = x - x.max()
    e = d.exp()
    if order == "torch":
        return torch.log_softmax(x, -1)
    total = torch.tensor(float32_sums(e.double())[order], dtype=torch.float32)
    return d - total.log()


@pytest.mark.parametrize("vocab", [264, 50257])
def test_float32_log_softmaxes_of_the_same_logits_are_within_the_bound(vocab):
    """Peaked and flat rows; torch's kernel and four summation orders; each against float64, and pairwise."""
    g = torch.Generator().manual_seed(vocab)
    for scale in (0.5, 5.0, 40.0):
        logits = (torch.randn(vocab, generator=g, dtype=torch.float64) * scale).float().double()
        exact = torch.log_softmax(logits, -1)
        lowest = float(exact.min())
        one = bounds.log_softmax_error(vocab, lowest)
        rows = {order: log_softmax_float32(logits, order) for order in ("torch", "left", "pairwise", "lanes")}
        for order, row in rows.items():
            bounds.within(
                f"bounds: log_softmax V={vocab} scale={scale:g} {order} vs float64",
                bounds.row_difference(row, exact),
                one,
            )
        two = bounds.log_softmax_difference(vocab, lowest)
        diff = max(bounds.row_difference(rows["torch"], row) for row in rows.values())
        bounds.within(f"bounds: log_softmax V={vocab} scale={scale:g} orders vs torch", diff, two)
        total = abs(torch.logsumexp(rows["torch"].double(), 0).item())
        bounds.within(f"bounds: normalised V={vocab} scale={scale:g}", total, bounds.normalisation_error(vocab))


def test_a_row_moved_by_ten_times_the_bound_fails():
    """The planted failure: the same check on a row moved by 10 x the bound at one entry raises, naming the
    check, the difference, the tolerance and its basis."""
    logits = torch.randn(50257, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    exact = torch.log_softmax(logits, -1)
    tol = bounds.log_softmax_error(50257, float(exact.min()))
    row = torch.log_softmax(logits.float(), -1)
    bounds.within("planted: unmoved", bounds.row_difference(row, exact), tol)
    moved = row.clone()
    moved[7] += 10 * float(tol)
    with pytest.raises(
        AssertionError, match=r"planted: moved: difference .* > tolerance .* \(log_softmax over V=50257"
    ):
        bounds.within("planted: moved", bounds.row_difference(moved, exact), tol)


def test_row_difference_counts_shared_minus_infinity_as_equal_and_fails_nan():
    a = torch.tensor([0.0, -math.inf, -1.0])
    assert bounds.row_difference(a, a.clone()) == 0.0
    assert bounds.row_difference(a, torch.tensor([0.0, -2.0, -1.0])) == math.inf
    assert math.isnan(bounds.row_difference(a, torch.tensor([0.0, -math.inf, math.nan])))
    with pytest.raises(AssertionError, match="nan"):
        bounds.within("nan", bounds.row_difference(a, torch.tensor([math.nan, -math.inf, -1.0])), 1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        bounds.row_difference(a, a[:2])


def test_within_records_each_check_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "bounds.jsonl"
    monkeypatch.setenv(bounds.RECORD_ENV, str(path))
    bounds.within("recorded", 1e-6, bounds.log_softmax_difference(100))
    with pytest.raises(AssertionError):
        bounds.within("recorded too", 1.0, bounds.exact())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["check"], r["diff"]) for r in records] == [("recorded", 1e-6), ("recorded too", 1.0)]
    assert records[0]["tolerance"] == float(bounds.log_softmax_difference(100)) and "V=100" in records[0]["basis"]
    assert records[1]["tolerance"] == 0.0 and records[1]["basis"].startswith("exact")
    assert records[0]["test"].endswith("test_within_records_each_check_when_asked")
    monkeypatch.delenv(bounds.RECORD_ENV)
    bounds.within("not recorded", 0.0, 1.0)
    assert len(path.read_text().splitlines()) == 2


def test_resolve_takes_a_number_a_function_or_the_log_softmax_default():
    rows = [torch.log_softmax(torch.randn(300, generator=torch.Generator().manual_seed(1)), -1)]
    assert bounds.resolve(1e-3, [[1]], rows) == 1e-3
    assert bounds.resolve(lambda contexts: 2e-3 * len(contexts), [[1], [2]], rows) == 4e-3
    default = bounds.resolve(None, [[1]], rows)
    assert default == bounds.log_softmax_difference(300, float(rows[0].min())) and "V=300" in default.basis


def batched_rows(model, contexts):
    """The next-token rows of ``contexts`` in one left-padded float32 batch: other matrix shapes, so other
    accumulation orders, than the unbatched runs of bounds.float32_error."""
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[0] * (width - len(c)) + list(c) for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, -1]
    return torch.log_softmax(logits, -1)


def check_float32_error_is_the_largest_over_every_prefix_row_and_the_models_probe(path):
    """A context's error is the largest over its own rows at every position and the model's fixed probe's
    rows, recomputed here by hand from the same unbatched passes (so equal to the bit)."""
    ctx = list(range(700, 760))
    whole = bounds.float32_error(path, [ctx])
    m32, m64 = bounds._models[path]  # the float32 and float64 copies float32_error loaded

    def largest(c):
        with torch.no_grad():
            ids = torch.tensor([list(c)])
            a = torch.log_softmax(m32(ids).logits[0], -1).double()
            b = torch.log_softmax(m64(ids).logits[0], -1)
        return (a - b).abs().max(-1).values  # per position

    probe = max(float(largest(c).max()) for c in bounds.probe_contexts(path))
    own = largest(ctx)
    assert len(bounds.probe_contexts(path)) == bounds.PROBE_CONTEXTS and probe > 0
    assert whole == max(probe, float(own.max()))
    assert bounds.float32_error(path, [[1]]) >= probe  # a one-token context is measured with the probe


def test_two_float32_runs_of_a_model_are_within_four_times_its_float64_measured_error():
    """model_difference on the tiny Llama: an unbatched and a padded batched float32 run (and one with a
    thread) differ by at most 4 x the float32 run's error against float64, measured over every prefix's
    row and the model's probe; a row moved by ten times that fails."""
    path = str(tiny_model_dir("llama"))
    g = torch.Generator().manual_seed(3)
    contexts = [
        torch.randint(0, 5000, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (12,), generator=g)
    ]
    tol = bounds.rows_bound(path)(contexts)
    assert 0 < tol < 1e-3 and "4 x the error against float64" in tol.basis
    model = bounds._models[path][0]  # the float32 copy float32_error loaded
    with torch.no_grad():
        alone = [torch.log_softmax(model(torch.tensor([c])).logits[0, -1], -1) for c in contexts]
    batched = batched_rows(model, contexts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = batched_rows(model, contexts)
    finally:
        torch.set_num_threads(threads)
    for name, rows in (("padded batch", batched), ("one thread", one_thread)):
        diff = max(bounds.row_difference(a, b) for a, b in zip(alone, rows, strict=True))
        bounds.within(f"bounds: tiny llama {name} vs alone", diff, tol)
    check_float32_error_is_the_largest_over_every_prefix_row_and_the_models_probe(path)
    moved = batched.clone()
    moved[0, 11] += 10 * float(tol)
    with pytest.raises(AssertionError, match="planted"):
        bounds.within("planted", max(bounds.row_difference(a, b) for a, b in zip(alone, moved, strict=True)), tol)


def test_lower_precision_scales_the_float32_error_by_the_unit_roundoffs():
    tol = bounds.lower_precision(1e-6, bounds.U_BF16)
    assert float(tol) == pytest.approx(2 * 1e-6 * 2**16 + 1e-6)
    assert bounds.gamma(10) == pytest.approx(10 * bounds.U32 / (1 - 10 * bounds.U32))
    with pytest.raises(ValueError, match="no bound"):
        bounds.gamma(2**25)
    with pytest.raises(ValueError, match="nonnegative"):
        bounds.model_difference(math.nan)
