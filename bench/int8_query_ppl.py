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
is replaced here by a causal one over blocks of 256 queries (the same float64 math, about 50 s per
configuration for 2,304 tokens on one core)."""
import argparse
import json
import math
import os
import time

import numpy as np


def causal_attention():
    """A stand-in for kvsimd.reference._attention (dense causal rows, no ALiBi, window or soft cap):
    the query arrives as kvsimd.reference.query_as_read gives it (patched per configuration)."""

    def attention(q, k, v, positions=None, slopes=None, window=0, scale=None, softcap=None):
        if positions is None or slopes is not None or window or softcap:
            raise NotImplementedError("dense causal attention only (SmolLM2)")
        H, T, D = q.shape
        G = H // k.shape[0]
        kr, vr = np.repeat(k, G, 0), np.repeat(v, G, 0)
        sc = 1.0 / math.sqrt(D) if scale is None else scale
        out = np.empty((T, H * D))
        for t0 in range(0, T, 256):
            t1 = min(T, t0 + 256)
            s = np.einsum("htd,hsd->hts", q[:, t0:t1], kr[:, :t1]) * sc
            s[:, np.arange(t0, t1)[:, None] < np.arange(t1)[None, :]] = -np.inf
            s -= s.max(-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(-1, keepdims=True)
            out[t0:t1] = np.einsum("hts,hsd->thd", p, vr[:, :t1]).reshape(t1 - t0, H * D)
        return out
    return attention


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2304, help="tokens scored (default 2304, at least 1)")
    ap.add_argument("--text", help="text file (default: kvsimd.bench's, $KVSIMD_SHARED_DIR/data/hamlet_gut.txt)")
    ap.add_argument("--json", help="write the perplexities here")
    args = ap.parse_args()
    if args.tokens < 1:
        ap.error("--tokens must be >= 1, got %d" % args.tokens)
    import kvsimd
    try:
        run(args)
    except kvsimd.KVSimdError as e:   # no text, no model: one line naming what is missing
        ap.exit(2, "%s: %s\n" % (ap.prog, e))


def run(args):
    from kvsimd import Decoder, reference
    from kvsimd.bench.common import text_path
    from kvsimd.bench.quality import _nll, load_tokens
    from kvsimd.loaders import registry
    text = text_path(args.text)   # KVSimdValueError naming --text and the variables when there is none
    model = Decoder.from_gguf(registry.smollm2_path(), activations="float32")
    tokens = load_tokens(model, text, args.tokens)
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"what": "bench/int8_query_ppl.py: SmolLM2 Q4_1 through kvsimd.reference (float64), dense "
                               "causal, K/V float, as an int8 or an int8/int4 cache stores them, the query rounded to "
                               "int8 per head and 32-value block (turned as the keys are) or not",
                       "tokens": len(tokens) - 1, "text": os.path.basename(text), "perplexity": ppl}, fh, indent=1)


if __name__ == "__main__":
    main()
