"""A vLLM V1 logits processor that hands each tagged request's next-token logits back to genlm.

Requests are matched by the tag in ``SamplingParams.extra_args`` (never by row order), so it does
not matter how the scheduler splits, orders or chunks them. A row is kept only while its request
has produced no token yet; with chunked prefill every chunk produces a row and the last one, at the
final prompt position, is the one that stays. Rows land in :data:`CaptureLogits.rows`, which the
engine's owner reads in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

TAG = "genlm_capture"


class CaptureLogits(LogitsProcessor):
    """Copies the logits of tagged requests; changes nothing."""

    rows: ClassVar[dict[str, torch.Tensor]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.slots: dict[int, tuple[str, list[int]]] = {}  # batch index -> (tag, live output token ids)

    def is_argmax_invariant(self) -> bool:
        return False  # else greedy batches skip us and we would see processed logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.slots.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            tag = (params.extra_args or {}).get(TAG) if params is not None else None
            if tag is None:
                self.slots.pop(index, None)
            else:
                self.slots[index] = (tag, output_ids)
        for a, b, direction in batch_update.moved:
            moving_a, moving_b = self.slots.pop(a, None), self.slots.pop(b, None)
            if moving_a is not None:
                self.slots[b] = moving_a
            if direction == MoveDirectionality.SWAP and moving_b is not None:
                self.slots[a] = moving_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.slots:
            with self.lock:
                for index, (tag, output_ids) in self.slots.items():
                    if not output_ids and index < logits.shape[0]:
                        self.rows[tag] = logits[index].detach().to("cpu", torch.float32, copy=True)
        return logits
