"""The JSON that ``python -m kvsimd.bench --json PATH`` writes, and a checker for it.

    {"schema": 1,
     "header": {"machine": {cpu, cores, llc_bytes, ...}, "versions": {python, numpy, kvsimd, torch?, ...},
                "isa": {compiled, supported, active, forced}, "roofline": {read_GBps, copy_GBps, bytes},
                "argv": [...], "quick": bool, "seconds": float,
                "loadavg": {"start": [1, 5, 15 min], "end": [...]}},
     "results": {<section>: [row, ...], ...}}

Sections and the keys every row has (figures are positive and finite):

* roofline   -- kind ("read" | "write" | "copy" | "fma"), threads, and GBps (memory: where =
                "dram" | "llc") or GFLOPs (fma: isa)
* attention  -- op "attend", impl ("kvsimd" | "numpy" | "torch-sdpa"), shape, H, Hkv, D, N, dtype,
                median_s, GBps, pct_read_roofline (kvsimd rows: isa); op "attend-ceiling" (kvsimd, float16,
                beyond the LLC): isa, threads, read_GBps, fma_GFLOPs, ceiling_GBps, pct_ceiling,
                pct_ceiling_ci95, binds, times_s and read_times_s (each repeat's call and the read of the
                same K and V paired with it); op
                "attend-int8" / "attend-int4" / "attend-int8/int4" (kvsimd, int8 / int4 / int8 keys with int4
                values beside float16, cold): isa, threads, median_s,
                fp16_median_s, GBps, fp16_GBps, ratio (quantized / float16 time), ratio_ci95, bytes_per_token,
                fp16_bytes_per_token
* rope       -- op "shift_keys", impl ("kvsimd" | "numpy" | "torch"), shape, Hkv, D, N, dtype,
                median_s, GBps, pct_copy_roofline
* decode     -- model, impl ("kvsimd" | "transformers" | "weights floor" | "llama.cpp"), context (>= 0),
                threads, tok_per_s; peers also speedup (median per-round ratio of their step to kvsimd's)
                and speedup_ci95.  Runs on GGUF files (decode --model smollm2|llama3-8b|PATH) add weights
                (the file's main tensor type), file, tok_per_s_ci95, steps, rounds, and rows with an op:
                "prefill" (model, impl, tokens, threads, tok_per_s, tok_per_s_ci95; peers speedup),
                "fill" (model, impl, tokens, start, threads, seconds, tok_per_s: the prefill of the tokens a
                decode context adds to the one before, ``start`` tokens),
                "load" (model, impl, load_s, rss_before_MiB, rss_after_MiB, file_MiB: a fresh process,
                warm page cache), "memory" (model, impl, rss_MiB: each process after the run) and
                "peer" (model, impl, status: "not installed", "skipped: ..." or "failed: ...")
* contention -- op "contention", model, context, neighbour ("none" | "busy core"), setting ("1 thread" |
                "2 threads" | "default"), threads, tok_per_s, vs_1_thread (median per-round ratio of the
                setting's step time to the 1-thread step time) and vs_1_thread_ci95, rounds
* complexity -- op "complexity" (regime, N, M, seconds, token_positions), "complexity-fit" (regime,
                time_exponent, positions_exponent) or "complexity-seed003" (regime, token_positions,
                expected)
* streaming  -- op "streaming-memory" (policy, tokens, growth_pct), "streaming-drift" (policy,
                tokens, rel_err) or "streaming-overhead" (policy, capacity, tok_per_s, overhead_pct,
                overhead_ci95_pct [low, high], rounds)
* quality    -- config, scored, ppl_all, ppl_oracle_positions (and "curves" beside "results"); a
                configuration of another cache dtype also vs_float16 (its PPL over float16's, paired
                position by position) and vs_float16_ci95 [low, high]
* hf         -- op "hf-decode" (model, impl ("eager" | "sdpa" | "kvsimd" | "kvsimd-int8"), context, threads, tok_per_s,
                tok_per_s_ci95, steps, rounds; kvsimd rows speedup_vs_sdpa, speedup_vs_eager and their
                _ci95) or "hf-sink" (impl, generated, threads, tok_per_s, tok_per_s_ci95, rss_MiB, cache_bytes)
"""
import math
from typing import Dict, List, Optional

SCHEMA_VERSION = 1


def vs_float16_text(row):
    """A quality row's vs_float16 as text, "+0.40% [+0.15, +0.64]"; "-" for a row without one."""
    if "vs_float16" not in row:
        return "-"
    return "%+.2f%% [%+.2f, %+.2f]" % tuple(100 * (x - 1) for x in [row["vs_float16"]] + list(row["vs_float16_ci95"]))

# section -> op (or None for every row) -> keys that must be present; values in POSITIVE must be > 0
_QUANTIZED_KEYS = ["op", "impl", "isa", "shape", "H", "Hkv", "D", "N", "dtype", "threads", "median_s", "fp16_median_s",
                   "GBps", "fp16_GBps", "ratio", "ratio_ci95", "bytes_per_token", "fp16_bytes_per_token"]
ROW_KEYS: Dict[str, Dict[Optional[str], List[str]]] = {
    "roofline": {None: ["kind", "threads"]},
    "attention": {None: ["op", "impl", "shape", "H", "Hkv", "D", "N", "dtype", "median_s", "GBps",
                         "pct_read_roofline"],
                  "attend-ceiling": ["op", "impl", "isa", "shape", "H", "Hkv", "D", "N", "dtype", "threads",
                                     "median_s", "GBps", "read_GBps", "fma_GFLOPs", "ceiling_GBps", "pct_ceiling",
                                     "pct_ceiling_ci95", "binds", "times_s", "read_times_s"],
                  "attend-int8": _QUANTIZED_KEYS, "attend-int4": _QUANTIZED_KEYS,
                  "attend-int8/int4": _QUANTIZED_KEYS},
    "rope": {None: ["op", "impl", "shape", "Hkv", "D", "N", "dtype", "median_s", "GBps", "pct_copy_roofline"]},
    "decode": {None: ["model", "impl", "context", "threads", "tok_per_s"],
               "prefill": ["model", "impl", "tokens", "threads", "tok_per_s", "tok_per_s_ci95"],
               "fill": ["model", "impl", "tokens", "start", "threads", "seconds", "tok_per_s"],
               "load": ["model", "impl", "load_s", "rss_before_MiB", "rss_after_MiB", "file_MiB"],
               "memory": ["model", "impl", "rss_MiB"],
               "peer": ["model", "impl", "status"]},
    "contention": {None: ["op", "model", "context", "neighbour", "setting", "threads", "tok_per_s", "vs_1_thread",
                          "vs_1_thread_ci95", "rounds"]},
    "complexity": {"complexity": ["regime", "N", "M", "seconds", "token_positions"],
                   "complexity-fit": ["regime", "time_exponent", "positions_exponent"],
                   "complexity-seed003": ["regime", "token_positions", "expected"]},
    "streaming": {"streaming-memory": ["policy", "tokens", "growth_pct"],
                  "streaming-drift": ["policy", "tokens", "rel_err"],
                  "streaming-overhead": ["policy", "capacity", "tok_per_s", "overhead_pct", "overhead_ci95_pct",
                                         "rounds"]},
    "quality": {None: ["config", "scored", "ppl_all", "ppl_oracle_positions"]},
    "hf": {"hf-decode": ["model", "impl", "context", "threads", "tok_per_s", "tok_per_s_ci95", "steps", "rounds"],
           "hf-sink": ["impl", "generated", "threads", "tok_per_s", "tok_per_s_ci95", "rss_MiB", "cache_bytes"]},
}
# the quantized caches' attention rows beside float16 (kernels.bench_attention_quantized)
QUANTIZED_OPS = tuple(op for op in ROW_KEYS["attention"] if op is not None and op.startswith("attend-int"))
POSITIVE = {"threads", "H", "Hkv", "D", "N", "median_s", "GBps", "GFLOPs", "pct_read_roofline", "read_GBps",
            "fma_GFLOPs", "ceiling_GBps", "pct_ceiling", "fp16_median_s", "fp16_GBps", "ratio", "bytes_per_token",
            "fp16_bytes_per_token",
            "pct_copy_roofline", "tok_per_s", "load_s", "rss_after_MiB", "file_MiB", "rss_MiB", "M", "seconds",
            "token_positions", "tokens", "capacity", "time_exponent", "expected", "ppl_oracle_positions", "scored",
            "vs_1_thread", "rounds", "generated", "cache_bytes", "steps", "vs_float16"}
NONNEGATIVE = {"context", "start"}
FINITE = POSITIVE | NONNEGATIVE | {"growth_pct", "overhead_pct", "rel_err", "positions_exponent"}


def validate(doc):
    """Raise ValueError naming the first thing in ``doc`` that breaks the schema."""
    if doc.get("schema") != SCHEMA_VERSION:
        raise ValueError("schema must be %d, got %r" % (SCHEMA_VERSION, doc.get("schema")))
    head = doc.get("header")
    if not isinstance(head, dict):
        raise ValueError("header missing")
    for key in ("machine", "versions", "isa", "roofline", "argv"):
        if key not in head:
            raise ValueError("header.%s missing" % key)
    for key in ("read_GBps", "copy_GBps"):
        v = head["roofline"].get(key)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError("header.roofline.%s must be positive, got %r" % (key, v))
    res = doc.get("results")
    if not isinstance(res, dict) or not res:
        raise ValueError("results missing or empty")
    for section, rows in res.items():
        if section not in ROW_KEYS:
            raise ValueError("unknown section %r" % section)
        if not isinstance(rows, list) or not rows:
            raise ValueError("section %r has no rows" % section)
        for i, row in enumerate(rows):
            spec = ROW_KEYS[section]
            op = row.get("op")
            keys = spec[op] if op in spec else spec.get(None)
            if keys is None:
                raise ValueError("%s[%d]: unknown op %r" % (section, i, op))
            for k in keys:
                if k not in row:
                    raise ValueError("%s[%d]: key %r missing" % (section, i, k))
            if section == "roofline" and not ("GBps" in row or "GFLOPs" in row):
                raise ValueError("roofline[%d]: needs GBps or GFLOPs" % i)
            for k, v in row.items():
                if k in FINITE and isinstance(v, (int, float)) and not isinstance(v, bool):
                    if not math.isfinite(v) or (k in POSITIVE and v <= 0) or (k in NONNEGATIVE and v < 0):
                        raise ValueError("%s[%d]: %s = %r is not %s" % (
                            section, i, k, v, "positive" if k in POSITIVE else "non-negative" if k in NONNEGATIVE
                            else "finite"))
    return True
