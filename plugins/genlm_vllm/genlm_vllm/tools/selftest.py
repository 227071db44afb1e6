"""Check that a vLLM layout returns exact rows, on the machines it runs on.

    python -m genlm_vllm.tools.selftest MODEL --options '{"engine_opts": {"tensor_parallel_size": 8,
        "distributed_executor_backend": "ray"}, "ray_address": "10.0.0.1:6379"}'

It starts the engine, asks every worker where it runs (node, ranks, how its groups talk, which rank
writes rows), computes full-vocabulary rows for a few contexts in one batch and one at a time, and
compares each row's top tokens with vLLM's own ``logprobs=k`` from the engine's sampler (a path
that does not go through our capture). Exit status 0 when every check passes.

    python -m genlm_vllm.tools.selftest MODEL --suite [--runners v1,v2]

runs the whole suite on a float32 HF folder (on a GPU: both model runners where the release's V2 takes
logits processors; vLLM 0.26's does not), one engine at a time:
the checks above; rows against genlm-hf on the same weights (on every token genlm-hf gives p >= 1e-4,
within 4 x the float32 model's own error against a float64 run of the folder on the same contexts and
tokens: ``genlm_core.testing.bounds.model_difference``; the whole vocabulary's largest difference is
reported beside it) with ``engine="llm"`` and
with ``engine="async"`` (vLLM's async scheduling as configured); an SMC with resampling whose rows
(sessions continued in the engine, forks copying their parent's block) equal the uncached reference;
LoRA per request against genlm-hf with the same adapter; TP=2 when two GPUs are present; and the SMC's
time against vLLM's own decode of the same number of tokens. It prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from genlm_core.testing import bounds
from genlm_core.testing.models import random_lora

#: Largest difference allowed between rows of one context computed in a batch and alone, for any model
#: this command is pointed at (float32 or half precision, any size): a limit, not a bound. A bound needs
#: the model's own rounding error, measured against float64 (``genlm_core.testing.bounds.model_difference``),
#: which ``--suite`` does for its float32 folder; pass ``batch_tol`` to :func:`check` to use one.
TOLERANCE = 1e-3


@dataclass
class Report:
    """What :func:`check` found; ``ok`` when nothing failed."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    max_diff_vs_engine: float = 0.0
    max_diff_batch_vs_single: float = 0.0
    #: the bound the rows vs vLLM's logprobs are held to: two log-softmaxes of the same logits
    tolerance_vs_engine: float = 0.0
    tolerance_batch: float = TOLERANCE
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
        vs, tol = self.max_diff_vs_engine, self.tolerance_vs_engine
        out.append(f"rows vs vLLM's own logprobs: max diff {vs:.2e} (tolerance {tol:.2e})")
        batch, tol = self.max_diff_batch_vs_single, self.tolerance_batch
        out.append(f"rows in one batch vs one at a time: max diff {batch:.2e} (tolerance {tol:.2e})")
        out += [f"PROBLEM: {p}" for p in self.problems] or ["OK"]
        return out


def contexts_for(vocab_size: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` random contexts of 1 to 200 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.choice([1, 3, 17, 64, 200]))] for _ in range(n)]


def check(lm: Any, contexts: list[list[int]] | None = None, k: int = 20, batch_tol: float | None = None) -> Report:
    """Run the checks on a started engine (``AsyncVirtualLM`` or one of its kinds).

    Each row's top ``k`` tokens against vLLM's own ``logprobs=k``: the same logits, normalised twice in
    float32, so within :func:`genlm_core.testing.bounds.log_softmax_difference` over the vocabulary at the
    lowest log-probability compared. Rows in one batch against rows computed alone: within ``batch_tol``
    (default :data:`TOLERANCE`, a limit for any model; a bound comes from the model's float64 error)."""
    report = Report(tolerance_batch=TOLERANCE if batch_tol is None else batch_tol)
    contexts = contexts or contexts_for(lm.vocab_size)
    report.workers = lm.call_workers("genlm_where")
    writers = sum(bool(w.get("writer")) for w in report.workers)
    engines = lm.driver.engine_count
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
    if not report.max_diff_batch_vs_single <= report.tolerance_batch:
        report.problems.append(f"batched rows differ from single ones by {report.max_diff_batch_vs_single:.2e}")
    for context, row, top in zip(contexts, rows, lm.engine_top_logprobs(contexts, k)):
        ids = torch.tensor(list(top))
        theirs = torch.tensor(list(top.values()), dtype=torch.float64)
        diff = float((row[ids].double() - theirs).abs().max())
        tol = bounds.log_softmax_difference(row.numel(), float(theirs.min()))
        report.max_diff_vs_engine = max(report.max_diff_vs_engine, diff)
        report.tolerance_vs_engine = max(report.tolerance_vs_engine, float(tol))
        bounds.record("vllm selftest: rows vs vLLM's logprobs", diff, tol)
        if not diff <= tol:
            report.problems.append(
                f"a context of {len(context)} tokens: row differs from vLLM's logprobs by {diff:.2e}"
            )
    return report


#: The multiple of the float32 folder's own error against float64 that our rows may differ by from
#: genlm-hf's on the same weights, and a session's row from the uncached one: two float32 runs
#: (``genlm_core.testing.bounds.model_difference``).
FACTOR = bounds.MODEL_FACTOR


@dataclass
class Line:
    """One check of the suite."""

    engine: str
    check: str
    value: str
    ok: bool
    detail: str = ""


async def particles(lm: Any, prompt: list[int], n: int, steps: int, seed: int = 0) -> list[tuple[list[int], Any]]:
    """A particle program: ``n`` particles extend ``prompt`` by sampling their rows; every 4th step
    they are resampled (uniformly: forks of live sessions). Returns every (context, row) it saw."""
    gen = torch.Generator().manual_seed(seed)
    live = [list(prompt) for _ in range(n)]
    seen = []
    for step in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in live))
        tokens = torch.multinomial(torch.stack(rows).exp(), 1, generator=gen).flatten().tolist()
        seen += [(list(c), r) for c, r in zip(live, rows, strict=True)]
        live = [[*c, t] for c, t in zip(live, tokens, strict=True)]
        if step % 4 == 3:
            live = [list(live[i]) for i in torch.randint(n, (n,), generator=gen).tolist()]
    return seen


def _diff(rows: list[Any], others: list[Any]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(rows, others, strict=True))


#: Rows against another backend are judged on the tokens it gives at least this probability: far in
#: the tail (log-probabilities of -20 and below) float32 rounding of a logit is a larger share of a
#: log-probability whose probability matters to nothing.
KEPT = 1e-4


def _versus(name: str, check: str, rows: list[Any], refs: list[Any], tol: float) -> Line:
    """Rows against a reference backend's: judged where the reference gives p >= KEPT, within ``tol``;
    the whole vocabulary's largest difference in the detail."""
    kept = max(float((a - b).abs()[b.exp() >= KEPT].max()) for a, b in zip(rows, refs, strict=True))
    bounds.record(f"vllm selftest: {check}", kept, tol)
    detail = f"all tokens {_diff(rows, refs):.1e}; tolerance {tol:.1e}"
    return Line(name, check, f"{kept:.1e}", kept <= tol, detail)


def reference_backend() -> Any:
    """genlm-hf's ``AsyncTransformer``, the suite's reference; an ImportError naming the extra if it is missing."""
    try:
        from genlm_hf import AsyncTransformer
    except ImportError as exc:
        raise ImportError(
            f"the vLLM self-test compares against genlm-hf, which is not installed ({exc}): "
            "pip install 'genlm-vllm[selftest]'"
        ) from exc
    return AsyncTransformer


def suite(
    model: str,
    runners: list[str],
    options: dict[str, Any] | None = None,
    n: int = 32,
    steps: int = 32,
    streaming: bool = True,
) -> list[Line]:
    """Run the whole suite on a float32 HF folder ``model``; one :class:`Line` per check
    (``streaming=False``: without the AsyncLLM engines)."""
    import tempfile
    import time

    from genlm_core import load_model_by_name
    from genlm_vllm.vllm_api.client import decode

    AsyncTransformer = reference_backend()

    # One engine batch per SMC step, flushed as soon as every particle has asked (as bench_smc.py does).
    base: dict[str, Any] = {"dtype": "float32", "enable_lora": True, "max_lora_rank": 8, "batch_size": n, "timeout": 0}
    base.update(options or {})
    lines: list[Line] = []
    with tempfile.TemporaryDirectory() as tmp:
        adapter = str(random_lora(model, tmp))
        hf = AsyncTransformer.from_name(model, batch_size=64)
        hf.load_lora(adapter, "a")
        contexts = contexts_for(hf.vocab_size, n=6)
        prompt = contexts[-1][:24]
        want = [hf.next_token_logprobs_sync(c) for c in contexts]
        want_lora = [hf.next_token_logprobs_sync(c, lora_name="a") for c in contexts]
        # 4 x the folder's float32 error against float64 on the same contexts and kept tokens; the adapter's
        # rank-8 products on two projections round like the base model's, whose error stands for them
        kept_error = bounds.float32_error(model, contexts, min_logprob=math.log(KEPT))
        rows_tol = float(bounds.model_difference(kept_error, FACTOR))
        checked = contexts_for(hf.vocab_size)  # check()'s batched vs single: two float32 runs as well
        batch_tol = float(bounds.model_difference(bounds.float32_error(model, checked), FACTOR))
        layouts: list[tuple[str, dict[str, Any]]] = [(r, {"model_runner": r}) for r in runners]
        if streaming:
            layouts += [(f"{r} async", {"model_runner": r, "engine": "async"}) for r in runners]
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            layouts += [(f"{r} TP=2", {"model_runner": r, "engine_opts": {"tensor_parallel_size": 2}}) for r in runners]
        for name, extra in layouts:
            engine_opts: dict[str, Any] = {**base.get("engine_opts", {}), **extra.get("engine_opts", {})}
            lm: Any = load_model_by_name(model, backend="vllm", llm_opts={**base, **extra, "engine_opts": engine_opts})
            try:
                facts = lm.driver.runner
                lines.append(Line(name, "model runner", str(facts).upper(), facts == extra["model_runner"]))
                report = check(lm, checked, batch_tol=batch_tol)
                lines.append(Line(name, "vs vLLM's logprobs", f"{report.max_diff_vs_engine:.1e}", report.ok))
                lm.load_lora(adapter, "a")
                lm.clear_cache()
                batch = asyncio.run(lm.batch_next_token_logprobs(contexts))
                lines.append(_versus(name, "rows vs genlm-hf", list(batch), want, rows_tol))
                got = [lm.next_token_logprobs_sync(c, lora_name="a") for c in contexts]
                lines.append(_versus(name, "LoRA rows vs genlm-hf", got, want_lora, rows_tol))
                if lm.driver.streams or extra.get("engine_opts"):
                    continue
                lm.clear_cache()
                seen = asyncio.run(particles(lm, prompt, n, steps))
                stats = lm.driver.sessions.stats if lm.driver.sessions is not None else None
                sample = [seen[i] for i in torch.randperm(len(seen))[:24].tolist()]
                diff = _diff([r for _, r in sample], [lm.next_token_logprobs_uncached(c) for c, _ in sample])
                smc_tol = float(bounds.model_difference(bounds.float32_error(model, [c for c, _ in sample]), FACTOR))
                bounds.record("vllm selftest: SMC rows vs uncached", diff, smc_tol)
                detail = (
                    "" if stats is None else f"{stats.continued}/{stats.rows} continued, {stats.tokens_copied} copied"
                )
                detail += f"; tolerance {smc_tol:.1e}"
                lines.append(Line(name, "SMC rows vs uncached", f"{diff:.1e}", diff <= smc_tol, detail))
                times = []
                for _ in range(3):
                    lm.clear_cache()
                    t0 = time.perf_counter()
                    decode(lm.driver.engine, prompt, n, steps)
                    t1 = time.perf_counter()
                    asyncio.run(particles(lm, prompt, n, steps))
                    times.append((time.perf_counter() - t1) / (t1 - t0))
                ratio = sorted(times)[1]
                lines.append(Line(name, "SMC time / vLLM decode", f"{ratio:.2f}x", True, f"N={n}, T={steps}"))
            finally:
                lm.cleanup()
        hf.cleanup()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model name or path, as for vLLM")
    parser.add_argument("--options", default="{}", help="VLLMOptions as JSON (engine_opts, replicas, ray_address, ...)")
    parser.add_argument("--suite", action="store_true", help="the whole suite (a float32 HF folder; needs genlm-hf)")
    parser.add_argument("--runners", default=None, help="model runners for --suite (default: default_runners())")
    parser.add_argument("--no-async", action="store_true", help="--suite without the AsyncLLM engines")
    parser.add_argument("--particles", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    from genlm_core import load_model_by_name

    if args.suite:
        runners = (args.runners or ",".join(default_runners())).split(",")
        lines = suite(args.model, runners, json.loads(args.options), args.particles, args.steps, not args.no_async)
        from genlm_core.cli import table

        print(f"vLLM {_version()}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
        rows = [[x.engine, x.check, x.value, "ok" if x.ok else "FAILED", x.detail] for x in lines]
        print(table(["engine", "check", "value", "", "detail"], rows))
        return 0 if all(x.ok for x in lines) else 1
    lm = load_model_by_name(args.model, backend="vllm", llm_opts=json.loads(args.options))
    try:
        report = check(lm)
    finally:
        lm.cleanup()
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def default_runners() -> list[str]:
    """The model runners the suite checks by default: both on CUDA where Model Runner V2 takes logits
    processors (vLLM 0.32 on), else V1 alone (vLLM's CPU build; vLLM 0.26 on CUDA)."""
    from genlm_vllm.vllm_api.release import has_v2_processors

    return ["v1", "v2"] if torch.cuda.is_available() and has_v2_processors() else ["v1"]


def _version() -> str:
    from genlm_vllm.vllm_api.release import distribution, version

    return f"{distribution()} {version()}"


if __name__ == "__main__":
    sys.exit(main())
