"""The compiled boundary (issue 13): every buffer kvsimd writes is checked, outputs never overlap
inputs, every integer goes through one checked conversion, one validator per concept (scale, RoPE
parameters, positions, key ranges) gives the same rule and message on every path, masked arrays
are refused, the kernel thread count is read once per call, and a cache serves one thread at a
time.  Each bad call raises a KVSimdError subclass naming the argument and leaves data unchanged."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvsimd
from kvsimd import (KVCache, KVSimdBusyError, KVSimdError, KVSimdPositionError, KVSimdTypeError, KVSimdValueError,
                    ops, reference)
from kvsimd import _kvsimd
from kvsimd.errors import KVSimdMemoryError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refused(fn, exc=KVSimdError, match=None):
    """fn() must raise a KVSimdError subclass of type exc whose message matches."""
    with pytest.raises(exc, match=match) as ei:
        fn()
    assert isinstance(ei.value, KVSimdError), repr(ei.value)
    return str(ei.value)


def run_child(code, timeout=240):
    """Run code in a fresh interpreter (a crash fails the calling test, not the run)."""
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired as e:
        pytest.fail("child hung for %d s (stderr: %s)" % (timeout, (e.stderr or b"")[-2000:]))
    assert r.returncode == 0, "child exited %d\nstdout:\n%s\nstderr:\n%s" % (r.returncode, r.stdout[-3000:],
                                                                            r.stderr[-3000:])
    return r.stdout


def filled_cache(rng, H=16, Hkv=4, D=64, n=40, capacity=64, dtype="float32", batch=1):
    c = KVCache(2, Hkv, D, capacity, batch=batch, dtype=dtype)
    for b in range(batch):
        c.write(0, rng.standard_normal((Hkv, n, D)).astype(np.float32),
                rng.standard_normal((Hkv, n, D)).astype(np.float32), seq=b)
        c.commit(n, seq=b)
    return c


def misaligned(shape, dtype):
    itemsize = np.dtype(dtype).itemsize
    buf = np.zeros(int(np.prod(shape)) * itemsize + 1, np.uint8)
    return np.ndarray(shape, dtype=dtype, buffer=buf, offset=1)


# ----------------------------------------------------------------------------- 1. caller buffers

def bad_outs(shape):
    """(label, out) pairs that each break one rule for an output of float32 `shape`."""
    ro = np.zeros(shape, np.float32)
    ro.flags.writeable = False
    return [
        ("one float", np.zeros((1, 1), np.float32), "out must have shape"),
        ("transposed shape", np.zeros(shape[::-1], np.float32) if shape[0] != shape[1] else np.zeros((1, 1), np.float32),
         "out must have shape"),
        ("float64", np.zeros(shape, np.float64), "out must have dtype float32"),
        ("strided", np.zeros((shape[0], 2 * shape[1]), np.float32)[:, ::2], "out must be C-contiguous"),
        ("read-only", ro, "out is read-only"),
        ("misaligned", misaligned(shape, np.float32), "out is not aligned"),
        ("masked", np.ma.masked_array(np.zeros(shape, np.float32)), "out is a numpy.ma.MaskedArray"),
        ("list", np.zeros(shape, np.float32).tolist(), "out must be a numpy.ndarray"),
    ]


@pytest.mark.parametrize("i", range(8))
def test_cache_attend_checks_out(rng, i):
    """KVCache.attend wrote H*D floats into whatever `out` was (one float: SIGSEGV; (64, 16) for
    H=16, D=64: silently filled row by row)."""
    c = filled_cache(rng)
    q = rng.standard_normal((16, 64)).astype(np.float32)
    label, out, msg = bad_outs((16, 64))[i]
    before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    refused(lambda: c.attend(0, q, out=out), match=msg)
    if before is not None:
        np.testing.assert_array_equal(np.asarray(out), before)
    refused(lambda: c.attend(0, q, out=np.zeros((64, 16), np.float32)), KVSimdValueError,
            r"out must have shape \(16, 64\), got \(64, 16\)")


@pytest.mark.parametrize("i", range(8))
def test_ops_attend_checks_out(rng, i):
    q = rng.standard_normal((8, 16)).astype(np.float32)
    k = rng.standard_normal((2, 30, 16)).astype(np.float16)
    label, out, msg = bad_outs((8, 16))[i]
    refused(lambda: ops.attend(q, k, k, out=out), match=msg)


@pytest.mark.parametrize("i", range(8))
def test_step_attend_checks_out(rng, i):
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    label, out, msg = bad_outs((1, 64))[i]
    if label == "transposed shape":
        out, msg = np.zeros((2, 64), np.float32), "out must have shape"
    if label == "one float":
        msg = r"HD \(the width of out\) must be H \* 16"
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    one = np.array([10], np.int64)
    before = c.keys(0, length=20).copy()
    refused(lambda: c.step_attend(0, qkv, out, one, one, one, [[(False, 0, 11, 10)]]), match=msg)
    np.testing.assert_array_equal(c.keys(0, length=20), before)


def test_conversions_check_out():
    x = np.ones((4, 8), np.float32)
    for label, out, msg in bad_outs((4, 8)):
        if label in ("float64",):
            continue
        o16 = out.astype(np.float16) if isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.writeable \
            and out.flags.c_contiguous and out.flags.aligned and not isinstance(out, np.ma.MaskedArray) else None
        if o16 is not None:
            refused(lambda: ops.to_float16(x, out=o16), match="out")
    ro = np.zeros((4, 8), np.float16)
    ro.flags.writeable = False
    refused(lambda: ops.to_float16(x, out=ro), match="out is read-only")
    refused(lambda: ops.to_float32(ro, out=np.ma.masked_array(np.zeros((4, 8), np.float32))),
            KVSimdTypeError, "MaskedArray")


def test_private_helpers_check_their_buffers():
    """_bench_*, _fma_peak, _rope_table, _attn_workspace_bytes: KVSimdErrors, never a crash or
    a write into read-only memory."""
    src = np.arange(256, dtype=np.uint8)
    ro = np.frombuffer(bytes(256), np.uint8)          # read-only memory of a bytes object
    refused(lambda: _kvsimd._bench_copy(ro, src), KVSimdValueError, "dst is read-only")
    assert not ro.any()
    refused(lambda: _kvsimd._bench_mem("write", ro, src, 1), KVSimdValueError, "dst is read-only")
    refused(lambda: _kvsimd._bench_mem("copy", src, src, 1), KVSimdValueError, "dst overlaps src")
    refused(lambda: _kvsimd._bench_mem("nope", src, src, 1), KVSimdValueError, "op must be one of")
    refused(lambda: _kvsimd._bench_mem("read", src, src, 2 ** 40), KVSimdValueError, "threads must be in 1..1024")
    refused(lambda: _kvsimd._bench_read("abc"), KVSimdTypeError, "buf must be a numpy.ndarray")
    refused(lambda: _kvsimd._bench_read(src[::2]), KVSimdValueError, "buf must be C-contiguous")
    refused(lambda: _kvsimd._fma_peak("scalar", 2 ** 63), KVSimdValueError, "iters must be in 0..")
    refused(lambda: _kvsimd._fma_peak("scalar", "10"), KVSimdTypeError, "iters must be an integer")
    refused(lambda: _kvsimd._attn_workspace_bytes(4, 0, 64), KVSimdValueError, "Hkv must be >= 1")  # was SIGFPE
    refused(lambda: _kvsimd._attn_workspace_bytes(2 ** 62, 1, 64), KVSimdValueError, "H=")
    refused(lambda: _kvsimd._rope_table(1.0, float("nan"), 2, 4), KVSimdValueError, "theta must be a positive")
    refused(lambda: _kvsimd._rope_table(float("inf"), 1e4, 2, 4), KVSimdValueError, "units must be finite")
    refused(lambda: _kvsimd._rope_table(1.0, 1e4, 2 ** 63, 4), KVSimdValueError, "R must be in 0..2")
    # and the good calls still work
    dst = np.zeros(256, np.uint8)
    _kvsimd._bench_copy(dst, src)
    np.testing.assert_array_equal(dst[:192], src[:192])   # whole 64-byte lines are copied
    cs = _kvsimd._rope_table(3.0, 1e4, 2, 4)
    np.testing.assert_allclose(cs, [np.cos(3.0), np.sin(3.0), np.cos(3e-2), np.sin(3e-2)], rtol=1e-6)


# ----------------------------------------------------------------------------- 2. thread count

def test_thread_count_is_read_once_per_call():
    """set_num_threads from one thread while others are inside attend aborted the process
    (`free(): invalid next size`): the workspace was sized from one read of the count and C read
    it again.  Hammer it, in a child process so that a crash fails only this test."""
    out = run_child("""
        import threading, numpy as np, kvsimd
        from kvsimd import ops, _kvsimd
        rng = np.random.default_rng(0)
        q = rng.standard_normal((16, 64)).astype(np.float32)
        k = rng.standard_normal((8, 300, 64)).astype(np.float16)
        v = rng.standard_normal((8, 300, 64)).astype(np.float16)
        c = kvsimd.KVCache(1, 8, 64, 300, dtype="float16")
        c.write(0, k.astype(np.float32), v.astype(np.float32)); c.commit(300)
        want = ops.attend(q, k, v)
        want_c = c.attend(0, q)
        assert np.array_equal(want, want_c)
        stop = threading.Event(); bad = []; calls = [0]
        def flip():
            n = 0
            while not stop.is_set():
                _kvsimd._set_kernel_threads(1 + 7 * (n % 2)); n += 1
        def work(fn):
            for _ in range(150):
                if not np.array_equal(fn(), want):
                    bad.append(1)
                calls[0] += 1
        f = threading.Thread(target=flip)
        ts = [threading.Thread(target=work, args=(fn,)) for fn in
              (lambda: ops.attend(q, k, v), lambda: ops.attend(q, k, v), lambda: c.attend(0, q))]
        f.start()
        for t in ts: t.start()
        for t in ts: t.join()
        stop.set(); f.join()
        print("calls", calls[0], "bad", len(bad))
    """)
    assert "bad 0" in out, out


def test_thread_count_changed_between_plan_and_layers():
    """A decode step sizes its workspace in step_plan and runs kv_attend per layer later: a
    set_num_threads in between (another thread, during a step) made C use more threads than the
    workspace held (heap overflow: SIGSEGV or a hang).  The plan now carries its thread count."""
    out = run_child("""
        import gc, numpy as np, kvsimd
        from kvsimd import _kvsimd
        rng = np.random.default_rng(0)
        Hkv, D, H, C = 8, 64, 16, 300
        k = rng.standard_normal((Hkv, 200, D)).astype(np.float32)
        one = np.array([200], np.int64)
        N, L = _kvsimd.Norm, _kvsimd.Linear
        blk = _kvsimd.Block(N(np.ones(2 * D, np.float32), None, True, 1e-5, 2 * D),
                            L(rng.standard_normal((2 * D, (H + 2 * Hkv) * D)).astype(np.float32) * 0.1),
                            L(rng.standard_normal((H * D, 2 * D)).astype(np.float32) * 0.1),
                            N(np.ones(2 * D, np.float32), None, True, 1e-5, 2 * D),
                            L(np.zeros((2 * D, 2 * D), np.float32)), L(np.zeros((2 * D, 2 * D), np.float32)))
        layers = _kvsimd.Layers([blk], d_model=2 * D, n_heads=H, n_kv_heads=Hkv, head_dim=D, activation="silu",
                                gated=False, pre_norm=True, parallel_residual=False)
        outs = []
        for nt_plan, nt_run in [(1, 1), (1, 8), (8, 1), (1, 8), (2, 8)]:
            _kvsimd._set_kernel_threads(nt_plan)
            c = kvsimd.KVCache(1, Hkv, D, C, dtype="float16")
            c.write(0, k, -k); c.commit(200)
            plan = c.step_plan(H * D, one, one, one, [[(False, 0, 201, 200)]])
            _kvsimd._set_kernel_threads(nt_run)
            x = np.ones((1, 2 * D), np.float32)
            layers.run(x, plan)
            outs.append(x.copy())
            del c, plan; gc.collect()
        assert all(np.array_equal(o, outs[0]) for o in outs[1:])
        assert not np.array_equal(outs[0], np.ones((1, 2 * D), np.float32))
        print("ok")
    """, timeout=120)
    assert out.strip() == "ok"


@pytest.mark.parametrize("n", [2 ** 31, 10 ** 7, 2 ** 64, -1, 0, 1025])
def test_kernel_thread_count_bounded(n):
    before = kvsimd.get_num_threads()
    refused(lambda: _kvsimd._set_kernel_threads(n), KVSimdValueError, r"n must be in 1\.\.1024, got %d" % n)
    assert kvsimd.get_num_threads() == before
    refused(lambda: _kvsimd._set_kernel_threads(2.0), KVSimdTypeError, "n must be an integer")


# ----------------------------------------------------------------------------- 3. sizes

@pytest.mark.parametrize("args, kwargs, exc, msg", [
    ((10 ** 6, 10 ** 6, 64, 10 ** 6), {}, KVSimdMemoryError, "needs %d bytes" % (10 ** 6 * 2 * 10 ** 6 * 10 ** 6 * 128)),
    ((1, 1, 64, 2 ** 24 + 1), {}, KVSimdValueError, "capacity must be in 1..16777216, got 16777217"),
    ((2 ** 63 - 1, 1, 64, 10), {}, KVSimdMemoryError, "n_layers=9223372036854775807"),
    ((2 ** 64, 1, 64, 10), {}, KVSimdValueError, "n_layers must be >= 1 .and < 2..63., got 18446744073709551616"),
    ((1, 2 ** 63, 64, 10), {}, KVSimdValueError, "n_kv_heads must be >= 1"),
    ((1, 1, 64, 10), {"batch": 2 ** 70}, KVSimdValueError, "batch must be >= 1"),
    ((1, 1, 64, 10), {"n_keep": 2 ** 64}, KVSimdValueError, "n_keep"),
    ((1, 1, 64, 10), {"dtype": object()}, KVSimdTypeError, "dtype must be float16, float32, int8, int4 or"),
    ((1, 1, 64, 10), {"policy": ["fixed"]}, KVSimdValueError, "policy must be one of"),
])
def test_cache_dimensions_checked(args, kwargs, exc, msg):
    refused(lambda: KVCache(*args, **kwargs), exc, msg)


def test_integers_beyond_int64_are_kvsimd_errors(rng):
    """Python ints >= 2**63 gave OverflowError from Cython's int64_t parameters."""
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 10, 16)).astype(np.float32)
    one = np.array([10], np.int64)
    slopes = np.ones(4, np.float32)
    refused(lambda: c.shift_range(0, 0, 2 ** 63, 1, 1e4, "gptj", 16), KVSimdValueError, "t1 must be")
    refused(lambda: c.shift_range(2 ** 64, 0, 1, 1, 1e4, "gptj", 16), KVSimdValueError, "seq must be")
    refused(lambda: c.step_plan(2 ** 70, one, one, one, [[(False, 0, 11, 10)]]), KVSimdValueError, "HD must be in")
    refused(lambda: ops.attend(q, k, k, alibi_slopes=slopes, query_position=2 ** 63), KVSimdPositionError,
            "query_position must be within")
    refused(lambda: c.attend(0, q, length=2 ** 64), KVSimdValueError, "length must be")
    refused(lambda: c.commit(2 ** 64), KVSimdValueError, "n must be")
    refused(lambda: c.keys(2 ** 64), KVSimdValueError, "layer must be")
    refused(lambda: ops.shift_keys(k.copy(), 1, stop=2 ** 64), KVSimdValueError, "stop")


# ----------------------------------------------------------------------------- 5. overlap

def test_conversion_output_overlapping_input_is_refused():
    """to_float32(x, out=<buffer holding x>) corrupted 4,088 of 4,096 values."""
    buf = np.zeros(4096 * 4, np.uint8)
    x = buf[:8192].view(np.float16)
    x[:] = np.arange(4096) / 7
    before = x.copy()
    out = buf.view(np.float32)
    refused(lambda: ops.to_float32(x, out=out), KVSimdValueError, "out overlaps x")
    np.testing.assert_array_equal(x, before)
    buf2 = np.zeros(4096 * 4, np.uint8)
    y = buf2.view(np.float32)
    y[:] = np.arange(4096)
    refused(lambda: ops.to_float16(y, out=buf2[4096:4096 + 8192].view(np.float16)), KVSimdValueError, "out overlaps x")


def test_attend_output_overlapping_any_input_is_refused(rng):
    H, D, N = 4, 16, 10
    q = rng.standard_normal((H, D)).astype(np.float32)
    k = rng.standard_normal((2, N, D)).astype(np.float32)
    out = np.zeros((H, D), np.float32)
    slopes = out.reshape(-1)[:H]                               # alibi_slopes inside out
    refused(lambda: ops.attend(q, k, k, alibi_slopes=slopes, out=out), KVSimdValueError, "out overlaps alibi_slopes")
    kp = out.reshape(-1).view(np.int64)[:N]                    # key_positions inside out
    kp[:] = np.arange(N)
    refused(lambda: ops.attend(q, k, k, alibi_slopes=np.ones(H, np.float32), key_positions=kp, out=out),
            KVSimdValueError, "out overlaps key_positions")
    qa = q.copy()
    refused(lambda: ops.attend(q, k, k, q_alt=qa, ranges=[(0, 5, True)], out=qa), KVSimdValueError,
            "out overlaps q_alt")
    # KVCache.attend: out against q and alibi_slopes
    c = filled_cache(rng, H=H, Hkv=2, D=D, n=N, capacity=20)
    refused(lambda: c.attend(0, out, out=out), KVSimdValueError, "out overlaps q")
    # apply_rope: x written in place must not hold its positions
    raw = np.zeros(2 * N * D * 4, np.uint8)
    x = raw.view(np.float32).reshape(2, N, D)
    pos = raw[:8 * N].view(np.int64)
    pos[:] = np.arange(N)
    refused(lambda: ops.apply_rope(x, pos), KVSimdValueError, "x overlaps positions")


def test_step_attend_output_overlapping_qkv_is_refused(rng):
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    one = np.array([10], np.int64)
    before = c.keys(0, length=20).copy()
    refused(lambda: c.step_attend(0, qkv, qkv[:, :64], one, one, one, [[(False, 0, 11, 10)]]), KVSimdValueError,
            "out overlaps qkv")
    np.testing.assert_array_equal(c.keys(0, length=20), before)


# ----------------------------------------------------------------------------- 6. one rule per concept

@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 10 ** 400, "1", True])
def test_scale_same_rule_everywhere(rng, scale):
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 10, 16)).astype(np.float32)
    one = np.array([10], np.int64)
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    msgs = {
        refused(lambda: ops.attend(q, k, k, scale=scale), match="scale"),
        refused(lambda: c.attend(0, q, scale=scale), match="scale"),
        refused(lambda: c.step_attend(0, qkv, np.zeros((1, 64), np.float32), one, one, one, [[(False, 0, 11, 10)]],
                                      scale=scale), match="scale"),
    }
    assert len(msgs) == 1, msgs


@pytest.mark.parametrize("theta, style, rd, msg", [
    (float("nan"), "gptj", 16, "theta must be a positive finite number"),
    (0.0, "gptj", 16, "theta must be a positive finite number"),
    (-1e4, "gptj", 16, "theta must be a positive finite number"),
    (float("inf"), "gptj", 16, "theta must be a positive finite number"),
    (1e-300, "gptj", 16, "theta must be a positive finite number"),
    ("1e4", "gptj", 16, "theta must be a real number"),
    (1e4, "llama", 16, "style must be 'gptj' or 'neox'"),
    (1e4, ["gptj"], 16, "style must be 'gptj' or 'neox'"),
    (1e4, "neox", 7, "rotary_dim must be even and in 2..head_dim=16, got 7"),
    (1e4, "neox", 18, "rotary_dim must be even and in 2..head_dim=16, got 18"),
    (1e4, "neox", 2 ** 64, "rotary_dim must be"),
    (1e4, "neox", 8.0, "rotary_dim must be an integer"),
])
def test_rope_params_same_rule_everywhere(rng, theta, style, rd, msg):
    """apply_rope, shift_keys, KVCache.shift_range and step_attend's rope: one validator.
    shift_range validated nothing (a NaN theta destroyed the keys in place; a bad style was a KeyError)."""
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    before = c.keys(0, length=20).copy()
    x = rng.standard_normal((2, 10, 16)).astype(np.float32)
    xb = x.copy()
    pos = np.arange(10, dtype=np.int64)
    one = np.array([10], np.int64)
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    msgs = {
        refused(lambda: ops.apply_rope(x, pos, theta=theta, style=style, rotary_dim=rd), match=msg),
        refused(lambda: ops.shift_keys(x, 3, theta=theta, style=style, rotary_dim=rd), match=msg),
        refused(lambda: c.shift_range(0, 0, 10, -3, theta, style, rd), match=msg),
        refused(lambda: c.step_attend(0, qkv, np.zeros((1, 64), np.float32), one, one, one, [[(False, 0, 11, 10)]],
                                      rope=(theta, style, rd)), match=msg),
    }
    assert len(msgs) == 1, msgs
    np.testing.assert_array_equal(x, xb)
    np.testing.assert_array_equal(c.keys(0, length=20), before)


@pytest.mark.parametrize("bad", [-2 ** 63, 2 ** 53 + 1, -2 ** 53 - 1, 2 ** 62])
def test_positions_same_rule_everywhere(rng, bad):
    """The +-2**53 guard was bypassed by -2**63 (abs() overflows); ALiBi query positions were
    not bounded at all, so qpos - kpos could overflow in C."""
    x = rng.standard_normal((2, 1, 16)).astype(np.float32)
    xb = x.copy()
    refused(lambda: ops.apply_rope(x, np.array([bad], np.int64)), KVSimdPositionError, "positions must be within")
    np.testing.assert_array_equal(x, xb)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 3, 16)).astype(np.float32)
    s = np.ones(4, np.float32)
    refused(lambda: ops.attend(q, k, k, alibi_slopes=s, query_position=bad), KVSimdPositionError, "within")
    refused(lambda: ops.attend(q, k, k, alibi_slopes=s, key_positions=np.array([0, 1, bad], np.int64)),
            KVSimdPositionError, "key_positions must be within")
    refused(lambda: ops.shift_keys(x, bad), KVSimdPositionError, "delta must be within")
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    refused(lambda: c.attend(0, q, alibi_slopes=s, query_position=bad), KVSimdPositionError, "within")
    refused(lambda: c.shift_range(0, 0, 5, bad, 1e4, "gptj", 16), KVSimdPositionError, "delta must be within")
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    out = np.zeros((1, 64), np.float32)
    one = np.array([10], np.int64)
    big = np.array([bad], np.int64)
    # without rope the positions were not checked at all
    refused(lambda: c.step_attend(0, qkv, out, one, big, one, [[(False, 0, 11, 10)]], alibi_slopes=s),
            KVSimdPositionError, "kpos must be within")
    refused(lambda: c.step_attend(0, qkv, out, one, one, one, [[(False, 0, 11, bad)]], alibi_slopes=s),
            KVSimdPositionError, "query_position must be within")
    kp = np.zeros((1, 20), np.int64)
    kp[0, 3] = bad                                # what step_plan hands C is checked too
    refused(lambda: c.step_attend(0, qkv, out, one, one, one, [[(False, 0, 11, 10)]], alibi_slopes=s,
                                  key_positions=kp), KVSimdPositionError, "key_positions must be within")


def test_alibi_extreme_positions_stay_exact(rng):
    """At the bound, qpos - kpos = 2**54 does not overflow: the result equals the reference."""
    q = rng.standard_normal((2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 3, 8)).astype(np.float32)
    s = np.array([1e-16, 2e-16], np.float32)
    kp = np.array([-2 ** 53, 0, 2 ** 53], np.int64)
    got = ops.attend(q, k, k, alibi_slopes=s, key_positions=kp, query_position=2 ** 53)
    want = reference.attend(q, k, k, alibi_slopes=s, key_positions=kp, query_position=2 ** 53)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ops_ranges, step_ranges, msg", [
    ([(0, 5), (2, 6)], [(False, 0, 5, 10), (False, 2, 6, 10)], "key ranges overlap: 0..5 and 2..6"),
    ([(4, 9), (0, 5)], [(False, 4, 9, 10), (False, 0, 5, 10)], "key ranges overlap: 0..5 and 4..9"),
    ([(0.0, 5)], [(False, 0.0, 5, 10)], "t0 must be an integer"),
    ([(0, np.float64(5))], [(False, 0, np.float64(5), 10)], "t1 must be an integer"),
    ([(3, 3)], [(False, 3, 3, 10)], "key range 0: keys 3..3 must be non-empty and within 0..20"),
    ([(0, 21)], [(False, 0, 21, 10)], "key range 0: keys 0..21 must be non-empty and within 0..20"),
    ([(0, 5, "yes")], [("yes", 0, 5, 10)], "use_q_alt must be a bool"),
    ([(0, 5, False, 2 ** 60)], [(False, 0, 5, 2 ** 60)], "query_position must be within"),
    ([], [], "ranges is empty"),
])
def test_key_ranges_same_rule_everywhere(rng, ops_ranges, step_ranges, msg):
    """step_attend/step_plan accepted overlapping and non-integer ranges that ops.attend rejected."""
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=19, capacity=20)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = np.ascontiguousarray(c.keys(0, length=20))
    qkv = rng.standard_normal((1, 128)).astype(np.float32)
    one = np.array([19], np.int64)
    before = c.keys(0, length=20).copy()
    msgs = {
        refused(lambda: ops.attend(q, k, k, ranges=ops_ranges, q_alt=q), match=msg),
        refused(lambda: c.step_plan(64, one, one, one, [step_ranges]), match=msg),
        refused(lambda: c.step_attend(0, qkv, np.zeros((1, 64), np.float32), one, one, one, [step_ranges]), match=msg),
    }
    assert len(msgs) == 1, msgs
    np.testing.assert_array_equal(c.keys(0, length=20), before)


# ----------------------------------------------------------------------------- 7. masked arrays

def test_masked_arrays_are_refused(rng):
    """The mask was ignored: attention read the masked keys as if they were data."""
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 10, 16)).astype(np.float32)
    mk = np.ma.masked_array(k, mask=np.zeros_like(k, bool))
    mk.mask[:, 5:] = True
    refused(lambda: ops.attend(q, mk, k), KVSimdTypeError, "k is a numpy.ma.MaskedArray")
    refused(lambda: ops.attend(np.ma.masked_array(q), k, k), KVSimdTypeError, "q is a numpy.ma.MaskedArray")
    refused(lambda: ops.apply_rope(mk, np.arange(10)), KVSimdTypeError, "x is a numpy.ma.MaskedArray")
    refused(lambda: ops.to_float16(np.ma.masked_array(q)), KVSimdTypeError, "MaskedArray")
    c = KVCache(1, 2, 16, 20, dtype="float32")
    refused(lambda: c.write(0, mk, k), KVSimdTypeError, "k is a numpy.ma.MaskedArray")
    assert c.length() == 0


# ----------------------------------------------------------------------------- 9. one thread per cache

def test_claim_refuses_another_thread_and_nests_for_the_owner(rng):
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    held, release, seen = threading.Event(), threading.Event(), []

    def owner():
        with c._claim():
            with c._claim():                      # re-entrant for the holder
                c.attend(0, q)                    # methods take it again inside
                c.commit(0)
            held.set()
            release.wait(30)

    t = threading.Thread(target=owner)
    t.start()
    assert held.wait(30)
    for call in (lambda: c.attend(0, q), lambda: c.commit(1), lambda: c.reset(),
                 lambda: c.write(0, np.zeros((2, 1, 16), np.float32), np.zeros((2, 1, 16), np.float32)),
                 lambda: c.shift_range(0, 0, 5, 1, 1e4, "gptj", 16), lambda: c._claim().__enter__()):
        try:
            call()
        except KVSimdBusyError as e:
            seen.append(str(e))
    release.set()
    t.join()
    assert len(seen) == 6 and all("KVCache(n_layers=2" in m and "in use by thread" in m for m in seen), seen
    assert isinstance(KVSimdBusyError("x"), RuntimeError)
    assert c.length() == 10                        # nothing the refused calls did stuck
    with c._claim():                               # free again
        c.commit(1)
    assert c.length() == 11


def test_two_threads_stepping_one_cache_never_corrupt_it():
    """Two threads each append 300 tokens to one cache (write + commit under one claim, retried
    when busy): every attempt either completes or raises KVSimdBusyError, and every committed
    slot holds the token whose commit claimed it."""
    c = KVCache(1, 1, 8, 700, dtype="float32")
    busy = [0, 0]
    done = [[], []]

    def worker(w):
        i = 0
        while i < 300:
            val = float(w * 10000 + i)
            try:
                with c._claim():
                    slot = c.length()
                    c.write(0, np.full((1, 1, 8), val, np.float32), np.full((1, 1, 8), -val, np.float32))
                    for _ in range(20):               # hold the claim a while: let the other thread try
                        c.keys(0)
                    c.commit(1)
                    done[w].append((slot, val))
                i += 1
            except KVSimdBusyError:
                busy[w] += 1
                time.sleep(0)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert c.length() == 600
    slots = sorted(done[0] + done[1])
    assert [s for s, _ in slots] == list(range(600))
    keys, values = c.keys(0), c.values(0)
    for s, val in slots:
        assert (keys[0, s] == val).all() and (values[0, s] == -val).all(), (s, val)


def test_concurrent_attend_on_one_cache_is_busy_or_right(rng):
    c = filled_cache(rng, H=16, Hkv=4, D=64, n=60, capacity=64)
    q = rng.standard_normal((16, 64)).astype(np.float32)
    want = c.attend(0, q)
    bad, busy = [], [0]

    def work():
        for _ in range(300):
            try:
                if not np.array_equal(c.attend(0, q), want):
                    bad.append(1)
            except KVSimdBusyError:
                busy[0] += 1

    ts = [threading.Thread(target=work) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


# ----------------------------------------------------------------------------- 11. argument types

@pytest.mark.parametrize("call, exc, msg", [
    (lambda c: c.shift_range("a", 0, 5, 1, 1e4, "gptj", 16), KVSimdTypeError, "seq must be an integer, got 'a'"),
    (lambda c: c.shift_range(0, 0, 5, 1.5, 1e4, "gptj", 16), KVSimdTypeError, "delta must be an integer, got 1.5"),
    (lambda c: c.shift_range(0, 0, 5, 1, 1e4, "nope", 16), KVSimdValueError, "style must be 'gptj' or 'neox', got 'nope'"),
    (lambda c: c.shift_range(0, 5, 2, 1, 1e4, "gptj", 16), KVSimdValueError, "slot range t0..t1 = 5..2"),
    (lambda c: c.step_plan(None, *([np.array([10], np.int64)] * 3), [[(False, 0, 11, 10)]]), KVSimdTypeError,
     "HD must be an integer, got None"),
    (lambda c: c.step_plan(64, *([np.array([10], np.int64)] * 3), 5), KVSimdTypeError, "ranges must be a list"),
    (lambda c: c.step_plan(64, *([np.array([10], np.int64)] * 3), [5]), KVSimdTypeError, "ranges must be a sequence"),
    (lambda c: c.step_plan(64, *([np.array([10], np.int64)] * 3), [[(False, 0, 11, 10)]], rope=5), KVSimdValueError,
     "rope must be a RopeSpec or .theta, style, rotary_dim., got 5"),
    (lambda c: c.attend(0, np.zeros((4, 16), np.float32), query_position=3), KVSimdValueError,
     "query_position only applies with alibi_slopes"),
    (lambda c: c.attend(0, np.zeros((4, 16), np.float32), alibi_slopes=np.full(4, np.nan, np.float32)),
     KVSimdValueError, "alibi_slopes must be finite"),
    (lambda c: c.length("x"), KVSimdTypeError, "seq must be an integer"),
    (lambda c: c._forget(0, "x"), KVSimdTypeError, "n must be an integer"),
])
def test_every_argument_gets_a_kvsimd_error(rng, call, exc, msg):
    c = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    before = c.keys(0, length=20).copy()
    refused(lambda: call(c), exc, msg)
    np.testing.assert_array_equal(c.keys(0, length=20), before)


def test_a_plan_serves_only_its_cache(rng):
    """The compiled layers write K/V only into the store that made the plan, and refuse a stack of
    more layers than that store holds (instead of writing past its block)."""
    big = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=200)
    small = filled_cache(rng, H=4, Hkv=2, D=16, n=10, capacity=20)
    one = np.array([150], np.int64)
    plan = big.step_plan(64, one, one, one, [[(False, 0, 151, 150)]])
    assert plan.owner is big
    x = np.zeros((1, 64), np.float32)
    N, L = _kvsimd.Norm, _kvsimd.Linear
    blk = _kvsimd.Block(N(np.ones(64, np.float32), None, True, 1e-5, 64), L(np.zeros((64, 128), np.float32)),
                        L(np.zeros((64, 64), np.float32)), N(np.ones(64, np.float32), None, True, 1e-5, 64),
                        L(np.zeros((64, 64), np.float32)), L(np.zeros((64, 64), np.float32)))
    layers = lambda n: _kvsimd.Layers([blk] * n, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,  # noqa: E731
                                      activation="silu", gated=False, pre_norm=True, parallel_residual=False)
    before = small.keys(0, length=20).copy()
    refused(lambda: layers(3).run(x, plan), KVSimdValueError, "3 layers for a cache of 2 layers")
    np.testing.assert_array_equal(small.keys(0, length=20), before)
    with pytest.raises(KVSimdTypeError, match="plan"):
        layers(1).run(x, None)

# ---------------------------------------------------------------------------------------------
# ndarray subclasses that redefine what the boundary reads: what is checked must be the buffer the
# kernels get (a subclass reporting a larger shape, or another dtype, read past the buffer or
# misread it).  Run in a child process, so that a crash fails these cases, not the whole run.
import childcases  # noqa: E402

CASES = {}   # childcases reads the registry by this name
sub_case = childcases.registrar(CASES)


def _lying(field, value):
    return type("Lying_" + field, (np.ndarray,), {field: property(lambda self: value)})


@sub_case(r"x is a Lying_size, which redefines numpy.ndarray's size: pass numpy.asarray\(x\)")
def subclass_size_to_float16():
    ops.to_float16(np.ones(5, np.float32).view(_lying("size", 10 ** 6)))


@sub_case(r"k is a Lying_shape, which redefines numpy.ndarray's shape")
def subclass_shape_attend():
    k = np.ones((1, 3, 4), np.float32).view(_lying("shape", (1, 10 ** 6, 4)))
    ops.attend(np.ones((1, 4), np.float32), k, k)


@sub_case(r"x is a Lying_shape, which redefines numpy.ndarray's shape")
def subclass_shape_rope():
    ops.apply_rope(np.ones((1, 3, 8), np.float32).view(_lying("shape", (1, 10 ** 5, 8))), np.arange(10 ** 5))


@sub_case(r"x is a Lying_shape, which redefines numpy.ndarray's shape")
def subclass_shape_qmatrix():
    kvsimd.QMatrix(b"\0" * 34 * 8, "q8_0", (8, 32)).matmul(
        np.ones((1, 32), np.float32).view(_lying("shape", (100000, 32))))


@sub_case(r"x is a Lying_dtype, which redefines numpy.ndarray's dtype")
def subclass_dtype_to_float16():
    ops.to_float16(np.array([1.0, 2.0, 3.0, 4.0]).view(_lying("dtype", np.dtype(np.float32))))


@sub_case(r"x is a Lying_flags, which redefines numpy.ndarray's flags")
def subclass_flags_to_float16():
    flags = type("Flags", (), {"c_contiguous": True, "aligned": True, "writeable": True})()
    ops.to_float16(np.arange(10, dtype=np.float32)[::2].view(_lying("flags", flags)))


sub_results = childcases.results_fixture(__name__, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_array_subclasses_that_redefine_what_is_checked_are_refused(name, sub_results):
    childcases.check(name, sub_results, CASES)


def test_array_subclasses_that_keep_ndarray_fields_are_accepted(tmp_path):
    """np.memmap and np.matrix (which redefine nothing the boundary reads) still work."""
    m = np.memmap(tmp_path / "x.bin", np.float32, "w+", shape=(8,))
    m[:] = np.arange(8)
    assert np.array_equal(ops.to_float16(m), np.arange(8, dtype=np.float16))
    assert np.array_equal(ops.to_float16(np.asmatrix(np.ones((2, 4), np.float32))), np.ones((2, 4), np.float16))


def test_bookkeeping_views_cannot_be_made_writeable():
    """The cache's positions / head / seen / rotations, a plan's positions and tokens, and a RoPE
    spec's frequencies are read-only views of state C reads: setflags(write=True) is refused (a
    head written through one crashed the next step)."""
    from kvsimd.cache import RopeSpec
    c = KVCache(1, 1, 8, 8)
    c.write(0, *np.ones((2, 1, 2, 8), np.float32))
    c.append(0, 2, np.arange(2, dtype=np.int64))
    plan = c.begin_step(np.array([1], np.int64))
    spec = RopeSpec(10000.0, "gptj", None, 8, inv_freq=np.ones(4))
    for a in (c.positions, c.head, c.seen, c.rotations, plan.embed_positions, plan.tokens, spec.frequencies,
              spec.inv_freq):
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            a.setflags(write=True)
