"""Perplexity under infinite generation, StreamingLLM's protocol: feed the text one token per
step, score the NLL of the next token, PPL = exp(mean NLL), on the real SmolLM2 model.

Configurations per window W: dense (every token cached), window without sinks (n_keep=0),
4 sinks + window under each policy, and the oracle for that window size (re-prefill the last
W tokens at every scored step).  The oracle costs a W-token prefill per step, so it is scored
on ``oracle_every``-spaced positions (all positions when 1); its PPL is compared with the other
configurations on exactly those positions."""
import math
import time

import numpy as np

import kvsimd


def _nll(logits, target):
    z = logits.astype(np.float64)
    m = z.max()
    return float(m + math.log(np.exp(z - m).sum()) - z[target])


def run(model, tokens, windows=(256, 512), n_keep=4, oracle_every=8, progress=None):
    n = len(tokens)
    curves = {}

    def log(name, nll):
        curves[name] = np.array(nll)
        if progress:
            progress(name, curves[name])

    # dense: all tokens cached, one step at a time
    cache = model.new_cache(capacity=n + 1)
    nll = []
    logits = model.prefill(tokens[:1], cache=cache)
    for i in range(1, n):
        nll.append(_nll(logits, tokens[i]))
        logits = model.step([tokens[i]], cache=cache)[0]
    log("dense", nll)
    for W in windows:
        configs = [("window, no sinks", dict(n_keep=0, policy="sink_query"))] + \
                  [("%d sinks + %s" % (n_keep, p), dict(n_keep=n_keep, policy=p))
                   for p in ("sink_query", "shift", "reevaluate")]
        for name, kw in configs:
            cache = model.new_cache(capacity=W, **kw)
            nll = []
            logits = model.prefill(tokens[:1], cache=cache)
            for i in range(1, n):
                nll.append(_nll(logits, tokens[i]))
                logits = model.step([tokens[i]], cache=cache)[0]
            log("W=%d %s" % (W, name), nll)
        # oracle: the model on exactly the last W tokens, recomputed
        nll = np.full(n - 1, np.nan)
        for i in range(1, n, oracle_every):
            ctx = tokens[max(0, i - W):i]
            c = model.new_cache(capacity=len(ctx))
            nll[i - 1] = _nll(model.prefill(ctx, cache=c), tokens[i])
        log("W=%d oracle (re-prefill)" % W, nll)
    return curves


def summarize(curves, oracle_every):
    """PPL per configuration, on all positions and on the oracle's positions."""
    rows = []
    for name, c in curves.items():
        sub = c[::oracle_every]
        rows.append({"config": name, "scored": int(np.isfinite(c).sum()),
                     "ppl_all": float(np.exp(np.nanmean(c))) if np.isfinite(c).all() else float("nan"),
                     "ppl_oracle_positions": float(np.exp(np.nanmean(sub)))})
    return rows


def plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in curves.items():
        if "oracle" in name:
            continue
        run_mean = np.cumsum(c) / np.arange(1, len(c) + 1)
        ax.plot(np.arange(1, len(c) + 1), run_mean, label=name, lw=1)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("running mean NLL")
    ax.set_title("SmolLM2-135M-Instruct, Hamlet: running NLL under infinite generation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(n_tokens=2304, windows=(256, 512), oracle_every=8, text_path=None, png=None):
    from kvsimd import models
    model = kvsimd.Decoder.from_gguf(models.smollm2_path())
    with open(text_path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    tokens = model.tokenizer.encode(text[20000:])[:n_tokens + 1]
    t0 = time.perf_counter()
    curves = run(model, tokens, windows, oracle_every=oracle_every,
                 progress=lambda name, c: print("quality  %-32s PPL %.3f  (%d scored, %.0f s)"
                                                % (name, float(np.exp(np.nanmean(c))), int(np.isfinite(c).sum()),
                                                   time.perf_counter() - t0), flush=True))
    rows = summarize(curves, oracle_every)
    if png:
        plot(curves, png)
    return rows, curves
