"""python -m kvsimd.bench [roofline|attention|rope] [--isa NAME] [--repeat N] [--quick] [--json PATH]"""
import argparse
import sys

import numpy as np

import kvsimd
from kvsimd.bench import cases, common, kernels


def _fmt_attn(r):
    extra = "%5.1f%% of read" % r["pct_read_roofline"] if "pct_read_roofline" in r else \
        "%5.1f%% of copy" % r["pct_copy_roofline"]
    return ("%-10s %-12s %-7s N=%-6d %-10s %9.3f ms %7.2f GB/s  %s%s"
            % (r["op"], r["shape"], r["dtype"], r["N"], r["isa"], r["median_s"] * 1e3, r["GBps"], extra,
               "" if r["beyond_llc"] else "  (fits in LLC)"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench", description=__doc__)
    ap.add_argument("what", nargs="?", default="all", choices=["all", "roofline", "attention", "rope", "decode", "streaming", "quality"])
    ap.add_argument("--plot", metavar="DIR", help="quality: write a PNG of running NLL against position here")
    ap.add_argument("--threads", type=int, action="append", help="thread counts for decode (default: 1 and 2)")
    ap.add_argument("--model", choices=["shapes", "smollm2"], default="shapes",
                    help="decode: random models of SmolLM2/BART shape, or the real SmolLM2 GGUF")
    ap.add_argument("--isa", action="append", help="ISA path(s) to run (default: every supported one)")
    ap.add_argument("--repeat", type=int, default=None, help="timed repeats per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="small contexts only, few repeats")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--oracle-every", type=int, default=8, metavar="K",
                    help="quality: score the re-prefill oracle on every K-th position (1 = all; default 8)")
    args = ap.parse_args(argv)

    supported = kvsimd.isa_info()["supported"]
    isas = args.isa or supported
    for isa in isas:
        if isa not in supported:
            ap.error("ISA %r is not supported here (supported: %s)" % (isa, ", ".join(supported)))
    repeat = args.repeat or (3 if args.quick else 7)
    contexts = cases.QUICK_CONTEXTS if args.quick else cases.CONTEXTS

    machine = common.header()
    roof = common.roofline(size=(256 << 20) if args.quick else (1 << 30), repeat=3 if args.quick else 5)
    print("roofline (1 thread, beyond LLC): read %.2f GB/s, copy %.2f GB/s (read+write bytes)"
          % (roof["read_GBps"], roof["copy_GBps"]))
    results = {"machine": machine, "roofline": roof, "rows": []}

    def show(r):
        print(_fmt_attn(r), flush=True)

    if args.what in ("all", "attention"):
        results["rows"] += kernels.bench_attention(isas, cases.ATTN_SHAPES, contexts, cases.DTYPES, repeat, roof, show)
    if args.what in ("all", "rope"):
        results["rows"] += kernels.bench_shift(isas, cases.ATTN_SHAPES, contexts, cases.DTYPES, repeat, roof, show)
    if args.what in ("all", "decode"):
        from kvsimd.bench import decode
        ctx = [128, 2048] if args.quick else [128, 2048, 8192]
        show = lambda r: print("decode     %-15s context=%-5d threads=%d %-12s %8.1f tok/s%s"  # noqa: E731
                               % (r["model"], r["context"], r["threads"], r["impl"], r["tok_per_s"],
                                  "   prefill %.1f tok/s" % r["prefill_tok_per_s"] if "prefill_tok_per_s" in r else ""),
                               flush=True)
        if args.model == "smollm2":
            import os
            text = os.path.join(os.path.dirname(os.path.abspath(kvsimd.__file__)), "..", "..", "shared", "data",
                                "hamlet_gut.txt")
            rows = decode.bench_smollm2([128] if args.quick else [128, 4096], args.threads or [1, 2],
                                        4 if args.quick else 16, show, text)
        else:
            rows = decode.run(ctx, args.threads or [1, 2], 4 if args.quick else 16, show)
        results["rows"] += rows
        ratios = {}
        for r in rows:
            ratios.setdefault((r["model"], r["context"], r["threads"]), {})[r["impl"]] = r["tok_per_s"]
        for key, v in ratios.items():
            if "transformers" in v:
                print("decode     %-15s context=%-5d threads=%d kvsimd / transformers = %.2fx" % (key + (v["kvsimd"] / v["transformers"],)))
            if "transformers" in v and "weights floor" in v:
                print("decode     %-15s context=%-5d threads=%d kvsimd at %.0f%% of the weight-streaming floor; "
                      "the floor itself is %.2fx transformers" % (key + (100 * v["kvsimd"] / v["weights floor"],
                                                                          v["weights floor"] / v["transformers"])))
    if args.what == "streaming":
        from kvsimd.bench import streaming
        n = 10**5 if args.quick else 10**6
        for pol in ("sink_query", "shift"):
            r = streaming.bench_memory(pol, n_tokens=n, progress=lambda r: print(
                "streaming  memory   %-10s after %8d tokens: RSS %.1f MiB (%.0f s)"
                % (r["policy"], r["tokens"], r["rss_MiB"], r["seconds"]), flush=True))
            print("streaming  memory   %-10s RSS growth from %d to %d tokens: %+.2f%%"
                  % (pol, r["first"], r["tokens"], r["growth_pct"]), flush=True)
            results["rows"].append(r)
        for pol in ("shift", "sink_query"):
            results["rows"] += streaming.bench_drift(pol, n_tokens=10**4 if args.quick else 10**5, checkpoints=(
                (10**3, 10**4) if args.quick else (10**3, 10**4, 10**5)), progress=lambda r: print(
                "streaming  drift    %-10s %s after %6d tokens: logits within %.2e of a fresh prefill (max %d rotations)"
                % (r["policy"], r["dtype"], r["tokens"], r["rel_err"], r["max_rotations"]), flush=True))
        results["rows"] += streaming.bench_overhead((256, 2048) if args.quick else (256, 2048, 8192), progress=lambda r: print(
            "streaming  overhead capacity=%-5d %-10s %6.1f tok/s  %+6.2f%% vs fixed%s"
            % (r["capacity"], r["policy"], r["tok_per_s"], r["overhead_pct"],
               "  (one shift event: %.1f ms)" % r["event_ms"] if "event_ms" in r else ""), flush=True))
    if args.what == "quality":
        import os
        from kvsimd.bench import quality
        text = os.path.join(os.path.dirname(os.path.abspath(kvsimd.__file__)), "..", "..", "shared", "data",
                            "hamlet_gut.txt")
        png = os.path.join(args.plot, "streaming_nll.png") if args.plot else None
        rows, curves = quality.main(n_tokens=512 if args.quick else 2304, windows=(128,) if args.quick else (256, 512),
                               oracle_every=args.oracle_every, text_path=text, png=png)
        for r in rows:
            print("quality  %-32s PPL all %-8.3f PPL on oracle positions %.3f (%d scored)"
                  % (r["config"], r["ppl_all"], r["ppl_oracle_positions"], r["scored"]))
        results["rows"] += rows
        results["curves"] = {k: [None if not np.isfinite(x) else round(float(x), 5) for x in v]
                             for k, v in curves.items()}
    if args.json:
        common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
