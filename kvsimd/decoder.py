"""Decoders with KV caches: decoder-only (:class:`Decoder`) and encoder-decoder (:class:`EncoderDecoder`).

Each decode step feeds one token per sequence and reads the cached K/V of every earlier
token (O(n) per step instead of recomputing O(n^2) attention): the new token's K/V are written
into the :class:`kvsimd.KVCache`, attention runs in kvsimd's kernel directly over the cache,
and the rest of the layer works on that one row.  Prefill processes a whole prompt in one
causal pass.  For encoder-decoders the encoder runs once per request and its output is
projected to K/V once per layer (:class:`CrossAttentionCache`), then reused by every step.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import numpy as np

import math
import operator
import signal as _signal
import threading as _threading

from kvsimd._kvsimd import KVCache
from kvsimd.errors import KVSimdCapacityError, KVSimdTypeError, KVSimdValueError
from kvsimd.layers import (F32, LayerWeights, ModelConfig, NormWeights, _f32, _real, alibi_slopes, causal_attention,
                           check_config, check_layer, ffn, linear, merge_heads, need_norm, need_weight, norm, rope,
                           sinusoidal_table, split_heads, weights_generation)
from kvsimd import _kvsimd
from kvsimd import threads as _threads
from kvsimd.observe import notify

_need_int = _kvsimd._need_int

__all__ = ["Decoder", "EncoderDecoder", "CrossAttentionCache", "sample"]


class CrossAttentionCache(KVCache):
    """Per-layer K/V of the encoder output, projected once per request and sequence."""

    def fill(self, seq, enc_out, layers: Sequence[LayerWeights], n_kv_heads, head_dim):
        """Project ``enc_out [S, d_model]`` with every layer's cross-attention K/V weights."""
        _kvsimd._need_array(enc_out, "enc_out", (np.dtype(F32),), 2, "[S, d_model]")
        S = enc_out.shape[0]
        if S == 0:
            raise KVSimdValueError("enc_out has no source tokens")
        if S > self.capacity:
            raise KVSimdCapacityError("source of %d tokens exceeds the cross cache capacity %d" % (S, self.capacity))
        self.reset(seq)
        for l, lw in enumerate(layers):
            a = lw.cross
            k = split_heads(linear(enc_out, a.wk, a.bk), n_kv_heads, head_dim)
            v = split_heads(linear(enc_out, a.wv, a.bv), n_kv_heads, head_dim)
            self.write(l, k, v, seq=seq, start=0)
        self.commit(S, seq=seq)


def _ring_ranges(start, count, base, width):
    """Slot ranges of ``count`` ring entries starting at slot ``start`` of the ring [base, base+width)."""
    if count <= 0:
        return []
    r0 = start - base
    first = min(count, width - r0)
    out = [(start, start + first)]
    if count > first:
        out.append((base, base + count - first))
    return out


def _short(x, n=80):
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def _tokens_1d(tokens, vocab, what="tokens"):
    """``tokens`` as a non-empty int64 array of ids in 0..vocab-1; KVSimdError naming ``what`` otherwise."""
    try:
        n = len(tokens)
    except TypeError:
        n = 0
    if n > _kvsimd.MAX_TOKENS:
        raise KVSimdValueError("%s has %d ids, more than the %d tokens a cache can hold" % (what, n, _kvsimd.MAX_TOKENS))
    try:
        t = np.asarray(tokens) if not isinstance(tokens, (str, bytes)) else None
    except (TypeError, ValueError):      # ragged nesting, objects NumPy cannot hold
        t = None
    if t is None or t.dtype == object or t.ndim != 1 or t.size == 0:
        raise KVSimdValueError("%s must be a non-empty 1-D sequence of integer token ids, got %s"
                               % (what, _short(tokens)))
    if not np.issubdtype(t.dtype, np.integer):
        raise KVSimdTypeError("%s must be integer token ids, got dtype %s: %s" % (what, t.dtype, _short(tokens)))
    if t.min() < 0 or t.max() >= vocab:
        raise KVSimdValueError("%s contain ids outside the vocabulary 0..%d: %s"
                               % (what, vocab - 1, t[(t < 0) | (t >= vocab)][:5].tolist()))
    return t.astype(np.int64)


def _prompts(prompt, vocab, what):
    """A prompt (ids) or a batch (a list of id lists, or a 2-D array) -> (list of id lists, batched)."""
    if isinstance(prompt, np.ndarray):
        batched = prompt.ndim == 2
    elif isinstance(prompt, (list, tuple, range)):
        if len(prompt) == 0:
            raise KVSimdValueError("%s must not be empty" % what)
        nested = [isinstance(p, (list, tuple, range, np.ndarray)) for p in prompt]
        if any(nested) and not all(nested):
            raise KVSimdValueError("%s mixes token ids and lists of token ids: %s" % (what, _short(prompt)))
        batched = nested[0]
    else:
        raise KVSimdTypeError("%s must be a list of token ids or a list of such lists, got %s"
                              % (what, _short(prompt)))
    if batched and len(prompt) == 0:
        raise KVSimdValueError("%s is an empty batch: it needs at least one sequence" % what)
    if batched:
        return [_tokens_1d(p, vocab, "%s[%d]" % (what, b)).tolist() for b, p in enumerate(prompt)], True
    return [_tokens_1d(prompt, vocab, what).tolist()], False


def _sampling_params(temperature, top_k, top_p):
    """The one check of sampling parameters (sample() and every generate())."""
    temperature = _real(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise KVSimdValueError("temperature must be finite and >= 0 (0: greedy), got %r" % temperature)
    top_k = _need_int(top_k, "top_k")
    if top_k < 0:
        raise KVSimdValueError("top_k must be >= 0 (0: no top-k truncation), got %d" % top_k)
    top_p = _real(top_p, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise KVSimdValueError("top_p must be in (0, 1] (1: no nucleus truncation), got %r" % top_p)
    return temperature, top_k, top_p


def _sample(logits, rng, temperature, top_k, top_p, what="logits"):
    """sample() on checked parameters; refuses NaN / +inf logits instead of picking token 0 forever."""
    try:
        z = np.asarray(logits)
    except (TypeError, ValueError):
        z = np.asarray(None)
    if z.dtype == bool or not (np.issubdtype(z.dtype, np.integer) or np.issubdtype(z.dtype, np.floating)):
        raise KVSimdTypeError("%s must be an array of real numbers, got %s" % (what, _short(logits)))
    z = z.astype(np.float64)
    if z.ndim != 1 or z.size == 0:
        raise KVSimdValueError("%s must be a non-empty 1-D array, got shape %s" % (what, z.shape))
    if temperature == 0:
        best = int(np.argmax(z))    # NaN counts as the maximum: one pass checks and picks
        top = z[best]
    else:
        top = z.max()
    if not top < np.inf:
        bad = np.nonzero(np.isnan(z) | np.isposinf(z))[0]
        raise KVSimdValueError("%s contain NaN or +inf at %d of %d entries (first ids %s): the model's numbers "
                               "overflowed" % (what, bad.size, z.size, bad[:5].tolist()))
    if top == -np.inf:
        raise KVSimdValueError("%s are all -inf: no token can be chosen" % what)
    if temperature == 0:
        return best
    with np.errstate(over="ignore"):
        z = (z - top) / temperature      # <= 0 and finite or -inf, even for a tiny temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    z = z[order] - z[order[0]]
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        keep = np.searchsorted(np.cumsum(p), top_p) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(order[rng.choice(len(order), p=p)])


def sample(logits, rng=None, *, temperature=0.0, top_k=0, top_p=1.0):
    """Pick a token from ``logits [vocab]``: greedy when temperature is 0, else seeded sampling
    with optional top-k (0: off) and nucleus top-p (1: off) truncation.  ``temperature`` must be
    finite and >= 0, ``top_k`` an integer >= 0, ``top_p`` in (0, 1], ``rng`` None or a
    ``numpy.random.Generator``; NaN or +inf logits raise :class:`kvsimd.KVSimdValueError`."""
    params = _sampling_params(temperature, top_k, top_p)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise KVSimdTypeError("rng must be None or a numpy.random.Generator, got %s" % _short(rng))
    return _sample(logits, rng, *params)


class _Undo:
    """What a prefill or a decode step may change in a cache, saved before it changes, so that a
    failure or an interrupt (KeyboardInterrupt included) puts the cache back exactly as it was.

    Always saved: each sequence's length, ring head, seen count and token-list length (a few
    integers), and the (position, rotation) of each slot a step writes -- a step writes K/V only
    into slots beyond the committed tokens, which stay invisible until the commit.  A sequence
    whose window is full (the step discards tokens) also has its bookkeeping row saved and the K/V
    the discard rewrites: every slot of every layer under "reevaluate" and "shift" (one copy of
    that sequence's cache, once per discard, i.e. every ``n_discard`` steps), only the overwritten
    slot under "sink_query" (every step once the window is full)."""

    def __init__(self, cache):
        self.cache = cache
        self.lengths = cache.lengths
        self.head = cache.head.copy()
        self.seen = cache.seen.copy()
        self.ntok = [len(t) for t in cache.tokens]
        self.rows, self.cells, self.kv = {}, [], []

    def save_row(self, b):
        c = self.cache
        if b not in self.rows:
            self.rows[b] = (c.positions[b].copy(), c.rotations[b].copy(), list(c.tokens[b]))

    def save_cell(self, b, slot):
        c = self.cache
        self.cells.append((b, slot, int(c.positions[b, slot]), int(c.rotations[b, slot])))

    def save_kv(self, b, t0, t1):
        c = self.cache
        for l in range(c.n_layers):
            self.kv.append((l, b, t0, np.array(c.keys(l, b, length=t1)[:, t0:t1]),
                            np.array(c.values(l, b, length=t1)[:, t0:t1])))

    def restore(self):
        """Put everything back.  A Ctrl-C (SIGINT) arriving meanwhile is held until the cache is
        whole again, then delivered as usual (main thread; Python runs signal handlers there)."""
        held, old = [], None
        if _threading.current_thread() is _threading.main_thread() and _signal.getsignal(_signal.SIGINT) is not None:
            try:     # (None: a handler installed outside Python, left alone)
                old = _signal.signal(_signal.SIGINT, lambda signum, frame: held.append(signum))
            except (ValueError, OSError, TypeError):
                old = None
        try:
            self._restore()
        finally:
            if old is not None:
                _signal.signal(_signal.SIGINT, old)
                if held:
                    _signal.raise_signal(_signal.SIGINT)   # the handler the program had decides

    def _restore(self):
        c = self.cache
        for l, b, t0, k, v in reversed(self.kv):      # fp16 -> fp32 -> fp16 is exact
            c.write(l, k.astype(F32), v.astype(F32), seq=b, start=t0)
        for b, slot, p, r in reversed(self.cells):
            c.positions[b, slot], c.rotations[b, slot] = p, r
        for b, (p, r, toks) in self.rows.items():
            c.positions[b], c.rotations[b], c.tokens[b] = p, r, toks
        for b in range(c.batch):
            del c.tokens[b][self.ntok[b]:]
        c.head[:], c.seen[:] = self.head, self.seen
        now = c.lengths
        for b in range(c.batch):
            if now[b] > self.lengths[b]:
                c._forget(b, int(now[b] - self.lengths[b]))
            elif now[b] < self.lengths[b]:
                c.commit(int(self.lengths[b] - now[b]), seq=b)


class _PrefillAttention:
    """Attention of a causal prefill chunk: write K/V to the cache, attend over the prefix."""

    def __init__(self, stack, cache, seq, cross, start, T, pos):
        self.s, self.cache, self.seq, self.cross = stack, cache, seq, cross
        self.start, self.T, self.pos = start, T, pos
        self.has_cross = cross is not None

    def self_attn(self, l, lw, h):
        s, cfg, cache, seq = self.s, self.s.cfg, self.cache, self.seq
        q, k, v = s._qkv(lw.attn, h)
        q = rope(cfg, split_heads(q, cfg.n_heads, cfg.head_dim), self.pos)
        k = rope(cfg, split_heads(k, cfg.n_kv_heads, cfg.head_dim), self.pos)
        v = split_heads(v, cfg.n_kv_heads, cfg.head_dim)
        cache.write(l, k, v, seq=seq)
        kk = cache.keys(l, seq, length=self.start + self.T).astype(F32)
        vv = cache.values(l, seq, length=self.start + self.T).astype(F32)
        return merge_heads(causal_attention(q, kk, vv, self.start, s.slopes))

    def cross_attn(self, l, lw, h):
        cfg = self.s.cfg
        q = split_heads(linear(h, lw.cross.wq, lw.cross.bq), cfg.n_heads, cfg.head_dim)
        kk = self.cross.keys(l, self.seq).astype(F32)
        vv = self.cross.values(l, self.seq).astype(F32)
        return merge_heads(causal_attention(q, kk, vv, 0, None, causal=False))


class _StepAttention:
    """Attention of one decode step (one token per sequence) through the cache's fused call."""

    def __init__(self, stack, cache, cross, B, slots, kpos, spos, ranges, rope_args):
        self.s, self.cache, self.cross, self.B = stack, cache, cross, B
        self.slots, self.kpos, self.spos, self.ranges, self.rope_args = slots, kpos, spos, ranges, rope_args
        self.has_cross = cross is not None
        self.HD = stack.cfg.n_heads * stack.cfg.head_dim

    def self_attn(self, l, lw, h):
        # rope q/k, store k/v at each sequence's slot, attend over its key ranges: one C call
        qkv = np.ascontiguousarray(linear(h, lw.attn.wqkv, lw.attn.bqkv), dtype=F32)
        return self.cache.step_attend(l, qkv, np.empty((self.B, self.HD), F32), self.slots, self.kpos, self.spos,
                                      self.ranges, rope=self.rope_args, alibi_slopes=self.s.slopes)

    def cross_attn(self, l, lw, h):
        cfg, B = self.s.cfg, self.B
        H, D = cfg.n_heads, cfg.head_dim
        q = linear(h, lw.cross.wq, lw.cross.bq).reshape(B, H, D)
        out = np.empty((B, H * D), F32)
        for b in range(B):
            self.cross.attend(l, np.ascontiguousarray(q[b]), seq=b, out=out[b].reshape(H, D))
        return out


class _FullAttention:
    """Attention of an uncached forward over a whole sequence (the recomputation reference)."""

    def __init__(self, stack, pos, enc_out):
        self.s, self.pos, self.enc_out = stack, pos, enc_out
        self.has_cross = enc_out is not None

    def self_attn(self, l, lw, h):
        s, cfg = self.s, self.s.cfg
        q, k, v = s._qkv(lw.attn, h)
        q = rope(cfg, split_heads(q, cfg.n_heads, cfg.head_dim), self.pos)
        k = rope(cfg, split_heads(k, cfg.n_kv_heads, cfg.head_dim), self.pos)
        return merge_heads(causal_attention(q, k, split_heads(v, cfg.n_kv_heads, cfg.head_dim), 0, s.slopes))

    def cross_attn(self, l, lw, h):
        cfg, e = self.s.cfg, self.enc_out
        q = split_heads(linear(h, lw.cross.wq, lw.cross.bq), cfg.n_heads, cfg.head_dim)
        k = split_heads(linear(e, lw.cross.wk, lw.cross.bk), cfg.n_kv_heads, cfg.head_dim)
        v = split_heads(linear(e, lw.cross.wv, lw.cross.bv), cfg.n_kv_heads, cfg.head_dim)
        return merge_heads(causal_attention(q, k, v, 0, None, causal=False))


class _Stack:
    """What decoder-only models and the decoder half of encoder-decoders share."""

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
        self.slopes = alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else None
        if not isinstance(self, EncoderDecoder):    # (EncoderDecoder: once its encoder half is set)
            self._ensure_valid()

    # ------------------------------------------------------------------ validation
    # Assigning any weight or config attribute (here, or on a ModelConfig / weights object) bumps
    # layers.weights_generation(); the next prefill/step/generate then validates the model again.
    _UNTRACKED = frozenset(("tokenizer", "source", "_valid", "_fast"))

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name not in self._UNTRACKED:
            object.__setattr__(self, "_valid", None)

    def _ensure_valid(self):
        """Validate every array the forward passes read (the compiled step reads them by pointer with
        lengths from the config) unless nothing was assigned since the last validation."""
        v = self.__dict__.get("_valid")
        layers = self.layers
        if v is not None and v[0] == weights_generation() and v[1] is layers and len(v[2]) == len(layers) \
                and all(map(operator.is_, v[2], layers)):
            return
        self._validate()
        object.__setattr__(self, "_fast", None)
        object.__setattr__(self, "_valid", (weights_generation(), layers, tuple(layers)))

    def _validate(self):
        cfg = self.cfg
        if not isinstance(cfg, ModelConfig):
            raise KVSimdTypeError("cfg must be a ModelConfig, got %s" % _short(cfg))
        check_config(cfg, "cfg")
        d, V = cfg.d_model, cfg.vocab_size
        need_weight(self.embed, "embed", (V, d))
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

    def _cross_width(self):
        """Width of the encoder output the layers' cross-attention reads (None: no cross-attention)."""
        return None

    def _check_cache(self, cache, name="cache"):
        """A cache must have this model's layer count, KV heads and head_dim (the compiled step
        indexes it by the model's dimensions)."""
        if not isinstance(cache, KVCache):
            raise KVSimdTypeError("%s must be a kvsimd.KVCache, got %s" % (name, _short(cache)))
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

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens, positions):
        cfg = self.cfg
        x = self.embed[tokens] * np.float32(cfg.embed_scale)
        if cfg.position in ("learned", "sinusoidal"):
            self._check_position(int(positions.max()))
            x = x + self.pos_embed[positions + cfg.position_offset]
        if self.embed_norm is not None:
            x = norm(cfg, x, self.embed_norm.w, self.embed_norm.b)
        return x.astype(F32)

    def _qkv(self, a, h, cfg=None):
        cfg = cfg or self.cfg
        qkv = linear(h, a.wqkv, a.bqkv)
        nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]

    def _logits(self, x):
        if self.final_norm is not None:
            x = norm(self.cfg, x, self.final_norm.w, self.final_norm.b)
        return linear(x, self.lm_head, self.lm_bias).astype(F32)

    def _block(self, l, lw: LayerWeights, x, att):
        """One decoder layer; ``att`` supplies the attention of this forward (prefill, step or
        uncached): ``att.self_attn(l, lw, h)`` / ``att.cross_attn(l, lw, h)`` -> [T, H*D] before wo.
        (Methods of one object per forward instead of closures created for every layer.)"""
        cfg = self.cfg
        cross = att.has_cross
        if cfg.pre_norm:
            h = norm(cfg, x, lw.norm1.w, lw.norm1.b)
            a = linear(att.self_attn(l, lw, h), lw.attn.wo, lw.attn.bo)
            if cfg.parallel_residual:
                return x + a + ffn(cfg, lw.ffn, norm(cfg, x, lw.norm2.w, lw.norm2.b))
            x = x + a
            if cross:
                h = norm(cfg, x, lw.norm_cross.w, lw.norm_cross.b)
                x = x + linear(att.cross_attn(l, lw, h), lw.cross.wo, lw.cross.bo)
            return x + ffn(cfg, lw.ffn, norm(cfg, x, lw.norm2.w, lw.norm2.b))
        x = norm(cfg, x + linear(att.self_attn(l, lw, x), lw.attn.wo, lw.attn.bo), lw.norm1.w, lw.norm1.b)
        if cross:
            x = norm(cfg, x + linear(att.cross_attn(l, lw, x), lw.cross.wo, lw.cross.bo), lw.norm_cross.w,
                     lw.norm_cross.b)
        return norm(cfg, x + ffn(cfg, lw.ffn, x), lw.norm2.w, lw.norm2.b)

    # ------------------------------------------------------------------ cached forward
    prefill_chunk = 256   # prompt tokens per causal pass: bounds the [H, T, S] score matrices
    fast_decode = True    # decode steps through _kvsimd._decode_stack (False: the NumPy layers)

    def _fast_layers(self):
        """Per-layer weight tuples for the compiled decode step, or None when this model's
        layers need the general path (parallel residual with post-norm, an unknown activation)."""
        self._ensure_valid()
        cfg = self.cfg
        if cfg.activation not in ("silu", "gelu", "gelu_tanh", "relu") or cfg.norm not in ("rmsnorm", "layernorm") \
                or (cfg.parallel_residual and not cfg.pre_norm):
            return None
        cached = self.__dict__.get("_fast")
        if cached is None or cached[0] is not self._valid:
            # built only from weights _ensure_valid has just checked (_decode_stack reads them by pointer)
            ln = cfg.norm == "layernorm"
            packed = []
            for lw in self.layers:
                f, c, nc = lw.ffn, lw.cross, lw.norm_cross
                packed.append((lw.norm1.w, lw.norm1.b if ln else None, lw.attn.wqkv, lw.attn.bqkv, lw.attn.wo,
                               lw.attn.bo, lw.norm2.w, lw.norm2.b if ln else None,
                               f.w13 if f.w13 is not None else f.w1, None if f.w13 is not None else f.b1, f.w2, f.b2,
                               None if nc is None else nc.w, None if nc is None or not ln else nc.b,
                               None if c is None else c.wq, None if c is None else c.bq,
                               None if c is None else c.wo, None if c is None else c.bo))
            self._fast = cached = (self._valid, packed)
        return cached[1]

    def _prefill(self, tokens, cache: KVCache, seq, cross=None, finish=None):
        """Run ``tokens`` of one sequence after its cached prefix, in chunks; returns the last
        hidden rows [T, d_model], or ``finish`` of them (the logits).  Checked up front, and undone
        on any failure or interrupt (until ``finish`` has returned), so a prefill either completes
        or leaves the cache as it was."""
        # one thread at a time (KVSimdBusyError otherwise)
        with cache._claim():
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
            undo = _Undo(cache)
            try:     # everything that runs Python code after the first change is inside the try
                with _threads.blas_scope():
                    out = [self._prefill_chunk(t[i:i + self.prefill_chunk], cache, seq, cross)
                           for i in range(0, t.size, self.prefill_chunk)]
                    x = out[0] if len(out) == 1 else np.concatenate(out)
                    result = x if finish is None else finish(x)
            except BaseException:
                undo.restore()
                raise
            return result

    def _prefill_chunk(self, t, cache: KVCache, seq, cross=None):
        start, T = cache.length(seq), t.size
        pos = np.arange(start, start + T, dtype=np.int64)
        x = self._embed(t, pos)
        att = _PrefillAttention(self, cache, seq, cross, start, T, pos)
        for l, lw in enumerate(self.layers):
            x = self._block(l, lw, x, att)
        cache.commit(T, seq=seq)
        cache.positions[seq, start:start + T] = pos
        cache.seen[seq] += T
        cache.tokens[seq].extend(int(v) for v in t)
        notify(self, "positions", "decoder", T)
        return x

    def _step(self, tokens, cache: KVCache, cross=None, finish=None):
        """One token per sequence of the batch: returns the hidden rows [B, d_model], or ``finish``
        of them (the logits).  The step, the discard a full window makes first, and ``finish`` are
        one transaction: on any failure or interrupt the cache is put back as it was."""
        # one thread at a time (KVSimdBusyError otherwise)
        with cache._claim():
            cfg = self.cfg
            t = _tokens_1d(tokens, cfg.vocab_size)
            B = t.size
            if B != cache.batch:
                raise KVSimdValueError("step needs one token per sequence: cache batch is %d, got %d tokens"
                                       % (cache.batch, B))
            lengths = cache.lengths
            if (lengths == 0).any():
                raise KVSimdValueError("sequences %s have no prompt yet: prefill them first"
                                       % np.nonzero(lengths == 0)[0].tolist())
            if cache.policy == "fixed" and (lengths + 1 > cache.capacity).any():
                raise KVSimdCapacityError("cache full: sequences %s hold %d tokens"
                                          % (np.nonzero(lengths + 1 > cache.capacity)[0].tolist(), cache.capacity))
            undo = _Undo(cache)
            try:     # the step and its discard are one transaction, BLAS scope exit included
                with _threads.blas_scope():
                    x = self._step_body(t, cache, cross, undo)
                    result = x if finish is None else finish(x)
            except BaseException:
                undo.restore()
                raise
            return result

    def _step_body(self, t, cache, cross, undo):
        cfg, B = self.cfg, t.size
        plans = [self._plan(cache, b, undo, cross) for b in range(B)]
        kpos = np.array([pl["kpos"] for pl in plans], dtype=np.int64)
        spos = np.array([pl["qpos_sinks"] for pl in plans], dtype=np.int64)
        x = self._embed(t, kpos if cache.policy != "sink_query" else spos)
        slots = np.array([pl["slot"] for pl in plans], dtype=np.int64)
        ranges = [[(which == "sinks", t0, t1, pl["qpos_sinks"] if which == "sinks" else pl["kpos"])
                   for which, t0, t1 in pl["ranges"]] for pl in plans]
        rope_args = (cfg.rope_theta, cfg.rope_style, cfg.rotary_dim) if cfg.position == "rope" else None
        fast = self._fast_layers() if self.fast_decode else None
        if fast is not None:
            plan = cache.step_plan(cfg.n_heads * cfg.head_dim, slots, kpos, spos, ranges, rope=rope_args,
                                   alibi_slopes=self.slopes)
            x = np.ascontiguousarray(x, dtype=F32)
            _kvsimd._decode_stack(fast, x, cache, plan, cfg.norm == "rmsnorm", cfg.norm_eps, cfg.activation,
                                  cfg.ffn_gated, cfg.parallel_residual, cfg.pre_norm, cross)
        else:
            att = _StepAttention(self, cache, cross, B, slots, kpos, spos, ranges, rope_args)
            for l, lw in enumerate(self.layers):
                x = self._block(l, lw, x, att)
        for b, pl in enumerate(plans):
            cache.rotations[b, pl["slot"]] = 0
            cache.seen[b] += 1
            cache.tokens[b].append(int(t[b]))
            cache.commit(1, seq=b)
        notify(self, "positions", "decoder", B)
        return x

    def _plan(self, cache: KVCache, b, undo, cross=None):
        """Where sequence b's next token goes, at which positions, and which key ranges it reads;
        makes room first when the window is full (the cache's policy).  StreamingLLM positions:
        sinks 0..n_keep-1, the window contiguous after them."""
        cfg = self.cfg
        cap, nk = cache.capacity, cache.n_keep
        W = cap - nk
        L = cache.length(b)
        if L == cap:
            pol = cache.policy
            if pol in ("reevaluate", "shift", "sink_query"):
                undo.save_row(b)
            if pol in ("reevaluate", "shift"):
                undo.save_kv(b, 0, cap)
            if pol == "reevaluate":
                kept = cache.tokens[b][:nk] + cache.tokens[b][nk + cache.n_discard:]
                cache.reset(b)
                self._prefill(kept, cache, b, cross)
            elif pol == "shift":
                nd = cache.n_discard
                keep_start = nk + (cache.head[b] - nk + nd) % W
                for t0, t1 in _ring_ranges(keep_start, W - nd, nk, W):
                    if cfg.position == "rope":
                        cache.shift_range(b, t0, t1, -nd, cfg.rope_theta, cfg.rope_style, cfg.rotary_dim)
                        cache.rotations[b, t0:t1] += 1
                    cache.positions[b, t0:t1] -= nd
                cache.head[b] = keep_start
                cache._forget(b, nd)
                del cache.tokens[b][nk:nk + nd]
            elif pol == "sink_query":
                cache.head[b] = nk + (cache.head[b] - nk + 1) % W
                cache._forget(b, 1)
                del cache.tokens[b][nk]
            else:
                raise KVSimdCapacityError("cache full: sequence %d holds %d tokens" % (b, cap))
            L = cache.length(b)
        if L < nk or W == 0:
            slot = L
        else:
            slot = nk + (cache.head[b] - nk + (L - nk)) % W
        Lp = L + 1                                   # valid tokens after this step
        compressed = Lp - 1
        kpos = int(cache.seen[b]) if cache.policy == "sink_query" else compressed
        ranges = [("sinks", 0, min(nk, Lp))] if nk else []
        if Lp > nk:
            # the window's keys carry their own positions, so slot order does not matter to the
            # softmax: in slot order, ranges that touch become one kernel call (cache.step_plan)
            ranges += [("window", t0, t1) for t0, t1 in sorted(_ring_ranges(int(cache.head[b]), Lp - nk, nk, W))]
        undo.save_cell(b, slot)
        if b in undo.rows and cache.policy == "sink_query":
            undo.save_kv(b, slot, slot + 1)   # the oldest window token's K/V, overwritten by this step
        cache.positions[b, slot] = kpos       # invisible until committed; ALiBi reads it this step
        return {"slot": slot, "kpos": kpos, "qpos_sinks": compressed if nk else kpos, "ranges": ranges}

    # ------------------------------------------------------------------ uncached reference
    def _full(self, tokens, enc_out=None):
        """Forward over all ``tokens`` from scratch (no cache): the recomputation reference."""
        cfg = self.cfg
        t = _tokens_1d(tokens, cfg.vocab_size)
        T = t.size
        pos = np.arange(T, dtype=np.int64)
        x = self._embed(t, pos)
        att = _FullAttention(self, pos, enc_out)
        for l, lw in enumerate(self.layers):
            x = self._block(l, lw, x, att)
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

    def new_cache(self, batch=1, capacity=2048, dtype="float16", *, n_keep=0, policy="fixed", n_discard=None):
        """A self-attention cache sized for this model.  With ``policy`` other than "fixed" the
        cache never fills (StreamingLLM): ``n_keep`` sink tokens stay, and when the window is
        full "reevaluate" drops the ``n_discard`` oldest window tokens and recomputes the rest,
        "shift" drops them and rotates the kept keys back in place, "sink_query" drops the
        oldest token each step and rewrites nothing (the query is rotated twice instead),
        "auto" picks "shift" where positions can shift and "reevaluate" elsewhere."""
        self._ensure_valid()
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, capacity, batch=batch, dtype=dtype,
                       n_keep=n_keep, policy=self._policy(policy), n_discard=n_discard)


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
    def from_transformers(cls, model):
        """Import a loaded Hugging Face causal LM (Llama/Mistral/Qwen2, GPT-NeoX, GPT-2, BLOOM)."""
        from kvsimd.hf import decoder_from_transformers
        return decoder_from_transformers(cls, model)

    @classmethod
    def from_gguf(cls, path):
        """Load a Llama-architecture GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, dequantized
        to float32).  The tokenizer from the file's metadata is ``.tokenizer``."""
        from kvsimd.errors import KVSimdError
        from kvsimd.gguf_model import GGUFError, decoder_kwargs_from_gguf
        from kvsimd.tokenizer import Tokenizer
        kwargs, reader = decoder_kwargs_from_gguf(path)
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
                 n_discard=None) -> Iterator:
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
        ``n_discard`` and ``cache_dtype`` are those of :meth:`new_cache`.  With ``policy="fixed"``,
        a sequence whose cache fills before ``max_new_tokens`` makes the generator raise
        :class:`kvsimd.KVSimdCapacityError` (naming the sequence and the capacity) at the
        ``next()`` after its last token; the tokens already yielded stay yielded.  The other
        policies never fill (see :meth:`new_cache`)."""
        self._ensure_valid()
        prompts, batched = _prompts(prompt, self.cfg.vocab_size, "prompt")
        return _generate(self, prompts, batched, None, max_new_tokens, temperature, top_k, top_p, seed,
                         stop_tokens, cache_dtype, capacity, dict(n_keep=n_keep, policy=policy, n_discard=n_discard))


def _generate(model, prompts, batched, sources, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
              cache_dtype, capacity, streaming=None):
    """Check every argument and make the cache now; return the token stream (which prefills at
    its first next())."""
    params = _sampling_params(temperature, top_k, top_p)
    max_new_tokens = _need_int(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 0:
        raise KVSimdValueError("max_new_tokens must be >= 0, got %d" % max_new_tokens)
    if seed is not None and (_need_int(seed, "seed") < 0):
        raise KVSimdValueError("seed must be None or an integer >= 0, got %d" % seed)
    if stop_tokens is None:
        stop_tokens = ()
    if not isinstance(stop_tokens, (list, tuple, set, frozenset, range, np.ndarray)) or \
            (isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim != 1):
        raise KVSimdTypeError("stop_tokens must be a list of token ids, got %s" % _short(stop_tokens))
    if len(stop_tokens) > model.cfg.vocab_size:
        raise KVSimdValueError("stop_tokens has %d ids, more than the vocabulary's %d"
                               % (len(stop_tokens), model.cfg.vocab_size))
    stop_tokens = list(stop_tokens)
    stop = set(_tokens_1d(stop_tokens, model.cfg.vocab_size, "stop_tokens").tolist()) if stop_tokens else set()
    longest = max(len(p) for p in prompts)
    if capacity is None:
        capacity = longest + max_new_tokens
    elif _need_int(capacity, "capacity") < longest:
        b = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise KVSimdCapacityError("capacity=%d is smaller than prompt %d (%d tokens)" % (capacity, b, longest))
    cache = model.new_cache(batch=len(prompts), capacity=capacity, dtype=cache_dtype, **(streaming or {}))
    # the last position any token will take: the cache never holds more than capacity tokens, and
    # the last generated token is never fed back
    model._check_position(min(cache.capacity, longest + max(max_new_tokens, 1) - 1) - 1)
    if sources is not None:
        for b, src in enumerate(sources):
            model._check_source(len(src), "src[%d]" % b if batched else "src")
    rng = np.random.default_rng(seed)
    return _stream(model, prompts, batched, sources, cache, cache_dtype, max_new_tokens, params, rng, stop)


def _stream(model, prompts, batched, sources, cache, cache_dtype, max_new_tokens, params, rng, stop):
    if max_new_tokens == 0:
        return
    B = len(prompts)
    cross = model.cross_for(sources, cache_dtype) if sources is not None else None
    logits = np.stack([model._prefill_logits(p, cache, b, cross) for b, p in enumerate(prompts)])
    done = [False] * B
    last = [p[-1] for p in prompts]
    for i in range(max_new_tokens):
        for b in range(B):
            if not done[b]:
                tok = _sample(logits[b], rng, *params, what="logits of sequence %d at new token %d" % (b, i))
                done[b] = tok in stop          # a stop token ends the sequence: it is not yielded
                last[b] = tok
        if all(done):
            return
        out = [None if done[b] else last[b] for b in range(B)]
        yield out if batched else out[0]
        if i + 1 == max_new_tokens:
            return
        if cache.policy == "fixed":
            lengths = cache.lengths
            for b in range(B):
                if lengths[b] == cache.capacity:
                    if not done[b]:
                        raise KVSimdCapacityError(
                            "generate: sequence %d filled its cache (capacity %d) after %d of max_new_tokens=%d "
                            "new tokens; pass a larger capacity, or a streaming policy" % (b, cache.capacity, i + 1,
                                                                                         max_new_tokens))
                    cache._forget(b, 1)    # a finished sequence's cache is never read again
        logits = model._step_logits(last, cache, cross)


class EncoderDecoder(_Stack):
    """An encoder-decoder transformer (BART, Marian): the encoder runs once per request, its
    output is projected to cross-attention K/V once per layer, and the decoder steps with a
    self-attention KV cache.  Each half reports the token positions it processed through
    :mod:`kvsimd.observe` (seed 003's complexity accounting: kvsimd.bench.complexity)."""

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
        emb = self.__dict__.get("enc_embed")
        need_weight(self.embed if emb is None else emb, "enc_embed", (ec.vocab_size, ec.d_model))
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

    def encode(self, src):
        """Encoder output ``[S, d_model]`` (bidirectional attention, no cache)."""
        self._ensure_valid()
        ec = self.enc_cfg
        t = _tokens_1d(src, ec.vocab_size, "src")
        S = t.size
        self._check_source(S)
        pos = np.arange(S, dtype=np.int64)
        emb = getattr(self, "enc_embed", None)
        x = (self.embed if emb is None else emb)[t] * np.float32(ec.embed_scale)
        if self.enc_pos is not None and ec.position in ("learned", "sinusoidal"):
            x = x + self.enc_pos[pos + ec.position_offset]
        if self.enc_embed_norm is not None:
            x = norm(ec, x, self.enc_embed_norm.w, self.enc_embed_norm.b)
        x = x.astype(F32)
        for lw in self.enc_layers:
            def attend(h, lw=lw):
                q, k, v = self._qkv(lw.attn, h, ec)
                return merge_heads(causal_attention(split_heads(q, ec.n_heads, ec.head_dim),
                                                    split_heads(k, ec.n_kv_heads, ec.head_dim),
                                                    split_heads(v, ec.n_kv_heads, ec.head_dim), 0, None, causal=False))
            if ec.pre_norm:
                x = x + linear(attend(norm(ec, x, lw.norm1.w, lw.norm1.b)), lw.attn.wo, lw.attn.bo)
                x = x + ffn(ec, lw.ffn, norm(ec, x, lw.norm2.w, lw.norm2.b))
            else:
                x = norm(ec, x + linear(attend(x), lw.attn.wo, lw.attn.bo), lw.norm1.w, lw.norm1.b)
                x = norm(ec, x + ffn(ec, lw.ffn, x), lw.norm2.w, lw.norm2.b)
        if self.enc_final_norm is not None:
            x = norm(ec, x, self.enc_final_norm.w, self.enc_final_norm.b)
        notify(self, "positions", "encoder", S)
        return x.astype(F32)

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
            cross.fill(b, self.encode(s), self.layers, self.cfg.n_kv_heads, self.cfg.head_dim)
            notify(self, "cross_projections", len(self.layers))
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
    def from_transformers(cls, model):
        """Import a loaded Hugging Face encoder-decoder (BART, Marian)."""
        from kvsimd.hf import encoder_decoder_from_transformers
        return encoder_decoder_from_transformers(cls, model)
