"""One SMC step on genlm-hf against HF's own decode step: timed apart, interleaved, and profiled.

The code that ``bench_hf.py --step`` and the GPU check's ``step:*`` and ``profile:*`` parts share. Three
things run on the same model, in turn (A, B, C, A, B, C, ...), each timed between device syncs:

- **bare** (A): HF's own decode step, ``model(input_ids=[N, 1], past_key_values=cache)`` over a
  ``DynamicCache`` of the prompt copied to N rows, no genlm; the next ids (each row's argmax) are picked
  on the device after the clock stops;
- **SMC step, timed inside** (B): one SMC step (below) in which genlm-hf's own model call
  (:meth:`~genlm_hf.lm.AsyncTransformer.run_step`), its KV gather (``gather_kv``) and the backend's
  whole step (``kv_forward_batch``) are each timed between device syncs: the **model call** is this
  step's ``run_step``;
- **SMC step** (C): N particles each await ``next_token_logprobs`` of their context handle
  (``asyncio.gather``: genlm batches them), the step's rows are sampled on the device in one pass
  (:func:`genlm_core.proposal.masked_proposal`, no mask: every weight stays 1, nothing is resampled),
  each handle is extended by its token. Untouched by timers.

Both the bare decode and the particles start from the same prompt; rounds before ``warmup`` are not
counted (genlm's first steps run the prompt, then gather its states into N rows). The ratios the issue
sets targets for: model call / bare (1.05x) and SMC step / bare (1.15x).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

#: The issue's targets: genlm-hf's model call and the whole SMC step against the bare HF step.
MODEL_CALL_TARGET = 1.05
SMC_STEP_TARGET = 1.15


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token keeps in every layer of ``model``."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * itemsize


def memory_needed(model: Any, n: int, tokens: int, vocab: int) -> int:
    """Device bytes a cell of N rows of ``tokens`` needs beside the weights: the bare decode's cache,
    genlm's stored block and the new one, the concatenation's copy of one layer, the logits and rows."""
    kv = kv_bytes_per_token(model) * n * tokens
    layer = kv // model.config.num_hidden_layers
    logits = n * model.config.vocab_size * (2 + 4) + n * vocab * (4 + 8 + 8)  # logits, rows, float64 cdf
    return 3 * kv + 2 * layer + 2 * logits


class Bare:
    """HF's own decode: the prompt's ``DynamicCache`` copied to ``n`` rows, one token per row per step."""

    def __init__(self, model: Any, prompt: list[int], n: int):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True, logits_to_keep=1)
            self.cache = out.past_key_values
            self.cache.batch_repeat_interleave(n)
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True).expand(n, 1).contiguous()
        sync(self.device)

    def call(self) -> Any:
        """The model's step alone, the same ids again (no timing, no sync, no pick): what the profiler
        records."""
        with torch.inference_mode():
            return self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)

    def step(self) -> float:
        """One decode step; the seconds of the model call, between device syncs."""
        sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)
            sync(self.device)
            elapsed = time.perf_counter() - t0
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return elapsed


#: The stages of genlm-hf's step timed inside an SMC step: (method, name in the results).
STAGES = (("run_step", "model call"), ("gather_kv", "gather"), ("kv_forward_batch", "forward_batch"))


class Particles:
    """N particles on genlm-hf, each holding a context handle, extended by one sampled token per step."""

    def __init__(self, lm: Any, prompt: list[int], n: int, seed: int = 0, resample: bool = False):
        self.lm = lm
        self.resample = resample  # after each step, N ancestors drawn uniformly (duplicates, reordered)
        self.device = torch.device(lm.device)
        self.handles = [lm.context(prompt)] * n
        self.generator = torch.Generator().manual_seed(seed)
        self.last_step: Any = None  # the last Step run_step ran (kept by step(capture=True))

    async def _step(self) -> None:
        rows = await asyncio.gather(*(self.lm.next_token_logprobs(h) for h in self.handles))
        from genlm_core.proposal import masked_proposal

        tokens = masked_proposal(torch.stack(rows), None, generator=self.generator).tokens.tolist()
        self.handles = [h.extend(t) for h, t in zip(self.handles, tokens)]
        if self.resample:
            ancestors = torch.randint(len(self.handles), (len(self.handles),), generator=self.generator)
            self.handles = [self.handles[a] for a in ancestors.tolist()]

    @contextmanager
    def _timed(self, stages: dict[str, list[float]], kinds: list[bool], capture: bool) -> Iterator[None]:
        """Time each of :data:`STAGES` between device syncs (instance attributes over the methods); note
        whether each model call was a plain step (no mask, no positions: ``Step.plain``) in ``kinds``."""
        lm = self.lm

        def timer(method: Callable[..., Any], name: str) -> Callable[..., Any]:
            def timed(arg: Any) -> Any:
                if name == "model call":
                    self.last_step = arg if capture else self.last_step
                    kinds.append(bool(arg.plain()))
                sync(self.device)
                t0 = time.perf_counter()
                result = method(arg)
                sync(self.device)
                stages.setdefault(name, []).append(time.perf_counter() - t0)
                return result

            return timed

        for method, name in STAGES:
            setattr(lm, method, timer(getattr(lm, method), name))
        try:
            yield
        finally:
            for method, _ in STAGES:
                delattr(lm, method)

    async def step(self, timed: bool = False, capture: bool = False) -> dict[str, float]:
        """One SMC step: ``{"SMC step": seconds}``, and with ``timed`` the seconds of each stage inside it
        (summed over the step's forward passes; a stage that did not run is 0)."""
        stages: dict[str, list[float]] = {}
        kinds: list[bool] = []
        before = (self.lm.batcher.stats.items, self.lm.tokens_computed)
        sync(self.device)
        t0 = time.perf_counter()
        if timed or capture:
            with self._timed(stages, kinds, capture):
                await self._step()
        else:
            await self._step()
        sync(self.device)
        out = {"SMC step": time.perf_counter() - t0}
        if timed:
            out.update({name: sum(stages.get(name, [0.0])) for _, name in STAGES})
            out["plain"] = sum(kinds) / max(len(kinds), 1)
        out["rows"] = self.lm.batcher.stats.items - before[0]
        out["computed"] = self.lm.tokens_computed - before[1]
        return out


async def time_cell(
    model: Any, lm: Any, prompt: list[int], n: int, rounds: int, warmup: int = 2, resample: bool = False
) -> dict[str, Any]:
    """Bare step, SMC step timed inside, SMC step, in turn, ``warmup + rounds`` times; the counted rounds'
    seconds of each (``bare``, ``model call``, ``gather``, ``forward_batch``, ``SMC step``) and counters.
    With ``resample``, the particles are resampled (uniformly) after every step: fewer distinct rows,
    each step's past gathered."""
    lm.clear_cache()
    bare = Bare(model, prompt, n)
    particles = Particles(lm, prompt, n, resample=resample)
    times: dict[str, list[float]] = {}
    rows: list[float] = []
    computed: list[float] = []
    plain: list[float] = []
    for r in range(warmup + rounds):
        a = bare.step()
        b = await particles.step(timed=True)
        c = await particles.step()
        if r >= warmup:
            times.setdefault("bare", []).append(a)
            for _, name in STAGES:
                times.setdefault(name, []).append(b[name])
            times.setdefault("SMC step", []).append(c["SMC step"])
            rows += [b["rows"], c["rows"]]
            plain.append(b["plain"])
            computed += [b["computed"], c["computed"]]
    del bare
    return {
        "times": times,
        "rows": statistics.median(rows),
        "computed": statistics.median(computed),
        "plain": statistics.mean(plain),
    }


def summary(cell: dict[str, Any]) -> dict[str, Any]:
    """Medians and spreads of a cell's times, and the ratios against the bare step (the median of the
    per-round ratios: each round's three were measured side by side)."""
    t = cell["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    spread = {k: (min(v), max(v)) for k, v in t.items()}
    call = [b / a for a, b in zip(t["bare"], t["model call"], strict=True)]
    step = [c / a for a, c in zip(t["bare"], t["SMC step"], strict=True)]
    return {
        "median": med,
        "spread": spread,
        "model_call_ratio": statistics.median(call),
        "model_call_ratio_spread": (min(call), max(call)),
        "smc_step_ratio": statistics.median(step),
        "smc_step_ratio_spread": (min(step), max(step)),
        "rows": cell["rows"],
        "computed": cell["computed"],
        "plain": cell["plain"],
    }


HEADER = [
    "model",
    "N",
    "prompt",
    "bare step",
    "model call",
    "gather",
    "forward_batch",
    "SMC step",
    f"call/bare (target {MODEL_CALL_TARGET}x)",
    f"step/bare (target {SMC_STEP_TARGET}x)",
    "rows/step",
    "tokens run/step",
    "plain calls",
]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def table_row(model: str, n: int, prompt: int, s: dict[str, Any]) -> list[str]:
    """One row of :data:`HEADER` for a cell's :func:`summary` (times: median (min-max))."""
    m, sp = s["median"], s["spread"]

    def cell(name: str) -> str:
        return f"{ms(m[name])} ({ms(sp[name][0])}-{ms(sp[name][1])})"

    def ratio(key: str, target: float) -> str:
        lo, hi = s[f"{key}_spread"]
        verdict = "ok" if s[key] <= target else "over"
        return f"{s[key]:.2f}x ({lo:.2f}-{hi:.2f}) {verdict}"

    return [
        model,
        str(n),
        str(prompt),
        cell("bare"),
        cell("model call"),
        ms(m["gather"]),
        ms(m["forward_batch"]),
        cell("SMC step"),
        ratio("model_call_ratio", MODEL_CALL_TARGET),
        ratio("smc_step_ratio", SMC_STEP_TARGET),
        f"{s['rows']:.0f}",
        f"{s['computed']:.0f}",
        f"{s['plain']:.0%}",
    ]


# ---- the profiler ---------------------------------------------------------------------------------


def _self_device(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", 0.0))


def profile_ops(fn: Callable[[], Any], steps: int, device: torch.device) -> tuple[Any, dict[str, dict[str, float]]]:
    """``fn`` run ``steps`` times under torch.profiler (CPU, and CUDA where the device is); the profile
    and, per op or kernel name, its calls, self CPU and self device microseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()  # once more before the profile: allocator and dispatch caches warm
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    ops: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        ops[e.key] = {
            "calls": e.count / steps,
            "cpu_us": e.self_cpu_time_total / steps,
            "device_us": _self_device(e) / steps,
        }
    return prof, ops


def compare_ops(
    bare: dict[str, dict[str, float]], ours: dict[str, dict[str, float]], device: torch.device, top: int = 30
) -> tuple[list[list[str]], list[list[str]]]:
    """Side by side, the ``top`` ops by self time (device time on CUDA, CPU time else) in either profile;
    and the ops only one of the two runs (or runs a different number of times per step)."""
    key = "device_us" if device.type == "cuda" else "cpu_us"
    zero = {"calls": 0.0, "cpu_us": 0.0, "device_us": 0.0}
    names = sorted(set(bare) | set(ours), key=lambda k: -max(bare.get(k, zero)[key], ours.get(k, zero)[key]))

    def row(name: str) -> list[str]:
        a, b = bare.get(name, zero), ours.get(name, zero)
        cells = [name[:90]]
        for side in (a, b):
            cells += [f"{side['calls']:g}", f"{side['cpu_us']:.0f}", f"{side['device_us']:.0f}"]
        cells.append(f"{b[key] - a[key]:+.0f}")
        return cells

    ranked = [row(k) for k in names[:top]]
    differ = [k for k in names if abs(bare.get(k, zero)["calls"] - ours.get(k, zero)["calls"]) > 1e-9]
    return ranked, [row(k) for k in differ]


OPS_HEADER = [
    "op / kernel",
    "bare calls/step",
    "bare self CPU µs",
    "bare self device µs",
    "genlm calls/step",
    "genlm self CPU µs",
    "genlm self device µs",
    "genlm - bare µs",
]


async def profile_cell(
    model: Any, lm: Any, prompt: list[int], n: int, steps: int, out: Path | None, warmup: int = 3
) -> dict[str, Any]:
    """Profile, at N = ``n``: the bare step; genlm-hf's model call (the ``run_step`` of a warmed-up SMC
    step, replayed on its own: its past is not changed by running it again); and the whole SMC step.
    Returns the side-by-side tables of the bare step against the model call and the per-step totals;
    with ``out``, writes each profile's full table there."""
    device = torch.device(lm.device)
    lm.clear_cache()
    bare = Bare(model, prompt, n)
    particles = Particles(lm, prompt, n)
    for _ in range(warmup):
        bare.call()
        await particles.step(capture=True)
    step = particles.last_step
    assert step is not None, "no model call was captured"

    def replay() -> None:
        with torch.inference_mode():
            lm.run_step(step)

    profiles = {}
    _, profiles["bare step"] = prof_bare = profile_ops(bare.call, steps, device)
    _, profiles["model call"] = prof_call = profile_ops(replay, steps, device)
    # the whole SMC step, awaited here (profile_ops takes a synchronous call)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof_smc:
        for _ in range(steps):
            await particles.step()
        sync(device)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = {
        "bare step": prof_bare[0].key_averages().table(sort_by=sort, row_limit=-1, max_name_column_width=120),
        "model call": prof_call[0].key_averages().table(sort_by=sort, row_limit=-1, max_name_column_width=120),
        "SMC step": prof_smc.key_averages().table(sort_by=sort, row_limit=-1, max_name_column_width=120),
    }
    files = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in tables.items():
            path = out / f"profile-N{n}-{name.replace(' ', '-')}.txt"
            path.write_text(f"{steps} steps, N={n}, prompt {len(prompt)}, sorted by {sort}\n{text}\n")
            files.append(str(path))
    ranked, differ = compare_ops(profiles["bare step"], profiles["model call"], device)
    totals = {
        name: {
            "cpu_us": sum(v["cpu_us"] for v in ops.values()),
            "device_us": sum(v["device_us"] for v in ops.values()),
            "calls": sum(v["calls"] for v in ops.values()),
        }
        for name, ops in profiles.items()
    }
    del bare
    return {
        "ranked": ranked,
        "differ": differ,
        "totals": totals,
        "files": files,
        "ops": profiles,
        "step": {"rows": int(step.input_ids.shape[0]), "width": step.width, "past": step.past_length},
    }
