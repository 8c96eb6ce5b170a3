"""Perplexity through the transformers integration: SmolLM2 run by transformers over a KVSimdCache of
each kind, with and without recent float rows, beside kvsimd's own Decoder on the same cache.

    python bench/hf_recent_ppl.py [--tokens 2304] [--recent 32] [--text PATH] [--json PATH]

transformers loads SmolLM2 from its GGUF (float32 weights, kvsimd.bench.hf.transformers_from_gguf)
with attn_implementation="kvsimd"; one forward pass over the first --tokens + 1 tokens of the text
into KVSimdCache(dtype=..., recent=R) gives every position's logits (each row reads its keys as
the cache stores them: quantized, its last R from float16 rows).  kvsimd's Decoder with the same
weights (Decoder.from_transformers) prefills the same tokens into new_cache(dtype=..., recent=R).
Prints each perplexity over float16's on the same tokens with a 95% interval (bootstrap over
blocks of 64 positions, kvsimd.bench.quality.paired_ratio), for both.  Needs torch and
transformers (the [test] extra)."""
import time

import numpy as np

from ref_ppl import parser, run_cli, write_json

KINDS = [("float16", 0), ("int8", 0), ("int8", None), ("int4", 0), ("int4", None), ("int8/int4", 0),
         ("int8/int4", None)]


def main():
    ap = parser(__doc__)
    ap.add_argument("--recent", type=int, default=32, help="float rows of the recent-row kinds (default 32)")
    args = ap.parse_args()
    if args.recent < 1:
        ap.error("--recent must be >= 1, got %d" % args.recent)
    run_cli(ap, args, run)


def run(args):
    import torch

    import kvsimd.integrations.transformers as kt
    from kvsimd import Decoder
    from kvsimd.bench.common import text_path
    from kvsimd.bench.hf import transformers_from_gguf
    from kvsimd.bench.quality import load_tokens, paired_ratio
    from kvsimd.loaders import registry
    text = text_path(args.text)
    m = transformers_from_gguf(registry.smollm2_path())
    kt.enable(m)
    dec = Decoder.from_transformers(m)
    tokens = load_tokens(Decoder.from_gguf(registry.smollm2_path()), text, args.tokens)   # the file's tokenizer
    ids = torch.tensor([tokens[:-1]])
    target = np.asarray(tokens[1:])

    def nll(logits):
        z = logits.astype(np.float64)
        mx = z.max(axis=1, keepdims=True)
        return (mx[:, 0] + np.log(np.exp(z - mx).sum(axis=1))) - z[np.arange(len(target)), target]

    curves, out = {}, {}
    for dtype, r in KINDS:
        R = args.recent if r is None else 0
        name = dtype + ("+recent%d" % R if R else "")
        t0 = time.perf_counter()
        with torch.no_grad():
            cache = kt.KVSimdCache(m, dtype=dtype, recent=R, capacity=len(tokens))
            hf = m(ids, past_key_values=cache, use_cache=True).logits[0].float().numpy()
        t1 = time.perf_counter()
        cq = dec.new_cache(capacity=len(tokens), dtype=dtype, recent=R)
        own = np.asarray(dec.prefill(tokens[:-1], cache=cq, all_logits=True))
        t2 = time.perf_counter()
        curves[name] = (nll(hf), nll(own))
        print("%-16s transformers %.1f s, Decoder %.1f s" % (name, t1 - t0, t2 - t1), flush=True)
    base_hf, base_own = curves["float16"]
    print("\nperplexity over float16's (95%% interval), %d tokens of %s" % (len(target), text))
    for name, (a, b) in curves.items():
        rh, rd = paired_ratio(a, base_hf), paired_ratio(b, base_own)
        out[name] = {"ppl_transformers": float(np.exp(a.mean())), "ppl_decoder": float(np.exp(b.mean())),
                     "over_float16_transformers": rh, "over_float16_decoder": rd,
                     # token by token: a perplexity over few tokens can land near float16's by chance
                     "max_nll_diff_transformers": float(np.abs(a - base_hf).max()),
                     "max_nll_diff_decoder": float(np.abs(b - base_own).max())}
        print("%-16s transformers %.3f  %+.2f%% [%+.2f, %+.2f]   Decoder %.3f  %+.2f%% [%+.2f, %+.2f]"
              % (name, np.exp(a.mean()), 100 * (rh[0] - 1), 100 * (rh[1] - 1), 100 * (rh[2] - 1),
                 np.exp(b.mean()), 100 * (rd[0] - 1), 100 * (rd[1] - 1), 100 * (rd[2] - 1)))
    write_json(args.json, "perplexity through transformers' KVSimdCache and kvsimd's Decoder, dense",
               tokens, text, results=out)


if __name__ == "__main__":
    main()
