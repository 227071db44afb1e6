"""``LlamaCppLM``: a GGUF model in llama.cpp behind the AsyncLM protocol.

A request flows: core's batcher → :meth:`LlamaCppLM.forward_batch` →
:class:`~genlm_core.live.LiveSequences` (core: which live sequence each request continues, forks or
copies) → :class:`~genlm_llamacpp.sequences.LlamaSequences` → :class:`~genlm_llamacpp.engine.LlamaEngine`
(one ``llama_decode`` of every new token) → one logits row per request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm_core import AsyncLM, Request, RowsOut, Tokenizer
from genlm_core.live import LiveSequences
from genlm_llamacpp.engine import EngineConfig, LlamaEngine
from genlm_llamacpp.files import gguf_tokenizer, resolve_gguf
from genlm_llamacpp.options import LlamaCppOptions
from genlm_llamacpp.sequences import LlamaSequences

log = logging.getLogger(__name__)


def engine_config(options: LlamaCppOptions) -> EngineConfig:
    """The llama.cpp context that ``options`` ask for (defaults decided from the model on load)."""
    return EngineConfig(
        n_seq_max=options.n_seq_max,
        n_ctx=options.n_ctx,
        n_batch=options.n_batch,
        n_ubatch=options.n_ubatch,
        n_threads=options.n_threads,
        n_threads_batch=options.n_threads_batch,
        cache_type=options.cache_type,
        flash_attn=options.flash_attn,
        n_gpu_layers=options.n_gpu_layers,
        use_mmap=options.use_mmap,
        repack_weights=options.repack_weights,
    )


class LlamaCppLM(AsyncLM):
    """A GGUF model run by llama.cpp: exact batched next-token logprobs, with each particle's
    context kept alive as a llama.cpp sequence between requests.

    Build with :meth:`from_name` (or ``load_model_by_name(path, backend="llamacpp")``), or wrap a
    :class:`~genlm_llamacpp.engine.LlamaEngine` and its tokenizer.
    """

    Options = LlamaCppOptions
    options: LlamaCppOptions

    def __init__(
        self, engine: LlamaEngine, tokenizer: Tokenizer, options: LlamaCppOptions | None = None, **kwargs: Any
    ):
        super().__init__(tokenizer, options, **kwargs)
        o = self.options
        if o.n_seq_max != engine.config.n_seq_max:
            raise ValueError(f"options.n_seq_max={o.n_seq_max} but the engine has {engine.config.n_seq_max} sequences")
        self.engine = engine
        self.check_vocabulary()
        self.context_limit = engine.n_ctx
        #: This context's sequence ids, and the particles alive in them (core's live sequences).
        self.sequence_ids = LlamaSequences(engine)
        self.sequences: LiveSequences[int, np.ndarray] = LiveSequences(self.sequence_ids, o.live)

    def check_vocabulary(self) -> None:
        """Raise ValueError unless the tokenizer's bytes are llama.cpp's, token by token."""
        if self.vocab_size > self.engine.n_vocab:
            raise ValueError(
                f"the tokenizer has {self.vocab_size} tokens and the GGUF model {self.engine.n_vocab}: "
                "not the same vocabulary"
            )
        pieces = self.engine.token_bytes()
        wrong = [i for i, token in enumerate(self.byte_vocab) if token.byte_string != pieces[i]]
        if wrong:
            shown = ", ".join(f"{i}: {self.byte_vocab[i].byte_string!r} vs {pieces[i]!r}" for i in wrong[:3])
            raise ValueError(
                f"{len(wrong)} tokens of the tokenizer decode to other bytes than in llama.cpp ({shown}); "
                "pass tokenizer= a Hugging Face tokenizer of this model"
            )

    @classmethod
    def from_options(cls, model_name: str, options: Any, /) -> LlamaCppLM:
        """Load the GGUF file ``model_name`` names (see :func:`~genlm_llamacpp.files.resolve_gguf`)."""
        path = resolve_gguf(model_name)
        if options.tokenizer is not None:
            from transformers import AutoTokenizer

            from genlm_core.hub import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(options.tokenizer))
        else:
            tokenizer = gguf_tokenizer(path)
        engine = LlamaEngine(path, engine_config(options))
        try:
            lm = cls(engine, tokenizer, options)
        except BaseException:
            engine.close()
            raise
        c = engine.config
        log.info(
            "llama.cpp: %s (%s), n_ctx=%d, %d sequences, %s cache, flash attention %s, %d threads",
            engine.describe(),
            path,
            engine.n_ctx,
            c.n_seq_max,
            c.cache_type,
            {None: "auto", True: "on", False: "off"}[c.flash_attn],
            c.n_threads,
        )
        return lm

    # ---- the backend ---------------------------------------------------------------------------

    def forward_batch(self, requests: Sequence[Request]) -> RowsOut:
        return self.sequences.run(requests).rows()

    def forward_uncached(self, request: Request) -> torch.Tensor:
        return torch.from_numpy(self.sequences.uncached(request))

    def clear_backend_cache(self) -> None:
        self.sequences.release_all()
        self.sequence_ids.clear()

    def close_backend(self) -> None:
        self.engine.close()
