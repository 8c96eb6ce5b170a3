"""What only the emulator can check about the avx512 row (AVX-512 F/BW/VL/DQ/VNNI, no FP16).

The kernel cases on every row are in test_attend.py, test_rope.py, test_convert.py,
test_qmatmul.py, ...: through the ``row`` fixture of tests/conftest.py the avx512 row runs
natively where this CPU has it, else in the process's emulated Sapphire Rapids (which has all the
row needs).  Here, each in a child process (one emulated CPU per process, tests/emulator.py):

* a Bochs Tiger Lake (AVX-512 F/BW/VL/DQ/VNNI, no AVX512-FP16) selects avx512, and the row's
  kernels run there -- a CPU where any AVX512-FP16 instruction would fault -- within the float64
  bounds of kvsimd.bounds, and with the native row's very bits where this CPU runs the row;
* a Bochs Skylake-X (AVX-512 F/BW/VL/DQ but no VNNI) never selects avx512: it falls back to avx2;
* the row's object code has no AVX512-FP16 instruction at all (also on paths no test reaches).

``python tests/test_avx512_emu.py MODEL SO_PATH OUT.npz`` is the child: detection and the cases of
:func:`cases` run on ``MODEL``, the kernels' outputs saved to OUT.npz.
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import emulator  # noqa: E402

REQUIRED = os.environ.get("KVSIMD_REQUIRE_EMULATOR") == "1"


# ------------------------------------------------------------------------------ the cases
class Case:
    """One kernel call: ``run(row)`` -> the output array (row: a conftest runner), ``check(got)``
    asserts it against float64 / NumPy.  Inputs come from a fixed seed: the same in every process."""

    def __init__(self, op, args, kw=None):
        self.op, self.args, self.kw = op, args, dict(kw or {})

    def run(self, row):
        if self.op in ("apply_rope", "shift_keys"):
            x = self.args[0].copy()
            getattr(row, self.op)(x, *self.args[1:], **self.kw)
            return x
        return getattr(row, self.op)(*self.args, **self.kw)

    def check(self, got):
        from kvsimd import bounds, reference
        if self.op == "attend":
            q, k, v = self.args
            err = np.abs(got - reference.attend(q, k, v, **self.kw)) / bounds.attend_bound(q, k, v, **self.kw)
            assert err.max() <= 1, err.max()
        elif self.op in ("apply_rope", "shift_keys"):
            x = self.args[0]
            rd = self.kw.get("rotary_dim") or x.shape[-1]
            if self.op == "apply_rope":
                ref = reference.apply_rope(x, self.args[1], style=self.kw["style"], rotary_dim=rd)
            else:
                ref = reference.shift_keys(x, self.args[1], style=self.kw["style"], rotary_dim=rd)
            bound = bounds.rope_bound("avx512", x.dtype, bounds.pair_norm(x, self.kw["style"], rd), ref)
            err = np.abs(got.astype(np.float64) - ref)
            assert np.all(err <= bound), float((err / bound).max())
        elif self.op == "to_float16":
            with np.errstate(over="ignore"):    # 70000 -> inf, as NumPy casts it
                want = self.args[0].astype(np.float16)
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        elif self.op == "to_float32":
            assert np.array_equal(got.view(np.uint32), self.args[0].astype(np.float32).view(np.uint32))
        elif self.op == "matmul":
            qm, x = self.args
            w_deq = self.deq
            mag = bounds.x8_block_magnitude(qm.raw(), qm.wtype) if qm.activations == "int8" else None
            bound = bounds.matmul_bound(x, w_deq, "avx512", qm.activations, mag)
            err = np.abs(got.astype(np.float64) - x.astype(np.float64) @ w_deq.astype(np.float64).T)
            assert np.all(err <= bound), float((err / bound).max())
        elif self.op == "dequantize":
            from test_qmatmul import assert_same_bits
            assert_same_bits(got, self.deq, self.args[0].wtype)
        else:
            raise AssertionError(self.op)


def cases():
    """{name: Case}: attention (fp16 and fp32 K/V, GQA, head-dim tails, ALiBi; several query
    rows with a soft cap and a window), rotations of fp16 rows (the fp32 path), conversions, and
    products of quantized weights with float and int8 activations (VPDPBUSD)."""
    from test_attend import alibi_case
    from test_qmatmul import make_weights
    rng = np.random.default_rng(20261124)
    out = {}
    for H, Hkv, N, D in [(4, 1, 15, 3), (9, 3, 16, 64), (8, 2, 17, 17), (6, 2, 31, 80), (32, 8, 33, 128)]:
        for dtype in ("float16", "float32"):
            q, k, v, kw = alibi_case(rng, H, Hkv, N, D, dtype)
            out["attend_%d_%d_%d_%d_%s" % (H, Hkv, N, D, dtype)] = Case("attend", (q, k, v), kw)
    q = (rng.standard_normal((7, 9, 64)) * 3).astype(np.float32)
    k = rng.standard_normal((3, 40, 64)).astype(np.float16)
    v = rng.standard_normal((3, 40, 64)).astype(np.float16)
    out["attend_rows_softcap_window"] = Case("attend", (q, k, v), dict(
        alibi_slopes=rng.uniform(0, 0.5, 9).astype(np.float32), softcap=2.0, window=5))
    for style in ("gptj", "neox"):
        for dtype in ("float16", "float32"):
            x = rng.standard_normal((3, 5, 72)).astype(dtype)
            pos = rng.integers(0, 2**20, 5, dtype=np.int64)
            out["rope_%s_%s" % (style, dtype)] = Case("apply_rope", (x, pos), dict(style=style, rotary_dim=66))
            out["shift_%s_%s" % (style, dtype)] = Case("shift_keys", (x, -37), dict(style=style))
    f = np.concatenate([rng.standard_normal(45) * 1e3, [np.inf, -np.inf, np.nan, 0.0, -0.0, 6e-8, 70000.0]])
    out["to_float16"] = Case("to_float16", (f.astype(np.float32),))
    h = rng.integers(0, 1 << 16, 53, dtype=np.uint64).astype(np.uint16).view(np.float16)
    out["to_float32"] = Case("to_float32", (h,))
    for wtype, act, cols in [("q8_0", "int8", 96), ("q4_k", "int8", 256), ("q4_1", "float32", 160),
                             ("q6_k", "float32", 256), ("f16", "float32", 37)]:
        qm, w_deq = make_weights(rng, wtype, 11, cols, act if act == "int8" else None)
        x = rng.standard_normal((3, cols)).astype(np.float32)
        c = Case("matmul", (qm, x))
        c.deq = w_deq
        out["matmul_%s_%s" % (wtype, act)] = c
        if act == "float32":
            d = Case("dequantize", (qm,))
            d.deq = w_deq
            out["dequantize_%s" % wtype] = d
    return out


def child_main():
    model, so_path, out_path = sys.argv[1:4]
    import kvsimd._kvsimd as ext
    from conftest import EmulatedRow
    info = ext._kernel_addresses()
    g = emulator.Guest(so_path, model=model, arena_size=16 << 20)
    feats = g.call(g.guest_address(info["kv_cpu_features"]))
    print("features=%d" % feats)
    print("select=%d" % g.call(g.guest_address(info["kv_select_isa"]), feats))
    row = EmulatedRow("avx512", g)
    np.savez(out_path, **{name: c.run(row) for name, c in CASES.items()})


# ------------------------------------------------------------------------------ the tests
def _child(args):
    if not REQUIRED:
        try:
            emulator.import_bochscpu()
            import elftools  # noqa: F401
        except Exception as e:
            pytest.skip("emulator unavailable: %s" % e)
    import kvsimd._kvsimd as ext
    # the package that holds the extension module, whether installed or built in place
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(line.split("=", 1) for line in r.stdout.split("\n") if "=" in line)


def _names(mask):
    import kvsimd._kvsimd as ext
    return {name for name, bit in ext._FEATURE_BITS if mask & bit}


@pytest.fixture(scope="module")
def tigerlake():
    """The tigerlake child's detection lines and kernel outputs."""
    import kvsimd._kvsimd as ext
    if "avx512" not in ext._kernel_addresses()["rows"]:
        pytest.fail("the avx512 row is not compiled into this build")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.npz")
        out = _child([os.path.abspath(__file__), "tigerlake", ext.__file__, path])
        with np.load(path) as z:
            return out, {name: z[name] for name in z.files}


def test_tigerlake_selects_avx512(tigerlake):
    import kvsimd._kvsimd as ext
    info = ext._kernel_addresses()
    out, _ = tigerlake
    feats = int(out["features"])
    assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "os_zmm_state"} <= _names(feats)
    assert "avx512fp16" not in _names(feats)
    assert "split512" not in _names(feats)      # an Intel core: 512-bit operations at full width
    assert feats & info["feature_bits"]["avx512"] and not feats & info["feature_bits"]["avx512fp16"]
    assert int(out["select"]) == info["isa_index"]["avx512"]


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
def test_avx512_kernels_on_tigerlake(tigerlake, name):
    """Each kernel of the avx512 row on a CPU without AVX512-FP16: within the float64 bound (or
    NumPy's bits), and where this CPU runs the row, the native row's very bits."""
    import kvsimd
    from conftest import NativeRow
    _, got = tigerlake
    case = CASES[name]
    case.check(got[name])
    if "avx512" in kvsimd.isa_info()["supported"]:
        want = case.run(NativeRow("avx512"))
        assert got[name].dtype == want.dtype and np.array_equal(got[name].view(np.uint8), want.view(np.uint8))


def test_cpu_without_vnni_never_selects_avx512():
    """Bochs' Skylake-X: AVX-512 F/BW/VL/DQ with ZMM state, but no VNNI -> avx2, whatever the OS
    saves; the avx512 row's own code would run there, so only detection keeps it away."""
    import kvsimd._kvsimd as ext
    info = ext._kernel_addresses()
    out = _child([emulator.__file__, "corei7_skylake_x", ext.__file__])
    feats = int(out["features_zmm"])
    assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "os_zmm_state", "avx2", "fma", "f16c"} <= _names(feats)
    assert "avx512vnni" not in _names(feats) and not feats & info["feature_bits"]["avx512"]
    assert out["select_zmm"] == out["select_ymm"] == str(info["isa_index"]["avx2"])


# AVX512-FP16 mnemonics: arithmetic on packed/scalar halves (..ph, ..sh, ..pch, ..sch), the
# conversions with an x suffix or to/from sh, VMOVW.  VCVTPH2PS / VCVTPS2PH (F16C, AVX512F) are not.
_FP16_INSN = re.compile(r"^v\w*(ph|sh|phx|psx)$|^vmovw$|^vcvtsh2\w+$|^vcvt\w+2sh$")


def _mnemonics(suffix):
    """{function name: set of mnemonics} of the extension's functions named kv_..._<suffix>."""
    import kvsimd._kvsimd as ext
    r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ext.__file__], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cur, funcs = None, {}
    for line in r.stdout.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1][:-2]
            cur = name if name.startswith("kv_") and name.endswith("_" + suffix) else None
            if cur:
                funcs[cur] = set()
        elif cur and len(line.split("\t")) > 1:
            funcs[cur].add(line.split("\t")[1].split()[0])
    return funcs


def _fp16(funcs):
    found = {}
    for name, mnems in funcs.items():
        for m in mnems:
            if _FP16_INSN.match(m) and m != "vcvtps2ph":
                found.setdefault(m, set()).add(name)
    return found


def test_avx512_object_code_has_no_fp16_instruction_and_uses_vnni():
    funcs = _mnemonics("avx512")
    assert len(funcs) > 20 and not _fp16(funcs), _fp16(funcs)
    # the check can fail: the avx512fp16 row's code has them
    funcs16 = _mnemonics("avx512fp16")
    assert len(funcs16) > 20 and {"vfmulcph", "vfmaddcph", "vcvtph2psx"} <= set(_fp16(funcs16))
    # VPDPBUSD for the int8 products (every one of them), VCVTPH2PS zmm for the fp16 rows
    x8 = {name: m for name, m in funcs.items() if name.startswith("kv_gemv_x8_")}
    assert x8 and all("vpdpbusd" in m for m in x8.values()), sorted(n for n, m in x8.items() if "vpdpbusd" not in m)
    assert "vcvtph2ps" in set().union(*funcs.values())


if __name__ == "__main__":
    child_main()
