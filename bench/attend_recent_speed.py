"""What reading a quantized cache's most recent tokens unquantized costs per attention call:
ops.attend over int4 K/V alone against the same call with M float16 rows after them
(``recent=(k, v)``, a second kernel call and the merge of kvsimd.h kv_attend_sources), and with
M float16 rows standing for the last M of the int4 keys (``recent_window=M``, three parts: how
the transformers integration's KVSimdCache(recent=M) reads a decode step).

    python bench/attend_recent_speed.py [--recent 32] [--calls 100] [--threads 1]

Per shape (SmolLM2 9/3/64, GQA 32/8/128) and key count (8,192, 32,768), with and without the
Hadamard turn (the float rows given as a cache stores them): the four calls alternated, K/V
warm; prints the median time of each and the ratios of the paired calls to int4 alone with
their quartiles."""
import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recent", type=int, default=32, help="float16 rows after the int4 ones (default 32)")
    ap.add_argument("--calls", type=int, default=100, help="alternated calls per case (default 100)")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (default 1)")
    args = ap.parse_args()
    if args.recent < 1 or args.calls < 1 or args.threads < 1:
        ap.error("--recent, --calls and --threads must be >= 1")
    import kvsimd
    from kvsimd import ops
    kvsimd.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    M = args.recent
    print("%s, %d thread(s), %d float16 rows after int4 ones" % (kvsimd.isa_info()["active"], args.threads, M))
    for H, Hkv, D in [(9, 3, 64), (32, 8, 128)]:
        for N in (8192, 32768):
            x = rng.standard_normal((2, Hkv, N, D)).astype(np.float32)
            kr, vr = rng.standard_normal((2, Hkv, M, D)).astype(np.float16)
            q = rng.standard_normal((H, D)).astype(np.float32)
            for had in (False, True):
                (kq, ks), (vq, vs) = (ops.quantize_kv(x[i], "int4", hadamard=had) for i in range(2))
                calls = {"int4": lambda: ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=had),
                         "int4 + recent": lambda: ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=had,
                                                             recent=(kr, vr)),
                         "int4 + window": lambda: ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=had,
                                                             recent=(kr, vr), recent_window=M),
                         "recent alone": lambda: ops.attend(q, kr, vr)}
                t = {k: [] for k in calls}
                for _ in range(args.calls):
                    for k, f in calls.items():
                        t0 = time.perf_counter()
                        f()
                        t[k].append(time.perf_counter() - t0)
                ratios = ["%s / int4 %.3f [%.3f, %.3f]" % (k, np.median(r), *np.percentile(r, [25, 75]))
                          for k in ("int4 + recent", "int4 + window")
                          for r in [np.array(t[k]) / np.array(t["int4"])]]
                print("%2d/%d/%-3d N=%-5d hadamard=%-5s %s   %s"
                      % (H, Hkv, D, N, had, "  ".join("%s %.1f us" % (k, 1e6 * np.median(v)) for k, v in t.items()),
                         "  ".join(ratios)))


if __name__ == "__main__":
    main()
