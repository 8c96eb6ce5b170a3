"""kvsimd's accuracy promises as functions: the one place that states each bound.

Every test that checks a kernel against :mod:`kvsimd.reference` takes its tolerance from
here, with the ISA row that actually ran (natively, or in the emulator when this CPU lacks it),
and the README's Accuracy table and :mod:`kvsimd.ops` state the same
numbers.  Users can call these to check kvsimd on their own data.

Notation: ``u = 2**-11`` is the unit roundoff of fp16 (half an ulp, relative), ``u32 = 2**-24``
that of fp32.  For a rotation, ``|pair|`` is the Euclidean norm of the (x, y) pair being rotated
(the input's), ``|out|`` the magnitude of the exact result component.
"""
from __future__ import annotations

import numpy as np

from kvsimd import _kvsimd, reference
from kvsimd.errors import KVSimdTypeError, KVSimdValueError

__all__ = ["U16", "U32", "rope_coefficients", "rope_bound", "pair_norm", "ATTEND_TOL",
           "attend_scale", "attend_bound", "score_chain", "score_rounding_error", "alibi_score_error", "SOFTCAP_REL",
           "softcap_score_error", "GEMV_LANES", "matmul_depth", "matmul_bound", "x8_block_magnitude"]

U16 = 2.0 ** -11
U32 = 2.0 ** -24


def _f64(x, name):
    """x as a float64 array, or KVSimdTypeError naming the argument (ragged lists, strings, objects)."""
    try:
        return np.asarray(x, np.float64)
    except (TypeError, ValueError):
        raise KVSimdTypeError("%s must be an array of numbers, got %s" % (name, _short(x))) from None


def _num(x, name):
    """x as a Python float, or KVSimdTypeError naming the argument."""
    try:
        return float(x)
    except (TypeError, ValueError):
        raise KVSimdTypeError("%s must be a number, got %s" % (name, _short(x))) from None


def _short(x):
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."

# Per call and per component:  |out - exact| <= a * |out| + b * |pair| + c.
#
# float32, every row: fp32 FMA arithmetic on fp32 (cos, sin); measured errors are ~1e-7 |pair|,
#   the bound keeps the historical 1e-5.
# float16, scalar, avx2 and avx512: widened to fp32, rotated (<= 2 u32 |pair| + the fp32 cos/sin's
#   u32 |pair|, below 2^-20 |pair|), rounded to fp16 once (u |out|).  avx512 runs the very code of
#   avx2 (rope.inc.h without KV_HAVE_CMUL_F16: one multiply and one FMA per component in fp32),
#   16 lanes instead of 8; the lanes are independent, so the bound is the same.
# float16, avx512fp16: the (cos, sin) multiplier m is split into fp16 hi + lo (m - hi - lo:
#   <= u^2 |m| + 2^-25 per component, plus fp32 cos/sin's u32); p = VFMULCPH(x, lo) (|p| <= u|pair|,
#   two roundings: <= 2 u^2 |pair| + 2 * 2^-25 with fp16 underflow), then VFMADDCPH(x, hi, p) rounds
#   each component twice: first the fused x_k * hi_re + p (<= u (|x_k| |m| + |p|) <= u |pair| + u^2 |pair|),
#   then the fused second product (<= u |out| + u * (the error so far)).  In all
#   <= u |out| + u |pair| + (2^-22 + 2^-21 + 4 u^2 + 2 u^2) |pair| + 4 * 2^-25, stated as
#   a = u, b = u + 2^-18, c = 2^-23.  (Before the hi + lo split: one VFMULCPH by the
#   fp16-rounded multiplier, up to 3 u |pair|; the bound then stated was 4 u |pair| + 2^-24.)
_ROPE = {
    ("float32", "scalar"): (0.0, 1e-5, 1e-30),
    ("float32", "avx2"): (0.0, 1e-5, 1e-30),
    ("float32", "avx512"): (0.0, 1e-5, 1e-30),
    ("float32", "avx512fp16"): (0.0, 1e-5, 1e-30),
    ("float16", "scalar"): (U16, 2.0 ** -20, 2.0 ** -25),
    ("float16", "avx2"): (U16, 2.0 ** -20, 2.0 ** -25),
    ("float16", "avx512"): (U16, 2.0 ** -20, 2.0 ** -25),
    ("float16", "avx512fp16"): (U16, U16 + 2.0 ** -18, 2.0 ** -23),
}


def rope_coefficients(isa: str, dtype) -> tuple[float, float, float]:
    """(a, b, c) of the per-call, per-component bound ``a |out| + b |pair| + c`` of
    ``apply_rope`` / ``shift_keys`` on ISA row ``isa`` for ``dtype`` (float16 or float32)."""
    try:
        key = (np.dtype(dtype).name, isa)
    except TypeError:
        raise KVSimdTypeError("dtype must be float16 or float32, got %s" % _short(dtype)) from None
    if key not in _ROPE:
        raise KVSimdValueError("no rotation bound for isa=%r dtype=%r" % (isa, np.dtype(dtype).name))
    return _ROPE[key]


def pair_norm(x, style: str, rotary_dim: int):
    """|pair| of every component of ``x [..., D]`` (0 for the dims beyond ``rotary_dim``)."""
    if style not in ("gptj", "neox"):
        raise KVSimdValueError("style must be 'gptj' or 'neox', got %r" % (style,))
    x = _f64(x, "x")
    _kvsimd._need_int(rotary_dim, "rotary_dim", 0, x.shape[-1] if x.ndim else 0)
    n = np.zeros_like(x)
    rd = rotary_dim
    R = rd // 2
    if style == "gptj":
        m = np.hypot(x[..., 0:rd:2], x[..., 1:rd:2])
        n[..., 0:rd:2] = m
        n[..., 1:rd:2] = m
    else:
        m = np.hypot(x[..., :R], x[..., R:rd])
        n[..., :R] = m
        n[..., R:rd] = m
    return n


def rope_bound(isa: str, dtype, pair, out, calls: int = 1, factor: float = 1.0):
    """Per-component bound on ``|result - exact|`` after ``calls`` successive rotations
    (``apply_rope`` / ``shift_keys``) of one tensor on ISA row ``isa``.

    ``pair``: |pair| of the input (:func:`pair_norm`); ``out``: the exact final result (its
    magnitude is used).  The last call contributes ``a |out| + b |pair| + c``; every earlier
    call's error vector is rotated by the later ones, which moves it between the two
    components of its pair, so it contributes its pair-norm ``a |pair| + sqrt(2) (b |pair| + c)``.
    A rotation keeps |pair| up to the errors so far (a factor 1 + 2^-8 covers up to 8 calls).
    ``factor``: the attention factor of a scaled RoPE (``apply_rope(attn_factor=...)``), which
    scales the (cos, sin) multiplier and so the pairs every product rounds: |pair| counts
    ``max(1, factor)`` times."""
    a, b, c = rope_coefficients(isa, dtype)
    calls = _kvsimd._need_int(calls, "calls", 1, 8)
    if not (np.isfinite(_num(factor, "factor")) and factor > 0):
        raise KVSimdValueError("factor must be finite and > 0, got %r" % (factor,))
    if pair is None or out is None:
        raise KVSimdValueError("pair and out must be arrays (pair_norm of the input, the exact result), got %s"
                               % ("pair=None" if pair is None else "out=None"))
    pair = _f64(pair, "pair") * (1.0 + 2.0 ** -8 if calls > 1 else 1.0) * max(1.0, float(factor))
    last = a * np.abs(_f64(out, "out")) + b * pair + c
    return last + (calls - 1) * ((a + np.sqrt(2.0) * b) * pair + np.sqrt(2.0) * c)


# attend: |out - ref| <= TOL * sum_j p_j |v_jd|  (+ the score terms of attend_bound), per element.
# fp32 accumulation with an online softmax; the tolerance of the softmax and accumulation
# rounding is the measured envelope (float16 K/V: reference = float64 math on the fp16 values);
# the dot products' rounding, which grows with the scores, is score_rounding_error's term.
# int8 and int4 K/V: each row is widened to exactly the float32 values q * scale
# (reference.dequantize_kv), so against float64 math on those values the float32 tolerance holds.
ATTEND_TOL = {"float32": 1e-5, "float16": 1e-4, "int8": 1e-5, "int4": 1e-5}
# Int8 and int4 values on the rows with VPDPWSSD (avx512, avx512fp16; kernels/attn.inc.h
# kv_accumulate_i16), when a KV head has several query vectors: per span of at most V_SPAN keys
# that are consecutive on the k / v arrays' axis N (the bound takes the largest weight and scale of
# the key's cell of V_SPAN and the cells on either side, so the kernel's grid may sit anywhere), query
# vector and value block b (32 values), the weight p_j s_jb of key j (s_jb its block's scale) is
# rounded to a multiple of the step (P / 32766) max_j |s_jb|, P the span's largest weight: off by
# half a step, plus the fp32 roundings of the quotient that is rounded (four, each of at most
# 2**-24 of a number at most 32766: 2**-9 of a step), W16_STEPS steps in all.  Value q_jd of key j weighs |v_jd| / |s_jb|,
# so over the span that adds at most
#     W16_STEPS / 32766 * P * max_j |s_jb| * sum_j |v_jd| / |s_jb|
# to |out_d - ref_d|.  The scales come from the values: |s_jb| >= A_jb / 127 (int8) or / 8 (int4),
# A_jb = max over the block of |v_jd|, as no int8 value passes 127 nor int4 one -8; and
# max |s_jb| <= max A_jb / 127 (int8: the block's largest value is +-127 steps) or / 7 (int4:
# +-7 or -8 steps, reference.int4_scale; float32 values of normal size), so V_SCALE_RATIO
# (127 / 127, 8 / 7) times max A_jb sum_j |v_jd| / A_jb.  Every row is bounded so; only those rows
# round.  The other fp32 roundings there (the int32 sums' conversion, two products) are relative
# to the span's sum_j p_j |v_jd|, within ATTEND_TOL.
V_SPAN = _kvsimd._V_SPAN
W16_STEPS = 0.5 + 4 * 2.0 ** -9
V_SCALE_RATIO = {"int8": 1.0 + 2.0 ** -20, "int4": 8.0 / 7.0 * (1.0 + 2.0 ** -20)}
# The softmax weight of a key far below the maximum: kernels/attn.inc.h's vf_exp clamps its
# argument at -87.34, e^-87.34 = 2**-126 (FLT_MIN), with its polynomial's error a little more.
EXP_FLOOR = 2.0 ** -125


def score_chain(D: int) -> int:
    """The most float32 roundings on the way to one score ``scale * q . k_j`` in the kernels
    (kernels/attn.inc.h), for head dim D: the scalar row sums each segment of 64 products in one
    chain and then the segments (64 + ceil(D / 64)); the SIMD rows' lanes hold shorter chains
    before their add trees (D / 8 + 4), the lanes path 16 + D / 16, int8 and int4 keys D / 32 block sums
    of exact integer dot products; plus the query's product with the scale and the products of
    a sum by the query's and the keys' steps, counted as 3."""
    D = _kvsimd._need_int(D, "D", 1)
    return min(D, 64) + -(-D // 64) + 3


def score_rounding_error(q, k, scale=None, q_alt=None):
    """Bound ``[H, N]`` on the float32 rounding of each score of :func:`kvsimd.ops.attend`:
    ``(score_chain(D) + 1) * 2**-24 * |scale| * sum_c |q_c| |k_jc|`` (each of the n roundings of a
    sum moves it by at most 2**-24 of the sum of the magnitudes it adds; one more for the
    higher-order terms), with ``max(|q|, |q_alt|)`` when ``q_alt`` is given.  Small against the
    scores' own size, but a score of 100 carries an error of up to ~1e-3, and through the softmax
    the output moves by as much relative to its scale: more than ``ATTEND_TOL`` covers once
    scores reach the tens (q of norm ~60 over D = 64)."""
    qa = np.abs(_f64(q, "q"))
    if q_alt is not None:
        if np.shape(q_alt) != qa.shape:
            raise KVSimdValueError("q_alt must have q's shape %s, got %s" % (qa.shape, np.shape(q_alt)))
        qa = np.maximum(qa, np.abs(_f64(q_alt, "q_alt")))
    return (score_chain(qa.shape[-1]) + 1) * U32 * _score_magnitude(qa, k, scale)


def _score_magnitude(qa, k, scale):
    """``|scale| * sum_c qa_c |k_jc|`` ``[H, N]`` for query magnitudes qa ``[H, D]`` (``scale`` None:
    1 / sqrt(D)): the size of what a score's roundings act on."""
    ka = np.abs(_f64(k, "k"))
    if qa.ndim != 2 or ka.ndim != 3 or qa.shape[1] != ka.shape[2] or ka.shape[0] < 1 or qa.shape[0] % ka.shape[0]:
        raise KVSimdValueError("q [H, D] and k [Hkv, N, D] must agree, with Hkv dividing H, got shapes %s and %s"
                               % (qa.shape, ka.shape))
    if scale is None:
        sc = 1.0 / np.sqrt(qa.shape[1])
    else:
        sc = abs(_kvsimd._need_real(scale, "scale"))
        if not np.isfinite(sc):
            raise KVSimdValueError("scale must be finite, got %r" % (scale,))
    return sc * np.einsum("hd,hnd->hn", qa, np.repeat(ka, qa.shape[0] // ka.shape[0], axis=0))


def quantized_step_bound(scale, D: int):
    """``|x - q * scale| <= |scale| / 2`` per component ``[..., D]`` for rows quantized by
    :func:`kvsimd.ops.quantize_kv` to int8 or int4 (``scale`` its ``[..., blocks]`` scales: the
    step, max |block| / 127 for int8, signed for int4: :func:`kvsimd.reference.int4_scale`), plus
    the float32 rounding of the product (2**-24 relative)."""
    scale = _f64(scale, "scale")
    blocks = scale.shape[-1] if scale.ndim else 0
    D = _kvsimd._need_int(D, "D", max(1, 32 * blocks - 31), 32 * blocks)   # the head dim these blocks hold
    per = np.repeat(np.abs(scale), 32, axis=-1)[..., :D]
    return per * (0.5 + 2.0 ** -23)


def hadamard_step_bound(scale, x):
    """``|x - H(q * scale)| <= bound`` per component for rows ``x [..., D]`` quantized with
    ``hadamard=True`` (``scale`` the stored ``[..., blocks]`` scales: the step / 32 on turned blocks):
    on a turned block each of its 32 values is off by at most half a step, and H sums them, so
    32 * scale / 2; plus the float32 butterflies of turning x (and, reading back, of turning q *
    scale): five roundings of partial sums, at most 2 * 5 * 2**-24 * the block's sum |x| (with
    margin for |x| itself being that far off).  A shorter last block: :func:`quantized_step_bound`."""
    D = np.shape(x)[-1]
    w = D // 32 * 32
    bound = quantized_step_bound(scale, D)
    per = np.repeat(np.abs(_f64(scale, "scale")), 32, axis=-1)[..., :w]
    bound[..., :w] = per * 32 * (0.5 + 2.0 ** -23) + 12 * 2.0 ** -24 * _block_sums(x)[..., :w]
    return bound


def _block_sums(x):
    """``|H| |x|``: the sum of ``|x|`` over each whole block of 32 values of the last axis, in
    every component of the block; 0 on a shorter last block (never turned)."""
    x = np.abs(_f64(x, "x"))
    w = x.shape[-1] // 32 * 32
    sums = np.zeros_like(x)
    sums[..., :w] = np.repeat(x[..., :w].reshape(x.shape[:-1] + (-1, 32)).sum(axis=-1), 32, axis=-1)
    return sums


def quantized_shift_bound(isa: str, pair, out, new_scale, hadamard=False):
    """Per-component bound on ``|shifted - exact|`` for one ``shift_keys`` call on an int8 or int4 K:
    ``exact`` the float64 rotation of the values the rows stood for, ``shifted`` the values they
    stand for after it (``q' * new_scale``).  The rotation runs in float32 on the widened rows
    (:func:`rope_bound` of float32) and the requantization adds half a step of the new scale.
    Successive calls add up, as for float rows: a token rotated k times carries up to k times
    this bound, so a cache bounds the rotations any token sees in the same way.  ``hadamard``: rows
    stored turned by H (:func:`hadamard_step_bound` for the step, which also covers turning them
    back before the rotation; that turn's roundings reach a component through its RoPE partner too,
    which may lie in another block: 10 * 2**-24 * the row's sum of ``pair``)."""
    if not hadamard:
        step = quantized_step_bound(new_scale, np.shape(out)[-1])
    else:
        step = hadamard_step_bound(new_scale, out) + \
            10 * 2.0 ** -24 * np.sum(_f64(pair, "pair"), axis=-1, keepdims=True)
    return rope_bound(isa, "float32", pair, out) + step + 2.0 ** -24 * np.abs(out)


def alibi_score_error(alibi_slopes, distances):
    """Bound on the fp32 rounding error of the ALiBi part of each score, ``[H, N]``.

    The kernel subtracts ``slope * float(query_position - key_position)`` from the fp32 score:
    the product and the subtraction are each rounded to fp32 (or fused: one rounding), each
    with an error up to ``u32 * |slope * distance|`` (the subtraction's ``u32 * |score|``
    counts in :func:`score_rounding_error`), plus one more when ``|distance| >= 2**24`` is
    not exact in fp32.  Note the *absolute* error grows with the distance: a bias of 1000
    carries ~1e-4 of score error, whatever the weights."""
    d = np.abs(_f64(distances, "distances"))
    bias = np.abs(_f64(alibi_slopes, "alibi_slopes"))[:, None] * d
    return (2.0 + (d >= 2.0 ** 24)) * U32 * bias


# Soft cap (softcap > 0): the kernel replaces each scaled dot product s by
# c = fl(fl(tanh(fl(s * fl(1 / cap32)))) * cap32), cap32 = the float32 cap (kernels/attn.inc.h,
# vf_tanh), against the reference's float64 cap * tanh(s / cap).  Relative to |c|, per score:
#   - cap32 = cap (1 + e0), |e0| <= u32: cap * tanh(s / cap) moves by e0 times
#     1 - x sech^2(x) / tanh(x), which is in [0, 1] (x = s / cap): at most u32;
#   - the argument x = s * fl(1 / cap32): two roundings, 2 u32 relative; tanh's relative
#     sensitivity to its argument, 2x / sinh(2x), is at most 1: at most 2 u32;
#   - vf_tanh: 2x = y = n ln2 + r; r1 = y - n hi is exact (Cody-Waite; n = 0: r = y exactly),
#     r = r1 - n lo is rounded once (u32 |r| <= 0.35 u32, absolute; lo's own error, n 2^-37, is
#     negligible), which moves e^y by that relative amount, e^y / |e^y - 1| <= 3.4 times more
#     relative to m = e^y - 1: <= 1.2 u32.  e^r - 1 = r p(r): Horner, one rounding per step
#     (<= 1.3 u32 on p), the truncation (r^8 / 8! < 0.35 u32 of |e^r - 1|) and the product r p
#     (u32): <= 2.7 u32.  m = 2^n (r p) + (2^n - 1): one fused rounding (u32), 2^n - 1 exact
#     (|n| <= 24; else within 2^-25 relative), and r p's error weighted by
#     |2^n r p / m| = |e^y - 2^n| / |e^y - 1| <= 1.4 (n = 1, r near -ln2 / 2): m within 6 u32 of
#     e^y - 1, relative.  t = m / (m + 2) passes m's relative error on times 2 / (m + 2) < 1.5
#     (m > -0.82 wherever m's error is not negligible; m -> -1 only as 2^n -> 0), then the
#     addition and the division (2 u32): at most 11 u32 (measured over every 16th float32 x in
#     [2^-30, 64), and all of [0.2, 1]: 4.0 u32 on every row);
#   - the product by cap32: u32.
# In all <= 15 u32 |c|, stated as SOFTCAP_REL = 16 u32 (measured: <= 5.5 u32 for caps from
# 2^-20 to 2^20 on every row).  Subnormal intermediates (|s / cap| < 2^-126, or |c| < 2^-126) add
# at most cap 2^-146 + 2^-148 absolutely.  The dot product's own rounding reaches the capped score
# multiplied by sech^2 (x) <= 1: no more than without the cap (ATTEND_TOL).  A saturated score
# (|s / cap| > 9.1, where 2 / (m + 2) < 2^-25) is exactly +-cap32 in the kernel.
SOFTCAP_REL = 16 * U32


def softcap_score_error(capped_scores, softcap):
    """Bound ``[H, N]`` on the rounding of the soft cap itself in each score (the derivation
    above): ``SOFTCAP_REL * |c| + softcap * 2**-146 + 2**-148``, ``c`` the float64 capped scores
    (:func:`kvsimd.reference.attention_scores` without ALiBi; keys outside the ranges: 0)."""
    c = np.abs(_f64(capped_scores, "capped_scores"))
    c = np.where(np.isfinite(c), c, 0.0)
    return SOFTCAP_REL * c + _num(softcap, "softcap") * 2.0 ** -146 + 2.0 ** -148


def _weights_and_scale(q, k, v, kw):
    p = reference.attention_weights(q, k, **kw)
    va = np.repeat(np.abs(_f64(v, "v")), p.shape[0] // k.shape[0], axis=0)
    return p, va, np.einsum("hn,hnd->hd", p, va)


def attend_scale(q, k, v, **kw):
    """``sum_j p_j |v_jd|`` ``[H, D]``: the natural scale of an attention output (p: the float64
    softmax weights), which stays meaningful where outputs cancel to ~0."""
    return _weights_and_scale(q, k, v, kw)[2]


def _tol_name(d, dtype):
    """The ATTEND_TOL key of one dtype (a name or a NumPy dtype); ``dtype`` the argument, for the error."""
    if isinstance(d, str) and d in ATTEND_TOL:
        return d
    try:
        name = np.dtype(d).name
    except TypeError:
        name = None
    if name not in ATTEND_TOL:
        raise KVSimdValueError("dtype must be one of %s, or two of them as \"K/V\", got %r"
                               % (", ".join(ATTEND_TOL), dtype))
    return name


def attend_bound(q, k, v, *, dtype=None, hadamard=False, **kw):
    """Per-element bound ``[H, D]`` (``[T, H, D]`` for q of T rows) on
    ``|attend(q, k, v, **kw) - reference.attend(...)|``
    (keywords as :func:`kvsimd.reference.attend`; ``dtype`` defaults to k's).

    ``ATTEND_TOL[dtype] * attend_scale``, plus ``EXP_FLOOR * sum_j |v_jd|`` (the kernels' exp
    stops at 2**-126: a key scoring more than 87.3 below the maximum, whose float64 weight is 0 or
    less, weighs about that much; it shows only where the output is ~0 and its scale too), plus
    the effect of the score errors e_j of the dot products' rounding (:func:`score_rounding_error`),
    of the ALiBi bias (:func:`alibi_score_error`) and of the soft cap (:func:`softcap_score_error`),
    summed:
    perturbing the scores by e_j changes the weights to p_j (1 + e_j - sum_k p_k e_k) to first
    order, so the output moves by at most
    ``sum_j p_j e_j |v_jd| + (sum_k p_k e_k) * sum_j p_j |v_jd|``.

    ``hadamard=True``: the bound of ``ops.attend(q, ..., hadamard=True)`` over rows stored turned
    by H, against ``reference.attend(q, hadamard_rows(k), hadamard_rows(v), **kw)``; ``k``, ``v``
    are the values the rows stand for as stored (:func:`kvsimd.reference.dequantize_kv`), ``q``
    the caller's.  The kernel reads the query turned, H q, and scores ``H q . k_j = q . H k_j``:
    the bound above holds for its output over the stored rows with H q (the weights p are the
    same), plus the float32 turn of q -- five roundings of partial sums, at most 5 * 2**-24 times
    the block's sum |q| per component (:func:`hadamard_step_bound`), so each score moves by at
    most ``e_j = 5 * 2**-24 * |scale| * sum_c B(q)_c |k_jc|`` (B: the block sums; with ``q_alt``
    the larger of the two), through the softmax as above.  Turning the output back, H sums the
    errors of its block in every component, and rounds five times more: 5 * 2**-24 times the
    block's sum of ``attend_scale`` (each stated as 6 * 2**-24 for the higher-order terms).  A
    shorter last block is not turned: the bound above.

    Int8 or int4 values (``dtype`` naming them, alone or as the V of "K/V"): plus the int16
    weights' term (the comment at V_SPAN): the keys of a kernel's span (a range's consecutive keys)
    must be consecutive on k and v's axis N, as they are when the ranges are laid end to end.

    Not covered: overflow -- the kernel's sum of the weighted values past float32's range (values
    near 3.4e38 / N over N keys of equal weight: see :func:`kvsimd.ops.attend`) -- and NaN or
    infinite inputs."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise KVSimdTypeError("%s must be a NumPy array, got %s" % (name, _short(x)))
    if q.ndim not in (2, 3) or k.ndim != 3 or v.shape != k.shape or q.shape[-1] != k.shape[2] or \
            not k.shape[0] or q.shape[-2] % k.shape[0]:
        raise KVSimdValueError("q [H, D] or [T, H, D] over k and v [Hkv, N, D] (Hkv dividing H), got q %s, k %s, v %s"
                               % (q.shape, k.shape, v.shape))
    if not k.shape[1]:   # as ops.attend
        raise KVSimdValueError("k and v are empty (N=0): attention needs at least one key")
    if np.ndim(q) == 3:   # several query rows: each row's bound (reference.query_rows)
        return np.stack([attend_bound(q[t], k, v, dtype=dtype, hadamard=hadamard, **rkw)
                         for t, rkw in enumerate(reference.query_rows(len(q), k.shape[1], **kw))])
    if hadamard:
        return _turned_attend_bound(q, k, v, dtype, kw)
    # "K/V" (a KVCache of int8 keys and int4 values): the larger tolerance of the two
    names = [_tol_name(n, dtype) for n in dtype.split("/")] if isinstance(dtype, str) else \
        [_tol_name(k.dtype if dtype is None else dtype, dtype)]
    p, va, scale = _weights_and_scale(q, k, v, kw)
    bound = max(ATTEND_TOL[n] for n in names) * scale + EXP_FLOOR * va.sum(axis=1)
    err = score_rounding_error(q, k, kw.get("scale"), kw.get("q_alt"))
    if kw.get("alibi_slopes") is not None:
        dist = reference.alibi_distances(k.shape[1], kw.get("key_positions"), kw.get("query_position"),
                                         kw.get("ranges"))
        err = err + alibi_score_error(kw["alibi_slopes"], dist)
    if kw.get("softcap"):
        plain = {key: val for key, val in kw.items() if key not in ("alibi_slopes", "key_positions", "query_position")}
        err = err + softcap_score_error(reference.attention_scores(q, k, **plain), kw["softcap"])
    pe = p * err
    bound = bound + np.einsum("hn,hnd->hd", pe, va) + pe.sum(axis=1)[:, None] * scale
    if names[-1] in V_SCALE_RATIO:
        # the kernel's weights are the reference's within e^(2 max e) (the score errors above), and at most 1
        grow = np.exp(np.minimum(2.0 * err.max(axis=1, initial=0.0), 700.0))[:, None]
        bound = bound + _int16_weight_bound(np.minimum(p * grow, 1.0), v, names[-1])
    return bound


def _near_max(x):
    """The largest of cells c - 1, c, c + 1 along axis 1 of x."""
    y = np.pad(x, [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2))
    return np.maximum(np.maximum(y[:, :-2], y[:, 1:-1]), y[:, 2:])


def _int16_weight_bound(p, v, name):
    """The int16 weights' term of attend_bound (above V_SPAN): ``[H, D]`` for weights p ``[H, N]``
    over int8 or int4 values v ``[Hkv, N, D]`` (the values they stand for)."""
    va = np.abs(_f64(v, "v"))
    Hkv, N, D = va.shape
    w = D // 32 * 32
    out = np.zeros((p.shape[0], D))
    if w < D:   # a head dim that is not whole blocks never takes the int16 weights
        return out
    A = np.repeat(va.reshape(Hkv, N, D // 32, 32).max(axis=-1), 32, axis=-1)    # [Hkv, N, D]: A_jb
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(A > 0, va / A, 0.0)
    cells = -(-N // V_SPAN)
    pad = cells * V_SPAN - N
    Ac = np.pad(A, ((0, 0), (0, pad), (0, 0))).reshape(Hkv, cells, V_SPAN, D).max(axis=2)       # [Hkv, cells, D]
    rc = np.pad(rel, ((0, 0), (0, pad), (0, 0))).reshape(Hkv, cells, V_SPAN, D).sum(axis=2)
    pc = np.pad(p, ((0, 0), (0, pad))).reshape(p.shape[0], cells, V_SPAN).max(axis=2)           # [H, cells]
    # a span holding a key of cell c lies within cells c - 1 .. c + 1 whatever the grid's offset
    Ac, pc = _near_max(Ac), _near_max(pc)
    G = p.shape[0] // Hkv
    per = np.repeat(Ac * rc, G, axis=0)                                                         # [H, cells, D]
    return W16_STEPS / 32766.0 * V_SCALE_RATIO[name] * np.einsum("hc,hcd->hd", pc, per)


def _turned_attend_bound(q, k, v, dtype, kw):
    """attend_bound(..., hadamard=True) of one query (its docstring states the terms)."""
    turned = dict(kw)
    bq = _block_sums(q)
    if kw.get("q_alt") is not None:
        turned["q_alt"] = reference.hadamard_rows(_f64(kw["q_alt"], "q_alt"))
        bq = np.maximum(bq, _block_sums(kw["q_alt"]))
    qt = reference.hadamard_rows(_f64(q, "q"))
    inner = attend_bound(qt, k, v, dtype=dtype, **turned)
    p, va, scale = _weights_and_scale(qt, k, v, turned)
    pe = p * (6 * U32 * _score_magnitude(bq, k, kw.get("scale")))
    inner = inner + np.einsum("hn,hnd->hd", pe, va) + pe.sum(axis=1)[:, None] * scale
    w = np.shape(q)[-1] // 32 * 32
    bound = inner.copy()
    bound[..., :w] = (_block_sums(inner) + 6 * U32 * _block_sums(scale + inner))[..., :w]
    return bound


# QMatrix.matmul (kernels/gemv.inc.h), y[b, j] = sum_i x[b, i] W[j, i], against float64 math on
# the dequantized weights (``QMatrix.dequantize()``, bit for bit ``gguf.quants.dequantize``):
#
# 1. Widening.  Every decoder (kernels/wt_*.inc.h) yields exactly the float32 value gguf's
#    dequantization computes, so the weights add no error of their own.  F32 is read as is;
#    F16 and BF16 widen exactly.  Quantized types: an fp16 scale has 11 significant bits, so
#    d * q (Q8_0: 8-bit q; Q4_0: the -8 d offset is a power-of-two multiple), d * sc (Q4_K/Q5_K:
#    6-bit sc; Q6_K: |sc| <= 128) and then (d * sc) * q (4..6-bit q; Q6_K's q - 32 has |.| <= 32)
#    all fit fp32's 24 bits: exact, fused or not.  What remains is one fp32 rounding of the
#    addition of the minimum / offset (Q4_1: + m; Q4_0: - 8 d; k-quants: - dmin * mn, itself an
#    exact product), the same single rounding gguf's NumPy float32 arithmetic makes.
#    (test_qmatmul.py checks QMatrix.dequantize bitwise against gguf for every type and row.)
# 2. Summation.  Per output, the kernel keeps NA vector accumulators of KV_W lanes (KV_W: 1
#    scalar, 8 avx2, 16 avx512 and avx512fp16; NA = 4, 2 or 1 for slices of 1, 2 or >= 3 rows of x, at most
#    the block's vector count), each lane a chain of FMAs (x * w exact inside the FMA, one
#    rounding per step; the scalar row rounds the product first: one more).  A lane's chain is
#    at most floor(k / (NA KV_W)) + NA long (the float types' last < NA vectors, the last maybe
#    partial, all go into accumulator 0; quantized chains are exactly k / (NA KV_W)); then NA - 1
#    additions of the accumulators and log2(KV_W) of the horizontal sum.  So every product
#    passes through at most floor(k / (NA KV_W)) + 2 NA + log2(KV_W) roundings, which for
#    NA in {1, 2, 4} is at most  h = ceil(k / KV_W) + log2(KV_W) + 8  (matmul_depth), and
#        |y - exact| <= gamma_h sum_i |x_bi| |w_ji|,   gamma_h = h u32 / (1 - h u32)
#    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 / eq. 3.4).
#    Underflow: an FMA or product below 2^-126 adds an absolute error of at most 2^-150; at most
#    k such operations per output, each amplified by at most (1 + u32)^h < 2: k 2^-149, stated
#    as k 2^-148.  The columns' split across threads changes nothing (each output is one column's
#    code), nor do B > 8 rows (slices of 8 rows, each an independent product).
# 3. The reference: float64 products of float32 values are exact, and any float64 summation
#    order errs by at most gamma_k(2^-53) sum |x||w| < k 2^-52 sum |x||w|: added so that a
#    test's float64 result (NumPy/BLAS, any order) may stand in for the exact sum.
# Not covered: overflow (|y| or a partial sum beyond fp32's range) and NaN/Inf inputs.
#
# Int8 activations (QMatrix(..., activations="int8"), kernels/gemv_x8.inc.h; Q8_0, Q4_0, Q4_1):
# (Q4_K, Q5_K: the same per sub-block of 32, D = d sc and M = -dmin mn, sc and mn 6-bit integers.)
# 4. x is rounded per block of 32 values to x^ = d_x q_x, d_x = fl(max |x| / 127), q_x the
#    nearest integer to fl(x / d_x) (|q_x| <= 127): |x - x^| <= (d_x / 2)(1 + 2^-16).  This is
#    the error the path exists for: sum over blocks of (d_x / 2)(1 + 2^-16) sum |w| (the block's
#    weights).
# 5. The rest is float32 arithmetic on exact integers: per block and column the integer sum
#    S = sum q'_w q_x (q'_w the decoder's unsigned or signed weights, S < 2^24: exact as a
#    float), then t = S d_x, the offset or minimum term (o d_x sum q_x, m d_x sum q_x) added, the
#    product with d_w and the accumulation over k / 32 blocks: at most h = k / 32 + 6 roundings,
#    each relative to the largest intermediate, which is at most M sum |x^| with M the block's
#    largest |d_w| (|q'_w| + |o|) + |m| (x8_block_magnitude: 383 |d| for Q8_0, 23 |d| for Q4_0,
#    15 |d| + |m| for Q4_1, 15 (Q5_K: 31) |d sc| + |dmin mn| for the k-quants):
#    gamma_h sum_blocks M (sum |x| + 16 d_x).
#    Not covered either: a block of x whose largest |x| is below 2^-119 (its step is a subnormal
#    float, rounded coarsely, or zero).
GEMV_LANES = {"scalar": 1, "avx2": 8, "avx512": 16, "avx512fp16": 16}   # KV_W of each row's vec_*.h


def matmul_depth(k: int, isa: str) -> int:
    """h: the most fp32 roundings any product x_bi w_ji passes through in ``QMatrix.matmul``
    with ``k`` columns on ISA row ``isa`` (see the derivation above)."""
    if isa not in GEMV_LANES:
        raise KVSimdValueError("no matmul bound for isa=%r (rows: %s)" % (isa, ", ".join(GEMV_LANES)))
    w = GEMV_LANES[isa]
    return -(-_kvsimd._need_int(k, "k", 0) // w) + int(w).bit_length() - 1 + 8


def matmul_bound(x, w_deq, isa: str, activations: str = "float32", block_magnitude=None):
    """Per-output bound ``[B, rows]`` on ``|QMatrix.matmul(x) - x @ w_deq.T|`` (the right side in
    float64) on ISA row ``isa``: ``(gamma_h + k 2^-52) * (|x| @ |w_deq|.T) + k 2^-148`` with
    ``h = matmul_depth(k, isa)``.  ``x``: float32 [B, k]; ``w_deq``: the dequantized weights
    [rows, k] (``QMatrix.dequantize()``, or ``gguf.quants.dequantize`` of the same bytes).
    ``activations="int8"`` (a QMatrix's ``activations``): sections 4 and 5 above, with
    ``block_magnitude`` = ``x8_block_magnitude(qm.raw(), qm.wtype)``."""
    x = _f64(x, "x")
    w = _f64(w_deq, "w_deq")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise KVSimdValueError("matmul_bound needs x [B, k] and w_deq [rows, k], got x %s and w_deq %s"
                               % (x.shape, w.shape))
    k = x.shape[1]
    if activations not in ("float32", "int8"):
        raise KVSimdValueError("activations must be 'float32' or 'int8', got %r" % (activations,))
    if activations == "float32":
        h = matmul_depth(k, isa)
        gamma = h * U32 / (1.0 - h * U32)
        return (gamma + k * 2.0 ** -52) * (np.abs(x) @ np.abs(w).T) + k * 2.0 ** -148
    matmul_depth(k, isa)                          # (checks isa)
    mag = _f64(block_magnitude, "block_magnitude") if block_magnitude is not None else None
    if k % 32 or mag is None or mag.shape != (w.shape[0], k // 32):
        raise KVSimdValueError("int8 activations need k a multiple of 32 and block_magnitude [rows, k / 32] "
                               "(x8_block_magnitude), got k %d and %s" % (k, None if mag is None else mag.shape))
    h = k // 32 + 6
    gamma = h * U32 / (1.0 - h * U32)
    ax = np.abs(x).reshape(x.shape[0], -1, 32)
    step = ax.max(-1) / 127.0 * (1 + 2.0 ** -20)                       # [B, blocks]
    wsum = np.abs(w).reshape(w.shape[0], -1, 32).sum(-1)                # [rows, blocks]
    rounding = (step * (0.5 + 2.0 ** -16)) @ wsum.T
    arithmetic = gamma * ((ax.sum(-1) + 16 * step) @ mag.T)
    return rounding + arithmetic + (k * 2.0 ** -52) * (np.abs(x) @ np.abs(w).T) + k * 2.0 ** -148


def _kquant_scales(b):
    """6-bit scales and minimums [rows, super-blocks, 8] of Q4_K/Q5_K super-blocks b (bytes 4..15)."""
    s = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def x8_block_magnitude(raw, wtype: str):
    """[rows, blocks of 32] M of section 5 above, from the stored bytes ``raw`` [rows, row bytes]
    of a Q8_0, Q4_0, Q4_1, Q4_K or Q5_K matrix (the blocks' half scale d at byte 0; Q4_1's half
    minimum m, the k-quants' half dmin at 2; the k-quants' packed 6-bit scales at 4..15)."""
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176}
    if wtype not in size:
        raise KVSimdValueError("int8 activations exist for %s, got %r" % (", ".join(size), wtype))
    if not isinstance(raw, np.ndarray) or raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % size[wtype]:
        raise KVSimdValueError("raw must be uint8 [rows, row bytes] of whole %d-byte %s blocks, got %s"
                               % (size[wtype], wtype, "%s %s" % (raw.dtype, raw.shape) if isinstance(raw, np.ndarray)
                                  else _short(raw)))
    b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size[wtype])
    d = np.abs(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    if wtype in ("q4_k", "q5_k"):     # per sub-block of 32: |d sc| q_max + |dmin mn|
        sc, mn = _kquant_scales(b)
        dmin = np.abs(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        qmax = 15.0 if wtype == "q4_k" else 31.0
        return (qmax * d[..., None] * sc + dmin[..., None] * mn).reshape(raw.shape[0], -1)
    if wtype == "q8_0":
        return 383.0 * d
    if wtype == "q4_0":
        return 23.0 * d
    return 15.0 * d + np.abs(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
