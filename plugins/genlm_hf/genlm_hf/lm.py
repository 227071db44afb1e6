"""``AsyncTransformer``: a transformers causal LM behind the AsyncLM protocol, with automatic KV reuse.

Core's :class:`~genlm_core.kv_reuse.KVReuse` runs the forward step (which states to reuse, the
layout, the gather index, the masks, what to store, LoRA adapters grouped); this module implements
its protocol on torch: :meth:`AsyncTransformer.gather_kv` (stored states into a past, by index, with
room for the new tokens) and :meth:`AsyncTransformer.run_step` (the model over a past held in a
``DynamicCache``, new states written into its room, the head only where logits are wanted). Every
transformers internal it uses is in :mod:`genlm_hf.transformers_api`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from genlm_core import AsyncLM, LoRASelection, Request, Tokenizer
from genlm_core.hub import resolve_model
from genlm_core.kv_reuse import KV, Gather, GatherPart, KVReuse, Step
from genlm_hf import transformers_api
from genlm_hf.options import HFOptions

log = logging.getLogger(__name__)

_RECURRENT_MODEL_TYPES = {
    "mamba",
    "mamba2",
    "falcon_mamba",
    "rwkv",
    "jamba",
    "zamba",
    "zamba2",
    "bamba",
    "recurrent_gemma",
}


def kv_reuse_problem(model: Any) -> str | None:
    """Why this model's KV cache cannot be extended from stored states (None if it can)."""
    config = transformers_api.text_config(model)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if getattr(config, "model_type", "") in _RECURRENT_MODEL_TYPES:
        return f"recurrent/state-space model ({config.model_type})"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layers other than full attention: {sorted(set(layer_types))}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention ({config.sliding_window})"
    return None


def position_limit(model: Any) -> int | None:
    """The most positions a model with learned absolute position embeddings (GPT-2's ``wpe``, OPT's
    ``embed_positions``) can take; None for relative schemes (RoPE, ALiBi), which have no hard limit."""
    config = transformers_api.text_config(model)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if limit is None:
        return None
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and (leaf == "wpe" or "position" in leaf):
            return int(limit)
    return None


class Room:
    """One layer's past in buffers (``[rows, heads, capacity, head_dim]``) with free positions after
    ``length``, for ``decode_room``: the next plain step of the same rows writes its new states there in
    place instead of copying the past. It travels on the views of the buffers that a step returns
    (their attribute :attr:`ATTRIBUTE`), so it goes wherever the stored block goes; a second step that
    extends the same stored block finds ``length`` moved on, and copies instead of writing over the
    first one's states."""

    __slots__ = ("keys", "length", "values")
    ATTRIBUTE = "_genlm_room"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        self.keys, self.values, self.length = keys, values, length

    def free_at(self, past: torch.Tensor, start: int, end: int) -> bool:
        """Whether ``past`` (a view of these buffers) ends where they are filled, at ``start``, and
        positions up to ``end`` are free."""
        return self.length == start and self.keys.shape[-2] >= end and past.data_ptr() == self.keys.data_ptr()

    @classmethod
    def keep(cls, rooms: list[Room], kv: KV, end: int) -> None:
        """After a step wrote into ``rooms``: each is filled up to ``end``, and rides on the step's
        states (``kv``, views of its buffers) for the next step."""
        for room, (k, _) in zip(rooms, kv):
            if k.data_ptr() == room.keys.data_ptr() and k.shape[-2] == end:
                room.length = end
                setattr(k, cls.ATTRIBUTE, room)


class AsyncTransformer(KVReuse, LoRASelection, AsyncLM):
    """A Hugging Face causal LM: batched, exact next-token logprobs with automatic KV reuse.

    Build with :meth:`from_name` (or ``load_model_by_name(name, backend="hf")``); or wrap a loaded
    ``model`` and ``tokenizer`` directly.
    """

    Options = HFOptions
    options: HFOptions

    def __init__(self, model: Any, tokenizer: Tokenizer, options: HFOptions | None = None, **kwargs: Any):
        super().__init__(tokenizer, options, **kwargs)
        o = self.options
        self.model = model.eval()
        self.device = model.get_input_embeddings().weight.device
        self.context_limit = position_limit(model)
        problem = kv_reuse_problem(model)
        if problem and o.reuse_kv:
            log.warning(
                "%s: KV reuse disabled (%s); every request is computed from scratch", type(model).__name__, problem
            )
        self.init_kv_reuse(o, o.reuse_kv and problem is None)
        # packed rows need arbitrary 4-D masks, which the sdpa and eager attentions take (flash does not)
        attention = transformers_api.attention_implementation(model)
        self.packs_shared_tokens = self.reuse_kv and attention in ("sdpa", "eager")
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        for name, path in o.lora.items():
            self.load_lora(path, name)
        if o.active_lora is not None:
            self.set_lora(None, o.active_lora)

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_name(  # type: ignore[override]  # the seed's signature: model_id may be given by keyword
        cls,
        model_id: str,
        bitsandbytes_opts: dict[str, Any] | None = None,
        hf_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncTransformer:
        """Load ``model_id`` (a local folder or a hub name) with :class:`HFOptions` given as keywords.

        ``bitsandbytes_opts`` (a ``BitsAndBytesConfig``'s arguments) and ``hf_opts`` (more
        ``from_pretrained`` arguments) are accepted as the seed library took them.
        """
        hf = dict(hf_opts or {})
        if bitsandbytes_opts:
            hf["quantization_config"] = transformers_api.bitsandbytes_config(**bitsandbytes_opts)
        return cls.from_options(model_id, HFOptions(**kwargs, hf_opts=hf))

    @classmethod
    def from_options(cls, model_id: str, options: HFOptions) -> AsyncTransformer:
        """The registry factory: load ``model_id`` with validated options (a local folder, ``smollm2``,
        or a hub id; see :func:`genlm_core.hub.resolve_model`)."""
        model_id = resolve_model(model_id)
        tokenizer = transformers_api.load_tokenizer(model_id, trust_remote_code=options.trust_remote_code)
        model: Any = transformers_api.load_causal_lm(model_id, **load_kwargs(options))
        if options.device_map is None and not (options.load_in_8bit or options.load_in_4bit):
            model = model.to(resolve_device(options.device))
        return cls(model, tokenizer, options)

    # ---- the backend step ---------------------------------------------------------------------

    def forward_batch(self, requests: Sequence[Request]) -> torch.Tensor:
        # inference mode: less per-op bookkeeping; its tensors stay inside (KV blocks), and the
        # logits leave as an ordinary tensor, so callers may modify what they get.
        with torch.inference_mode():
            return self.kv_forward_batch(requests)

    def gather_kv(self, gather: Gather) -> KV:
        """Follow ``gather`` in every layer. One part that writes the whole past: when each row's past is
        its block row's first positions (an SMC step's, resampled or deduplicated), one ``index_select``
        of rows per layer into a past allocated with room; else one indexing, which is the past itself.
        Several parts: into a past allocated once (a one-row part straight into place). With
        ``decode_room``, the past has that much more room (its next steps write there in place)."""
        whole, spare = gather.whole(), self.options.decode_room
        prefix = whole is not None and leading_columns(whole.columns, gather.length)
        if whole is not None and not prefix and not spare:
            return self._take(whole)
        size = gather.length + gather.room + spare
        new = torch.Tensor.new_empty if gather.complete else torch.Tensor.new_zeros
        past = [
            (new(k, (gather.rows, k.shape[1], size, k.shape[3])), new(v, (gather.rows, v.shape[1], size, v.shape[3])))
            for k, v in gather.parts[0].block.kv
        ]
        if whole is not None and prefix:  # the room is written by the step before it is read
            rows, length = self._tensor(whole.rows), gather.length
            for (k, v), (sk, sv) in zip(past, whole.block.kv):
                torch.index_select(sk[:, :, :length], 0, rows, out=k[:, :, :length])
                torch.index_select(sv[:, :, :length], 0, rows, out=v[:, :, :length])
            return past
        for part in gather.parts:
            end = part.at + part.columns.shape[1]
            if len(part.rows) == 1:
                columns, row, into = self._tensor(part.columns[0]), int(part.rows[0]), int(part.into[0])
                for (k, v), (sk, sv) in zip(past, part.block.kv):
                    torch.index_select(sk[row], 1, columns, out=k[into, :, part.at : end])
                    torch.index_select(sv[row], 1, columns, out=v[into, :, part.at : end])
            else:
                into_rows = self._tensor(part.into)
                for (k, v), (gk, gv) in zip(past, self._take(part)):
                    k[:, :, part.at : end].index_copy_(0, into_rows, gk)
                    v[:, :, part.at : end].index_copy_(0, into_rows, gv)
        return past

    def _take(self, part: GatherPart) -> KV:
        """``part``'s states, ``[rows, heads, columns, head_dim]`` per layer: one indexing each."""
        rows = self._tensor(part.rows)[:, None, None]
        heads = torch.arange(part.block.kv[0][0].shape[1], device=self.device)[None, :, None]
        at = self._tensor(part.columns)[:, None, :]
        return [(k[rows, heads, at], v[rows, heads, at]) for k, v in part.block.kv]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def run_step(self, step: Step) -> tuple[torch.Tensor, KV]:
        """The model on ``step``: a 2-D mask (causal steps) or the 4-D one of ``step.sees``, explicit
        positions, the past as a DynamicCache (new states written into its room when it has some);
        the head only where logits are wanted. A plain step (:meth:`Step.plain`: an SMC step, every
        row one token after a past of the same length) passes what HF's own decode passes, no mask and
        no positions (the model's defaults are the same), and takes the last-position logits as they
        are; with ``decode_room``, its past is kept in buffers with room (:class:`Room`)."""
        past, length, plain = step.past, step.past_length if step.room else None, step.plain()
        rooms = self._rooms(step) if self.options.decode_room and past is not None and plain else None
        if rooms is not None:
            past, length = [(r.keys, r.values) for r in rooms], step.past_length
        inputs: dict[str, Any] = {
            "input_ids": self._tensor(step.input_ids),
            "past_key_values": transformers_api.kv_cache(past, length),
            "use_cache": True,
        }
        if not plain:
            mask = self._tensor(step.keys).long() if step.sees is None else self._tensor(step.sees)[:, None]
            inputs.update(attention_mask=mask, position_ids=self._tensor(step.positions))
        columns = [c for _, c in step.outputs]
        if step.outputs_last_in_order():
            out = self.model(**inputs, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        elif all(c == step.width - 1 for c in columns):
            out = self.model(**inputs, logits_to_keep=1)
            logits = out.logits[self._rows(step), -1, :]
        elif self.plain_head:  # the head on the wanted positions only
            causal_lm = self._causal_lm()
            out = causal_lm.base_model(**inputs)
            head = causal_lm.get_output_embeddings()
            logits = head(out.last_hidden_state[self._rows(step), torch.tensor(columns, device=self.device)])
        else:
            kept = sorted(set(columns))
            out = self.model(**inputs, logits_to_keep=torch.tensor(kept, device=self.device))
            at = torch.tensor([kept.index(c) for c in columns], device=self.device)
            logits = out.logits[self._rows(step), at, :]
        kv = transformers_api.cache_states(out.past_key_values)
        if rooms is not None:
            Room.keep(rooms, kv, step.past_length + step.width)
        return logits, kv

    def _rows(self, step: Step) -> torch.Tensor:
        return torch.tensor([b for b, _ in step.outputs], device=self.device)

    def _rooms(self, step: Step) -> list[Room]:
        """Buffers with room for a plain step's new tokens, per layer: the past's own, where this step
        is the first to extend it (the stored block's :class:`Room`, or a past gathered for this step
        with room); else new ones with ``decode_room`` positions of room after the step, the past copied
        in (what HF's concatenation would copy anyway)."""
        assert step.past is not None
        start, end = step.past_length, step.past_length + step.width
        found = [getattr(k, Room.ATTRIBUTE, None) for k, _ in step.past]
        if all(r is not None and r.free_at(k, start, end) for r, (k, _) in zip(found, step.past)):
            return found  # type: ignore[return-value]  # none is None
        if step.room and step.past[0][0].shape[-2] >= end:  # gathered for this step: its room is ours
            return [Room(k, v, start) for k, v in step.past]
        rooms = []
        spare = self.options.decode_room
        for k, v in step.past:
            keys = k.new_empty((*k.shape[:2], end + spare, k.shape[3]))
            values = v.new_empty((*v.shape[:2], end + spare, v.shape[3]))
            keys[:, :, :start] = k[:, :, :start]
            values[:, :, :start] = v[:, :, :start]
            rooms.append(Room(keys, values, start))
        return rooms

    def _causal_lm(self) -> Any:
        """The transformers model, under a peft wrapper if LoRA adapters are loaded (peft changes its
        layers in place, so its body and head run the active adapter)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @functools.cached_property
    def plain_head(self) -> bool:
        """Whether the head may run on wanted positions only (:meth:`_has_plain_head`), checked on the
        first packed batch that wants positions other than the last, not at load."""
        return self._has_plain_head()

    def _has_plain_head(self) -> bool:
        """Whether the model's logits are its output embedding applied to its base model's last hidden
        state (true of most causal LMs; not of those that scale or cap logits), checked on 3 tokens.
        Packed batches then run the head on the positions whose rows are wanted, not on every column."""
        causal_lm = self._causal_lm()
        head, base = causal_lm.get_output_embeddings(), getattr(causal_lm, "base_model", None)
        if head is None or base is None or base is causal_lm:
            return False
        ids = torch.tensor([[0, 1, 2]], device=self.device)
        with torch.inference_mode():
            whole = self.model(input_ids=ids).logits
            split = head(base(input_ids=ids).last_hidden_state)
        return whole.shape == split.shape and bool(torch.equal(whole, split))

    @torch.no_grad()
    def forward_uncached(self, request: Request) -> torch.Tensor:
        with self.adapter_context(request.adapter):
            ids = torch.tensor([request.token_ids], device=self.device)
            return self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]

    def cache_kv(self, prompt_tokens: Sequence[int]) -> None:
        """Run ``prompt_tokens`` now so that later requests extending it start from its KV states."""
        request = self.request(prompt_tokens)
        if self.cache.get(request) is None:
            self.compute_rows([request])

    def close_backend(self) -> None:
        self.model = None

    # ---- LoRA ---------------------------------------------------------------------------------

    def load_lora(self, path: str, name: str = "lora_1") -> None:
        """Load a peft LoRA adapter from ``path`` under ``name`` (it does not become active)."""
        self.ensure_open()
        try:
            from peft import PeftModel
        except ImportError:
            raise ImportError("LoRA needs peft: `pip install 'genlm-hf[lora]'`") from None
        with self.model_lock:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            self.adapters[name] = path

    def unload_lora(self, name: str) -> None:
        self.model.delete_adapter(name)

    @contextlib.contextmanager
    def adapter_context(self, adapter: str | None) -> Iterator[None]:
        """Run ``adapter`` (None: the base model) within the block."""
        if not self.adapters:
            yield
        elif adapter is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(adapter)
            yield


def leading_columns(columns: np.ndarray, length: int) -> bool:
    """Whether every row of ``columns`` (a gather index, ``[rows, >= length]``) starts with the
    positions ``0 .. length - 1`` in order: the rows' pasts are their block rows' first positions."""
    return length > 0 and bool((columns[:, :length] == np.arange(length)).all())


def resolve_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_kwargs(options: HFOptions) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for the options."""
    kwargs: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    device = resolve_device(options.device)
    if options.dtype == "auto":
        kwargs["dtype"] = torch.float32 if device.type == "cpu" and options.device_map is None else "auto"
    else:
        kwargs["dtype"] = getattr(torch, options.dtype)
    if options.device_map is not None:
        kwargs["device_map"] = options.device_map
    if options.load_in_8bit or options.load_in_4bit:
        compute = options.bnb_4bit_compute_dtype
        kwargs["quantization_config"] = transformers_api.bitsandbytes_config(
            load_in_8bit=options.load_in_8bit,
            load_in_4bit=options.load_in_4bit,
            bnb_4bit_quant_type=options.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=getattr(torch, compute) if compute else None,
        )
        kwargs.setdefault("device_map", {"": str(device)})
    kwargs.update(options.hf_opts)
    return kwargs
