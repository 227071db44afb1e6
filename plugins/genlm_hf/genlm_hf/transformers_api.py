"""Every transformers internal genlm-hf relies on, in one module (the rest of genlm-hf goes through it).

Public transformers (``AutoModelForCausalLM``, ``AutoTokenizer``, ``BitsAndBytesConfig``) is loaded here
too, so that no other module of genlm-hf imports transformers. What is not public API — the cache's
constructor and layers, a cache-layer subclass, the config's attention implementation, the forward
pass's ``logits_to_keep`` — is declared in :data:`INTERFACES`, and :mod:`genlm_hf.tools.contract` checks each
declaration against a release's own sources (the installed one, and the newest of :data:`TESTED`).
Nothing here imports transformers before it is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

#: The transformers releases genlm-hf is tested with (genlm-core's one range).
TESTED = ">=5.16.1,<5.20"


@dataclass(frozen=True)
class Interface:
    """One transformers internal we use: ``qualname`` in source file ``path`` (under ``transformers/``)
    exists; a call passes ``params`` by name (an override takes them first, in this order) and needs no
    other; its instances carry ``attributes``."""

    path: str
    qualname: str
    why: str
    params: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    #: ``params`` are the leading parameters of a method we override (in order), not keywords we pass
    overridden: bool = False


#: What :func:`kv_cache`, :func:`cache_states`, :func:`layer_with_room`, :func:`attention_implementation`,
#: :func:`text_config` and the forward pass rely on.
INTERFACES: tuple[Interface, ...] = (
    Interface("__init__.py", "DynamicCache", "kv_cache: the past given to the model"),
    Interface(
        "cache_utils.py",
        "DynamicCache",
        "kv_cache, cache_states: the layers replaced and read",
        attributes=("layers",),
    ),
    Interface(
        "cache_utils.py",
        "DynamicLayer",
        "layer_with_room and kv_cache: the states a layer holds, set directly",
        attributes=("keys", "values", "dtype", "device", "is_initialized"),
    ),
    Interface(
        "cache_utils.py",
        "DynamicLayer.__init__",
        "kv_cache and layer_with_room: a layer made with no argument, its states set directly",
    ),
    Interface(
        "cache_utils.py",
        "DynamicLayer.update",
        "layer_with_room overrides update(key_states, value_states, ...)",
        params=("key_states", "value_states"),
        overridden=True,
    ),
    Interface(
        "configuration_utils.py",
        "PreTrainedConfig._attn_implementation",
        "attention_implementation: packed rows need sdpa or eager attention",
    ),
    Interface(
        "configuration_utils.py", "PreTrainedConfig.get_text_config", "text_config: a multimodal model's text part"
    ),
    *(
        Interface(
            path,
            f"{cls}.forward",
            "the forward step: a past, explicit positions and masks, logits only where wanted",
            params=("input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep"),
        )
        for path, cls in (
            ("models/llama/modeling_llama.py", "LlamaForCausalLM"),
            ("models/gpt2/modeling_gpt2.py", "GPT2LMHeadModel"),
        )
    ),
    Interface("models/llama/modeling_llama.py", "LlamaForCausalLM.base_model", "the head on wanted positions only"),
    Interface("models/llama/modeling_llama.py", "LlamaForCausalLM.get_output_embeddings", "the head itself"),
    Interface("models/llama/modeling_llama.py", "LlamaForCausalLM.get_input_embeddings", "the model's device"),
    Interface(
        "modeling_outputs.py",
        "CausalLMOutputWithPast",
        "logits and the new states",
        attributes=("logits", "past_key_values"),
    ),
    Interface(
        "modeling_outputs.py",
        "BaseModelOutputWithPast",
        "the base model's last hidden state, for the head",
        attributes=("last_hidden_state", "past_key_values"),
    ),
)

KV = list[tuple[torch.Tensor, torch.Tensor]]


def text_config(model: Any) -> Any:
    """The config of ``model``'s text part (a multimodal model's decoder), or its config."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_implementation(model: Any) -> str | None:
    """The attention ``model`` runs (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ...), or None."""
    return getattr(model.config, "_attn_implementation", None)


def load_causal_lm(model_id: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(model_id, **kwargs)``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_id, **kwargs)


def load_tokenizer(model_id: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(model_id, **kwargs)``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_id, **kwargs)


def bitsandbytes_config(**kwargs: Any) -> Any:
    """``BitsAndBytesConfig(**kwargs)``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**kwargs)


def kv_cache(kv: KV | None, length: int | None = None) -> Any:
    """A ``DynamicCache`` holding ``kv`` (per layer ``(keys, values)``) without copying it. With
    ``length``, ``kv`` holds the past in its first ``length`` positions and has room after them for the
    new tokens, which are written there in place; else the model's update concatenates (a copy of the
    past, never a write into it)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    if kv is None:
        return cache
    if length is not None:
        cache.layers = [layer_with_room()(k, v, length) for k, v in kv]
        return cache
    # full-attention layers (the only kind KV reuse runs on), filled as they are
    cache.layers = [filled(DynamicLayer(), k, v) for k, v in kv]
    return cache


def filled(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """``layer`` (a transformers cache layer made with no argument) holding ``keys`` and ``values`` as they
    are: its states set directly, no copy."""
    layer.keys, layer.values, layer.dtype, layer.device = keys, values, keys.dtype, keys.device
    layer.is_initialized = True
    return layer


def cache_states(cache: Any) -> KV:
    """Every layer's ``(keys, values)`` of a cache the model returned (``out.past_key_values``)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


@functools.cache
def layer_with_room() -> type:
    """A transformers cache layer over a past allocated with room for the new tokens (defined on first
    use, so that importing genlm_hf does not import transformers)."""
    from transformers.cache_utils import DynamicLayer

    class LayerWithRoom(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
            super().__init__()
            self.room: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)
            self.length = length  # positions of the room holding states
            filled(self, keys[:, :, :length], values[:, :, :length])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            start, end = self.length, self.length + key_states.shape[-2]
            if self.room is None or end > self.room[0].shape[-2]:  # no room left: concatenate from now on
                self.room = None
                return super().update(key_states, value_states, *args, **kwargs)
            keys, values = self.room
            keys[:, :, start:end] = key_states
            values[:, :, start:end] = value_states
            self.length = end
            self.keys, self.values = keys[:, :, :end], values[:, :, :end]
            return self.keys, self.values

    return LayerWithRoom
