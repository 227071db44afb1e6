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

from typing import Any

import torch

MARK = "_genlm_fixed"


def apply_cpu_fixes() -> None:
    """Apply every fix here that applies to this platform (idempotent)."""
    fix_cpu_lora_without_adapter()
    fix_cpu_pipeline_buffers()


def fix_cpu_pipeline_buffers() -> bool:
    """Apply the pipeline-buffer fix on vLLM's CPU build; returns whether it is in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(original, MARK, False):
        return True

    def sync_and_gather_intermediate_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, *args, **kwargs)

    setattr(sync_and_gather_intermediate_tensors, MARK, True)
    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors  # type: ignore[method-assign]
    return True


def fix_cpu_lora_without_adapter() -> bool:
    """Apply the LoRA fix on vLLM's CPU build; returns whether it is in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    original = lora_ops.bgmv_shrink
    if getattr(original, MARK, False):
        return True

    def bgmv_shrink(
        inputs: torch.Tensor,
        lora_b_weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        scaling: float = 1.0,
    ) -> Any:
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        without = lora_indices_tensor < 0
        if bool(without.any()):
            output_tensor[without] = 0

    setattr(bgmv_shrink, MARK, True)
    lora_ops.bgmv_shrink = bgmv_shrink  # sgmv_shrink (prefill) calls it through the module
    punica_cpu.bgmv_shrink = bgmv_shrink  # the CPU wrapper imported it by name
    return True
