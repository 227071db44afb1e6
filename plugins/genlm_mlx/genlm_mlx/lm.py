"""``AsyncMlxLM``: an mlx-lm model behind the AsyncLM protocol, with automatic KV reuse.

The reuse plan comes from core (:mod:`genlm_core.kv_reuse`), as for genlm-hf. mlx-lm's attention
layers ask their cache for RoPE offsets, for the keys and values, and for the mask; a
:class:`_PlannedCache` answers with per-row offsets (left-padded new tokens keep their real
positions), the gathered past and the plan's mask, so ragged batches over different cached
prefixes are exact. The LM head runs only at the last position.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from genlm_core import AsyncLM, Request, Tokenizer
from genlm_core.hub import resolve_model
from genlm_core.kv_reuse import BatchPlan, KVBlock, KVReuse
from genlm_mlx.options import MLXOptions

log = logging.getLogger(__name__)

#: mlx-lm model types whose layers take RoPE offsets from the cache and whose logits are the LM head of
#: the final hidden state (so the planned cache and the last-position head are exact).
PLANNED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class _PlannedCache:
    """One layer's cache for one planned forward pass, in the shape mlx-lm's attention expects."""

    def __init__(self, past: tuple[mx.array, mx.array] | None, offset: mx.array, mask: mx.array):
        self.keys: mx.array | None
        self.values: mx.array | None
        self.keys, self.values = past if past is not None else (None, None)
        self.offset = offset
        self._mask = mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is not None and self.values is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self._mask


def normalise_config(path: Path) -> dict[str, Any]:
    """Config overrides mlx-lm needs for a transformers-5 checkpoint: it reads ``rope_theta`` (and
    ``rope_scaling``) only at the top level, and would silently ignore a ``rope_parameters`` block;
    its GPT-2 wants ``n_ctx``, which newer configs call ``n_positions`` only."""
    config_file = path / "config.json"
    if not config_file.exists():
        return {}
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters") or {}
    out: dict[str, Any] = {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if config.get("model_type") == "gpt2" and "n_ctx" not in config and "n_positions" in config:
        out["n_ctx"] = config["n_positions"]
    if out:
        log.info("%s: config values set for mlx-lm: %s", path, sorted(out))
    return out


class AsyncMlxLM(KVReuse, AsyncLM):
    """An mlx-lm causal LM: batched, exact next-token logprobs with automatic KV reuse."""

    Options = MLXOptions
    options: MLXOptions

    def __init__(self, model: Any, tokenizer: Tokenizer, options: MLXOptions | None = None, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        self.model = model
        args = getattr(model, "args", None)
        model_type = getattr(args, "model_type", type(model).__module__.rsplit(".", 1)[-1])
        sliding = getattr(getattr(model, "model", None), "swa_idx", None) is not None
        self.planned = model_type in PLANNED_MODEL_TYPES and not sliding
        if not self.planned:  # rotating (sliding-window) or unvetted caches: exact, one request at a time
            reason = "sliding-window layers" if sliding else f"model type {model_type!r}"
            log.warning("mlx %s: KV reuse and batching disabled; every request is computed alone", reason)
        self.init_kv_reuse(self.options, self.options.reuse_kv and self.planned)

    @classmethod
    def from_options(cls, model_path: str, options: MLXOptions) -> AsyncMlxLM:
        """Load a local mlx-lm / Hugging Face folder (the registry factory; ``from_name`` takes the
        options as keywords)."""
        import mlx_lm

        model_path = resolve_model(model_path)
        config = {**normalise_config(Path(model_path)), **options.model_config_overrides}
        model, wrapper, *_ = mlx_lm.load(model_path, model_config=config)
        return cls(model, getattr(wrapper, "_tokenizer", wrapper), options)

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        if not self.planned:
            rows = [self.model(mx.array([list(r.token_ids)]))[:, -1, :] for r in requests]
            logits = mx.concatenate(rows, axis=0).astype(mx.float32)
        else:
            logits = self.kv_logits([r.token_ids for r in requests]).astype(mx.float32)
        mx.eval(logits)
        return torch.from_numpy(np.array(logits))

    def _past(self, plan: BatchPlan) -> tuple[list[tuple[mx.array, mx.array]] | None, mx.array]:
        n = len(plan.rows)
        if not plan.groups:
            return None, mx.zeros((n, 0), dtype=mx.bool_)
        whole = plan.reuses_whole_block()
        if whole is not None:
            return whole.kv, whole.mask
        length = plan.past_length
        parts_kv: list[list[tuple[mx.array, mx.array]]] = []
        parts_mask, order = [], []
        for block, dst, src in plan.groups:  # each block's rows, right-aligned to the common length
            index = mx.array(src)
            pad = length - block.length
            kv = []
            for k, v in block.kv:
                k, v = k[index], v[index]
                if pad:
                    k = mx.concatenate([mx.zeros((len(src), k.shape[1], pad, k.shape[3]), k.dtype), k], axis=2)
                    v = mx.concatenate([mx.zeros((len(src), v.shape[1], pad, v.shape[3]), v.dtype), v], axis=2)
                kv.append((k, v))
            mask = block.mask[index]
            if pad:
                mask = mx.concatenate([mx.zeros((len(src), pad), dtype=mx.bool_), mask], axis=1)
            parts_kv.append(kv)
            parts_mask.append(mask)
            order += dst
        missing = [b for b in range(n) if b not in set(order)]
        if missing:  # rows with nothing cached: an all-masked past
            template = plan.groups[0][0].kv
            parts_kv.append(
                [
                    (
                        mx.zeros((len(missing), k.shape[1], length, k.shape[3]), k.dtype),
                        mx.zeros((len(missing), v.shape[1], length, v.shape[3]), v.dtype),
                    )
                    for k, v in template
                ]
            )
            parts_mask.append(mx.zeros((len(missing), length), dtype=mx.bool_))
            order += missing
        inverse = mx.array(np.argsort(np.array(order)))
        kv = [
            (
                mx.concatenate([p[i][0] for p in parts_kv], axis=0)[inverse],
                mx.concatenate([p[i][1] for p in parts_kv], axis=0)[inverse],
            )
            for i in range(len(parts_kv[0]))
        ]
        return kv, mx.concatenate(parts_mask, axis=0)[inverse]

    def forward_new(self, plan: BatchPlan) -> tuple[mx.array, KVBlock]:
        past, past_mask = self._past(plan)
        width = plan.width
        new_mask = mx.array(plan.new_mask)
        valid = mx.concatenate([past_mask, new_mask], axis=1)  # [batch, past + width]
        past_len = valid.shape[1] - width
        causal = mx.arange(width)[:, None] >= mx.arange(width)[None, :]
        allowed = mx.concatenate([mx.ones((width, past_len), dtype=mx.bool_), causal], axis=1)
        mask = allowed[None, None] & valid[:, None, None, :]
        # a pad query sees its own (pad) key: no fully masked row, hence no NaN to spread
        mask = mask | mx.concatenate(
            [mx.zeros((width, past_len), dtype=mx.bool_), mx.eye(width, dtype=mx.bool_)], axis=1
        )
        # RoPE position of column j in row b is offset[b] + j: left pads do not shift real positions
        offset = mx.array(plan.positions[:, -1] - (width - 1))
        layers: list[tuple[mx.array, mx.array] | None] = list(past) if past else [None] * len(self.model.layers)
        caches = [_PlannedCache(layer_kv, offset, mask) for layer_kv in layers]
        hidden = self.model.model(mx.array(plan.input_ids), cache=caches)[:, -1:, :]
        head = self.model.lm_head if hasattr(self.model, "lm_head") else self.model.model.embed_tokens.as_linear
        logits = head(hidden)[:, 0, :]
        block = KVBlock([(c.keys, c.values) for c in caches], valid)
        mx.eval(logits, *[a for kv in block.kv for a in kv], block.mask)
        return logits, block

    def close_backend(self) -> None:
        self.model = None
