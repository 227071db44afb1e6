"""SMC workload on the hf backend: ours vs a plain batched HF decode (the practical limit) vs the seed.

N particles x T steps: at every step each particle awaits ``next_token_logprobs`` of its own growing
context and samples one token. The plain decode runs the same shapes with one DynamicCache and no
library (prefill, then T one-token steps). The seed is genlm-backend 0.3.1's AsyncTransformer, in
its own venv (``bash benchmarks/seed_venv.sh``). Model: a 66M-parameter float32 Llama (random weights,
GPT-2 tokenizer) built offline.

    python benchmarks/bench_hf.py                 # N=32,T=32 with seed; N=128; 1,000-token shared prompt
    python benchmarks/bench_hf.py --quick         # N=32,T=32 only, no seed
    python benchmarks/bench_hf.py --step          # HF's bare decode step vs genlm-hf's model call and
                                                  # SMC step, interleaved (hf_step.py; --n, --prompts,
                                                  # --rounds, --decode-room, --resample)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch
from _common import fmt_s, run_seed, seed_python

from genlm_core.cli import table
from genlm_core.testing.models import tiny_model_dir

MODEL = {
    "arch": "llama",
    "tokenizer": "gpt2",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}

SEED = """
import asyncio, json, time, torch
from genlm.backend.llm import AsyncTransformer
lm = AsyncTransformer.from_name({path!r}, batch_size={n}, timeout=0.001)
prompt = {prompt!r}
async def particle(i, gen):
    ctx = list(prompt)
    for _ in range({t}):
        lp = await lm.next_token_logprobs(ctx)
        ctx.append(int(torch.multinomial(torch.softmax(lp.double(), -1), 1, generator=gen)))
async def main():
    await asyncio.gather(*(particle(i, torch.Generator().manual_seed(i)) for i in range({n})))
t0 = time.perf_counter(); asyncio.run(main()); print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def plain_decode(model, prompt: list[int], n: int, steps: int) -> float:
    """The limit: one batched DynamicCache decode of the same shapes, sampling like the particles."""
    from transformers import DynamicCache

    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    t0 = time.perf_counter()
    with torch.no_grad():
        cache = DynamicCache()
        ids = torch.tensor([prompt] * n)
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logprobs = torch.log_softmax(out.logits[:, -1].float(), -1)
            nxt = [
                int(torch.multinomial(torch.softmax(lp.double(), -1), 1, generator=g)) for lp, g in zip(logprobs, gens)
            ]
            ids = torch.tensor(nxt)[:, None]
            cache = out.past_key_values
    return time.perf_counter() - t0


def ours(lm, prompt: list[int], n: int, steps: int) -> float:
    lm.clear_cache()

    async def particle(gen: torch.Generator) -> None:
        ctx = list(prompt)
        for _ in range(steps):
            lp = await lm.next_token_logprobs(ctx)
            ctx.append(int(torch.multinomial(torch.softmax(lp.double(), -1), 1, generator=gen)))

    async def main() -> None:
        await asyncio.gather(*(particle(torch.Generator().manual_seed(i)) for i in range(n)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0


def step_mode(args: argparse.Namespace) -> None:
    """HF's bare decode step against genlm-hf's model call and whole SMC step (``hf_step.py``), each cell
    interleaved round by round, on this script's model."""
    import hf_step
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_hf import AsyncTransformer
    from genlm_hf.options import HFOptions

    path = str(tiny_model_dir(**MODEL))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ns = [int(x) for x in args.n.split(",")]
    options = HFOptions(batch_size=max(ns), timeout=0, decode_room=args.decode_room)
    lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(path), options)
    text = "It was a bright cold day in April, and the clocks were striking thirteen. "
    rows = []
    for n in ns:
        lm.batcher.batch_size = n
        for length in [int(x) for x in args.prompts.split(",")]:
            prompt = (list(lm.tokenizer.encode(text)) * (length // 10 + 1))[:length]
            cell = asyncio.run(hf_step.time_cell(model, lm, prompt, n, args.rounds, resample=args.resample))
            label = f"float32 Llama{f' decode_room={args.decode_room}' if args.decode_room else ''}"
            label += " resampled" if args.resample else ""
            rows.append(hf_step.table_row(label, n, length, hf_step.summary(cell)))
    print(
        f"model: float32 Llama, {params(model) / 1e6:.1f}M parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.rounds} interleaved rounds after 2; times: median (min-max)"
    )
    print(table(hf_step.HEADER, rows))
    lm.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-seed", action="store_true")
    ap.add_argument("--step", action="store_true", help="bare HF decode step vs genlm-hf's model call (hf_step.py)")
    ap.add_argument("--n", default="8,32", help="--step: particles (default 8,32)")
    ap.add_argument("--prompts", default="24,200", help="--step: prompt lengths (default 24,200)")
    ap.add_argument("--rounds", type=int, default=15, help="--step: counted rounds (default 15)")
    ap.add_argument("--decode-room", type=int, default=0, help="--step: genlm-hf's decode_room option (default 0)")
    ap.add_argument("--resample", action="store_true", help="--step: particles resampled uniformly every step")
    args = ap.parse_args()
    if args.step:
        step_mode(args)
        return

    from transformers import AutoModelForCausalLM

    from genlm_hf import AsyncTransformer

    path = str(tiny_model_dir(**MODEL))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = "It was a bright cold day in April, and the clocks were striking thirteen."
    workloads = [("N=32, T=32", 32, 32, "short")]
    if not args.quick:
        workloads += [("N=128, T=32", 128, 32, "short"), ("N=32, T=32, 1,000-token shared prompt", 32, 32, "long")]
    rows = []
    for label, n, steps, kind in workloads:
        lm = AsyncTransformer.from_name(path, batch_size=n, timeout=0.001)
        tok = lm.tokenizer
        prompt = tok.encode(text)
        if kind == "long":
            prompt = (prompt * 100)[:1000]
        ours(lm, prompt, n, 2)  # warm-up
        plain_decode(model, prompt, n, 2)
        t_ours = ours(lm, prompt, n, steps)
        t_plain = plain_decode(model, prompt, n, steps)
        t_seed = None
        if seed_python() and not args.no_seed and not args.quick and kind == "short" and n == 32:
            try:
                t_seed = run_seed(SEED.format(path=path, n=n, t=steps, prompt=prompt))["seconds"]
            except RuntimeError as exc:
                print(f"seed failed: {exc}", file=sys.stderr)
        rows.append(
            [
                label,
                fmt_s(t_ours),
                fmt_s(t_plain),
                fmt_s(t_seed) if t_seed else "not run",
                f"{t_ours / t_plain:.2f}x",
                f"{t_seed / t_ours:.1f}x" if t_seed else "-",
            ]
        )
        lm.cleanup()
    print(
        f"model: float32 Llama, {params(model) / 1e6:.1f}M parameters, vocab {model.config.vocab_size}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        table(["workload", "ours", "plain decode", "seed 0.3.1", "ours / plain (target <= 1.33)", "seed / ours"], rows)
    )


if __name__ == "__main__":
    main()
