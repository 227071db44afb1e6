"""Registers the ``example`` backend with genlm (found through the ``genlm`` entry-point group)."""

from genlm_core import Register, hookimpl
from genlm_example.options import BigramOptions


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "example",
        "genlm_example.lm:BigramLM.from_options",  # imported only when someone loads the backend
        options=BigramOptions,
        resolve_name="genlm_core.hub:resolve_tokenizer",  # the model name is a tokenizer: an unknown one fails at once
        description="Template plugin: an add-k smoothed bigram LM counted from a text, over a real tokenizer.",
        default_priority=0,  # picked by load_model_by_name(name) only when no installed backend ranks higher
        install="pip install genlm-example",  # shown when it is installed but cannot import what it needs
    )
