"""python -m kvsimd.bench [roofline|attention|rope|decode|complexity|streaming|quality|hf] [options]

decode --contention: decode speed with 1 thread, 2 threads and kvsimd's default thread counts
beside a process spinning on one core (and without it), as paired ratios to 1 thread.

With no subcommand: an overview of roofline, attention, rope, decode, complexity and streaming
(about ten minutes; add --quick for a smoke run).  --json writes the schema of
kvsimd.bench.schema; --plot DIR writes PNG charts (needs matplotlib: pip install -e ".[plot]"
from the source checkout), after the JSON.

decode --model smollm2|llama3-8b|PATH: GGUF files as stored, kvsimd beside llama.cpp
(llama-cpp-python, "not installed" without it: pip install -e ".[peers]") and transformers, each
in its own process: load time and RSS, prefill of prompts of 128, 512, 4096 and 8192 tokens
(--prefill-tokens), decode at context depths
(--depth), 1 and 2 threads; ratios paired round by round, medians with 95% intervals.

hf: transformers' own SmolLM2 (float32 weights) with kvsimd's attention and cache
(kvsimd.integrations.transformers) beside stock eager and SDPA with DynamicCache, decode at context
depths (--depth, default 128, 4096, 8192), 1 and 2 threads; then generate with KVSimdSinkCache for
--sink-tokens new tokens (default 100,000; 0 = skip) and its tok/s at 10^3, 10^4 and 10^5.

quality (and decode of a GGUF model) read a text: --text PATH, else $KVSIMD_BENCH_TEXT, else
$KVSIMD_SHARED_DIR/data/hamlet_gut.txt (quality needs one; decode falls back to a built-in
filler, since decode speed does not depend on the words)."""
import argparse
import os
import sys
import time

import numpy as np

import kvsimd
from kvsimd import _kvsimd
from kvsimd.bench import cases, common, kernels
from kvsimd.errors import KVSimdError
from kvsimd.bench.schema import SCHEMA_VERSION

SUBCOMMANDS = ("roofline", "attention", "rope", "decode", "complexity", "streaming", "quality", "hf")
OVERVIEW = ("roofline", "attention", "rope", "decode", "complexity", "streaming")


def _fmt_kernel(r):
    key = "pct_read_roofline" if "pct_read_roofline" in r else "pct_copy_roofline"
    who = r.get("isa", r["impl"]) if r["impl"] == "kvsimd" else r["impl"]
    return ("%-10s %-12s %-8s N=%-6d %-10s %9.3f ms %7.2f GB/s %5.1f%% of %s"
            % (r["op"], r["shape"], r["dtype"], r["N"], who, r["median_s"] * 1e3, r["GBps"], r[key],
               key.split("_")[1]))


def _fmt_ceiling(r):
    return ("attend     %-12s %-8s N=%-7d %-10s threads=%d %9.3f ms %7.2f GB/s  ceiling %.2f GB/s (%s) %5.1f%% "
            "[%.1f, %.1f]" % (r["shape"], r["dtype"], r["N"], r["isa"], r["threads"], r["median_s"] * 1e3, r["GBps"],
                              r["ceiling_GBps"], r["binds"], r["pct_ceiling"], *r["pct_ceiling_ci95"]))


def _fmt_quantized(r):
    return ("attend     %-12s %-8s N=%-7d %-10s threads=%d %9.3f ms (float16 %.3f ms) %7.2f GB/s  "
            "%s/fp16 time %.3f [%.3f, %.3f]"
            % (r["shape"], r["dtype"], r["N"], r["isa"], r["threads"], r["median_s"] * 1e3, r["fp16_median_s"] * 1e3,
               r["GBps"], r["dtype"], r["ratio"], r["ratio_ci95"][0], r["ratio_ci95"][1]))


def run_roofline(args, roof):
    rows = common.roofline_table(size=(256 << 20) if args.quick else (1 << 30), repeat=args.repeat or 3)
    for r in rows:
        if r["kind"] == "fma":
            print("roofline   fp32 multiply-add  %-10s threads=%d %8.1f GFLOP/s" % (r["isa"], r["threads"], r["GFLOPs"]))
        else:
            print("roofline   %-5s %-4s threads=%d %8.2f GB/s" % (r["kind"], r["where"], r["threads"], r["GBps"]))
    return rows


def _kernel_section(args, roof, isas, op):
    shapes = cases.ATTN_SHAPES[:1] if args.quick else cases.ATTN_SHAPES
    contexts = cases.QUICK_CONTEXTS if args.quick else cases.CONTEXTS
    repeat = args.repeat or (3 if args.quick else 5)
    threads = (args.threads or [1])[0]
    kvsimd.set_num_threads(threads)
    n = len(shapes) * len(contexts)
    bar = common.Progress(n * len(cases.DTYPES) * len(isas) + n, op)

    def show(r):
        bar.tick("%s %s N=%d" % (r["shape"], r["dtype"], r["N"]))
        print(_fmt_kernel(r), flush=True)
    if op == "attention":
        rows = kernels.bench_attention(isas, shapes, contexts, cases.DTYPES, repeat, roof, show)
        peers = kernels.bench_peers("attend", shapes, contexts, repeat, roof, threads,
                                    lambda r: print(_fmt_kernel(r), flush=True))
        # every row and thread count against min(read bandwidth, FMA peak / G); quick: small, one shape
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        peers += kernels.bench_attention_ceiling(
            isas, cases.CEILING_SHAPES[-1:] if args.quick else cases.CEILING_SHAPES,
            sorted(set(args.threads or [1, cores])), 3 if args.quick else max(repeat, 7),
            tokens=4096 if args.quick else None, progress=lambda r: print(_fmt_ceiling(r), flush=True))
        # the int8 and int4 caches beside float16, same keys, cold, alternated
        peers += kernels.bench_attention_quantized(
            isas, cases.ATTN_SHAPES[:1] if args.quick else cases.INT8_SHAPES,
            cases.QUICK_CONTEXTS[-1:] if args.quick else cases.INT8_CONTEXTS, sorted(set(args.threads or [1, cores])),
            3 if args.quick else max(repeat, 9), progress=lambda r: print(_fmt_quantized(r), flush=True))
    else:
        rows = kernels.bench_shift(isas, shapes, contexts, cases.DTYPES, repeat, roof, show)
        peers = kernels.bench_peers("shift_keys", shapes, contexts, repeat, roof, threads,
                                    lambda r: print(_fmt_kernel(r), flush=True))
    return rows + peers


def _gguf_models(args):
    """(label, path) of the GGUF files --model names, and the default depths."""
    from kvsimd.bench import models
    if args.model == "smollm2":
        return [("smollm2 " + w, models.smollm2_variant(w)) for w in models.SMOLLM2_WEIGHTS], [0, 4096, 8192]
    if args.model == "llama3-8b":
        return [("llama3-8b-shaped", models.llama3_8b_shaped())], [0, 4096]
    name = os.path.basename(args.model)
    return [(name[:-5] if name.endswith(".gguf") else name, args.model)], [0, 4096]


def _show_gguf(r):
    who = "%-10s %-12s" % (r["impl"], r.get("isa", r.get("version", "")))
    if r.get("op") == "peer":
        print("decode     %-22s %-12s %s%s" % (r["model"], r["impl"], r["status"],
                                              "  (%s)" % r["hint"] if r.get("hint") else ""), flush=True)
        return
    if r.get("op") == "load":
        print("load       %-22s %s %6.2f s   RSS %7.1f -> %7.1f MiB (%+.1f; file %.1f MiB)"
              % (r["model"], who, r["load_s"], r["rss_before_MiB"], r["rss_after_MiB"], r["rss_delta_MiB"],
                 r["file_MiB"]), flush=True)
        return
    if r.get("op") == "fill":
        print("fill       %-22s %5d tokens after %-5d threads=%d %s %8.1f tok/s (%.1f s)"
              % (r["model"], r["tokens"], r["start"], r["threads"], who, r["tok_per_s"], r["seconds"]), flush=True)
        return
    if r.get("op") == "memory":
        print("memory     %-22s %-10s RSS after the run %.1f MiB (peak %.1f)"
              % (r["model"], r["impl"], r["rss_MiB"], r["rss_peak_MiB"]), flush=True)
        return
    what = "prefill %d tokens" % r["tokens"] if r.get("op") == "prefill" else "context=%-5d" % r["context"]
    ratio = ""
    if "speedup" in r:
        ratio = "   kvsimd / %s = %.2fx [%.2f, %.2f]" % (r["impl"], r["speedup"], *r["speedup_ci95"])
    print("%-10s %-22s %-18s threads=%d %s %8.1f tok/s [%.1f, %.1f]%s"
          % ("prefill" if r.get("op") == "prefill" else "decode", r["model"], what, r["threads"], who,
             r["tok_per_s"], r["tok_per_s_ci95"][0], r["tok_per_s_ci95"][1], ratio), flush=True)


def run_decode(args, roof):
    from kvsimd.bench import decode
    threads = args.threads or [1, 2]
    steps = 4 if args.quick else 24

    def show(r):
        print("decode     %-15s context=%-5d threads=%d %-13s %8.1f tok/s%s"
              % (r["model"], r["context"], r["threads"], r["impl"], r["tok_per_s"],
                 "   prefill %.1f tok/s" % r["prefill_tok_per_s"] if "prefill_tok_per_s" in r else ""), flush=True)
    if args.model != "shapes":
        models, depths = _gguf_models(args)
        if args.depth:
            depths = args.depth
        elif args.quick:
            depths = [0, 64]
        prefill = args.prefill_tokens
        if prefill is None:
            prefill = [64] if args.quick else [128, 512, 4096, 8192] if args.model == "smollm2" else []
        return decode.bench_gguf(models, depths, threads, steps=args.steps or (4 if args.quick else 8),
                                 rounds=args.repeat or (3 if args.quick else 8), progress=_show_gguf,
                                 text_path=args.text, prefill_tokens=prefill,
                                 prefill_repeat=2 if args.quick else 5, load_repeat=1 if args.quick else 3,
                                 fill=args.fill, flash_attn=args.llama_flash_attn,
                                 peers=decode.GGUF_PEERS + (decode.KV_INT8_PEERS if args.kv_int8 else ()) +
                                       (decode.KV_INT4_PEERS if args.kv_int4 else ()) +
                                       tuple("kvsimd-int4+%d" % r for r in args.kv_recent or ()))
    rows = decode.run([128] if args.quick else [128, 2048, 8192], threads, steps, show,
                      models=("smollm2-shaped",) if args.quick else None)
    ratios = {}
    for r in rows:
        ratios.setdefault((r["model"], r["context"], r["threads"]), {})[r["impl"]] = r["tok_per_s"]
    for key, v in ratios.items():
        if "transformers" in v:
            print("decode     %-15s context=%-5d threads=%d kvsimd / transformers = %.2fx"
                  % (key + (v["kvsimd"] / v["transformers"],)))
        if "transformers" in v and "weights floor" in v:
            print("decode     %-15s context=%-5d threads=%d kvsimd at %.0f%% of the weight-streaming floor; "
                  "the floor itself is %.2fx transformers"
                  % (key + (100 * v["kvsimd"] / v["weights floor"], v["weights floor"] / v["transformers"])))
    return rows


def run_complexity(args, roof):
    from kvsimd.bench import complexity
    ms = (10, 20, 40, 80) if args.quick else (25, 50, 100, 200, 400, 1000)

    def show(r):
        if r["op"] == "complexity":
            print("complexity %-8s N=%-5d M=%-5d %9.3f s  %9d token positions"
                  % (r["regime"], r["N"], r["M"], r["seconds"], r["token_positions"]), flush=True)
        elif r["op"] == "complexity-fit":
            print("complexity %-8s fitted exponent over M=%d..%d: time ~ M^%.2f, token positions ~ M^%.2f"
                  % (r["regime"], r["M_range"][0], r["M_range"][1], r["time_exponent"], r["positions_exponent"]))
        else:
            print("complexity %-8s N=1024 M=100: %d token positions (seed 003: %d)%s"
                  % (r["regime"], r["token_positions"], r["expected"],
                     "" if r["token_positions"] == r["expected"] else "  MISMATCH"), flush=True)
    return complexity.run(ms=ms, n_src=32 if args.quick else 64, progress=show)


def run_streaming(args, roof):
    from kvsimd.bench import streaming
    rows = []
    n = 2 * 10**4 if args.quick else (10**5 if args.overview else 10**6)
    first = 10**3 if args.quick else 10**4
    for pol in ("sink_query", "shift"):
        r = streaming.bench_memory(pol, n_tokens=n, checkpoints=(first,), progress=lambda r: print(
            "streaming  memory   %-10s after %8d tokens: RSS %.1f MiB (%.0f s)"
            % (r["policy"], r["tokens"], r["rss_MiB"], r["seconds"]), flush=True))
        print("streaming  memory   %-10s RSS growth from %d to %d tokens: %+.2f%%"
              % (pol, r["first"], r["tokens"], r["growth_pct"]), flush=True)
        rows.append(r)
    far = 2 * 10**3 if args.quick else (10**4 if args.overview else 10**5)
    for pol in ("shift", "sink_query"):
        rows += streaming.bench_drift(pol, n_tokens=far, checkpoints=tuple(c for c in (10**3, 10**4, 10**5) if c <= far)
                                      + ((far,) if far not in (10**3, 10**4, 10**5) else ()), progress=lambda r: print(
            "streaming  drift    %-10s %s after %6d tokens: logits within %.2e of a fresh prefill (max %d rotations)"
            % (r["policy"], r["dtype"], r["tokens"], r["rel_err"], r["max_rotations"]), flush=True))
    rows += streaming.bench_overhead((256,) if args.quick else (256, 2048, 8192), steps=6 if args.quick else 200,
                                     progress=lambda r: print(
        "streaming  overhead capacity=%-5d %-10s %6.1f tok/s  %+6.2f%% vs fixed%s"
        % (r["capacity"], r["policy"], r["tok_per_s"], r["overhead_pct"],
           "  (one shift event: %.1f ms)" % r["event_ms"] if "event_ms" in r else ""), flush=True))
    return rows


def _quality_tokens(args):
    """Scored positions of the quality run (it reads one token more from the text)."""
    return 256 if args.quick else 2304


def run_quality(args, roof):
    from kvsimd.bench import quality
    rows, curves = quality.main(n_tokens=_quality_tokens(args), windows=(64,) if args.quick else (256, 512),
                                oracle_every=args.oracle_every, text_path=args.text,
                                dtypes=tuple(args.kv_dtype or ("float16",)))
    for r in rows:
        print("quality  %-32s PPL all %-8.3f PPL on oracle positions %.3f (%d scored)"
              % (r["config"], r["ppl_all"], r["ppl_oracle_positions"], r["scored"]))
    args.extra["curves"] = {k: [None if not np.isfinite(x) else round(float(x), 5) for x in v]
                            for k, v in curves.items()}
    return rows


def _show_hf(r):
    if r["op"] == "hf-sink":
        print("hf sink    %-8s generated=%-7d threads=%d %8.1f tok/s [%.1f, %.1f]   RSS %.1f MiB, cache %d bytes"
              % (r.get("how", ""), r["generated"], r["threads"], r["tok_per_s"], *r["tok_per_s_ci95"], r["rss_MiB"], r["cache_bytes"]),
              flush=True)
        return
    extra = ""
    if r["impl"].startswith("kvsimd"):
        extra = "   x%.2f [%.2f, %.2f] vs sdpa, x%.2f vs eager" % (r["speedup_vs_sdpa"], *r["speedup_vs_sdpa_ci95"],
                                                                  r["speedup_vs_eager"])
    print("hf decode  context=%-5d threads=%d %-7s %8.1f tok/s [%.1f, %.1f]%s"
          % (r["context"], r["threads"], r["impl"], r["tok_per_s"], *r["tok_per_s_ci95"], extra), flush=True)


def run_hf(args, roof):
    from kvsimd.bench import hf
    depths = args.depth or ([64] if args.quick else list(hf.DEPTHS))
    sink = args.sink_tokens if args.sink_tokens is not None else (300 if args.quick else hf.SINK_MARKS[-1])
    return hf.run([d for d in depths if d > 0], args.threads or [1, 2], steps=args.steps or (3 if args.quick else 8),
                  rounds=args.repeat or (2 if args.quick else 6), sink_tokens=sink, text_path=args.text,
                  progress=_show_hf)


def run_contention(args, roof):
    from kvsimd.bench import contention

    def show(r):
        print("contention %-15s context=%-5d neighbour=%-9s %-9s (%d threads) %7.1f tok/s  step time %.3f x "
              "1 thread [%.3f, %.3f]" % (r["model"], r["context"], r["neighbour"], r["setting"], r["threads"],
                                          r["tok_per_s"], r["vs_1_thread"], *r["vs_1_thread_ci95"]), flush=True)
    return contention.run(contexts=(128,) if args.quick else (128, 2048, 8192), steps=6 if args.quick else 60,
                          progress=show)


RUNNERS = {"roofline": run_roofline, "attention": lambda a, r: _kernel_section(a, r, a.isas, "attention"),
           "rope": lambda a, r: _kernel_section(a, r, a.isas, "rope"), "decode": run_decode,
           "complexity": run_complexity, "streaming": run_streaming, "quality": run_quality,
           "contention": run_contention, "hf": run_hf}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default=None, choices=SUBCOMMANDS,
                    help="one benchmark (default: an overview of all but quality)")
    ap.add_argument("--isa", action="append", help="ISA path(s) for attention/rope (default: every supported one)")
    ap.add_argument("--threads", type=int, action="append",
                    help="thread count(s): decode runs each (default 1 and 2); kernels use the first (default 1)")
    ap.add_argument("--repeat", type=int, default=None, help="timed repeats per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="small cases, few repeats (each subcommand < 1 min)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON (see kvsimd.bench.schema)")
    ap.add_argument("--plot", metavar="DIR", help='write PNG charts into DIR (needs matplotlib: pip install -e ".[plot]")')
    ap.add_argument("--model", default="shapes", metavar="shapes|smollm2|llama3-8b|PATH",
                    help="decode: random models of SmolLM2/BART shape (float32 weights, beside transformers); "
                         "or GGUF files as stored, beside llama.cpp and transformers: smollm2 (the real SmolLM2 "
                         "Q4_1 and its Q8_0/F16 variants), llama3-8b (random weights of Llama-3-8B's shapes, "
                         "Q4_0, ~4.5 GB, built into the model cache when missing) or the PATH of a GGUF file")
    ap.add_argument("--depth", type=int, action="append",
                    help="decode of a GGUF model: context depth(s) (default 0, 4096, 8192 for smollm2; 0 and "
                         "4096 otherwise)")
    ap.add_argument("--steps", type=int, help="decode of a GGUF model: greedy steps per round (default 8; "
                    "--repeat rounds, default 8)")
    ap.add_argument("--prefill-tokens", type=int, metavar="N", action="append",
                    help="decode of a GGUF model: a prompt length of the prefill measurement, repeatable (default "
                         "128, 512, 4096 and 8192 for smollm2, none for other models: their context fills are "
                         "reported as prefill figures; 0 = none)")
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                    help="decode of a GGUF model: kvsimd's context, the prompt prefilled (default) or random K/V "
                         "of the same length (llama.cpp and transformers always prefill)")
    from kvsimd.bench.quality import _kind_arg
    ap.add_argument("--kv-dtype", action="append", type=_kind_arg, metavar="KIND",
                    help="quality: the KV-cache kind(s) every configuration runs with (default float16; the "
                         "first one also runs the oracle): float16, float32, int8, int4, int8/int4, int4-plain "
                         "(int4 without the Hadamard turn), or a quantized one with +R (its last R tokens' "
                         "float16 rows kept and read as well, e.g. int4+32)")
    ap.add_argument("--kv-int8", action="store_true",
                    help="decode of a GGUF model: also kvsimd with an int8 KV cache and llama.cpp with q8_0 K/V "
                         "(flash attention), side by side with the float16 caches")
    ap.add_argument("--kv-int4", action="store_true",
                    help="decode of a GGUF model: also kvsimd with an int4 KV cache and one of int8 keys with int4 "
                         "values (both turned by the Hadamard matrix), "
                         "side by side with the float16 caches")
    ap.add_argument("--kv-recent", type=int, action="append", metavar="R",
                    help="decode of a GGUF model: also kvsimd with an int4 KV cache that keeps its last R "
                         "tokens' float16 rows (KVCache(recent=R), read for each query's last R keys), "
                         "repeatable")
    ap.add_argument("--llama-flash-attn", action="store_true",
                    help="decode of a GGUF model: llama.cpp with flash attention (default: off, "
                         "llama-cpp-python's default)")
    ap.add_argument("--contention", action="store_true",
                    help="decode: 1 thread, 2 threads and the default beside a process spinning on one core "
                         "(random SmolLM2-shaped model; results in the 'contention' section)")
    ap.add_argument("--text", metavar="PATH",
                    help="quality, decode --model smollm2: the text to read (default: $%s, else $%s/%s)"
                         % (common.TEXT_ENV, common.SHARED_ENV, common.SHARED_TEXT))
    ap.add_argument("--sink-tokens", type=int, metavar="N",
                    help="hf: tokens generate runs with KVSimdSinkCache (default 100000; 0 = skip)")
    ap.add_argument("--oracle-every", type=int, default=8, metavar="K",
                    help="quality: score the re-prefill oracle on every K-th position (1 = all; default 8)")
    args = ap.parse_args(argv)

    supported = kvsimd.isa_info()["supported"]
    args.isas = args.isa or supported
    for isa in args.isas:
        if isa not in supported:
            ap.error("ISA %r is not supported here (supported: %s)" % (isa, ", ".join(supported)))
    if any(not 1 <= t <= _kvsimd.MAX_THREADS for t in args.threads or []):
        ap.error("--threads must be in 1..%d" % _kvsimd.MAX_THREADS)
    if args.repeat is not None and args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error("--json %s: its directory does not exist" % args.json)
    if args.json and os.path.isdir(args.json):      # else found only when the results are written, after the run
        ap.error("--json %s: a directory (give the path of the file to write)" % args.json)
    if args.plot and os.path.exists(args.plot) and not os.path.isdir(args.plot):
        ap.error("--plot %s: not a directory" % args.plot)
    if args.sink_tokens is not None and (args.what != "hf" or args.sink_tokens < 0):
        ap.error("--sink-tokens (>= 0) goes with the hf subcommand")
    if args.model != "shapes" and (args.what != "decode" or args.contention):
        ap.error("--model goes with the decode subcommand (not --contention)")
    if args.model not in ("shapes", "smollm2", "llama3-8b"):
        if os.path.isdir(args.model):
            ap.error("--model %s: a directory, not a GGUF file" % args.model)
        if not os.path.isfile(args.model):
            ap.error("--model %s: no such file (give shapes, smollm2, llama3-8b or the path of a GGUF file)"
                     % args.model)
        from kvsimd.loaders.gguf import open_gguf
        try:       # its header, metadata and tensor directory (no tensor data): a fraction of a second
            open_gguf(args.model).close()
        except KVSimdError as e:
            ap.error("--model %s: not a GGUF file kvsimd reads: %s" % (args.model, e))
    if any(d < 0 for d in args.depth or []) or (args.steps is not None and args.steps < 1) or \
            min(args.prefill_tokens or [0]) < 0:
        ap.error("--depth and --prefill-tokens must be >= 0, --steps >= 1")
    if args.kv_dtype and args.what != "quality":     # decode would silently time float16 caches only
        ap.error("--kv-dtype goes with the quality subcommand (decode of a GGUF model takes --kv-int8 and --kv-int4)")
    if (args.kv_int8 or args.kv_int4 or args.kv_recent) and (args.what != "decode" or args.model == "shapes" or
                                                             args.contention):
        ap.error("--kv-int8, --kv-int4 and --kv-recent go with decode of a GGUF model (--model smollm2, llama3-8b or "
                 "a path)")
    if any(r < 1 for r in args.kv_recent or ()):
        ap.error("--kv-recent must be >= 1")
    if args.contention and args.what != "decode":
        ap.error("--contention goes with the decode subcommand: python -m kvsimd.bench decode --contention")
    wants_text = args.what in ("quality", "hf") or (args.what == "decode" and args.model != "shapes"
                                                    and not args.contention)
    if args.text and not wants_text:
        ap.error("--text goes with quality or decode --model smollm2 (or another GGUF model)")
    try:       # before anything runs: a missing text is one line and exit 2, not a traceback later
        args.text = common.text_path(args.text, required=args.what == "quality") if wants_text else None
        if args.what == "quality":      # and long enough for the run (its tokenizer alone, about a second)
            from kvsimd.bench import quality
            quality.check_text(args.text, _quality_tokens(args))
    except KVSimdError as e:
        print("python -m kvsimd.bench: error: %s" % e, file=sys.stderr)
        return 2
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
    args.overview = args.what is None
    args.extra = {}
    sections = OVERVIEW if args.overview else ("contention",) if args.contention else (args.what,)

    t_start = time.perf_counter()
    load_start = os.getloadavg()      # a shared machine: what else ran is part of the record
    machine = common.header()
    roof = common.roofline(size=(256 << 20) if args.quick else (1 << 30), repeat=3 if args.quick else 5)
    print("roofline (1 thread, beyond LLC): read %.2f GB/s, copy %.2f GB/s (read+write bytes)"
          % (roof["read_GBps"], roof["copy_GBps"]), flush=True)
    results = {}
    for section in sections:
        print("## %s" % section, flush=True)
        results[section] = RUNNERS[section](args, roof)
    doc = {"schema": SCHEMA_VERSION,
           "header": {"machine": machine, "versions": common.versions(), "isa": kvsimd.isa_info(),
                      "roofline": roof, "argv": list(sys.argv[1:] if argv is None else argv), "quick": args.quick,
                      "seconds": time.perf_counter() - t_start,
                      "loadavg": {"start": list(load_start), "end": list(os.getloadavg())}},
           "results": results}
    doc.update(args.extra)
    if args.json:      # first: whatever happens to the charts, the run is kept
        common.write_json(args.json, doc)
    if args.plot:
        from kvsimd.bench import plots
        try:
            for path in plots.write_all(doc, args.plot):
                print("plot: %s" % path)
        except plots.PlotUnavailable as e:
            print("kvsimd.bench: %s%s" % (e, "; the results are in %s" % args.json if args.json else ""),
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
