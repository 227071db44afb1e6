"""The proposal step of a particle program, for a whole step's rows at once.

Each particle's next token is drawn from its next-token distribution restricted to a mask, and its
weight is multiplied by the probability mass the mask kept. :func:`masked_proposal` does this for
``n`` rows in one pass on the device the rows live on: it masks, takes the log of the kept mass and
draws by inverse CDF (one uniform per row), in float64 so that no token of positive probability
is lost to rounding.

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
    probability (a particle with nothing to propose must be handled by the program)."""
    single = logprobs.dim() == 1
    rows = logprobs.unsqueeze(0) if single else logprobs
    if rows.dim() != 2 or rows.shape[1] == 0:
        raise ValueError(f"logprobs must be (V,) or (n, V) with V > 0, got shape {tuple(logprobs.shape)}")
    n, vocab = rows.shape
    if torch.isnan(rows).any():
        bad = torch.isnan(rows).any(1).nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} contain NaN")
    probs = rows.to(torch.float64).exp_()  # float32 logprobs are >= -104: no underflow in float64
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
        if mask.shape not in ((vocab,), (n, vocab)):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; want ({vocab},) or ({n}, {vocab})")
        probs.mul_(mask.to(probs.device))  # in place; exact (times 1 or 0), faster than a broadcast masked_fill
    cdf = torch.cumsum(probs, dim=1)  # the running kept probability; its last column is the kept mass
    kept = cdf[:, -1]
    empty = kept <= 0
    if empty.any():
        raise ValueError(f"rows {empty.nonzero().flatten().tolist()}: the mask keeps no token of positive probability")
    if uniforms is None:
        uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    uniforms = uniforms.to(device=probs.device, dtype=torch.float64).reshape(-1)
    if uniforms.shape != (n,) or ((uniforms < 0) | (uniforms >= 1)).any():
        raise ValueError(f"need {n} uniforms in [0, 1), got {tuple(uniforms.shape)} values")
    # The first token whose running kept probability exceeds the target: it has positive probability.
    tokens = torch.searchsorted(cdf, (uniforms * kept)[:, None], right=True).squeeze(1)
    past = tokens >= vocab  # rounding put the target at the CDF's last step: take the last kept token
    if past.any():
        last_kept = vocab - 1 - torch.argmax((probs[past] > 0).flip(1).to(torch.int8), dim=1)
        tokens[past] = last_kept
    log_kept = torch.log(kept)
    if single:
        return Proposal(tokens[0], log_kept[0])
    return Proposal(tokens, log_kept)
