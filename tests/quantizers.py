"""Test weights in every weight type kvsimd multiplies in place (kvsimd._kvsimd.weight_types()).

``quantize(x, wtype)`` gives the stored bytes [rows, row_bytes] of a float matrix: the ``gguf``
package's own quantizers for F32, F16, BF16, Q8_0, Q4_0 and Q4_1; for the k-quants Q4_K, Q5_K and
Q6_K (gguf's ``quantize`` raises NotImplementedError for them) simple reference quantizers written
here in vectorized NumPy.  They aim at correct bytes, not at llama.cpp's quality: one min/max
pass per sub-block, the 6-bit (Q4_K/Q5_K) or 8-bit (Q6_K) sub-block scales rounded to nearest.
test_qmatmul.py checks them through ``gguf.quants.dequantize`` (an independent decoder): within
``format_error_bound`` on random data, and bit-exact on values that lie on a format grid.

``dequantize(raw, wtype)`` is gguf's dequantization (float32), the reference of the kernel tests.

Layouts (ggml's, byte offsets within a super-block of 256 values):
  Q4_K (144): d fp16 @0, dmin fp16 @2, scales[12] @4, qs[128] @16 -- 8 sub-blocks of 32,
              value = d * sc_s * q - dmin * mn_s, q in 0..15; sub-block s in the low (s even)
              or high (s odd) nibbles of qs[32 (s // 2) ..+32].
  Q5_K (176): as Q4_K with qh[32] @16 and qs[128] @48: bit s of qh[o] is bit 4 of value o of
              sub-block s; q in 0..31.
  Q6_K (210): ql[128] @0, qh[64] @128, int8 scales[16] @192, d fp16 @208 -- 16 sub-blocks of
              16, value = d * sc_s * (q - 32), q in 0..63; value 128 h + 32 j + l (j < 4, l < 32)
              keeps its low 4 bits in nibble j // 2 of ql[64 h + 32 (j % 2) + l] and its high 2
              bits at bits 2j..2j+1 of qh[32 h + l].
The 12 scale bytes of Q4_K/Q5_K pack eight 6-bit scales sc and minimums mn: bytes 0..3 hold
sc[0..3] and bytes 4..7 mn[0..3] in their low 6 bits, and in their top 2 bits the top 2 bits of
sc[4..7] (bytes 0..3) and mn[4..7] (bytes 4..7); bytes 8..11 hold the low 4 bits of sc[4..7]
(low nibble) and of mn[4..7] (high nibble).
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq

QK_K = 256
# name (kvsimd) -> gguf's type
GGUF_TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
              "bf16": GGMLQuantizationType.BF16, "q8_0": GGMLQuantizationType.Q8_0,
              "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
              "q6_k": GGMLQuantizationType.Q6_K}
K_QUANTS = ("q4_k", "q5_k", "q6_k")
# per k-quant: sub-block length, largest q, largest sub-block scale (6-bit or int8)
_K_SHAPE = {"q4_k": (32, 15, 63), "q5_k": (32, 31, 63), "q6_k": (16, 31, 127)}


def _fp16(a):
    """a (float64) rounded to fp16 (nearest even), as float64 and as the two stored bytes."""
    h = np.asarray(a, np.float64).astype(np.float16)
    return h.astype(np.float64), h.view(np.uint8).reshape(h.shape + (2,))


def _sub_blocks(x, wtype):
    """x [rows, cols] -> float64 [super-blocks, sub-blocks, sub-block length]."""
    n = _K_SHAPE[wtype][0]
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError("%s needs x [rows, cols] with cols a multiple of %d, got %s" % (wtype, QK_K, x.shape))
    return x.reshape(-1, QK_K // n, n)


def _safe_div(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape), where=b > 0)


def _pack_scales_mins(sc, mn):
    """Eight 6-bit scales and minimums per super-block [nb, 8] -> the 12 bytes [nb, 12]."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _quantize_q45_k(x, wtype):
    """Q4_K / Q5_K: per sub-block of 32, the range [min(0, min x), max x] on q = 0..qmax."""
    _, qmax, scmax = _K_SHAPE[wtype]
    b = _sub_blocks(x, wtype)                              # [nb, 8, 32]
    low = np.minimum(b.min(axis=2), 0.0)                   # the minimum subtracted: -low >= 0
    scale = (b.max(axis=2) - low) / qmax                   # >= 0
    d, d_bytes = _fp16(scale.max(axis=1) / scmax)          # [nb]
    dmin, dmin_bytes = _fp16((-low).max(axis=1) / scmax)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, scmax)
    mn = np.clip(np.rint(_safe_div(-low, dmin[:, None])), 0, scmax)
    step, off = d[:, None] * sc, dmin[:, None] * mn          # exact in float64
    q = np.clip(np.rint(_safe_div(b + off[:, :, None], step[:, :, None])), 0, qmax).astype(np.uint8)
    nb = b.shape[0]
    pairs = q.reshape(nb, 4, 2, 32)                        # sub-blocks 2p (low nibble), 2p + 1 (high)
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(nb, 128)
    parts = [d_bytes, dmin_bytes, _pack_scales_mins(sc, mn)]
    if wtype == "q5_k":
        bit4 = (q >> 4).astype(np.uint8)                   # [nb, 8, 32]
        parts.append(np.bitwise_or.reduce(bit4 << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x):
    """Q6_K: per sub-block of 16, symmetric: q - 32 in -31..31 covers max |x|."""
    _, qmax, scmax = _K_SHAPE["q6_k"]
    b = _sub_blocks(x, "q6_k")                             # [nb, 16, 16]
    scale = np.abs(b).max(axis=2) / qmax
    d, d_bytes = _fp16(scale.max(axis=1) / scmax)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, scmax)
    step = d[:, None] * sc
    q = (np.clip(np.rint(_safe_div(b, step[:, :, None])), -32, 31) + 32).astype(np.uint8)
    nb = b.shape[0]
    q = q.reshape(nb, 2, 4, 32)                            # [nb, half h, quarter j, l]
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(nb, 128)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql, qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8), d_bytes], axis=1)


def quantize(x, wtype):
    """The stored bytes of float matrix ``x [rows, cols]`` in ``wtype``: uint8 [rows, row_bytes]."""
    x = np.ascontiguousarray(x, np.float32)
    rows = x.shape[0]
    if wtype in ("q4_k", "q5_k"):
        raw = _quantize_q45_k(x, wtype)
    elif wtype == "q6_k":
        raw = _quantize_q6_k(x)
    else:
        raw = gq.quantize(x, GGUF_TYPES[wtype])
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


def dequantize(raw, wtype):
    """gguf's float32 dequantization of stored bytes ``raw [rows, row_bytes]`` -> [rows, cols]."""
    return gq.dequantize(np.ascontiguousarray(raw, np.uint8), GGUF_TYPES[wtype])


def format_error_bound(x, wtype):
    """Per value, how far ``dequantize(quantize(x))`` may be from ``x`` for the k-quants
    (``quantize`` above; [rows, cols]).

    Q4_K/Q5_K, a sub-block with range [lo, hi] (lo = min(0, min x)), scale = (hi - lo) / qmax,
    super-block d = max scale / 63 and dmin = max(-lo) / 63 (each within 2^-11 of that after the
    fp16 rounding): the stored step S = d sc is within d/2 of the scale and the offset M = dmin mn
    within dmin/2 of -lo, so a value on the grid [-M, qmax S - M] is within S/2 of a grid point,
    and a value beyond it within (qmax / 2) d + dmin / 2 of its end.  Q6_K, scale = max |x| / 31,
    d = max scale / 127: within S/2, or beyond 31 S by at most (31 / 2) d.  Plus the float32
    rounding of the decoded value."""
    n, qmax, scmax = _K_SHAPE[wtype]
    b = _sub_blocks(x, wtype)
    grow = 1.0 + 2.0 ** -10
    if wtype == "q6_k":
        scale = np.abs(b).max(axis=2) / qmax
        d = scale.max(axis=1, keepdims=True) / scmax * grow
        per_sub = np.maximum((scale + d / 2) / 2, qmax / 2 * d)
    else:
        low = np.minimum(b.min(axis=2), 0.0)
        scale = (b.max(axis=2) - low) / qmax
        d = scale.max(axis=1, keepdims=True) / scmax * grow
        dmin = (-low).max(axis=1, keepdims=True) / scmax * grow
        per_sub = np.maximum((scale + d / 2) / 2, qmax / 2 * d + dmin / 2)
    bound = np.repeat(per_sub[:, :, None], n, axis=2) + 2.0 ** -23 * np.abs(b).max(axis=(1, 2))[:, None, None]
    return bound.reshape(np.shape(x))


# where the fp16 scales of each block type sit (byte offsets in a block)
_HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(rng, wtype, rows, cols):
    """Stored bytes [rows, row_bytes] of a block type with every quant bit random (all q values,
    all 6-bit scale and minimum patterns, Q6_K's negative int8 scales: what ``quantize`` never
    makes) and finite fp16 scales of random sign, 1e-3..1e-1 in magnitude.  For the float types:
    values of varied magnitude with exact zeros, -0.0 and (F16) subnormals."""
    if wtype in ("f32", "f16", "bf16"):
        x = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-6, 6, (rows, cols)))
        pick = rng.integers(0, 8, (rows, cols))
        x[pick == 0] = 0.0
        x[pick == 1] = -0.0
        x[pick == 2] = rng.uniform(-6e-5, 6e-5, int((pick == 2).sum()))   # fp16 subnormal range
        return quantize(x.astype(np.float32), wtype)
    block = 256 if wtype in K_QUANTS else 32
    nbytes = gq.GGML_QUANT_SIZES[GGUF_TYPES[wtype]][1]
    nb = rows * cols // block
    raw = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    for off in _HALF_OFFSETS[wtype]:
        h = (rng.choice([-1.0, 1.0], nb) * 10.0 ** rng.uniform(-3, -1, nb)).astype(np.float16)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)
