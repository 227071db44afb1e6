"""Corrections to vLLM applied in every process that runs the model: each capture processor calls
:func:`apply_cpu_fixes` when vLLM's model runner builds it, before the engine's first forward pass in
that process (importing this module changes nothing).

Each is applied only where a probe of its bug finds it (:func:`apply_cpu_fixes`), so a vLLM release
that fixes one stops being patched without a change here.

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

from genlm_vllm.vllm_api import worker

MARK = "_genlm_fixed"


def apply_cpu_fixes() -> list[str]:
    """Apply each fix here that this vLLM still needs (idempotent): on its CPU build, where a probe of
    the bug finds it. Returns the names of the fixes in place."""
    targets = worker.cpu_fix_targets()
    if targets is None:
        return []
    applied = []
    # sgmv_shrink (prefill) calls bgmv_shrink through its module; the CPU wrapper imported it by name
    owners = (targets["lora_ops"], targets["punica_cpu"])
    if _fixed(owners[0].bgmv_shrink) or lora_kernel_leaks(owners[0].bgmv_shrink):
        _replace(skip_requests_without_adapter, owners, "bgmv_shrink")
        applied.append("lora")
    runner = targets["cpu_runner"]
    if _fixed(runner.sync_and_gather_intermediate_tensors) or needs_pipeline_buffer(
        runner.sync_and_gather_intermediate_tensors
    ):
        _replace(make_pipeline_buffer_first, (runner,), "sync_and_gather_intermediate_tensors")
        applied.append("pipeline")
    return applied


def _fixed(function: Any) -> bool:
    return bool(getattr(function, MARK, False))


def lora_kernel_leaks(bgmv_shrink: Callable[..., Any]) -> bool:
    """Whether the CPU LoRA kernel gives a token without an adapter (index -1) an adapter's output."""
    inputs = torch.ones(1, 2)
    weights = torch.ones(1, 1, 2, 2)  # one adapter slot
    out = torch.zeros(1, 2)
    bgmv_shrink(inputs, weights, out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() > 0)


def needs_pipeline_buffer(sync_and_gather: Callable[..., Any]) -> bool:
    """Whether a later pipeline stage still fails when the warm-up did not create its input buffer."""
    from types import SimpleNamespace

    try:
        sync_and_gather(SimpleNamespace(intermediate_tensors=None), 1, None, False)
    except AssertionError:
        return True
    except Exception:  # it went further than the missing buffer: vLLM handles it now
        return False
    return False


def _replace(fix: Callable[[Any], Any], owners: tuple[Any, ...], name: str) -> None:
    original = getattr(owners[0], name)
    if _fixed(original):
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
