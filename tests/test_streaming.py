"""Infinite generation (StreamingLLM): n_keep sinks + a ring-buffer window under each policy.

Reference: a fresh prefill of exactly the kept tokens at StreamingLLM positions (sinks
0..n_keep-1, the window contiguous after them).  For a one-layer model every policy must
match it: a token's K/V depend only on the token and its position, so re-rotating cached keys
(shift) or rotating the query twice (sink_query) is exactly a prefill at compressed positions.
With more layers, shift and sink_query keep K/V computed with their original context (the
StreamingLLM semantics) while reevaluate recomputes them, so only reevaluate is compared there.
Bounds: logits relative to max |logit|: 1e-4 (float32 cache), 2e-2 (float16 cache).
"""
import numpy as np
import pytest

from kvsimd import Decoder, KVSimdCapacityError
from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights

V = 53


def random_decoder(position="rope", style="neox", rotary_dim=None, n_layers=1, seed=0, d=32, H=4, Hkv=2):
    rng = np.random.default_rng(seed)
    Dh = d // H
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=n_layers, n_heads=H, n_kv_heads=Hkv, head_dim=Dh, ffn_dim=48,
                      activation="silu", ffn_gated=True, norm="rmsnorm", position=position, rope_style=style,
                      rotary_dim=rotary_dim, max_positions=8192, family="random-%s" % position)
    layers = [LayerWeights(AttentionWeights(r(d, H * Dh) * 3, r(d, Hkv * Dh) * 3, r(d, Hkv * Dh), r(H * Dh, d)),
                           FFNWeights(r(d, 48), r(48, d), r(d, 48)), NormWeights(1 + r(d)), NormWeights(1 + r(d)))
              for _ in range(n_layers)]
    return Decoder(cfg, embed=r(V, d) * 3, layers=layers, final_norm=NormWeights(1 + r(d)), lm_head=r(d, V),
                   pos_embed=r(8192, d) if position == "learned" else None)


def run_stream(dec, tokens, prompt_len, **kw):
    cache = dec.new_cache(**kw)
    logits = dec.prefill(tokens[:prompt_len], cache=cache)
    for t in tokens[prompt_len:]:
        logits = dec.step([t], cache=cache)[0]
    return cache, logits


def fresh(dec, kept):
    c = dec.new_cache(capacity=len(kept) + 1, dtype="float32")
    return dec.prefill(kept, cache=c)


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


MODELS = {
    "rope-gptj": dict(position="rope", style="gptj"),
    "rope-neox": dict(position="rope", style="neox"),
    "rope-partial": dict(position="rope", style="neox", rotary_dim=4),
    "alibi": dict(position="alibi"),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("policy", ["shift", "sink_query", "reevaluate"])
def test_policies_equal_fresh_prefill_of_kept_tokens(model, policy):
    dec = random_decoder(**MODELS[model])
    toks = list(np.random.default_rng(1).integers(0, V, 90))
    cache, logits = run_stream(dec, toks, 10, capacity=24, n_keep=4, policy=policy, dtype="float32")
    kept = cache.tokens[0]
    assert len(kept) <= 24 and kept[:4] == toks[:4] and kept[-1] == toks[-1]
    # the window is the most recent tokens, contiguous
    assert kept[4:] == toks[len(toks) - (len(kept) - 4):]
    assert rel(logits, fresh(dec, kept)) <= 1e-4, (model, policy)


def test_reevaluate_equals_fresh_prefill_in_deep_models():
    for pos in ("rope", "learned"):
        dec = random_decoder(position=pos, n_layers=3, seed=2)
        toks = list(np.random.default_rng(3).integers(0, V, 70))
        cache, logits = run_stream(dec, toks, 8, capacity=20, n_keep=2, policy="reevaluate", n_discard=7,
                                   dtype="float32")
        assert rel(logits, fresh(dec, cache.tokens[0])) <= 1e-4


@pytest.mark.parametrize("policy", ["shift", "sink_query"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_no_drift_over_many_steps(policy, dtype, tol):
    """Errors after 3,000 tokens stay within the bound that holds after 300 (no accumulation:
    shift rotates any cached key at most floor((W - 1) / n_discard) times; sink_query never)."""
    dec = random_decoder(position="rope", style="gptj")
    toks = list(np.random.default_rng(4).integers(0, V, 3000))
    cache = dec.new_cache(capacity=64, n_keep=4, policy=policy, dtype=dtype)
    logits = dec.prefill(toks[:16], cache=cache)
    errs = {}
    for i, t in enumerate(toks[16:], start=17):
        logits = dec.step([t], cache=cache)[0]
        if i in (300, 3000):
            errs[i] = rel(logits, fresh(dec, cache.tokens[0]))
    assert errs[300] <= tol and errs[3000] <= tol, errs
    W, nd = 64 - 4, cache.n_discard
    assert cache.rotations.max() <= (W - 1) // nd
    if policy == "sink_query":
        assert cache.rotations.max() == 0


@pytest.mark.parametrize("policy", ["shift", "sink_query", "reevaluate"])
def test_batches_wrap_at_different_steps(policy):
    dec = random_decoder(position="rope", style="neox", seed=5)
    rng = np.random.default_rng(6)
    prompts = [list(rng.integers(0, V, n)) for n in (3, 14)]
    steps = [list(rng.integers(0, V, 40)) for _ in prompts]
    cache = dec.new_cache(batch=2, capacity=20, n_keep=2, policy=policy, dtype="float32")
    for b, p in enumerate(prompts):
        dec.prefill(p, cache=cache, seq=b)
    for i in range(40):
        batch_logits = dec.step([steps[0][i], steps[1][i]], cache=cache)
    for b in range(2):
        alone, logits = run_stream(dec, prompts[b] + steps[b], len(prompts[b]), capacity=20, n_keep=2, policy=policy,
                                   dtype="float32")
        assert alone.tokens[0] == cache.tokens[b]
        assert rel(batch_logits[b], logits) <= 1e-5


def test_generate_runs_past_capacity():
    dec = random_decoder(position="rope")
    out = list(dec.generate([1, 2, 3], max_new_tokens=200, capacity=32, n_keep=4, policy="shift"))
    assert len(out) == 200
    with pytest.raises(KVSimdCapacityError, match="cache full"):
        c = dec.new_cache(capacity=8)
        dec.prefill(list(range(8)), cache=c)
        dec.step([1], cache=c)


def test_bad_streaming_arguments():
    dec = random_decoder(position="rope")
    with pytest.raises(ValueError, match="n_keep must be in 0..capacity-1=15"):
        dec.new_cache(capacity=16, n_keep=16, policy="shift")
    with pytest.raises(ValueError, match="n_discard must be in 1..12"):
        dec.new_cache(capacity=16, n_keep=4, policy="shift", n_discard=13)
    with pytest.raises(ValueError, match="n_discard must be in 1..12"):
        dec.new_cache(capacity=16, n_keep=4, policy="shift", n_discard=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        dec.new_cache(capacity=16, policy="lru")
    learned = random_decoder(position="learned")
    with pytest.raises(ValueError, match="needs RoPE or ALiBi positions; this model has learned"):
        learned.new_cache(capacity=16, policy="shift")
    with pytest.raises(ValueError, match="needs RoPE or ALiBi"):
        learned.new_cache(capacity=16, policy="sink_query")
    assert learned.new_cache(capacity=16, policy="auto").policy == "reevaluate"
    assert dec.new_cache(capacity=16, policy="auto").policy == "shift"


def test_prefill_after_wrap_is_refused_and_changes_nothing():
    dec = random_decoder(position="rope")
    cache, _ = run_stream(dec, list(range(1, 40)), 5, capacity=16, n_keep=2, policy="sink_query")
    before = (cache.lengths.copy(), list(cache.tokens[0]), cache.keys(0).copy())
    with pytest.raises(ValueError, match="wrapped its ring buffer"):
        dec.prefill([1, 2], cache=cache)
    assert np.array_equal(cache.lengths, before[0]) and cache.tokens[0] == before[1]
    assert np.array_equal(cache.keys(0), before[2])
