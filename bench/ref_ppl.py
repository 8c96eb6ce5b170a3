"""What the perplexity scripts that run SmolLM2 through kvsimd.reference share
(bench/int8_query_ppl.py, bench/int4_recent_ppl.py): the model and the text's tokens, their JSON
file, and a stand-in for kvsimd.reference._attention (dense causal rows, no ALiBi, window or soft
cap), the same float64 math over blocks of 256 queries instead of one query at a time (about 50 s
per configuration for 2,304 tokens on one core)."""
import json
import math
import os

import numpy as np

BLOCK = 256


def causal_attention(recent=0, sinks=0):
    """reference._attention's stand-in.  With ``recent`` or ``sinks`` > 0, q, K and V arrive as pairs
    ``[2, H or Hkv, S, D]`` (as the cache's attention reads them, as they were computed): query i
    reads key j as computed, with q as computed, when j is among its last ``recent`` keys
    (i - recent < j <= i) or among the first ``sinks``, else as stored, with q as read over stored
    keys (rounded over int8 and int4 keys, reference.query_as_read)."""

    def attention(q, k, v, positions=None, slopes=None, window=0, scale=None, softcap=None):
        if positions is None or slopes is not None or window or softcap:
            raise NotImplementedError("dense causal attention only (SmolLM2)")
        mixed = recent > 0 or sinks > 0
        if mixed != (k.ndim == 4) or mixed != (q.ndim == 4):
            raise ValueError("q, K and V must come as (stored, computed) pairs exactly when recent or sinks > 0")
        qs, qc = (q[0], q[1]) if mixed else (q, q)
        H, T, D = qs.shape
        G = H // k.shape[-3]
        kr, vr = np.repeat(k, G, -3), np.repeat(v, G, -3)
        sc = 1.0 / math.sqrt(D) if scale is None else scale
        out = np.empty((T, H * D))
        for t0 in range(0, T, BLOCK):
            t1 = min(T, t0 + BLOCK)
            i, j = np.arange(t0, t1)[:, None], np.arange(t1)[None, :]
            if mixed:
                exact = (j > i - recent) | (j < sinks)
                s = np.where(exact, np.einsum("htd,hsd->hts", qc[:, t0:t1], kr[1, :, :t1]),
                             np.einsum("htd,hsd->hts", qs[:, t0:t1], kr[0, :, :t1])) * sc
            else:
                s = np.einsum("htd,hsd->hts", qs[:, t0:t1], kr[:, :t1]) * sc
            s[:, i < j] = -np.inf
            s -= s.max(-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(-1, keepdims=True)
            if mixed:
                o = np.einsum("hts,hsd->thd", np.where(exact, p, 0), vr[1, :, :t1]) + \
                    np.einsum("hts,hsd->thd", np.where(exact, 0, p), vr[0, :, :t1])
            else:
                o = np.einsum("hts,hsd->thd", p, vr[:, :t1])
            out[t0:t1] = o.reshape(t1 - t0, H * D)
        return out
    return attention


def parser(doc):
    """The scripts' command line: --tokens, --text, --json (each script adds its own)."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2304, help="tokens scored (default 2304, at least 1)")
    ap.add_argument("--text", help="text file (default: kvsimd.bench's, $KVSIMD_SHARED_DIR/data/hamlet_gut.txt)")
    ap.add_argument("--json", help="write the perplexities here")
    return ap


def run_cli(ap, args, run):
    """``run(args)`` after the common checks; a KVSimdError (no text, no model) ends it with one line
    naming what is missing, exit 2."""
    if args.tokens < 1:
        ap.error("--tokens must be >= 1, got %d" % args.tokens)
    import kvsimd
    try:
        run(args)
    except kvsimd.KVSimdError as e:
        ap.exit(2, "%s: %s\n" % (ap.prog, e))


def model_and_tokens(args):
    """SmolLM2 Q4_1 (float32 activations) and the first ``args.tokens + 1`` tokens of ``args.text``
    (kvsimd.bench's text by default); KVSimdError naming what is missing.  Returns (model, tokens,
    text path)."""
    from kvsimd import Decoder
    from kvsimd.bench.common import text_path
    from kvsimd.bench.quality import load_tokens
    from kvsimd.loaders import registry
    text = text_path(args.text)
    model = Decoder.from_gguf(registry.smollm2_path(), activations="float32")
    return model, load_tokens(model, text, args.tokens), text


def write_json(path, what, tokens, text, **results):
    """The run's results in ``path`` (nothing when None), with what was measured, over how many tokens of which text."""
    if path:
        with open(path, "w") as fh:
            json.dump(dict({"what": what, "tokens": len(tokens) - 1, "text": os.path.basename(text)}, **results), fh,
                      indent=1)
