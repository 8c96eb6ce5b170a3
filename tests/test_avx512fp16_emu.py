"""The avx512fp16 row, executed in an emulated Sapphire Rapids CPU (tests/emulator.py).

The guest runs the machine code of the installed extension module itself and is compared
with the scalar row run natively.  Tolerances (u = 2^-11, the fp16 unit roundoff):
  * fp16 rotation (VFMULCPH, one per element per call, multiplier (cos, sin) rounded to fp16):
    per component |out - exact| <= 4u |pair| + 2^-24, where 4u = 3u for VFMULCPH's two
    roundings per component (the bound derived in shared/docs/avx512fp16-testing.md) plus
    sqrt(2)/2 u for rounding the multiplier; against the scalar row (one rounding, <= u|out|)
    the sum of both.
  * fp32 rotation: 1e-5 |pair|; attention: 1e-5 (fp32 K/V) / 1e-4 (fp16 K/V) times
    sum_j p_j |v_jd| (as in test_attend.py); conversions: bit-identical to NumPy.
If bochscpu cannot be installed the tests skip with the reason, unless KVSIMD_REQUIRE_EMULATOR=1
(set by .ci/run), in which case they fail.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsimd
import kvsimd._kvsimd as ext
from kvsimd import ops, reference
from kvsimd.testing import use_isa

sys.path.insert(0, os.path.dirname(__file__))
import emulator  # noqa: E402
from emulator import ATTN_TYPES, ROT_TYPES, XCR0_YMM, XCR0_ZMM, EmuError, Guest, pack_struct  # noqa: E402

U = 2.0 ** -11
INFO = ext._kernel_addresses()
REQUIRED = os.environ.get("KVSIMD_REQUIRE_EMULATOR") == "1"


@pytest.fixture(scope="module")
def guest():
    if "avx512fp16" not in INFO["rows"]:
        pytest.fail("the avx512fp16 row is not compiled into this build")
    try:
        emulator.import_bochscpu()
        import elftools  # noqa: F401
    except Exception as e:  # ImportError, or the shim failing to build
        msg = "emulator unavailable (pip install 'bochscpu-python==0.4.0' pyelftools): %s" % e
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    return Guest(ext.__file__)


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
    kvsimd only uses the commutative VFMULCPH, so no VFCMULCPH may appear at all."""
    r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ext.__file__], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text, cur, funcs = r.stdout, None, {}
    for line in text.splitlines():
        if line.endswith(">:"):
            cur = line.split("<", 1)[1][:-2]
        elif cur and "avx512fp16" in cur:
            funcs.setdefault(cur, []).append(line)
    rot = "\n".join(funcs.get("kv_rotate_avx512fp16", []) + funcs.get("kv_rot_row_cmul_avx512fp16", []))
    assert "vfmulcph" in rot
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
    prm = pack_struct(INFO["rot_params"], {
        "x": xa, "cs": ca, "H": H, "D": D, "R": rd // 2, "n_total": N, "t0": t0, "t1": t1,
        "cs_stride": cs_stride, "dtype": 1 if x.dtype == np.float16 else 0,
        "style": 0 if style == "gptj" else 1}, ROT_TYPES)
    guest.call(guest.guest_address(fn("rotate")), guest.put(prm))
    out = np.frombuffer(guest.read(xa, x.nbytes), x.dtype).reshape(x.shape).copy()
    return out, guest.read(xa + x.nbytes, 128) == b"\xa5" * 128


def pair_norm(x, style, rd):
    from test_rope import pair_norm as pn
    return pn(x, style, rd)


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
    err = np.abs(got.astype(np.float64) - exact) - (4 * U * norm + 2.0 ** -24)
    assert err.max() <= 0, "exceeds the one-rotation bound by %g" % err.max()
    with use_isa("scalar"):
        native = x.copy()
        ops.shift_keys(native, delta, style=style, rotary_dim=rd)
    err = np.abs(got.astype(np.float64) - native) - (5 * U * norm + 2.0 ** -23)
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
    norm = pair_norm(x, style, rd)
    tol = 4 * U * norm + 2.0 ** -24 if dtype == "float16" else 1e-5 * norm + 1e-30
    assert (np.abs(got.astype(np.float64) - exact) - tol).max() <= 0


def test_shift_range_leaves_other_tokens(guest, rng):
    x = rng.standard_normal((2, 40, 64)).astype(np.float16)
    cs = ext._rope_table(-5.0, 10000.0, 32, 64)
    got, _ = guest_rotate(guest, x, cs, 0, "gptj", 64, t0=10, t1=25)
    assert np.array_equal(got[:, :10], x[:, :10]) and np.array_equal(got[:, 25:], x[:, 25:])
    assert not np.array_equal(got[:, 10:25], x[:, 10:25])


def test_rope_then_shift_matches_rope_at_shifted_position(guest, rng):
    """The accuracy statement of kvsimd.ops: each fp16 call rounds once; two calls, two bounds."""
    H, N, D = 2, 24, 64
    x = rng.standard_normal((H, N, D)).astype(np.float16)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    for delta in (-(2**20), -1, 3, 2**20):
        cs = np.concatenate([ext._rope_table(float(p), 1e5, 32, 64) for p in pos])
        a, _ = guest_rotate(guest, x, cs, 64, "neox", 64)
        b, _ = guest_rotate(guest, a, ext._rope_table(float(delta), 1e5, 32, 64), 0, "neox", 64)
        exact = reference.apply_rope(x, pos + delta, style="neox", theta=1e5)
        tol = 2 * (4 * U * pair_norm(x, "neox", 64) + 2.0 ** -24)
        assert (np.abs(b.astype(np.float64) - exact) - tol).max() <= 0, delta


def test_rotation_special_values(guest):
    x = np.zeros((1, 4, 32), np.float16)
    x[0, 0, :2] = [np.inf, 0]
    x[0, 1, :2] = [np.nan, 1]
    x[0, 2, :2] = [0.0, -0.0]
    x[0, 3, :4] = [6e-8, 0, 3e-5, 0]   # subnormals
    ident = ext._rope_table(0.0, 10000.0, 16, 32)         # angle 0: (1, 0) pairs
    got, _ = guest_rotate(guest, x, ident, 0, "gptj", 32)
    assert np.isinf(got[0, 0, 0]) and np.isnan(got[0, 1, 0])
    assert np.all(got[0, 2] == 0) and np.array_equal(got[0, 3], x[0, 3])  # no flush to zero
    turn = ext._rope_table(1.0, 10000.0, 16, 32)
    got, _ = guest_rotate(guest, x, turn, 0, "gptj", 32)
    assert np.isnan(got[0, 0, :2]).any() or np.isinf(got[0, 0, :2]).all()  # inf*cos - 0*sin
    assert np.isnan(got[0, 1, 0])


# ------------------------------------------------------------------------------ attention
def guest_attend(guest, q, k, v, alibi=None, kpos=None, qpos=0, ranges=None, q_alt=None):
    H, D = q.shape
    Hkv, N, _ = k.shape
    out = guest.alloc(4 * H * D)
    ml = guest.alloc(8 * H)
    ws = guest.alloc(ext._attn_workspace_bytes(H, Hkv, D), align=64)
    extra = {}
    if ranges is not None:   # kv_attn_range rows: (use q_alt, t0, t1, query position)
        rows = np.array([(int(r[2]), r[0], r[1], r[3]) for r in ranges], dtype=np.int64)
        extra = {"ranges": guest.put(rows), "n_ranges": len(ranges), "q_alt": guest.put(q_alt)}
    prm = pack_struct(INFO["attn_params"], {**extra,
        "q": guest.put(q), "k": guest.put(k, offset=2), "v": guest.put(v, offset=2), "out": out,
        "m": ml, "l": ml + 4 * H, "alibi": guest.put(alibi) if alibi is not None else 0,
        "key_pos": guest.put(kpos) if kpos is not None else 0, "query_pos": qpos,
        "H": H, "Hkv": Hkv, "D": D, "n_total": N, "t0": 0, "t1": N, "g0": 0, "g1": Hkv,
        "scale": 1.0 / np.sqrt(D), "dtype": 1 if k.dtype == np.float16 else 0, "init": 1, "finalize": 1},
        ATTN_TYPES)
    guest.call(guest.guest_address(fn("attn")), guest.put(prm), ws)
    return np.frombuffer(guest.read(out, 4 * H * D), np.float32).reshape(H, D)


ATTN_CASES = [(1, 1, 1, 1), (4, 1, 15, 3), (9, 3, 16, 64), (8, 2, 17, 17), (6, 2, 31, 80), (32, 8, 33, 128),
              (16, 2, 100, 64), (3, 3, 1000, 96), (8, 1, 64, 256), (2, 1, 20, 512)]


@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_attention_against_scalar_row(guest, rng, H, Hkv, N, D, dtype):
    from test_attend import assert_close, make, weighted_scale
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    slopes = rng.uniform(0, 0.3, H).astype(np.float32)
    kpos = np.arange(500, 500 + N, dtype=np.int64)
    got = guest_attend(guest, q, k, v, slopes, kpos, 500 + N)
    with use_isa("scalar"):
        want = ops.attend(q, k, v, alibi_slopes=slopes, key_positions=kpos, query_position=500 + N)
    ws = weighted_scale(q, k, v, alibi_slopes=slopes, key_positions=kpos, query_position=500 + N)
    tol = 1e-5 if dtype == "float32" else 1e-4
    assert_close(got, want.astype(np.float64), ws, tol, "avx512fp16 vs scalar")
    ref = reference.attend(q, k, v, alibi_slopes=slopes, key_positions=kpos, query_position=500 + N)
    assert_close(got, ref, ws, tol, "avx512fp16 vs float64")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_attention_ranges_with_alternate_query(guest, rng, dtype):
    """A ring cache's read: sinks scored with q_alt at their own ALiBi query position, the
    window in two pieces (wrapped), one softmax; against the float64 reference."""
    from test_attend import assert_close, make, weighted_scale
    q, k, v = make(rng, 8, 2, 90, 64, dtype)
    q_alt = rng.standard_normal(q.shape).astype(np.float32)
    slopes = rng.uniform(0, 0.3, 8).astype(np.float32)
    kpos = rng.permutation(90).astype(np.int64)
    ranges = [(0, 4, True, 40), (57, 90, False, 95), (4, 50, False, 95)]
    kw = dict(alibi_slopes=slopes, key_positions=kpos, ranges=ranges, q_alt=q_alt)
    got = guest_attend(guest, q, k, v, slopes, kpos, 0, ranges=ranges, q_alt=q_alt)
    tol = 1e-5 if dtype == "float32" else 1e-4
    assert_close(got, reference.attend(q, k, v, **kw), weighted_scale(q, k, v, **kw), tol, "avx512fp16 vs float64")


def test_attention_without_alibi(guest, rng):
    from test_attend import assert_close, make, weighted_scale
    q, k, v = make(rng, 9, 3, 257, 64, "float16")
    assert_close(guest_attend(guest, q, k, v), reference.attend(q, k, v), weighted_scale(q, k, v), 1e-4)


def test_guest_fault_is_reported(guest):
    """The harness itself must be able to fail: a wild pointer faults, it does not pass."""
    with pytest.raises(EmuError, match="unmapped|#PF"):
        guest.call(guest.guest_address(fn("f16_to_f32")), 0x5000_0000_0000, 0x10, 64)
