"""Perplexity under infinite generation, StreamingLLM's protocol: feed the text one token per
step, score the NLL of the next token, PPL = exp(mean NLL), on the real SmolLM2 model.

Configurations per window W: dense (every token cached), window without sinks (n_keep=0),
4 sinks + window under each policy, and the oracle for that window size (re-prefill the last
W tokens at every scored step).  The oracle costs a W-token prefill per step, so it is scored
on ``oracle_every``-spaced positions (all positions when 1); its PPL is compared with the other
configurations on exactly those positions."""
import math
import sys
import time

import numpy as np

import kvsimd
from kvsimd.bench.common import text_path as find_text
from kvsimd.bench.schema import vs_float16_text
from kvsimd.errors import KVSimdValueError


def _nll(logits, target):
    z = logits.astype(np.float64)
    m = z.max()
    return float(m + math.log(np.exp(z - m).sum()) - z[target])


def oracle_shard(model, tokens, W, shard=0, n_shards=1, every=1):
    """The oracle's NLL at positions i = 1 + every * (shard + k * n_shards): the model on exactly
    the last W tokens, re-prefilled.  Shards of one oracle can run in separate processes (it
    costs a W-token prefill per position); NaN where another shard scores."""
    n = len(tokens)
    nll = np.full(n - 1, np.nan)
    for j, i in enumerate(range(1, n, every)):
        if j % n_shards != shard:
            continue
        ctx = tokens[max(0, i - W):i]
        c = model.new_cache(capacity=len(ctx))
        nll[i - 1] = _nll(model.prefill(ctx, cache=c), tokens[i])
    return nll


# characters of the text skipped before the tokens are read: its front matter (Project Gutenberg's header)
TEXT_START = 20000


def load_tokens(model, text_path, n_tokens):
    """The first ``n_tokens + 1`` tokens of the text file (past its front matter, the first
    TEXT_START characters): a run over ``n_tokens`` scored positions.  KVSimdValueError naming the
    file when it gives fewer (a shorter run would be another measurement, or none)."""
    with open(text_path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    tokens = model.tokenizer.encode(text[TEXT_START:])[:n_tokens + 1]
    if len(tokens) < n_tokens + 1:
        raise KVSimdValueError("text %s: %d tokens after its first %d characters (of %d), a run over %d tokens "
                               "needs %d" % (text_path, len(tokens), TEXT_START, len(text), n_tokens, n_tokens + 1))
    return tokens


def check_text(text_path, n_tokens):
    """:func:`load_tokens` with the model's tokenizer alone (the GGUF file's metadata, no weights:
    about a second): KVSimdValueError before anything runs when the text is too short for a run
    over ``n_tokens``."""
    from types import SimpleNamespace

    from kvsimd.loaders import registry as models
    from kvsimd.loaders.gguf import open_gguf
    from kvsimd.loaders.tokenizer import Tokenizer
    gf = open_gguf(models.smollm2_path())
    try:
        load_tokens(SimpleNamespace(tokenizer=Tokenizer.from_gguf(gf)), text_path, n_tokens)
    finally:
        gf.close()


# KV-cache kinds the quality runs compare: a dtype of KVCache ("int8/int4": int8 keys, int4 values),
# or "int4-plain" (int4 without the Hadamard turn that KVCache(dtype="int4") applies by default)
CACHE_KINDS = ("float16", "float32", "int8", "int4", "int8/int4", "int4-plain")


def parse_kind(kind):
    """(a kind of CACHE_KINDS, recent) of ``kind``: one of CACHE_KINDS, or a quantized one with
    "+R" (e.g. "int4+32": the cache also keeps its last 32 tokens' float16 rows, KVCache(recent=32),
    and every query reads its last 32 keys from them).  ValueError for anything else."""
    base, plus, r = str(kind).partition("+")
    if base not in CACHE_KINDS or (plus and (base in ("float16", "float32") or not r.isdigit() or int(r) < 1)):
        raise ValueError("a KV-cache kind is one of %s, or a quantized one with +R (R >= 1 recent tokens kept as "
                         "float16 rows, e.g. int4+32), got %r" % (", ".join(CACHE_KINDS), kind))
    return base, int(r) if plus else 0


def cache_args(kind):
    """new_cache keywords of a cache kind (parse_kind)."""
    base, recent = parse_kind(kind)
    args = dict(dtype="int4", hadamard=False) if base == "int4-plain" else dict(dtype=base)
    if recent:
        args["recent"] = recent
    return args


def _kind_arg(kind):
    """argparse type of --kv-dtype."""
    import argparse
    try:
        parse_kind(kind)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return kind


def run(model, tokens, windows=(256, 512), n_keep=4, oracle_every=8, progress=None, oracle=True, dense=True,
        dtypes=("float16",)):
    """NLL per position of every configuration, for each KV-cache dtype of ``dtypes`` (float16's
    configurations keep their plain names, another dtype's carry it as a suffix, e.g. "dense int8")."""
    n = len(tokens)
    curves = {}
    for dt in dtypes:
        tag = "" if dt == "float16" else " " + dt
        _run_dtype(model, tokens, windows, n_keep, oracle_every, oracle and dt == dtypes[0], dense, dt, tag, curves,
                   progress)
    return curves


def _run_dtype(model, tokens, windows, n_keep, oracle_every, oracle, dense, dtype, tag, curves, progress):
    n = len(tokens)

    def log(name, nll):
        curves[name] = np.array(nll)
        if progress:
            progress(name, curves[name])

    # dense: all tokens cached, one step at a time
    if dense:
        cache = model.new_cache(capacity=n + 1, **cache_args(dtype))
        nll = []
        logits = model.prefill(tokens[:1], cache=cache)
        for i in range(1, n):
            nll.append(_nll(logits, tokens[i]))
            logits = model.step([tokens[i]], cache=cache)[0]
        log("dense" + tag, nll)
    for W in windows:
        configs = [("window, no sinks", dict(n_keep=0, policy="sink_query"))] + \
                  [("%d sinks + %s" % (n_keep, p), dict(n_keep=n_keep, policy=p))
                   for p in ("sink_query", "shift", "reevaluate")]
        for name, kw in configs:
            cache = model.new_cache(capacity=W, **cache_args(dtype), **kw)
            nll = []
            logits = model.prefill(tokens[:1], cache=cache)
            for i in range(1, n):
                nll.append(_nll(logits, tokens[i]))
                logits = model.step([tokens[i]], cache=cache)[0]
            log("W=%d %s%s" % (W, name, tag), nll)
        if oracle:
            log("W=%d oracle (re-prefill)" % W, oracle_shard(model, tokens, W, every=oracle_every))


# the real-model prompts of the tests (tests/test_gguf.py): two texts and a chat turn
GREEDY_PROMPTS = ["The old king said to his daughters:", "def fibonacci(n):",
                  [{"role": "user", "content": "Name three colours of the rainbow."}]]


def greedy_divergence(model, dtypes=("int8",), n=64, prompts=GREEDY_PROMPTS):
    """Greedy decoding of each prompt with a float16 cache and with each cache dtype of ``dtypes``:
    per prompt and dtype, the step at which the tokens first differ from float16's (None: the ``n``
    tokens are the same), and the two texts from there."""
    tok = model.tokenizer
    rows = []
    for i, p in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template(p) if isinstance(p, list) else p)
        base = list(model.generate(ids, max_new_tokens=n, cache_dtype="float16"))
        for dt in dtypes:
            args = cache_args(dt)
            got = list(model.generate(ids, max_new_tokens=n, cache_dtype=args["dtype"],
                                      cache_recent=args.get("recent", 0)))
            first = next((j for j, (a, b) in enumerate(zip(base, got)) if a != b), None)
            rows.append({"prompt": i, "dtype": dt, "tokens": n, "first_divergence": first,
                         "float16_text": tok.decode(base[first or 0:]) if first is not None else "",
                         "text": tok.decode(got[first or 0:]) if first is not None else ""})
    return rows


# positions per resampled block of paired_ratio's bootstrap: the losses of neighbouring tokens are
# correlated (a hard passage is hard for every cache), so single positions would understate the spread
PAIRED_BLOCK = 64


def paired_ratio(nll, base, block=PAIRED_BLOCK, n_boot=2000, seed=0):
    """PPL of the NLL curve ``nll`` over PPL of ``base`` on the positions both scored (the same
    tokens, so the text's own difficulty cancels), with a 95% interval from a bootstrap over
    blocks of ``block`` consecutive positions: (ratio, low, high)."""
    nll, base = np.asarray(nll, dtype=float), np.asarray(base, dtype=float)
    if nll.shape != base.shape:
        raise ValueError("curves of %d and %d positions" % (nll.size, base.size))
    d = (nll - base)[np.isfinite(nll) & np.isfinite(base)]
    if d.size == 0:
        raise ValueError("no position scored by both curves")
    edges = np.arange(0, d.size, block)
    sums, counts = np.add.reduceat(d, edges), np.diff(np.append(edges, d.size))
    pick = np.random.default_rng(seed).integers(0, edges.size, (n_boot, edges.size))
    boot = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    return (float(np.exp(d.mean())), float(np.exp(np.percentile(boot, 2.5))),
            float(np.exp(np.percentile(boot, 97.5))))


def _is_kind(kind):
    try:
        parse_kind(kind)
    except ValueError:
        return False
    return True


def summarize(curves, oracle_every):
    """PPL per configuration, on all positions and on the oracle's positions; a configuration run
    with another cache dtype ("<config> <dtype>", see :func:`run`) also gets its PPL over float16's
    of the same configuration, paired position by position: vs_float16 and vs_float16_ci95."""
    rows = []
    for name, c in curves.items():
        sub = c[::oracle_every]
        row = {"config": name, "scored": int(np.isfinite(c).sum()),
               "ppl_all": float(np.exp(np.nanmean(c))) if np.isfinite(c).all() else float("nan"),
               "ppl_oracle_positions": float(np.exp(np.nanmean(sub)))}
        head, _, kind = name.rpartition(" ")
        base = head if head in curves and kind != "float16" and _is_kind(kind) else None
        if base is not None:
            if len(c) != len(curves[base]):
                raise ValueError("%r has %d positions and %r %d: runs over different --tokens cannot be paired"
                                 % (name, len(c), base, len(curves[base])))
            r, lo, hi = paired_ratio(c, curves[base])
            row.update(vs_float16=r, vs_float16_ci95=[lo, hi])
        rows.append(row)
    return rows


def plot(curves, path):
    """Running mean NLL of every configuration but the oracles (``curves``: name -> NLL per
    position, as arrays or as the JSON's lists with None for unscored positions)."""
    from kvsimd.bench.plots import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in curves.items():
        if "oracle" in name:
            continue
        c = np.asarray([np.nan if x is None else x for x in c], dtype=float)
        run_mean = np.cumsum(c) / np.arange(1, len(c) + 1)
        ax.plot(np.arange(1, len(c) + 1), run_mean, label=name, lw=1)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("running mean NLL")
    ax.set_title("SmolLM2-135M-Instruct, Hamlet: running NLL under infinite generation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(n_tokens=2304, windows=(256, 512), oracle_every=8, text_path=None, dtypes=("float16",)):
    """Every configuration over the text ``text_path`` (None: as :func:`kvsimd.bench.common.text_path`
    finds it; KVSimdValueError before the model loads when it finds none)."""
    text_path = find_text(text_path)
    from kvsimd.loaders import registry as models
    model = kvsimd.Decoder.from_gguf(models.smollm2_path())
    tokens = load_tokens(model, text_path, n_tokens)
    t0 = time.perf_counter()
    curves = run(model, tokens, windows, oracle_every=oracle_every, dtypes=dtypes,
                 progress=lambda name, c: print("quality  %-32s PPL %.3f  (%d scored, %.0f s)"
                                                % (name, float(np.exp(np.nanmean(c))), int(np.isfinite(c).sum()),
                                                   time.perf_counter() - t0), flush=True))
    return summarize(curves, oracle_every), curves


def _cli(argv=None):
    """Long quality runs in pieces (separate processes, so both cores work):

        python -m kvsimd.bench.quality oracle --window 512 --shard 0/2 --out o512_0.npy
        python -m kvsimd.bench.quality policies --out p.npz       # dense + every policy, windows 256 512
        python -m kvsimd.bench.quality merge p.npz o256_*.npy ... --json q.json --plot docs/
        python -m kvsimd.bench.quality greedy --kv-dtype int8   # first divergence of greedy tokens from float16
    """
    import argparse
    import glob
    import json
    import os
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench.quality", description=_cli.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["oracle", "policies", "merge", "greedy"])
    ap.add_argument("inputs", nargs="*")
    ap.add_argument("--window", type=int, action="append", help="window(s) (default 256 and 512)")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--kv-dtype", action="append", type=_kind_arg, metavar="KIND",
                    help="KV-cache dtype(s) of the policies run: %s, or a quantized one with +R, its last R "
                         "tokens' float16 rows kept and read as well (e.g. int4+32) (default float16; "
                         "int4-plain: int4 without the Hadamard turn)" % ", ".join(CACHE_KINDS))
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--tokens", type=int, default=2304)
    ap.add_argument("--out")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--text", metavar="PATH", help="the text (default: $KVSIMD_BENCH_TEXT, else "
                                                   "$KVSIMD_SHARED_DIR/data/hamlet_gut.txt)")
    a = ap.parse_args(argv)
    if a.what == "greedy":        # greedy tokens of the real-model prompts, each cache dtype beside float16
        if any(parse_kind(k)[0] == "int4-plain" for k in (a.kv_dtype or ())):
            ap.error("greedy runs generate(cache_dtype=..., cache_recent=...), which takes a KVCache dtype: "
                     "int4-plain is for the perplexity runs")
        from kvsimd.loaders import registry as models
        model = kvsimd.Decoder.from_gguf(models.smollm2_path())
        for r in greedy_divergence(model, tuple(d for d in (a.kv_dtype or ["int8"]) if d != "float16")):
            print("greedy   prompt %d  %-8s %s" % (r["prompt"], r["dtype"], "same %d tokens" % r["tokens"]
                                                   if r["first_divergence"] is None else
                                                   "first divergence at token %d: float16 %r, %s %r"
                                                   % (r["first_divergence"], r["float16_text"][:60], r["dtype"],
                                                      r["text"][:60])))
        return 0
    if a.what in ("oracle", "policies"):
        from kvsimd.errors import KVSimdError
        try:       # before the model loads: one line and exit 2
            a.text = find_text(a.text)
            check_text(a.text, a.tokens)
        except KVSimdError as e:
            print("python -m kvsimd.bench.quality: error: %s" % e, file=sys.stderr)
            return 2
        from kvsimd.loaders import registry as models
        model = kvsimd.Decoder.from_gguf(models.smollm2_path())
        tokens = load_tokens(model, a.text, a.tokens)
        if a.what == "oracle":
            k, n = (int(v) for v in a.shard.split("/"))
            np.save(a.out, oracle_shard(model, tokens, (a.window or [256])[0], k, n))
        else:
            curves = run(model, tokens, windows=a.window or (256, 512), oracle=False, dense=not a.no_dense,
                         dtypes=tuple(a.kv_dtype or ("float16",)),
                         progress=lambda name, c: print(
                "quality  %-32s PPL %.3f" % (name, float(np.exp(np.mean(c)))), flush=True))
            np.savez(a.out, **curves)
        return 0
    curves = {}
    oracles = {}
    for path in a.inputs:
        for p in sorted(glob.glob(path)):
            if p.endswith(".npz"):
                curves.update(dict(np.load(p)))
            else:
                w = int(os.path.basename(p).split("_")[0].lstrip("o"))
                part = np.load(p)
                cur = oracles.get(w)
                oracles[w] = part if cur is None else np.where(np.isnan(cur), part, cur)
    for w, c in sorted(oracles.items()):
        curves["W=%d oracle (re-prefill)" % w] = c
    try:
        rows = summarize(curves, 1)
    except ValueError as e:
        print("python -m kvsimd.bench.quality: error: %s" % e, file=sys.stderr)
        return 2
    for r in rows:
        print("quality  %-32s PPL %.3f (%d scored)%s" % (
            r["config"], r["ppl_oracle_positions"], r["scored"],
            "  vs float16 " + vs_float16_text(r) if "vs_float16" in r else ""))
    if a.json:
        from kvsimd.bench import common
        from kvsimd.bench.schema import SCHEMA_VERSION
        doc = {"schema": SCHEMA_VERSION,
               "header": {"machine": common.machine(), "versions": common.versions(), "isa": kvsimd.isa_info(),
                          "roofline": common.roofline(size=256 << 20, repeat=3), "argv": ["quality"] + list(argv or []),
                          "quick": False},
               "results": {"quality": rows},
               "curves": {k: [None if not np.isfinite(x) else round(float(x), 5) for x in v] for k, v in curves.items()}}
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    if a.plot:     # after the JSON: a missing matplotlib loses no result
        from kvsimd.bench.plots import PlotUnavailable
        try:
            plot(curves, os.path.join(a.plot, "streaming_nll.png"))
        except PlotUnavailable as e:
            print("kvsimd.bench.quality: %s" % e, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
