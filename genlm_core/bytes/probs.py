"""Distributions over the next byte: ``LazyByteProbs`` (a 258-vector) and ``Chart`` (a dict)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from genlm_core.validation import is_int

#: Index of "end of token" and "end of sequence" in a 258-long next-byte vector (bytes are 0..255).
EOT = 256
EOS = 257


def check_symbol(b: Any) -> int:
    """A byte (0..255) or EOS (257) to feed a beam or state; TypeError/ValueError naming anything else
    (EOT, 256, is internal: a token ends by itself)."""
    if type(b) is not int:
        if not is_int(b):
            raise TypeError(f"a byte must be an integer 0..255 (or EOS, 257), got {b!r} ({type(b).__name__})")
        b = int(b)
    if not (0 <= b < 256 or b == EOS):
        raise ValueError(f"a byte must be 0..255 (or EOS, 257), got {b}")
    return b


def logsumexp(a: Any, axis: int | None = None) -> Any:
    """log(sum(exp(a))) along ``axis``, exact for -inf entries (all -inf gives -inf)."""
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return -np.inf
    top = np.max(a, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(a - top), axis=axis, keepdims=True)) + top
    return out.item() if axis is None else np.squeeze(out, axis=axis)


def byte_label(b: Any) -> str:
    """Readable label of a byte, EOT (None or 256) or EOS (257)."""
    if b is None or b == EOT:
        return "EOT"
    if b == EOS:
        return "EOS"
    return repr(bytes([b]))[2:-1]


class LazyByteProbs:
    """Log-probabilities (or probabilities) of the next byte: 256 bytes, EOT (index 256), EOS (257)."""

    def __init__(self, ps: np.ndarray, log_space: bool = True):
        ps = np.asarray(ps, dtype=np.float64)
        if ps.shape != (258,):
            raise ValueError(f"expected 258 entries (256 bytes, EOT, EOS), got shape {ps.shape}")
        self.ps = ps
        self.log_space = log_space

    def __getitem__(self, b: int | None) -> float:
        """Entry for byte ``b`` (0..255), EOT (``None`` or 256) or EOS (257)."""
        if b is None:
            return float(self.ps[EOT])
        if not is_int(b) or not 0 <= b <= EOS:
            raise ValueError(f"invalid index {b}: bytes are 0..255, EOT is None (or 256), EOS is 257")
        return float(self.ps[b])

    def materialize(self) -> Chart:
        """The distribution as a :class:`Chart` keyed by byte (int), ``None`` (EOT) and 257 (EOS)."""
        chart = Chart(-np.inf if self.log_space else 0.0)
        for b in range(256):
            chart[b] = float(self.ps[b])
        chart[None] = float(self.ps[EOT])
        chart[EOS] = float(self.ps[EOS])
        return chart

    def argmax(self) -> int:
        """The most probable next byte, or EOS (257)."""
        return int(np.argmax(self.ps))

    def pretty(self) -> Chart:
        """The distribution keyed by readable labels."""
        return self.materialize().map_keys(byte_label)

    def __repr__(self) -> str:
        top = np.argsort(-self.ps)[:5]
        return "LazyByteProbs(" + ", ".join(f"{byte_label(int(b))}: {self.ps[b]:.4g}" for b in top) + ", ...)"


class Chart(dict):
    """A dict with a default ``zero`` for missing keys and a few semiring-style helpers."""

    def __init__(self, zero: Any, vals: Iterable[tuple[Hashable, Any]] = ()):
        self.zero = zero
        super().__init__(vals)

    def __missing__(self, key: Hashable) -> Any:
        return self.zero

    def spawn(self) -> Chart:
        return Chart(self.zero)

    def __add__(self, other: Chart) -> Chart:
        out = self.copy()
        for k, v in other.items():
            out[k] = out[k] + v
        return out

    def __mul__(self, scalar: Any) -> Chart:
        return Chart(self.zero, ((k, v * scalar) for k, v in self.items()))

    def copy(self) -> Chart:
        return Chart(self.zero, self.items())

    def trim(self) -> Chart:
        """Without the entries equal to zero."""
        return Chart(self.zero, ((k, v) for k, v in self.items() if v != self.zero))

    def argmax(self) -> Hashable:
        return max(self, key=self.__getitem__)

    def argmin(self) -> Hashable:
        return min(self, key=self.__getitem__)

    def top(self, k: int) -> Chart:
        return Chart(self.zero, sorted(self.items(), key=lambda kv: kv[1], reverse=True)[:k])

    def max(self) -> Any:
        return max(self.values())

    def min(self) -> Any:
        return min(self.values())

    def sum(self) -> Any:
        return sum(self.values())

    def normalize(self) -> Chart:
        total = self.sum()
        return Chart(self.zero, ((k, v / total) for k, v in self.items()))

    def sort_descending(self) -> Chart:
        return Chart(self.zero, sorted(self.items(), key=lambda kv: kv[1], reverse=True))

    def filter(self, keep: Callable[[Hashable], bool]) -> Chart:
        return Chart(self.zero, ((k, v) for k, v in self.items() if keep(k)))

    def map_values(self, f: Callable[[Any], Any]) -> Chart:
        return Chart(f(self.zero), ((k, f(v)) for k, v in self.items()))

    def map_keys(self, f: Callable[[Hashable], Hashable]) -> Chart:
        return Chart(self.zero, ((f(k), v) for k, v in self.items()))

    def project(self, f: Callable[[Hashable], Hashable]) -> Chart:
        """Sum values whose keys map to the same ``f(key)``."""
        out = self.spawn()
        for k, v in self.items():
            out[f(k)] = out[f(k)] + v
        return out

    def metric(self, other: Chart) -> float:
        """Largest absolute difference over the union of keys."""
        return max((abs(self[k] - other[k]) for k in set(self) | set(other)), default=0.0)

    def assert_equal(self, want: Chart, *, tol: float = 1e-5) -> None:
        diff = self.metric(want)
        if diff > tol:
            raise AssertionError(f"charts differ by {diff} > {tol}")

    def __repr__(self) -> str:
        return "Chart({" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items()) + "})"
