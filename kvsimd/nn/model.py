"""The part every model shares: validation, the packed layers, and the forward passes.

A forward pass is three crossings: the cache plans it (``KVCache.begin_prefill`` /
``begin_step``: slots, positions, key ranges, the streaming policy's discards), the compiled
layers run it (``Layers.run``: every layer, attention through the plan), the cache commits it
(``end_prefill`` / ``end_step``), all inside ``cache.transaction()`` so that a failure or an
interrupt leaves the cache as it was.
"""
from __future__ import annotations

import operator
from typing import List, Optional

import numpy as np

from kvsimd import _kvsimd
from kvsimd import threads as _threads
from kvsimd._kvsimd import CrossAttentionCache, KVCache, RopeSpec
from kvsimd.errors import KVSimdCapacityError, KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import (F32, ModelConfig, attention_scale, check_config, layer_windows, rope_frequencies,
                              weights_generation)
from kvsimd.nn.generate import _short, _tokens_1d
from kvsimd.observe import notify
from kvsimd.nn.weights import (LayerWeights, NormWeights, _f32, alibi_slopes, check_layer, embed_rows, need_norm,
                               need_weight, pack_layers, sinusoidal_table, _norm)

_need_int = _kvsimd._need_int


def _rope_spec(cfg):
    """The model's RopeSpec (None without RoPE): frequencies and attention factor of cfg.rope_scaling."""
    if cfg.position != "rope":
        return None
    inv, att = rope_frequencies(cfg)
    return RopeSpec(cfg.rope_theta, cfg.rope_style, cfg.rotary_dim, cfg.head_dim, inv, att)


class _Packed:
    """A model's compiled form, rebuilt whenever a weight or the config is assigned."""

    def __init__(self, cfg, layers, final_norm, embed_norm, lm_head, lm_bias, d_source):
        self.layers = pack_layers(cfg, layers, "layers", d_source)
        self.final_norm = _norm(cfg, final_norm, "final_norm")
        self.embed_norm = _norm(cfg, embed_norm, "embed_norm")
        self.lm_head = _kvsimd.Linear(lm_head, lm_bias, name="lm_head", bias_name="lm_bias")


class _Stack:
    """What decoder-only models and the decoder half of encoder-decoders share: the checks, the
    packed layers, and the three forward passes (a prefill chunk, a decode step, an uncached
    pass), each of which is: the cache plans it, the compiled layers run it, the cache commits."""

    _VALID_AT_INIT = True
    # set by validation (object.__setattr__: not weight assignments)
    rope: Optional[RopeSpec]
    slopes: Optional[np.ndarray]
    _attn: dict           # the plans' scale, softcap and windows (see _validate)
    _packed: "_Packed"

    def __init__(self, cfg: ModelConfig, embed, layers: List[LayerWeights], final_norm: Optional[NormWeights],
                 lm_head, lm_bias=None, pos_embed=None, embed_norm: Optional[NormWeights] = None):
        if not isinstance(cfg, ModelConfig):
            raise KVSimdTypeError("cfg must be a ModelConfig, got %s" % _short(cfg))
        self.cfg = cfg
        self.embed = _f32(embed, "embed")
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = _f32(lm_head, "lm_head")   # [d_model, vocab]
        self.lm_bias = None if lm_bias is None else _f32(lm_bias, "lm_bias")
        self.pos_embed = None if pos_embed is None else _f32(pos_embed, "pos_embed")
        if cfg.position == "sinusoidal" and self.pos_embed is None:
            self.pos_embed = sinusoidal_table(min(cfg.max_positions, 1 << 16), cfg.d_model)
        self.embed_norm = embed_norm
        if self._VALID_AT_INIT:    # (EncoderDecoder: once its encoder half is set)
            self._ensure_valid()

    # ------------------------------------------------------------------ validation
    # Assigning any weight or config attribute (here, or on a ModelConfig / weights object) bumps
    # nn.config.weights_generation(); the next prefill/step/generate validates and packs the model again.
    _UNTRACKED = frozenset(("tokenizer", "source", "_valid", "_packed"))

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name not in self._UNTRACKED:
            object.__setattr__(self, "_valid", None)

    def _ensure_valid(self):
        """Validate every array the forward passes read and pack them into the compiled layers,
        unless nothing was assigned since the last validation."""
        v = self.__dict__.get("_valid")
        layers = self.layers
        if v is not None and v[0] == weights_generation() and v[1] is layers and len(v[2]) == len(layers) \
                and all(map(operator.is_, v[2], layers)):
            return
        self._validate()
        object.__setattr__(self, "_packed", self._pack())
        object.__setattr__(self, "_valid", (weights_generation(), layers, tuple(layers)))

    def _validate(self):
        cfg = self.cfg
        if not isinstance(cfg, ModelConfig):
            raise KVSimdTypeError("cfg must be a ModelConfig, got %s" % _short(cfg))
        check_config(cfg, "cfg")
        d, V = cfg.d_model, cfg.vocab_size
        need_weight(self.embed, "embed", (V, d), table=True)
        need_weight(self.lm_head, "lm_head", (d, V))
        need_weight(self.lm_bias, "lm_bias", (V,), optional=True)
        need_norm(self.final_norm, "final_norm", d, optional=True)
        need_norm(self.embed_norm, "embed_norm", d, optional=True)
        if cfg.position in ("learned", "sinusoidal"):
            need_weight(self.pos_embed, "pos_embed", (None, d))
            if self.pos_embed.shape[0] <= cfg.position_offset:
                raise KVSimdValueError("pos_embed has %d rows, not more than position_offset=%d"
                                       % (self.pos_embed.shape[0], cfg.position_offset))
        layers = self.layers
        if not isinstance(layers, (list, tuple)) or len(layers) != cfg.n_layers:
            raise KVSimdValueError("layers must be a list of cfg.n_layers=%d LayerWeights, got %s"
                                   % (cfg.n_layers, _short(layers)))
        d_source = self._cross_width()
        for i, lw in enumerate(layers):
            check_layer(cfg, lw, "layers[%d]" % i, d_source)
        chunk = _need_int(self.prefill_chunk, "prefill_chunk")
        if chunk < 1:
            raise KVSimdValueError("prefill_chunk must be >= 1, got %d" % chunk)
        object.__setattr__(self, "slopes", alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else None)
        object.__setattr__(self, "rope", _rope_spec(cfg))
        # what every plan of this model carries besides positions: the scores' scale and cap, the
        # attention windows of its layers
        object.__setattr__(self, "_attn", dict(scale=attention_scale(cfg), softcap=cfg.attn_softcap or None,
                                               windows=tuple(sorted(set(layer_windows(cfg)) - {0})) or None))

    def _cross_width(self):
        """Width of the encoder output the layers' cross-attention reads (None: no cross-attention)."""
        return None

    def _check_cache(self, cache, name="cache"):
        """A cache must have this model's layer count, KV heads and head_dim (the compiled step
        indexes it by the model's dimensions)."""
        kind = CrossAttentionCache if name == "cross" else KVCache
        if not isinstance(cache, kind):
            raise KVSimdTypeError("%s must be a kvsimd.%s, got %s" % (name, kind.__name__, _short(cache)))
        c = self.cfg
        want, got = (c.n_layers, c.n_kv_heads, c.head_dim), (cache.n_layers, cache.n_kv_heads, cache.head_dim)
        if want != got:
            raise KVSimdValueError("%s has (n_layers, n_kv_heads, head_dim) = %s, this model needs %s: "
                                   "make it with model.new_cache()" % (name, got, want))
        if name == "cache" and self._policy(cache.policy, "cache.policy") != cache.policy:
            raise KVSimdValueError("cache.policy %r is not resolved for this model: make the cache with "
                                   "model.new_cache(policy=%r)" % (cache.policy, cache.policy))

    def _check_cross(self, cross, cache):
        if self._cross_width() is None:
            return
        self._check_cache(cross, "cross")
        if cross.batch != cache.batch:
            raise KVSimdValueError("cross has %d sequences, cache has %d: they must match" % (cross.batch, cache.batch))
        if (cross.lengths == 0).any():
            raise KVSimdValueError("cross has empty sequences %s: fill it with model.cross_for(sources)"
                                   % np.nonzero(cross.lengths == 0)[0].tolist())

    def _begin(self, cache, cross=None):
        """The checks of every public prefill/step, once per call."""
        self._ensure_valid()
        self._check_cache(cache)
        self._check_cross(cross, cache)

    def _check_position(self, last):
        """Learned/sinusoidal models have a table of positions: ``last`` must be in it."""
        cfg = self.cfg
        if cfg.position in ("learned", "sinusoidal") and last + cfg.position_offset >= self.pos_embed.shape[0]:
            raise KVSimdValueError("position %d is beyond the %d positions this model has"
                                   % (last, self.pos_embed.shape[0] - cfg.position_offset))

    def _pack(self):
        return _Packed(self.cfg, self.layers, self.final_norm, self.embed_norm, self.lm_head, self.lm_bias,
                       self._cross_width())

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens, positions):
        cfg = self.cfg
        x = embed_rows(self.embed, tokens) * np.float32(cfg.embed_scale)
        if cfg.position in ("learned", "sinusoidal"):
            self._check_position(int(positions.max()))
            x = x + self.pos_embed[positions + cfg.position_offset]
        x = np.ascontiguousarray(x, dtype=F32)
        en = self._packed.embed_norm
        return x if en is None else en(x)

    def _logits(self, x):
        p = self._packed
        if p.final_norm is not None:
            x = p.final_norm(x)
        logits = p.lm_head(x)
        cap = self.cfg.final_softcap
        if cap:
            c = np.float32(cap)
            logits = np.tanh(logits / c) * c
        return logits

    def _fill_cross(self, cross, seq, enc_out):
        """Project ``enc_out [S, d_source]`` with every layer's cross-attention K/V weights into
        sequence ``seq`` of ``cross`` (once per request)."""
        S, Hkv, D = enc_out.shape[0], self.cfg.n_kv_heads, self.cfg.head_dim
        if S > cross.capacity:
            raise KVSimdCapacityError("source of %d tokens exceeds the cross cache capacity %d" % (S, cross.capacity))
        cross.reset(seq)
        for l, blk in enumerate(self._packed.layers.blocks):
            kv = blk.cross_kv(enc_out).reshape(S, 2, Hkv, D)
            cross.write(l, np.ascontiguousarray(kv[:, 0].transpose(1, 0, 2)),
                        np.ascontiguousarray(kv[:, 1].transpose(1, 0, 2)), seq=seq, start=0)
        cross.commit(S, seq=seq)

    # ------------------------------------------------------------------ cached forward
    prefill_chunk = 256   # prompt tokens per causal pass

    def _prefill(self, tokens, cache: KVCache, seq, cross=None, finish=None):
        """Run ``tokens`` of one sequence after its cached prefix, in chunks; returns the last
        hidden rows [T, d_model], or ``finish`` of them (the logits).  Checked up front, and undone
        on any failure or interrupt (until ``finish`` has returned), so a prefill either completes
        or leaves the cache as it was."""
        with cache.transaction():     # one thread at a time (KVSimdBusyError otherwise)
            t = _tokens_1d(tokens, self.cfg.vocab_size)
            start = cache.length(seq)
            if cache.head[seq] != cache.n_keep or cache.seen[seq] != start:
                raise KVSimdValueError("sequence %d has wrapped its ring buffer: feed further tokens with step()" % seq)
            if start + t.size > cache.capacity:
                raise KVSimdCapacityError("prompt of %d tokens after %d cached exceeds capacity %d (sequence %d)"
                                          % (t.size, start, cache.capacity, seq))
            if cross is not None and cross.length(seq) == 0:
                raise KVSimdValueError("cross has no source tokens for sequence %d" % seq)
            self._check_position(start + t.size - 1)
            with _threads.blas_scope():
                out = [self._prefill_chunk(t[i:i + self.prefill_chunk], cache, seq, cross)
                       for i in range(0, t.size, self.prefill_chunk)]
                x = out[0] if len(out) == 1 else np.concatenate(out)
                return x if finish is None else finish(x)

    def _prefill_chunk(self, t, cache: KVCache, seq, cross=None):
        plan = cache.begin_prefill(seq, t, rope=self.rope, alibi_slopes=self.slopes, n_heads=self.cfg.n_heads,
                                   **self._attn)
        x = self._embed(t, plan.embed_positions)
        self._packed.layers.run(x, plan, cross)
        cache.end_prefill(plan)
        notify(self, "positions", "decoder", t.size)
        return x

    def _step(self, tokens, cache: KVCache, cross=None, finish=None):
        """One token per sequence of the batch: returns the hidden rows [B, d_model], or ``finish``
        of them (the logits).  The step, the discard a full window makes first, and ``finish`` are
        one transaction: on any failure or interrupt the cache is put back as it was."""
        with cache.transaction():     # one thread at a time (KVSimdBusyError otherwise)
            t = _tokens_1d(tokens, self.cfg.vocab_size)
            if t.size != cache.batch:
                raise KVSimdValueError("step needs one token per sequence: cache batch is %d, got %d tokens"
                                       % (cache.batch, t.size))
            with _threads.blas_scope():
                kw: dict = dict(rope=self.rope, alibi_slopes=self.slopes, n_heads=self.cfg.n_heads, **self._attn)
                plan = cache.begin_step(t, **kw)
                if plan.refill:     # "reevaluate": the cache emptied these sequences; prefill what it keeps
                    for b, kept in plan.refill.items():
                        self._prefill(kept, cache, b, cross)
                    plan = cache.begin_step(t, **kw)
                x = self._embed(t, plan.embed_positions)
                self._packed.layers.run(x, plan, cross)
                cache.end_step(plan)
                notify(self, "positions", "decoder", t.size)
                return x if finish is None else finish(x)

    # ------------------------------------------------------------------ uncached pass
    def _full(self, tokens, enc_out=None):
        """Forward over all ``tokens`` from scratch (no cache): the recomputation baseline."""
        cfg = self.cfg
        t = _tokens_1d(tokens, cfg.vocab_size)
        T = t.size
        cross = None
        if enc_out is not None:
            cross = CrossAttentionCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, enc_out.shape[0], dtype="float32")
            self._fill_cross(cross, 0, enc_out)
        with _threads.blas_scope():
            plan = _kvsimd._local_plan(T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.rope, self.slopes, True,
                                       **self._attn)
            x = self._embed(t, plan.embed_positions)
            self._packed.layers.run(x, plan, cross)
            notify(self, "positions", "decoder", T)
            return self._logits(x)

    def _prefill_logits(self, tokens, cache, seq, cross, all_logits=False):
        if not isinstance(all_logits, (bool, np.bool_)):
            raise KVSimdTypeError("all_logits must be True or False, got %s" % _short(all_logits))
        return self._prefill(tokens, cache, seq, cross,
                             finish=self._logits if all_logits else lambda x: self._logits(x[-1:])[0])

    def _step_logits(self, tokens, cache, cross):
        return self._step(tokens, cache, cross, finish=self._logits)

    def _policy(self, policy, name="policy"):
        """``policy`` as the cache will run it ("auto" resolved); refused where positions cannot shift."""
        pos = self.cfg.position
        if isinstance(policy, str) and policy == "auto":
            return "shift" if pos in ("rope", "alibi") else "reevaluate"
        if isinstance(policy, str) and policy in ("shift", "sink_query") and pos not in ("rope", "alibi"):
            raise KVSimdValueError("%s %r needs RoPE or ALiBi positions; this model has %s positions "
                                   "(use 'reevaluate', or 'auto')" % (name, policy, pos))
        return policy

    def new_cache(self, batch=1, capacity=2048, dtype="float16", *, n_keep=0, policy="fixed", n_discard=None,
                  hadamard=None, recent=0):
        """A self-attention cache sized for this model.  With ``policy`` other than "fixed" the
        cache never fills (StreamingLLM): ``n_keep`` sink tokens stay, and when the window is
        full "reevaluate" drops the ``n_discard`` oldest window tokens and recomputes the rest,
        "shift" drops them and rotates the kept keys back in place, "sink_query" drops the
        oldest token each step and rewrites nothing (the query is rotated twice instead),
        "auto" picks "shift" where positions can shift and "reevaluate" elsewhere.  ``dtype``
        "float16", "float32", "int8", "int4" or "int8/int4" (int8 keys, int4 values); ``hadamard`` as
        :class:`kvsimd.KVCache` (default: on when K or V is int4); ``recent``: a quantized cache also
        keeps the float16 rows of each sequence's last ``recent`` tokens, and every query reads its
        last ``recent`` keys from them (:class:`kvsimd.KVCache`)."""
        self._ensure_valid()
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, capacity, batch=batch, dtype=dtype,
                       hadamard=hadamard, n_keep=n_keep, policy=self._policy(policy), n_discard=n_discard,
                       recent=recent)
