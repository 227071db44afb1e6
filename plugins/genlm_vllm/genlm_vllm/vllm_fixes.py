"""Corrections to vLLM applied in every process that runs the model (imported with the processor).

**LoRA beside plain requests on vLLM's CPU build.** Its PyTorch LoRA kernels pick each token's
adapter weights with ``weights[index]``, and a token of a request without an adapter has index -1:
Python indexing then picks the *last* adapter slot. With one slot (``max_loras=1``, the default),
a plain request batched with an adapted one silently got the adapter's output (7.4 nats off here).
The first LoRA step ("shrink") is fixed to give zero for those tokens; every later step multiplies
that zero, so the plain request gets exactly the base model. CUDA's kernels skip index -1 already.

**Pipeline parallelism without a compile warm-up on vLLM's CPU build.** A later pipeline stage copies
its inputs into a buffer that only the warm-up forward pass creates, and the CPU worker skips that
pass when the model is not compiled: with ``enforce_eager=True`` or with LoRA enabled, the first
request failed in ``Worker_PP1`` (``assert self.intermediate_tensors is not None``). The buffer is
now made on first use, as the warm-up would have made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MARK = "_genlm_fixed"


def apply_cpu_fixes() -> bool:
    """Apply every fix here on vLLM's CPU build (idempotent); returns whether they apply here."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    # sgmv_shrink (prefill) calls bgmv_shrink through its module; the CPU wrapper imported it by name
    _replace(skip_requests_without_adapter, (lora_ops, punica_cpu), "bgmv_shrink")
    _replace(make_pipeline_buffer_first, (CPUModelRunner,), "sync_and_gather_intermediate_tensors")
    return True


def _replace(fix: Callable[[Any], Any], owners: tuple[Any, ...], name: str) -> None:
    original = getattr(owners[0], name)
    if getattr(original, MARK, False):
        return
    fixed = fix(original)
    setattr(fixed, MARK, True)
    for owner in owners:
        setattr(owner, name, fixed)


def skip_requests_without_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """The LoRA fix: tokens with adapter index -1 get a zero first step."""

    def bgmv_shrink(
        inputs: torch.Tensor,
        lora_b_weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        scaling: float = 1.0,
    ) -> None:
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        without = lora_indices_tensor < 0
        if bool(without.any()):
            output_tensor[without] = 0

    return bgmv_shrink


def make_pipeline_buffer_first(original: Callable[..., Any]) -> Callable[..., Any]:
    """The pipeline fix: create the buffer between stages where the warm-up would have."""

    def sync_and_gather_intermediate_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, *args, **kwargs)

    return sync_and_gather_intermediate_tensors
