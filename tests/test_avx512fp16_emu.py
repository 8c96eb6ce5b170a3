"""What only the emulator can check about the avx512fp16 row (tests/emulator.py, an emulated
Sapphire Rapids running the machine code of the extension module itself).

The kernel cases (attention, rotation, conversion) are not here: tests/test_attend.py,
test_rope.py and test_convert.py run each of them on every compiled row through the ``row``
fixture of tests/conftest.py, the avx512fp16 row in the emulator when this CPU lacks it.  Here:
CPU detection in the guest, a CPU model without FP16, the object code, the harness's own
failure, and (on a CPU with AVX512-FP16) native and emulated bits being the same.
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
from kvsimd import ops
from kvsimd.testing import use_isa

sys.path.insert(0, os.path.dirname(__file__))
import emulator  # noqa: E402
from conftest import EmulatedRow  # noqa: E402
from emulator import XCR0_YMM, XCR0_ZMM, EmuError  # noqa: E402
from test_attend import alibi_case, ATTN_CASES  # noqa: E402
from test_rope import ROT_SHAPES  # noqa: E402

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
    """A Tiger Lake model (AVX-512 but no AVX512-FP16), in a child process (one CPU per process);
    what it selects instead (avx512) is checked in test_avx512_emu.py."""
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
    assert out["select_zmm"] != fp16 and out["select_ymm"] != fp16
    assert "#UD" in out["kernel_avx512fp16"], out  # the FP16 instructions really are absent there


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


# ------------------------------------------------------------------------------ native vs emulated
NATIVE_FP16 = "avx512fp16" in kvsimd.isa_info()["supported"]


@pytest.mark.skipif(not NATIVE_FP16, reason="CPU lacks AVX512-FP16")
@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("delta", [1, -7, 2**20])
def test_native_rotation_equals_emulated(guest, rng, style, delta):
    """On a CPU that runs the row natively, the emulator must give the very same bits."""
    emu_row = EmulatedRow("avx512fp16", guest)
    for H, N, D, rd in ROT_SHAPES:
        x = rng.standard_normal((H, N, D)).astype(np.float16)
        pos = rng.integers(0, 2**31, N, dtype=np.int64)
        emu, native = x.copy(), x.copy()
        emu_row.apply_rope(emu, pos, style=style, rotary_dim=rd)
        emu_row.shift_keys(emu, delta, style=style, rotary_dim=rd)
        with use_isa("avx512fp16"):
            ops.apply_rope(native, pos, style=style, rotary_dim=rd)
            ops.shift_keys(native, delta, style=style, rotary_dim=rd)
        assert np.array_equal(emu.view(np.uint16), native.view(np.uint16)), (H, N, D, rd)


@pytest.mark.skipif(not NATIVE_FP16, reason="CPU lacks AVX512-FP16")
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_native_scaled_rotation_equals_emulated(guest, rng, style):
    """The same with explicit frequencies and an attention factor (scaled RoPE)."""
    emu_row = EmulatedRow("avx512fp16", guest)
    for H, N, D, rd in ROT_SHAPES:
        x = rng.standard_normal((H, N, D)).astype(np.float16)
        pos = rng.integers(0, 2**31, N, dtype=np.int64)
        kw = dict(style=style, rotary_dim=rd, inv_freq=rng.uniform(1e-4, 1.0, rd // 2))
        emu, native = x.copy(), x.copy()
        emu_row.apply_rope(emu, pos, attn_factor=1.17, **kw)
        emu_row.shift_keys(emu, -5, **kw)
        with use_isa("avx512fp16"):
            ops.apply_rope(native, pos, attn_factor=1.17, **kw)
            ops.shift_keys(native, -5, **kw)
        assert np.array_equal(emu.view(np.uint16), native.view(np.uint16)), (H, N, D, rd)


@pytest.mark.skipif(not NATIVE_FP16, reason="CPU lacks AVX512-FP16")
@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_native_attention_equals_emulated(guest, rng, H, Hkv, N, D, dtype):
    q, k, v, kw = alibi_case(rng, H, Hkv, N, D, dtype)
    got = EmulatedRow("avx512fp16", guest).attend(q, k, v, **kw)
    with use_isa("avx512fp16"):
        want = ops.attend(q, k, v, **kw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_softcapped_attention_in_the_emulator(guest, rng, H, Hkv, N, D, dtype):
    """The soft cap (kv_attn_params.softcap, packed from the layout C reports) with ALiBi and a
    sink range scored with q_alt: within the float64 bound, and on a CPU with AVX512-FP16 the
    same bits as the native row."""
    from kvsimd import reference
    from kvsimd.bounds import attend_bound
    q, k, v, kw = alibi_case(rng, H, Hkv, N, D, dtype)
    q *= 10                                     # most scores saturate at cap 3
    kw.update(softcap=3.0, q_alt=(rng.standard_normal(q.shape) * 10).astype(np.float32),
              ranges=[(0, min(N, 4), True, 499)] + ([(4, N)] if N > 4 else []))
    got = EmulatedRow("avx512fp16", guest).attend(q, k, v, **kw)
    err = np.abs(got - reference.attend(q, k, v, **kw)) / attend_bound(q, k, v, **kw)
    assert err.max() <= 1, err.max()
    if NATIVE_FP16:
        with use_isa("avx512fp16"):
            want = ops.attend(q, k, v, **kw)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# tiles of < 32 query vectors (one vector per query) and of >= 32 (queries on the lanes: 12 rows x
# 3 heads, 40 rows x 1 head with a head-dim tail)
@pytest.mark.parametrize("T,H,Hkv,N,D", [(2, 4, 2, 2, 64), (7, 9, 3, 40, 64), (20, 4, 4, 37, 17),
                                         (12, 9, 3, 30, 64), (40, 2, 2, 50, 17)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_multi_row_attention_in_the_emulator(guest, rng, T, H, Hkv, N, D, dtype):
    """Several query rows (kv_attn_params.T, strides, causal_end, window) with ALiBi, a soft cap
    and a window: within the float64 bound, and on a CPU with AVX512-FP16 the native bits."""
    from kvsimd import reference
    from kvsimd.bounds import attend_bound
    q = (rng.standard_normal((T, H, D)) * 3).astype(np.float32)
    k = rng.standard_normal((Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((Hkv, N, D)).astype(dtype)
    for kw in (dict(), dict(alibi_slopes=rng.uniform(0, 0.5, H).astype(np.float32), softcap=2.0, window=5),
               dict(causal=False)):
        got = EmulatedRow("avx512fp16", guest).attend(q, k, v, **kw)
        err = np.abs(got - reference.attend(q, k, v, **kw)) / attend_bound(q, k, v, **kw)
        assert err.max() <= 1, (kw, err.max())
        if NATIVE_FP16:
            with use_isa("avx512fp16"):
                want = ops.attend(q, k, v, **kw)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), kw


def test_guest_fault_is_reported(guest):
    """The harness itself must be able to fail: a wild pointer faults, it does not pass."""
    with pytest.raises(EmuError, match="unmapped|#PF"):
        guest.call(guest.guest_address(fn("f16_to_f32")), 0x5000_0000_0000, 0x10, 64)


def test_runner_reports_a_write_past_the_end(guest):
    """The emulated row's runner checks the guard bytes after every output: a kernel told to
    write one element more than the runner reserved fails the check."""
    emu_row = EmulatedRow("avx512fp16", guest)
    f = np.ones(17, np.float32)
    guest.reset_arena()
    dst = guest.put(np.zeros(16, np.float16), guard=EmulatedRow.GUARD)
    guest.call(guest.guest_address(fn("f32_to_f16")), dst, guest.put(f), 17)
    with pytest.raises(AssertionError, match="wrote past the end"):
        emu_row._read_guarded(dst, 32)
