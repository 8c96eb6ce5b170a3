"""Decoders under bad models, bad caches, bad arguments and interrupts.

* Every array the compiled decode step reads by pointer is checked against the ModelConfig when
  the model is built, and again after any assignment to a weight or config attribute; a cache of
  other dimensions is refused when a prefill/step starts.  Those calls read out of bounds on an
  unchecked build, so they run in a child process: a signal there fails the case instead of the
  whole run, and every case must end in a KVSimdError whose message names the argument.
* A step (with the discard a full streaming window makes first) and a prefill are transactions:
  a KeyboardInterrupt raised at any point inside leaves the cache exactly as it was, and
  generation continued afterwards gives the logits of an uninterrupted run, bit for bit.
"""
import numpy as np
import pytest

import childcases

from kvsimd import CrossAttentionCache, Decoder, EncoderDecoder, KVCache, KVSimdError
from kvsimd.bench.complexity import greedy_counting
from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights

from test_streaming import V, random_decoder



def random_encoder_decoder(seed=0, d=32, H=4):
    """A tiny post-norm encoder-decoder (BART-like: LayerNorm, biases, learned positions, cross-attention)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    common = dict(vocab_size=V, d_model=d, n_heads=H, n_kv_heads=H, head_dim=d // H, ffn_dim=48, activation="gelu",
                  norm="layernorm", norm_eps=1e-5, pre_norm=False, position="learned", max_positions=64,
                  position_offset=2, embed_norm=True, final_norm=False, decoder_start_token_id=1, eos_token_id=2)
    dec_cfg = ModelConfig(n_layers=2, cross_attention=True, **common)
    enc_cfg = ModelConfig(n_layers=1, **common)

    def attn():
        return AttentionWeights(r(d, d), r(d, d), r(d, d), r(d, d), r(d), r(d), r(d), r(d))

    def ln():
        return NormWeights(1 + r(d), r(d))

    def layer(cross):
        return LayerWeights(attn(), FFNWeights(r(d, 48), r(48, d), None, r(48), r(d)), ln(), ln(),
                            attn() if cross else None, ln() if cross else None)

    return EncoderDecoder(dec_cfg, enc_cfg, enc_embed_pos=r(66, d), enc_layers=[layer(False)], enc_final_norm=None,
                          enc_embed_norm=ln(), embed=r(V, d), layers=[layer(True) for _ in range(2)], final_norm=None,
                          lm_head=r(d, V), pos_embed=r(66, d), embed_norm=ln())


# ---------------------------------------------------------------------------------------------- cases
CASES = {}


case = childcases.registrar(CASES)


def model(**kw):
    return random_decoder(n_layers=2, **kw)      # d_model 32, 4 heads / 2 KV heads, head_dim 8, ffn 48


def stepped(m, cache=None):
    """A cache with one prompt in it, and the model's step on it."""
    cache = cache or m.new_cache(capacity=16)
    m.prefill([1, 2, 3], cache=cache)
    return cache


def weights(**override):
    """Decoder(...) arguments of the tiny model, with some replaced."""
    m = model()
    kw = dict(cfg=m.cfg, embed=m.embed, layers=m.layers, final_norm=m.final_norm, lm_head=m.lm_head)
    kw.update(override)
    return kw


# built with mismatched arrays
@case(r"layers\[0\]\.norm1\.w must have shape \(32,\), got \(31,\)")
def build_short_norm():
    m = model()
    m.layers[0].norm1 = NormWeights(np.ones(31, np.float32))
    Decoder(**weights(layers=m.layers))


@case(r"embed must have shape \(53, 32\), got \(50, 32\)")
def build_short_embedding():
    Decoder(**weights(embed=np.zeros((50, 32), np.float32)))


@case(r"lm_head must have shape \(32, 53\), got \(32, 52\)")
def build_narrow_lm_head():
    Decoder(**weights(lm_head=np.zeros((32, 52), np.float32)))


@case(r"layers must be a list of cfg.n_layers=2 LayerWeights")
def build_missing_layer():
    Decoder(**weights(layers=model().layers[:1]))


@case(r"layers\[1\]\.attn\.wo must have shape \(32, 32\), got \(24, 32\)")
def build_short_wo():
    m = model()
    a = m.layers[1].attn
    m.layers[1].attn = AttentionWeights(a.wq, a.wk, a.wv, a.wo[:24])
    Decoder(**weights(layers=m.layers))


@case(r"wq, wk, wv: the parts must agree")
def build_unfusable_qkv():
    AttentionWeights(np.zeros((32, 32)), np.zeros((31, 16)), np.zeros((32, 16)), np.zeros((32, 32)))


@case(r"ffn\.w3 is set but the config has ffn_gated=False")
def build_gate_without_gated_config():
    m = model()
    m.cfg.ffn_gated = False
    Decoder(**weights(cfg=m.cfg, layers=m.layers))


@case(r"cfg.n_heads=4 must be a multiple of n_kv_heads=3|n_heads=4 must be a multiple of n_kv_heads=3")
def build_bad_head_counts():
    ModelConfig(vocab_size=5, d_model=8, n_layers=1, n_heads=4, n_kv_heads=3, head_dim=2, ffn_dim=8)


@case(r"config.rotary_dim must be even and in 2..head_dim=8, got 12")
def build_rotary_wider_than_head():
    ModelConfig(vocab_size=5, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8, rotary_dim=12)


@case(r"cfg must be a ModelConfig, got None")
def build_without_config():
    Decoder(**weights(cfg=None))


@case(r"lm_head must be an array of real numbers, got None")
def build_without_lm_head():
    Decoder(**weights(lm_head=None))


@case(r"embed must be an array of real numbers, got str")
def build_with_text_embedding():
    Decoder(**weights(embed="abc"))


@case(r"final_norm must be a NormWeights, got 'int'")
def build_with_junk_final_norm():
    Decoder(**weights(final_norm=3))


# weights assigned after load: the next call validates again
@case(r"layers\[1\]\.norm1\.w must have shape \(32,\), got \(5,\)")
def step_after_norm_replaced_by_shorter():
    m = model()
    cache = stepped(m)
    m.layers[1].norm1.w = np.ones(5, np.float32)
    m.step([4], cache=cache)


@case(r"layers\[0\]\.attn\.wqkv must have shape \(32, 64\), got \(3, 3\)")
def step_after_wqkv_replaced():
    m = model()
    cache = stepped(m)
    m.layers[0].attn.wqkv = np.zeros((3, 3), np.float32)
    m.step([4], cache=cache)


@case(r"layers\[0\]\.attn\.wq must have shape \(32, 32\), got \(32, 40\)")
def step_after_wq_widened():
    m = model()
    cache = stepped(m)
    m.layers[0].attn.wq = np.zeros((32, 40), np.float32)     # (re-fused into a wider wqkv)
    m.step([4], cache=cache)


@case(r"layers\[1\]\.ffn\.b2 must have shape \(32,\), got \(33,\)")
def step_after_bias_lengthened():
    m = model()
    cache = stepped(m)
    m.layers[1].ffn.b2 = np.ones(33, np.float32)
    m.step([4], cache=cache)


@case(r"layers\[0\]\.norm2\.w must have dtype float32, got float64")
def step_after_float64_norm():
    m = model()
    cache = stepped(m)
    m.layers[0].norm2.w = np.ones(32)
    m.step([4], cache=cache)


@case(r"layers\[0\]\.norm2\.w must be C-contiguous")
def step_after_strided_norm():
    m = model()
    cache = stepped(m)
    m.layers[0].norm2.w = np.ones(64, np.float32)[::2]
    m.step([4], cache=cache)


@case(r"layers must be a list of cfg.n_layers=2 LayerWeights")
def step_after_layer_appended():
    m = model()
    cache = stepped(m)
    m.layers.append(m.layers[0])
    m.step([4], cache=cache)


@case(r"layers\[1\] must be a LayerWeights, got 'str'")
def step_after_layer_replaced_by_junk():
    m = model()
    cache = stepped(m)
    m.layers[1] = "junk"
    m.step([4], cache=cache)


@case(r"layers\[0\]\.attn\.wq must have shape \(32, 64\)")
def step_after_config_changed():
    m = model()
    cache = stepped(m)
    m.cfg.n_heads = 8
    m.step([4], cache=cache)


@case(r"lm_head must have shape \(32, 53\), got \(32, 10\)")
def generate_after_lm_head_replaced():
    m = model()
    m.lm_head = np.zeros((32, 10), np.float32)
    m.generate([1, 2], max_new_tokens=3)


@case(r"encoder|enc_layers\[0\]\.norm1\.w must have shape \(32,\), got \(4,\)")
def encoder_decoder_generate_after_encoder_norm_replaced():
    m = random_encoder_decoder()
    m.enc_layers[0].norm1.w = np.ones(4, np.float32)
    m.generate([5, 6, 7], max_new_tokens=3)


@case(r"layers\[1\]\.cross\.wq must have shape \(32, 32\), got \(32, 16\)")
def encoder_decoder_step_after_cross_weight_replaced():
    m = random_encoder_decoder()
    cross = m.cross_for([[5, 6, 7]])
    cache = m.new_cache(capacity=8)
    m.prefill([1], cache=cache, cross=cross)
    m.layers[1].cross.wq = np.zeros((32, 16), np.float32)
    m.step([4], cache=cache, cross=cross)


# caches that do not fit the model
@case(r"cache has \(n_layers, n_kv_heads, head_dim\) = \(1, 2, 8\), this model needs \(2, 2, 8\)")
def prefill_cache_with_fewer_layers():
    model().prefill([1, 2], cache=KVCache(1, 2, 8, 16))


@case(r"cache has \(n_layers, n_kv_heads, head_dim\) = \(1, 2, 8\), this model needs \(2, 2, 8\)")
def step_cache_with_fewer_layers():
    cache = KVCache(1, 2, 8, 16)
    cache.commit(3)
    model().step([1], cache=cache)


@case(r"cache has \(n_layers, n_kv_heads, head_dim\) = \(2, 4, 8\), this model needs \(2, 2, 8\)")
def step_cache_with_more_kv_heads():
    cache = KVCache(2, 4, 8, 16)
    cache.commit(3)
    model().step([1], cache=cache)


@case(r"cache has \(n_layers, n_kv_heads, head_dim\) = \(2, 2, 16\), this model needs \(2, 2, 8\)")
def step_cache_with_other_head_dim():
    cache = KVCache(2, 2, 16, 16)
    cache.commit(3)
    model().step([1], cache=cache)


@case(r"cache.policy 'auto' is not resolved")
def step_cache_with_unresolved_policy():
    m = model()
    m.prefill([1, 2], cache=KVCache(2, 2, 8, 4, policy="auto"))


@case(r"cache.policy 'shift' needs RoPE or ALiBi positions; this model has learned positions")
def step_shift_cache_on_learned_positions():
    m = random_decoder(position="learned")
    m.prefill([1, 2], cache=KVCache(1, 2, 8, 4, policy="shift"))


@case(r"cross must be a kvsimd.CrossAttentionCache, got None")
def encoder_decoder_prefill_without_cross():
    m = random_encoder_decoder()
    m.prefill([1], cache=m.new_cache(capacity=8), cross=None)


@case(r"cross has \(n_layers, n_kv_heads, head_dim\) = \(1, 4, 8\), this model needs \(2, 4, 8\)")
def encoder_decoder_step_with_short_cross():
    m = random_encoder_decoder()
    cache = m.new_cache(capacity=8)
    m.prefill([1], cache=cache, cross=m.cross_for([[5, 6]]))
    cross = CrossAttentionCache(1, 4, 8, 4)
    cross.commit(2)
    m.step([3], cache=cache, cross=cross)


@case(r"cross must be a kvsimd.CrossAttentionCache, got KVCache")
def encoder_decoder_step_with_a_kv_cache_as_cross():
    m = random_encoder_decoder()
    cache = m.new_cache(capacity=8)
    m.prefill([1], cache=cache, cross=m.cross_for([[5, 6]]))
    m.step([3], cache=cache, cross=m.new_cache(capacity=4))


@case(r"cache must be a kvsimd.KVCache, got CrossAttentionCache")
def decoder_prefill_with_a_cross_cache():
    m = random_decoder()
    m.prefill([1], cache=CrossAttentionCache(m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim, 8))


@case(r"tokens must be integer token ids, got dtype timedelta64")
def decoder_prefill_of_timedelta_ids():
    m = random_decoder()
    m.prefill(np.array([5], dtype="timedelta64[s]"), cache=m.new_cache(capacity=4))



@case(r"cross has 2 sequences, cache has 1")
def encoder_decoder_cross_of_other_batch():
    m = random_encoder_decoder()
    m.prefill([1], cache=m.new_cache(capacity=8), cross=m.cross_for([[5, 6], [7]]))


@case(r"cross has empty sequences \[0\]")
def encoder_decoder_empty_cross():
    m = random_encoder_decoder()
    m.prefill([1], cache=m.new_cache(capacity=8), cross=m.new_cross_cache())


# bad arguments of the public methods (issue 13, item 11)
@case(r"cache must be a kvsimd.KVCache, got None")
def prefill_cache_none():
    model().prefill([1, 2], cache=None)


@case(r"cache must be a kvsimd.KVCache, got 'abc'")
def step_cache_string():
    model().step([1], cache="abc")


@case(r"tokens must be a non-empty 1-D sequence of integer token ids, got None")
def prefill_tokens_none():
    model().prefill(None, cache=model().new_cache())


@case(r"tokens must be a non-empty 1-D sequence of integer token ids, got \[\[1\], \[2, 3\]\]")
def step_ragged_tokens():
    m = model()
    m.step([[1], [2, 3]], cache=stepped(m))


@case(r"seq must be an integer, got 'a'")
def prefill_seq_string():
    m = model()
    m.prefill([1], cache=m.new_cache(), seq="a")


@case(r"all_logits must be True or False, got 'yes'")
def prefill_all_logits_string():
    m = model()
    m.prefill([1], cache=m.new_cache(), all_logits="yes")


@case(r"capacity must be an integer, got 'x'")
def new_cache_capacity_string():
    model().new_cache(capacity="x")


@case(r"batch must be >= 1 .*got 0")
def new_cache_batch_zero():
    model().new_cache(batch=0)


@case(r"policy must be one of .*, got None")
def new_cache_policy_none():
    model().new_cache(policy=None)


@case(r"dtype must be float16, float32, int8, int4 or \"int8/int4\" \(int8 keys, int4 values\), got 'int16'")
def new_cache_dtype_int16():
    model().new_cache(dtype="int16")


@case(r"tokens must be a non-empty 1-D sequence of integer token ids, got \[\]")
def forward_empty():
    model().forward([])


@case(r"src must be a non-empty 1-D sequence of integer token ids, got None")
def encode_none():
    random_encoder_decoder().encode(None)


@case(r"src of 70 tokens exceeds the encoder's 64 positions")
def encode_too_long():
    random_encoder_decoder().encode(list(range(3, 50)) + list(range(3, 26)))


@case(r"sources must be a list of token-id lists")
def cross_for_flat_list():
    random_encoder_decoder().cross_for([5, 6, 7])


@case(r"sources\[1\] must be a non-empty 1-D sequence of integer token ids, got \[\]")
def cross_for_empty_source():
    random_encoder_decoder().cross_for([[5], []])


@case(r"sources must be a list of token ids or a list of such lists, got None")
def cross_for_none():
    random_encoder_decoder().cross_for(None)


@case(r"enc_out must have shape \(n >= 1, 32\), got \(3, 31\)")
def forward_bad_encoder_output():
    random_encoder_decoder().forward([5, 6], [1, 2], enc_out=np.zeros((3, 31), np.float32))


@case(r"max_new_tokens must be >= 0, got -1")
def greedy_counting_negative():
    greedy_counting(random_encoder_decoder(), [5, 6], -1)


@case(r"regime must be 'none', 'encoder' or 'cached', got 'x'")
def greedy_counting_bad_regime():
    greedy_counting(random_encoder_decoder(), [5, 6], 2, regime="x")


@case(r"decoder_start contain ids outside the vocabulary 0..52: \[1000\]")
def greedy_counting_bad_start():
    greedy_counting(random_encoder_decoder(), [5, 6], 2, decoder_start=1000)


child_results = childcases.results_fixture(__name__, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_model_cache_or_argument_raises_a_kvsimd_error(name, child_results):
    childcases.check(name, child_results, CASES)


def test_child_process_exits_cleanly(child_results):
    res, rc, err = child_results
    assert rc == 0, "exit status %d:\n%s" % (rc, err[-3000:])


def test_assigned_weights_are_used_by_every_path(rng):
    """Assigning wq (or w1) after load re-fuses wqkv (w13): prefill, step and the uncached forward of
    the changed model equal those of a model built from the changed weights."""
    m = model()
    toks = list(rng.integers(0, V, 9))
    new_wq = (rng.standard_normal((32, 32)) * 0.3).astype(np.float32)
    new_w1 = (rng.standard_normal((32, 48)) * 0.3).astype(np.float32)
    before = m.forward(toks)
    m.layers[1].attn.wq = new_wq
    m.layers[0].ffn.w1 = new_w1
    layers = []
    for lw in m.layers:
        a, f = lw.attn, lw.ffn
        layers.append(LayerWeights(AttentionWeights(a.wq, a.wk, a.wv, a.wo), FFNWeights(f.w1, f.w2, f.w3),
                                   lw.norm1, lw.norm2))
    ref = Decoder(m.cfg, embed=m.embed, layers=layers, final_norm=m.final_norm, lm_head=m.lm_head)
    want = ref.forward(toks)
    assert not np.allclose(want, before)
    np.testing.assert_array_equal(m.forward(toks), want)
    for d in (m, ref):
        cache = d.new_cache(capacity=16, dtype="float32")
        d.out = [d.prefill(toks[:5], cache=cache)] + [d.step([t], cache=cache)[0] for t in toks[5:]]
    np.testing.assert_array_equal(np.stack(m.out), np.stack(ref.out))
    np.testing.assert_allclose(np.stack(m.out), want[4:], rtol=0, atol=1e-4 * np.abs(want).max())


def test_gguf_tensor_that_does_not_fit_its_metadata_is_a_gguf_error(tmp_path, monkeypatch):
    """A tensor of another length than the file's metadata says is refused at load (it would be read
    out of bounds by the compiled step)."""
    from kvsimd.loaders import gguf as gguf_model
    from test_gguf import write_llama_gguf
    path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(path)
    real = gguf_model.load_tensors

    def short_norm(gf, **kw):
        w = real(gf, **kw)
        w["blk.0.attn_norm.weight"] = w["blk.0.attn_norm.weight"][:-1].copy()
        return w

    monkeypatch.setattr(gguf_model, "load_tensors", short_norm)
    with pytest.raises(gguf_model.GGUFError, match=r"tiny.gguf: layers\[0\]\.norm1\.w must have shape \(32,\), "
                                                   r"got \(31,\)"):
        Decoder.from_gguf(path)


@pytest.mark.parametrize("load", [Decoder.from_transformers, EncoderDecoder.from_transformers])
def test_from_transformers_needs_a_model(load):
    with pytest.raises(KVSimdError, match=r"needs a loaded transformers model, got NoneType"):
        load(None)


def test_fused_weight_parts_refuse_in_place_edits():
    """wq, wk, wv (and their biases) and a gated FFN's w1, w3 are multiplied as fused copies: an
    in-place edit of a part, or of a fused matrix, is refused (it would be silently lost), while
    assigning a new array re-fuses and changes the output."""
    from kvsimd.testing import random_decoder as tiny
    m = tiny(41, 24, 2, 4, 2, 6, 36, seed=1, ffn_gated=True)
    a, f = m.layers[0].attn, m.layers[0].ffn
    base = m.forward([1, 2, 3])
    for name, w in [("wq", a.wq), ("wk", a.wk), ("wv", a.wv), ("wqkv", a.wqkv), ("wkv", a.wkv),
                    ("w1", f.w1), ("w3", f.w3), ("w13", f.w13)]:
        with pytest.raises(ValueError, match="read-only"):
            w[:] = 0
    assert np.array_equal(m.forward([1, 2, 3]), base)
    a.wq = np.zeros_like(a.wq)
    f.w3 = np.zeros_like(f.w3)
    assert not np.array_equal(m.forward([1, 2, 3]), base)
    assert not a.wqkv[:, :a.wq.shape[1]].any() and not f.w13[:, f.w1.shape[1]:].any()
