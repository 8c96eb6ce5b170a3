"""Decode attention against its own ceiling, per ISA row and thread count (issue 19's measure).

    python bench/attention_ceiling.py [--tokens N] [--repeat 9] [--threads 1 --threads 2] [--isa ...]

A group of G query heads over fp16 K/V does 4 G D FLOP per 4 D bytes of K and V, G FLOP per
byte, so a decode step's attention cannot beat min(read bandwidth, FMA peak / G) GB/s of K+V.
This prints, for each shape (the issue's five), row and thread count, the kernel's GB/s
(median of cold calls: caches evicted before each), the two ceilings measured in the same run
(the read bandwidth of `threads` threads beyond the LLC, the row's fp32 multiply-add peak x
threads, both from kvsimd.bench.common), the % of the lower one and which one binds.  K/V sizes
are chosen beyond the LLC (at least 2x) unless --tokens is given."""
import argparse
import statistics
import time

import numpy as np

import kvsimd
from kvsimd import _kvsimd, ops
from kvsimd.bench import common
from kvsimd.testing import use_isa

SHAPES = [("mha", 32, 32, 128), ("gqa4", 32, 8, 128), ("g8", 64, 8, 128), ("smollm2", 9, 3, 64),
          ("mqa", 32, 1, 128)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=0, help="keys per head (default: K+V >= 2x the LLC)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, action="append")
    ap.add_argument("--isa", action="append", help="rows (default: every row this CPU runs but scalar)")
    a = ap.parse_args()
    threads = a.threads or [1, 2]
    isas = a.isa or [i for i in kvsimd.isa_info()["supported"] if i != "scalar"]
    llc = common.llc_bytes() or (32 << 20)
    print("%s, LLC %d MiB" % (common.cpu_name(), llc >> 20), flush=True)
    evict = common.Evictor()
    size = max(1 << 30, 4 * llc)
    src = np.ones(size, np.uint8)
    read = {}
    for nt in threads:
        _kvsimd._bench_mem("read", src, src, nt)
        t, _ = common.time_call(lambda: _kvsimd._bench_mem("read", src, src, nt), 5)
        read[nt] = size / t / 1e9
    del src
    peak = {}
    for isa in isas:
        flops, secs = _kvsimd._fma_peak(isa, 1000)
        iters = max(1000, int(1000 * 0.2 / max(secs, 1e-6)))
        for nt in threads:
            best = min(common._parallel_peak(isa, iters, nt) for _ in range(3))
            peak[isa, nt] = flops / 1000 * iters * nt / best / 1e9
    for nt in threads:
        print("read beyond the LLC, %d thread(s): %.2f GB/s; fp32 FMA peak: %s" % (
            nt, read[nt], ", ".join("%s %.0f GFLOP/s" % (i, peak[i, nt]) for i in isas)), flush=True)
    print("%-8s %-11s %6s %-11s %3s %9s %8s %9s %8s %-8s" % ("shape", "H/Hkv/D", "N", "row", "thr", "ms", "GB/s",
                                                            "ceiling", "% ceil", "binds"))
    before = kvsimd.get_num_threads()
    for name, H, Hkv, D in SHAPES:
        G = H // Hkv
        N = a.tokens or -(-2 * llc // (4 * Hkv * D * 2048)) * 2048   # K + V >= 2x the LLC
        k, v = common.fill((Hkv, N, D), np.float16, 1), common.fill((Hkv, N, D), np.float16, 2)
        q, out = common.fill((H, D), np.float32, 3), np.empty((H, D), np.float32)
        nbytes = k.nbytes + v.nbytes
        for isa in isas:
            for nt in threads:
                kvsimd.set_num_threads(nt)
                with use_isa(isa):
                    ops.attend(q, k, v, out=out)
                    ts = []
                    for _ in range(a.repeat):
                        evict()
                        t0 = time.perf_counter()
                        ops.attend(q, k, v, out=out)
                        ts.append(time.perf_counter() - t0)
                med = statistics.median(ts)
                gbps = nbytes / med / 1e9
                mem, comp = read[nt], peak[isa, nt] / G
                ceil = min(mem, comp)
                print("%-8s %-11s %6d %-11s %3d %9.3f %8.2f %9.2f %7.1f%% %-8s" % (
                    name, "%d/%d/%d" % (H, Hkv, D), N, isa, nt, med * 1e3, gbps, ceil, 100 * gbps / ceil,
                    "memory" if mem <= comp else "compute"), flush=True)
        del k, v
    kvsimd.set_num_threads(before)


if __name__ == "__main__":
    main()
