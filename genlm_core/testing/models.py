"""Models for tests and examples, offline: tiny random-weight models and random LoRA adapters.

Tiny models are built from a config with a real tokenizer, saved with ``save_pretrained`` and
cached under the genlm cache folder, so every backend loads them through its real loading path.
Needs ``transformers``. SmolLM2-135M is a runtime asset (:mod:`genlm_core.assets`), re-exported here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from genlm_core.assets import SMOLLM2_GGUF, build_once, cache_dir, load_tokenizer, smollm2_dir, smollm2_path
from genlm_core.testing.tokenizers import toy_tokenizer


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

    return build_once(build, out)


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
    adapter = build_once(
        lambda dest: random_lora(base, dest), cache_dir() / "models" / "SmolLM2-135M-lora-seed5", "adapter_config.json"
    )

    def build(dest: Path) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(dest)
        AutoTokenizer.from_pretrained(base).save_pretrained(dest)

    return adapter, build_once(build, cache_dir() / "models" / "SmolLM2-135M-lora-seed5-merged")


__all__ = ["SMOLLM2_GGUF", "random_lora", "smollm2_dir", "smollm2_lora_dirs", "smollm2_path", "tiny_model_dir"]
