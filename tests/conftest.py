"""Shared fixtures: the ISA paths to test, a reproducible seed, hypothesis profiles, markers.

Kernel tests take the ``row`` fixture: one *runner* per ISA row compiled into this build, all
with the same small API (``attend``, ``apply_rope``, ``shift_keys``, ``to_float16``,
``to_float32``: the signatures of kvsimd.ops; ``matmul(qm, x, parts)`` and ``dequantize(qm)``
of a QMatrix).  A row this CPU runs is run natively (through
``kvsimd.testing.use_isa``); a row it cannot run is run in the emulated Sapphire Rapids of
tests/emulator.py, on the very machine code of the extension module.  When the emulator cannot
be set up that row is a skip with the reason, or a failure with ``KVSIMD_REQUIRE_EMULATOR=1`` (CI).
Write a kernel case once with ``@row_cases(...)`` (hypothesis, fewer examples on an emulated row)
or a plain test taking ``row``; tests of the Python API's own checks take ``isa`` (native rows).
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

import kvsimd
import kvsimd._kvsimd as ext
from kvsimd import ops, reference
from kvsimd.testing import use_isa

settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])
# CI replays the same examples every run (reproducible); dev runs explore new ones
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("KVSIMD_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

INFO = kvsimd.isa_info()
COMPILED_ISAS = INFO["compiled"]
# Paths this CPU runs natively; the other compiled rows run in the emulator (``row`` fixture).
NATIVE_ISAS = INFO["supported"]
SIMD_ISAS = [isa for isa in NATIVE_ISAS if isa != "scalar"]

# Slow tests, by module: which of its tests are slow.  The cmake/ctest build, benchmark runs,
# the CLI run as subprocesses on a model, the real SmolLM2 model loaded by transformers, the GGUF
# fuzzer, the complexity accounting, the README's model example, the stub check; with the emulated rows' long cases (below), what
# `pytest -m "not slow"` leaves out.  The README's `python -m pytest` runs everything.
SLOW = {
    "test_c_units.py": lambda item: True,
    "test_bench.py": lambda item: True,
    "test_cli.py": lambda item: True,
    "test_fuzz_gguf.py": lambda item: True,
    "test_gguf.py": lambda item: "theirs" in item.fixturenames,
    "test_models.py": lambda item: item.name.startswith("test_complexity_accounting"),
    "test_review_f.py": lambda item: item.name.startswith("test_smollm2_chat_template"),
    "test_readme.py": lambda item: "Models and decoding" in item.name,
    "test_stubs.py": lambda item: True,           # mypy's stubtest: ~50 s
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a cmake/ctest build, a benchmark run or a long emulated case "
                                       "(the fast set: pytest -m 'not slow')")
    config.addinivalue_line("markers", "emulated_slow: slow on an emulated row only (marked slow there)")
    config.addinivalue_line("markers", "sanitizer_slow: a large case that CI's sanitizer step leaves to the suite "
                                       "(.ci/run: -m 'not sanitizer_slow'; smaller cases there take the same paths)")
    config.addinivalue_line("markers", "row_cases: a hypothesis kernel case over every row (conftest.row_cases)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = os.path.basename(str(item.fspath))
        if module in SLOW and SLOW[module](item):
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        row = callspec.params.get("row") if callspec else None
        # on an emulated row: the hypothesis cases and the cases marked emulated_slow
        if row is not None and row not in NATIVE_ISAS and (
                item.get_closest_marker("emulated_slow") or item.get_closest_marker("row_cases")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=NATIVE_ISAS)
def isa(request):
    """Run the test on each ISA path this CPU supports (tests of the Python API)."""
    with use_isa(request.param):
        yield request.param


@pytest.fixture
def seed():
    return int(os.environ.get("KVSIMD_TEST_SEED", "20261122"))


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------- row runners
class NativeRow:
    """A row this CPU runs: kvsimd.ops with the row made active for each call."""
    emulated = False

    def __init__(self, isa):
        self.isa = isa

    def attend(self, q, k, v, **kw):
        with use_isa(self.isa):
            return ops.attend(q, k, v, **kw)

    def apply_rope(self, x, positions, **kw):
        with use_isa(self.isa):
            ops.apply_rope(x, positions, **kw)

    def shift_keys(self, k, delta, **kw):
        with use_isa(self.isa):
            ops.shift_keys(k, delta, **kw)

    def _convert(self, fn, src, dtype, fill):
        """fn into a view one element into a guarded buffer: no write past either end."""
        n = src.size
        buf = np.full(n + 33, fill, np.uint16 if dtype == np.float16 else np.uint32)
        out = buf[1:n + 1].view(dtype)
        with use_isa(self.isa):
            assert fn(src, out=out) is out
        assert np.all(buf[0] == fill) and np.all(buf[n + 1:] == fill), "wrote outside the output"
        return out.copy()

    def to_float16(self, f):
        return self._convert(ops.to_float16, f, np.float16, 0x5A5A)

    def to_float32(self, h):
        return self._convert(ops.to_float32, h, np.float32, 0x5A5A5A5A)

    def matmul(self, qm, x, parts=1):
        """``qm.matmul(x)`` (a QMatrix) with the columns split over ``parts`` kernel threads, into
        a view one float into a guarded buffer."""
        B, n = x.shape[0], qm.rows
        buf = np.full(B * n + 33, 0x5A5A5A5A, np.uint32)
        out = buf[1:B * n + 1].view(np.float32).reshape(B, n)
        before = ext._get_kernel_threads()
        ext._set_kernel_threads(parts)
        try:
            with use_isa(self.isa):
                assert qm.matmul(x, out=out) is out
        finally:
            ext._set_kernel_threads(before)
        assert buf[0] == 0x5A5A5A5A and np.all(buf[B * n + 1:] == 0x5A5A5A5A), "wrote outside the output"
        return out.copy()

    def dequantize(self, qm):
        with use_isa(self.isa):
            return qm.dequantize()


class EmulatedRow:
    """A row run in the emulator: its kernels from the dispatch table, called with structs
    packed from the layout C reports; inputs at odd offsets, outputs followed by guard bytes."""
    emulated = True
    GUARD = 128

    def __init__(self, isa, guest):
        self.isa, self.guest = isa, guest
        self.info = ext._kernel_addresses()

    def _fn(self, name):
        return self.guest.guest_address(self.info["rows"][self.isa][name])

    def _pack(self, struct_name, values):
        from emulator import pack_struct
        return pack_struct(self.info["structs"][struct_name], values)

    def _read_guarded(self, addr, nbytes):
        data = self.guest.read(addr, nbytes)
        assert self.guest.read(addr + nbytes, self.GUARD) == b"\xa5" * self.GUARD, "wrote past the end"
        return data

    def attend(self, q, k, v, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None,
               ranges=None, q_alt=None, out=None, softcap=None, causal_offset=None, causal=True, window=None,
               part=None, k_scale=None, v_scale=None):
        """As ops.attend (q [H, D], or [T, H, D] rows: one kernel call for every row; int8 k, v, or
        uint8 (int4) ones, with their block scales, at odd byte offsets).  ``part=(lo, hi)``:
        one split-K piece, keys lo..hi-1 of the ranges end to end; returns (unnormalized out,
        [T, H, 2] (max, sum))."""
        g = self.guest
        g.reset_arena()
        rows = q.ndim == 3
        T, H, D = q.shape if rows else (1,) + q.shape
        Hkv, N = k.shape[:2]
        off = N - T if causal_offset is None else causal_offset
        cend = off + 1 if rows and causal else 0
        qpos = (off if rows else N - 1) if query_position is None else query_position
        rows_ = [(0, N, False, qpos)] if ranges is None else [
            (r[0], r[1], bool(r[2]) if len(r) > 2 else False, r[3] if len(r) > 3 else qpos) for r in ranges]
        packed = b"".join(self._pack("kv_attn_range", {"query": int(r[2]), "t0": r[0], "t1": r[1], "query_pos": r[3]})
                          for r in rows_)
        dst = g.put(np.zeros(T * H * D, np.float32), guard=self.GUARD)
        ml = g.put(np.zeros(T * H * 2, np.float32), guard=self.GUARD) if part is not None else 0
        i8 = k.dtype in (np.int8, np.uint8)
        code = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int8): 2, np.dtype(np.uint8): 3}  # kv_dtype
        scales = {"k_scale": g.put(k_scale, offset=4), "v_scale": g.put(v_scale, offset=4)} if i8 else {}
        prm = self._pack("kv_attn_params", {
            "q": g.put(q), "k": g.put(k, offset=3 if i8 else 2), "v": g.put(v, offset=3 if i8 else 2), "out": dst,
            "alibi": g.put(alibi_slopes) if alibi_slopes is not None else 0,
            "key_pos": g.put(key_positions) if key_positions is not None else 0,
            "q_alt": g.put(q_alt) if q_alt is not None else 0,
            "ranges": g.put(packed), "n_ranges": len(rows_), "H": H, "Hkv": Hkv, "D": D, "n_total": N,
            "T": T, "q_stride": H * D, "out_stride": H * D, "causal_end": cend, "window": window or 0,
            "scale": 1.0 / np.sqrt(D) if scale is None else scale, "softcap": softcap or 0.0,
            "dtype": code[k.dtype], "v_dtype": code[v.dtype], **scales,
            **({} if part is None else {"part_lo": part[0], "part_hi": part[1], "part_ml": ml})})
        ws = g.alloc(ext._attn_workspace_bytes(H, Hkv, D), align=64)
        g.call(self._fn("attn"), g.put(prm), 0, Hkv, 0, T, ws)
        res = np.frombuffer(self._read_guarded(dst, 4 * T * H * D), np.float32).reshape(q.shape)
        if part is not None:
            return res.copy(), np.frombuffer(self._read_guarded(ml, 8 * T * H), np.float32).reshape(T, H, 2).copy()
        if out is None:
            return res.copy()
        out[...] = res
        return out

    def _rotate(self, x, cs, cs_stride, style, rd, t0=0, t1=None):
        """The row's rotate kernel on x [H, N, D] in place (angles as ops.c computes them)."""
        g = self.guest
        g.reset_arena()
        H, N, D = x.shape
        xa = g.put(x, offset=2, guard=self.GUARD)
        prm = self._pack("kv_rot_params", {
            "x": xa, "cs": g.put(np.ascontiguousarray(cs, np.float32), offset=4), "H": H, "D": D, "R": rd // 2,
            "n_total": N, "t0": t0, "t1": N if t1 is None else t1, "cs_stride": cs_stride,
            "dtype": 1 if x.dtype == np.float16 else 0, "style": 0 if style == "gptj" else 1})
        g.call(self._fn("rotate"), g.put(prm))
        x[...] = np.frombuffer(self._read_guarded(xa, x.nbytes), x.dtype).reshape(x.shape)

    def apply_rope(self, x, positions, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None,
                   attn_factor=1.0):
        rd = x.shape[-1] if rotary_dim is None else rotary_dim
        cs = np.concatenate([ext._rope_table(float(p), theta, rd // 2, rd, inv_freq, attn_factor) for p in positions])
        self._rotate(x, cs, rd, style, rd)

    def shift_keys(self, k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None, start=0,
                   stop=None, k_scale=None, head_dim=None, hadamard=False):
        """As ops.shift_keys; int8 and int4 (uint8) k as ops.c does it around the row's rotate
        kernel: rows widened (q * scale, in float32; hadamard: turned back), rotated by the row,
        quantized again by the C rule."""
        i4 = k.dtype == np.uint8
        D = (head_dim or 2 * k.shape[-1]) if i4 else k.shape[-1]
        rd = D if rotary_dim is None else rotary_dim
        cs = ext._rope_table(float(delta), theta, rd // 2, rd, inv_freq)
        if k.dtype not in (np.int8, np.uint8):
            self._rotate(k, cs, 0, style, rd, start, stop)
            return
        t1 = k.shape[1] if stop is None else stop
        x = np.ascontiguousarray(reference.dequantize_kv(k[:, start:t1], k_scale[:, start:t1], D))
        if hadamard:
            x = reference.hadamard_rows(x)
        self._rotate(x, cs, 0, style, rd)
        k[:, start:t1], k_scale[:, start:t1] = ops.quantize_kv(x, "int4" if i4 else "int8", hadamard=hadamard)

    def _convert(self, name, src, dtype):
        g = self.guest
        g.reset_arena()
        n = src.size
        isz = np.dtype(dtype).itemsize
        dst = g.put(np.zeros(n, dtype), offset=2, guard=self.GUARD)
        g.call(self._fn(name), dst, g.put(np.ascontiguousarray(src), offset=4), n)
        return np.frombuffer(self._read_guarded(dst, isz * n), dtype).copy()

    def to_float16(self, f):
        return self._convert("f32_to_f16", f, np.float16)

    def to_float32(self, h):
        return self._convert("f16_to_f32", h, np.float32)

    def _put_weights(self, qm):
        """A QMatrix's bytes in the arena off 64-byte alignment: one element for the float types
        (their kernels need element alignment, as the Python boundary checks), 3 bytes (odd) for
        the block types."""
        off = {"f32": 4, "f16": 2, "bf16": 2}.get(qm.wtype, 3)
        return self.guest.put(np.ascontiguousarray(qm.raw()), offset=off)

    def matmul(self, qm, x, parts=1):
        """The row's gemv[wtype] kernel as kv_matmul calls it: slices of KV_GEMV_MAX_B = 8 rows of
        x, the columns in ``parts`` separate calls (ranges n t / parts ..).  x and y sit in padded
        rows (x_stride k + 3, its padding NaN: a read past k shows; y_stride n + 5, the padding
        checked untouched), off 64-byte alignment, y followed by guard bytes."""
        g = self.guest
        g.reset_arena()
        B, k = x.shape
        n = qm.rows
        xs, ys = k + 3, n + 5
        xp = np.full((B, xs), np.nan, np.float32)
        xp[:, :k] = x
        fill = 0xA5A5A5A5
        int8 = qm.activations == "int8"
        if int8:   # the repacked weights, x quantized as kv_matmul does it (C code, outside the row)
            w = self.guest.put(qm._repacked(), offset=3)
            xq = ext._quantize_x(x)
            xqa = g.put(xq, offset=4)
        else:
            w = self._put_weights(qm)
        xa = g.put(xp, offset=4)
        ya = g.put(np.full(B * ys, fill, np.uint32), offset=4, guard=self.GUARD)
        fn = self.guest.guest_address(self.info["rows"][self.isa]["gemv_x8" if int8 else "gemv"][qm.wtype])
        t = list(ext.weight_types()).index(qm.wtype)
        unit = 8 if int8 else 1     # int8: column ranges of whole groups of 8
        for b0 in range(0, B, 8):
            prm = g.put(self._pack("kv_gemv_params", {
                "w": w, "x": xa + 4 * b0 * xs, "y": ya + 4 * b0 * ys, "row_bytes": qm.row_bytes, "k": k, "n": n,
                "B": min(8, B - b0), "x_stride": xs, "y_stride": ys, "wtype": t,
                "xq": xqa + b0 * xq.shape[1] if int8 else 0}))
            for p in range(parts):
                n0, n1 = n // unit * p // parts * unit, n // unit * (p + 1) // parts * unit
                if n1 > n0:
                    g.call(fn, prm, n0, n1)
        y = np.frombuffer(self._read_guarded(ya, 4 * B * ys), np.uint32).reshape(B, ys)
        assert np.all(y[:, n:] == fill), "wrote into the padding of y"
        return y[:, :n].view(np.float32).copy()

    def dequantize(self, qm):
        """The row's dequant[wtype] kernel over the whole matrix, into a guarded output."""
        g = self.guest
        g.reset_arena()
        count = qm.rows * qm.cols
        w = self._put_weights(qm)
        dst = g.put(np.zeros(count, np.float32), offset=4, guard=self.GUARD)
        g.call(self.guest.guest_address(self.info["rows"][self.isa]["dequant"][qm.wtype]), dst, w, count)
        return np.frombuffer(self._read_guarded(dst, 4 * count), np.float32).reshape(qm.rows, qm.cols).copy()


@pytest.fixture(params=COMPILED_ISAS)
def row(request):
    """Every row compiled into this build, with one API: native where this CPU runs it, else in
    the emulator (a skip with the reason when it cannot run, a failure under
    KVSIMD_REQUIRE_EMULATOR=1)."""
    if request.param in NATIVE_ISAS:
        return NativeRow(request.param)
    if ext._sanitized():   # not a missing feature: the normal build runs this row in the emulator
        pytest.skip("a sanitized build's %s object calls the sanitizer runtime: not runnable in the emulator"
                    % request.param)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import emulator
    return EmulatedRow(request.param, emulator.shared_guest(ext.__file__))


def row_cases(emulated_examples=None, examples=(), **strategies):
    """A hypothesis-driven kernel case over every row: the decorated body takes ``(row, **drawn)``;
    the test takes the ``row`` fixture, draws the strategies with the active profile's example
    count (at most ``emulated_examples`` on an emulated row: ~5M guest instructions/s) and replays
    each dict of ``examples`` first."""
    def decorate(body):
        def test(row):
            def case(**drawn):
                body(row, **drawn)
            run = given(**strategies)(case)
            for ex in examples:
                run = example(**ex)(run)
            if row.emulated and emulated_examples is not None:
                run = settings(max_examples=min(settings.default.max_examples, emulated_examples))(run)
            # a database entry per test and row (all share this inner function's source)
            run.hypothesis.inner_test._hypothesis_internal_add_digest = (body.__module__ + body.__qualname__
                                                                         + row.isa).encode()
            run()
        test.__name__, test.__qualname__, test.__doc__ = body.__name__, body.__qualname__, body.__doc__
        test.__module__ = body.__module__
        return pytest.mark.row_cases(test)
    return decorate
