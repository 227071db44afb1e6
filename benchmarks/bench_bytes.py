"""Byte LM prefill (K=5) beside the model's floor, and beside genlm-bytes 0.2.0.

1. **The floor** (SmolLM2-135M float32, hf backend; 300- and 2,000-byte English texts): the byte
   LM's ``prefill`` against the least any exact method could spend on the same rows on this machine:
   every distinct token of the contexts the beam needs, computed once, in one tree-shaped pass of the
   same model (a 4-D attention mask lets each token see only its ancestors; chunks of 512 tokens in
   depth-first order, each after its ancestors' states only), rows normalised. The contexts are the
   ones the beam asks for without prefetching (``lookahead=1``).
   Runs are interleaved (floor, lookahead 1, lookahead 2, ... in each round), medians and the spread
   of the per-round ratios; counters of the last round: model calls, tokens computed and rows. Log Z
   is checked against the beam replayed on the floor's rows (an independent computation).
   Beside them, the engine's own cost of prefill's sequence of calls: the model alone runs, for each
   call of the last lookahead listed, that call's new tokens as one sequence after a past of the same
   length, written in place after it (no copy of the past). The floor says what the beam's
   dependencies cost (a beam must have rows before it prunes); this row says what our layout, copies
   and Python cost on top of the model.
2. **The seed** (``--seed``, a tiny random 2-layer Llama with the GPT-2 tokenizer, through each
   library's HF backend): ours against genlm-bytes 0.2.0 (``bash benchmarks/seed_venv.sh``).

    python benchmarks/bench_bytes.py [--sizes 300,2000] [--lookaheads 1,6] [--rounds 2] [--seed]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from _common import fmt_s, run_seed, seed_python

from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_core.cli import table

TEXT = (
    b"The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    b"polished the great lens, and watched the ships pass far out on the grey water. In winter the storms "
    b"came in hard from the north, and he would sit by the lamp for hours, listening to the wind and the sea. "
    b"His daughter lived in the village below the cliffs, where she ran a small shop that sold rope, nails, "
    b"tea and tinned fish to the fishermen. On Sundays she walked up the long path with a basket of bread and "
    b"the week's newspapers, and the two of them would eat lunch at the kitchen table while the gulls argued "
    b"on the roof. She often asked him when he planned to retire. He always answered that the light would "
    b"need him for one more winter, and then he would think about it. In truth he could not imagine a life "
    b"without the tower. He knew every step of the stairs by the sound it made under his boots, and he could "
    b"tell the weather a day ahead from the colour of the clouds over the headland. When the new automatic "
    b"lamp arrived in the spring, two engineers came with it. They were young and polite, and they spent a "
    b"week installing cables, sensors and a small grey box that would switch the light on and off by itself. "
    b"On the last evening they showed him how it worked, and he watched the beam come to life without anyone "
    b"touching it. He thanked them, made them a pot of tea, and said nothing more about it. After they left, "
    b"he climbed the stairs anyway, as he had done for thirty years, and sat beside the lens until morning. "
    b"The next week he packed his books, his charts and his old brass telescope into wooden crates, and his "
    b"daughter drove him down to the village. He took a room above her shop with a window that faced the sea. "
    b"From there he could still see the light turning at night, steady and patient, doing its work alone. "
    b"Some evenings the fishermen came by to ask his opinion of the weather, and he was always glad to give it. "
    b"In the autumn he began to write down everything he remembered about the ships that had passed."
)
K = 5
FLOOR_CHUNK = 512  # tokens per forward pass of the floor (the fastest of 128, 256, 512 on 2,000 bytes)

# ---- 1. the floor --------------------------------------------------------------------------------


def tree_rows(
    model: Any, contexts: Sequence[tuple[int, ...]], chunk: int = FLOOR_CHUNK
) -> dict[tuple[int, ...], torch.Tensor]:
    """Next-token log-probabilities of every context, each distinct token computed once.

    The contexts' prefixes form a tree, taken in depth-first order (sorted) and in chunks; a chunk runs
    as one sequence after the states of its nodes' earlier ancestors only, under a 4-D mask that lets
    every token see its ancestors and itself (positions are depths). So no token is run twice and no
    attention is spent on other branches."""
    nodes = sorted({c[:i] for c in set(contexts) for i in range(1, len(c) + 1)})
    index = {node: j for j, node in enumerate(nodes)}
    ancestors = np.zeros((len(nodes), len(nodes)), bool)
    for j, node in enumerate(nodes):
        if len(node) > 1:
            ancestors[j] = ancestors[index[node[:-1]]]
        ancestors[j, j] = True
    from transformers import DynamicCache

    keys: list[torch.Tensor] = []  # per layer [1, heads, nodes, head_dim], filled chunk by chunk
    values: list[torch.Tensor] = []
    rows = []
    with torch.inference_mode():
        for a in range(0, len(nodes), chunk):
            b = min(len(nodes), a + chunk)
            before = np.flatnonzero(ancestors[a:b, :a].any(axis=0))
            cache = DynamicCache()
            if len(before):
                picked = torch.from_numpy(before)
                for layer, (k, v) in enumerate(zip(keys, values)):
                    cache.update(k[:, :, picked], v[:, :, picked], layer)
            mask = np.concatenate([ancestors[a:b, before], ancestors[a:b, a:b]], axis=1)
            out = model(
                input_ids=torch.tensor([[n[-1] for n in nodes[a:b]]]),
                position_ids=torch.tensor([[len(n) - 1 for n in nodes[a:b]]]),
                attention_mask=torch.from_numpy(mask)[None, None],
                past_key_values=cache,
                use_cache=True,
            )
            for layer, state in enumerate(out.past_key_values.layers):
                k, v = state.keys[:, :, len(before) :], state.values[:, :, len(before) :]
                if a == 0:
                    keys.append(k.new_zeros(1, k.shape[1], len(nodes), k.shape[3]))
                    values.append(v.new_zeros(1, v.shape[1], len(nodes), v.shape[3]))
                keys[layer][:, :, a:b], values[layer][:, :, a:b] = k, v
            rows.append(torch.log_softmax(out.logits[0].float(), -1))
    table_rows = torch.cat(rows)
    return {c: table_rows[index[c]] for c in set(contexts)}


@contextlib.contextmanager
def answering(lm: Any, rows_of: Callable[[Any, Sequence[int]], Awaitable[torch.Tensor]]) -> Iterator[None]:
    """Within the block, ``lm.next_token_logprobs(context)`` is ``rows_of(lm's own method, context)``."""
    own = lm.next_token_logprobs
    lm.next_token_logprobs = lambda context: rows_of(own, context)
    try:
        yield
    finally:
        del lm.next_token_logprobs  # the class's method again


async def prefill(
    lm: Any, text: bytes, lookahead: int, shapes: list[tuple[int, int]] | None = None
) -> tuple[float, float, dict[str, int]]:
    """Seconds, log Z and counters of one prefill from a cold cache; ``shapes`` gets each model call's
    (new tokens, past length with no holes)."""
    beam = await ByteBeamState.initial(lm, BeamParams(K=K, heal=False))
    lm.clear_cache()
    calls, tokens, rows = lm.forward_calls, lm.tokens_computed, lm.batcher.stats.items
    own = lm.forward_new
    if shapes is not None:

        def noted(plan: Any) -> Any:
            past = plan.merged.length if plan.merged is not None else plan.real_past_length
            shapes.append((int(plan.new_mask.sum()), past))
            return own(plan)

        lm.forward_new = noted
    t0 = time.perf_counter()
    try:
        after = await beam.prefill(text, lookahead=lookahead)
    finally:
        seconds = time.perf_counter() - t0
        if shapes is not None:
            del lm.forward_new  # the class's method again
    work = {
        "model calls": lm.forward_calls - calls,
        "tokens computed": lm.tokens_computed - tokens,
        "rows": lm.batcher.stats.items - rows,
    }
    beam.close()
    return seconds, after.logZ, work


async def recording(seen: set[tuple[int, ...]], ask: Any, context: Sequence[int]) -> torch.Tensor:
    """``ask(context)``, noting ``context`` in ``seen``."""
    seen.add(tuple(context))
    return await ask(context)


async def replayed_log_z(lm: Any, text: bytes, rows: dict[tuple[int, ...], torch.Tensor]) -> float:
    """Log Z of the same prefill when every row is read from ``rows`` (the floor's)."""

    async def from_floor(_: Any, context: Sequence[int]) -> torch.Tensor:
        return rows[tuple(context)]

    with answering(lm, from_floor):
        beam = await ByteBeamState.initial(lm, BeamParams(K=K, heal=False))
        log_z = (await beam.prefill(text, lookahead=1)).logZ
        beam.close()
        return log_z


def same_calls(model: Any, shapes: list[tuple[int, int]]) -> float:
    """Seconds the model alone takes for calls of these shapes: each call's new tokens as one sequence
    after a past of that length, held in a buffer with room for them (no padding, no copies, no masks
    beyond causal, logits at every new token): what any implementation of the same sequence of calls
    must spend."""
    from genlm_hf.lm import _dynamic_cache

    longest = max(past + tokens for tokens, past in shapes)
    with torch.inference_mode():
        base = model(torch.arange(1, longest + 1)[None] % 5000, use_cache=True).past_key_values.layers
        t0 = time.perf_counter()
        for tokens, past in shapes:
            # views of one base past: each call writes its new states over positions past.. in place
            # (their values do not matter for timing)
            kv = [(state.keys[:, :, : past + tokens], state.values[:, :, : past + tokens]) for state in base]
            cache = _dynamic_cache(kv, past)
            model(torch.randint(0, 5000, (1, tokens)), past_key_values=cache, use_cache=True, logits_to_keep=tokens)
        return time.perf_counter() - t0


def floor_table(sizes: list[int], lookaheads: list[int], rounds: int) -> None:
    from genlm_core.testing.models import smollm2_dir
    from genlm_hf import AsyncTransformer

    lm = AsyncTransformer.from_name(str(smollm2_dir()), batch_size=256, timeout=0.0)
    asyncio.run(prefill(lm, TEXT[:20], 2))  # warm-up: first model calls, allocator
    rows_out = []
    for size in sizes:
        text = TEXT[:size]
        seen: set[tuple[int, ...]] = set()
        with answering(lm, functools.partial(recording, seen)):
            asyncio.run(prefill(lm, text, 1))
        needed = sorted(seen)
        floor_rows = tree_rows(lm.model, needed)
        reference = asyncio.run(replayed_log_z(lm, text, floor_rows))
        times: dict[Any, list[float]] = {"floor": [], "model": []}
        results: dict[int, tuple[float, dict[str, int]]] = {}
        for _ in range(rounds):
            t0 = time.perf_counter()
            tree_rows(lm.model, needed)
            times["floor"].append(time.perf_counter() - t0)
            for la in lookaheads:
                shapes: list[tuple[int, int]] = []
                seconds, log_z, work = asyncio.run(prefill(lm, text, la, shapes if la == lookaheads[-1] else None))
                times.setdefault(la, []).append(seconds)
                results[la] = (log_z, work)
            times["model"].append(same_calls(lm.model, shapes))
        floor = statistics.median(times["floor"])
        nodes = len({c[:i] for c in needed for i in range(1, len(c) + 1)})
        chunks = f"{-(-nodes // FLOOR_CHUNK)} chunks"
        rows_out.append(
            [str(size), "floor: one tree pass", fmt_s(floor), "1.00x", "", chunks, str(nodes), str(len(needed)), ""]
        )
        for la in lookaheads:
            ratios = [t / f for t, f in zip(times[la], times["floor"])]
            log_z, work = results[la]
            rows_out.append(
                [
                    str(size),
                    f"prefill, lookahead={la}",
                    fmt_s(statistics.median(times[la])),
                    f"{statistics.median(ratios):.2f}x",
                    f"{min(ratios):.2f}-{max(ratios):.2f}",
                    str(work["model calls"]),
                    str(work["tokens computed"]),
                    str(work["rows"]),
                    f"{abs(log_z - reference):.1e}",
                ]
            )
        last = lookaheads[-1]
        model_ratios = [t / f for t, f in zip(times["model"], times["floor"])]
        ours = [t / m for t, m in zip(times[last], times["model"])]
        rows_out.append(
            [
                str(size),
                f"model alone, the calls of lookahead={last}",
                fmt_s(statistics.median(times["model"])),
                f"{statistics.median(model_ratios):.2f}x",
                f"{min(model_ratios):.2f}-{max(model_ratios):.2f}",
                str(results[last][1]["model calls"]),
                str(results[last][1]["tokens computed"]),
                "",
                f"ours {statistics.median(ours):.2f}x",
            ]
        )
        print(f"  {size} bytes: log Z {reference:.4f} (the beam on the floor's rows)", file=sys.stderr)
    lm.cleanup()
    print(
        f"byte LM prefill, K={K}, SmolLM2-135M float32 (hf backend), {torch.get_num_threads()} threads; "
        f"{rounds} interleaved rounds, medians; target: prefill <= 1.2x the floor. 'model alone': the "
        "model by itself on the same sequence of calls (each call's new tokens as one sequence after a past "
        "of its length, no copies), and prefill's time over it ('ours')"
    )
    header = ["bytes", "run", "time", "vs floor", "spread", "model calls", "tokens computed", "rows", "|d log Z|"]
    print(table(header, rows_out))


# ---- 2. the seed ---------------------------------------------------------------------------------

SEED = """
import asyncio, json, time
from genlm.backend.llm import AsyncTransformer
from genlm.bytes import ByteBeamState, BeamParams
lm = AsyncTransformer.from_name({path!r}, **{kwargs!r})
async def main():
    beam = await ByteBeamState.initial(lm, BeamParams(K={k}, heal=False))
    t0 = time.perf_counter()
    after = await beam.prefill({text!r})
    return time.perf_counter() - t0, float(after.logZ)
seconds, log_z = asyncio.run(main())
print(json.dumps({{"seconds": seconds, "logZ": log_z}}))
"""


async def ours_on(path: str, text: bytes) -> tuple[float, float]:
    from genlm_hf import AsyncTransformer

    lm = AsyncTransformer.from_name(path, batch_size=256, timeout=0.0)
    beam = await ByteBeamState.initial(lm, BeamParams(K=K, heal=False))
    await (await beam.prefill(text[:20])).logp_next()  # warm-up: first model call
    lm.clear_cache()
    t0 = time.perf_counter()
    after = await beam.prefill(text)
    seconds = time.perf_counter() - t0
    beam.cleanup()
    return seconds, after.logZ


def seed_table() -> None:
    from genlm_core.testing.models import tiny_model_dir

    if not seed_python():
        print("seed venv not found: run `bash benchmarks/seed_venv.sh`", file=sys.stderr)
        return
    path, text = str(tiny_model_dir("llama")), TEXT[:300]
    t_ours, z_ours = asyncio.run(ours_on(path, text))
    rows = [
        ["ours (genlm_core.bytes), LM timeout=0", fmt_s(t_ours), f"{len(text) / t_ours:.1f}", f"{z_ours:.4f}", "1.0x"]
    ]
    for label, kwargs in (("its defaults (timeout=0.02)", {}), ("tuned like ours (timeout=0)", {"timeout": 0.0})):
        seed = run_seed(SEED.format(path=path, k=K, text=text, kwargs=kwargs))
        rows.append(
            [
                f"genlm-bytes 0.2.0, {label}",
                fmt_s(seed["seconds"]),
                f"{len(text) / seed['seconds']:.1f}",
                f"{seed['logZ']:.4f}",
                f"{seed['seconds'] / t_ours:.1f}x slower",
            ]
        )
    print(
        f"prefill of {len(text)} bytes, K={K}, tiny 2-layer float32 Llama (GPT-2 tokenizer); target: ours >= 20x faster"
    )
    print(table(["implementation", "time", "bytes/s", "log Z", "vs ours"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="300,2000", help=f"prompt lengths in bytes (at most {len(TEXT)})")
    parser.add_argument("--lookaheads", default="1,6", help="prefill lookaheads to time")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians and spread)")
    parser.add_argument("--seed", action="store_true", help="also time genlm-bytes 0.2.0 on a tiny model")
    args = parser.parse_args()
    floor_table([int(s) for s in args.sizes.split(",")], [int(x) for x in args.lookaheads.split(",")], args.rounds)
    if args.seed:
        seed_table()


if __name__ == "__main__":
    main()
