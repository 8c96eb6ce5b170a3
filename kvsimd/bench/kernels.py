"""attention and rope (K-cache shift) benchmarks, per ISA path, against the read/copy roofline."""
import numpy as np

from kvsimd import ops
from kvsimd.testing import use_isa

from kvsimd.bench.common import Evictor, fill, llc_bytes, time_call


def _sweep(op, isas, shapes, contexts, dtypes, repeat, roof, make, progress):
    """Time ``make(...)``'s call for every shape x dtype x context x ISA, cold caches.
    ``make`` returns (call, bytes moved, bytes resident, roofline key)."""
    rows = []
    evict = Evictor()
    llc = llc_bytes()
    for name, H, Hkv, D in shapes:
        for dtype in dtypes:
            for N in contexts:
                call, moved, resident, roof_key = make(H, Hkv, D, N, dtype)
                for isa in isas:
                    with use_isa(isa):
                        call()
                        med, best = time_call(call, repeat, setup=evict)
                    gbps = moved / med / 1e9
                    rows.append({"op": op, "shape": name, "H": H, "Hkv": Hkv, "D": D, "N": N, "dtype": dtype,
                                 "isa": isa, "median_s": med, "min_s": best, "bytes": moved, "GBps": gbps,
                                 "pct_%s_roofline" % roof_key.split("_")[0]: 100.0 * gbps / roof[roof_key],
                                 "beyond_llc": resident > llc})
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


def bench_shift(isas, shapes, contexts, dtypes, repeat, roof, progress=None):
    """K-cache shift (shift_keys over the whole cache, in place): bytes = read + write of K."""
    def make(H, Hkv, D, N, dtype):
        k = fill((Hkv, N, D), dtype, 1)
        return (lambda: ops.shift_keys(k, -1)), 2 * k.nbytes, k.nbytes, "copy_GBps"
    return _sweep("shift_keys", isas, shapes, contexts, dtypes, repeat, roof, make, progress)
