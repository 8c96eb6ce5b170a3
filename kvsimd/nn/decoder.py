"""Decoder-only transformers with a KV cache: prefill, step and streaming generation."""
from __future__ import annotations

from typing import Iterator

from kvsimd import _kvsimd
from kvsimd._kvsimd import KVCache
from kvsimd.nn.generate import _generate, _prompts
from kvsimd.nn.model import _Stack

__all__ = ["Decoder"]


class Decoder(_Stack):
    """A decoder-only transformer with a KV cache: prefill, step and streaming generation."""

    def __repr__(self):
        c = self.cfg
        return ("Decoder(%s: %d layers, d_model %d, %d heads / %d KV heads, head_dim %d, %s positions; isa=%s)"
                % (c.family or "custom", c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.position,
                   _kvsimd.active_isa()))

    def prefill(self, tokens, *, cache: KVCache, seq=0, all_logits=False):
        """Process a prompt (or the next chunk of one) for sequence ``seq`` in one causal pass.
        Returns the logits of the last token (``[vocab]``), or of every token when ``all_logits``.
        On any error (or interrupt) the cache is left as it was."""
        self._begin(cache)
        return self._prefill_logits(tokens, cache, seq, None, all_logits)

    def step(self, tokens, *, cache: KVCache):
        """Feed one token per sequence (``len(tokens) == cache.batch``); returns logits ``[batch, vocab]``.
        A step (with the discard a full streaming window makes first) is one transaction: on any
        error or interrupt the cache is left as it was."""
        self._begin(cache)
        return self._step_logits(tokens, cache, None)

    def forward(self, tokens):
        """Logits ``[T, vocab]`` of a full forward pass without any cache (the uncached reference)."""
        self._ensure_valid()
        return self._full(tokens)

    @classmethod
    def from_transformers(cls, model, weights="float32"):
        """Import a loaded Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2,
        GPT-NeoX, GPT-2, BLOOM).  ``weights``: how the matrices are kept: "float32" (arrays, BLAS), or stored as "float16",
        "bfloat16" or "q8_0" (quantized at import; multiplied by kvsimd's kernels)."""
        from kvsimd.loaders.hf import decoder_from_transformers
        return decoder_from_transformers(cls, model, weights)

    @classmethod
    def from_gguf(cls, path, *, mmap=True, activations="int8"):
        """Load a GGUF file of architecture llama, qwen2, qwen3, phi3 or gemma2
        (``kvsimd.loaders.gguf.ARCHITECTURES``), its weights kept as the file stores them (F32, F16,
        BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: multiplied in place by kvsimd's kernels; Q5_0,
        Q5_1, Q2_K, Q3_K dequantized to float32 with a warning).  ``mmap=True``: the weights are
        views of the memory-mapped file (load costs no copy; the file must stay as it is while the
        model lives); ``mmap=False``: a private copy of the stored bytes.  ``activations="int8"``:
        the Q8_0, Q4_0, Q4_1, Q4_K and Q5_K matrices multiply activations rounded to int8 per
        block of 32 (as llama.cpp does; about twice the speed, see :class:`kvsimd.QMatrix`),
        ``"float32"``: every matrix widens its weights and multiplies in float32.  The tokenizer from the file's
        metadata is ``.tokenizer``."""
        from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError
        from kvsimd.loaders.gguf import GGUFError, decoder_kwargs_from_gguf
        from kvsimd.loaders.tokenizer import Tokenizer
        if not isinstance(mmap, bool):
            raise KVSimdTypeError("mmap must be True or False, got %r" % (mmap,))
        if activations not in ("int8", "float32"):
            raise KVSimdValueError("activations must be 'int8' or 'float32', got %r" % (activations,))
        kwargs, reader = decoder_kwargs_from_gguf(path, mmap=mmap, activations=activations)
        try:
            model = cls(**kwargs)
        except GGUFError:
            raise
        except KVSimdError as e:     # a tensor that does not fit the file's own metadata
            raise GGUFError("%s: %s" % (path, e)) from None
        model.tokenizer = Tokenizer.from_gguf(reader)
        model.source = str(path)
        return model

    def generate(self, prompt, *, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                 stop_tokens=(), cache_dtype="float16", capacity=None, n_keep=0, policy="fixed",
                 n_discard=None, lookup=None, cache_recent=0) -> Iterator:
        """Stream generated tokens.  ``prompt``: a list of ids (yields ints) or a list of lists
        (a batch: yields, per step, one id per sequence, ``None`` once a sequence has stopped).

        Every argument is checked here, before anything runs (a bad one raises a
        :class:`kvsimd.KVSimdError` subclass); the prompts are prefilled at the first ``next()``.
        ``temperature`` 0 is greedy, else sampling seeded by ``seed`` (None or an int >= 0) with
        ``top_k`` (0: off) and ``top_p`` (1: off, else in (0, 1]).  At most ``max_new_tokens``
        (>= 0) tokens per sequence.

        Stop tokens are **not yielded**: a token of ``stop_tokens`` ends its sequence's stream (a
        single prompt's generator returns; in a batch the sequence yields ``None`` from that step
        on, and the generator returns once every sequence has stopped).

        ``capacity`` (default: longest prompt + ``max_new_tokens``), ``n_keep``, ``policy``,
        ``n_discard`` and ``cache_dtype`` are those of :meth:`new_cache`, ``cache_recent`` its
        ``recent`` (a quantized cache also keeps its last tokens' float16 rows).  With ``policy="fixed"``,
        a sequence whose cache fills before ``max_new_tokens`` makes the generator raise
        :class:`kvsimd.KVSimdCapacityError` (naming the sequence and the capacity) at the
        ``next()`` after its last token; the tokens already yielded stay yielded.  The other
        policies never fill (see :meth:`new_cache`).

        ``lookup=n`` (n >= 1; None or 0: off) is prompt-lookup decoding, for a single prompt and
        greedy decoding only: each pass drafts up to ``n`` tokens by matching the last 3..1 tokens
        against the prompt and earlier output, verifies them in one multi-token pass and keeps
        those the model would have chosen (the others are truncated from the cache).  The tokens
        are plain greedy decoding's (up to float rounding: rows of one pass and single steps
        round their sums differently, which can flip a near tie); faster where text repeats.
        Once a streaming window is full (or the cache is) tokens go one step at a time."""
        self._ensure_valid()
        prompts, batched = _prompts(prompt, self.cfg.vocab_size, "prompt")
        return _generate(self, prompts, batched, None, max_new_tokens, temperature, top_k, top_p, seed,
                         stop_tokens, cache_dtype, capacity,
                         dict(n_keep=n_keep, policy=policy, n_discard=n_discard, recent=cache_recent),
                         lookup)
