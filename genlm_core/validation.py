"""Argument checks for every public entry point, written once.

Each check either returns the value in canonical form or raises ``TypeError`` (wrong kind of value)
or ``ValueError`` (right kind, bad value), with a message that names the argument and the value.
Integers may be Python or numpy integers; ``bool`` is never taken for a number, and a float is
never taken for an integer, even when it is integral (``2.0`` counts nothing: it is usually a bug).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

#: Largest seed accepted (seeds are non-negative and fit in a signed 64-bit integer).
MAX_SEED = 2**63 - 1


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {_show(value)} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_real(
    value: Any,
    name: str,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    below: float | None = None,
) -> float:
    """``value`` as a finite ``float`` in ``[minimum, maximum]`` (and ``< below`` when given)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_show(value)} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    if below is not None and not value < below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return value


def check_seed(seed: Any, name: str = "seed") -> int | None:
    """``None`` (fresh randomness) or an integer in ``[0, 2**63)``."""
    return None if seed is None else check_int(seed, name, 0, MAX_SEED)


def check_bool(value: Any, name: str) -> bool:
    """A ``bool`` (numpy's too); anything else is a TypeError rather than a truth test."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_show(value)} ({type(value).__name__})")
    return bool(value)


def check_token_ids(token_ids: Any, vocab_size: int, name: str = "token_ids") -> tuple[int, ...]:
    """A context as a tuple of ids in ``[0, vocab_size)``.

    Takes a list, tuple or other sequence of integers, or a 1-D integer numpy array or torch
    tensor. Rejects what only looks like a context: sets and dicts (no order), ``str`` and
    ``bytes`` (text, not ids), bools, floats, and empty contexts.
    """
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        kind = "torch tensor" if isinstance(token_ids, torch.Tensor) else "numpy array"
        is_integral = (
            not token_ids.dtype.is_floating_point and not token_ids.dtype.is_complex and token_ids.dtype != torch.bool
            if isinstance(token_ids, torch.Tensor)
            else token_ids.dtype.kind in "iu"
        )
        if not is_integral:
            raise TypeError(f"{name} must be a sequence of ints, got a {kind} of dtype {token_ids.dtype}")
        if token_ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got a {kind} of shape {tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"{name} must be a sequence of ints (list, tuple, 1-D integer array), "
            f"got {type(token_ids).__name__} {_show(token_ids)}"
        )
    if set(map(type, token_ids)) <= {int}:  # plain ints, the usual case: no conversion needed
        ids = tuple(token_ids)
    else:
        for pos, i in enumerate(token_ids):
            if not is_int(i):
                raise TypeError(
                    f"{name} must be a sequence of ints: position {pos} holds {_show(i)} ({type(i).__name__})"
                )
        ids = tuple(map(int, token_ids))
    if not ids:
        raise ValueError(f"{name} is empty: a next-token distribution needs at least one context token (e.g. BOS)")
    if min(ids) < 0 or max(ids) >= vocab_size:
        pos, bad = next((p, i) for p, i in enumerate(ids) if not 0 <= i < vocab_size)
        raise ValueError(f"{name}: token id {bad} at position {pos} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_token_id_set(token_ids: Any, vocab_size: int, name: str) -> set[int]:
    """An iterable of token ids (e.g. EOS ids) as a set; a single id or a string is a TypeError."""
    if is_int(token_ids) or isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"{name} must be an iterable of token ids, got {type(token_ids).__name__} {_show(token_ids)}")
    out = set()
    for i in token_ids:
        token_id = check_int(i, f"{name} entry")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{name} entry {token_id} is outside the vocabulary [0, {vocab_size})")
        out.add(token_id)
    return out


def check_temperature(temperature: Any) -> float:
    """A finite temperature >= 0 (0 is greedy)."""
    return check_real(temperature, "temperature", 0.0)


def check_batcher_numbers(batch_size: Any, timeout: Any) -> tuple[int, float]:
    """A batch size (an integer >= 1) and a flush timeout (finite seconds >= 0)."""
    return check_int(batch_size, "batch_size", 1), check_real(timeout, "timeout", 0.0)


def check_vocabulary(vocab: Any, name: str = "vocab") -> list[Any]:
    """A vocabulary (token id ``i`` is ``vocab[i]``) as a list; what is not a sequence is a TypeError.
    The entries' types are checked where the trie is built."""
    if isinstance(vocab, (str, bytes, bytearray)) or not isinstance(vocab, Sequence):
        raise TypeError(f"{name} must be a sequence of byte strings (token id i is {name}[i]), got {_show(vocab)}")
    return list(vocab)


def as_bytes(data: Any, name: str) -> bytes:
    """Bytes from a bytes-like object; a ``str`` is encoded as UTF-8 (so it means the same as its bytes)."""
    if isinstance(data, str):
        return data.encode("utf-8", errors="surrogateescape")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{name} must be bytes (or a str, read as UTF-8), got {type(data).__name__} {_show(data)}")
