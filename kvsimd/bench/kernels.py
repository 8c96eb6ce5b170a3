"""attention and rope (K-cache shift) benchmarks, per ISA path, against the read/copy roofline."""
import numpy as np

from kvsimd import ops
from kvsimd.testing import use_isa

from kvsimd.bench.common import Evictor, fill, llc_bytes, time_call


def bench_attention(isas, shapes, contexts, dtypes, repeat, roof, progress=None):
    """Decode-step attention: one query per head over a [Hkv, N, D] cache, cold caches."""
    rows = []
    evict = Evictor()
    llc = llc_bytes()
    for name, H, Hkv, D in shapes:
        for dtype in dtypes:
            for N in contexts:
                k = fill((Hkv, N, D), dtype, 1)
                v = fill((Hkv, N, D), dtype, 2)
                q = fill((H, D), np.float32, 3)
                out = np.empty((H, D), np.float32)
                nbytes = k.nbytes + v.nbytes
                for isa in isas:
                    with use_isa(isa):
                        ops.attend(q, k, v, out=out)
                        med, best = time_call(lambda: ops.attend(q, k, v, out=out), repeat, setup=evict)
                    gbps = nbytes / med / 1e9
                    rows.append({
                        "op": "attend", "shape": name, "H": H, "Hkv": Hkv, "D": D, "N": N, "dtype": dtype,
                        "isa": isa, "median_s": med, "min_s": best, "bytes": nbytes, "GBps": gbps,
                        "pct_read_roofline": 100.0 * gbps / roof["read_GBps"], "beyond_llc": nbytes > llc,
                    })
                    if progress:
                        progress(rows[-1])
                del k, v
    return rows


def bench_shift(isas, shapes, contexts, dtypes, repeat, roof, progress=None):
    """K-cache shift (shift_keys over the whole cache): bytes moved = read + write of K."""
    rows = []
    evict = Evictor()
    llc = llc_bytes()
    for name, H, Hkv, D in shapes:
        for dtype in dtypes:
            for N in contexts:
                k = fill((Hkv, N, D), dtype, 1)
                nbytes = 2 * k.nbytes
                for isa in isas:
                    with use_isa(isa):
                        ops.shift_keys(k, -1)
                        med, best = time_call(lambda: ops.shift_keys(k, -1), repeat, setup=evict)
                    gbps = nbytes / med / 1e9
                    rows.append({
                        "op": "shift_keys", "shape": name, "Hkv": Hkv, "D": D, "N": N, "dtype": dtype, "isa": isa,
                        "median_s": med, "min_s": best, "bytes": nbytes, "GBps": gbps,
                        "pct_copy_roofline": 100.0 * gbps / roof["copy_GBps"], "beyond_llc": nbytes / 2 > llc,
                    })
                    if progress:
                        progress(rows[-1])
                del k
    return rows
