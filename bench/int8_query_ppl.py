"""What rounding the query to int8 costs in perplexity: the accuracy side of integer dot products
over an int8 K cache (bench/int8_dot_speed.py measures their speed).

    python bench/int8_query_ppl.py [--tokens 2304] [--text PATH] [--json PATH]

VPDPBUSD multiplies bytes by bytes, so scores over int8 keys computed with it need the query in
int8 too: one scale per query head and 32-value block, rounded by the rule the cache applies to
its keys (kvsimd.reference.quantize_kv: max |block| / 127, ties to even, in float32), which is what
kvsimd's attention over int8 keys reads (kvsimd.reference.query_as_read).  This runs SmolLM2 (the
GGUF kvsimd's tests use) through kvsimd.reference in float64 over the first --tokens tokens of a
text (dense causal: every token reads every earlier one), six ways: float K/V, K/V as
KVCache(dtype="int8") and KVCache(dtype="int8/int4") store them (kvsimd.reference.quantize_kv; the
latter turned by H), each with the query rounded so (turned as the keys are) or not, and prints each
perplexity and its change against float.  No kvsimd kernel runs: the model's weights are read by
kvsimd's GGUF loader, everything after that is NumPy.  The reference's per-query attention loop
is replaced here by bench/ref_ppl.py's causal one over blocks of queries."""
import math
import time

import numpy as np

from ref_ppl import causal_attention, model_and_tokens, parser, run_cli, write_json


def main():
    ap = parser(__doc__)
    run_cli(ap, ap.parse_args(), run)


def run(args):
    from kvsimd import reference
    from kvsimd.bench.quality import _nll
    model, tokens, text = model_and_tokens(args)
    ppl = {}
    rounded = reference.query_as_read   # the int8 keys' rule (turned with turned keys); else q

    def plain(q, kv):
        return q
    reference._attention = causal_attention()
    for name, kv, query in [("float K/V", "float", plain),
                            ("float K/V, int8 query", "float", lambda q, kv: rounded(q, "int8")),
                            ("int8 K/V", "int8", plain), ("int8 K/V, int8 query", "int8", rounded),
                            ("int8 K, int4 V", "int8/int4", plain), ("int8 K, int4 V, int8 query", "int8/int4", rounded)]:
        reference.query_as_read = query
        t0 = time.time()
        logits = reference.forward(model, tokens[:-1], kv=kv)
        ppl[name] = math.exp(np.mean([_nll(logits[i], tokens[i + 1]) for i in range(len(tokens) - 1)]))
        print("%-28s perplexity %.4f  %+.3f%% against float K/V  (%.0f s)"
              % (name, ppl[name], 100 * (ppl[name] / ppl["float K/V"] - 1), time.time() - t0), flush=True)
    write_json(args.json, "bench/int8_query_ppl.py: SmolLM2 Q4_1 through kvsimd.reference (float64), dense causal, "
               "K/V float, as an int8 or an int8/int4 cache stores them, the query rounded to int8 per head and "
               "32-value block (turned as the keys are) or not", tokens, text, perplexity=ppl)


if __name__ == "__main__":
    main()
