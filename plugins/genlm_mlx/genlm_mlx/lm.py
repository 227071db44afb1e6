"""``AsyncMlxLM``: an mlx-lm model behind the AsyncLM protocol, with automatic KV reuse.

Core's :class:`~genlm_core.kv_reuse.KVReuse` runs the forward step, as for genlm-hf; this module
implements its protocol on MLX: :meth:`AsyncMlxLM.gather_kv` (stored states into a past, by index)
and :meth:`AsyncMlxLM.run_step`. mlx-lm's attention layers ask their cache for RoPE offsets, for the
keys and values, and for the mask; a :class:`_PlannedCache` answers with per-row offsets
(left-padded new tokens keep their real positions), the past and the step's mask, so ragged batches
over different cached prefixes are exact. The LM head runs only at the last position.
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
from genlm_core.kv_reuse import KV, Gather, GatherPart, KVReuse, Step
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


def _take(part: GatherPart) -> KV:
    """``part``'s states, ``[rows, heads, columns, head_dim]`` per layer: one indexing each."""
    rows = mx.array(part.rows)[:, None, None]
    heads = mx.arange(part.block.kv[0][0].shape[1])[None, :, None]
    columns = mx.array(part.columns)[:, None, :]
    return [(k[rows, heads, columns], v[rows, heads, columns]) for k, v in part.block.kv]


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
            return torch.stack([self.forward_uncached(r) for r in requests])
        return self.kv_forward_batch(requests)

    def forward_uncached(self, request: Request) -> torch.Tensor:
        logits = self.model(mx.array([list(request.token_ids)]))[0, -1, :].astype(mx.float32)
        return torch.from_numpy(np.array(logits))

    def gather_kv(self, gather: Gather) -> KV:
        """Follow ``gather`` in every layer: one indexing per part, written into a zero past unless one
        part is all of it."""
        if (whole := gather.whole()) is not None:
            return _take(whole)
        size = gather.length + gather.room
        past = [
            (
                mx.zeros((gather.rows, k.shape[1], size, k.shape[3]), k.dtype),
                mx.zeros((gather.rows, v.shape[1], size, v.shape[3]), v.dtype),
            )
            for k, v in gather.parts[0].block.kv
        ]
        for part in gather.parts:
            into, end = mx.array(part.into), part.at + part.columns.shape[1]
            for (k, v), (gk, gv) in zip(past, _take(part)):
                k[into, :, part.at : end] = gk
                v[into, :, part.at : end] = gv
        return past

    def run_step(self, step: Step) -> tuple[torch.Tensor, KV]:
        """The model on ``step`` through :class:`_PlannedCache` layers; logits at each row's last
        position (this backend does not pack rows)."""
        assert step.outputs == [(b, step.width - 1) for b in range(len(step.input_ids))]
        mask = mx.array(step.attention())[:, None]
        # RoPE position of column j in row b is offset[b] + j: left pads do not shift real positions
        offset = mx.array(step.positions[:, -1] - (step.width - 1))
        length = step.past_length
        past: list[tuple[mx.array, mx.array] | None] = (
            [(k[:, :, :length], v[:, :, :length]) for k, v in step.past]
            if step.past
            else [None] * len(self.model.layers)
        )
        caches = [_PlannedCache(layer_kv, offset, mask) for layer_kv in past]
        hidden = self.model.model(mx.array(step.input_ids), cache=caches)[:, -1:, :]
        head = self.model.lm_head if hasattr(self.model, "lm_head") else self.model.model.embed_tokens.as_linear
        logits = head(hidden)[:, 0, :].astype(mx.float32)
        kv = [(c.keys, c.values) for c in caches]
        mx.eval(logits, *[a for layer in kv for a in layer])
        return torch.from_numpy(np.array(logits)), kv

    def close_backend(self) -> None:
        self.model = None
