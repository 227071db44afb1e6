"""Registers the ``hf`` backend (transformers is imported only when it is used)."""

from genlm_core import Register, hookimpl
from genlm_hf.options import HFOptions


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "hf",
        "genlm_hf.lm:AsyncTransformer.from_options",
        resolve_name="genlm_core.hub:resolve_model",
        options=HFOptions,
        aliases=("transformers",),
        description="Hugging Face transformers, CPU or CUDA; automatic KV reuse, LoRA, bitsandbytes.",
        default_priority=10,  # runs everywhere: the default unless a backend ranks higher here
        install="pip install genlm-hf",
    )
