"""Runtime dispatch: detection, KVSIMD_FORCE_ISA, and the in-process test hook."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsimd
from kvsimd.errors import KVSimdISAError
from kvsimd.testing import use_isa

from conftest import NATIVE_ISAS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src_c"))
from isa_rows import read_rows  # noqa: E402  (the build's own table: src_c/isa_rows.def)

ROWS = read_rows()
ALL = [name for name, _ in ROWS]


def run_python(code, force=None):
    env = dict(os.environ)
    env.pop("KVSIMD_FORCE_ISA", None)
    if force is not None:
        env["KVSIMD_FORCE_ISA"] = force
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_isa_info_shape():
    info = kvsimd.isa_info()
    assert set(info) >= {"compiled", "supported", "active", "forced"}
    assert "scalar" in info["compiled"] and "scalar" in info["supported"]
    assert set(info["supported"]) <= set(info["compiled"]) <= set(ALL)
    assert info["active"] in info["supported"]
    assert kvsimd.active_isa() == info["active"]
    # the attention kernels' prefetch distance: shorter on cores that split 512-bit operations (Zen 4)
    assert info["prefetch_values"] == (1536 if "split512" in info["features"] else 4096)


def test_avx512fp16_is_compiled():
    """gcc >= 12 builds the avx512fp16 row; it must be in every build made here."""
    assert "avx512fp16" in kvsimd.isa_info()["compiled"]


def test_detection_agrees_with_the_kernel():
    """CPUID+XGETBV against what Linux reports in /proc/cpuinfo."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo on this system")
    feats = set(kvsimd.cpu_features())
    for name in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"):
        assert (name in feats) == (name in flags), name
    assert ("avx512fp16" in feats) == ("avx512_fp16" in flags)
    assert ("avx512vnni" in feats) == ("avx512_vnni" in flags)
    supported = kvsimd.isa_info()["supported"]
    assert ("avx2" in supported) == ({"avx2", "fma", "f16c"} <= flags)
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    assert ("avx512" in supported) == (avx512 <= flags)
    assert ("avx512fp16" in supported) == (avx512 | {"avx512_fp16"} <= flags)


def cpu_vendor_family():
    """(vendor_id, cpu family) as Linux reports them, or (None, None)."""
    vendor = family = None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("vendor_id") and vendor is None:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("cpu family") and family is None:
                    family = int(line.split(":", 1)[1])
    except OSError:
        pass
    return vendor, family


def test_split512_is_zen4():
    """"split512" (512-bit operations run as two 256-bit halves) is set exactly on AMD family 25
    (19h) with AVX-512, i.e. Zen 4, by /proc/cpuinfo's own account; the emulated Tiger Lake, an
    Intel core, never has it (test_avx512_emu.py)."""
    vendor, family = cpu_vendor_family()
    if vendor is None or family is None:
        pytest.skip("no /proc/cpuinfo on this system")
    expected = vendor == "AuthenticAMD" and family == 25 and "avx512f" in cpu_flags()
    assert ("split512" in kvsimd.cpu_features()) == expected


def _small_group_case(G, dtype, rng):
    H, D, N = 3 * G, 64, 1000
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k = rng.standard_normal((3, N, D)).astype(dtype)
    v = rng.standard_normal((3, N, D)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("G", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_small_group_attention_runs_the_row_attend_isa_names(G, dtype):
    """kvsimd.attend_isa says which row the automatic choice runs attention on, and that row's
    own kernel gives the automatic result bit for bit: on Zen 4 ("split512") a decode step over
    float K/V with 2 or 3 query heads per KV head runs the avx2 row (0.93x SmolLM2's step time at
    8,192 tokens there), everything else the active row; a forced row always runs its own."""
    from kvsimd import ops
    info = kvsimd.isa_info()
    dt = "float16" if dtype == np.float16 else "float32"
    routed = (info["active"] == "avx512" and "split512" in info["features"] and "avx2" in info["supported"]
              and G in (2, 3))
    want = "avx2" if routed else info["active"]
    assert kvsimd.attend_isa(3 * G, 3, dt) == want
    assert kvsimd.attend_isa(3 * G, 3, dt, n_queries=2) == info["active"]       # prefill rows: never
    assert kvsimd.attend_isa(3 * G, 3, "int8") == info["active"]                # int8 keys: VNNI stays
    assert kvsimd.attend_isa(3 * G, 3, "int8/int4") == info["active"]
    assert kvsimd.attend_isa(3 * G, 3, dtype) == want                           # a NumPy dtype, as KVCache takes
    assert info["small_group_attention"] == ("avx2" if info["active"] == "avx512" and "split512"
                                             in info["features"] and "avx2" in info["supported"] else info["active"])
    q, k, v = _small_group_case(G, dtype, np.random.default_rng(G))
    auto = ops.attend(q, k, v)
    with use_isa(want):
        assert kvsimd.attend_isa(3 * G, 3, dt) == want                          # forced: its own
        same = ops.attend(q, k, v)
    assert np.array_equal(auto, same)
    if want != info["active"]:                                                  # the other row differs
        with use_isa(info["active"]):
            assert kvsimd.attend_isa(3 * G, 3, dt) == info["active"]


@pytest.mark.parametrize("args, match", [
    ((3, 2), "n_heads must be a multiple of n_kv_heads, got 3 and 2"),
    ((0, 1), "n_heads must be >= 1"),
    ((3, 1, "bf16"), "dtype must be float16, float32, int8, int4 .*got 'bf16'"),
    ((3, 1, "int8/int2"), "int8 or int4 on each side"),
    ((3, 1, "float16", 0), "n_queries must be >= 1"),
    ((2 ** 70, 1), "n_heads must be >= 1 \\(and < 2\\*\\*63\\), got 1180591620717411303424"),
])
def test_attend_isa_rejects_bad_arguments(args, match):
    from kvsimd.errors import KVSimdError
    with pytest.raises(KVSimdError, match=match):
        kvsimd.attend_isa(*args)


def test_select_isa_with_synthetic_feature_masks():
    """kv_select_isa (the table of isa_rows.def) on feature masks no CPU here has: the last row
    whose required bits the mask covers.  cpu.c sets a row's composite bit only when every part
    is there (avx512: the avx2 features + AVX-512 F/BW/VL/DQ/VNNI + ZMM state), so a part alone
    (AVX-512F without VNNI, say) selects nothing beyond avx2."""
    import ctypes

    from kvsimd import _kvsimd
    info = _kvsimd._kernel_addresses()
    select = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint32)(info["kv_select_isa"])
    bits, idx = info["feature_bits"], info["isa_index"]
    parts = {name: bit for name, bit in _kvsimd._FEATURE_BITS}
    every_part = 0
    for bit in parts.values():
        every_part |= bit
    assert select(0) == idx["scalar"]
    assert select(every_part) == idx["scalar"]         # parts, no composite: nothing but scalar
    assert select(bits["avx2"]) == idx["avx2"]
    assert select(bits["avx2"] | every_part) == idx["avx2"]
    assert select(bits["avx512"]) == idx["scalar"]     # the avx512 row needs the avx2 features too
    assert select(bits["avx2"] | bits["avx512"]) == idx["avx512"]
    assert select(bits["avx2"] | bits["avx512fp16"]) == idx["avx2"]   # FP16 alone does not make a row
    assert select(bits["avx2"] | bits["avx512"] | bits["avx512fp16"]) == idx["avx512fp16"]
    assert select(0xFFFFFFFF) == len(ALL) - 1
    assert ALL.index("avx2") < ALL.index("avx512") < ALL.index("avx512fp16")


def test_default_choice_is_the_best_supported():
    r = run_python("import kvsimd; print(kvsimd.active_isa())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kvsimd.isa_info()["supported"][-1]


@pytest.mark.parametrize("name", NATIVE_ISAS)
def test_force_each_supported_path(name):
    r = run_python("import kvsimd; i = kvsimd.isa_info(); print(kvsimd.active_isa(), i['forced'])", force=name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [name, name]


def test_empty_force_means_not_forced():
    r = run_python("import kvsimd; print(kvsimd.isa_info()['forced'])", force="")
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr


@pytest.mark.parametrize("name", ["sse9", "AVX2", "avx2 ", "scalar,avx2"])
def test_force_unknown_name_fails_the_import(name):
    r = run_python("import kvsimd", force=name)
    assert r.returncode != 0
    assert "unknown ISA" in r.stderr and "compiled:" in r.stderr and "supported on this CPU:" in r.stderr


@pytest.mark.parametrize("name", [n for n in ALL if n not in NATIVE_ISAS])
def test_force_unsupported_path_fails_cleanly(name):
    """No SIGILL and no silent fallback: the import fails and says why."""
    r = run_python("import kvsimd", force=name)
    assert r.returncode == 1, (r.returncode, r.stderr)  # not a signal
    assert "this CPU cannot run ISA '%s'" % name in r.stderr
    assert "supported on this CPU: " + ", ".join(NATIVE_ISAS) in r.stderr


def test_use_isa_switches_and_restores():
    before = kvsimd.active_isa()
    for name in NATIVE_ISAS:
        with use_isa(name):
            assert kvsimd.active_isa() == name
            assert kvsimd.isa_info()["forced"] == name
        assert kvsimd.active_isa() == before


@pytest.mark.parametrize("name", ["nope", "avx512", "avx512fp16"])
def test_use_isa_rejects_bad_names(name):
    if name in NATIVE_ISAS:
        pytest.skip("this CPU runs %s natively" % name)
    before = kvsimd.active_isa()
    with pytest.raises(KVSimdISAError, match="compiled: .*supported on this CPU"):
        with use_isa(name):
            pass
    assert kvsimd.active_isa() == before


def test_show_runtime(capsys):
    kvsimd.show_runtime()
    text = capsys.readouterr().out
    assert kvsimd.__version__ in text and "compiler: gcc" in text
    for name in kvsimd.isa_info()["compiled"]:
        assert name in text
    assert "active: " + kvsimd.active_isa() in text
    flags = kvsimd.isa_info()["flags"]
    for name in kvsimd.isa_info()["compiled"]:
        line = next(ln for ln in text.splitlines() if ln[4:].split()[:1] == [name])
        assert line.endswith(flags[name] or "(baseline x86-64)"), line


def test_show_runtime_names_a_file_it_cannot_write():
    """file= takes an open stream: an int, or a closed StringIO, is a KVSimdTypeError naming it;
    an open StringIO gets the text."""
    import io
    closed = io.StringIO()
    closed.close()
    for bad in (5, "out.txt", closed):
        with pytest.raises(kvsimd.KVSimdTypeError, match="file must be None or an open text stream"):
            kvsimd.show_runtime(file=bad)
    buf = io.StringIO()
    kvsimd.show_runtime(file=buf)
    assert "active: " + kvsimd.active_isa() in buf.getvalue()


def test_rows_and_flags_are_the_build_table():
    """The names, order and per-row compiler flags the extension reports are those of
    src_c/isa_rows.def, from which setup.py compiled each row (and passed the same text to it as
    KV_ROW_CFLAGS): a row compiled with other flags than it reports fails here."""
    assert ALL[:2] == ["scalar", "avx2"] and len(ALL) == len(set(ALL))
    info = kvsimd.isa_info()
    assert info["compiled"] == [name for name in ALL if name in info["compiled"]]
    assert set(info["flags"]) == set(info["compiled"])
    for name, flags in ROWS:
        if name in info["compiled"]:
            assert info["flags"][name] == " ".join(flags), name


def test_forced_has_one_source():
    """use_isa and KVSIMD_FORCE_ISA both end in C's kv_forced: isa_info reports the active row
    while forced, None once the automatic choice is restored."""
    with use_isa("scalar"):
        assert kvsimd.isa_info()["forced"] == "scalar"
        with use_isa(NATIVE_ISAS[-1]):
            assert kvsimd.isa_info()["forced"] == NATIVE_ISAS[-1]
        assert kvsimd.isa_info()["forced"] == "scalar" and kvsimd.active_isa() == "scalar"
    assert kvsimd.isa_info()["forced"] is None
    r = run_python("import kvsimd; from kvsimd.testing import use_isa\n"
                   "with use_isa(%r): pass\nprint(kvsimd.active_isa(), kvsimd.isa_info()['forced'])" % NATIVE_ISAS[-1],
                   force="scalar")
    assert r.returncode == 0 and r.stdout.split() == ["scalar", "scalar"], r.stderr


def test_struct_layouts_come_from_c():
    """The emulator packs kv_attn_params / kv_attn_range / kv_rot_params / kv_gemv_params from the layout C reports
    (offsetof/sizeof over the field lists in kvsimd.h): every field's bytes inside the struct,
    no two overlapping, gaps only alignment padding, each letter as wide as the C field."""
    import struct

    from kvsimd import _kvsimd
    layouts = _kvsimd._struct_layouts()
    assert set(layouts) == {"kv_attn_params", "kv_attn_range", "kv_rot_params", "kv_gemv_params"}
    for name, lay in layouts.items():
        spans = sorted((off, size, code, field) for field, (off, size, code) in lay["fields"].items())
        end = 0
        for off, size, code, field in spans:
            assert struct.calcsize("<" + code) == size, (name, field)
            assert off >= end and off - end < size and off % size == 0, (name, field, off, end)
            end = off + size
        assert end <= lay["size"] < end + 8, name
    assert layouts["kv_attn_range"]["size"] == 32    # what a KVCache step plan keeps per range
