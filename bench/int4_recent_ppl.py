"""What keeping the most recent tokens' K/V as computed (unquantized) buys an int4 KV cache in
perplexity, before any cache does it.

    python bench/int4_recent_ppl.py [--tokens 2304] [--kind int4 ...] [--recent 0 ...] [--sinks 0]
                                    [--text PATH] [--json PATH]

Runs SmolLM2 (the GGUF kvsimd's tests use) through kvsimd.reference in float64 over the first
--tokens tokens of a text, dense and causal (every token reads every earlier one).  Float K/V
first, then for each --kind (a kvsimd.reference K/V kind: "int4" turned by H as
KVCache(dtype="int4") stores it, "int4-plain" without the turn, "int8/int4", "int8") and each
--recent R: query i reads the keys and values of tokens i - R < j <= i as they were computed and
every earlier one as such a cache stores it (kvsimd.reference.quantize_kv); --sinks S also reads
the first S tokens as computed.  Prints each perplexity over float's on the same tokens, with a
95% interval (bootstrap over blocks of 64 positions, kvsimd.bench.quality.paired_ratio).  No
kvsimd kernel runs: the weights are read by kvsimd's GGUF loader, everything after that is NumPy
(bench/ref_ppl.py's causal attention; about a minute per configuration for 2,304 tokens)."""
import time

import numpy as np

from ref_ppl import causal_attention, model_and_tokens, parser, run_cli, write_json

KINDS = {"int4": ("int4", True), "int4-plain": ("int4", False), "int8/int4": "int8/int4", "int8": "int8"}


def main():
    ap = parser(__doc__)
    ap.add_argument("--kind", action="append", choices=sorted(KINDS), help="K/V kind (repeatable; default int4)")
    ap.add_argument("--recent", action="append", type=int,
                    help="tokens read as computed (repeatable; default 0, 8, 16, 32, 64, 128)")
    ap.add_argument("--sinks", type=int, default=0, help="first tokens read as computed (default 0)")
    args = ap.parse_args()
    args.kind = args.kind or ["int4"]
    args.recent = args.recent if args.recent is not None else [0, 8, 16, 32, 64, 128]
    if min(args.recent) < 0 or args.sinks < 0:
        ap.error("--recent and --sinks must be >= 0, got %s and %d" % (args.recent, args.sinks))
    run_cli(ap, args, run)


def run(args):
    from kvsimd import reference
    from kvsimd.bench.quality import _nll, paired_ratio
    model, tokens, text = model_and_tokens(args)
    stored, read = reference._as_cached, reference.query_as_read

    def both(kv, x, D, which=0):   # K/V (as stored, as computed): causal_attention picks per key
        return np.stack([stored(kv, x, D, which), x])

    def query(q, kv):              # q as read over stored keys (rounded over int8 ones), as computed
        reference._as_cached = stored
        try:
            return np.stack([read(q, kv), q])
        finally:
            reference._as_cached = both

    def nll(kv, recent, sinks):
        reference._attention = causal_attention(recent, sinks)
        if (recent or sinks) and kv != "float":
            reference._as_cached, reference.query_as_read = both, query
        try:
            logits = reference.forward(model, tokens[:-1], kv=kv)
        finally:
            reference._as_cached, reference.query_as_read = stored, read
        return np.array([_nll(logits[i], tokens[i + 1]) for i in range(len(tokens) - 1)])

    t0 = time.time()
    base = nll("float", 0, 0)
    rows = {"float": {"perplexity": float(np.exp(base.mean()))}}
    print("%-34s perplexity %.4f  (%.0f s)" % ("float K/V", rows["float"]["perplexity"], time.time() - t0), flush=True)
    for kind in args.kind:
        for recent in args.recent:
            t0 = time.time()
            x = nll(KINDS[kind], recent, args.sinks)
            r, lo, hi = paired_ratio(x, base)
            name = "%s, recent %d, sinks %d" % (kind, recent, args.sinks)
            rows[name] = {"kind": kind, "recent": recent, "sinks": args.sinks, "perplexity": float(np.exp(x.mean())),
                          "vs_float": r, "vs_float_ci95": [lo, hi]}
            print("%-34s perplexity %.4f  %+.2f%% [%+.2f, %+.2f] against float K/V  (%.0f s)"
                  % (name, rows[name]["perplexity"], 100 * (r - 1), 100 * (lo - 1), 100 * (hi - 1), time.time() - t0),
                  flush=True)
    write_json(args.json, "bench/int4_recent_ppl.py: SmolLM2 Q4_1 through kvsimd.reference (float64), dense causal; "
               "K/V as a quantized cache stores them except the last `recent` tokens of each query (and the first "
               "`sinks`), read as computed", tokens, text, rows=rows)


if __name__ == "__main__":
    main()
