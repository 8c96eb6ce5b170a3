"""Speed of the weight kernels: y[B, n] = x[B, k] . W through ``QMatrix.matmul``, per weight type,
shape, rows of x, ISA row and thread count, against the machine's read bandwidth.

    python bench/gemv_speed.py [--types q4_0,q8_0] [--shapes smol,8b] [--B 1,2,4,8]
                               [--isa avx2,avx512fp16] [--threads 1,2] [--repeat 5]
                               [--where dram|llc] [--json PATH] [--compare OLD.json]

Decode is the stream of the weights, so what matters is how close a product comes to reading
its weight bytes at the read bandwidth.  For each case the weights are laid out as M distinct
matrices in one buffer (M chosen so the buffer is at least twice the last-level cache with
``--where dram``, the default; a quarter of it with ``--where llc``); one timed pass multiplies
x into every matrix in turn, so each call starts with its weights out of cache (dram) or in
the LLC (llc).  Beside every pass the same buffer is read once by kvsimd's own read probe
(``_kvsimd._bench_mem("read", ...)``, the roofline of ``python -m kvsimd.bench``) on the same
thread count: "%rd" is the median over passes of (read time / product time), so the load of a
shared machine moves both alike.  Printed per case: weight GB/s (weight bytes / median seconds
per call), %rd, GFLOP/s (2 B k n / seconds) and microseconds per call (which include about
1.7 us of Python call overhead: it matters only for the smallest matrices).

Weights: f32 raw, f16/bf16/q8_0/q4_0/q4_1 from ``gguf.quants.quantize`` of normal values,
the k-quants random bytes with small finite fp16 scales (the speed does not depend on the
values).  A pool of up to 256 quantized rows is tiled to fill the buffer.  A dev script: it
checks one product per case against float64 on the dequantized weights, never asserts speed.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

try:
    import kvsimd
except ImportError:   # run from a source checkout built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kvsimd
from kvsimd import _kvsimd as ext
from kvsimd.bench.common import llc_bytes
from kvsimd.testing import use_isa

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"]
# (group, label, k, n): y[B, n] = x[B, k] . W, W stored as n rows of k values
SHAPES = [
    ("smol", "576x1536", 576, 1536),      # SmolLM2-135M: gate/up
    ("smol", "1536x576", 1536, 576),      # down
    ("smol", "576x49152", 576, 49152),    # LM head
    ("8b", "4096x14336", 4096, 14336),    # Llama-3-8B: gate/up
    ("8b", "14336x4096", 14336, 4096),    # down
]
POOL_ROWS = 256


def weights(wtype, k, rows, rng):
    """``rows`` rows of k values of type ``wtype`` as uint8 [rows, row_bytes]."""
    import gguf
    from gguf.quants import quantize
    info = ext.weight_types()[wtype]
    if wtype in ("q4_k", "q5_k", "q6_k"):
        nb = k // 256
        blk = rng.integers(0, 256, (rows, nb, info["block_bytes"]), dtype=np.uint8)
        h = rng.uniform(0.001, 0.01, (rows, nb, 2)).astype(np.float16).view(np.uint8).reshape(rows, nb, 4)
        if wtype == "q6_k":
            blk[:, :, 208:210] = h[:, :, :2]
        else:
            blk[:, :, 0:4] = h
        return blk.reshape(rows, -1)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if wtype == "f32":
        return x.view(np.uint8)
    raw = quantize(x, gguf.GGMLQuantizationType(info["ggml_type"]))
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


class Case:
    """M copies of one [n, k] matrix of type wtype, laid end to end in one 64-byte aligned buffer."""

    def __init__(self, wtype, k, n, target, rng):
        pool = weights(wtype, k, min(n, POOL_ROWS), rng)
        self.row_bytes = pool.shape[1]
        self.nbytes = n * self.row_bytes
        self.count = max(1, math.ceil(target / self.nbytes))
        total = self.count * self.nbytes
        raw = np.empty(total + 64, np.uint8)
        off = (-raw.ctypes.data) % 64
        self.buf = raw[off:off + total]
        rows = self.buf.reshape(self.count * n, self.row_bytes)
        for r0 in range(0, rows.shape[0], pool.shape[0]):
            m = min(pool.shape[0], rows.shape[0] - r0)
            rows[r0:r0 + m] = pool[:m]
        self.mats = [ext.QMatrix(self.buf[i * self.nbytes:(i + 1) * self.nbytes], wtype, (n, k))
                     for i in range(self.count)]
        self.wtype, self.k, self.n = wtype, k, n


def run_case(case, B, threads, repeat, rng):
    """(seconds per call: median, %read: median over passes of read time / product time)."""
    x = rng.standard_normal((B, case.k)).astype(np.float32)
    out = np.empty((B, case.n), np.float32)
    ext._set_kernel_threads(threads)
    mats = case.mats

    def one_pass():
        for m in mats:
            m.matmul(x, out=out)
    one_pass()   # warm-up (and the LLC case's fill)
    ext._bench_mem("read", case.buf, case.buf, threads)
    t_mm, ratios = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        one_pass()
        t1 = time.perf_counter()
        ext._bench_mem("read", case.buf, case.buf, threads)
        t2 = time.perf_counter()
        t_mm.append((t1 - t0) / len(mats))
        ratios.append((t2 - t1) / (t1 - t0))
    # check once: the last matrix against float64 math on its dequantized weights
    w = mats[-1].dequantize().astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    scale = (np.abs(x).astype(np.float64) @ np.abs(w).T).max()
    err = float(np.abs(out - ref).max() / max(scale, 1e-300))
    if not err < 1e-5:
        raise AssertionError("%s k=%d n=%d B=%d: relative error %.3g" % (case.wtype, case.k, case.n, B, err))
    return statistics.median(t_mm), statistics.median(ratios)


def read_bandwidth(threads, size):
    buf = np.ones(size, np.uint8)
    ext._bench_mem("read", buf, buf, threads)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        ext._bench_mem("read", buf, buf, threads)
        ts.append(time.perf_counter() - t0)
    return size / statistics.median(ts) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", default="smol,8b", help="groups (smol, 8b) or labels (576x1536, ...)")
    ap.add_argument("--B", default="1,2,4,8")
    ap.add_argument("--isa", default=None, help="default: the supported rows other than scalar")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--where", choices=("dram", "llc"), default="dram")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", default=None, help="a --json file of an earlier run: print new/old GB/s")
    a = ap.parse_args(argv)
    types = a.types.split(",")
    wanted = a.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in wanted or s[1] in wanted]
    Bs = [int(b) for b in a.B.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    isas = a.isa.split(",") if a.isa else [i for i in ext.isa_info()["supported"] if i != "scalar"]
    llc = llc_bytes() or (32 << 20)
    target = 2 * llc if a.where == "dram" else llc // 4
    rng = np.random.default_rng(0)
    old = {}
    if a.compare:
        with open(a.compare) as fh:
            for r in json.load(fh)["rows"]:
                old[(r["type"], r["shape"], r["B"], r["isa"], r["threads"])] = r
    bw = {t: read_bandwidth(t, max(1 << 30, 4 * llc)) for t in threads}
    print("# %s, LLC %d MiB, rotation buffer >= %d MiB (%s); read bandwidth %s"
          % (kvsimd.bench.common.cpu_name(), llc >> 20, target >> 20, a.where,
             ", ".join("%d thread(s) %.1f GB/s" % (t, g) for t, g in bw.items())))
    hdr = "%-5s %-11s %2s %-10s %2s %8s %5s %8s %9s" % ("type", "shape", "B", "isa", "th", "GB/s", "%rd",
                                                        "GFLOP/s", "us/call")
    print(hdr + ("   new/old" if old else ""))
    rows = []
    for wtype in types:
        for group, label, k, n in shapes:
            block = ext.weight_types()[wtype]["block"]
            if k % block:
                print("%-5s %-11s    (k = %d is not a whole number of %s blocks of %d: no such matrix)"
                      % (wtype, label, k, wtype, block), flush=True)
                continue
            case = Case(wtype, k, n, target, rng)
            for isa in isas:
                with use_isa(isa):
                    for t in threads:
                        for B in Bs:
                            sec, ratio = run_case(case, B, t, a.repeat, rng)
                            r = {"type": wtype, "shape": label, "k": k, "n": n, "B": B, "isa": isa, "threads": t,
                                 "bytes": case.nbytes, "matrices": case.count, "seconds": sec,
                                 "GBps": case.nbytes / sec / 1e9, "read_ratio": ratio,
                                 "GFLOPs": 2.0 * B * k * n / sec / 1e9}
                            rows.append(r)
                            line = "%-5s %-11s %2d %-10s %2d %8.2f %4.0f%% %8.1f %9.1f" % (
                                wtype, label, B, isa, t, r["GBps"], 100 * ratio, r["GFLOPs"], sec * 1e6)
                            o = old.get((wtype, label, B, isa, t))
                            if o:
                                line += "   %5.2fx" % (r["GBps"] / o["GBps"])
                            print(line, flush=True)
            del case
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"machine": kvsimd.bench.common.cpu_name(), "llc_bytes": llc, "where": a.where,
                       "read_GBps": {str(t): g for t, g in bw.items()}, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
