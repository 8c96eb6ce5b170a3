"""RoPE frequency scaling (linear, llama3, yarn; GGUF's per-pair freq_factors) through every RoPE path.

References: transformers' ROPE_INIT_FUNCTIONS (inverse frequencies, attention factor) and its
Llama / Qwen2 / GPT-NeoX models (logits, greedy tokens); NumPy float64 (kvsimd.reference) for
the kernels, the streaming policies and the model.  Bounds: kvsimd.bounds.rope_bound (kernels),
test_models.TOL (against transformers), kvsimd.testing.REFERENCE_BOUNDS (against float64).
"""
import math
import pickle
import types

import numpy as np
import pytest

from kvsimd import KVCache, KVSimdTypeError, KVSimdValueError, ops, reference
from kvsimd.bounds import pair_norm, rope_bound
from kvsimd.cache import RopeSpec
from kvsimd.nn import ModelConfig
from kvsimd.nn.config import ROPE_SCALING, rope_frequencies
from kvsimd.testing import assert_matches_reference, random_decoder

from test_streaming import fresh, rel, run_stream

LLAMA31 = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


def config(rope_scaling, head_dim=16, rotary_dim=None, theta=10000.0, **kw):
    return ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=head_dim, ffn_dim=8,
                       rope_theta=theta, rotary_dim=rotary_dim, rope_scaling=rope_scaling, **kw)


def check(out, ref, tol, what):
    err = np.abs(np.asarray(out, np.float64) - ref) - tol
    assert err.max() <= 0, f"{what}: exceeds the bound by {err.max():.3g}"


# ------------------------------------------------------------------ (a) the formulas vs transformers
# (type, parameters, theta, head_dim, partial rotary factor)
HF_CASES = [
    ("linear", dict(factor=2.0), 10000.0, 16, 1.0),
    ("linear", dict(factor=8.0), 500000.0, 128, 1.0),
    ("llama3", {k: v for k, v in LLAMA31.items() if k != "type"}, 500000.0, 128, 1.0),          # Llama 3.1
    ("llama3", dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
     500000.0, 64, 1.0),                                                                          # Llama 3.2
    ("llama3", dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=16.0, original_max_position_embeddings=64),
     10000.0, 16, 1.0),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=32768), 1e6, 128, 1.0),            # Qwen2.5
    ("yarn", dict(factor=4.0, original_max_position_embeddings=64, beta_fast=8.0, beta_slow=0.5, truncate=False),
     10000.0, 16, 1.0),
    ("yarn", dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),
     10000.0, 64, 1.0),
    ("yarn", dict(factor=2.0, original_max_position_embeddings=64, attention_factor=1.25), 10000.0, 32, 0.5),
    ("yarn", dict(factor=3.0, original_max_position_embeddings=100, beta_fast=20.0, beta_slow=2.0), 5000.0, 48, 0.5),
]


def hf_frequencies(kind, params, theta, head_dim, partial):
    transformers = pytest.importorskip("transformers", reason="the frequency tests need transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    orig = params.get("original_max_position_embeddings", 512)
    rp = dict(rope_type=kind, rope_theta=theta, **params)
    if partial != 1.0:
        rp["partial_rotary_factor"] = partial
    c = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                 max_position_embeddings=int(orig * params.get("factor", 1.0)), rope_parameters=rp)
    inv, att = ROPE_INIT_FUNCTIONS[kind](c, None)
    return inv.double().numpy(), float(att)


@pytest.mark.parametrize("case", range(len(HF_CASES)))
def test_frequencies_equal_transformers(case):
    kind, params, theta, head_dim, partial = HF_CASES[case]
    want, want_att = hf_frequencies(kind, params, theta, head_dim, partial)
    cfg = config(dict(type=kind, **params), head_dim=head_dim, rotary_dim=int(head_dim * partial), theta=theta)
    inv, att = rope_frequencies(cfg)
    assert inv.dtype == np.float64 and inv.shape == want.shape
    # transformers computes in float32: a few float32 ulps (theta ** x rounds x's float32 exponent)
    assert np.abs(inv / want - 1).max() <= 4e-6, (kind, params, np.abs(inv / want - 1).max())
    assert att == pytest.approx(want_att, rel=1e-12, abs=0)
    if kind == "yarn":
        assert att != 1.0
    spec = RopeSpec(theta, "neox", cfg.rotary_dim, head_dim, inv, att)
    assert np.array_equal(spec.frequencies, inv) and spec.attn_factor == att


def test_gguf_freq_factors_reproduce_llama3():
    """GGUF files store Llama 3.1's adjustment as rope_freqs (llama.cpp's converter: 1 where the
    wavelength is short, factor where long, 1 / ((1 - s) / factor + s) between); dividing the
    plain frequencies by them is transformers' llama3."""
    kind, params, theta, head_dim, _ = HF_CASES[2]
    want, _ = hf_frequencies(kind, params, theta, head_dim, 1.0)
    base = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    f, lo, hi, orig = (params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings"))
    ff = []
    for b in base:
        w = 2 * math.pi / b
        s = (orig / w - lo) / (hi - lo)
        ff.append(1.0 if w < orig / hi else f if w > orig / lo else 1 / ((1 - s) / f + s))
    inv, att = rope_frequencies(config(dict(type="default", freq_factors=tuple(ff)), head_dim=head_dim, theta=theta))
    assert np.abs(inv / want - 1).max() <= 4e-6 and att == 1.0
    # with linear scaling they divide the scaled frequencies
    lin, _ = rope_frequencies(config(dict(type="linear", factor=2.0, freq_factors=ff), head_dim=head_dim, theta=theta))
    np.testing.assert_allclose(lin, base / 2.0 / np.array(ff), rtol=1e-15)


def test_no_scaling_keeps_the_theta_frequencies():
    assert rope_frequencies(config(None)) == (None, 1.0)
    inv, att = rope_frequencies(config(dict(type="default")))
    np.testing.assert_allclose(inv, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-15)
    assert att == 1.0
    spec = RopeSpec(10000.0, "neox", 16, 16)
    assert spec.inv_freq is None
    np.testing.assert_allclose(spec.frequencies, inv, rtol=1e-15)


# ------------------------------------------------------------------ the kernels, every row
def scaled_case(rng, rd):
    inv = 10000.0 ** (-np.arange(0, rd, 2) / rd) / rng.uniform(1.0, 8.0, rd // 2)
    return inv, 1.3


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("H,N,D,rd", [(2, 19, 64, 64), (3, 5, 80, 32), (1, 33, 128, 128)])
def test_apply_rope_then_shift_with_frequencies_and_factor(row, rng, dtype, style, H, N, D, rd):
    """apply_rope multiplies the rotated pairs by the factor; a shift turns them by the delta's
    angles alone, so a key rotated at p then shifted by d is the key rotated at p + d."""
    inv, f = scaled_case(rng, rd)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2 ** 21, N, dtype=np.int64)
    got = x.copy()
    row.apply_rope(got, pos, style=style, rotary_dim=rd, inv_freq=inv, attn_factor=f)
    exact = reference.apply_rope(x, pos, style=style, rotary_dim=rd, inv_freq=inv, attn_factor=f)
    norm = pair_norm(x, style, rd)
    check(got, exact, rope_bound(row.isa, dtype, norm, exact, factor=f), f"{row.isa} apply")
    assert np.array_equal(got[..., rd:].view(np.uint8), x[..., rd:].view(np.uint8))
    assert np.abs(exact[..., :rd]).max() > 1.2 * np.abs(reference.apply_rope(x, pos, style=style, rotary_dim=rd,
                                                                              inv_freq=inv)[..., :rd]).max()
    for d in (-7, 2 ** 20):
        a = got.copy()
        row.shift_keys(a, d, style=style, rotary_dim=rd, inv_freq=inv)
        exact = reference.apply_rope(x, pos + d, style=style, rotary_dim=rd, inv_freq=inv, attn_factor=f)
        check(a, exact, rope_bound(row.isa, dtype, norm, exact, calls=2, factor=f), f"{row.isa} shift {d}")


def test_explicit_theta_frequencies_give_the_same_bits(isa, rng):
    x = rng.standard_normal((2, 9, 64)).astype(np.float16)
    pos = rng.integers(0, 2 ** 31, 9, dtype=np.int64)
    a, b = x.copy(), x.copy()
    ops.apply_rope(a, pos, theta=5e5, style="neox")
    ops.apply_rope(b, pos, theta=5e5, style="neox", inv_freq=RopeSpec(5e5, "neox", 64, 64).frequencies,
                   attn_factor=1.0)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_cache_shift_range_takes_the_frequencies(rng):
    inv, _ = scaled_case(rng, 8)
    cache = KVCache(2, 2, 16, 12, dtype="float32")
    keys = rng.standard_normal((2, 12, 16)).astype(np.float32)
    for layer in range(2):
        cache.write(layer, keys, -keys)
    cache.commit(12)
    cache.shift_range(0, 3, 9, -5, 1e4, "gptj", 8, inv_freq=inv)
    want = keys.copy()
    ops.shift_keys(want, -5, theta=1e4, style="gptj", rotary_dim=8, inv_freq=inv, start=3, stop=9)
    for layer in range(2):
        assert np.array_equal(cache.keys(layer), want) and np.array_equal(cache.values(layer), -keys)


# ------------------------------------------------------------------ (b) models against transformers
def tm():
    return pytest.importorskip("test_models", reason="the model tests need torch and transformers")


def scaled_models():
    T = tm().transformers
    V = tm().V
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    return {
        "llama-linear": T.LlamaConfig(**common, max_position_embeddings=512,
                                      rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
        "llama-llama3": T.LlamaConfig(**common, max_position_embeddings=512, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64)),
        "llama-yarn": T.LlamaConfig(**common, max_position_embeddings=256, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
        "qwen2-yarn-betas": T.Qwen2Config(**common, max_position_embeddings=128, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e5, factor=2.0, original_max_position_embeddings=64, beta_fast=16.0,
            beta_slow=2.0, attention_factor=1.4)),
        "gpt_neox-yarn-partial": T.GPTNeoXConfig(
            vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                partial_rotary_factor=0.5)),
    }


_MODELS = {}


def scaled(name):
    if name not in _MODELS:
        t = tm()
        t.torch.manual_seed(sum(map(ord, name)))
        m = t.transformers.AutoModelForCausalLM.from_config(scaled_models()[name]).eval()
        from kvsimd import Decoder
        _MODELS[name] = (m, Decoder.from_transformers(m))
    return _MODELS[name]


MODEL_NAMES = ["llama-linear", "llama-llama3", "llama-yarn", "qwen2-yarn-betas", "gpt_neox-yarn-partial"]


def test_model_configs_scale():
    for name in MODEL_NAMES:
        _, d = scaled(name)
        sc = d.cfg.rope_scaling
        assert sc["type"] == name.split("-")[1]
        inv, att = rope_frequencies(d.cfg)
        assert np.array_equal(d.rope.frequencies, inv) and d.rope.attn_factor == att
        assert not np.allclose(inv, RopeSpec(d.cfg.rope_theta, "neox", d.cfg.rotary_dim, d.cfg.head_dim).frequencies)
    assert scaled("gpt_neox-yarn-partial")[1].cfg.rotary_dim == 8
    assert scaled("qwen2-yarn-betas")[1].rope.attn_factor == 1.4


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_and_steps_past_the_original_context_match_transformers(name, dtype, rng):
    t = tm()
    m, d = scaled(name)
    toks = rng.integers(0, t.V, 100)      # the original context is 64 tokens
    ref = t.hf_logits(m, toks)
    cache = d.new_cache(capacity=128, dtype=dtype)
    errs = [t.rel(d.prefill(toks[:70], cache=cache, all_logits=True), ref[:70])]
    errs += [t.rel(d.step([toks[i]], cache=cache)[0], ref[i]) for i in range(70, 100)]
    assert max(errs) <= t.TOL[dtype], (name, dtype, max(errs))
    assert t.rel(d.forward(toks), ref) <= t.TOL["float32"]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_tokens_identical_to_transformers(name, rng):
    t = tm()
    torch = t.torch
    m, d = scaled(name)
    prompt = list(rng.integers(0, t.V, 80))
    ours = list(d.generate(prompt, max_new_tokens=16, cache_dtype="float32"))
    seq, past, inp = list(prompt), None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(16):
            out = m(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
            seq.append(nxt)
            inp = torch.tensor([[nxt]])
    assert ours == seq[len(prompt):]


def test_reference_model_follows_the_scaling():
    """The float64 reference rotates with the same frequencies and factor: kvsimd matches it, and
    it differs from the unscaled model."""
    toks = np.random.default_rng(3).integers(0, 53, 40)
    for sc in (dict(type="linear", factor=3.0), dict(LLAMA31, original_max_position_embeddings=16),
               dict(type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.5)):
        dec = random_decoder(53, 32, 2, 4, 2, 8, 48, seed=5, rope_scaling=sc)
        plain = random_decoder(53, 32, 2, 4, 2, 8, 48, seed=5)
        assert_matches_reference(dec, toks, dec.forward(toks))
        cache = dec.new_cache(capacity=40, dtype="float16")
        logits = np.concatenate([dec.prefill(toks[:30], cache=cache, all_logits=True)] +
                                [dec.step([x], cache=cache) for x in toks[30:]])
        assert_matches_reference(dec, toks, logits, cache_dtype="float16")
        assert rel(reference.forward(plain, toks), reference.forward(dec, toks)) > 1e-2


# ------------------------------------------------------------------ (c) streaming with a scaled spec
STREAM_SCALINGS = {
    "linear": dict(type="linear", factor=4.0),
    "llama3": dict(LLAMA31, original_max_position_embeddings=16),
    "yarn": dict(type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.5),
}


@pytest.mark.parametrize("kind", list(STREAM_SCALINGS))
@pytest.mark.parametrize("policy", ["shift", "sink_query", "reevaluate"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_policies_equal_fresh_prefill_of_kept_tokens(kind, policy, dtype, tol):
    """As tests/test_streaming.py: in a one-layer model every policy equals a fresh prefill of the
    kept tokens at compressed positions -- with shift, only if a shifted key keeps its factor once
    (the yarn case's 1.5 applied again would scale those keys' scores by 1.5)."""
    dec = random_decoder(53, 32, 1, 4, 2, 8, 48, seed=11, rope_style="gptj", rope_scaling=STREAM_SCALINGS[kind])
    toks = list(np.random.default_rng(1).integers(0, 53, 90))
    cache, logits = run_stream(dec, toks, 10, capacity=24, n_keep=4, policy=policy, dtype=dtype)
    kept = cache.tokens[0]
    assert kept[:4] == toks[:4] and kept[4:] == toks[len(toks) - (len(kept) - 4):]
    if policy == "shift":
        assert cache.rotations.max() >= 1
    assert rel(logits, fresh(dec, kept)) <= tol, (kind, policy)
    if dtype == "float32":
        assert_matches_reference(dec, kept, logits, bound=tol)


# ------------------------------------------------------------------ RopeSpec's value semantics
def test_rope_spec_pickle_repr_equality(rng):
    inv = rng.uniform(0.01, 1.0, 4)
    s = RopeSpec(1e4, "neox", 8, 16, inv, 1.25)
    inv[0] = 99.0                                  # the spec holds its own copy
    assert s.inv_freq[0] != 99.0 and not s.inv_freq.flags.writeable and not s.frequencies.flags.writeable
    for t in (pickle.loads(pickle.dumps(s)), eval(repr(s), {"RopeSpec": RopeSpec})):
        assert t == s and hash(t) == hash(s) and repr(t) == repr(s)
        assert np.array_equal(t.frequencies, s.frequencies) and t.attn_factor == 1.25
    plain = RopeSpec(1e4, "neox", 8, 16)
    assert plain == RopeSpec(1e4, "neox", 8, 16) and hash(plain) == hash(RopeSpec(1e4, "neox", 8, 16))
    assert repr(plain) == "RopeSpec(theta=10000.0, style='neox', rotary_dim=8, head_dim=16)"
    assert pickle.loads(pickle.dumps(plain)) == plain and plain.inv_freq is None
    for other in (RopeSpec(1e4, "neox", 8, 16, s.frequencies), RopeSpec(1e4, "neox", 8, 16, attn_factor=1.25),
                  RopeSpec(1e4, "gptj", 8, 16, s.frequencies, 1.25), plain):
        assert other != s
    assert (s == "x") is False


# ------------------------------------------------------------------ (d) bad specs are refused
BAD_INV = [
    ("abc", KVSimdTypeError, "inv_freq must be a numpy array, list or tuple"),
    ([1.0, 2.0, 3.0], KVSimdValueError, r"inv_freq must have rotary_dim/2=4 entries, got shape \(3,\)"),
    ([[1.0, 2.0], [3.0, 4.0]], KVSimdValueError, "inv_freq must have rotary_dim/2=4 entries"),
    (["a", "b", "c", "d"], KVSimdTypeError, "inv_freq must hold real numbers"),
    ([True, False, True, True], KVSimdTypeError, "inv_freq must hold real numbers, got dtype bool"),
    ([1.0, [2.0], 3.0, 4.0], KVSimdTypeError, "inv_freq must"),
    ([1.0, 0.5, float("nan"), 0.1], KVSimdValueError, r"inv_freq\[2\]=nan must be finite and in \(0, 1e\+200\]"),
    ([1.0, 0.0, 0.5, 0.1], KVSimdValueError, r"inv_freq\[1\]=0.0 must be"),
    (np.array([1.0, 0.5, -0.5, 0.1]), KVSimdValueError, r"inv_freq\[2\]=-0.5 must be"),
    ([1.0, 0.5, 0.1, 1e300], KVSimdValueError, r"inv_freq\[3\]=1e\+300 must be"),
    (np.zeros(4, complex), KVSimdTypeError, "got dtype complex128"),
    (np.ma.masked_array(np.ones(4), [0, 1, 0, 0]), KVSimdTypeError, "inv_freq is a numpy.ma.MaskedArray"),
]
BAD_FACTOR = [(0.0, KVSimdValueError), (-1.0, KVSimdValueError), (float("nan"), KVSimdValueError),
              (float("inf"), KVSimdValueError), (1e39, KVSimdValueError), (True, KVSimdTypeError),
              ("1", KVSimdTypeError), (None, KVSimdTypeError)]


@pytest.mark.parametrize("inv, exc, msg", BAD_INV)
def test_bad_frequencies_are_refused_everywhere(inv, exc, msg):
    with pytest.raises(exc, match=msg):
        RopeSpec(1e4, "neox", 8, 16, inv)
    x = np.ones((1, 3, 16), np.float32)
    for call in (lambda: ops.apply_rope(x, np.arange(3), rotary_dim=8, inv_freq=inv),
                 lambda: ops.shift_keys(x, 2, rotary_dim=8, inv_freq=inv),
                 lambda: KVCache(1, 1, 16, 4).shift_range(0, 0, 2, 1, 1e4, "gptj", 8, inv_freq=inv)):
        with pytest.raises(exc, match=msg):
            call()
    assert (x == 1).all()


@pytest.mark.parametrize("f, exc", BAD_FACTOR)
def test_bad_attention_factor_is_refused(f, exc):
    x = np.ones((1, 3, 16), np.float32)
    with pytest.raises(exc, match="attn_factor"):
        RopeSpec(1e4, "neox", 8, 16, attn_factor=f)
    with pytest.raises(exc, match="attn_factor"):
        ops.apply_rope(x, np.arange(3), attn_factor=f)
    assert (x == 1).all()
    with pytest.raises(TypeError):
        ops.shift_keys(x, 1, attn_factor=1.5)     # a shift never applies the factor


BAD_SCALING = [
    ([("type", "linear")], KVSimdTypeError, r"config.rope_scaling must be None or a dict, got list"),
    (dict(factor=2.0), KVSimdValueError, r"rope_scaling\['type'\] must be one of default, linear, llama3, yarn, "
                                         r"got None"),
    (dict(type="longrope", factor=2.0), KVSimdValueError, "must be one of default, linear, llama3, yarn, got 'longrope'"),
    (dict(type="dynamic", factor=2.0), KVSimdValueError, "got 'dynamic'"),
    (dict(type="linear", factor=2.0, beta_fast=3.0), KVSimdValueError,
     "unknown key 'beta_fast' for type 'linear' .its keys: type, factor, freq_factors."),
    (dict(type="linear"), KVSimdValueError, r"rope_scaling\['factor'\] is missing: type 'linear' needs factor"),
    (dict(LLAMA31, high_freq_factor=None), KVSimdTypeError, r"rope_scaling\['high_freq_factor'\] must be a real"),
    ({k: v for k, v in LLAMA31.items() if k != "low_freq_factor"}, KVSimdValueError,
     r"\['low_freq_factor'\] is missing"),
    (dict(type="linear", factor=0.0), KVSimdValueError, r"\['factor'\] must be finite and > 0, got 0.0"),
    (dict(type="linear", factor=float("nan")), KVSimdValueError, r"\['factor'\] must be finite and > 0"),
    (dict(type="linear", factor="2"), KVSimdTypeError, r"\['factor'\] must be a real number"),
    (dict(type="linear", factor=True), KVSimdTypeError, r"\['factor'\] must be a real number"),
    (dict(LLAMA31, original_max_position_embeddings=0), KVSimdValueError,
     r"\['original_max_position_embeddings'\] must be >= 1"),
    (dict(LLAMA31, original_max_position_embeddings=8192.0), KVSimdTypeError,
     r"\['original_max_position_embeddings'\] must be an integer"),
    (dict(LLAMA31, high_freq_factor=1.0), KVSimdValueError, r"\['high_freq_factor'\]=1.0 must be greater than "
                                                            r"low_freq_factor=1.0"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, truncate="yes"), KVSimdTypeError,
     r"\['truncate'\] must be a bool"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=-1.0), KVSimdValueError,
     r"\['beta_fast'\] must be finite and > 0"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=-1.0), KVSimdValueError,
     r"\['mscale'\] must be finite and >= 0"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=0), KVSimdValueError,
     r"\['attention_factor'\] must be finite and > 0"),
    (dict(type="default", freq_factors=(1.0, 2.0)), KVSimdValueError,
     r"\['freq_factors'\] must have rotary_dim/2=8 entries, got shape \(2,\)"),
    (dict(type="default", freq_factors=(1.0,) * 7 + (0.0,)), KVSimdValueError,
     r"\['freq_factors'\]\[7\]=0.0 must be finite and > 0"),
    (dict(type="default", freq_factors="abcdefgh"), KVSimdTypeError, r"\['freq_factors'\] must be a sequence"),
    (dict(type="default", freq_factors=("a",) * 8), KVSimdTypeError, r"\['freq_factors'\] must hold real numbers"),
    (dict(type="default", freq_factors=(1e-300,) * 8), KVSimdValueError,
     r"rope_scaling gives RoPE the kernels refuse: inv_freq\[0\]=\S+ must be finite and in \(0, 1e\+200\]"),
]


@pytest.mark.parametrize("sc, exc, msg", BAD_SCALING)
def test_bad_rope_scaling_is_refused_naming_the_key(sc, exc, msg):
    with pytest.raises(exc, match=msg):
        config(sc)


def test_rope_scaling_other_rules():
    with pytest.raises(KVSimdValueError, match="rope_scaling applies to RoPE positions; position is 'alibi'"):
        config(dict(type="linear", factor=2.0), position="alibi")
    with pytest.raises(KVSimdValueError, match="rope_theta=1 is refused with yarn"):
        config(dict(type="yarn", factor=2.0, original_max_position_embeddings=8), theta=1.0)
    assert set(ROPE_SCALING) == {"default", "linear", "llama3", "yarn"}


def test_rope_scaling_is_read_only_and_reassignment_revalidates():
    dec = random_decoder(53, 32, 1, 4, 2, 8, 48, seed=2, rope_scaling=dict(type="linear", factor=2.0,
                                                                          freq_factors=[1.0] * 4))
    sc = dec.cfg.rope_scaling
    assert isinstance(sc["freq_factors"], tuple)
    for edit in (lambda: sc.__setitem__("factor", 3.0), lambda: sc.update(factor=3.0), lambda: sc.pop("factor"),
                 lambda: sc.clear(), lambda: sc.setdefault("x", 1), lambda: sc.__delitem__("factor")):
        with pytest.raises(KVSimdTypeError, match="rope_scaling is read-only: assign a new dict"):
            edit()
    assert pickle.loads(pickle.dumps(dec.cfg)) == dec.cfg
    before = dec.forward([1, 2, 3])
    f2 = dec.rope.frequencies.copy()
    dec.cfg.rope_scaling = dict(type="linear", factor=4.0)
    after = dec.forward([1, 2, 3])
    np.testing.assert_allclose(dec.rope.frequencies, f2 / 2, rtol=1e-15)
    assert not np.allclose(before, after)
    dec.cfg.rope_scaling = dict(type="linear", factor=-1.0)
    with pytest.raises(KVSimdValueError, match=r"cfg.rope_scaling\['factor'\] must be finite and > 0"):
        dec.forward([1, 2, 3])


def test_transformers_configs_map_to_rope_scaling():
    from kvsimd.loaders.hf import _rope_params
    v4 = types.SimpleNamespace(rope_theta=5e5, max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    assert _rope_params(v4) == (5e5, 1.0, dict(LLAMA31))
    v4_type = types.SimpleNamespace(rope_theta=1e4, max_position_embeddings=4096,
                                    rope_scaling=dict(type="linear", factor=2.0))
    assert _rope_params(v4_type) == (1e4, 1.0, dict(type="linear", factor=2.0))
    yarn = types.SimpleNamespace(max_position_embeddings=131072, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=None, original_max_position_embeddings=32768, beta_fast=0,
        mscale=None, truncate=False))
    assert _rope_params(yarn) == (1e6, 1.0, dict(type="yarn", factor=4.0, original_max_position_embeddings=32768,
                                                 truncate=False))
    default = types.SimpleNamespace(rope_parameters=dict(rope_type="default", rope_theta=1e4))
    assert _rope_params(default) == (1e4, 1.0, None)
    for kind in ("longrope", "dynamic", "proportional"):
        cfg = types.SimpleNamespace(max_position_embeddings=4096, rope_parameters=dict(rope_type=kind, factor=2.0))
        with pytest.raises(KVSimdValueError, match="RoPE scaling %r is not supported .supported: default, linear, "
                                                   "llama3, yarn." % kind):
            _rope_params(cfg)


def test_from_transformers_refuses_dynamic_scaling():
    t = tm()
    from kvsimd import Decoder
    c = t.transformers.LlamaConfig(vocab_size=t.V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4,
                                                                               factor=2.0))
    m = t.transformers.AutoModelForCausalLM.from_config(c).eval()
    with pytest.raises(KVSimdValueError, match="RoPE scaling 'dynamic' is not supported"):
        Decoder.from_transformers(m)

