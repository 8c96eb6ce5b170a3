"""Decode speed beside a busy neighbour: ``python -m kvsimd.bench decode --contention``.

A second process spins on one of the cores this process may use (as a neighbour's job would),
and a SmolLM2-shaped decoder with random weights (built here: no transformers needed) takes
single-token steps with 1 thread, with 2 threads, and with kvsimd's default.  The settings
are timed round robin, step by step, so the drift of a shared machine hits them alike; each
is reported as the median over rounds of its step time over the 1-thread step time of the same
round, with a 95% bootstrap interval.  The same is measured without the neighbour for
reference.  Target: the default never more than 10% slower than 1 thread.
"""
import math
import os
import subprocess
import sys
import time

import numpy as np

import kvsimd
from kvsimd import threads as kthreads
from kvsimd.bench.common import median_ci
from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights

# SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 KV heads, head_dim 64, FFN 1536, vocab 49152
SMOLLM2 = dict(vocab=49152, d=576, layers=30, heads=9, kv_heads=3, ffn=1536)


def random_decoder(vocab, d, layers, heads, kv_heads, ffn, seed=0):
    """A Llama-architecture Decoder with random float32 weights of the given shape."""
    rng = np.random.default_rng(seed)
    dh = d // heads

    def r(*s):
        return (rng.standard_normal(s, dtype=np.float32) * np.float32(0.5 / math.sqrt(s[0])))

    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                      head_dim=dh, ffn_dim=ffn, activation="silu", ffn_gated=True, rope_theta=1e5,
                      family="random-llama")
    ones = lambda: NormWeights(np.ones(d, np.float32))  # noqa: E731
    lay = [LayerWeights(AttentionWeights(r(d, heads * dh), r(d, kv_heads * dh), r(d, kv_heads * dh), r(heads * dh, d)),
                        FFNWeights(r(d, ffn), r(ffn, d), r(d, ffn)), ones(), ones()) for _ in range(layers)]
    embed = r(vocab, d)
    return kvsimd.Decoder(cfg, embed, lay, ones(), np.ascontiguousarray(embed.T))


class BusyNeighbour:
    """A process spinning on one core (the last this process may use) until stopped."""

    def __init__(self):
        self.cpu = sorted(os.sched_getaffinity(0))[-1] if hasattr(os, "sched_getaffinity") else None

    def __enter__(self):
        code = ("import os, sys\n"
                "cpu = int(sys.argv[1])\n"
                "if cpu >= 0 and hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {cpu})\n"
                "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
                "while True: pass\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(-1 if self.cpu is None else self.cpu)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.proc.stdout.readline()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def settings():
    """name -> thread count to set before a step (None: kvsimd's default, as at import)."""
    return {"1 thread": 1, "2 threads": 2, "default": None}


def _apply(n):
    if n is None:
        kthreads.use_default_threads()
    else:
        kvsimd.set_num_threads(n)


def _blas_threads():
    """Threads of the BLAS libraries loaded now (the largest, 0 if none is found)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return 0
    with kthreads.blas_scope():      # as inside a decode step
        return max([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] or [0])


def _round_robin(dec, cache, configs, steps, warmup=2):
    """Seconds of each step of each setting, settings in turn (order rotated every round)."""
    tok = [1]
    names = list(configs)
    for name in names * warmup:
        _apply(configs[name])
        dec.step(tok, cache=cache)
    times = {name: [] for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            _apply(configs[name])
            t0 = time.perf_counter()
            dec.step(tok, cache=cache)
            times[name].append(time.perf_counter() - t0)
    return times


def run(contexts=(128, 2048), steps=40, progress=None):
    """Rows: one per (neighbour, context, setting) with tok/s and the paired ratio of its step
    time to the 1-thread step time (``vs_1_thread``, ``vs_1_thread_ci95``)."""
    dec = random_decoder(**SMOLLM2)
    cfg = dec.cfg
    rng = np.random.default_rng(0)
    configs = settings()
    counts = {}
    for name, n in configs.items():      # (kernel, BLAS) threads of each setting
        _apply(n)
        counts[name] = (kvsimd.get_num_threads(), _blas_threads())
    rows = []
    before = kvsimd.get_num_threads()
    try:
        for n_ctx in contexts:
            cache = dec.new_cache(capacity=n_ctx + (steps + 4) * len(configs) * 2 + 8, dtype="float16")
            for layer in range(cfg.n_layers):
                k = rng.standard_normal((cfg.n_kv_heads, n_ctx, cfg.head_dim), dtype=np.float32) * 0.5
                cache.write(layer, k, -k)
            cache.commit(n_ctx)
            for busy in (False, True):
                if busy:
                    with BusyNeighbour():
                        times = _round_robin(dec, cache, configs, steps)
                else:
                    times = _round_robin(dec, cache, configs, steps)
                for name, t in times.items():
                    med, lo, hi = median_ci([a / b for a, b in zip(t, times["1 thread"])])
                    rows.append({"op": "contention", "model": "smollm2-shaped", "context": n_ctx,
                                 "neighbour": "busy core" if busy else "none", "setting": name,
                                 "threads": counts[name][0], "blas_threads": counts[name][1],
                                 "tok_per_s": 1.0 / float(np.median(t)), "vs_1_thread": med,
                                 "vs_1_thread_ci95": [lo, hi], "rounds": len(t),
                                 "available_cores": kthreads.available_cores()})
                    if progress:
                        progress(rows[-1])
    finally:
        kvsimd.set_num_threads(before)
    return rows
