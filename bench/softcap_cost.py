"""What the attention soft cap costs: ``ops.attend`` with ``softcap=50`` beside the same call
without it, in one process, alternating call by call, per ISA row, shape, dtype and context.

    python bench/softcap_cost.py [--isa scalar,avx2,avx512fp16] [--contexts 512,2048,8192] [--repeat 15]

One thread; the same arrays every call (warm caches: the cap's arithmetic shows undiluted by
DRAM time).  Printed per case: the median milliseconds per call of each and the median over
repeats of capped / plain (both timed within the same repeat, so machine load moves both).
Whether the uncapped path got slower is a question for two builds: bench/ab_compare.py."""
import argparse
import time

import numpy as np

import kvsimd
from kvsimd import ops
from kvsimd.bench.cases import ATTN_SHAPES
from kvsimd.testing import use_isa


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", default=",".join(kvsimd.isa_info()["supported"]))
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    kvsimd.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("%-11s %-12s %-7s %6s %10s %10s %8s" % ("isa", "shape", "dtype", "N", "plain ms", "capped ms", "ratio"))
    for isa in args.isa.split(","):
        for name, H, Hkv, D in ATTN_SHAPES:
            for dt in ("float16", "float32"):
                for N in (int(n) for n in args.contexts.split(",")):
                    q = rng.standard_normal((H, D)).astype(np.float32)
                    k = rng.standard_normal((Hkv, N, D)).astype(dt)
                    v = rng.standard_normal((Hkv, N, D)).astype(dt)
                    out = np.empty((H, D), np.float32)
                    inner = max(1, int(2e6 // (Hkv * N * D)))     # calls per timing: >= ~2M K elements
                    times = {None: [], 50.0: []}
                    with use_isa(isa):
                        for r in range(args.repeat):
                            for cap in ((None, 50.0) if r % 2 else (50.0, None)):
                                t0 = time.perf_counter()
                                for _ in range(inner):
                                    ops.attend(q, k, v, out=out, softcap=cap)
                                times[cap].append((time.perf_counter() - t0) / inner)
                    plain, capped = np.array(times[None]), np.array(times[50.0])
                    print("%-11s %-12s %-7s %6d %10.4f %10.4f %8.3f" % (
                        isa, name, dt, N, np.median(plain) * 1e3, np.median(capped) * 1e3,
                        np.median(capped / plain)), flush=True)


if __name__ == "__main__":
    main()
