"""Registers the ``llamacpp`` backend (llama-cpp-python is imported only when it is used)."""

from genlm_core import Register, hookimpl
from genlm_llamacpp.options import LlamaCppOptions

INSTALL = "pip install genlm-llamacpp (builds llama-cpp-python from source: a C++ compiler and CMake, a few minutes)"


def unavailable_reason() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return f"the llama_cpp module is not installed: {INSTALL}"
    return None


def here() -> str:
    """What llama.cpp was built with on this machine (the ``genlm backends`` line)."""
    import re
    from importlib.metadata import version

    from genlm_llamacpp.engine import available_cpus, bindings

    lib = bindings()
    features = re.findall(r"(\w+) = 1", lib.llama_print_system_info().decode())
    gpu = "GPU offload (n_gpu_layers)" if lib.llama_supports_gpu_offload() else "no GPU offload"
    return (
        f"llama-cpp-python {version('llama-cpp-python')} on {available_cpus()} CPU(s), "
        f"{', '.join(dict.fromkeys(features)) or 'no SIMD'}; {gpu}"
    )


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "llamacpp",
        "genlm_llamacpp.lm:LlamaCppLM.from_options",
        resolve_name="genlm_llamacpp.files:resolve_gguf",
        options=LlamaCppOptions,
        aliases=("llama.cpp", "gguf"),
        description="llama.cpp on any CPU (or its GPU builds): GGUF models, quantized or not; "
        "particles live in llama.cpp sequences, forks by sequence copy.",
        check=unavailable_reason,
        details="genlm_llamacpp.plugin:here",
        default_priority=0,  # the default only when no other backend ranks higher
        install=INSTALL,
    )
