"""Property-based fuzzing of every public entry point of kvsimd.ops and KVCache (issue 13, Tools).

hypothesis draws shapes, strides, dtypes, values (NaN, inf, huge), ``out`` buffers (wrong
shape/dtype, read-only, misaligned, masked, overlapping an input) and integer arguments from
-2**64 to 2**64.  Every call must end in a result or in a KVSimdError (any other exception fails);
results of valid calls are checked against kvsimd.reference / NumPy, and a refused call must
leave its in-place operands and the cache unchanged.

Each test runs its hypothesis loop in a fresh interpreter (this file, imported by a child
process), so a crash (SIGSEGV, abort) fails that one test rather than the whole run.  The child
prints how many examples ran; the parent prints it too (``pytest -s`` shows the counts) and the
number of examples is SCALE times the loaded hypothesis profile's (tests/conftest.py: dev 25, ci 60).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGETS = ("attend", "rope", "convert", "cache", "private")
SCALE = 4   # examples per target = SCALE x the profile's max_examples (ci: 240 each, about 25 s in all)


# ------------------------------------------------------------------------------- the parent side

@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target):
    prof = settings.default
    code = ("import sys; sys.path.insert(0, %r); import test_fuzz_api as m; m.child(%r, %d, %r)"
            % (HERE, target, SCALE * prof.max_examples, bool(prof.derandomize)))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail("fuzz %s: child hung (stderr tail: %s)" % (target, (e.stderr or b"")[-3000:]))
    tail = (r.stdout[-4000:], r.stderr[-6000:])
    assert r.returncode == 0, "fuzz %s: child exited %d (negative: killed by that signal)\n%s\n%s" % (
        (target, r.returncode) + tail)
    counts = [line for line in r.stdout.splitlines() if line.startswith("fuzz ")]
    assert counts, tail
    print(counts[-1])
    n = int(counts[-1].split()[2])
    assert n >= min(10, prof.max_examples), counts[-1]


# ------------------------------------------------------------------------------- the child side

def child(target, max_examples, derandomize):
    import kvsimd  # noqa: F401  (imported here: the parent never runs kernels for these tests)
    ran = [0, 0]   # examples, of which refused with a KVSimdError
    body = {"attend": _fuzz_attend, "rope": _fuzz_rope, "convert": _fuzz_convert, "cache": _fuzz_cache,
            "private": _fuzz_private}[target]

    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        ran[0] += 1
        ran[1] += body(data)

    run()
    print("fuzz %s: %d examples (%d refused with a KVSimdError)" % (target, ran[0], ran[1]))
    sys.stdout.flush()


def _call(fn):
    """1 if fn() raised a KVSimdError, 0 if it returned; anything else propagates (fails)."""
    from kvsimd import KVSimdError
    try:
        fn()
    except KVSimdError as e:
        msg = str(e)
        assert msg and len(msg) < 5000, msg
        return 1
    return 0


# integers: the usual, the edges of int64 and beyond
INTS = st.one_of(st.integers(-3, 70), st.sampled_from([-2 ** 64, -2 ** 63, -2 ** 53 - 1, -2 ** 31, 2 ** 24 + 1,
                                                      2 ** 31, 2 ** 53, 2 ** 53 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63,
                                                      2 ** 64]))
REALS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e39, -1e39, 1e-300, 0.0, 1.0]),
                  st.integers(-5, 5), st.sampled_from(["1", None, True, 10 ** 400]))
SPECIAL = np.array([np.nan, np.inf, -np.inf, 6e4, -6e4, 3e38, 1e-40, 0.0], np.float64)


def _array(data, shape, dtype, values="normal"):
    """An array of `shape` and `dtype`; one time in five broken in one way: another dtype, not
    contiguous, misaligned, read-only, masked, big-endian, a list.  Finite or special values."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    a = rng.standard_normal(shape)
    if values == "special" or data.draw(st.integers(0, 9)) == 0:
        a = np.where(rng.random(shape) < 0.3, rng.choice(SPECIAL, size=shape), a)
    broken = data.draw(st.integers(0, 4)) == 0
    with np.errstate(all="ignore"):
        a = a.astype(data.draw(st.sampled_from(["float64", "float16", "float32", "int64"])) if broken and
                     data.draw(st.booleans()) else dtype)
    kind = data.draw(st.sampled_from(["strided", "misaligned", "readonly", "masked", "fortran", "list",
                                      "bigendian"])) if broken else "plain"
    if kind == "strided" and a.ndim:
        b = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        b[..., ::2] = a
        a = b[..., ::2]
    elif kind == "misaligned" and a.itemsize > 1:
        buf = np.zeros(a.nbytes + 1, np.uint8)
        b = np.ndarray(a.shape, a.dtype, buffer=buf, offset=1)
        b[...] = a
        a = b
    elif kind == "readonly":
        a.flags.writeable = False
    elif kind == "masked":
        a = np.ma.masked_array(a, mask=rng.random(shape) < 0.5)
    elif kind == "fortran":
        a = np.asfortranarray(a)
    elif kind == "list":
        return a.tolist()
    elif kind == "bigendian":
        a = a.astype(a.dtype.newbyteorder(">"))
    return a


def _dim(data, good):
    """Mostly `good`, sometimes 0..5."""
    return good if data.draw(st.integers(0, 5)) else data.draw(st.integers(0, 5))


def _shape(data, dims):
    return tuple(data.draw(st.one_of(st.integers(0, 5), st.sampled_from(list(d))), label="dim") for d in dims)


def _plain(a):
    import numpy as _n
    return isinstance(a, _n.ndarray) and not isinstance(a, _n.ma.MaskedArray) and a.flags.c_contiguous \
        and a.flags.aligned and a.dtype.isnative


def _fuzz_attend(data):
    from kvsimd import ops, reference
    Hkv = data.draw(st.integers(1, 3))
    H, Hkv = _dim(data, Hkv * data.draw(st.integers(1, 3))), _dim(data, Hkv)
    N, D = _dim(data, data.draw(st.sampled_from([1, 7, 17, 40]))), _dim(data, data.draw(st.sampled_from([1, 8, 16, 33])))
    q = _array(data, (H, D), "float32")
    kd = data.draw(st.sampled_from(["float16", "float32"]))
    k = _array(data, (Hkv, N, D), kd)
    v = _array(data, (Hkv, N, D), kd)
    kw = {}
    if data.draw(st.integers(0, 3)) == 0:
        kw["scale"] = data.draw(st.one_of(st.none(), REALS))
    if data.draw(st.integers(0, 3)) == 0:
        kw["alibi_slopes"] = _array(data, (data.draw(st.sampled_from([H, H + 1])),), "float32")
        if data.draw(st.booleans()):
            kp = data.draw(st.lists(INTS, min_size=N, max_size=N))
            kw["key_positions"] = np.array([max(min(i, 2 ** 63 - 1), -2 ** 63) for i in kp], np.int64)
        if data.draw(st.booleans()):
            kw["query_position"] = data.draw(INTS)
    if data.draw(st.integers(0, 3)) == 0:
        kw["softcap"] = data.draw(REALS)
    if data.draw(st.integers(0, 2)) == 0:
        kw["ranges"] = data.draw(st.lists(st.tuples(INTS, INTS, st.sampled_from([False, True, 2, "x"]), INTS)
                                          .map(lambda t: t[:data.draw(st.integers(2, 4))]), max_size=4))
        if data.draw(st.booleans()):
            kw["q_alt"] = _array(data, (H, D), "float32")
    out_kind = data.draw(st.sampled_from(["none", "fresh"] * 3 + ["bad", "q", "k", "alibi", "q_alt"]))
    if out_kind == "fresh":
        kw["out"] = np.zeros((H, D), np.float32)
    elif out_kind == "bad":
        kw["out"] = _array(data, _shape(data, [(H,), (D,)]), "float32")
    elif out_kind == "q" and isinstance(q, np.ndarray):
        kw["out"] = q
    elif out_kind == "k" and isinstance(k, np.ndarray) and k.nbytes >= 4 * H * D and _plain(k):
        kw["out"] = k.reshape(-1).view(np.uint8)[:4 * H * D].view(np.float32).reshape(H, D)
    elif out_kind == "alibi" and "alibi_slopes" in kw and isinstance(q, np.ndarray):
        kw["out"] = kw["alibi_slopes"]
    elif out_kind == "q_alt" and "q_alt" in kw:
        kw["out"] = kw["q_alt"]
    kcopy = np.array(k, copy=True) if isinstance(k, np.ndarray) else None
    res = []
    refused = _call(lambda: res.append(ops.attend(q, k, v, **kw)))
    if kcopy is not None and out_kind != "k":
        np.testing.assert_array_equal(np.asarray(k), kcopy)      # inputs never written
    if refused:
        return 1
    out = res[0]
    assert out.shape == (H, D) and out.dtype == np.float32
    mags = [np.abs(np.asarray(a, np.float64)) for a in (q, k, v)]
    s, cap = kw.get("scale"), kw.get("softcap")
    if all(np.isfinite(m).all() and m.max(initial=0) < 1e3 for m in mags) and "ranges" not in kw and \
            "alibi_slopes" not in kw and (s is None or (isinstance(s, (int, float)) and abs(s) < 10)) and \
            (cap is None or (isinstance(cap, (int, float)) and (cap == 0 or 0.5 <= cap <= 1e3))):
        ref = reference.attend(np.asarray(q), np.asarray(k), np.asarray(v), scale=s, softcap=cap)
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * max(1.0, float(mags[2].max(initial=0))))
    return 0


def _inv_freq(data, rd, D):
    """Scaled RoPE's frequencies: mostly None (theta's); else rotary_dim/2 positive reals, or a
    broken array (length, values, dtype, masked...), a list with special values, a string."""
    k = data.draw(st.integers(0, 9))
    n = max((rd if isinstance(rd, int) and not isinstance(rd, bool) and 0 < rd < 10 ** 4 else D) // 2, 0)
    if k <= 5:
        return None
    if k <= 7:
        return np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))).uniform(1e-6, 2.0, n)
    if k == 8:
        return _array(data, (data.draw(st.sampled_from([n, n, n + 1, max(n - 1, 0)])),), "float64")
    if data.draw(st.booleans()):
        return [data.draw(st.one_of(REALS, st.just([1.0]))) for _ in range(n)]
    return data.draw(st.sampled_from(["abc", 1.0, {"a": 1}, (), [[1.0, 2.0]], np.zeros((n, 1))]))


def _fuzz_rope(data):
    from kvsimd import ops, reference
    H, N, D = (_dim(data, data.draw(st.sampled_from(g))) for g in [(1, 2, 3), (1, 5, 17), (2, 4, 8, 16, 18, 64)])
    x = _array(data, (H, N, D), data.draw(st.sampled_from(["float16", "float32"])))
    theta = data.draw(st.sampled_from([1e4, 5e5, 1.0])) if data.draw(st.integers(0, 3)) else data.draw(REALS)
    style = data.draw(st.sampled_from(["gptj", "neox"] * 3 + ["llama", None, ["gptj"]]))
    rd = data.draw(st.sampled_from([None, D, D - D % 4])) if data.draw(st.integers(0, 3)) else \
        data.draw(st.one_of(INTS, st.sampled_from([2.0, "4"])))
    inv = _inv_freq(data, rd, D)
    before = np.array(x, copy=True) if isinstance(x, np.ndarray) else None
    if data.draw(st.booleans()):
        pos_kind = data.draw(st.sampled_from(["arange"] * 4 + ["extreme", "bad", "overlap"]))
        if pos_kind == "arange":
            pos = np.arange(N, dtype=np.int64) * data.draw(st.integers(-1000, 1000))
        elif pos_kind == "extreme":
            pos = np.array([data.draw(INTS) % 2 ** 64 - 2 ** 63 if data.draw(st.booleans()) else 0
                            for _ in range(N)], np.int64)
        elif pos_kind == "overlap" and _plain(x) and x.nbytes >= 8 * N:
            pos = x.reshape(-1).view(np.uint8)[:8 * N].view(np.int64)
        else:
            pos = _array(data, (N,), "int64")
        af = data.draw(st.floats(0.5, 2.0)) if data.draw(st.integers(0, 5)) else data.draw(REALS)
        refused = _call(lambda: ops.apply_rope(x, pos, theta=theta, style=style, rotary_dim=rd, inv_freq=inv,
                                               attn_factor=af))
        if not refused and _plain(x) and x.dtype == np.float32 and np.abs(before).max(initial=0) < 1e3 and \
                pos_kind == "arange":
            want = reference.apply_rope(before.astype(np.float64), np.asarray(pos), theta=theta, style=style,
                                        rotary_dim=rd, inv_freq=inv, attn_factor=af)
            np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(before).max())))
    else:
        delta = data.draw(st.one_of(st.integers(-100, 100), INTS))
        start = data.draw(st.one_of(st.just(0), st.just(0), st.integers(0, N), INTS))
        stop = data.draw(st.one_of(st.none(), st.none(), st.integers(0, N), INTS))
        refused = _call(lambda: ops.shift_keys(x, delta, theta=theta, style=style, rotary_dim=rd, inv_freq=inv,
                                               start=start, stop=stop))
    if refused and before is not None:
        np.testing.assert_array_equal(np.asarray(x), before)
    return refused


def _fuzz_convert(data):
    from kvsimd import ops
    n = data.draw(st.one_of(st.integers(0, 40), st.sampled_from([1000, 4096])))
    shape = data.draw(st.sampled_from([(n,), (1, n), (n, 1)]))
    to16 = data.draw(st.booleans())
    src_dt, dst_dt = ("float32", np.float16) if to16 else ("float16", np.float32)
    x = _array(data, shape, src_dt, values="special")
    kind = data.draw(st.sampled_from(["none", "fresh", "bad", "overlap"]))
    out = None
    if kind == "fresh":
        out = np.zeros(shape, dst_dt)
    elif kind == "bad":
        out = _array(data, _shape(data, [(n,), (1, n)]), np.dtype(dst_dt).name)
    elif kind == "overlap" and _plain(x) and x.size:
        buf = np.zeros(x.nbytes + x.size * 4 + 64, np.uint8)
        off = data.draw(st.integers(0, 16)) * 2
        xs = buf[off:off + x.nbytes].view(x.dtype).reshape(shape)
        xs[...] = x
        x = xs
        o0 = data.draw(st.integers(0, 16)) * 4
        out = buf[o0:o0 + x.size * np.dtype(dst_dt).itemsize].view(dst_dt).reshape(shape)
    before = np.array(x, copy=True) if isinstance(x, np.ndarray) else None
    res = []
    refused = _call(lambda: res.append((ops.to_float16 if to16 else ops.to_float32)(x, out=out)))
    if before is not None:
        assert np.asarray(x).tobytes() == before.tobytes()
    if not refused:
        assert kind != "overlap" or not np.shares_memory(res[0], x)
        with np.errstate(all="ignore"):
            want = before.astype(dst_dt)
        np.testing.assert_array_equal(res[0].view(np.uint8), want.view(np.uint8))
    return refused


def _fuzz_cache(data):
    """A small cache driven through a random sequence of calls, good and bad; a refused call
    changes neither the lengths nor the stored keys and values."""
    import kvsimd
    from kvsimd import KVCache, ops
    bad_dims = st.sampled_from([-2 ** 64, -1, 0, 2 ** 63, 2 ** 64, 10 ** 12, 2.0, "2", None])
    dims = [data.draw(bad_dims if data.draw(st.integers(0, 9)) == 0 else st.integers(1, 3), label=n)
            for n in ("n_layers", "n_kv_heads")]
    D = data.draw(st.sampled_from([1, 8, 16, 17]))
    C = data.draw(st.integers(1, 24))
    B = data.draw(st.integers(1, 2))
    dtype = data.draw(st.sampled_from(["float16", "float32"] * 4 + ["int8", None]))
    res = []
    if _call(lambda: res.append(KVCache(dims[0], dims[1], D, C, batch=B, dtype=dtype))):
        return 1
    c = res[0]
    L, Hkv = c.n_layers, c.n_kv_heads
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    refused = 0
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["write", "commit", "attend", "step", "shift", "reset", "keys"]))
        layer = data.draw(st.one_of(st.integers(0, L - 1), INTS))
        seq = data.draw(st.one_of(st.integers(0, B - 1), INTS))
        lens = c.lengths
        snap = [c.keys(l, s, length=C).copy() for l in range(L) for s in range(B)] + \
               [c.values(l, s, length=C).copy() for l in range(L) for s in range(B)]
        H = Hkv * data.draw(st.sampled_from([1, 2]))
        if op == "write":
            T = data.draw(st.integers(0, 4))
            k = _array(data, (Hkv, T, D), "float32")
            r = _call(lambda: c.write(layer, k, k, seq=seq, start=data.draw(st.one_of(st.none(), INTS))))
        elif op == "commit":
            r = _call(lambda: c.commit(data.draw(st.one_of(st.integers(0, 3), INTS)), seq=seq))
        elif op == "attend":
            q = _array(data, (H, D), "float32")
            kw = {}
            if data.draw(st.booleans()):
                kw["out"] = data.draw(st.sampled_from(["fresh", "one", "transposed", "q"]))
                kw["out"] = {"fresh": np.zeros((H, D), np.float32), "one": np.zeros((1, 1), np.float32),
                             "transposed": np.zeros((D, H), np.float32), "q": q}[kw["out"]]
            if data.draw(st.booleans()):
                kw["scale"] = data.draw(REALS)
            if data.draw(st.integers(0, 3)) == 0:
                kw["alibi_slopes"] = _array(data, (H,), "float32")
                kw["query_position"] = data.draw(INTS)
            r = _call(lambda: c.attend(layer, q, seq=seq, length=data.draw(st.one_of(st.none(), INTS)), **kw))
        elif op == "step":
            qkv = _array(data, (B, (H + 2 * Hkv) * D), "float32")
            out = data.draw(st.sampled_from(["fresh", "bad", "qkv"]))
            out = {"fresh": np.zeros((B, H * D), np.float32), "bad": np.zeros((B, H * D + 1), np.float32),
                   "qkv": qkv}[out]
            slots = np.array([data.draw(st.one_of(st.integers(0, C - 1), INTS)) % 2 ** 63 for _ in range(B)], np.int64)
            kpos = np.array([data.draw(INTS) % 2 ** 63 for _ in range(B)], np.int64) * data.draw(st.sampled_from([0, 1]))
            rngs = [data.draw(st.lists(st.tuples(st.sampled_from([False, True, 3]), INTS, INTS, INTS), min_size=0,
                                       max_size=3) | st.just([(False, 0, int(lens[b]) + 1, 0)]))
                    for b in range(B)]
            kw = {}
            if data.draw(st.booleans()):
                kw["rope"] = (data.draw(st.one_of(st.just(1e4), REALS)), data.draw(st.sampled_from(["gptj", "neox", "x"])),
                              data.draw(st.one_of(st.just(D - D % 2), INTS)))
            if data.draw(st.booleans()):
                kw["alibi_slopes"] = _array(data, (H,), "float32")
            if data.draw(st.booleans()):
                kw["scale"] = data.draw(REALS)
            r = _call(lambda: c.step_attend(layer, qkv, out, slots, kpos, kpos, rngs, **kw))
        elif op == "shift":
            r = _call(lambda: c.shift_range(seq, data.draw(INTS), data.draw(INTS), data.draw(INTS),
                                            data.draw(st.one_of(st.just(1e4), REALS)),
                                            data.draw(st.sampled_from(["gptj", "neox", "bad", None])),
                                            data.draw(st.one_of(st.just(D - D % 2), INTS, st.none())),
                                            inv_freq=_inv_freq(data, D - D % 2, D)))
        elif op == "reset":
            r = _call(lambda: c.reset(data.draw(st.one_of(st.none(), st.integers(0, B - 1), INTS))))
        else:
            r = _call(lambda: c.keys(layer, seq, length=data.draw(st.one_of(st.none(), INTS))))
        if r:
            assert (c.lengths == lens).all()
            now = [c.keys(l, s, length=C) for l in range(L) for s in range(B)] + \
                  [c.values(l, s, length=C) for l in range(L) for s in range(B)]
            for a, b in zip(now, snap):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        refused += r
    del ops, kvsimd
    return min(refused, 1)


def _fuzz_private(data):
    from kvsimd import _kvsimd
    which = data.draw(st.sampled_from(["copy", "mem", "read", "rope_table", "ws", "threads", "peak"]))
    a = _array(data, (data.draw(st.integers(0, 300)),), "uint8")
    b = _array(data, (data.draw(st.integers(0, 300)),), "uint8")
    if which == "copy":
        return _call(lambda: _kvsimd._bench_copy(a, b if data.draw(st.booleans()) else a))
    if which == "mem":
        return _call(lambda: _kvsimd._bench_mem(data.draw(st.sampled_from(["read", "write", "copy", "x"])), a, b,
                                                data.draw(st.one_of(st.integers(1, 3), INTS))))
    if which == "read":
        return _call(lambda: _kvsimd._bench_read(a))
    if which == "rope_table":
        rd = data.draw(INTS)
        return _call(lambda: _kvsimd._rope_table(data.draw(REALS), data.draw(REALS), data.draw(INTS), rd,
                                                 _inv_freq(data, rd, 8), data.draw(st.one_of(st.just(1.0), REALS))))
    if which == "ws":
        return _call(lambda: _kvsimd._attn_workspace_bytes(data.draw(INTS), data.draw(INTS), data.draw(INTS)))
    if which == "peak":
        return _call(lambda: _kvsimd._fma_peak(data.draw(st.sampled_from(["scalar", "avx2", "nope", 3])),
                                               data.draw(st.one_of(st.integers(0, 100), INTS.filter(lambda i: i < 10 ** 4)))))
    before = _kvsimd._get_kernel_threads()
    n = data.draw(st.one_of(st.integers(1, 4), INTS, st.sampled_from([1.0, "2", None, True])))
    r = _call(lambda: _kvsimd._set_kernel_threads(n))
    got = _kvsimd._get_kernel_threads()
    assert got == (before if r else n), (n, got)
    _kvsimd._set_kernel_threads(before)
    return r
