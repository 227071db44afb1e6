"""GGUF files for tests and benchmarks, offline: a Hugging Face Llama folder written as a float32
GGUF (the same weights, so genlm-hf and genlm-llamacpp can be compared row by row).

A test kit: no runtime module imports it. The files the model names build (``smollm2``, ``smollm2-f32``,
:func:`~genlm_llamacpp.files.dequantize_gguf`) are runtime's, in :mod:`genlm_llamacpp.files`.
Needs ``gguf`` and ``transformers``. Files are cached beside genlm's other test models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from genlm_core.assets import cache_dir
from genlm_llamacpp.files import publish_file

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def _rope_interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder a q/k projection's output rows from Hugging Face's rotary layout (each head's first
    half rotates with its second half) to llama.cpp's (adjacent pairs rotate together)."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _tokenizer_metadata(writer: Any, folder: Path) -> None:
    """The tokenizer of ``folder`` (a byte-level BPE or a SentencePiece BPE with byte fallback)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE":
        raise ValueError(f"only BPE tokenizers are written to GGUF here, not {model['type']}")
    n = len(tok)
    pieces = [""] * n
    for piece, i in model["vocab"].items():
        pieces[i] = piece
    special = {a["id"] for a in spec["added_tokens"] if a.get("special")}
    for a in spec["added_tokens"]:
        pieces[a["id"]] = a["content"]
    if model.get("byte_fallback"):  # SentencePiece: '▁' for spaces, <0xNN> byte tokens
        types = [
            UNKNOWN
            if p == model.get("unk_token")
            else CONTROL
            if i in special
            else BYTE
            if len(p) == 6 and p.startswith("<0x") and p.endswith(">")
            else NORMAL
            for i, p in enumerate(pieces)
        ]
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(pieces)
        writer.add_token_scores([-float(i) for i in range(n)])  # llama.cpp's SPM merges by score
        writer.add_token_types(types)
        if model.get("unk_token") in model["vocab"]:
            writer.add_unk_token_id(model["vocab"][model["unk_token"]])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(pieces)
        writer.add_token_types([CONTROL if i in special else NORMAL for i in range(n)])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    if tok.bos_token_id is not None:
        writer.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_id is not None:
        writer.add_eos_token_id(tok.eos_token_id)
    writer.add_add_bos_token(False)


def write_llama_gguf(folder: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face Llama in ``folder`` as a float32 GGUF at ``out`` (weights unchanged:
    its rows equal the folder's under genlm-hf up to float rounding)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    if config.model_type != "llama":
        raise ValueError(f"only Llama models are written to GGUF here, not {config.model_type!r}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_name(folder.name)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(float(theta))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        _tokenizer_metadata(writer, folder)
        writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
        for i in range(config.num_hidden_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            writer.add_tensor(b + "attn_norm.weight", weights[p + "input_layernorm.weight"])
            writer.add_tensor(b + "attn_q.weight", _rope_interleave(weights[p + "self_attn.q_proj.weight"], heads))
            writer.add_tensor(b + "attn_k.weight", _rope_interleave(weights[p + "self_attn.k_proj.weight"], kv_heads))
            writer.add_tensor(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
            writer.add_tensor(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
            writer.add_tensor(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
            writer.add_tensor(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
            writer.add_tensor(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
            writer.add_tensor(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
        writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
        if not config.tie_word_embeddings:
            writer.add_tensor("output.weight", weights["lm_head.weight"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return publish_file(Path(out), write)


def llama_gguf(folder: str | Path) -> Path:
    """:func:`write_llama_gguf` of ``folder``, cached by the folder's path and weights' file times."""
    folder = Path(folder).resolve()
    stamp = [str(folder)] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(folder.iterdir())]
    key = hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:12]
    return write_llama_gguf(folder, cache_dir() / "gguf" / f"{folder.name}-{key}-f32.gguf")


__all__ = ["llama_gguf", "write_llama_gguf"]
