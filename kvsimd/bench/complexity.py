"""Seed 003's complexity argument, measured: generating M tokens from an N-token source with

* ``none``: no cache -- the encoder re-runs and the decoder recomputes its whole prefix every
  step (O(M^3) attention work in total for a fixed source);
* ``encoder``: the encoder output hoisted out of the loop, the decoder still recomputed
  (O(M^3) as well, without the N-dependent term);
* ``cached``: encoder once, cross-attention K/V once, a self-attention KV cache (O(M^2)).

For each regime and M: wall time and the token positions the model processed (reported by the
model itself to an attached :class:`PositionCounter`, not computed), then the exponent of a
least-squares fit of log time against log M over the larger Ms.  Also reproduces the seed's 107,450 / 6,074 / 1,124 token
positions for N = 1024, M = 100.  The model is a tiny random encoder-decoder built here, so
the figures show the algorithm, not BLAS.
"""
import math
import time

import numpy as np

import kvsimd
from kvsimd.errors import KVSimdValueError
from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights
from kvsimd.observe import Observer, observe

REGIMES = ("none", "encoder", "cached")
SEED_COUNTS = {"none": 107_450, "encoder": 6_074, "cached": 1_124}


def tiny_encoder_decoder(d=32, heads=4, layers=2, vocab=96, ffn=64, max_positions=4096, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * (0.6 / math.sqrt(s[0]))).astype(np.float32)  # noqa: E731
    dh = d // heads

    def cfg(cross):
        return ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                           head_dim=dh, ffn_dim=ffn, activation="gelu", norm="layernorm", norm_eps=1e-5,
                           position="sinusoidal", max_positions=max_positions, cross_attention=cross,
                           decoder_start_token_id=1, family="tiny-encdec")

    def attn():
        return AttentionWeights(r(d, d), r(d, d), r(d, d), r(d, d))

    def nw():
        return NormWeights(np.ones(d, np.float32), np.zeros(d, np.float32))

    enc = [LayerWeights(attn(), FFNWeights(r(d, ffn), r(ffn, d)), nw(), nw()) for _ in range(layers)]
    dec = [LayerWeights(attn(), FFNWeights(r(d, ffn), r(ffn, d)), nw(), nw(), cross=attn(), norm_cross=nw())
           for _ in range(layers)]
    return kvsimd.EncoderDecoder(cfg(True), cfg(False), None, enc, nw(), None, embed=r(vocab, d) * 8,
                                 layers=dec, final_norm=nw(), lm_head=r(d, vocab))


class PositionCounter(Observer):
    """Counts what a model reports: token positions per half (``encoder``, ``decoder``) and
    (layer, sequence) cross-attention projections (``projections``)."""

    def __init__(self):
        self.encoder = self.decoder = self.projections = 0

    def positions(self, part, n):
        setattr(self, part, getattr(self, part) + n)

    def cross_projections(self, n):
        self.projections += n


def greedy_counting(model, src, max_new_tokens, regime="cached", decoder_start=None):
    """Greedy decoding of exactly ``max_new_tokens`` tokens of the encoder-decoder ``model`` in
    one of seed 003's regimes: ``"none"`` (encoder re-run and decoder recomputed every step),
    ``"encoder"`` (encoder hoisted, decoder recomputed), ``"cached"`` (encoder once, cross and
    self caches).  Returns (tokens, encoder positions, decoder positions), the positions as the
    model reported them to a :class:`PositionCounter` during the real calls."""
    if not (isinstance(regime, str) and regime in REGIMES):
        raise KVSimdValueError("regime must be 'none', 'encoder' or 'cached', got %r" % (regime,))
    # generate() checks src, decoder_start and max_new_tokens as for any user, and runs nothing
    # until its first next(): the same rules, the same messages
    model.generate(src, decoder_start=decoder_start, max_new_tokens=max_new_tokens, stop_tokens=())
    start = int(model.cfg.decoder_start_token_id if decoder_start is None else decoder_start)
    out = [start]
    with observe(model, PositionCounter()) as count:
        if regime == "cached":
            cross = model.cross_for([src])
            cache = model.new_cache(batch=1, capacity=max_new_tokens + 1)
            logits = model.prefill([start], cache=cache, cross=cross)
            for i in range(max_new_tokens):
                out.append(int(np.argmax(logits)))
                if i + 1 < max_new_tokens:
                    logits = model.step([out[-1]], cache=cache, cross=cross)[0]
        else:
            enc = model.encode(src) if regime == "encoder" else None
            for _ in range(max_new_tokens):
                e = model.encode(src) if regime == "none" else enc
                out.append(int(np.argmax(model.forward(src, out, enc_out=e)[-1])))
    return out[1:], count.encoder, count.decoder


def fit_exponent(ms, ys):
    """Slope of log y against log M (least squares)."""
    x, y = np.log(np.asarray(ms, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(x, y, 1)[0])


def run(ms=(25, 50, 100, 200, 400, 1000), n_src=64, seed_check=True, progress=None):
    model = tiny_encoder_decoder()
    rng = np.random.default_rng(1)
    src = list(rng.integers(2, model.cfg.vocab_size, n_src))
    rows = []
    for regime in REGIMES:
        for m in ms:
            t0 = time.perf_counter()
            toks, enc, dec = greedy_counting(model, src, m, regime=regime)
            dt = time.perf_counter() - t0
            rows.append({"op": "complexity", "regime": regime, "N": n_src, "M": m, "seconds": dt,
                         "token_positions": enc + dec, "encoder_positions": enc, "decoder_positions": dec})
            if progress:
                progress(rows[-1])
    fits = []
    for regime in REGIMES:
        rs = [r for r in rows if r["regime"] == regime]
        upper = rs[-3:]   # the three largest Ms: closest to the asymptote
        fits.append({"op": "complexity-fit", "regime": regime, "N": n_src,
                     "M_range": [upper[0]["M"], upper[-1]["M"]],
                     "time_exponent": fit_exponent([r["M"] for r in upper], [r["seconds"] for r in upper]),
                     "positions_exponent": fit_exponent([r["M"] for r in upper],
                                                        [r["token_positions"] for r in upper])})
        if progress:
            progress(fits[-1])
    seed = []
    if seed_check:
        src = list(rng.integers(2, model.cfg.vocab_size, 1024))
        for regime in REGIMES:
            t0 = time.perf_counter()
            _, enc, dec = greedy_counting(model, src, 100, regime=regime)
            seed.append({"op": "complexity-seed003", "regime": regime, "N": 1024, "M": 100,
                         "token_positions": enc + dec, "expected": SEED_COUNTS[regime],
                         "seconds": time.perf_counter() - t0})
            if progress:
                progress(seed[-1])
    return rows + fits + seed


def plot(rows, path):
    from kvsimd.bench.plots import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    fits = {r["regime"]: r for r in rows if r["op"] == "complexity-fit"}
    for regime in REGIMES:
        rs = [r for r in rows if r["op"] == "complexity" and r["regime"] == regime]
        if rs:
            lab = regime + (" (slope %.2f)" % fits[regime]["time_exponent"] if regime in fits else "")
            ax.loglog([r["M"] for r in rs], [r["seconds"] for r in rs], "o-", label=lab)
    ax.set_xlabel("tokens generated M")
    ax.set_ylabel("total seconds")
    ax.set_title("Generating M tokens: no cache / encoder hoisted / full caching")
    ax.grid(True, which="both", lw=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
