"""Check that a vLLM layout returns exact rows, on the machines it runs on.

    python -m genlm_vllm.selftest MODEL --options '{"engine_opts": {"tensor_parallel_size": 8,
        "distributed_executor_backend": "ray"}, "ray_address": "10.0.0.1:6379"}'

It starts the engine, asks every worker where it runs (node, ranks, how its groups talk, which rank
writes rows), computes full-vocabulary rows for a few contexts in one batch and one at a time, and
compares each row's top tokens with vLLM's own ``logprobs=k`` from the engine's sampler (a path
that does not go through our capture). Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

#: Largest difference allowed between our row and vLLM's own logprobs (float32 summation order).
TOLERANCE = 1e-3


@dataclass
class Report:
    """What :func:`check` found; ``ok`` when nothing failed."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    max_diff_vs_engine: float = 0.0
    max_diff_batch_vs_single: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        out = ["workers:"]
        for w in self.workers:
            ranks = f"tp {w.get('tp_rank')} pp {w.get('pp_rank')}"
            talk = w.get("tp_path") or w.get("pp_path") or "-"
            writes = "  (writes rows)" if w.get("writer") else ""
            out.append(f"  node {w.get('node')} pid {w.get('pid')} {ranks} via {talk}{writes}")
        out.append(f"rows vs vLLM's own logprobs: max diff {self.max_diff_vs_engine:.2e} (tolerance {TOLERANCE})")
        out.append(f"rows in one batch vs one at a time: max diff {self.max_diff_batch_vs_single:.2e}")
        out += [f"PROBLEM: {p}" for p in self.problems] or ["OK"]
        return out


def contexts_for(vocab_size: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` random contexts of 1 to 200 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.choice([1, 3, 17, 64, 200]))] for _ in range(n)]


def check(lm: Any, contexts: list[list[int]] | None = None, k: int = 20) -> Report:
    """Run the checks on a started engine (``AsyncVirtualLM`` or one of its kinds)."""
    report = Report()
    contexts = contexts or contexts_for(lm.vocab_size)
    report.workers = lm.call_workers("genlm_where")
    writers = sum(bool(w.get("writer")) for w in report.workers)
    engines = max(1, lm.layout.data_parallel) * getattr(lm, "replica_count", 1)
    if writers != engines:
        report.problems.append(f"{writers} workers write rows; want exactly one per engine ({engines})")

    async def batch() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)))

    lm.clear_cache()
    rows = asyncio.run(batch())
    singles = []
    for c in contexts:
        lm.clear_cache()
        singles.append(lm.next_token_logprobs_sync(c))
    report.max_diff_batch_vs_single = max(float((a - b).abs().max()) for a, b in zip(rows, singles))
    if report.max_diff_batch_vs_single > TOLERANCE:
        report.problems.append(f"batched rows differ from single ones by {report.max_diff_batch_vs_single:.2e}")
    for context, row, top in zip(contexts, rows, lm.engine_top_logprobs(contexts, k)):
        ids = torch.tensor(list(top))
        diff = float((row[ids] - torch.tensor(list(top.values()))).abs().max())
        report.max_diff_vs_engine = max(report.max_diff_vs_engine, diff)
        if diff > TOLERANCE:
            report.problems.append(
                f"a context of {len(context)} tokens: row differs from vLLM's logprobs by {diff:.2e}"
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model name or path, as for vLLM")
    parser.add_argument("--options", default="{}", help="VLLMOptions as JSON (engine_opts, replicas, ray_address, ...)")
    args = parser.parse_args(argv)
    from genlm_core import load_model_by_name

    lm = load_model_by_name(args.model, backend="vllm", llm_opts=json.loads(args.options))
    try:
        report = check(lm)
    finally:
        lm.cleanup()
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
