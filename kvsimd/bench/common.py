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
from kvsimd.errors import KVSimdValueError

TEXT_ENV = "KVSIMD_BENCH_TEXT"         # the text file itself
SHARED_ENV = "KVSIMD_SHARED_DIR"       # a folder holding data/hamlet_gut.txt (the team's shared/)
SHARED_TEXT = os.path.join("data", "hamlet_gut.txt")


def text_path(path=None, required=True, environ=None):
    """The text file the quality (and real-model decode) benchmarks read: ``path`` (``--text``),
    else ``$KVSIMD_BENCH_TEXT``, else ``$KVSIMD_SHARED_DIR/data/hamlet_gut.txt``.  None when
    nothing is given and ``required`` is false; otherwise KVSimdValueError, one line naming the
    argument, the variables and the path, when nothing is given or the file is missing."""
    env = os.environ if environ is None else environ
    if path:
        where = "--text %s" % path
    elif env.get(TEXT_ENV):
        path = env[TEXT_ENV]
        where = "%s=%s" % (TEXT_ENV, path)
    elif env.get(SHARED_ENV):
        path = os.path.join(env[SHARED_ENV], SHARED_TEXT)
        where = "%s=%s (read as %s)" % (SHARED_ENV, env[SHARED_ENV], path)
    elif required:
        raise KVSimdValueError("no text file given: pass --text PATH, or set %s=PATH or %s=DIR (a folder "
                               "holding %s)" % (TEXT_ENV, SHARED_ENV, SHARED_TEXT))
    else:
        return None
    if not os.path.isfile(path):
        raise KVSimdValueError("%s: no such file (the text comes from --text PATH, else %s=PATH, else "
                               "%s=DIR/%s)" % (where, TEXT_ENV, SHARED_ENV, SHARED_TEXT))
    return path


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


def empty_aligned(shape, dtype, align=64):
    """An uninitialised array whose data starts on an ``align``-byte boundary (a KVCache's
    storage is 64-byte aligned; a large NumPy array starts 16 bytes into a page)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def like_cache(a):
    """A copy of array a, 64-byte aligned like a KV cache's storage (empty_aligned)."""
    out = empty_aligned(a.shape, a.dtype)
    out[...] = a
    return out


def fill(shape, dtype, seed=0):
    """A large array with realistic values, 64-byte aligned like a KV cache's storage, made
    quickly by tiling a random block."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(1 << 16).astype(dtype)
    out = empty_aligned(shape, dtype)
    flat = out.reshape(-1)
    for i in range(0, flat.size, block.size):
        n = min(block.size, flat.size - i)
        flat[i:i + n] = block[:n]
    return out


def roofline(size=1 << 30, repeat=5):
    """Single-thread streaming read and copy bandwidth (bytes moved / s), beyond the LLC: the
    figures every kernel row is reported against."""
    size = max(size, 4 * llc_bytes())
    src = np.ones(size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    out = {}
    for op in ("read", "copy"):
        _kvsimd._bench_mem(op, dst, src, 1)
        t, _ = time_call(lambda: _kvsimd._bench_mem(op, dst, src, 1), repeat)
        out["%s_GBps" % op] = (2 if op == "copy" else 1) * size / t / 1e9
    out["bytes"] = size
    return out


def roofline_table(size=1 << 30, repeat=5, progress=None):
    """Read, write and copy bandwidth on 1 thread and on every core, beyond the LLC (DRAM) and
    inside it (a buffer of a quarter of the LLC, repeated), plus the fp32 multiply-add peak of
    every supported ISA path (1 thread, and x cores for all threads)."""
    llc = llc_bytes() or (32 << 20)
    cores = os.cpu_count() or 1
    rows = []
    for where, nbytes, reps in (("dram", max(size, 4 * llc), 1), ("llc", llc // 4, 16)):
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.ones(nbytes, dtype=np.uint8)
        for threads in sorted({1, cores}):
            for op in ("read", "write", "copy"):
                def run():
                    for _ in range(reps):
                        _kvsimd._bench_mem(op, dst, src, threads)
                run()
                t, _ = time_call(run, repeat)
                moved = (2 if op == "copy" else 1) * nbytes * reps
                rows.append({"kind": op, "where": where, "threads": threads, "bytes": nbytes, "GBps": moved / t / 1e9})
                if progress:
                    progress(rows[-1])
    for isa in kvsimd.isa_info()["supported"]:
        for threads in sorted({1, cores}):
            rows.append({"kind": "fma", "isa": isa, "threads": threads, "GFLOPs": fma_peak(isa, threads, repeat)})
            if progress:
                progress(rows[-1])
    return rows


def fma_peak(isa, threads, repeat=3):
    """The fp32 multiply-add throughput of row ``isa`` on ``threads`` concurrent threads, GFLOP/s
    (best of ``repeat`` runs of about 0.2 s)."""
    flops, secs = _kvsimd._fma_peak(isa, 1000)
    iters = max(1000, int(1000 * 0.2 / max(secs, 1e-6)))
    best = min(_parallel_peak(isa, iters, threads) for _ in range(repeat))
    return flops / 1000 * iters * threads / best / 1e9


def _parallel_peak(isa, iters, threads):
    """Wall time of ``threads`` concurrent FMA probes (the probe releases the GIL)."""
    import threading
    go = threading.Barrier(threads + 1)

    def work():
        go.wait()
        _kvsimd._fma_peak(isa, iters)
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal): ``tick(label)`` per item."""

    def __init__(self, total, title):
        self.total, self.title, self.n = max(1, total), title, 0
        self.t0 = time.perf_counter()
        self.on = sys.stderr.isatty()

    def tick(self, label=""):
        self.n += 1
        if self.on:
            w = 24
            f = min(w, int(w * self.n / self.total))
            sys.stderr.write("\r%-10s [%s%s] %d/%d %5.0fs %-40s" % (self.title, "#" * f, "." * (w - f), self.n,
                                                                   self.total, time.perf_counter() - self.t0,
                                                                   label[:40]))
            if self.n >= self.total:
                sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def header(out=sys.stdout):
    m = machine()
    print("# kvsimd bench on %s (%d cores, LLC %d MiB), python %s, numpy %s"
          % (m["cpu"], m["cores"], m["llc_bytes"] >> 20, m["python"], m["numpy"]), file=out)
    kvsimd.show_runtime(file=out)
    return m


def versions():
    out = {"python": platform.python_version(), "numpy": np.__version__, "kvsimd": kvsimd.__version__}
    for mod in ("torch", "transformers", "llama_cpp"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


def write_json(path, payload):
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)


def median_ci(x, n_boot=2000, seed=0):
    """Median of x and a 95% bootstrap interval for it."""
    x = np.asarray(x)
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, (n_boot, x.size))], axis=1)
    return float(np.median(x)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))
