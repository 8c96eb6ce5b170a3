"""kvsimd.testing.random_decoder / random_encoder_decoder: tiny random models without torch."""
import doctest
import math

import numpy as np
import pytest

import kvsimd.testing
from kvsimd import Decoder, EncoderDecoder, KVSimdError, reference
from kvsimd.testing import REFERENCE_BOUNDS, random_decoder, random_encoder_decoder

DIMS = dict(vocab_size=41, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, ffn_dim=36)


def arrays(model):
    """Every weight array of a model, by name (for shape and determinism checks)."""
    out = {"embed": model.embed, "lm_head": model.lm_head}
    for name in ("lm_bias", "pos_embed"):
        if getattr(model, name) is not None:
            out[name] = getattr(model, name)
    for name in ("final_norm", "embed_norm"):
        nw = getattr(model, name)
        if nw is not None:
            out[name + ".w"] = nw.w
    for i, lw in enumerate(model.layers):
        for part in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
            if getattr(lw.attn, part) is not None:
                out["layers[%d].attn.%s" % (i, part)] = getattr(lw.attn, part)
        for part in ("w1", "w2", "w3", "b1", "b2"):
            if getattr(lw.ffn, part) is not None:
                out["layers[%d].ffn.%s" % (i, part)] = getattr(lw.ffn, part)
        for part in ("norm1", "norm2"):
            out["layers[%d].%s.w" % (i, part)] = getattr(lw, part).w
    return out


def test_shapes_and_scale():
    d = random_decoder(**DIMS, ffn_gated=True, bias=True)
    assert isinstance(d, Decoder)
    V, D, H, Hkv, Dh, F = 41, 24, 4, 2, 6, 36
    a = arrays(d)
    assert a["embed"].shape == (V, D) and a["lm_head"].shape == (D, V) and a["lm_bias"].shape == (V,)
    assert len(d.layers) == 2
    want = {"attn.wq": (D, H * Dh), "attn.wk": (D, Hkv * Dh), "attn.wv": (D, Hkv * Dh), "attn.wo": (H * Dh, D),
            "attn.bq": (H * Dh,), "attn.bk": (Hkv * Dh,), "attn.bv": (Hkv * Dh,), "attn.bo": (D,),
            "ffn.w1": (D, F), "ffn.w3": (D, F), "ffn.w2": (F, D), "ffn.b2": (D,), "norm1.w": (D,), "norm2.w": (D,)}
    for part, shape in want.items():
        assert a["layers[1]." + part].shape == shape, part
    assert "layers[0].ffn.b1" not in a            # a gated FFN takes no b1
    assert all(x.dtype == np.float32 for x in a.values())
    # a linear layer keeps the size of its input: std of wq ~ 1/sqrt(d_model)
    assert abs(a["layers[0].attn.wq"].std() * math.sqrt(D) - 1) < 0.15
    logits = d.forward([1, 2, 3, 4, 5])
    assert logits.shape == (5, V)
    assert 0.3 < np.abs(logits).max() < 30          # O(1)
    assert np.abs(random_decoder(**DIMS, scale=0.01).forward([1, 2, 3])).max() < 0.3 * np.abs(logits).max()


def test_no_bias_by_default_and_layernorm_has_its_bias():
    d = random_decoder(**DIMS)
    assert d.lm_bias is None and d.layers[0].attn.bq is None and d.layers[0].ffn.b1 is None
    assert d.layers[0].norm1.b is None               # rmsnorm: no bias
    d = random_decoder(**DIMS, norm="layernorm")
    assert d.layers[0].norm1.b is not None and d.final_norm.b is not None


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = (arrays(random_decoder(**DIMS, seed=s, bias=True, position="learned")) for s in (3, 3, 4))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        assert not np.array_equal(a[name], c[name]), name


OPTIONS = [("activation", "gelu"), ("activation", "gelu_tanh"), ("activation", "relu"), ("ffn_gated", True),
           ("norm", "layernorm"), ("norm_eps", 1e-3), ("pre_norm", False), ("parallel_residual", True),
           ("position", "alibi"), ("position", "learned"), ("position", "sinusoidal"), ("rope_theta", 1e5),
           ("rope_style", "gptj"), ("rotary_dim", 4), ("max_positions", 64), ("embed_scale", 2.5),
           ("embed_norm", True), ("final_norm", False), ("bos_token_id", 1), ("eos_token_id", 2),
           ("decoder_start_token_id", 3), ("family", "toy")]


@pytest.mark.parametrize("field, value", OPTIONS, ids=["%s=%s" % o for o in OPTIONS])
def test_every_option_is_accepted(field, value):
    d = random_decoder(**DIMS, **{field: value})
    assert getattr(d.cfg, field) == value
    assert d.forward([1, 2, 3]).shape == (3, 41)
    if field == "embed_norm":
        assert d.embed_norm is not None
    if field == "final_norm":
        assert d.final_norm is None
    if field == "position" and value == "learned":
        assert d.pos_embed.shape == (256, 24)        # max_positions defaults to 256 for a table


def test_learned_table_covers_the_offset():
    d = random_decoder(**DIMS, position="learned", position_offset=2, max_positions=10)
    assert d.pos_embed.shape == (12, 24)
    assert d.forward(list(range(10))).shape == (10, 41)


@pytest.mark.parametrize("kwargs, word", [
    (dict(nrom="layernorm"), "nrom"),
    (dict(norm="batchnorm"), "norm"),
    (dict(activation="tanh"), "activation"),
    (dict(position="nope"), "position"),
    (dict(rope_style="llama"), "rope_style"),
    (dict(rotary_dim=5), "rotary_dim"),
    (dict(pre_norm="yes"), "pre_norm"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(scale=0.0), "scale"),
    (dict(scale=float("nan")), "scale"),
    (dict(bias=1), "bias"),
    (dict(cross_attention=True), "cross_attention"),
])
def test_a_bad_option_is_a_kvsimd_error_naming_it(kwargs, word):
    with pytest.raises(KVSimdError, match=r"\b%s\b" % word):
        random_decoder(**DIMS, **kwargs)


@pytest.mark.parametrize("kwargs, word", [(dict(n_heads=5), "n_heads"), (dict(d_model=0), "d_model"),
                                          (dict(vocab_size="41"), "vocab_size")])
def test_a_bad_dimension_is_a_kvsimd_error_naming_it(kwargs, word):
    with pytest.raises(KVSimdError, match=r"\b%s\b" % word):
        random_decoder(**dict(DIMS, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(vocab_size=2**40), dict(ffn_dim=2**40)])
def test_dimensions_too_big_for_memory_are_refused_before_a_weight_is_drawn(kwargs):
    """Weights larger than this machine's memory (4 bytes x 2**45 and more, far above any machine
    these tests run on): a KVSimdValueError naming the dimensions and the size, before any is
    drawn -- numpy raised MemoryError, or the OOM killer could end the process mid-draw.  (One
    array too big each: without the check these fail at once rather than draw for hours.)"""
    name, value = next(iter(kwargs.items()))
    for make in (random_decoder, random_encoder_decoder):
        with pytest.raises(KVSimdError, match=r"GiB of float32 weights, more than this machine's .* GiB of memory") as e:
            make(**dict(DIMS, **kwargs))
        assert "%s=%d" % (name, value) in str(e.value)


@pytest.mark.parametrize("gated, position", [(False, "rope"), (True, "learned")])
def test_the_memory_check_counts_what_is_drawn(gated, position):
    """The size the check compares with the machine's memory is the weights' own: within 5% of the
    bytes of the drawn matrices and tables (norms and biases are the rest), decoder and
    encoder-decoder (whose encoder shares the decoder's embeddings), so that many small layers are
    counted as one huge matrix is."""
    from kvsimd.testing import _weights_bytes
    dims = dict(DIMS, vocab_size=512, d_model=64, ffn_dim=128)

    def drawn(stack, cross=False):
        n = 0
        for l in stack:
            n += sum(getattr(l.attn, w).nbytes for w in ("wq", "wk", "wv", "wo"))
            n += sum(getattr(l.ffn, w).nbytes for w in ("w1", "w2", "w3") if getattr(l.ffn, w) is not None)
            if cross:
                n += sum(getattr(l.cross, w).nbytes for w in ("wq", "wk", "wv", "wo"))
        return n
    d = random_decoder(**dims, ffn_gated=gated, position=position)
    got = d.embed.nbytes + d.lm_head.nbytes + (d.pos_embed.nbytes if d.pos_embed is not None else 0) + drawn(d.layers)
    assert got == pytest.approx(_weights_bytes(d.cfg), rel=0.05)
    m = random_encoder_decoder(**dims, enc_layers=3, ffn_gated=gated)
    got = (m.embed.nbytes + m.lm_head.nbytes + m.pos_embed.nbytes + m.enc_pos.nbytes + drawn(m.layers, cross=True)
           + drawn(m.enc_layers))
    assert got == pytest.approx(_weights_bytes(m.cfg, cross=True) + _weights_bytes(m.enc_cfg, embeddings=False),
                                rel=0.05)


def test_encoder_decoder_shapes_and_options():
    m = random_encoder_decoder(**DIMS, enc_layers=3, pre_norm=False, embed_norm=True, bias=True)
    assert isinstance(m, EncoderDecoder)
    assert len(m.enc_layers) == 3 and len(m.layers) == 2
    assert m.cfg.cross_attention and not m.enc_cfg.cross_attention
    assert m.layers[0].cross.wk.shape == (24, 2 * 6) and m.enc_layers[0].cross is None
    assert m.enc_embed_norm is not None and m.cfg.decoder_start_token_id == 40
    assert m.forward([1, 2, 3], [40, 5]).shape == (2, 41)
    for kwargs, word in ((dict(position="rope"), "position"), (dict(cross_attention=False), "cross_attention"),
                         (dict(enc_layers=0), "enc_layers"), (dict(nrom=1), "nrom"),
                         (dict(parallel_residual=True), "parallel_residual")):
        with pytest.raises(KVSimdError, match=r"\b%s\b" % word):
            random_encoder_decoder(**DIMS, **kwargs)


def test_docstring_examples():
    assert doctest.testmod(kvsimd.testing, raise_on_error=True).attempted >= 7


# ------------------------------------------------------------------------------ greedy decoding
def assert_greedy_is_reference_greedy(model, prompt, tokens, src=None, bound=REFERENCE_BOUNDS["float32"]):
    """Each generated token is the argmax of the reference logits (recomputed from scratch over the
    prompt and the tokens before it), or within the float32 bound of it (a near tie)."""
    seq = list(prompt)
    exact = 0
    for i, tok in enumerate(tokens):
        ref = reference.forward(model, seq, src=src)[-1]
        best = int(ref.argmax())
        assert ref[best] - ref[tok] <= 2 * bound * np.abs(ref).max(), (i, tok, best)
        exact += tok == best
        seq.append(tok)
    return exact


GREEDY = [dict(), dict(norm="layernorm", activation="gelu", parallel_residual=True, bias=True, rotary_dim=2),
          dict(position="alibi", pre_norm=False, activation="gelu_tanh"),
          dict(position="learned", position_offset=2, ffn_gated=True, rope_style="gptj", embed_norm=True)]


@pytest.mark.parametrize("opts", GREEDY, ids=["default", "neox-like", "alibi-postnorm", "learned-gated"])
def test_generate_equals_reference_greedy(opts, rng):
    d = random_decoder(**DIMS, seed=11, **opts)
    prompt = list(rng.integers(0, 41, 6))
    tokens = list(d.generate(prompt, max_new_tokens=16, cache_dtype="float32"))
    assert len(tokens) == 16
    assert assert_greedy_is_reference_greedy(d, prompt, tokens) >= 15


def test_encoder_decoder_generate_equals_reference_greedy(rng):
    m = random_encoder_decoder(**DIMS, seed=12, pre_norm=False, norm="layernorm", bias=True)
    src = list(rng.integers(0, 40, 9))
    tokens = list(m.generate(src, max_new_tokens=12, cache_dtype="float32", stop_tokens=()))
    assert len(tokens) == 12
    assert assert_greedy_is_reference_greedy(m, [m.cfg.decoder_start_token_id], tokens, src=src) >= 11


@pytest.mark.parametrize("bound, error", [("x", "a real number"), (float("nan"), ">= 0"), (-1, ">= 0")])
def test_assert_matches_reference_checks_its_bound(bound, error):
    """A bound that is not a number >= 0 is a KVSimdError naming it (a string raised numpy's
    TypeError from the comparison; NaN let every error pass)."""
    from kvsimd.testing import assert_matches_reference
    d = random_decoder(**DIMS)
    logits = d.forward([1, 2, 3])
    with pytest.raises(KVSimdError, match=r"\bbound\b.*" + error):
        assert_matches_reference(d, [1, 2, 3], logits, bound=bound)
    assert assert_matches_reference(d, [1, 2, 3], logits, bound=1.0) < 1e-3
