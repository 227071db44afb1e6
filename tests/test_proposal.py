"""masked_proposal against a brute-force walk over each row's kept probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from genlm_core import proposal
from genlm_core.proposal import BLOCK, masked_proposal
from genlm_core.testing import bounds


def reference(row: torch.Tensor, mask: torch.Tensor, u: float) -> tuple[int, float, float]:
    """The first kept token whose running kept probability exceeds u times the kept mass, the log kept
    mass, and how far (relative to the mass) the target lies from the nearest end of that token's
    interval of the running sum."""
    kept = [math.exp(x) if m else 0.0 for x, m in zip(row.double().tolist(), mask.tolist())]
    total = math.fsum(kept)
    running = 0.0
    for token, p in enumerate(kept):
        running += p
        if p > 0 and running > u * total:
            return token, math.log(total), min(running - u * total, u * total - (running - p)) / total
    return max(i for i, p in enumerate(kept) if p > 0), math.log(total), 0.0


def kept_neighbours(mask: torch.Tensor, row: torch.Tensor, token: int) -> set[int]:
    """The kept tokens of positive probability just before and after ``token``."""
    ok = [i for i in range(len(mask)) if mask[i] and row[i] > float("-inf")]
    at = ok.index(token)
    return set(ok[max(0, at - 1) : at + 2])


def random_rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, ::7] = float("-inf")  # tokens of probability zero, as after a model's own masking
    return torch.log_softmax(logits, dim=1)


@pytest.mark.parametrize("shared_mask", [True, False])
@pytest.mark.parametrize("vocab", [50, 2 * BLOCK + 50])
def test_tokens_and_kept_mass_match_the_brute_force_walk(shared_mask, vocab):
    """Against a float64 walk over each row (fsum for the mass): the same token, except where the target
    lies within the blocks' float32 error of its interval's end (then a kept neighbour); the kept mass
    within that error. Rows of 50 tokens (one block) and of several blocks."""
    rows = random_rows(64, vocab, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(vocab, generator=g) < 0.4 if shared_mask else torch.rand(64, vocab, generator=g) < 0.4
    mask[..., 3] = True  # every row keeps some probability
    uniforms = torch.rand(64, generator=g, dtype=torch.float64)
    uniforms[:4] = torch.tensor([0.0, 1 - 1e-16, 0.5, 1e-300], dtype=torch.float64)  # the edges
    step = masked_proposal(rows, mask, uniforms=uniforms)
    block_error = bounds.FN_ULPS_U * bounds.U32 + bounds.gamma(min(vocab, BLOCK) - 1, bounds.U32)
    for i in range(64):
        row_mask = mask if shared_mask else mask[i]
        token, log_kept, margin = reference(rows[i], row_mask, float(uniforms[i]))
        drawn = int(step.tokens[i])
        if drawn != token:
            near = 2 * block_error + bounds.gamma(vocab, bounds.U64)  # the target's and the interval end's
            assert margin <= near and drawn in kept_neighbours(row_mask, rows[i], token), (i, margin)
        # the mass's relative error (a sum of float32 block masses, then float64 over blocks: gamma(blocks))
        # becomes an absolute error of its log, beside the two logs' own (u |log|)
        tol = block_error + bounds.gamma(vocab // BLOCK + 1, bounds.U64) + 2 * bounds.U64 * abs(log_kept)
        bounds.within("proposal: log kept mass vs brute force", abs(float(step.log_kept[i]) - log_kept), tol)
        assert bool(row_mask[drawn]) and rows[i, drawn] > float("-inf")


def test_a_mask_keeping_only_tokens_below_float32s_underflow_still_draws_them():
    """A row whose kept tokens all have probability under e**-87 (float32's exp underflows there) is
    drawn in float64: the same tokens and mass as the walk, and never an error for keeping nothing."""
    logits = torch.zeros(4, 600)
    logits[:, 500:] = -95.0  # after normalising: log p about -95 - log(500)
    rows = torch.log_softmax(logits, dim=1)
    mask = torch.zeros(600, dtype=torch.bool)
    mask[[510, 520, 599]] = True
    uniforms = torch.tensor([0.1, 0.4, 0.7, 0.99], dtype=torch.float64)
    step = masked_proposal(rows, mask, uniforms=uniforms)
    for i in range(4):
        token, log_kept, _ = reference(rows[i], mask, float(uniforms[i]))
        assert int(step.tokens[i]) == token
        tol = bounds.gamma(600, bounds.U64) + (2 * bounds.FN_ULPS_U + 2) * bounds.U64 * abs(log_kept)
        bounds.within("proposal: float64 draw of unlikely tokens", abs(float(step.log_kept[i]) - log_kept), tol)


def test_draws_follow_the_masked_distribution():
    row = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]))
    mask = torch.tensor([True, False, True, True, False])
    draws = 40_000
    step = masked_proposal(row.expand(draws, 5), mask, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(step.tokens, minlength=5).double()
    expected = torch.tensor([0.1, 0.0, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.55 * draws
    assert counts[1] == counts[4] == 0
    kept = expected > 0
    chi2 = float((((counts - expected) ** 2)[kept] / expected[kept]).sum())
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001 (a seeded generator: the same draws each run)
    # float32 logs of 0.1, 0.3, 0.15: each probability rounded to float32 (U32) and its log off by FN_ULPS_U
    # U32 |log p| (|log p| <= log 10), which exp turns into a relative error; the float64 rest is below 1e-15
    tol = 0.55 * bounds.U32 * (1 + bounds.FN_ULPS_U * math.log(10)) + 8 * bounds.U64
    bounds.within("proposal: kept mass of float32 logs", abs(math.exp(float(step.log_kept[0])) - 0.55), tol)


def test_one_row_and_no_mask():
    row = torch.log(torch.tensor([0.25, 0.25, 0.5]))
    step = masked_proposal(row, uniforms=torch.tensor([0.6]))
    assert step.tokens.dim() == 0 and int(step.tokens) == 2
    # 0.25, 0.25, 0.5 are exact in float32; their float32 logs are off by FN_ULPS_U U32 |log p| (<= log 4)
    tol = bounds.FN_ULPS_U * bounds.U32 * math.log(4) + 8 * bounds.U64
    bounds.within("proposal: no mask keeps everything", abs(float(step.log_kept)), tol)


def test_the_generator_makes_draws_reproducible():
    rows = random_rows(16, 30, seed=3)
    a = masked_proposal(rows, generator=torch.Generator().manual_seed(7)).tokens
    b = masked_proposal(rows, generator=torch.Generator().manual_seed(7)).tokens
    assert torch.equal(a, b)


@pytest.mark.parametrize("shared_mask", [True, False])
def test_rows_drawn_part_by_part_are_each_rows_own_draw(monkeypatch, shared_mask):
    """On the CPU a step's rows are drawn a few at a time in one reused workspace: with parts of 3 rows
    (and 1 over), every token and kept mass is bit for bit that row's draw alone, and a NaN row in any
    part is named by its place in the step."""
    vocab = 2 * BLOCK + 50
    rows = random_rows(10, vocab, seed=4)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(vocab, generator=g) < 0.4 if shared_mask else torch.rand(10, vocab, generator=g) < 0.4
    mask[..., 3] = True
    uniforms = torch.rand(10, generator=g, dtype=torch.float64)
    monkeypatch.setattr(proposal, "SCRATCH_BYTES", 3 * 4 * vocab)
    step = masked_proposal(rows, mask, uniforms=uniforms)
    for i in range(10):
        alone = masked_proposal(rows[i], mask if shared_mask else mask[i], uniforms=uniforms[i : i + 1])
        assert (int(step.tokens[i]), float(step.log_kept[i])) == (int(alone.tokens), float(alone.log_kept)), i
    rows[[1, 7]] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1, 7\] contain NaN"):
        masked_proposal(rows, mask, uniforms=uniforms)


@pytest.mark.parametrize(
    ("rows", "mask", "uniforms", "message"),
    [
        (torch.full((2, 3), float("nan")), None, None, r"rows \[0, 1\] contain NaN"),
        (torch.zeros(2, 3, 4), None, None, "must be"),
        (torch.zeros(2, 3), torch.ones(4, dtype=torch.bool), None, r"mask has shape \(4,\)"),
        (torch.zeros(2, 3), torch.ones(3), None, "bool tensor"),
        (torch.log(torch.tensor([[0.5, 0.5, 0.0]])), torch.tensor([False, False, True]), None, "keeps no token"),
        (torch.zeros(2, 3), None, torch.tensor([0.5]), "need 2 uniforms"),
        (torch.zeros(1, 3), None, torch.tensor([1.0]), r"in \[0, 1\)"),
    ],
)
def test_bad_input_is_an_error(rows, mask, uniforms, message):
    with pytest.raises(ValueError, match=message):
        masked_proposal(rows, mask, uniforms=uniforms)
