"""The avx512fp16 row, executed in an emulated Sapphire Rapids CPU (tests/emulator.py).

The guest runs the machine code of the installed extension module itself and is compared
with the scalar row run natively.  Every tolerance comes from kvsimd.bounds with isa
"avx512fp16" (rope_bound, attend_bound): the bounds the native tests apply when this row is
the active one, and the rotation cases of tests/test_rope.py run here unchanged (``EmuRot``).
If bochscpu cannot be installed the tests skip with the reason, unless KVSIMD_REQUIRE_EMULATOR=1
(set by .ci/run), in which case they fail.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvsimd
import kvsimd._kvsimd as ext
from kvsimd import ops, reference
from kvsimd.bounds import attend_bound, pair_norm, rope_bound
from kvsimd.testing import use_isa

sys.path.insert(0, os.path.dirname(__file__))
import emulator  # noqa: E402
import test_attend  # noqa: E402
import test_rope  # noqa: E402
from strategies import gqa_ratios, head_dims, kv_dtypes, kv_heads, rope_shapes, seeds, styles, token_counts  # noqa: E402,E501
from emulator import XCR0_YMM, XCR0_ZMM, EmuError, pack_struct  # noqa: E402

INFO = ext._kernel_addresses()
REQUIRED = os.environ.get("KVSIMD_REQUIRE_EMULATOR") == "1"


@pytest.fixture(scope="module")
def guest():
    if "avx512fp16" not in INFO["rows"]:
        pytest.fail("the avx512fp16 row is not compiled into this build")
    return emulator.shared_guest(ext.__file__)


@pytest.fixture(autouse=True)
def fresh_arena(request):
    if "guest" in request.fixturenames:
        request.getfixturevalue("guest").reset_arena()


def fn(name):
    return INFO["rows"]["avx512fp16"][name]


# ------------------------------------------------------------------------------ detection
def test_detection_picks_avx512fp16_only_with_zmm_state(guest):
    bits = INFO["feature_bits"]
    f = guest.call(guest.guest_address(INFO["kv_cpu_features"]), xcr0=XCR0_ZMM)
    assert f & bits["avx512fp16"] and f & bits["avx2"]
    assert guest.call(guest.guest_address(INFO["kv_select_isa"]), f, xcr0=XCR0_ZMM) == INFO["isa_index"]["avx512fp16"]
    # same CPU, but an OS that does not save ZMM/opmask state: AVX-512 must not be chosen
    f = guest.call(guest.guest_address(INFO["kv_cpu_features"]), xcr0=XCR0_YMM)
    assert not f & bits["avx512fp16"] and f & bits["avx2"]
    assert guest.call(guest.guest_address(INFO["kv_select_isa"]), f, xcr0=XCR0_YMM) == INFO["isa_index"]["avx2"]


def test_cpu_without_fp16_never_selects_it():
    """A Tiger Lake model (AVX-512 but no AVX512-FP16), in a child process (one CPU per process)."""
    if not REQUIRED:
        try:
            emulator.import_bochscpu()
        except Exception as e:
            pytest.skip("emulator unavailable: %s" % e)
    r = subprocess.run([sys.executable, emulator.__file__, "tigerlake", ext.__file__],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.split("\n") if "=" in line)
    fp16 = str(INFO["isa_index"]["avx512fp16"])
    assert out["select_zmm"] == str(INFO["isa_index"]["avx2"]) and out["select_ymm"] != fp16
    assert "#UD" in out["fp16_kernel"], out  # the FP16 instructions really are absent there


def test_forcing_avx512fp16_natively_fails_with_a_message():
    if "avx512fp16" in kvsimd.isa_info()["supported"]:
        pytest.skip("this CPU runs avx512fp16 natively")
    env = dict(os.environ, KVSIMD_FORCE_ISA="avx512fp16")
    r = subprocess.run([sys.executable, "-c", "import kvsimd"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "this CPU cannot run ISA 'avx512fp16'" in r.stderr


def test_object_code_uses_vfmulcph_and_avoids_the_gcc12_vfcmulcph_bug():
    """GCC 12 swaps the operands of _mm512_fcmul_pch with a memory operand (shared/docs):
    kvsimd only uses VFMULCPH and VFMADDCPH (x * m), so no VFCMULCPH may appear at all."""
    r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ext.__file__], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text, cur, funcs = r.stdout, None, {}
    for line in text.splitlines():
        if line.endswith(">:"):
            cur = line.split("<", 1)[1][:-2]
        elif cur and "avx512fp16" in cur:
            funcs.setdefault(cur, []).append(line)
    rot = "\n".join(funcs.get("kv_rotate_avx512fp16", []) + funcs.get("kv_rot_row_cmul_avx512fp16", []))
    assert "vfmulcph" in rot and "vfmaddcph" in rot   # x * lo, then x * hi + that
    assert not any("vfcmulcph" in line for lines in funcs.values() for line in lines)


# ------------------------------------------------------------------------------ conversion
def test_f16_to_f32_all_halves(guest):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    src, dst = guest.put(h), guest.alloc(4 << 16)
    guest.call(guest.guest_address(fn("f16_to_f32")), dst, src, h.size)
    got = np.frombuffer(guest.read(dst, 4 << 16), np.uint32)
    np.testing.assert_array_equal(got, h.view(np.float16).astype(np.float32).view(np.uint32))


def test_f32_to_f16_bit_identical(guest, rng):
    from test_convert import interesting_floats
    f = interesting_floats(rng)[:300_000]
    src, dst = guest.put(f), guest.alloc(2 * f.size)
    guest.call(guest.guest_address(fn("f32_to_f16")), dst, src, f.size)
    got = np.frombuffer(guest.read(dst, 2 * f.size), np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(hex(f.view(np.uint32)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 1000])
def test_conversion_lengths_unaligned_and_guarded(guest, rng, n):
    f = (rng.standard_normal(n) * 100).astype(np.float32)
    src = guest.put(f, offset=4)
    dst = guest.put(np.zeros(n, np.uint16), offset=2, guard=64)
    guest.call(guest.guest_address(fn("f32_to_f16")), dst, src, n)
    np.testing.assert_array_equal(np.frombuffer(guest.read(dst, 2 * n), np.uint16), f.astype(np.float16).view(np.uint16))
    assert guest.read(dst + 2 * n, 64) == b"\xa5" * 64
    back = guest.put(np.zeros(n, np.float32), offset=4, guard=64)
    guest.call(guest.guest_address(fn("f16_to_f32")), back, dst, n)
    np.testing.assert_array_equal(np.frombuffer(guest.read(back, 4 * n), np.float32), f.astype(np.float16).astype(np.float32))
    assert guest.read(back + 4 * n, 64) == b"\xa5" * 64


# ------------------------------------------------------------------------------ rotation
def guest_rotate(guest, x, cs, cs_stride, style, rd, t0=0, t1=None, offset=2):
    """Run the avx512fp16 rotate kernel on a copy of x [H, N, D]; returns (result, guard_ok)."""
    H, N, D = x.shape
    t1 = N if t1 is None else t1
    xa = guest.put(x, offset=offset, guard=128)
    ca = guest.put(np.ascontiguousarray(cs, np.float32), offset=4)
    prm = pack_struct(INFO["structs"]["kv_rot_params"], {
        "x": xa, "cs": ca, "H": H, "D": D, "R": rd // 2, "n_total": N, "t0": t0, "t1": t1,
        "cs_stride": cs_stride, "dtype": 1 if x.dtype == np.float16 else 0,
        "style": 0 if style == "gptj" else 1})
    guest.call(guest.guest_address(fn("rotate")), guest.put(prm))
    out = np.frombuffer(guest.read(xa, x.nbytes), x.dtype).reshape(x.shape).copy()
    return out, guest.read(xa + x.nbytes, 128) == b"\xa5" * 128


class EmuRot:
    """``apply_rope`` / ``shift_keys`` (the signatures of kvsimd.ops) on the avx512fp16 row in the
    emulator: the angles come from the extension's own table function (double precision, as
    ops.c computes them), the rotation from the row's kernel."""

    def __init__(self, guest):
        self.guest = guest

    def _run(self, x, cs, cs_stride, style, rd, t0=0, t1=None):
        self.guest.reset_arena()
        out, guard_ok = guest_rotate(self.guest, x, cs, cs_stride, style, rd, t0, t1)
        assert guard_ok, "wrote past the end"
        x[...] = out

    def apply_rope(self, x, positions, *, theta=10000.0, style="gptj", rotary_dim=None):
        rd = x.shape[-1] if rotary_dim is None else rotary_dim
        cs = np.concatenate([ext._rope_table(float(p), theta, rd // 2, rd) for p in positions])
        self._run(x, cs, rd, style, rd)

    def shift_keys(self, k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, start=0, stop=None):
        rd = k.shape[-1] if rotary_dim is None else rotary_dim
        self._run(k, ext._rope_table(float(delta), theta, rd // 2, rd), 0, style, rd, start, stop)


ROT_SHAPES = [(1, 1, 2, 2), (2, 15, 64, 64), (3, 16, 80, 80), (2, 17, 128, 128), (1, 33, 64, 32),
              (2, 31, 34, 34), (1, 5, 512, 512), (2, 9, 96, 16), (1, 3, 40, 38)]


@pytest.mark.parametrize("H,N,D,rd", ROT_SHAPES)
@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("delta", [1, -7, 2**20, -(2**20)])
def test_shift_fp16_vfmulcph(guest, rng, H, N, D, rd, style, delta):
    x = rng.standard_normal((H, N, D)).astype(np.float16)
    cs = ext._rope_table(float(delta), 10000.0, rd // 2, rd)
    got, guard_ok = guest_rotate(guest, x, cs, 0, style, rd)
    assert guard_ok, "wrote past the end"
    assert np.array_equal(got[..., rd:].view(np.uint16), x[..., rd:].view(np.uint16))
    exact = reference.shift_keys(x, delta, style=style, rotary_dim=rd)
    norm = pair_norm(x, style, rd)
    err = np.abs(got.astype(np.float64) - exact) - rope_bound("avx512fp16", "float16", norm, exact)
    assert err.max() <= 0, "exceeds the one-rotation bound by %g" % err.max()
    with use_isa("scalar"):
        native = x.copy()
        ops.shift_keys(native, delta, style=style, rotary_dim=rd)
    tol = rope_bound("avx512fp16", "float16", norm, exact) + rope_bound("scalar", "float16", norm, exact)
    err = np.abs(got.astype(np.float64) - native) - tol
    assert err.max() <= 0, "differs from the scalar row by %g beyond the bound" % err.max()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_apply_rope_per_token(guest, rng, dtype, style):
    H, N, D, rd = 3, 37, 80, 64
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2**31, N, dtype=np.int64)
    cs = np.concatenate([ext._rope_table(float(p), 10000.0, rd // 2, rd) for p in pos])
    got, guard_ok = guest_rotate(guest, x, cs, rd, style, rd)
    assert guard_ok
    exact = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    tol = rope_bound("avx512fp16", dtype, pair_norm(x, style, rd), exact)
    assert (np.abs(got.astype(np.float64) - exact) - tol).max() <= 0


def test_shift_range_leaves_other_tokens(guest, rng):
    x = rng.standard_normal((2, 40, 64)).astype(np.float16)
    cs = ext._rope_table(-5.0, 10000.0, 32, 64)
    got, _ = guest_rotate(guest, x, cs, 0, "gptj", 64, t0=10, t1=25)
    assert np.array_equal(got[:, :10], x[:, :10]) and np.array_equal(got[:, 25:], x[:, 25:])
    assert not np.array_equal(got[:, 10:25], x[:, 10:25])


def test_rope_then_shift_matches_rope_at_shifted_position(guest, rng):
    """The accuracy statement of kvsimd.ops: two calls, two per-call bounds."""
    H, N, D = 2, 24, 64
    x = rng.standard_normal((H, N, D)).astype(np.float16)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    for delta in (-(2**20), -1, 3, 2**20):
        cs = np.concatenate([ext._rope_table(float(p), 1e5, 32, 64) for p in pos])
        a, _ = guest_rotate(guest, x, cs, 64, "neox", 64)
        b, _ = guest_rotate(guest, a, ext._rope_table(float(delta), 1e5, 32, 64), 0, "neox", 64)
        exact = reference.apply_rope(x, pos + delta, style="neox", theta=1e5)
        tol = rope_bound("avx512fp16", "float16", pair_norm(x, "neox", 64), exact, calls=2)
        assert (np.abs(b.astype(np.float64) - exact) - tol).max() <= 0, delta


def test_rotation_special_values(guest):
    x = np.zeros((1, 4, 32), np.float16)
    x[0, 0, :2] = [np.inf, 0]
    x[0, 1, :2] = [np.nan, 1]
    x[0, 2, :2] = [0.0, -0.0]
    x[0, 3, :4] = [6e-8, 0, 3e-5, 0]   # subnormals
    ident = ext._rope_table(0.0, 10000.0, 16, 32)         # angle 0: (1, 0) pairs
    got, _ = guest_rotate(guest, x, ident, 0, "gptj", 32)
    # inf stays non-finite (x * lo = inf * 0 is NaN: as the native test, inf or NaN), NaN stays NaN
    assert (np.isinf(got[0, 0, 0]) or np.isnan(got[0, 0, 0])) and np.isnan(got[0, 1, 0])
    assert np.all(got[0, 2] == 0) and np.array_equal(got[0, 3], x[0, 3])  # no flush to zero
    turn = ext._rope_table(1.0, 10000.0, 16, 32)
    got, _ = guest_rotate(guest, x, turn, 0, "gptj", 32)
    assert np.isnan(got[0, 0, :2]).any() or np.isinf(got[0, 0, :2]).all()  # inf*cos - 0*sin
    assert np.isnan(got[0, 1, 0])


# ------------------------------------------------------------------------------ test_rope.py's cases
# The same case bodies and bounds as the native tests: they pass here exactly when they would
# pass natively on a CPU whose active row is avx512fp16 (the emulator is bit-exact to it).
@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, pos_kind=test_rope.pos_kinds)
def test_rope_cases_apply_rope(guest, shape, dtype, style, seed, pos_kind):
    test_rope.case_apply_rope(EmuRot(guest), "avx512fp16", shape, dtype, style, seed, pos_kind)


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=test_rope.shift_deltas,
       theta=test_rope.thetas)
def test_rope_cases_rope_then_shift(guest, shape, dtype, style, seed, delta, theta):
    test_rope.case_rope_then_shift(EmuRot(guest), "avx512fp16", shape, dtype, style, seed, delta, theta)


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=st.integers(-2**20, 2**20))
def test_rope_cases_shift_there_and_back(guest, shape, dtype, style, seed, delta):
    test_rope.case_shift_there_and_back(EmuRot(guest), "avx512fp16", shape, dtype, style, seed, delta)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_rope_cases_shift_range_only(guest, rng, dtype, style):
    test_rope.case_shift_range_only(EmuRot(guest), "avx512fp16", rng, dtype, style)


# ------------------------------------------------------------------------------ attention
def guest_attend(guest, q, k, v, alibi=None, kpos=None, qpos=0, ranges=None, q_alt=None, scale=None):
    H, D = q.shape
    Hkv, N, _ = k.shape
    out = guest.alloc(4 * H * D)
    ws = guest.alloc(ext._attn_workspace_bytes(H, Hkv, D), align=64)
    extra = {}
    if ranges is None:       # kv_attn_range rows: (t0, t1, use q_alt, query position)
        ranges = [(0, N, False, qpos)]
    else:
        extra = {"q_alt": guest.put(q_alt)}
    rows = b"".join(pack_struct(INFO["structs"]["kv_attn_range"],
                                {"query": int(r[2]), "t0": r[0], "t1": r[1], "query_pos": r[3]}) for r in ranges)
    prm = pack_struct(INFO["structs"]["kv_attn_params"], {**extra,
        "q": guest.put(q), "k": guest.put(k, offset=2), "v": guest.put(v, offset=2), "out": out,
        "alibi": guest.put(alibi) if alibi is not None else 0,
        "key_pos": guest.put(kpos) if kpos is not None else 0,
        "ranges": guest.put(rows), "n_ranges": len(ranges),
        "H": H, "Hkv": Hkv, "D": D, "n_total": N,
        "scale": 1.0 / np.sqrt(D) if scale is None else scale, "dtype": 1 if k.dtype == np.float16 else 0})
    guest.call(guest.guest_address(fn("attn")), guest.put(prm), 0, Hkv, ws)
    return np.frombuffer(guest.read(out, 4 * H * D), np.float32).reshape(H, D)


class EmuAttend:
    """``attend`` (the signature and defaults of kvsimd.ops.attend) on the avx512fp16 row in the
    emulator."""

    def __init__(self, guest):
        self.guest = guest

    def attend(self, q, k, v, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None,
               ranges=None, q_alt=None):
        N = k.shape[1]
        qpos = N - 1 if query_position is None else query_position
        if ranges is not None:
            ranges = [(r[0], r[1], bool(r[2]) if len(r) > 2 else False, r[3] if len(r) > 3 else qpos)
                      for r in ranges]
        self.guest.reset_arena()
        return guest_attend(self.guest, q, k, v, alibi_slopes, key_positions, qpos, ranges, q_alt, scale)


ATTN_CASES = [(1, 1, 1, 1), (4, 1, 15, 3), (9, 3, 16, 64), (8, 2, 17, 17), (6, 2, 31, 80), (32, 8, 33, 128),
              (16, 2, 100, 64), (3, 3, 1000, 96), (8, 1, 64, 256), (2, 1, 20, 512)]


def _emulated_alibi_case(guest, rng, H, Hkv, N, D, dtype):
    """Random q, k, v and ALiBi slopes at key positions 500..500+N-1 (query at 500+N), and the
    emulated avx512fp16 row's attention of them."""
    from test_attend import make
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    slopes = rng.uniform(0, 0.3, H).astype(np.float32)
    kpos = np.arange(500, 500 + N, dtype=np.int64)
    return q, k, v, slopes, kpos, guest_attend(guest, q, k, v, slopes, kpos, 500 + N)


@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_attention_against_scalar_row(guest, rng, H, Hkv, N, D, dtype):
    from test_attend import assert_within
    q, k, v, slopes, kpos, got = _emulated_alibi_case(guest, rng, H, Hkv, N, D, dtype)
    kw = dict(alibi_slopes=slopes, key_positions=kpos, query_position=500 + N)
    with use_isa("scalar"):
        want = ops.attend(q, k, v, **kw)
    bound = attend_bound(q, k, v, **kw)
    assert_within(got, want.astype(np.float64), 2 * bound, "avx512fp16 vs scalar")
    assert_within(got, reference.attend(q, k, v, **kw), bound, "avx512fp16 vs float64")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_attention_ranges_with_alternate_query(guest, rng, dtype):
    """A ring cache's read: sinks scored with q_alt at their own ALiBi query position, the
    window in two pieces (wrapped), one softmax; against the float64 reference."""
    from test_attend import assert_within, make
    q, k, v = make(rng, 8, 2, 90, 64, dtype)
    q_alt = rng.standard_normal(q.shape).astype(np.float32)
    slopes = rng.uniform(0, 0.3, 8).astype(np.float32)
    kpos = rng.permutation(90).astype(np.int64)
    ranges = [(0, 4, True, 40), (57, 90, False, 95), (4, 50, False, 95)]
    kw = dict(alibi_slopes=slopes, key_positions=kpos, ranges=ranges, q_alt=q_alt)
    got = guest_attend(guest, q, k, v, slopes, kpos, 0, ranges=ranges, q_alt=q_alt)
    assert_within(got, reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), "avx512fp16 vs float64")


def test_attention_without_alibi(guest, rng):
    from test_attend import assert_within, make
    q, k, v = make(rng, 9, 3, 257, 64, "float16")
    assert_within(guest_attend(guest, q, k, v), reference.attend(q, k, v), attend_bound(q, k, v))


# test_attend.py's cases, with the same bounds (fewer examples: the emulator runs ~5M instructions/s)
EMU_EXAMPLES = settings(max_examples=min(settings.default.max_examples, 20))


@EMU_EXAMPLES
@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       q_scale=st.sampled_from([0.0, 0.3, 1.0, 3.0]))
def test_attend_cases_matches_reference(guest, hkv, ratio, N, D, dtype, seed, q_scale):
    test_attend.case_matches_reference(EmuAttend(guest), "avx512fp16", hkv, ratio, N, D, dtype, seed, q_scale)


@EMU_EXAMPLES
@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       explicit=st.booleans())
@example(hkv=1, ratio=1, N=40, D=512, dtype="float32", seed=202, explicit=True)
def test_attend_cases_alibi(guest, hkv, ratio, N, D, dtype, seed, explicit):
    test_attend.case_alibi(EmuAttend(guest), "avx512fp16", hkv, ratio, N, D, dtype, seed, explicit)


@EMU_EXAMPLES
@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       alibi=st.booleans())
def test_attend_cases_ranges_with_alternate_query(guest, hkv, ratio, N, D, dtype, seed, alibi):
    test_attend.case_ranges_with_alternate_query(EmuAttend(guest), "avx512fp16", hkv, ratio, N, D, dtype, seed,
                                                 alibi)


# ------------------------------------------------------------------------------ native vs emulated
NATIVE_FP16 = "avx512fp16" in kvsimd.isa_info()["supported"]


@pytest.mark.skipif(not NATIVE_FP16, reason="CPU lacks AVX512-FP16")
@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("delta", [1, -7, 2**20])
def test_native_rotation_equals_emulated(guest, rng, style, delta):
    """On a CPU that runs the row natively, the emulator must give the very same bits."""
    for H, N, D, rd in ROT_SHAPES:
        x = rng.standard_normal((H, N, D)).astype(np.float16)
        pos = rng.integers(0, 2**31, N, dtype=np.int64)
        emu, native = x.copy(), x.copy()
        EmuRot(guest).apply_rope(emu, pos, style=style, rotary_dim=rd)
        EmuRot(guest).shift_keys(emu, delta, style=style, rotary_dim=rd)
        with use_isa("avx512fp16"):
            ops.apply_rope(native, pos, style=style, rotary_dim=rd)
            ops.shift_keys(native, delta, style=style, rotary_dim=rd)
        assert np.array_equal(emu.view(np.uint16), native.view(np.uint16)), (H, N, D, rd)


@pytest.mark.skipif(not NATIVE_FP16, reason="CPU lacks AVX512-FP16")
@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_native_attention_equals_emulated(guest, rng, H, Hkv, N, D, dtype):
    q, k, v, slopes, kpos, got = _emulated_alibi_case(guest, rng, H, Hkv, N, D, dtype)
    with use_isa("avx512fp16"):
        want = ops.attend(q, k, v, alibi_slopes=slopes, key_positions=kpos, query_position=500 + N)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_guest_fault_is_reported(guest):
    """The harness itself must be able to fail: a wild pointer faults, it does not pass."""
    with pytest.raises(EmuError, match="unmapped|#PF"):
        guest.call(guest.guest_address(fn("f16_to_f32")), 0x5000_0000_0000, 0x10, 64)
