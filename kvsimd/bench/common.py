"""Timing, machine description and the memory roofline."""
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import kvsimd
from kvsimd import _kvsimd


def llc_bytes():
    """Size of the last-level cache, from sysfs (0 if unknown)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            try:
                with open(os.path.join(base, idx, "size")) as fh:
                    s = fh.read().strip()
                with open(os.path.join(base, idx, "type")) as fh:
                    if fh.read().strip() == "Instruction":
                        continue
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
    except OSError:
        pass
    return best


def cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine():
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "llc_bytes": llc_bytes(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kvsimd": kvsimd.__version__,
        "isa": kvsimd.isa_info(),
    }


class Evictor:
    """Streams a buffer of 2x the LLC through the cache so the next timed call starts cold."""

    def __init__(self):
        n = max(2 * llc_bytes(), 64 << 20)
        self.buf = np.ones(n, dtype=np.uint8)

    def __call__(self):
        _kvsimd._bench_read(self.buf)


def time_call(fn, repeat, setup=None):
    """Median and min wall time of ``fn()`` over ``repeat`` runs (``setup()`` untimed before each)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def fill(shape, dtype, seed=0):
    """A large array with realistic values, made quickly by tiling a random block."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(1 << 16).astype(dtype)
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for i in range(0, flat.size, block.size):
        n = min(block.size, flat.size - i)
        flat[i:i + n] = block[:n]
    return out


def roofline(size=1 << 30, repeat=5):
    """Single-thread streaming read and copy bandwidth (bytes moved / s), beyond the LLC."""
    size = max(size, 4 * llc_bytes())
    src = np.ones(size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    _kvsimd._bench_read(src)
    _kvsimd._bench_copy(dst, src)
    t_read, _ = time_call(lambda: _kvsimd._bench_read(src), repeat)
    t_copy, _ = time_call(lambda: _kvsimd._bench_copy(dst, src), repeat)
    return {"read_GBps": size / t_read / 1e9, "copy_GBps": 2 * size / t_copy / 1e9, "bytes": size}


def header(out=sys.stdout):
    m = machine()
    print("# kvsimd bench on %s (%d cores, LLC %d MiB), python %s, numpy %s"
          % (m["cpu"], m["cores"], m["llc_bytes"] >> 20, m["python"], m["numpy"]), file=out)
    kvsimd.show_runtime(file=out)
    return m


def write_json(path, payload):
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
