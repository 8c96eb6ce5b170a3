"""attention and rope (K-cache shift) benchmarks, per ISA path, against the read/copy roofline."""
import statistics
import time

import numpy as np

from kvsimd import ops
from kvsimd.testing import use_isa

from kvsimd.bench.common import Evictor, fill, fma_peak, like_cache, llc_bytes, median_ci


def paired_roofline(kind, nbytes):
    """A plain streaming read (or copy) of ``nbytes`` moved, to time beside a kernel call:
    the same size, started equally cold, in the same seconds of this shared machine."""
    from kvsimd import _kvsimd
    if kind == "read":
        a = np.ones(nbytes, np.uint8)
        return lambda: _kvsimd._bench_mem("read", a, a, 1)
    a, b = np.ones(nbytes // 2, np.uint8), np.ones(nbytes // 2, np.uint8)
    return lambda: _kvsimd._bench_mem("copy", b, a, 1)


def time_paired(call, ref, repeat, evict):
    """Times of ``call`` and of ``ref``, alternated repeat by repeat, each cold: (median call
    seconds, best call seconds, median ref seconds, per-repeat ratios ref / call)."""
    tc, tr = [], []
    for _ in range(repeat):
        for fn, acc in ((call, tc), (ref, tr)):
            evict()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(tc), min(tc), statistics.median(tr), [r / c for r, c in zip(tr, tc)]


def _row(op, impl, name, H, Hkv, D, N, dtype, timing, moved, roof, roof_key, llc, resident):
    """One result row; the % of roofline is the median over repeats of (paired plain read or
    copy time) / (kernel time), with a 95% bootstrap interval: drift between repeats cancels."""
    med, best, ref_s, ratios = timing
    gbps = moved / med / 1e9
    kind = roof_key.split("_")[0]
    pct, lo, hi = median_ci(ratios)
    return {"op": op, "impl": impl, "shape": name, "H": H, "Hkv": Hkv, "D": D, "N": N, "dtype": dtype,
            "median_s": med, "min_s": best, "bytes": moved, "GBps": gbps,
            "paired_%s_GBps" % kind: moved / ref_s / 1e9,
            "pct_%s_roofline" % kind: 100.0 * pct,
            "pct_%s_roofline_ci95" % kind: [100.0 * lo, 100.0 * hi],
            "pct_global_%s_roofline" % kind: 100.0 * gbps / roof[roof_key],
            "beyond_llc": resident > llc}


def _sweep(op, isas, shapes, contexts, dtypes, repeat, roof, make, progress):
    """Time ``make(...)``'s call for every shape x dtype x context x ISA, cold caches, each
    repeat paired with a plain read (or copy) of the same bytes: the % of roofline is kernel
    GB/s over that paired figure.  ``make`` returns (call, bytes moved, bytes resident, key)."""
    rows = []
    evict = Evictor()
    llc = llc_bytes()
    for name, H, Hkv, D in shapes:
        for dtype in dtypes:
            for N in contexts:
                call, moved, resident, roof_key = make(H, Hkv, D, N, dtype)
                ref = paired_roofline(roof_key.split("_")[0], moved)
                for isa in isas:
                    with use_isa(isa):
                        call()
                        timing = time_paired(call, ref, repeat, evict)
                    rows.append(dict(_row(op, "kvsimd", name, H, Hkv, D, N, dtype, timing, moved, roof,
                                          roof_key, llc, resident), isa=isa))
                    if progress:
                        progress(rows[-1])
    return rows


def bench_attention(isas, shapes, contexts, dtypes, repeat, roof, progress=None):
    """Decode-step attention: one query per head over a [Hkv, N, D] cache; bytes = K + V."""
    def make(H, Hkv, D, N, dtype):
        k, v = fill((Hkv, N, D), dtype, 1), fill((Hkv, N, D), dtype, 2)
        q, out = fill((H, D), np.float32, 3), np.empty((H, D), np.float32)
        return (lambda: ops.attend(q, k, v, out=out)), k.nbytes + v.nbytes, k.nbytes + v.nbytes, "read_GBps"
    return _sweep("attend", isas, shapes, contexts, dtypes, repeat, roof, make, progress)


def bench_attention_ceiling(isas, shapes, threads, repeat, tokens=None, progress=None):
    """Decode attention against its own ceiling (rows op "attend-ceiling"): a group of G query
    heads over float16 K/V does 4 G D FLOP per 4 D bytes of K and V -- G FLOP per byte -- so a
    step cannot beat min(read bandwidth, FMA peak / G) GB/s of K+V.  Per shape, row and thread
    count, repeat by repeat, each cold: one call, then a plain streaming read of the same K and V
    arrays on as many threads (the same bytes and pages, in the same seconds of this shared
    machine); pct_ceiling is the median over repeats of the call's GB/s over min(that repeat's
    read, FMA peak / G), with a 95% bootstrap interval, so drift in the memory bandwidth between
    repeats cancels.  The FMA peak is the row's best of three probes on as many threads, taken
    before any call (an FMA probe paired with each call measured up to a third low: OpenMP's
    threads still spin after a call).  read_GBps is the median paired read; times_s and
    read_times_s keep every repeat.  K+V is >= 2x the LLC unless ``tokens`` is given."""
    import kvsimd
    from kvsimd import _kvsimd
    peak = {(isa, nt): fma_peak(isa, nt) for isa in isas for nt in threads}
    llc = llc_bytes() or (32 << 20)
    evict = Evictor()
    rows = []
    before = kvsimd.get_num_threads()
    try:
        for name, H, Hkv, D in shapes:
            G = H // Hkv
            N = tokens or -(-2 * llc // (4 * Hkv * D * 2048)) * 2048
            k, v = fill((Hkv, N, D), np.float16, 1), fill((Hkv, N, D), np.float16, 2)
            q, out = fill((H, D), np.float32, 3), np.empty((H, D), np.float32)
            kb, vb = k.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8)
            nbytes = k.nbytes + v.nbytes
            for isa in isas:
                for nt in threads:
                    kvsimd.set_num_threads(nt)

                    def read(nt=nt):
                        _kvsimd._bench_mem("read", kb, kb, nt)
                        _kvsimd._bench_mem("read", vb, vb, nt)
                    with use_isa(isa):
                        ops.attend(q, k, v, out=out)
                        ts, tr = [], []
                        for _ in range(repeat):
                            for fn, acc in ((lambda: ops.attend(q, k, v, out=out), ts), (read, tr)):
                                evict()
                                t0 = time.perf_counter()
                                fn()
                                acc.append(time.perf_counter() - t0)
                    # per repeat: (call GB/s) / min(paired read GB/s, FMA peak / G)
                    comp = peak[isa, nt] / G
                    pct, lo, hi = median_ci([(nbytes / t / 1e9) / min(nbytes / r / 1e9, comp) for t, r in zip(ts, tr)])
                    med, mem = statistics.median(ts), nbytes / statistics.median(tr) / 1e9
                    rows.append({"op": "attend-ceiling", "impl": "kvsimd", "isa": isa, "shape": name, "H": H,
                                 "Hkv": Hkv, "D": D, "N": N, "dtype": "float16", "threads": nt, "median_s": med,
                                 "GBps": nbytes / med / 1e9, "read_GBps": mem, "fma_GFLOPs": peak[isa, nt],
                                 "ceiling_GBps": min(mem, comp), "pct_ceiling": 100.0 * pct,
                                 "pct_ceiling_ci95": [100.0 * lo, 100.0 * hi],
                                 "binds": "memory" if mem <= comp else "compute", "beyond_llc": nbytes > llc,
                                 "times_s": ts, "read_times_s": tr})
                    if progress:
                        progress(rows[-1])
            del k, v
    finally:
        kvsimd.set_num_threads(before)
    return rows


def bench_attention_quantized(isas, shapes, contexts, threads, repeat, progress=None,
                              dtypes=("int8", "int4", "int8/int4")):
    """Quantized KV caches against float16 (rows op "attend-" + dtype): per shape, N, row and thread
    count, the same keys as float16 and as each of ``dtypes`` (a KVCache dtype: "int8/int4" int8
    keys, int4 values) with block scales (ops.quantize_kv; turned by H when K or V is int4, as
    KVCache stores them), the calls alternated
    repeat by repeat, each cold (the LLC evicted first: what a decode step that streams a cache larger
    than the LLC sees), every array 64-byte aligned as fill's and a cache's are (like_cache).
    ``ratio`` is the median per-repeat quantized / float16 time with a 95% interval; bytes are
    K + V (+ scales) as stored, per token of context."""
    import kvsimd
    evict = Evictor()
    llc = llc_bytes() or (32 << 20)
    rows = []
    before = kvsimd.get_num_threads()
    try:
        for name, H, Hkv, D in shapes:
            for N in contexts:
                k32, v32 = fill((Hkv, N, D), np.float32, 1), fill((Hkv, N, D), np.float32, 2)
                k16, v16 = like_cache(k32.astype(np.float16)), like_cache(v32.astype(np.float16))
                sides = [(dt.split("/") * 2)[:2] for dt in dtypes]
                quant = [tuple(tuple(like_cache(a) for a in ops.quantize_kv(x, dt, hadamard="int4" in (kd, vd)))
                               for x, dt in ((k32, kd), (v32, vd))) for kd, vd in sides]
                del k32, v32
                q, out = fill((H, D), np.float32, 3), np.empty((H, D), np.float32)
                b16 = k16.nbytes + v16.nbytes
                calls = [lambda: ops.attend(q, k16, v16, out=out)]
                nbytes = []
                for (kq, ks), (vq, vs) in quant:
                    calls.append(lambda kq=kq, ks=ks, vq=vq, vs=vs: ops.attend(q, kq, vq, k_scale=ks, v_scale=vs,
                                                                                out=out))
                    nbytes.append(kq.nbytes + vq.nbytes + ks.nbytes + vs.nbytes)
                for isa in isas:
                    for nt in threads:
                        kvsimd.set_num_threads(nt)
                        with use_isa(isa):
                            for c in calls:
                                c()
                            times = [[] for _ in calls]
                            for _ in range(repeat):
                                for c, acc in zip(calls, times):
                                    evict()
                                    t0 = time.perf_counter()
                                    c()
                                    acc.append(time.perf_counter() - t0)
                        t16, m16 = times[0], statistics.median(times[0])
                        for dt, tq, bq in zip(dtypes, times[1:], nbytes):
                            ratio, lo, hi = median_ci([a / b for a, b in zip(tq, t16)])
                            mq = statistics.median(tq)
                            rows.append({"op": "attend-" + dt, "impl": "kvsimd", "isa": isa, "shape": name, "H": H,
                                         "Hkv": Hkv, "D": D, "N": N, "dtype": dt, "threads": nt, "median_s": mq,
                                         "fp16_median_s": m16, "GBps": bq / mq / 1e9, "fp16_GBps": b16 / m16 / 1e9,
                                         "ratio": ratio, "ratio_ci95": [lo, hi], "bytes_per_token": bq // N,
                                         "fp16_bytes_per_token": b16 // N, "beyond_llc": b16 > llc})
                            if progress:
                                progress(rows[-1])
                del k16, v16, quant
    finally:
        kvsimd.set_num_threads(before)
    return rows


def bench_shift(isas, shapes, contexts, dtypes, repeat, roof, progress=None):
    """K-cache shift (shift_keys over the whole cache, in place): bytes = read + write of K."""
    def make(H, Hkv, D, N, dtype):
        k = fill((Hkv, N, D), dtype, 1)
        return (lambda: ops.shift_keys(k, -1)), 2 * k.nbytes, k.nbytes, "copy_GBps"
    return _sweep("shift_keys", isas, shapes, contexts, dtypes, repeat, roof, make, progress)


# ----------------------------------------------------------------------------- peers
def torch_available():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _numpy_attend(q, k, v):
    """Decode attention in NumPy float32 (batched matmuls + softmax), GQA by head groups."""
    Hkv, N, D = k.shape
    G = q.shape[0] // Hkv
    s = np.matmul(q.reshape(Hkv, G, D), k.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(D))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(-1, D)


def attention_peers(H, Hkv, D, N, threads=1):
    """(impl, dtype, call, bytes of K+V it reads) for NumPy float32 and torch SDPA fp32/fp16/bf16."""
    k32, v32 = fill((Hkv, N, D), np.float32, 1), fill((Hkv, N, D), np.float32, 2)
    q = fill((H, D), np.float32, 3)
    out = [("numpy", "float32", lambda: _numpy_attend(q, k32, v32), k32.nbytes + v32.nbytes)]
    if torch_available():
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(threads)
        for name, dt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            tk = torch.from_numpy(k32).to(dt)[None]
            tv = torch.from_numpy(v32).to(dt)[None]
            tq = torch.from_numpy(q).to(dt)[None, :, None, :]

            def call(tq=tq, tk=tk, tv=tv):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=H != Hkv)
            out.append(("torch-sdpa", name, call, tk.nbytes * 2))
    return out


def _rope_cos_sin(D, theta, positions):
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def shift_peers(Hkv, D, N, threads=1):
    """The K-cache shift written the usual way (rotate_half formula, new tensor, copied back):
    NumPy float32 and torch in the cache's dtypes.  (impl, dtype, call, bytes read + written)."""
    k32 = fill((Hkv, N, D), np.float32, 1)
    cos, sin = _rope_cos_sin(D, 1e4, [-1])
    cos, sin = np.concatenate([cos, cos], -1)[0], np.concatenate([sin, sin], -1)[0]
    h = D // 2

    def np_shift():
        rot = np.concatenate([-k32[..., h:], k32[..., :h]], axis=-1)
        k32[...] = k32 * cos + rot * sin
    out = [("numpy", "float32", np_shift, 2 * k32.nbytes)]
    if torch_available():
        import torch
        torch.set_num_threads(threads)
        for name, dt in (("float32", torch.float32), ("float16", torch.float16)):
            tk = torch.from_numpy(k32).to(dt)
            tc, ts = torch.from_numpy(cos).to(dt), torch.from_numpy(sin).to(dt)

            def call(tk=tk, tc=tc, ts=ts):
                with torch.no_grad():
                    rot = torch.cat([-tk[..., h:], tk[..., :h]], dim=-1)
                    tk.copy_(tk * tc + rot * ts)
            out.append(("torch", name, call, 2 * tk.nbytes))
    return out


def bench_peers(kind, shapes, contexts, repeat, roof, threads=1, progress=None):
    """Peers timed like kvsimd's rows (cold caches, median of repeats, paired roofline)."""
    rows = []
    evict = Evictor()
    llc = llc_bytes()
    key = "read_GBps" if kind == "attend" else "copy_GBps"
    for name, H, Hkv, D in shapes:
        for N in contexts:
            peers = attention_peers(H, Hkv, D, N, threads) if kind == "attend" else shift_peers(Hkv, D, N, threads)
            for impl, dtype, call, moved in peers:
                call()
                ref = paired_roofline(key.split("_")[0], moved)
                timing = time_paired(call, ref, repeat, evict)
                rows.append(_row(kind, impl, name, H, Hkv, D, N, dtype, timing, moved, roof, key, llc,
                                 moved if kind == "attend" else moved // 2))
                if progress:
                    progress(rows[-1])
    return rows
