"""Infinite generation: memory stays flat, and the policies cost little per step.

* memory: RSS of a process that generates 10^6 tokens with a tiny model, after 10^4 and 10^6;
* overhead: decode tok/s with a full cache under each policy against the same cache size in
  fixed mode, on the SmolLM2-shaped model (random weights).  A shift event (rotating the kept
  window of every layer) happens once per n_discard steps: its time is measured on its own and
  amortized over those steps.
"""
import os
import statistics
import time

import numpy as np

import kvsimd
from kvsimd.bench.common import median_ci
from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights


def rss_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tiny_decoder(seed=0, d=32, H=4, Hkv=2, vocab=64, layers=1):
    rng = np.random.default_rng(seed)
    Dh = d // H
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=H, n_kv_heads=Hkv, head_dim=Dh,
                      ffn_dim=64, ffn_gated=True, position="rope", rope_style="gptj", family="tiny")
    lw = [LayerWeights(AttentionWeights(r(d, H * Dh), r(d, Hkv * Dh), r(d, Hkv * Dh), r(H * Dh, d)),
                       FFNWeights(r(d, 64), r(64, d), r(d, 64)), NormWeights(1 + r(d)), NormWeights(1 + r(d)))
          for _ in range(layers)]
    return kvsimd.Decoder(cfg, embed=r(vocab, d), layers=lw, final_norm=NormWeights(1 + r(d)), lm_head=r(d, vocab))


def bench_memory(policy, n_tokens=10**6, checkpoints=(10**4,), capacity=256, progress=None):
    dec = tiny_decoder()
    cache = dec.new_cache(capacity=capacity, n_keep=4, policy=policy)
    dec.prefill([1, 2, 3, 4, 5], cache=cache)
    rss = {}
    t0 = time.perf_counter()
    tok = [7]
    marks = set(checkpoints) | {n_tokens}
    for i in range(1, n_tokens + 1):
        logits = dec.step(tok, cache=cache)[0]
        tok = [int(np.argmax(logits))]
        if i in marks:
            rss[i] = rss_bytes()
            if progress:
                progress({"policy": policy, "tokens": i, "rss_MiB": rss[i] / 2**20,
                          "seconds": time.perf_counter() - t0})
    first = min(checkpoints)
    return {"op": "streaming-memory", "policy": policy, "capacity": capacity, "tokens": n_tokens,
            "rss_first": rss[first], "rss_last": rss[n_tokens], "first": first,
            "growth_pct": 100.0 * (rss[n_tokens] - rss[first]) / rss[first]}


def _step_times(dec, cache, n, hold=False):
    """n timed steps; hold=True undoes each step's token afterwards (untimed), so a fixed
    cache attends over the same number of tokens at every step."""
    times, tok = [], [1]
    for _ in range(n):
        if not hold:
            t0 = time.perf_counter()
            dec.step(tok, cache=cache)
            times.append(time.perf_counter() - t0)
            continue
        try:
            with cache.transaction():     # the cache's own rollback undoes the step
                t0 = time.perf_counter()
                dec.step(tok, cache=cache)
                times.append(time.perf_counter() - t0)
                raise _Undo
        except _Undo:
            pass
    return times


class _Undo(Exception):
    """Raised inside a cache transaction to roll a timed step back."""


def bench_overhead(capacities=(256, 2048, 8192), steps=24, progress=None):
    from kvsimd.bench.decode import SHAPES, _hf_model
    spec = dict(SHAPES["smollm2-shaped"], name="smollm2-shaped")
    dec = kvsimd.Decoder.from_transformers(_hf_model(spec))
    cfg = dec.cfg
    rng = np.random.default_rng(0)
    rows = []
    for cap in capacities:
        kv = [(rng.standard_normal((cfg.n_kv_heads, cap, cfg.head_dim)).astype(np.float32) * 0.5,
               rng.standard_normal((cfg.n_kv_heads, cap, cfg.head_dim)).astype(np.float32) * 0.5)
              for _ in range(cfg.n_layers)]

        def filled(policy, n, capacity=cap):
            c = dec.new_cache(capacity=capacity, n_keep=4, policy=policy)
            # a prefill's bookkeeping (positions, tokens) with random K/V instead of the layers'
            plan = c.begin_prefill(0, np.ones(n, np.int64), rope=dec.rope, n_heads=cfg.n_heads)
            for layer, (k, v) in enumerate(kv):
                c.write(layer, np.ascontiguousarray(k[:, :n]), np.ascontiguousarray(v[:, :n]))
            c.end_prefill(plan)
            return c

        res = {}
        # fixed: cap - 1 tokens, each timed step adds the cap-th and is then undone, so every
        # step attends over exactly the cap tokens that a full ring holds
        caches = {"fixed": filled("fixed", cap - 1)}
        for pol in ("sink_query", "shift", "reevaluate"):
            caches[pol] = filled(pol, cap)
        # shift/reevaluate: the step that finds the window full discards (and rotates, or
        # recomputes); time it alone, then amortize it over the n_discard steps it buys
        events = {pol: _step_times(dec, caches[pol], 1)[0] for pol in ("shift", "reevaluate")}
        _step_times(dec, caches["sink_query"], 1)   # warm-up
        _step_times(dec, caches["fixed"], 1, hold=True)
        # steady state, interleaved step by step so that drift of this shared machine cancels
        times = {pol: [] for pol in caches}
        order = list(caches)
        for i in range(steps):
            for pol in order[i % len(order):] + order[:i % len(order)]:   # rotate who goes first
                times[pol] += _step_times(dec, caches[pol], 1, hold=pol == "fixed")
        # per-round ratios to the fixed cache's step of the same round: drift of this shared
        # machine between rounds cancels; the median of the ratios is the steady-state overhead
        ratio = {pol: median_ci([t / f for t, f in zip(times[pol], times["fixed"])]) for pol in caches}
        for pol in caches:
            res[pol] = statistics.median(times[pol])
        for pol, ev in events.items():
            amort = max(0.0, ev - res[pol]) / caches[pol].n_discard
            ratio[pol] = tuple(x + amort / res["fixed"] for x in ratio[pol])
            res[pol] += amort
        res["shift_event_s"] = events["shift"]
        for pol in ("fixed", "sink_query", "shift", "reevaluate"):
            med, lo, hi = ratio[pol]
            rows.append({"op": "streaming-overhead", "policy": pol, "capacity": cap, "tok_per_s": 1.0 / res[pol],
                         "overhead_pct": 100.0 * (med - 1.0), "overhead_ci95_pct": [100.0 * (lo - 1.0), 100.0 * (hi - 1.0)],
                         "rounds": steps,
                         **({"event_ms": res["shift_event_s"] * 1e3} if pol == "shift" else {})})
            if progress:
                progress(rows[-1])
    return rows


def bench_drift(policy, n_tokens=10**5, checkpoints=(10**3, 10**4, 10**5), dtype="float16", progress=None):
    """Logits of a long infinite generation against a fresh prefill of exactly the kept tokens
    (one-layer model, where the two must agree): the error must not grow with the length."""
    dec = tiny_decoder(seed=3)
    cache = dec.new_cache(capacity=256, n_keep=4, policy=policy, dtype=dtype)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, dec.cfg.vocab_size, n_tokens)
    logits = dec.prefill(list(toks[:8]), cache=cache)
    out = []
    for i in range(8, n_tokens):
        logits = dec.step([int(toks[i])], cache=cache)[0]
        if i + 1 in checkpoints:
            ref_cache = dec.new_cache(capacity=len(cache.tokens[0]) + 1, dtype="float32")
            ref = dec.prefill(cache.tokens[0], cache=ref_cache)
            err = float(np.abs(logits - ref).max() / np.abs(ref).max())
            out.append({"op": "streaming-drift", "policy": policy, "dtype": dtype, "tokens": i + 1,
                        "rel_err": err, "max_rotations": int(cache.rotations.max())})
            if progress:
                progress(out[-1])
    return out
