"""The proposal step of a particle program, for a whole step's rows at once.

Each particle's next token is drawn from its next-token distribution restricted to a mask, and its
weight is multiplied by the probability mass the mask kept. :func:`masked_proposal` does this for
``n`` rows in one pass on the device the rows live on (on the CPU, a few rows at a time in one reused
workspace: :data:`SCRATCH_BYTES`): it masks, takes the log of the kept mass and draws by inverse CDF
(one uniform per row), in two levels (a block of tokens by its mass, then a token inside it) so that
no token of positive probability is lost to rounding, with float32 work over the rows and float64
sums only over blocks and one block per row.

>>> import torch
>>> rows = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
>>> step = masked_proposal(rows, torch.tensor([True, False, True]), uniforms=torch.tensor([0.5, 0.5]))
>>> step.tokens.tolist(), [round(x, 4) for x in step.log_kept.exp().tolist()]
([0, 2], [0.75, 0.9])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Proposal", "masked_proposal"]


@dataclass(frozen=True)
class Proposal:
    """One proposal step: a token per row and the log of the mass its mask kept (float64)."""

    tokens: torch.Tensor
    log_kept: torch.Tensor


#: Tokens per block of the two-level draw: a block is chosen by its mass, then a token inside it.
BLOCK = 256
#: Rows whose kept mass in float32 falls below this are drawn again in float64 (their tokens could be
#: near float32's underflow, e**-87: a mask that keeps only very unlikely tokens).
FLOAT32_FLOOR = 2.0**-96
#: On the CPU, rows are drawn this many bytes of float32 probabilities at a time, in one workspace that
#: the allocator hands back warm each step, where a fresh ``[n, V]`` block costs its page faults (1,024 x
#: 32k rows: 124 -> 53 ms on 2 cores). On an accelerator every row is drawn at once.
SCRATCH_BYTES = 2**23


def masked_proposal(
    logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> Proposal:
    """Draw a token from each row restricted to ``mask`` and return it with the log kept mass.

    ``logprobs`` is one row ``(V,)`` or a step's rows ``(n, V)`` of normalised log-probabilities;
    ``mask`` is ``(V,)`` (the same for every row) or ``(n, V)``, True where a token may be proposed
    (None keeps all). The draw for row ``i`` is the first token whose cumulative kept probability
    exceeds ``uniforms[i]`` times the row's kept mass; ``uniforms`` (in [0, 1), on any device) are
    drawn from ``generator`` when not given. A token outside the mask or of zero probability is
    never drawn. Raises ``ValueError`` for NaN rows, wrong shapes, and rows whose mask keeps no
    probability (a particle with nothing to propose must be handled by the program).

    The draw is two-level, so that no token's probability is absorbed by a running sum: the row's
    float32 probabilities are summed per block of :data:`BLOCK` tokens, a block is drawn from the
    blocks' masses (a float64 cumulative sum), then a token from the block's own float64 cumulative
    sum. A token is lost only below float32's underflow (probability under ``e**-87``; a row whose
    kept mass is that small is drawn in float64 instead), where one float64 sum over the whole row
    absorbs every token below ``2**-53`` of the mass before it. The block masses are float32 sums of
    float32 ``exp`` (each relatively within ``gamma(BLOCK - 1) + FN_ULPS_U * U32``): a token whose
    cumulative interval lies that close to the target may be its neighbour."""
    single = logprobs.dim() == 1
    rows = logprobs.unsqueeze(0) if single else logprobs
    if rows.dim() != 2 or rows.shape[1] == 0:
        raise ValueError(f"logprobs must be (V,) or (n, V) with V > 0, got shape {tuple(logprobs.shape)}")
    n, vocab = rows.shape
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
        if mask.shape not in ((vocab,), (n, vocab)):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; want ({vocab},) or ({n}, {vocab})")
        mask = mask.to(rows.device)
    if uniforms is None:
        uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    uniforms = uniforms.to(device=rows.device, dtype=torch.float64).reshape(-1)
    if uniforms.shape != (n,) or ((uniforms < 0) | (uniforms >= 1)).any():
        raise ValueError(f"need {n} uniforms in [0, 1), got {tuple(uniforms.shape)} values")

    tokens = torch.empty(n, dtype=torch.int64, device=rows.device)
    kept = torch.empty(n, dtype=torch.float64, device=rows.device)
    step = n if rows.device.type != "cpu" else max(1, SCRATCH_BYTES // (4 * vocab))
    scratch = torch.empty(min(n, step), -(-vocab // BLOCK) * BLOCK, dtype=torch.float32, device=rows.device)
    for first in range(0, n, step):
        part = slice(first, min(n, first + step))
        part_mask = mask if mask is None or mask.dim() == 1 else mask[part]
        tokens[part], kept[part] = _two_level_draw(rows[part], part_mask, uniforms[part], scratch)
    if torch.isnan(kept).any():
        bad = torch.isnan(rows).any(1).nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} contain NaN")
    log_kept = torch.log(kept)
    small = kept < FLOAT32_FLOOR
    if small.any():
        again = small.nonzero().flatten()
        tokens[again], log_kept[again] = _float64_draw(rows, mask, uniforms, again)
    if single:
        return Proposal(tokens[0], log_kept[0])
    return Proposal(tokens, log_kept)


def _two_level_draw(
    rows: torch.Tensor, mask: torch.Tensor | None, uniforms: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and kept masses (float64; NaN for a row with NaN) of ``rows``, drawn in two levels with
    ``scratch``'s leading rows as the workspace of their float32 probabilities."""
    n, vocab = rows.shape
    probs = scratch[:n]
    blocks = probs.shape[1] // BLOCK
    probs[:, vocab:].zero_()  # the last block's padding
    kept_probs = probs[:, :vocab]
    if rows.dtype == torch.float32:
        torch.exp(rows, out=kept_probs)
    else:
        kept_probs.copy_(rows.exp())
    if mask is not None:
        kept_probs.mul_(mask)  # in place; exact (times 1 or 0)
    by_block = probs.view(n, blocks, BLOCK)
    masses = by_block.sum(2).to(torch.float64)
    cdf = torch.cumsum(masses, dim=1)
    kept = cdf[:, -1]
    target = uniforms * kept
    block = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=blocks - 1)
    below = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inside = by_block[torch.arange(n, device=rows.device), block].to(torch.float64)
    inner = torch.searchsorted(torch.cumsum(inside, dim=1), (target - below)[:, None], right=True).squeeze(1)
    past = inner >= BLOCK  # the block's float64 sum fell short of its float32 mass: its last kept token
    if past.any():
        inner[past] = _last_positive(inside[past])
    tokens = block * BLOCK + inner
    return tokens, kept


def _float64_draw(
    rows: torch.Tensor, mask: torch.Tensor | None, uniforms: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-level draw in float64 of rows ``index``, whose kept mass is near float32's underflow."""
    probs = rows[index].to(torch.float64).exp_()  # float32 logprobs are >= -104: no underflow in float64
    if mask is not None:
        probs.mul_(mask if mask.dim() == 1 else mask[index])
    cdf = torch.cumsum(probs, dim=1)
    kept = cdf[:, -1]
    empty = kept <= 0
    if empty.any():
        raise ValueError(f"rows {index[empty].tolist()}: the mask keeps no token of positive probability")
    tokens = torch.searchsorted(cdf, (uniforms[index] * kept)[:, None], right=True).squeeze(1)
    past = tokens >= rows.shape[1]  # rounding put the target at the CDF's last step: take the last kept token
    if past.any():
        tokens[past] = _last_positive(probs[past])
    return tokens, torch.log(kept)


def _last_positive(probs: torch.Tensor) -> torch.Tensor:
    """Each row's last column of positive probability (where rounding put the target past the end)."""
    return probs.shape[1] - 1 - torch.argmax((probs > 0).flip(1).to(torch.int8), dim=1)
