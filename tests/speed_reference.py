"""A short reference workload that tells how fast this machine runs the kind of work the fast tier does.

Machines of the project's kind differ by about 2x in Python-bound work, and a shared machine's speed drifts
from one hour to the next, so a fixed number of seconds for the fast tier fails a slow machine's run of a
tier that did not get slower, and lets a fast machine's run of one that did pass. The fast tier's budget
(``TimeBudget`` in ``tests/conftest.py``) is therefore given for the machine it was set on, with this
workload's time there (``fast_tier_reference`` in ``pyproject.toml``), and scaled by this workload's time on
the machine at hand: ``budget = fast_tier_budget * speed_factor(measured, reference)``.

The workload has the fast tier's two kinds of work, each timed on its own and on one thread (the tier runs
one worker per core):

- ``python``: the interpreter's own work, as in the batcher, the contexts, the vocabulary's tokens and the
  trie's bookkeeping: small objects, dicts and sets, bytes, sorting, and an event loop with many tasks;
- ``torch``: the row math of every backend's tests: a small matmul to a vocabulary's width and a
  ``log_softmax`` over it, in float32.

Each part runs a fixed amount of work a few times and keeps the median repetition: a machine that other
processes keep busy is a slower machine for the tier too, and the median reads that where the fastest
repetition would slip through a gap in the load. ``python tests/speed_reference.py`` prints its times on this machine.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Mapping

#: How many times each part runs; the median counts.
REPEATS = 5


def _python_work() -> int:
    vocab = [bytes([33 + (i * 7) % 90, 33 + (i * 13) % 90]) * (1 + i % 4) for i in range(12000)]
    index: dict[bytes, int] = {}
    for i, token in enumerate(vocab):
        index.setdefault(token, i)
    prefixes = {token[:k] for token in vocab for k in range(1, len(token) + 1)}
    order = sorted(vocab, key=lambda t: (len(t), t))

    async def particle(i: int) -> int:
        await asyncio.sleep(0)
        return index[vocab[i % len(vocab)]]

    async def step() -> int:
        return sum(await asyncio.gather(*(particle(i) for i in range(3000))))

    total = asyncio.run(step())
    return len(prefixes) + len(order) + total


def _torch_work() -> float:
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(32, 128, generator=generator)
    head = torch.randn(128, 32_000, generator=generator)
    total = 0.0
    for _ in range(8):
        rows = torch.log_softmax(hidden @ head, dim=-1)
        total += float(rows[:, 0].sum())
    return total


def _median(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(repeats: int = REPEATS) -> dict[str, float]:
    """Seconds of the median of ``repeats`` runs of each part, on one torch thread.

    >>> sorted(measure(repeats=1))
    ['python', 'torch']
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _torch_work()  # the first call pays for torch's lazy initialisation, not the machine's speed
        return {"python": _median(_python_work, repeats), "torch": _median(_torch_work, repeats)}
    finally:
        torch.set_num_threads(threads)


def parse(text: str) -> dict[str, float]:
    """``"python=0.31 torch=0.12"`` (an ini value) as ``{"python": 0.31, "torch": 0.12}``.

    >>> parse("python=0.31 torch=0.12")
    {'python': 0.31, 'torch': 0.12}
    """
    parts = dict(item.split("=", 1) for item in text.split())
    return {name: float(seconds) for name, seconds in parts.items()}


def speed_factor(measured: Mapping[str, float], reference: Mapping[str, float]) -> float:
    """How many times longer this machine takes than the reference machine: the geometric mean of the parts'
    ratios (each kind of work counts alike; the fast tier is about as Python-bound as torch-bound).

    >>> speed_factor({"python": 0.2, "torch": 0.1}, {"python": 0.1, "torch": 0.1})  # doctest: +ELLIPSIS
    1.414...
    """
    ratios = [measured[name] / reference[name] for name in reference]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def budget(seconds: float, reference: Mapping[str, float], readings: list[Mapping[str, float]]) -> tuple[float, float]:
    """The budget of ``seconds`` (set where the workload took ``reference``) on a machine where it took
    ``readings``, and the factor it was scaled by: the slowest reading's (1.0 with none).

    >>> budget(150, {"python": 0.1, "torch": 0.1}, [{"python": 0.2, "torch": 0.2}, {"python": 0.1, "torch": 0.1}])
    (300.0, 2.0)
    """
    factor = max((speed_factor(reading, reference) for reading in readings), default=1.0)
    return seconds * factor, factor


def describe(times: Mapping[str, float]) -> str:
    """The workload's times as an ini value (see :func:`parse`)."""
    return " ".join(f"{name}={seconds:.3f}" for name, seconds in times.items())


if __name__ == "__main__":
    print(describe(measure()))
