"""genlm-llamacpp against genlm-hf on the same float32 weights, through every path a particle program takes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from genlm_core import OptionsError, load_model_by_name
from genlm_core.errors import ModelNotFoundError
from genlm_core.testing import bounds, check_lm_contract
from genlm_core.testing.live import particle_program
from genlm_core.tokenization import decode_vocabulary
from genlm_llamacpp import LlamaCppLM
from genlm_llamacpp.engine import EngineConfig, LlamaEngine, repack_weights
from genlm_llamacpp.files import resolve_gguf


def gguf_file(path) -> tuple[str, int, int]:
    """A GGUF file as genlm-llamacpp's tokenizer cache knows it: its path, size and time."""
    path = Path(path).resolve()
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns


@pytest.fixture(scope="module", autouse=True)
def tokenizers_loaded_once(loaded_once):
    """Most tests build a llama.cpp model and a genlm-hf one on the same weights; the tokenizers, which both
    read and never change, are loaded once per file or folder (about 0.7 s a load here, over 30 loads)."""
    import genlm_llamacpp.lm
    from genlm_hf import transformers_api

    with (
        loaded_once(genlm_llamacpp.lm, "gguf_tokenizer", key=gguf_file),
        loaded_once(transformers_api, "load_tokenizer"),
    ):
        yield


def llamacpp(gguf: str, **opts) -> LlamaCppLM:
    return load_model_by_name(gguf, backend="llamacpp", llm_opts={"timeout": 0.001, **opts})


def hf(folder: str):
    return load_model_by_name(folder, backend="hf", llm_opts={"dtype": "float32"})


def test_byte_vocab_is_llama_cpps_and_the_hugging_face_tokenizers(tiny):
    """llama.cpp's own detokenization of every token equals the bytes genlm decodes from the Hugging
    Face tokenizer the GGUF was written from (byte-level BPE, and SentencePiece with <0xNN> bytes)."""
    folder, gguf = tiny
    from transformers import AutoTokenizer

    engine = LlamaEngine(gguf, EngineConfig(n_seq_max=1, n_ctx=64))
    try:
        pieces = engine.token_bytes()
    finally:
        engine.close()
    expected = [bytes(t) for t in decode_vocabulary(AutoTokenizer.from_pretrained(folder)).byte_vocab]
    assert pieces == expected
    lm = llamacpp(gguf)
    assert [bytes(t) for t in lm.byte_vocab] == pieces
    if "mistral" in folder or len(pieces) == 32000:
        assert pieces[3 + 0x41] == b"A" and pieces[3 + 0xFF] == b"\xff"  # <0x41>, <0xFF>: raw bytes
    lm.cleanup()


@pytest.mark.slow
@pytest.mark.breadth
def test_weights_are_not_repacked_where_llama_cpp_reports_amx(tiny_gpt2, monkeypatch):
    """llama.cpp's AMX matrix multiply segfaulted on SmolLM2's Q4_1 GGUF on an AMX machine: by default
    genlm asks llama.cpp not to repack weights (the AMX path) there, and lets it elsewhere."""
    amx = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"
    assert repack_weights(None, amx) is False
    assert repack_weights(None, amx.replace("AMX_INT8 = 1 | ", "")) is True
    assert repack_weights(True, amx) is True and repack_weights(False, "AVX2 = 1") is False
    from llama_cpp import llama_cpp as lib

    asked = []

    def recorded(path, params):  # what genlm asks of llama.cpp, then "could not load": no model work
        asked.append(params.use_extra_bufts)
        return None

    monkeypatch.setattr(lib, "llama_model_load_from_file", recorded)
    _, gguf = tiny_gpt2
    here = lib.llama_print_system_info().decode()
    for option, want in ((None, repack_weights(None, here)), (True, True), (False, False)):
        with pytest.raises(ValueError, match="could not load"):
            llamacpp(gguf, repack_weights=option)
        assert asked.pop() is want


def test_a_tokenizer_with_other_bytes_is_refused(tiny_gpt2):
    _, gguf = tiny_gpt2
    from genlm_core.testing.tokenizers import load_tokenizer

    engine = LlamaEngine(gguf, EngineConfig(n_seq_max=4, n_ctx=64))
    with pytest.raises(ValueError, match=r"decode to other bytes than in llama\.cpp"):
        LlamaCppLM(engine, load_tokenizer("mistral-v1"), n_seq_max=4, batch_size=4)
    engine.close()


def test_rows_equal_genlm_hf_on_the_same_weights(tiny):
    folder, gguf = tiny
    lm, ref = llamacpp(gguf), hf(folder)
    contexts = [[5], [5, 6, 7], list(range(100, 160)), [1, 2, 3, 4, 5, 6]]
    ours = lm.batch_next_token_logprobs_sync(contexts)
    theirs = torch.stack([ref.next_token_logprobs_uncached(c) for c in contexts])
    # two float32 runs of one model (ggml and torch): 4 x its float32-vs-float64 error on the contexts
    bounds.within("llamacpp: rows vs hf", (ours - theirs).abs().max().item(), bounds.rows_bound(folder)(contexts))
    assert lm.engine.config.cache_type == "f32" and lm.engine.config.flash_attn is False
    lm.cleanup()
    ref.cleanup()


def reference_rows(contexts: list[tuple[int, ...]], ref) -> dict[tuple[int, ...], torch.Tensor]:
    """The row of every context from plain, unbatched forward passes of ``ref``'s transformers model, in
    float64. Only contexts that are no prefix of another run, and each is read at the positions where
    the contexts it holds end: a causal model's state at position i depends on the first i + 1 tokens
    alone. A particle program's contexts are mostly prefixes of one another, so this runs a few passes
    instead of one per context, and the LM head only on the rows asked for."""
    body, head = ref.model.get_decoder(), ref.model.get_output_embeddings()
    ordered = sorted(set(contexts))
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    run: list[tuple[int, ...]] = []
    for i, context in enumerate(ordered):
        run.append(context)
        if ordered[i + 1 : i + 2] and ordered[i + 1][: len(context)] == context:
            continue  # a prefix of the next one: the pass of the run's last context holds it too
        with torch.no_grad():
            states = body(torch.tensor([context])).last_hidden_state[0]
            logits = head(states[[len(prefix) - 1 for prefix in run]]).double()
        for prefix, row in zip(run, logits):
            rows[prefix] = torch.log_softmax(row[: ref.vocab_size], -1)
        run = []
    return rows


def assert_rows_match(served, ref, name="llamacpp: served vs hf"):
    """Every served row against the transformers model's unbatched float32 row: two float32 runs of one
    model, within 4 x its float32-vs-float64 error on the served contexts (bounds.rows_bound)."""
    theirs = reference_rows(list(served), ref)
    worst = max(bounds.row_difference(row, theirs[c]) for c, row in served.items())
    tol = bounds.rows_bound(ref.model.name_or_path)([list(c) for c in served])
    bounds.within(name, worst, tol, "largest difference from transformers")
    return worst


def assert_no_sequence_leaks(lm):
    lm.sequences.release_all()
    free = lm.sequence_ids.free
    assert sorted(free) == list(range(lm.engine.config.n_seq_max))
    assert all(lm.engine.sequence_length(s) == 0 for s in free)


@pytest.mark.sized(steps=(25, 200))
def test_hundreds_of_continued_forked_cancelled_and_rewound_steps_match_genlm_hf(tiny_gpt2, steps):
    folder, gguf = tiny_gpt2
    lm, ref = llamacpp(gguf, batch_size=16), hf(folder)
    served = asyncio.run(particle_program(lm, particles=12, steps=steps, seed=1))
    s = lm.sequences.stats
    assert len(served) > 10 * steps  # 12 particles a step, less cancellations
    assert s.continued > 7.5 * steps and s.forked > steps / 2 and s.fresh + s.copied > 10  # every path ran
    assert s.tokens_computed < 1.3 * s.rows  # a continued row costs its one new token
    assert_rows_match(served, ref)
    assert_no_sequence_leaks(lm)
    lm.cleanup()
    ref.cleanup()


def held_sequences(lm) -> int:
    """Sequence ids not free, and free ones that still hold positions."""
    free = lm.sequence_ids.free
    n = lm.engine.config.n_seq_max
    return n - len(set(free)) + sum(lm.engine.sequence_length(s) > 0 for s in free)


def run_shared_check(tiny_gpt2, opts, steps):
    """genlm_core.testing.live: the randomised program every live-sequence engine passes (rows equal the
    uncached rows, every placement ran, no sequence left once released)."""
    from genlm_core.testing.live import check_live_sequences

    folder, gguf = tiny_gpt2
    lm = llamacpp(gguf, **opts)
    tol = bounds.rows_bound(folder)  # live rows and uncached ones come from other batches
    stats = check_live_sequences(lm, lm.sequences, in_use=lambda: held_sequences(lm), steps=steps, atol=tol)
    assert stats.copied > 0  # a sibling in a later batch, a particle that went back, a repeated context
    if opts.get("n_seq_max"):
        assert stats.evicted > 0
    lm.cleanup()


@pytest.mark.sized(steps=(20, 40))
def test_the_shared_particle_check_of_core_passes_on_llama_cpp(tiny_gpt2, steps):
    run_shared_check(tiny_gpt2, {"batch_size": 16}, steps)


@pytest.mark.slow
@pytest.mark.breadth
def test_the_shared_particle_check_passes_with_evictions_on_llama_cpp(tiny_gpt2):
    """Fewer sequences than particles: evictions. 40 steps (in 20, with batches of 4 on 6 sequences, no
    particle had a sibling in its batch, so forks never ran)."""
    run_shared_check(tiny_gpt2, {"batch_size": 4, "n_seq_max": 6, "live": {"lookback": 2}}, 40)


@pytest.mark.slow
@pytest.mark.soak
def test_a_full_kv_cache_or_too_few_sequences_give_fresh_rows_never_wrong_ones(tiny_gpt2):
    folder, gguf = tiny_gpt2
    ref = hf(folder)
    # 12 particles of up to 80 tokens in 256 cells (llama.cpp's least): live sequences are evicted for room
    small = llamacpp(gguf, batch_size=12, n_seq_max=12, n_ctx=256)
    served = asyncio.run(particle_program(small, particles=12, steps=70, seed=2))
    assert small.sequences.stats.evicted > 0 and small.context_limit == 256
    # a batch that cannot fit at all (6 x 60 tokens in 256 cells): each row alone
    unrelated = [list(range(1000 + 100 * i, 1060 + 100 * i)) for i in range(6)]
    alone = small.sequences.stats.alone
    served.update(zip(map(tuple, unrelated), small.batch_next_token_logprobs_sync(unrelated)))
    assert small.sequences.stats.alone == alone + 6
    assert_rows_match(served, ref)
    assert_no_sequence_leaks(small)
    small.cleanup()
    few = llamacpp(gguf, batch_size=4, n_seq_max=5)  # 12 particles, 5 sequences: batches of 4, evictions
    served = asyncio.run(particle_program(few, particles=12, steps=30, seed=3))
    assert few.sequences.stats.evicted > 20
    assert_rows_match(served, ref)
    assert_no_sequence_leaks(few)
    few.cleanup()
    off = llamacpp(gguf, live={"enabled": False})
    served = asyncio.run(particle_program(off, particles=6, steps=10, seed=4))
    assert off.sequences.stats.continued == 0 and len(off.sequences) == 0
    assert_rows_match(served, ref)
    off.cleanup()
    ref.cleanup()


def test_an_engine_error_fails_its_batch_frees_its_sequences_and_the_model_serves_on(tiny_gpt2):
    folder, gguf = tiny_gpt2
    lm = llamacpp(gguf, batch_size=8)
    contexts = [[5, 6, 7 + i] for i in range(6)]
    before = lm.batch_next_token_logprobs_sync(contexts)
    real = lm.engine.decode

    def broken(*args, **kwargs):
        raise RuntimeError("llama_decode exploded")

    lm.engine.decode = broken

    async def batch():
        return await asyncio.gather(*(lm.next_token_logprobs(c + [9]) for c in contexts), return_exceptions=True)

    failures = asyncio.run(batch())
    assert all(isinstance(f, RuntimeError) and "exploded" in str(f) for f in failures)
    lm.engine.decode = real
    assert_no_sequence_leaks(lm)
    again = torch.stack(asyncio.run(batch()))
    lm.clear_cache()
    tol = bounds.rows_bound(folder)  # recomputed in another batch: 4 x the float32 error
    diff = (lm.batch_next_token_logprobs_sync(contexts) - before).abs().max().item()
    bounds.within("llamacpp: after an engine error vs before", diff, tol(contexts))
    fresh = torch.stack([lm.next_token_logprobs_uncached(c + [9]) for c in contexts])
    diff = (again - fresh).abs().max().item()
    bounds.within("llamacpp: after an engine error vs uncached", diff, tol([c + [9] for c in contexts]))
    lm.cleanup()


def test_the_whole_protocol_and_close(tiny_gpt2):
    folder, gguf = tiny_gpt2
    lm = llamacpp(gguf, batch_size=8)
    check_lm_contract(lm, [[5], [5, 6, 7], list(range(50, 90)), [5, 6, 8]], atol=bounds.rows_bound(folder), close=True)


def test_options_and_names_are_checked_before_loading(tmp_path, tiny_gpt2):
    _, gguf = tiny_gpt2
    with pytest.raises(OptionsError, match="raise n_seq_max"):
        llamacpp(gguf, batch_size=100, n_seq_max=64)
    with pytest.raises(OptionsError, match="n_seq_max"):
        llamacpp(gguf, n_seq_max=300)
    with pytest.raises(OptionsError, match="unknown option 'n_gpu'"):
        llamacpp(gguf, n_gpu=1)
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file 'smolm2'.*did you mean 'smollm2'"):
        resolve_gguf("smolm2")
    with pytest.raises(ModelNotFoundError, match=r"no \.gguf file in the folder"):
        resolve_gguf(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match=r"no \.gguf file"):
        resolve_gguf(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        resolve_gguf(str(tmp_path / "a.gguf"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "m.gguf").symlink_to(gguf)
    assert resolve_gguf(str(tmp_path / "b")) == str(tmp_path / "b" / "m.gguf")
    assert LlamaCppLM.Options(n_ctx=512).n_ctx == 512


def test_a_context_longer_than_the_kv_cache_is_refused_at_once(tiny_gpt2):
    _, gguf = tiny_gpt2
    lm = llamacpp(gguf, n_ctx=300)  # llama.cpp rounds up to a multiple of 256
    assert lm.context_limit == lm.engine.n_ctx == 512
    with pytest.raises(ValueError, match="limit of 512 positions"):
        lm.next_token_logprobs_sync(list(range(513)))
    assert lm.next_token_logprobs_sync(list(range(512))).shape == (lm.vocab_size,)
    lm.cleanup()


def test_logits_do_not_depend_on_what_else_is_in_the_batch(tiny_gpt2):
    """The same context alone, in a batch of strangers, and continued from a live sequence."""
    folder, gguf = tiny_gpt2
    lm = llamacpp(gguf, batch_size=16)
    target = [7, 8, 9, 10, 11]
    alone = lm.next_token_logprobs_uncached(target)
    lm.batch_next_token_logprobs_sync([target[:-1]] + [list(np.arange(30) + i) for i in range(10)])
    lm.cache.clear()
    crowded = lm.batch_next_token_logprobs_sync([target] + [list(np.arange(31) + i) for i in range(10)])[0]
    assert lm.sequences.stats.continued >= 1
    diff = (alone - crowded).abs().max().item()
    bounds.within("llamacpp: alone vs in a batch of strangers", diff, bounds.rows_bound(folder)([target]))
    lm.cleanup()


@pytest.mark.slow
@pytest.mark.breadth
def test_the_command_line_lists_loads_and_explains(capsys, monkeypatch, tiny_gpt2):
    from genlm_core.cli import main
    from genlm_llamacpp import plugin

    assert main(["backends", "--check"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("llamacpp "))
    assert "genlm-llamacpp" in line and " yes " in line
    assert main(["options", "llamacpp"]) == 0
    assert "n_seq_max" in capsys.readouterr().out
    _, gguf = tiny_gpt2
    assert main(["logprobs", gguf, "hello world", "-b", "llamacpp", "--top", "3"]) == 0
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("1 "))
    lm = llamacpp(gguf)
    row = lm.next_token_logprobs_sync(lm.tokenizer.encode("hello world"))
    assert int(first.split()[1]) == int(row.argmax()) and f"{row.max().item():.4f}" in first
    lm.cleanup()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "pip install genlm-llamacpp" in plugin.unavailable_reason()


def test_an_untested_llama_cpp_python_release_is_named_at_load(monkeypatch, caplog):
    from genlm_llamacpp import engine

    engine.check_version()
    assert not caplog.records
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.3.99")
    engine.check_version()
    assert "llama-cpp-python 0.3.99 is not a release genlm-llamacpp is tested with (==0.3.36)" in caplog.text
