"""Decode attention in the cache, row beside row: the compute side of the kernel without DRAM.

    python bench/attn_rows_l2.py [--isa NAME ...] [--shape H/Hkv/D/N ...] [--rounds 5] [--threads 1]
                                 [--dtype float16|int8|int4]

``python -m kvsimd.bench attention`` measures decode attention beyond the LLC, where the memory and
the kernel's arithmetic are hard to tell apart.  This times one ``ops.attend`` call (one query row,
float16 K/V) over K/V small enough to stay in the caches (warm: the same arrays call after call), for
every compiled row this CPU runs (or --isa), the rows alternated round by round: per shape and row
the median over rounds of each round's median of 15 calls, as GFLOP/s (4 H D N per call) and as %
of the row's fp32 multiply-add peak on as many threads (kvsimd.bench.common.fma_peak).  ``--dtype
int8`` or ``int4``: K/V as a cache of that dtype stores them (ops.quantize_kv, the same values; int4
turned by H), the scales counted in the MiB shown.  Default
shapes: MHA 32/32/128 and 16/16/64, G = 3 9/3/128 and SmolLM2 9/3/64, GQA 32/8/128, G = 8 64/8/128,
MQA 32/1/128, each at a context whose K+V is 2-4 MiB."""
import argparse
import statistics
import time

import numpy as np

def positive(text):
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1, got %r" % text)
    return n


def shape(text):
    """argparse type: H/Hkv/D/N, four integers >= 1 with K+V under 1 GiB (this is an in-cache bench)."""
    parts = text.split("/")
    try:
        dims = [positive(x) for x in parts]
    except argparse.ArgumentTypeError:
        dims = []
    if len(dims) != 4:
        raise argparse.ArgumentTypeError("must be H/Hkv/D/N, four integers >= 1, got %r" % text)
    if 4 * dims[1] * dims[2] * dims[3] > 1 << 30:
        raise argparse.ArgumentTypeError("K+V of %r is over 1 GiB: this bench times K/V that stay in the caches" % text)
    return tuple(dims)


SHAPES = ["32/32/128/256", "16/16/64/1024", "9/3/128/1024", "9/3/64/2048", "32/8/128/1024", "64/8/128/1024",
          "32/1/128/4096"]


def main():
    import kvsimd
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", action="append", help="rows to time (default: every row this CPU runs)")
    ap.add_argument("--shape", action="append", type=shape, help="H/Hkv/D/N (default: %s)" % ", ".join(SHAPES))
    ap.add_argument("--rounds", type=positive, default=5)
    ap.add_argument("--threads", type=positive, default=1)
    ap.add_argument("--dtype", choices=("float16", "int8", "int4"), default="float16",
                    help="K/V as stored (default float16; int4 turned by the Hadamard matrix, as an int4 cache does)")
    args = ap.parse_args()
    try:
        run(args)
    except kvsimd.KVSimdError as e:   # a row this CPU lacks, a shape kvsimd refuses: one line, no traceback
        ap.exit(2, "%s: %s\n" % (ap.prog, e))


def run(args):
    import kvsimd
    from kvsimd import ops
    from kvsimd.bench.common import fill, fma_peak
    from kvsimd.testing import use_isa
    isas = args.isa or [i for i in kvsimd.isa_info()["supported"] if i != "scalar"]
    kvsimd.set_num_threads(args.threads)
    peak = {isa: fma_peak(isa, args.threads) for isa in isas}
    print("# %s, %d thread(s), %s K/V; fp32 FMA peak %s" % (kvsimd.__version__, args.threads, args.dtype,
                                                          ", ".join("%s %.1f GFLOP/s" % (i, peak[i]) for i in isas)))
    for H, Hkv, D, N in args.shape or [shape(x) for x in SHAPES]:
        spec = "%d/%d/%d/%d" % (H, Hkv, D, N)
        k, v = fill((Hkv, N, D), np.float16, 1), fill((Hkv, N, D), np.float16, 2)
        kw, nbytes = {}, k.nbytes + v.nbytes
        if args.dtype != "float16":      # as a cache of that dtype stores them: int4 turned by H
            turn = args.dtype == "int4"
            (k, ks), (v, vs) = (ops.quantize_kv(x.astype(np.float32), args.dtype, hadamard=turn) for x in (k, v))
            kw, nbytes = dict(k_scale=ks, v_scale=vs, hadamard=turn), k.nbytes + v.nbytes + ks.nbytes + vs.nbytes
        q, out = fill((H, D), np.float32, 3), np.empty((H, D), np.float32)
        med = {isa: [] for isa in isas}
        for r in range(args.rounds):
            for isa in (isas if r % 2 == 0 else isas[::-1]):
                with use_isa(isa):
                    ops.attend(q, k, v, out=out, **kw)
                    ts = []
                    for _ in range(15):
                        t0 = time.perf_counter()
                        ops.attend(q, k, v, out=out, **kw)
                        ts.append(time.perf_counter() - t0)
                med[isa].append(statistics.median(ts))
        flop = 4.0 * H * D * N
        print("%-16s K+V %5.2f MiB  " % (spec, nbytes / 2 ** 20) + "  ".join(
            "%s %6.1f GFLOP/s (%4.1f%%)" % (isa, flop / statistics.median(med[isa]) / 1e9,
                                            100 * flop / statistics.median(med[isa]) / 1e9 / peak[isa])
            for isa in isas), flush=True)


if __name__ == "__main__":
    main()
