"""kvsimd.reference's float64 model: equal to transformers on every imported family, and the oracle
kvsimd's decoders are held to (within kvsimd.testing.REFERENCE_BOUNDS) on the families and on a
grid of ModelConfig options no family has."""
import math
import os
import types

import numpy as np
import pytest

from kvsimd import KVSimdError, KVSimdValueError, reference
from kvsimd.testing import (INT8_ACTIVATION_BOUND, REFERENCE_BOUNDS, assert_matches_reference, random_decoder,
                            random_encoder_decoder, reference_error)

# transformers' float32 forward against the float64 reference: max |difference| relative to the largest
# |logit| (measured 1.2e-7 .. 3.7e-7 on the tiny families of tests/test_models.py)
HF_TOL = 2e-6


def families():
    """tests/test_models.py's tiny random transformers models (one builder for both files)."""
    return pytest.importorskip("test_models", reason="the family tests need torch and transformers")


CAUSAL = ["llama", "qwen2-bias", "gpt_neox", "gpt_neox-sequential", "gpt2", "bloom", "mistral-window", "qwen2-window",
          "qwen3", "phi3", "phi3-window", "gemma2"]
SEQ2SEQ = ["bart", "marian"]


def test_family_lists_are_those_of_test_models():
    tm = families()
    assert sorted(tm.causal_models()) == sorted(CAUSAL)
    assert sorted(tm.seq2seq_models()) == sorted(SEQ2SEQ)


def cached_logits(model, tokens, dtype, split, src=None):
    """Logits of every token: a prefill of ``tokens[:split]`` (all logits), then one step per token."""
    cache = model.new_cache(capacity=len(tokens), dtype=dtype)
    if src is None:
        rows = [model.prefill(tokens[:split], cache=cache, all_logits=True)]
        rows += [model.step([t], cache=cache) for t in tokens[split:]]
    else:
        cross = model.cross_for([src], dtype)
        rows = [model.prefill(tokens[:split], cache=cache, cross=cross, all_logits=True)]
        rows += [model.step([t], cache=cache, cross=cross) for t in tokens[split:]]
    return np.concatenate(rows)


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


# ------------------------------------------------------------------------------ families
@pytest.mark.parametrize("name", CAUSAL)
def test_reference_equals_transformers_causal(name, rng):
    tm = families()
    m, d = tm.causal(name)
    toks = rng.integers(0, tm.V, 37)
    assert rel(tm.hf_logits(m, toks), reference.forward(d, toks)) <= HF_TOL


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_reference_equals_transformers_seq2seq(name, rng):
    tm = families()
    torch = tm.torch
    m, d = tm.seq2seq(name)
    src = rng.integers(3, tm.V - 1, 21)
    tgt = np.concatenate([[m.config.decoder_start_token_id], rng.integers(3, tm.V - 1, 17)])
    with torch.no_grad():
        out = m(input_ids=torch.tensor(src[None]), decoder_input_ids=torch.tensor(tgt[None]))
        enc = m.get_encoder()(input_ids=torch.tensor(src[None])).last_hidden_state[0].double().numpy()
    assert rel(reference.encode(d, src), enc) <= HF_TOL
    assert rel(out.logits[0].double().numpy(), reference.forward(d, tgt, src=src)) <= HF_TOL


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "int4", "int8/int4"])
@pytest.mark.parametrize("name", CAUSAL)
def test_decoder_matches_reference_causal(name, dtype, isa, rng):
    tm = families()
    _, d = tm.causal(name)
    toks = rng.integers(0, tm.V, 40)
    assert_matches_reference(d, toks, cached_logits(d, toks, dtype, 11), cache_dtype=dtype)
    assert_matches_reference(d, toks, d.forward(toks))
    cache = d.new_cache(capacity=40, dtype=dtype)
    assert_matches_reference(d, toks, d.prefill(toks, cache=cache), cache_dtype=dtype)   # the last row only


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "int4", "int8/int4"])
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_decoder_matches_reference_seq2seq(name, dtype, rng):
    tm = families()
    m, d = tm.seq2seq(name)
    src = rng.integers(3, tm.V - 1, 19)
    tgt = np.concatenate([[m.config.decoder_start_token_id], rng.integers(3, tm.V - 1, 25)])
    assert_matches_reference(d, tgt, cached_logits(d, tgt, dtype, 3, src), src=src, cache_dtype=dtype)
    assert_matches_reference(d, tgt, d.forward(src, tgt), src=src)
    assert rel(d.encode(src), reference.encode(d, src)) <= REFERENCE_BOUNDS["float32"]


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct (30 layers, GQA 9/3, GPT-J RoPE pairs), the GGUF tests/test_gguf.py
    reads, from kvsimd's model cache."""
    pytest.importorskip("gguf")
    from kvsimd import Decoder
    from kvsimd.loaders import registry as models
    return Decoder.from_gguf(models.smollm2_path(), activations="float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_real_model_matches_reference(smollm2, dtype):
    """The bounds hold at 30 layers (measured: float32 2.0e-6, float16 3.3e-4)."""
    ids = smollm2.tokenizer.encode("The old king said to his daughters:")
    assert_matches_reference(smollm2, ids, cached_logits(smollm2, ids, dtype, 4), cache_dtype=dtype)


# The real model on an int8 cache against the reference that quantizes K/V by the same rule and
# rounds each query by it too (reference.query_as_read: what the kernel's integer dot products read):
# 30 layers deep, a value that lies near the middle of two steps is rounded one way from kvsimd's
# float32 value and the other from the reference's float64 one (one step of one value).  A K or V
# value is stored once and read by every later row; a query is rounded in every layer at every
# step, so there are far more such flips (9 query heads against 3 KV heads).  Measured on a Zen 4:
# 5.0e-3 (scalar), 8.6e-3 (avx2), 5.1e-3 (avx512), while the float reference is 1.3e-2 .. 1.5e-2
# away and the reference without the query's rounding 9.5e-3 .. 1.1e-2 (K flips alone: 3.1e-3 on
# a Zen 4, 1.1e-4 on a Xeon); with int8 keys and int4 values 1.1e-2 (scalar, avx2) and 2.5e-4
# (avx512).  So the check here is a stated bound, 10x the tiny models' REFERENCE_BOUNDS["int8"],
# and that the int8 reference is nearer than the float one (a cache that did not quantize is ~1e-5
# from the float one).  The rule itself, the query's rounding included, is
# checked where a flip is rare: tiny models (test_decoder_matches_reference_* with int8 caches fail
# against a reference that does not round the query) and ops.attend (tests/test_quantized_kv.py).
REAL_MODEL_INT8_BOUND = 10 * REFERENCE_BOUNDS["int8"]
# Over int4 keys the query is rounded by the int8 rule as well (their integer dot products read
# it so), so the same flips happen there, in every layer at every step, with 4-bit steps of K/V
# behind them.  Measured on a Zen 5 (max |logits - ref| / max |ref|): int4 2.6e-6 (avx512), 2.2e-2
# (avx2), 1.5e-2 (scalar), where the float, int8 and unturned int4 references are 7.3e-2 .. 7.6e-2,
# 7.8e-2 .. 8.1e-2 and 0.33 away; int8 keys with int4 values 8.0e-3 (avx512), 1.9e-2 (avx2), 2.0e-2
# (scalar), where the float, int4 and turned int8 references are 4.7e-2 .. 4.8e-2, 6.2e-2 .. 6.9e-2
# and 4.7e-2 .. 4.8e-2 away (1.1e-2 and 2.5e-4 at an earlier commit: which values flip changes
# with any change to the arithmetic; the int8 cache measured the same here as on a Zen 4).  So the check: a stated bound, twice the int8
# one, and at most 0.6x the distance to every reference that stores a side another way (a cache
# that kept a side float, or stored it at the other width or unturned, fails that).
REAL_MODEL_INT4_BOUND = 2 * REAL_MODEL_INT8_BOUND
NEARER = 0.6


def test_real_model_int8_cache_matches_reference(smollm2):
    ids = smollm2.tokenizer.encode("The old king said to his daughters:")
    logits = cached_logits(smollm2, ids, "int8", 4)
    err8 = assert_matches_reference(smollm2, ids, logits, cache_dtype="int8", bound=REAL_MODEL_INT8_BOUND)
    errf = reference_error(smollm2, ids, logits, kv="float")
    assert err8 < errf, (err8, errf)


def test_real_model_int4_cache_matches_reference(smollm2):
    """The real model on an int4 cache (K/V turned by the Hadamard matrix, 4-bit) against the
    reference that quantizes the same way and rounds the query as the kernels read it, within
    REAL_MODEL_INT4_BOUND (its measurements above), and nearer than the float, int8 and unturned
    int4 references: a cache that kept float K/V, stored int8 or did not turn fails those."""
    ids = smollm2.tokenizer.encode("The old king said to his daughters:")
    logits = cached_logits(smollm2, ids, "int4", 4)
    err4 = assert_matches_reference(smollm2, ids, logits, cache_dtype="int4", bound=REAL_MODEL_INT4_BOUND)
    for other in ("float", "int8", ("int4", False)):
        assert err4 <= NEARER * reference_error(smollm2, ids, logits, kv=other), other


def test_real_model_int8_keys_int4_values_cache_matches_reference(smollm2):
    """int8 keys with int4 values (KVCache(dtype="int8/int4"), both turned by the Hadamard matrix)
    against the reference that stores them the same way (and rounds the query as int8 keys have it
    read), within REAL_MODEL_INT4_BOUND (a step of a key or of a query may flip; its measurements
    above), and nearer than the float, int4 (4-bit keys) and turned int8 (8-bit values) references:
    a cache that stored either side at the other width fails that."""
    ids = smollm2.tokenizer.encode("The old king said to his daughters:")
    logits = cached_logits(smollm2, ids, "int8/int4", 4)
    err = assert_matches_reference(smollm2, ids, logits, cache_dtype="int8/int4", bound=REAL_MODEL_INT4_BOUND)
    for other in ("float", "int4", ("int8", True)):
        assert err <= NEARER * reference_error(smollm2, ids, logits, kv=other), other


def test_real_model_with_int8_activations_matches_reference(smollm2):
    """Int8 activations (the default) against the reference that rounds x the same way: the
    stated model-level figure (kvsimd.testing.INT8_ACTIVATION_BOUND) measured 3.8e-2 here, 30
    layers deep: checked against four times the tiny models' bound."""
    from kvsimd import Decoder
    m = Decoder.from_gguf(smollm2.source)
    ids = m.tokenizer.encode("The old king said to his daughters:")
    assert_matches_reference(m, ids, cached_logits(m, ids, "float32", 4), bound=4 * INT8_ACTIVATION_BOUND)


# ------------------------------------------------------------------------------ option grid
# (name, encoder-decoder?, n_kv_heads, options): together every ModelConfig option the forward reads
GRID = [
    ("llama-like", False, 2, dict(ffn_gated=True)),
    ("layernorm-gelu-bias-parallel-partial-rope", False, 4,
     dict(norm="layernorm", activation="gelu", bias=True, parallel_residual=True, rotary_dim=4)),
    ("gptj-rope-theta-relu-eps", False, 2, dict(rope_style="gptj", rope_theta=500.0, activation="relu",
                                                norm_eps=1e-2)),
    ("alibi-mqa-embed_norm", False, 1, dict(position="alibi", norm="layernorm", embed_norm=True)),
    ("postnorm-gelu_tanh-learned-offset", False, 4,
     dict(pre_norm=False, activation="gelu_tanh", position="learned", position_offset=2, norm="layernorm",
          bias=True)),
    ("sinusoidal-embed_scale-no-final_norm-gated-gelu", False, 2,
     dict(position="sinusoidal", embed_scale=math.sqrt(32), final_norm=False, ffn_gated=True, activation="gelu")),
    ("postnorm-rmsnorm-alibi", False, 2, dict(pre_norm=False, position="alibi")),
    ("encdec-postnorm-learned", True, 4,
     dict(pre_norm=False, position_offset=2, norm="layernorm", embed_norm=True, final_norm=False, bias=True,
          activation="gelu")),
    ("encdec-prenorm-sinusoidal-gated-gqa", True, 2, dict(position="sinusoidal", ffn_gated=True, embed_scale=2.0)),
    ("qk_norm-post_norms-scale-window-final_softcap", False, 2,
     dict(qk_norm=True, post_norms=True, attn_scale=0.6, attn_windows=(6, 0), final_softcap=1.5, ffn_gated=True,
          attn_softcap=0.7)),
    ("layernorm-qk_norm-windows-alibi", False, 2,
     dict(norm="layernorm", qk_norm=True, position="alibi", attn_windows=(4, 7))),
]

V = 53


def grid_model(name):
    _, encdec, kv, opts = next(g for g in GRID if g[0] == name)
    if encdec:
        return random_encoder_decoder(V, 32, 2, 4, kv, 8, 40, enc_layers=1, seed=7, **opts)
    return random_decoder(V, 32, 2, 4, kv, 8, 40, seed=7, **opts)


def test_grid_covers_every_option():
    seen = {}
    for _, encdec, kv, opts in GRID:
        m = grid_model(_)
        c = m.cfg
        for field in ("norm", "activation", "position", "rope_style", "ffn_gated", "pre_norm", "parallel_residual",
                      "embed_norm", "final_norm", "cross_attention"):
            seen.setdefault(field, set()).add(getattr(c, field))
        seen.setdefault("partial rotary", set()).add(c.position == "rope" and c.rotary_dim < c.head_dim)
        seen.setdefault("rope_theta", set()).add(c.position == "rope" and c.rope_theta != 10000.0)
        seen.setdefault("norm_eps", set()).add(c.norm_eps != 1e-6)
        seen.setdefault("position_offset", set()).add(c.position_offset > 0)
        seen.setdefault("embed_scale", set()).add(c.embed_scale != 1.0)
        seen.setdefault("bias", set()).add(m.layers[0].attn.bq is not None)
        seen.setdefault("heads", set()).add(("mha", "gqa", "mqa")[(kv < 4) + (kv == 1)])
        for field in ("qk_norm", "post_norms"):
            seen.setdefault(field, set()).add(getattr(c, field))
        seen.setdefault("attn_scale", set()).add(c.attn_scale is not None)
        seen.setdefault("final_softcap", set()).add(c.final_softcap > 0)
        seen.setdefault("attn_softcap", set()).add(c.attn_softcap > 0)
        seen.setdefault("attn_windows", set()).add(c.attn_windows is not None)
    assert seen.pop("norm") == {"rmsnorm", "layernorm"}
    assert seen.pop("activation") == {"silu", "gelu", "gelu_tanh", "relu"}
    assert seen.pop("position") == {"rope", "alibi", "learned", "sinusoidal"}
    assert seen.pop("rope_style") == {"neox", "gptj"}
    assert seen.pop("heads") == {"mha", "gqa", "mqa"}
    assert all(v == {True, False} for v in seen.values()), seen


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", [g[0] for g in GRID])
def test_decoder_matches_reference_option_grid(name, dtype, isa, rng):
    m = grid_model(name)
    toks = rng.integers(0, V, 30)
    if m.cfg.cross_attention:
        src = rng.integers(0, V, 13)
        toks[0] = m.cfg.decoder_start_token_id
        assert_matches_reference(m, toks, cached_logits(m, toks, dtype, 4, src), src=src, cache_dtype=dtype)
        assert_matches_reference(m, toks, m.forward(src, toks), src=src)
    else:
        assert_matches_reference(m, toks, cached_logits(m, toks, dtype, 9), cache_dtype=dtype)
        assert_matches_reference(m, toks, m.forward(toks))


@pytest.mark.parametrize("policy, position, windows", [("shift", "rope", None), ("shift", "alibi", None),
                                                       ("reevaluate", "learned", None), ("shift", "rope", (5,)),
                                                       ("reevaluate", "rope", (4, 0))])
def test_streaming_window_matches_reference_of_the_kept_tokens(policy, position, windows, rng):
    """StreamingLLM: after each discard (n_keep sinks, n_discard oldest window tokens dropped) a
    step's logits are those of the kept tokens at the compressed positions 0..L-1.  "shift" keeps
    the K/V the kept tokens got beside the discarded ones (rotated to their new positions): only the
    first layer's are a function of the kept tokens alone, so its model has one layer.  Layers with
    an attention window read the last W of the kept tokens (sinks included while they are among them)."""
    n_layers = 1 if policy == "shift" else 2
    d = random_decoder(V, 32, n_layers, 4, 2, 8, 40, seed=5, position=position, norm="layernorm",
                       attn_windows=windows)
    cap, nk, nd = 12, 2, 3
    cache = d.new_cache(capacity=cap, n_keep=nk, policy=policy, n_discard=nd, dtype="float32")
    toks = rng.integers(0, V, 30)
    kept = list(toks[:5])
    d.prefill(kept, cache=cache)
    for t in toks[5:]:
        if len(kept) == cap:
            kept = kept[:nk] + kept[nk + nd:]
        kept.append(t)
        logits = d.step([t], cache=cache)[0]
        assert_matches_reference(d, kept, logits, positions=np.arange(len(kept)))


# ------------------------------------------------------------------------------ the reference itself
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_relative_positions_are_translation_invariant(position, rng):
    d = random_decoder(V, 32, 2, 4, 2, 8, 40, seed=2, position=position)
    toks = rng.integers(0, V, 17)
    np.testing.assert_allclose(reference.forward(d, toks, positions=np.arange(17) + 1000), reference.forward(d, toks),
                               rtol=0, atol=1e-9)


def test_learned_positions_read_the_offset_rows(rng):
    d = random_decoder(V, 32, 2, 4, 2, 8, 40, seed=2, position="learned", position_offset=3)
    toks = rng.integers(0, V, 9)
    shifted = types.SimpleNamespace(**vars(d))
    shifted.pos_embed = d.pos_embed[5:]          # rows 5.. of the table: positions moved by 5
    np.testing.assert_allclose(reference.forward(shifted, toks), reference.forward(d, toks, positions=np.arange(9) + 5),
                               rtol=0, atol=1e-12)
    assert np.abs(reference.forward(d, toks) - reference.forward(shifted, toks)).max() > 1e-3


def test_attention_is_causal(rng):
    d = random_decoder(V, 32, 2, 4, 2, 8, 40, seed=4, position="alibi")
    toks = rng.integers(0, V, 15)
    np.testing.assert_allclose(reference.forward(d, toks[:6]), reference.forward(d, toks)[:6], rtol=0, atol=1e-12)
    m = random_encoder_decoder(V, 32, 1, 4, 4, 8, 40, seed=4)
    src = rng.integers(0, V, 8)
    enc = reference.encode(m, src)          # bidirectional: the first row depends on the last token
    src2 = src.copy()
    src2[-1] = (src[-1] + 1) % V
    assert np.abs(reference.encode(m, src2)[0] - enc[0]).max() > 1e-3


def test_activations_and_norms_against_torch(rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = rng.standard_normal((5, 16)) * 3
    tx = torch.tensor(x, dtype=torch.float64)
    for name, want in (("silu", F.silu(tx)), ("gelu", F.gelu(tx)), ("gelu_tanh", F.gelu(tx, approximate="tanh")),
                       ("relu", F.relu(tx))):
        np.testing.assert_allclose(reference.activation(name, x), want.numpy(), rtol=1e-13, atol=1e-15)
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    nw = types.SimpleNamespace(w=w, b=b)
    cfg = types.SimpleNamespace(norm="layernorm", norm_eps=1e-5)
    want = F.layer_norm(tx, (16,), torch.tensor(w), torch.tensor(b), eps=1e-5).numpy()
    np.testing.assert_allclose(reference.norm(cfg, nw, x), want, rtol=1e-12, atol=1e-12)
    cfg.norm = "rmsnorm"                    # rmsnorm has no bias: b is not read
    want = (tx * torch.rsqrt(tx.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.tensor(w)).numpy()
    np.testing.assert_allclose(reference.norm(cfg, nw, x), want, rtol=1e-12, atol=1e-12)


def test_alibi_slopes_and_sinusoidal_table():
    # powers of two: 2^(-8 i / n); otherwise the largest power p's slopes, then every other one of 2p
    np.testing.assert_allclose(reference.alibi_slopes(8), 2.0 ** (-np.arange(1, 9)), rtol=1e-15)
    np.testing.assert_allclose(reference.alibi_slopes(6), np.concatenate([2.0 ** (-2.0 * np.arange(1, 5)),
                                                                          2.0 ** (-np.array([1.0, 3.0]))]), rtol=1e-15)
    t = reference.sinusoidal_table(7, 6)
    p, i = 5, 2
    assert t[p, i] == pytest.approx(math.sin(p / 10000 ** (2 * i / 6)))
    assert t[p, 3 + i] == pytest.approx(math.cos(p / 10000 ** (2 * i / 6)))


def test_undefined_layer_rules_are_refused():
    """Option combinations with no one rule today (the Python layers and the compiled step differ, or
    the option is ignored): the reference refuses them, naming the option."""
    with pytest.raises(KVSimdValueError, match="parallel_residual needs pre_norm=True"):   # refused by the library too
        random_decoder(V, 32, 1, 4, 2, 8, 40, parallel_residual=True, pre_norm=False)
    d = random_decoder(V, 32, 1, 4, 2, 8, 40)
    post = types.SimpleNamespace(**vars(d))
    post.cfg = types.SimpleNamespace(**dict(vars(d.cfg), parallel_residual=True, pre_norm=False))
    with pytest.raises(KVSimdValueError, match="parallel_residual"):
        reference.forward(post, [1, 2])
    m = random_encoder_decoder(V, 32, 1, 4, 4, 8, 40)
    with pytest.raises(KVSimdValueError, match="parallel_residual"):
        reference.layer(types.SimpleNamespace(**dict(vars(m.cfg), parallel_residual=True)), m.layers[0],
                        np.zeros((2, 32)), np.arange(2), enc_out=np.zeros((3, 32)))
    enc = types.SimpleNamespace(**vars(m))
    enc.enc_cfg = types.SimpleNamespace(**dict(vars(m.enc_cfg), position="rope"))
    with pytest.raises(KVSimdValueError, match="enc_cfg.position"):
        reference.encode(enc, [1, 2])


def test_bad_inputs_name_the_argument():
    d = random_decoder(V, 32, 1, 4, 2, 8, 40, position="learned", max_positions=8)
    for call, word in ((lambda: reference.forward(d, [1, V]), "tokens"),
                       (lambda: reference.forward(d, []), "tokens"),
                       (lambda: reference.forward(d, [1.5, 2]), "tokens"),
                       (lambda: reference.forward(d, [1, 2], positions=[0]), "positions"),
                       (lambda: reference.forward(d, [1, 2], positions=[-1, 0]), "positions"),
                       (lambda: reference.forward(d, list(range(9))), "position table"),
                       (lambda: reference.forward(d, [1, 2], src=[1]), "src"),
                       (lambda: reference.activation("tanh", np.ones(2)), "activation")):
        with pytest.raises(KVSimdError, match=word):
            call()
    m = types.SimpleNamespace(**vars(d))
    m.final_norm = None                      # cfg.final_norm is True: the weights must be there
    with pytest.raises(KVSimdValueError, match="final_norm"):
        reference.forward(m, [1, 2])


# ------------------------------------------------------------------------------ the oracle stays out of the library
_BLOCKED_RUN = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers") or name == "kvsimd.reference":
            raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Block())
from kvsimd.testing import random_decoder, random_encoder_decoder
d = random_decoder(41, 24, 2, 4, 2, 6, 36, position="alibi")
cache = d.new_cache(capacity=16)
d.prefill([1, 2, 3], cache=cache)
d.step([4], cache=cache)
d.forward([1, 2])
print(len(list(d.generate([1, 2, 3], max_new_tokens=4))))
m = random_encoder_decoder(41, 24, 2, 4, 2, 6, 36, pre_norm=False)
m.forward([1, 2], [40])
print(len(list(m.generate([1, 2, 3], max_new_tokens=3, stop_tokens=()))))
assert "kvsimd.reference" not in sys.modules and "torch" not in sys.modules
"""


def test_models_run_without_the_reference_torch_or_transformers():
    """No execution path of the library imports kvsimd.reference (nor torch / transformers):
    random models are built, prefill, step and generate with those imports blocked."""
    import subprocess
    import sys
    import kvsimd
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvsimd.__file__)))
    r = subprocess.run([sys.executable, "-c", _BLOCKED_RUN], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "3"]
