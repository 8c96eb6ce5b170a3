"""Encoder-decoder transformers (BART, Marian): the encoder runs once per request, its output is
projected to cross-attention K/V once per layer (CrossAttentionCache), then reused by every step."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from kvsimd import _kvsimd
from kvsimd import threads as _threads
from kvsimd._kvsimd import CrossAttentionCache, KVCache
from kvsimd.errors import KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import F32, ModelConfig, check_config
from kvsimd.nn.generate import _generate, _prompts, _short, _tokens_1d
from kvsimd.nn.model import _Stack, _rope_spec
from kvsimd.observe import notify
from kvsimd.nn.weights import (LayerWeights, NormWeights, _f32, _norm, alibi_slopes, check_layer, embed_rows, need_norm,
                               need_weight, pack_layers)

__all__ = ["EncoderDecoder"]


class EncoderDecoder(_Stack):
    """An encoder-decoder transformer (BART, Marian): the encoder runs once per request, its
    output is projected to cross-attention K/V once per layer, and the decoder steps with a
    self-attention KV cache.  Each half reports the token positions it processes to the
    observers attached with :func:`kvsimd.observe.observe` (seed 003's complexity accounting)."""

    _VALID_AT_INIT = False

    def __init__(self, cfg: ModelConfig, enc_cfg: ModelConfig, enc_embed_pos, enc_layers: List[LayerWeights],
                 enc_final_norm: Optional[NormWeights], enc_embed_norm: Optional[NormWeights], **dec):
        super().__init__(cfg, **dec)
        if not isinstance(enc_cfg, ModelConfig):
            raise KVSimdTypeError("enc_cfg must be a ModelConfig, got %s" % _short(enc_cfg))
        self.enc_cfg = enc_cfg
        self.enc_pos = None if enc_embed_pos is None else _f32(enc_embed_pos, "enc_embed_pos")
        if enc_cfg.position == "sinusoidal" and self.enc_pos is None:
            self.enc_pos = self.pos_embed
        self.enc_layers = enc_layers
        self.enc_final_norm = enc_final_norm
        self.enc_embed_norm = enc_embed_norm
        self._ensure_valid()

    def _cross_width(self):
        return self.enc_cfg.d_model

    def _validate(self):
        super()._validate()
        ec = self.enc_cfg
        if not isinstance(ec, ModelConfig):
            raise KVSimdTypeError("enc_cfg must be a ModelConfig, got %s" % _short(ec))
        check_config(ec, "enc_cfg")
        if ec.position in ("rope", "alibi"):
            raise KVSimdValueError("enc_cfg.position must be 'learned' or 'sinusoidal' (the encoders kvsimd imports), "
                                   "got %r" % ec.position)
        emb = self.__dict__.get("enc_embed")
        need_weight(self.embed if emb is None else emb, "enc_embed", (ec.vocab_size, ec.d_model), table=True)
        if ec.position in ("learned", "sinusoidal"):
            need_weight(self.enc_pos, "enc_pos", (None, ec.d_model))
            if self.enc_pos.shape[0] <= ec.position_offset:
                raise KVSimdValueError("enc_pos has %d rows, not more than position_offset=%d"
                                       % (self.enc_pos.shape[0], ec.position_offset))
        need_norm(self.enc_final_norm, "enc_final_norm", ec.d_model, optional=True)
        need_norm(self.enc_embed_norm, "enc_embed_norm", ec.d_model, optional=True)
        if not isinstance(self.enc_layers, (list, tuple)) or len(self.enc_layers) != ec.n_layers:
            raise KVSimdValueError("enc_layers must be a list of enc_cfg.n_layers=%d LayerWeights, got %s"
                                   % (ec.n_layers, _short(self.enc_layers)))
        for i, lw in enumerate(self.enc_layers):
            check_layer(ec, lw, "enc_layers[%d]" % i)

    def _check_source(self, S, what="src"):
        ec = self.enc_cfg
        if ec.position in ("learned", "sinusoidal") and S + ec.position_offset > self.enc_pos.shape[0]:
            raise KVSimdValueError("%s of %d tokens exceeds the encoder's %d positions"
                                   % (what, S, self.enc_pos.shape[0] - ec.position_offset))

    def __repr__(self):
        c = self.cfg
        return ("EncoderDecoder(%s: %d+%d layers, d_model %d, %d heads; isa=%s)"
                % (c.family or "custom", len(self.enc_layers), c.n_layers, c.d_model, c.n_heads, _kvsimd.active_isa()))

    def _pack(self):
        packed = super()._pack()
        ec = self.enc_cfg
        packed.encoder = pack_layers(ec, self.enc_layers, "enc_layers")
        packed.enc_final_norm = _norm(ec, self.enc_final_norm, "enc_final_norm")
        packed.enc_embed_norm = _norm(ec, self.enc_embed_norm, "enc_embed_norm")
        packed.enc_rope = _rope_spec(ec)
        return packed

    def encode(self, src):
        """Encoder output ``[S, d_model]`` (bidirectional attention, no cache)."""
        self._ensure_valid()
        ec, p = self.enc_cfg, self._packed
        t = _tokens_1d(src, ec.vocab_size, "src")
        S = t.size
        self._check_source(S)
        emb = getattr(self, "enc_embed", None)
        x = embed_rows(self.embed if emb is None else emb, t) * np.float32(ec.embed_scale)
        if self.enc_pos is not None and ec.position in ("learned", "sinusoidal"):
            x = x + self.enc_pos[np.arange(S) + ec.position_offset]
        x = np.ascontiguousarray(x, dtype=F32)
        if p.enc_embed_norm is not None:
            x = p.enc_embed_norm(x)
        with _threads.blas_scope():
            plan = _kvsimd._local_plan(S, ec.n_heads, ec.n_kv_heads, ec.head_dim, p.enc_rope,
                                       alibi_slopes(ec.n_heads) if ec.position == "alibi" else None, False)
            p.encoder.run(x, plan)
        if p.enc_final_norm is not None:
            x = p.enc_final_norm(x)
        notify(self, "positions", "encoder", S)
        return x

    def new_cross_cache(self, batch=1, capacity=1024, dtype="float16"):
        return CrossAttentionCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, capacity,
                                   batch=batch, dtype=dtype)

    def cross_for(self, sources, dtype="float16"):
        """Run the encoder on each source (a list of token-id lists) and fill a cross-attention
        cache (once per request)."""
        self._ensure_valid()
        srcs, batched = _prompts(sources, self.enc_cfg.vocab_size, "sources")
        if not batched:
            raise KVSimdValueError("sources must be a list of token-id lists (one per sequence), got %s"
                                   % _short(sources))
        for b, src in enumerate(srcs):
            self._check_source(len(src), "sources[%d]" % b)
        cross = self.new_cross_cache(batch=len(srcs), capacity=max(len(s) for s in srcs), dtype=dtype)
        for b, s in enumerate(srcs):
            self._fill_cross(cross, b, self.encode(s))
            notify(self, "cross_projections", self.cfg.n_layers)
        return cross

    def prefill(self, tokens, *, cache: KVCache, cross: CrossAttentionCache, seq=0, all_logits=False):
        """As :meth:`Decoder.prefill`, with the cross-attention cache of :meth:`cross_for`."""
        self._begin(cache, cross)
        return self._prefill_logits(tokens, cache, seq, cross, all_logits)

    def step(self, tokens, *, cache: KVCache, cross: CrossAttentionCache):
        """As :meth:`Decoder.step`, with the cross-attention cache of :meth:`cross_for`."""
        self._begin(cache, cross)
        return self._step_logits(tokens, cache, cross)

    def forward(self, src, tgt, enc_out=None):
        """Decoder logits ``[T, vocab]`` for target prefix ``tgt`` without any cache."""
        self._ensure_valid()
        if enc_out is None:
            enc_out = self.encode(src)
        else:
            need_weight(enc_out, "enc_out", (None, self.enc_cfg.d_model))
        return self._full(tgt, enc_out)

    def _start(self, decoder_start):
        start = self.cfg.decoder_start_token_id if decoder_start is None else decoder_start
        if start is None:
            raise KVSimdValueError("decoder_start is needed: the model config has no decoder_start_token_id")
        return int(_tokens_1d([start], self.cfg.vocab_size, "decoder_start")[0])

    def generate(self, src, *, decoder_start=None, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
                 seed=None, stop_tokens=None, cache_dtype="float16", capacity=None):
        """Stream the translation/summary of ``src`` (a list of ids, or a list of lists for a batch).
        Arguments and stop tokens as in :meth:`Decoder.generate` (stop tokens are not yielded);
        ``stop_tokens=None`` stops at the config's ``eos_token_id``."""
        self._ensure_valid()
        sources, batched = _prompts(src, self.enc_cfg.vocab_size, "src")
        start = self._start(decoder_start)
        stop = (self.cfg.eos_token_id,) if stop_tokens is None and self.cfg.eos_token_id is not None else stop_tokens
        return _generate(self, [[start]] * len(sources), batched, sources, max_new_tokens, temperature, top_k, top_p,
                         seed, stop, cache_dtype, capacity)

    @classmethod
    def from_transformers(cls, model, weights="float32"):
        """Import a loaded Hugging Face encoder-decoder (BART, Marian); ``weights`` as for
        :meth:`Decoder.from_transformers`."""
        from kvsimd.loaders.hf import encoder_decoder_from_transformers
        return encoder_decoder_from_transformers(cls, model, weights)
