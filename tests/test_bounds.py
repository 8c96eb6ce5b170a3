"""kvsimd.bounds: every compiled row has its bounds, and the avx512fp16 rotation bound holds for
a NumPy model of the kernel's arithmetic (the rounding rule of VFMULCPH checked against the
hardware capture in test_avx512fp16_hw.py, VFMADDCPH by the same rule with the accumulator as
the first addend), for either operand order a compiler may choose, over pair magnitudes from
fp16 subnormals to 1e4."""
import os
import sys

import numpy as np
import pytest

import kvsimd
from kvsimd import bounds

sys.path.insert(0, os.path.dirname(__file__))
from test_avx512fp16_hw import _fma16, _round16  # noqa: E402


@pytest.mark.parametrize("isa", kvsimd.isa_info()["compiled"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_compiled_row_has_a_rotation_bound(isa, dtype):
    a, b, c = bounds.rope_coefficients(isa, dtype)
    assert 0 <= a <= 2.0 ** -11 and 0 < b and 0 < c < 1e-6


def test_unknown_row_has_no_bound():
    with pytest.raises(ValueError, match="avx9"):
        bounds.rope_coefficients("avx9", "float16")


def _cmul(x, y, acc=None):
    """x * y per complex pair, the SDM order (src1 = x, src2 = y): the real part starts with
    x.re * y.re, the imaginary with x.im * y.re; with ``acc`` (VFMADDCPH) those first steps add
    the accumulator in the same fused operation.  Arrays [..., 2] of fp16 values as float64."""
    xr, xi, yr, yi = x[..., 0], x[..., 1], y[..., 0], y[..., 1]
    if acc is None:
        t_re, t_im = _round16(xr * yr).astype(np.float64), _round16(xi * yr).astype(np.float64)
    else:
        t_re = _fma16(xr, yr, acc[..., 0]).astype(np.float64)
        t_im = _fma16(xi, yr, acc[..., 1]).astype(np.float64)
    return np.stack([_fma16(-xi, yi, t_re), _fma16(xr, yi, t_im)], axis=-1).astype(np.float64)


def model_rotate_hilo(x, cs, swap_mul, swap_fma):
    """The avx512fp16 kernel: hi = fp16(m), lo = fp16(m - hi); p = x * lo; out = x * hi + p."""
    hi = _round16(cs).astype(np.float64)
    lo = _round16(cs - hi).astype(np.float64)
    p = _cmul(lo, x) if swap_mul else _cmul(x, lo)
    return _cmul(hi, x, p) if swap_fma else _cmul(x, hi, p)


@pytest.mark.parametrize("swap_mul", [False, True])
@pytest.mark.parametrize("swap_fma", [False, True])
def test_avx512fp16_rotation_bound_holds_for_the_model(rng, swap_mul, swap_fma):
    n = 400_000
    mag = 10.0 ** rng.uniform(-7.5, 4.0, n)
    x = _round16(rng.standard_normal((n, 2)) * mag[:, None]).astype(np.float64)
    ang = rng.uniform(-np.pi, np.pi, n)
    cs = np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32).astype(np.float64)  # as ops.c
    got = model_rotate_hilo(x, cs, swap_mul, swap_fma)
    exact = np.stack([x[:, 0] * np.cos(ang) - x[:, 1] * np.sin(ang),
                      x[:, 1] * np.cos(ang) + x[:, 0] * np.sin(ang)], -1)
    pair = np.broadcast_to(np.hypot(x[:, 0], x[:, 1])[:, None], x.shape)
    ok = np.abs(exact) < 60000          # fp16 overflow is outside every bound
    err = np.abs(got - exact)[ok]
    bound = bounds.rope_bound("avx512fp16", "float16", pair, exact)[ok]
    assert (err <= bound).all(), "model exceeds the bound by %g" % (err - bound).max()
    # and the bound is not loose: the model reaches at least half of its leading term
    big = ok & (pair > 1e-3)
    lead = 2.0 ** -11 * (pair + np.abs(exact))
    assert (np.abs(got - exact)[big] / lead[big]).max() > 0.5
    # the old kernel (one VFMULCPH by the fp16-rounded multiplier) does not meet it
    old = _cmul(x, _round16(cs).astype(np.float64))
    assert (np.abs(old - exact)[ok] > bound).any()


def test_references_and_bounds_refuse_what_ops_refuses():
    """reference.attend / bounds.attend_bound refuse what ops.attend refuses (heads that do not
    divide, a slope per head missing, ranges past the keys, a negative window, causal rows before
    the first key) instead of returning an empty or NaN result; the bounds' counts, style and D
    are checked; reference.forward names an unknown kv."""
    from kvsimd import reference
    from kvsimd.errors import KVSimdTypeError, KVSimdValueError
    q, k = np.ones((1, 8), np.float32), np.ones((2, 5, 8), np.float32)
    q4, k1 = np.ones((4, 8), np.float32), np.ones((1, 5, 8), np.float32)
    calls = [lambda: reference.attend(q, k, k), lambda: bounds.attend_bound(q, k, k),
             lambda: reference.attend(q4, k1, k1, alibi_slopes=[0.5]),
             lambda: reference.attend(q4, k1, k1, ranges=[(0, 50, False, 4)]),
             lambda: reference.attend(np.ones((3, 4, 8)), k1, k1, window=-1),
             lambda: reference.attend(np.ones((7, 4, 8)), k1, k1),
             lambda: bounds.quantized_step_bound(np.ones((6, 1), np.float32), -1),
             lambda: bounds.quantized_step_bound(np.ones((6, 1), np.float32), 64),
             lambda: bounds.pair_norm(np.ones((2, 8)), "bogus", 8),
             lambda: bounds.matmul_depth(-5, "avx2"),
             lambda: bounds.rope_bound("avx2", "float32", np.ones(8), np.ones(8), calls=0),
             lambda: bounds.rope_bound("avx2", "float32", None, np.ones(8)),
             lambda: reference.quantize_kv(np.ones((2, 32), np.float32), "int3"),
             lambda: reference.query_as_read(q, "int3"),
             lambda: bounds.score_rounding_error(q, k),                    # 1 query head on 2 KV heads
             lambda: bounds.score_rounding_error(q4, k1[:, :, :4]),        # head dims differ
             lambda: bounds.score_rounding_error(q4, k1, scale=np.nan),
             lambda: bounds.score_rounding_error(q4, k1, q_alt=q),         # q_alt of another shape
             lambda: bounds.score_chain(0)]
    for i, call in enumerate(calls):
        with pytest.raises(KVSimdValueError):
            call()
            pytest.fail("call %d was accepted" % i)
    # the counts by the library's one rule for integer arguments (_need_int): a float is a type error
    with pytest.raises(KVSimdTypeError, match=r"k must be an integer, got 2\.5"):
        bounds.matmul_depth(2.5, "avx2")
    with pytest.raises(KVSimdTypeError, match=r"scale must be a real number, got 'x'"):
        bounds.score_rounding_error(q4, k1, scale="x")
    with pytest.raises(KVSimdTypeError, match=r"D must be an integer, got 64\.0"):
        bounds.score_chain(64.0)
    # the score term: (score_chain(D) + 1) u32 |scale| sum |q||k|, score_chain(8) = 8 + 1 + 3
    assert np.allclose(bounds.score_rounding_error(q4, k1, scale=-0.5), 13 * 2.0 ** -24 * 0.5 * 8)
    with pytest.raises(KVSimdTypeError, match=r"calls must be an integer, got 2\.5"):
        bounds.rope_bound("avx2", "float32", np.ones(8), np.ones(8), calls=2.5)
    with pytest.raises(KVSimdValueError, match=r"D must be in 33\.\.64, got 65"):
        bounds.quantized_step_bound(np.ones((6, 2), np.float32), 65)
    assert bounds.quantized_step_bound(np.ones((6, 2), np.float32), 40).shape == (6, 40)
