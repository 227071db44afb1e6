"""How many times one request crosses between genlm's modules on its way through genlm-vllm.

Starts the tiny float32 Llama of ``tests/vllm/conftest.py`` on vLLM's in-process engine (CPU), puts one
context in a live session, then traces one request that continues it: ``await lm.next_token_logprobs``
(through the batcher, whose worker thread is traced too) and ``lm.next_token_logprobs_sync``.

*Modules* are the genlm modules the request enters. A *crossing* is a Python call
into a function of a genlm module (``genlm_core.*``, ``genlm_vllm.*``)
whose nearest calling genlm frame (walking the calling frames of the same thread) is in another
module; a *return crossing* is one of those whose module is already further up that chain (the
request goes back into a module it had left). Calls with no genlm caller in their thread (a
coroutine resumed by the event loop, the batcher thread's job) are counted as *entries*. The
numbers depend only on the code path, not on timing, except where the batcher's flush policy
changes what runs (the default, ``idle``, here).

Usage: ``.venv/bin/python benchmarks/module_crossings.py [--top 15]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import threading
from types import FrameType
from typing import Any

from _common import TINY_VLLM_ENGINE, TINY_VLLM_MODEL

from genlm_core import load_model_by_name
from genlm_core.testing.models import tiny_model_dir

MODEL, ENGINE = TINY_VLLM_MODEL, TINY_VLLM_ENGINE


#: modules of value types (a request, a context handle): calls into them are counted, and also left
#: out of the ``between stages`` column, which counts only calls from one stage of the path to another
VALUES = {"genlm_core.request", "genlm_core.context"}


def module_of(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith(("genlm_core", "genlm_vllm")) else None


class Counter:
    """The profile hook: counts crossings while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.calls = self.crossings = self.returns = self.entries = self.between = 0
        self.edges: collections.Counter[tuple[str, str]] = collections.Counter()
        self.modules: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = module_of(frame)
        if module is None:
            return
        chain = []
        back = frame.f_back
        while back is not None:
            m = module_of(back)
            if m is not None:
                chain.append(m)
            back = back.f_back
        with self.lock:
            self.calls += 1
            self.modules.add(module)
            if not chain:
                self.entries += 1
            elif chain[0] != module:
                self.crossings += 1
                self.edges[(chain[0], module)] += 1
                if module in chain[1:]:
                    self.returns += 1
                if module not in VALUES:
                    self.between += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="most frequent crossings to list")
    args = parser.parse_args()
    counter = Counter()
    lm = load_model_by_name(
        str(tiny_model_dir("llama", **MODEL)),
        backend="vllm",
        llm_opts={"dtype": "float32", "max_model_len": 2048, "engine_opts": ENGINE},
    )
    threading.setprofile(counter)  # the batcher's worker thread starts with the first batch
    sys.setprofile(counter)
    try:
        ids = list(range(300, 340))

        async def one(context: list[int]) -> None:
            await lm.next_token_logprobs(context)

        asyncio.run(one(ids))  # a live session for ``ids``; the batcher's thread now exists
        results = []
        for label, run in (
            ("await next_token_logprobs", lambda: asyncio.run(one([*ids, 7]))),
            ("next_token_logprobs_sync", lambda: lm.next_token_logprobs_sync([*ids, 7, 8])),
        ):
            counter.reset()
            counter.on = True
            run()
            counter.on = False
            results.append(
                (
                    label,
                    counter.calls,
                    counter.crossings,
                    counter.between,
                    counter.returns,
                    counter.entries,
                    sorted(counter.modules),
                    counter.edges,
                )
            )
        stats = lm.driver.sessions.stats  # type: ignore[attr-defined]
        assert stats.continued == 2, stats  # both traced requests continued the live session
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type,unused-ignore]
        lm.cleanup()
    print(
        "| request (continues a live session) | genlm modules (core + plugin) | genlm calls | crossings "
        "| between stages (not into request/context) | back into a module left | entries |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, calls, crossings, between, returns, entries, modules, _ in results:
        core = sum(m.startswith("genlm_core") for m in modules)
        print(
            f"| {label} | {len(modules)} ({core} + {len(modules) - core}) | {calls} | {crossings} | {between} "
            f"| {returns} | {entries} |"
        )
    for label, *_, modules, _ in results:
        print(f"\n{label}: modules entered: {', '.join(modules)}")
    for label, *_, edges in results:
        print(f"\n{label}: most frequent crossings")
        for (a, b), n in edges.most_common(args.top):
            print(f"  {n:3d}  {a} -> {b}")


if __name__ == "__main__":
    main()
