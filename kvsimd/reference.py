"""Plain NumPy float64 references for kvsimd's kernels and models.

Slow and simple on purpose: the tests compare every ISA path against these, and users can
use them to check kvsimd on their own data.  Inputs of any float dtype are widened to float64
(so fp16 caches are compared against exact math on their fp16-rounded values).

The second half is a whole transformer in float64 (:func:`forward`, :func:`encode`,
:func:`layer`), the oracle of kvsimd's compiled layers.  It reads a model by duck typing
(``model.cfg``, ``model.embed``, ``model.layers``...) and imports nothing of kvsimd but its
errors and, for a config with ``rope_scaling``, the one function of the scaling formulas
(``kvsimd.nn.config.rope_frequencies``, itself checked against transformers), so no library path
depends on it and it does not depend on where the model classes live."""
from __future__ import annotations

import math

import numpy as np

from kvsimd.errors import KVSimdTypeError, KVSimdValueError

__all__ = ["attend", "query_as_read", "query_rows", "attention_weights", "attention_scores", "alibi_distances", "rope_angles", "apply_rope",
           "shift_keys", "rotate_pairs", "alibi_slopes", "sinusoidal_table", "activation", "norm", "ffn", "layer",
           "encode", "forward"]


def _scores(q, k, scale, alibi_slopes, distances, softcap=None):
    """float64 scores ``[H, N]`` of q against k (GQA: query head h reads KV head h // (H // Hkv));
    with ``softcap`` the scaled dot product s becomes ``softcap * tanh(s / softcap)`` (Gemma 2),
    then ALiBi subtracts ``slope * distance`` (distance = query position - key position)."""
    H, D = q.shape
    Hkv, N, _ = k.shape
    kh = np.repeat(k, H // Hkv, axis=0)
    s = np.einsum("hd,hnd->hn", q, kh) * float(1.0 / np.sqrt(D) if scale is None else scale)
    if softcap:
        s = float(softcap) * np.tanh(s / float(softcap))
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[:, None] * distances[None, :]
    return s


def alibi_distances(n_keys, key_positions=None, query_position=None, ranges=None):
    """float64 ``query position - key position`` of every key ``[N]``, as :func:`attention_weights`
    reads them: key positions default to the slots, the query position to N - 1, and a range
    ``(t0, t1, use_q_alt, query_position)`` has its own query position (keys outside every
    range: 0)."""
    N = int(n_keys)
    kp = np.arange(N, dtype=np.float64) if key_positions is None else np.asarray(key_positions, np.float64)
    qp = N - 1 if query_position is None else query_position
    if ranges is None:
        return float(qp) - kp
    d = np.zeros(N)
    for r in ranges:
        t0, t1 = int(r[0]), int(r[1])
        d[t0:t1] = float(r[3] if len(r) > 3 else qp) - kp[t0:t1]
    return d


def attention_scores(q, k, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None,
                     ranges=None, q_alt=None, softcap=None):
    """float64 scores ``[H, N]`` of single-query attention (GQA/MQA), before the softmax:
    ``scale * q . k``, capped to ``softcap * tanh(s / softcap)`` when ``softcap`` is given (not
    None or 0), then less the ALiBi bias.

    ``ranges`` (as :func:`kvsimd.ops.attend`): only the keys of the ranges are scored, a range
    with ``use_q_alt`` with ``q_alt``, its ALiBi distances from its own query position; keys
    outside every range score -inf."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.ndim != 2 or k.ndim != 3 or q.shape[1] != k.shape[2]:
        raise KVSimdValueError("q [H, D] and k [Hkv, N, D] must agree, got shapes %s and %s" % (q.shape, k.shape))
    Hkv, N, _ = k.shape
    H = q.shape[0]
    if H < 1 or Hkv < 1 or H % Hkv:   # the rule ops.attend checks
        raise KVSimdValueError("query heads H=%d must be a positive multiple of KV heads Hkv=%d" % (H, Hkv))
    if alibi_slopes is not None and np.shape(alibi_slopes) != (H,):
        raise KVSimdValueError("alibi_slopes must have one slope per query head (%d), got shape %s"
                               % (H, np.shape(alibi_slopes)))
    for r in ranges or ():
        if not 0 <= int(r[0]) <= int(r[1]) <= N:
            raise KVSimdValueError("range %r must lie within the %d keys" % (tuple(r), N))
    dist = alibi_distances(N, key_positions, query_position, ranges)
    if ranges is None:
        return _scores(q, k, scale, alibi_slopes, dist, softcap)
    s = np.full((q.shape[0], N), -np.inf)
    for r in ranges:
        t0, t1 = int(r[0]), int(r[1])
        qq = np.asarray(q_alt, np.float64) if len(r) > 2 and r[2] else q
        s[:, t0:t1] = _scores(qq, k[:, t0:t1], scale, alibi_slopes, dist[t0:t1], softcap)
    return s


def attention_weights(q, k, **kw):
    """float64 softmax weights ``[H, N]`` of single-query attention (GQA/MQA, optional soft cap
    and ALiBi): the softmax of :func:`attention_scores` (keywords as there), one softmax over
    the keys of all ranges; keys outside every range get weight 0."""
    s = attention_scores(q, k, **kw)
    s = s - s.max(axis=1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=1, keepdims=True)


def query_rows(T, n_keys, *, causal_offset=None, causal=True, window=None, query_position=None, ranges=None,
               q_alt=None, **kw):
    """The single-query keywords of each of T query rows (as :func:`kvsimd.ops.attend` with q
    ``[T, H, D]``): row t reads the ranges' keys (default all) up to ``causal_offset + t``
    (default offset N - T; every key with ``causal=False``), with ``window`` W only those above
    ``causal_offset + t - W``; its query position (ALiBi) is ``query_position + t``, default the
    offset, a range's own + t; ``q_alt`` row t.  Returns a list of T keyword dicts."""
    N = int(n_keys)
    off = N - T if causal_offset is None else int(causal_offset)
    if window is not None and int(window) < 0:
        raise KVSimdValueError("window must be None or >= 0 (0: no window), got %d" % int(window))
    if causal and off < 0:
        raise KVSimdValueError("causal rows need causal_offset >= 0 (row 0 reads keys 0..offset), got %d "
                               "(%d rows over %d keys)" % (off, T, N))
    qp0 = off if query_position is None else int(query_position)
    base = [(0, N)] if ranges is None else ranges
    out = []
    for t in range(T):
        hi = off + t + 1 if causal else N
        lo = hi - window if (causal and window) else 0
        rr = []
        for r in base:
            t0, t1 = max(int(r[0]), lo), min(int(r[1]), hi)
            if t0 < t1:
                rr.append((t0, t1, bool(r[2]) if len(r) > 2 else False, (int(r[3]) if len(r) > 3 else qp0) + t))
        out.append(dict(kw, ranges=rr, query_position=qp0 + t, q_alt=None if q_alt is None else q_alt[t]))
    return out


def attend(q, k, v, **kw):
    """float64 attention ``softmax(cap(scale * k @ q) + bias) @ v``: q ``[H, D]`` returns ``[H, D]``
    (keywords as :func:`attention_scores`); q ``[T, H, D]`` returns ``[T, H, D]``, row t as
    :func:`query_rows` says (keywords also ``causal_offset``, ``causal``, ``window``)."""
    if np.ndim(q) == 3:
        return np.stack([attend(q[t], k, v, **rkw) for t, rkw in enumerate(query_rows(len(q), np.shape(k)[1], **kw))])
    p = attention_weights(q, k, **kw)
    v = np.asarray(v, dtype=np.float64)
    return np.einsum("hn,hnd->hd", p, np.repeat(v, p.shape[0] // v.shape[0], axis=0))


def rope_angles(positions, *, theta=10000.0, rotary_dim, inv_freq=None):
    """Angles ``[N, rotary_dim/2]``: ``position * inv_freq[i]`` in float64, ``inv_freq``
    defaulting to ``theta ** (-2i / rotary_dim)``."""
    pos = np.asarray(positions, dtype=np.float64)
    if inv_freq is None:
        i = np.arange(rotary_dim // 2, dtype=np.float64)
        inv = float(theta) ** (-2.0 * i / rotary_dim)
    else:
        inv = np.asarray(inv_freq, dtype=np.float64)
    return pos[:, None] * inv[None, :]


def rotate_pairs(x, angles, *, style="gptj", rotary_dim=None, scale=1.0):
    """Rotate the pairs of ``x [H, N, D]`` by ``angles [N, R]`` and multiply them by ``scale``;
    returns a new float64 array."""
    x = np.array(x, dtype=np.float64)
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    R = rd // 2
    c, s = np.cos(angles)[None] * scale, np.sin(angles)[None] * scale
    if style == "gptj":
        a, b = x[..., 0:rd:2].copy(), x[..., 1:rd:2].copy()
        x[..., 0:rd:2] = a * c - b * s
        x[..., 1:rd:2] = b * c + a * s
    elif style == "neox":
        a, b = x[..., :R].copy(), x[..., R:rd].copy()
        x[..., :R] = a * c - b * s
        x[..., R:rd] = b * c + a * s
    else:
        raise ValueError("style must be 'gptj' or 'neox'")
    return x


def apply_rope(x, positions, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None, attn_factor=1.0):
    """float64 RoPE of ``x [H, N, D]`` at ``positions [N]`` (pairs multiplied by ``attn_factor``);
    returns a new array."""
    rd = np.shape(x)[-1] if rotary_dim is None else rotary_dim
    return rotate_pairs(x, rope_angles(positions, theta=theta, rotary_dim=rd, inv_freq=inv_freq), style=style,
                        rotary_dim=rd, scale=attn_factor)


def shift_keys(k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None, start=0, stop=None):
    """float64 rotation of tokens ``start..stop-1`` of ``k [Hkv, N, D]`` by ``delta`` positions
    (the rotation alone: no attention factor)."""
    k = np.array(k, dtype=np.float64)
    stop = k.shape[1] if stop is None else stop
    rd = k.shape[-1] if rotary_dim is None else rotary_dim
    ang = rope_angles(np.full(stop - start, delta), theta=theta, rotary_dim=rd, inv_freq=inv_freq)
    k[:, start:stop] = rotate_pairs(k[:, start:stop], ang, style=style, rotary_dim=rd)
    return k


# ------------------------------------------------------------------------------ the model
# Rules (those of kvsimd's decoders; only the precision differs):
#   x0 = embed[token] * embed_scale  (+ pos_table[position + position_offset] for learned /
#        sinusoidal positions)  (-> embed_norm when cfg.embed_norm)
#   pre-norm layer:   x += attn(norm1 x); [x += cross(norm_cross x)]; x += ffn(norm2 x)
#        parallel:    x += attn(norm1 x) + ffn(norm2 x)
#   post-norm layer:  x = norm1(x + attn x); [x = norm_cross(x + cross x)]; x = norm2(x + ffn x)
#   logits = (final_norm x when cfg.final_norm) @ lm_head + lm_bias  (-> c tanh(logits / c), c = final_softcap)
#   post_norms: attn(h) and ffn(h) above are normed by post_norm1 / post_norm2 before the add
# Weights are [in, out]; attention is softmax(q.k * attn_scale (default 1/sqrt(head_dim)) - slope *
# distance) (scores capped to c tanh(s / c) first, c = attn_softcap) over the keys at or before the query (the last attn_windows[layer] of them when > 0)
# or over all keys (encoder, cross-attention); qk_norm norms every q and k head before RoPE; RoPE
# rotates q and k at their positions; rmsnorm has no bias.
# Refused (KVSimdValueError), having no single rule in kvsimd today: parallel_residual with
# post-norm (the decoder ignores the flag) or with cross-attention (prefill skips the
# cross-attention, the compiled step adds it), and an encoder with rope / alibi positions or
# parallel_residual (the encoder ignores them).

def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _stored(w):
    """A weight kept as a file stores it (kvsimd's QMatrix: ``raw()`` bytes of GGUF type
    ``ggml_type``, rows of ``cols`` values) as float64 ``[rows, cols]``, dequantized by the
    ``gguf`` package's own routines (not kvsimd's kernels)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return np.asarray(dequantize(np.asarray(w.raw()), GGMLQuantizationType(w.ggml_type)),
                      dtype=np.float64).reshape(w.shape)


def _matrix(w):
    """A projection ``[in, out]`` in float64: a float array as given, a stored weight ``[out, in]``
    (or a tuple of parts stacked along out) transposed."""
    if isinstance(w, (tuple, list)):
        return np.concatenate([_stored(p) for p in w], axis=0).T
    return _stored(w).T if hasattr(w, "ggml_type") else _f64(w)


def _table(t):
    """An embedding table ``[rows, d]`` in float64 (stored weights dequantized by gguf)."""
    return _stored(t) if hasattr(t, "ggml_type") else _f64(t)


def alibi_slopes(n_heads):
    """float64 ALiBi slopes of ``n_heads`` heads: for the largest power of two p <= n_heads,
    ``2 ** (-8 (i + 1) / p)``; the remaining heads take every other slope of 2p heads
    (``2 ** (-8 (2 i + 1) / (2 p))``), as BLOOM does."""
    n = int(n_heads)
    p = 1 << (n.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / p) for i in range(p)]
    slopes += [2.0 ** (-8.0 * (2 * i + 1) / (2 * p)) for i in range(n - p)]
    return np.array(slopes, dtype=np.float64)


def sinusoidal_table(n_positions, dim):
    """float64 ``[n_positions, dim]``: ``sin(p * 10000 ** (-2i / dim))`` in the first ``dim // 2``
    columns and the matching ``cos`` in the next ``dim // 2`` (Marian's layout)."""
    half = dim // 2
    ang = np.arange(n_positions, dtype=np.float64)[:, None] * 10000.0 ** (-2.0 * np.arange(half) / dim)[None, :]
    table = np.zeros((n_positions, dim))
    table[:, :half], table[:, half:2 * half] = np.sin(ang), np.cos(ang)
    return table


_erf = np.frompyfunc(math.erf, 1, 1)


def activation(name, x):
    """float64 ``silu``, ``gelu`` (exact, with erf), ``gelu_tanh`` or ``relu`` of ``x``."""
    x = np.asarray(x, dtype=np.float64)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise KVSimdValueError("activation must be one of silu, gelu, gelu_tanh, relu, got %r" % (name,))


def norm(cfg, nw, x):
    """float64 ``cfg.norm`` of the rows of ``x`` with the weights ``nw.w`` (and, for layernorm,
    the bias ``nw.b`` if set): rmsnorm ``x / sqrt(mean(x^2) + eps) * w``, layernorm
    ``(x - mean) / sqrt(var + eps) * w + b``."""
    x = np.asarray(x, dtype=np.float64)
    eps = float(cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(nw.w)
    if cfg.norm == "layernorm":
        xc = x - x.mean(axis=-1, keepdims=True)
        y = xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps) * _f64(nw.w)
        return y if nw.b is None else y + _f64(nw.b)
    raise KVSimdValueError("cfg.norm must be rmsnorm or layernorm, got %r" % (cfg.norm,))


def int8_rows(x):
    """x as int8 activations see it (``QMatrix(..., activations="int8")``; kvsimd.h
    kv_quantize_x): each block of 32 values of a row rounded to the nearest multiple of
    ``max |block| / 127`` (ties to even)."""
    b = np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, 32)
    step = np.abs(b).max(axis=-1, keepdims=True) / 127.0
    q = np.rint(np.divide(b, step, out=np.zeros_like(b), where=step > 0))
    return (q * step).reshape(np.shape(x))


KV_I8_BLOCK = 32   # values per scale of an int8 or int4 KV row (kvsimd.h)
KV_QRANGE = {"int8": (-127, 127), "int4": (-8, 7)}   # the integers of each quantized KV dtype


def hadamard_rows(x, _back=True):
    """Every whole block of 32 values of the last axis of ``x`` times the 32 x 32 Sylvester-Hadamard
    matrix H of +-1 (H H = 32 I), a shorter last block unchanged: the block times 1/32, the
    butterflies (a, b) -> (a + b, a - b) at distances 1, 2, 4, 8, 16, then times 32, in x's own
    precision (float32: the C kernel's roundings, kvsimd.h kv_hadamard_rows; the powers of 2 keep
    the sums in range wherever the result is, and change no bit elsewhere but for values below
    2**-120).  Returns a new array."""
    x = np.array(x)
    D = x.shape[-1]
    w = D // KV_I8_BLOCK * KV_I8_BLOCK
    b = x[..., :w].reshape(x.shape[:-1] + (w // KV_I8_BLOCK, KV_I8_BLOCK))
    b *= x.dtype.type(1.0 / KV_I8_BLOCK)
    h = 1
    while h < KV_I8_BLOCK:
        v = b.reshape(b.shape[:-1] + (KV_I8_BLOCK // (2 * h), 2, h))
        lo, hi = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :], v[..., 1, :] = lo + hi, lo - hi
        h *= 2
    if _back:
        b *= x.dtype.type(KV_I8_BLOCK)
    x[..., :w] = b.reshape(x.shape[:-1] + (w,))
    return x


def quantize_kv(x, dtype="int8", hadamard=False):
    """The quantized KV cache's rule (kvsimd.ops.quantize_kv), in NumPy float32: each row of the
    last axis in blocks of 32 values (the last shorter) and ``q = rint(block / scale)`` (ties to
    even), within half a step of the block: int8 ``scale = max |block| / 127``; int4 (q in -8..7)
    the smallest ``|scale|`` that keeps that, :func:`int4_scale`.  A block with NaN or infinity
    gets scale NaN and q 0.  ``hadamard``: each whole block turned first, H x /
    32 (:func:`hadamard_rows` without its final times 32), so that q * scale stands for H x / 32.  Returns (q, scale float32 x.shape[:-1] +
    (blocks,)): int8 q of x.shape, or for int4 q packed as the cache stores it (:func:`pack_int4`)."""
    if not isinstance(dtype, str) or dtype not in KV_QRANGE:
        raise KVSimdValueError("dtype must be 'int8' or 'int4', got %r" % (dtype,))
    qmin, qmax = KV_QRANGE[dtype]
    x = np.asarray(x, np.float32)
    if hadamard:
        x = hadamard_rows(x, _back=False)
    D = x.shape[-1]
    nb = -(-D // KV_I8_BLOCK)
    pad = np.zeros(x.shape[:-1] + (nb * KV_I8_BLOCK,), np.float32)
    pad[..., :D] = x
    b = pad.reshape(x.shape[:-1] + (nb, KV_I8_BLOCK))
    amax = np.abs(b).max(axis=-1)
    bad = ~np.isfinite(b).all(axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        scale = (amax / np.float32(qmax)).astype(np.float32) if dtype == "int8" else \
            int4_scale(np.where(bad[..., None], np.float32(0), b))
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.rint(np.where(scale[..., None] != 0, b / np.where(scale != 0, scale, 1)[..., None], 0))
    q = np.clip(np.where(bad[..., None], 0, q), qmin, qmax).astype(np.int8)
    scale = np.where(bad, np.float32(np.nan), scale).astype(np.float32)
    q = q.reshape(pad.shape)
    return (q[..., :D].copy() if dtype == "int8" else pack_int4(q)), scale


def int4_scale(blocks):
    """The int4 step of each block (``blocks [..., 32]`` float32, finite): levels -8..7 times
    s > 0 reach from -8.5 s to 7.5 s, so ``|s| = max(neg / 8.5, pos / 7.5)`` (neg, pos: the largest
    magnitudes of the block's negative and positive values), taken up an ulp at a time until both
    float32 quotients are below 8.5 and 7.5, so that no value is clamped; s < 0 mirrors the levels
    and is taken where it gives the smaller step (s > 0 on a tie).  float32 ``blocks.shape[:-1]``."""
    b = np.asarray(blocks, np.float32)
    pos = np.maximum(b, 0).max(axis=-1).astype(np.float32)
    neg = np.maximum(-b, 0).max(axis=-1).astype(np.float32)

    def step(top, other):   # |s| with `top` on the side of -8
        s = np.maximum(top / np.float32(8.5), other / np.float32(7.5)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            while True:
                up = ((top > 0) | (other > 0)) & ~((top / s < np.float32(8.5)) & (other / s < np.float32(7.5)))
                if not up.any():
                    return s
                s = np.where(up, np.nextafter(s, np.float32(np.inf)), s).astype(np.float32)

    sp, sn = step(neg, pos), step(pos, neg)
    return np.where(sp <= sn, sp, -sn).astype(np.float32)


def pack_int4(q):
    """int8 values in -8..7, ``[..., 32 * blocks]``, as an int4 cache stores them: uint8
    ``[..., 16 * blocks]``, byte i of block b holding value 32 b + i + 8 in its low nibble and
    value 32 b + 16 + i + 8 in its high one (kvsimd.h KV_I4)."""
    q = np.asarray(q, np.int16)
    b = (q + 8).astype(np.uint8).reshape(q.shape[:-1] + (-1, 2, 16))
    return (b[..., 0, :] | (b[..., 1, :] << 4)).reshape(q.shape[:-1] + (-1,))


def unpack_int4(q, D):
    """The int8 values (-8..7) ``[..., D]`` of int4 rows ``q`` (uint8 ``[..., 16 * ceil(D / 32)]``)."""
    b = np.asarray(q, np.uint8).reshape(np.shape(q)[:-1] + (-1, 16))
    v = np.stack([b & 15, b >> 4], axis=-2).astype(np.int8) - 8
    return v.reshape(np.shape(q)[:-1] + (-1,))[..., :D]


def dequantize_kv(q, scale, D=None):
    """The float32 values int8 or int4 (uint8, head_dim ``D``: default twice its last axis) K/V stand
    for, ``q[d] * scale[d // 32]`` (one float32 rounding): what the attention kernels widen each row to."""
    q = np.asarray(q)
    if q.dtype == np.uint8:
        q = unpack_int4(q, 2 * q.shape[-1] if D is None else D)
    per = np.repeat(np.asarray(scale, np.float32), KV_I8_BLOCK, axis=-1)[..., :q.shape[-1]]
    return (q.astype(np.float32) * per).astype(np.float32)


_KV_KINDS = ("float", "int8", "int4", "int8/int4", "int4/int8", "int8/int8", "int4/int4")


def _kv_kind(kv):
    """(name, hadamard) of a kind of K/V (:func:`_as_cached`), checked: a name of _KV_KINDS, or a
    (name, bool) pair."""
    pair = isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[1], (bool, np.bool_))
    name = kv[0] if pair else kv
    if not isinstance(name, str) or name not in _KV_KINDS:
        raise KVSimdValueError("kv must be one of %s (or (name, hadamard)), got %r" % (", ".join(_KV_KINDS), kv))
    return (name, bool(kv[1])) if pair else (name, "int4" in name.split("/"))


def _as_cached(kv, x, D, which=0):
    """K (``which`` 0) or V (1) rows ``x`` as a cache of kind ``kv`` holds them: "float" as they are;
    "int8" / "int4" / "int8/int4" (int8 keys, int4 values) quantized as KVCache(dtype=...) stores
    them by default (turned by H when K or V is int4, else not); ("int4", False) or ("int8", True)
    to choose the turn.  Returns float64."""
    name, had = _kv_kind(kv)
    dtype = name.split("/")[which] if "/" in name else name
    if dtype == "float":
        return x
    y = dequantize_kv(*quantize_kv(x, dtype, had), D).astype(np.float64)
    return hadamard_rows(y) if had else y


def query_as_read(q, kv):
    """The query rows ``q [..., D]`` as attention over K of kind ``kv`` (:func:`_as_cached`'s
    kinds) reads them, float64: over int8 or int4 keys each query vector is rounded by the int8
    keys' rule (:func:`quantize_kv` to int8, in float32; turned with the keys when they are turned),
    so that the kernel scores full blocks of keys with exact integer dot products (attn.inc.h
    round_query; int4 keys read as int8 ones); else ``q`` as it is.  The softmax scale applies after
    the rounding."""
    name, had = _kv_kind(kv)
    if name.split("/")[0] not in ("int8", "int4"):
        return q
    return _as_cached(("int8", had), np.asarray(q, np.float32), np.shape(q)[-1], 0)


def _linear(x, w, b=None):
    parts = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    if any(getattr(p, "activations", None) == "int8" for p in parts):   # each part sees x its own way
        y = np.concatenate([(int8_rows(x) if getattr(p, "activations", None) == "int8" else x) @ _matrix(p)
                            for p in parts], axis=-1)
    else:
        y = x @ _matrix(w)
    return y if b is None else y + _f64(b)


def ffn(cfg, f, x):
    """float64 feed-forward: ``act(x w1) * (x w3)`` when ``cfg.ffn_gated``, else ``act(x w1 + b1)``;
    then ``@ w2 + b2``."""
    if cfg.ffn_gated:
        h = activation(cfg.activation, _linear(x, f.w1, f.b1)) * _linear(x, f.w3)
    else:
        h = activation(cfg.activation, _linear(x, f.w1, f.b1))
    return _linear(h, f.w2, f.b2)


def _heads(x, n, D):
    """[T, n * D] -> [n, T, D]"""
    return x.reshape(x.shape[0], n, D).transpose(1, 0, 2)


def _attention(q, k, v, positions=None, slopes=None, window=0, **kw):
    """Rows ``[T, H * D]`` of the attention of ``q [H, T, D]`` over ``k, v [Hkv, S, D]``: causal
    (query i reads keys 0..i, at ``positions``; with ``window`` > 0 only the last ``window`` of
    them) when ``positions`` is given, else over all keys.  ``kw``: :func:`attend`'s scale."""
    H, T, D = q.shape
    out = np.empty((T, H * D))
    for i in range(T):
        if positions is None:
            o = attend(q[:, i], k, v, **kw)
        else:
            j = max(0, i + 1 - window) if window else 0
            o = attend(q[:, i], k[:, j:i + 1], v[:, j:i + 1], alibi_slopes=slopes,
                       key_positions=positions[j:i + 1], query_position=positions[i], **kw)
        out[i] = o.reshape(-1)
    return out


def _head_norm(cfg, nw, x):
    """``cfg.norm`` of each head (``head_dim`` wide) of the rows ``x [n, T, D]``."""
    return norm(cfg, nw, x)


def _self_attention(cfg, a, h, positions, window=0, qk=None, kv="float"):
    """Causal self-attention at ``positions`` (RoPE / ALiBi by the config), or bidirectional
    without position terms when ``positions`` is None (the encoder).  ``qk``: the norms of each
    q and k head (cfg.qk_norm), before RoPE; ``window``: the layer's attention window; ``kv``
    "int8" / "int4" / "int8/int4" (or (dtype, hadamard)): K (after RoPE) and V read as such a cache stores them
    (:func:`_as_cached`)."""
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = _heads(_linear(h, a.wq, a.bq), H, D)
    k = _heads(_linear(h, a.wk, a.bk), Hkv, D)
    v = _heads(_linear(h, a.wv, a.bv), Hkv, D)
    if qk is not None:
        q, k = _head_norm(cfg, qk[0], q), _head_norm(cfg, qk[1], k)
    slopes = None
    if positions is not None and cfg.position == "rope":
        from kvsimd.nn.config import rope_frequencies   # the scaling formulas (checked against transformers)
        inv, att = rope_frequencies(cfg)
        rope = dict(theta=cfg.rope_theta, style=cfg.rope_style, inv_freq=inv, attn_factor=att,
                    rotary_dim=cfg.head_dim if cfg.rotary_dim is None else cfg.rotary_dim)
        q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    elif positions is not None and cfg.position == "alibi":
        slopes = alibi_slopes(H)
    q, k, v = query_as_read(q, kv), _as_cached(kv, k, D, 0), _as_cached(kv, v, D, 1)
    scale, cap = getattr(cfg, "attn_scale", None), getattr(cfg, "attn_softcap", 0.0) or None
    return _linear(_attention(q, k, v, positions, slopes, window, scale=scale, softcap=cap), a.wo, a.bo)


def _cross_attention(cfg, a, h, enc_out, kv="float"):
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = _heads(_linear(h, a.wq, a.bq), H, D)
    k, v = (_heads(_linear(enc_out, w, b), Hkv, D) for w, b in ((a.wk, a.bk), (a.wv, a.bv)))
    q, k, v = query_as_read(q, kv), _as_cached(kv, k, D, 0), _as_cached(kv, v, D, 1)
    return _linear(_attention(q, k, v), a.wo, a.bo)


def _check_layer_rules(cfg, what, cross):
    if cfg.parallel_residual and not cfg.pre_norm:
        raise KVSimdValueError("%s.parallel_residual=True needs pre_norm=True: a parallel post-norm layer is "
                               "not defined" % what)
    if cfg.parallel_residual and cross:
        raise KVSimdValueError("%s.parallel_residual=True with cross-attention is not defined" % what)


def layer(cfg, lw, x, positions=None, enc_out=None, window=0, kv="float"):
    """One float64 layer over the rows ``x [T, d_model]``.  ``positions`` (``[T]``) makes the
    self-attention causal at those positions (RoPE / ALiBi); None makes it bidirectional with no
    position terms (the encoder).  ``enc_out [S, d_source]`` adds cross-attention over it.
    ``window`` > 0: each query reads its last ``window`` keys only.  With ``cfg.post_norms`` the
    attention and FFN outputs are normed (post_norm1, post_norm2) before their residual adds.
    ``kv="int8"``, ``"int4"`` or ``"int8/int4"``: the self- and cross-attention read K/V as such caches
    store them."""
    x = np.asarray(x, dtype=np.float64)
    cross = enc_out is not None
    _check_layer_rules(cfg, "cfg", cross)
    pos = None if positions is None else np.asarray(positions, dtype=np.int64)
    qk = (lw.q_norm, lw.k_norm) if getattr(cfg, "qk_norm", False) else None
    post = getattr(cfg, "post_norms", False)

    def attn(h):
        a = _self_attention(cfg, lw.attn, h, pos, window, qk, kv)
        return norm(cfg, lw.post_norm1, a) if post else a

    def ff(h):
        f = ffn(cfg, lw.ffn, h)
        return norm(cfg, lw.post_norm2, f) if post else f

    if cfg.pre_norm:
        a = attn(norm(cfg, lw.norm1, x))
        if cfg.parallel_residual:
            return x + a + ff(norm(cfg, lw.norm2, x))
        x = x + a
        if cross:
            x = x + _cross_attention(cfg, lw.cross, norm(cfg, lw.norm_cross, x), enc_out, kv)
        return x + ff(norm(cfg, lw.norm2, x))
    x = norm(cfg, lw.norm1, x + attn(x))
    if cross:
        x = norm(cfg, lw.norm_cross, x + _cross_attention(cfg, lw.cross, x, enc_out, kv))
    return norm(cfg, lw.norm2, x + ffn(cfg, lw.ffn, x))


def _ids(tokens, vocab, what):
    t = np.asarray(tokens)
    if t.ndim != 1 or t.size == 0 or t.dtype.kind not in "iu":
        raise KVSimdValueError("%s must be a non-empty 1-D array of integer token ids, got %r" % (what, tokens))
    if t.min() < 0 or t.max() >= vocab:
        raise KVSimdValueError("%s has ids outside 0..%d: %s" % (what, vocab - 1, t[(t < 0) | (t >= vocab)][:5]))
    return t.astype(np.int64)


def _norm_weights(cfg, flag, nw, what, cfg_name):
    """The norm weights ``nw`` the config flag ``cfg_name.flag`` asks for (None when it is False)."""
    on = getattr(cfg, flag)
    if bool(on) != (nw is not None):
        raise KVSimdValueError("%s.%s is %s but %s is %s" % (cfg_name, flag, on, what,
                                                             "None" if nw is None else "set"))
    return nw


def _embed(cfg, table, pos_table, embed_norm, t, positions, what):
    """float64 input rows of tokens ``t`` at ``positions`` (token embedding, position table, norm)."""
    x = _table(table)[t] * float(cfg.embed_scale)
    if cfg.position in ("learned", "sinusoidal"):
        rows = positions + int(cfg.position_offset)
        if pos_table is None:
            if cfg.position == "learned":
                raise KVSimdValueError("%s: learned positions need a position table, got None" % what)
            pos_table = sinusoidal_table(int(rows.max()) + 1, cfg.d_model)
        if rows.min() < 0 or rows.max() >= len(pos_table):
            raise KVSimdValueError("%s: positions %d..%d (+ position_offset %d) are outside the %d-row position "
                                   "table" % (what, positions.min(), positions.max(), cfg.position_offset,
                                              len(pos_table)))
        x = x + _f64(pos_table)[rows]
    if embed_norm is not None:
        x = norm(cfg, embed_norm, x)
    return x


def encode(model, src):
    """float64 encoder output ``[S, d_model]`` of source ids ``src`` (bidirectional attention)
    of an encoder-decoder ``model`` (``enc_cfg``, ``enc_layers``, ``enc_pos``, ``enc_embed_norm``,
    ``enc_final_norm``, optional ``enc_embed`` else the shared ``embed``)."""
    ec = getattr(model, "enc_cfg", None)
    if ec is None:
        raise KVSimdTypeError("model has no encoder (no enc_cfg): %s" % type(model).__name__)
    if ec.position in ("rope", "alibi"):
        raise KVSimdValueError("enc_cfg.position=%r: the encoder takes learned or sinusoidal positions" % ec.position)
    if ec.parallel_residual:
        raise KVSimdValueError("enc_cfg.parallel_residual=True is not defined for the encoder")
    t = _ids(src, ec.vocab_size, "src")
    table = getattr(model, "enc_embed", None)
    table = model.embed if table is None else table
    enc_pos = model.enc_pos
    if enc_pos is None and ec.position == "sinusoidal":
        enc_pos = model.pos_embed
    x = _embed(ec, table, enc_pos, _norm_weights(ec, "embed_norm", model.enc_embed_norm, "enc_embed_norm", "enc_cfg"),
               t, np.arange(t.size), "src")
    for lw in model.enc_layers:
        x = layer(ec, lw, x)
    fn = _norm_weights(ec, "final_norm", model.enc_final_norm, "enc_final_norm", "enc_cfg")
    return x if fn is None else norm(ec, fn, x)


def forward(model, tokens, src=None, positions=None, kv="float"):
    """float64 logits ``[T, vocab]`` of a causal pass over ``tokens`` from scratch (``kv="int8"``,
    ``"int4"``, ``"int8/int4"``: the self-attention K/V quantized as such a cache stores them,
    :func:`quantize_kv`).

    ``model``: a decoder (``cfg``, ``embed``, ``layers``, ``final_norm``, ``lm_head``, ``lm_bias``,
    ``pos_embed``, ``embed_norm``), or an encoder-decoder with ``src`` (its source ids, run through
    :func:`encode`).  ``positions`` (default ``0..T-1``) are the tokens' positions, e.g. the
    compressed positions a StreamingLLM window gives its kept tokens."""
    cfg = model.cfg
    _kv_kind(kv)
    t = _ids(tokens, cfg.vocab_size, "tokens")
    pos = np.arange(t.size, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos.shape != t.shape:
        raise KVSimdValueError("positions must have one entry per token (%d), got shape %s" % (t.size, pos.shape))
    if pos.min() < 0:
        raise KVSimdValueError("positions must be >= 0, got %d" % pos.min())
    if src is not None and not cfg.cross_attention:
        raise KVSimdValueError("src is given but cfg.cross_attention is False")
    if src is None and cfg.cross_attention:
        raise KVSimdValueError("cfg.cross_attention is True: pass the source ids as src")
    enc_out = None if src is None else encode(model, src)
    pos_table = model.pos_embed
    x = _embed(cfg, model.embed, pos_table, _norm_weights(cfg, "embed_norm", model.embed_norm, "embed_norm", "cfg"),
               t, pos, "tokens")
    windows = getattr(cfg, "attn_windows", None) or (0,) * len(model.layers)
    for lw, w in zip(model.layers, windows):
        x = layer(cfg, lw, x, pos, enc_out, int(w), kv)
    fn = _norm_weights(cfg, "final_norm", model.final_norm, "final_norm", "cfg")
    if fn is not None:
        x = norm(cfg, fn, x)
    logits = _linear(x, model.lm_head, getattr(model, "lm_bias", None))
    cap = float(getattr(cfg, "final_softcap", 0.0) or 0.0)
    return np.tanh(logits / cap) * cap if cap else logits
