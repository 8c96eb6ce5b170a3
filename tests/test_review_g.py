"""Review findings on the compiled layers and the model config checks (issue 13, moved in issue 14).

* The compiled layers (``_kvsimd.Layers``) read every weight by pointer.  Each part is checked when
  it is packed (dtype, shape, contiguity, and its width against the stack's), and each pass checks
  that no array changed in place since (an ``ndarray.resize`` after the model checked it), so a
  bad array is a KVSimdError naming the layer and the weight, never an out-of-bounds read.  Those
  calls crash or read garbage on an unchecked build, so they run in a child process: a signal
  there fails the case instead of the whole run.
* ModelConfig: numbers too large for a double, non-bool flags and a RoPE theta the kernels
  refuse are KVSimdErrors naming the field, at construction.
"""
import os
import re
import sys

import numpy as np
import pytest

import childcases

from kvsimd import KVSimdError, KVSimdTypeError, KVSimdValueError, _kvsimd
from kvsimd.nn import sample
from kvsimd.nn import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


# ---------------------------------------------------------------------------------- 1. decode step
CASES = {}


case = childcases.registrar(CASES)


def _decoder(n_layers=2):
    from test_streaming import random_decoder
    m = random_decoder(n_layers=n_layers)     # pre-norm, RMSNorm, gated FFN, d_model 32, ffn 48
    cache = m.new_cache(capacity=16)
    m.prefill([1, 2, 3], cache=cache)
    return m, cache


def _encdec():
    from test_decoder_safety import random_encoder_decoder
    m = random_encoder_decoder()               # post-norm, LayerNorm, biases, cross-attention
    cross = m.cross_for([[5, 6, 7]])
    cache = m.new_cache(capacity=16)
    m.prefill([1, 2], cache=cache, cross=cross)
    return m, cache, cross


def _resized_step(path, shape, encdec=False):
    """Resize one weight array of layer 0 in place (no new assignment, so the model does not
    re-validate), then take a decode step."""
    if encdec:
        m, cache, cross = _encdec()
    else:
        (m, cache), cross = _decoder(), None
    obj = m.layers[0]
    for part in path.split("."):
        obj = getattr(obj, part)
    obj.resize(shape, refcheck=False)
    if encdec:
        m.step([4], cache=cache, cross=cross)
    else:
        m.step([4], cache=cache)


for _path, _shape, _ed in (("norm1.w", (1,), False), ("norm2.w", (4,), False), ("attn.wqkv", (4, 64), False),
                           ("attn.wo", (1, 32), False), ("ffn.w13", (32, 7), False), ("ffn.w2", (2, 32), False),
                           ("norm1.b", (1,), True), ("attn.bqkv", (8,), True), ("attn.bo", (3,), True),
                           ("ffn.b1", (5,), True), ("ffn.b2", (1,), True), ("norm_cross.w", (2,), True),
                           ("cross.wq", (32, 4), True), ("cross.bq", (1,), True), ("cross.wo", (4, 32), True)):
    def _fn(p=_path, s=_shape, e=_ed):
        _resized_step(p, s, e)
    _fn.__name__ = "resized_" + _path.replace(".", "_")
    case(r"layers\[0\]\.%s changed in place after the model packed it" % re.escape(_path))(_fn)


def _layers(blocks, **kw):
    args = dict(d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, activation="silu", gated=True, pre_norm=True,
                parallel_residual=False)
    args.update(kw)
    return _kvsimd.Layers(blocks, **args)


def _parts(F=48, **edit):
    """The parts of one valid gated layer (d_model 32, 2 heads of 16, 1 KV head), then ``edit``."""
    f = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    N, L = _kvsimd.Norm, _kvsimd.Linear
    parts = dict(norm1=lambda: N(f(32), None, True, 1e-6, 32, name="layers[0].norm1"),
                 qkv=lambda: L(f(32, 64), name="layers[0].attn.wqkv"),
                 o=lambda: L(f(32, 32), name="layers[0].attn.wo"),
                 norm2=lambda: N(f(32), None, True, 1e-6, 32, name="layers[0].norm2"),
                 ffn_in=lambda: L(f(32, 2 * F), name="layers[0].ffn.w13"),
                 ffn_out=lambda: L(f(F, 32), name="layers[0].ffn.w2"))
    parts.update(edit)
    return _kvsimd.Block(*[parts[k]() for k in ("norm1", "qkv", "o", "norm2", "ffn_in", "ffn_out")])


def _run(blocks=None, x=None, plan="plan", **kw):
    m, cache = _decoder(1)
    cfg = m.cfg
    if plan == "plan":
        plan = cache.step_plan(cfg.n_heads * cfg.head_dim, np.array([3]), np.array([3]), np.array([3]),
                               [[(False, 0, 4, 3)]], rope=m.rope)
    layers = _layers([_parts()] if blocks is None else blocks, **kw)
    layers.run(np.zeros((1, 32), np.float32) if x is None else x, plan)


@case(r"layers\[0\]\.norm1\.w must be a numpy\.ndarray, got NoneType")
def direct_norm_none():
    _parts(norm1=lambda: _kvsimd.Norm(None, None, True, 1e-6, 32, name="layers[0].norm1"))


@case(r"layers\[1\]\.norm2\.w must have shape \(32,\), got \(31,\)")
def direct_norm_short():
    _kvsimd.Norm(np.ones(31, np.float32), None, True, 1e-6, 32, name="layers[1].norm2")


@case(r"layers\[1\]\.norm2\.w must have 32 entries for these layers, got 31")
def direct_norm_narrow():
    _layers([_parts(norm2=lambda: _kvsimd.Norm(np.ones(31, np.float32), None, True, 1e-6, 31,
                                               name="layers[1].norm2"))])


@case(r"layers\[1\]\.attn\.bqkv must have shape \(64,\), got \(63,\)")
def direct_bias_short():
    _kvsimd.Linear(np.zeros((32, 64), np.float32), np.zeros(63, np.float32), name="layers[1].attn.wqkv")


@case(r"layers\[0\]\.ffn\.w13 must be \[32, 2F\] \(\[gate \| up\] of a gated FFN\), got \[32, 95\]")
def direct_w_in_odd():
    _layers([_parts(F=47, ffn_in=lambda: _kvsimd.Linear(np.zeros((32, 95), np.float32), name="layers[0].ffn.w13"))])


@case(r"layers\[0\]\.ffn\.w2 must be \[48, 32\] for these layers, got \[47, 32\]")
def direct_w2_rows():
    _layers([_parts(ffn_out=lambda: _kvsimd.Linear(np.zeros((47, 32), np.float32), name="layers[0].ffn.w2"))])


@case(r"layers\[0\]\.ffn\.w2 must have dtype float32, got float64")
def direct_w2_dtype():
    _kvsimd.Linear(np.zeros((48, 32)), name="layers[0].ffn.w2")


@case(r"layers\[1\]\.attn\.wo must be C-contiguous")
def direct_wo_fortran():
    _kvsimd.Linear(np.asfortranarray(np.zeros((32, 32), np.float32)), name="layers[1].attn.wo")


@case(r"layers\[0\]\.ffn\.b1 must be a numpy\.ndarray, got list")
def direct_bias_list():
    _kvsimd.Linear(np.zeros((32, 96), np.float32), [0.0] * 96, name="layers[0].ffn.w1")


@case(r"blocks\[0\] must be a Block, got tuple")
def direct_short_tuple():
    _layers([(1, 2, 3)])


@case(r"plan must be a plan of a cache .*got NoneType")
def direct_plan_none():
    _run(plan=None)


@case(r"x must be a numpy\.ndarray, got NoneType")
def direct_x_none():
    m, cache = _decoder(1)
    plan = cache.step_plan(32, np.array([3]), np.array([3]), np.array([3]), [[(False, 0, 4, 3)]])
    _layers([_parts()]).run(None, plan)


@case(r"activation must be one of silu, gelu, gelu_tanh, relu, got 'tanh'")
def direct_bad_activation():
    _layers([_parts()], activation="tanh")


@case(r"layers\[0\]\.cross\.wo must be \[32, 32\] for these layers, got \[8, 32\]")
def direct_cross_wo():
    m, cache, cross = _encdec()
    b = m._packed.layers.blocks[0]
    bad = _kvsimd.Block(b.norm1, b.qkv, b.o, b.norm2, b.ffn_in, b.ffn_out, b.norm_cross, b.cross_q,
                        _kvsimd.Linear(np.zeros((8, 32), np.float32), name="layers[0].cross.wo"), b.cross_kv)
    _kvsimd.Layers([bad], d_model=32, n_heads=m.cfg.n_heads, n_kv_heads=m.cfg.n_kv_heads, head_dim=m.cfg.head_dim,
                   activation="gelu", gated=False, pre_norm=False, parallel_residual=False)


child_results = childcases.results_fixture(__name__, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_layers_check_every_array_they_read(name, child_results):
    childcases.check(name, child_results, CASES)


def test_decode_step_still_matches_the_uncached_pass():
    """The checks refuse nothing valid: a cached decode step equals the uncached pass (a local
    plan over the whole prefix, no cache)."""
    from test_streaming import random_decoder
    m = random_decoder(n_layers=2)
    cache = m.new_cache(capacity=16, dtype="float32")
    m.prefill([1, 2, 3], cache=cache)
    np.testing.assert_allclose(m.step([4], cache=cache)[0], m.forward([1, 2, 3, 4])[-1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------- 2. config numbers and flags
def cfg(**kw):
    args = dict(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16)
    args.update(kw)
    return ModelConfig(**args)


@pytest.mark.parametrize("field", ["norm_eps", "embed_scale", "rope_theta"])
def test_config_number_too_large_for_a_double_is_named(field):
    with pytest.raises(KVSimdValueError, match=r"config\.%s=%d does not fit a double" % (field, 2 ** 2000)):
        cfg(**{field: 2 ** 2000})


@pytest.mark.parametrize("field,value", [("temperature", 2 ** 1100), ("top_p", -2 ** 1100)])
def test_sampling_number_too_large_for_a_double_is_named(field, value):
    logits = np.array([0.0, 1.0, 2.0], np.float32)
    with pytest.raises(KVSimdValueError, match=r"%s=%d does not fit a double" % (field, value)):
        sample(logits, np.random.default_rng(0), **{field: value})


BOOLS = ("ffn_gated", "pre_norm", "parallel_residual", "embed_norm", "final_norm", "cross_attention")


@pytest.mark.parametrize("field", BOOLS)
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None, 1.0, np.int64(1)])
def test_config_flags_must_be_bools(field, value):
    pattern = r"config\.%s must be a bool, got %s" % (field, re.escape(repr(value)))
    with pytest.raises(KVSimdTypeError, match=pattern):
        cfg(**{field: value})


@pytest.mark.parametrize("field", BOOLS)
def test_config_flags_take_python_and_numpy_bools(field):
    for v in (True, False, np.bool_(True), np.bool_(False)):
        c = cfg(**{field: v})
        assert getattr(c, field) == v


def test_config_flag_checked_again_when_a_model_revalidates():
    """A flag assigned after construction is caught where the model re-validates its config."""
    from test_streaming import random_decoder
    m = random_decoder(n_layers=1)
    cache = m.new_cache(capacity=8)
    m.cfg.pre_norm = "no"
    with pytest.raises(KVSimdTypeError, match=r"pre_norm must be a bool, got 'no'"):
        m.prefill([1, 2], cache=cache)


# ---------------------------------------------------------------------------------- 3. one rule for RoPE theta
@pytest.mark.parametrize("theta", [1e-300, 1e-201, 0.0, -1.0, float("inf"), float("nan")])
def test_config_theta_follows_the_kernel_rule(theta):
    """Whatever theta the config accepts, the RoPE kernels accept (and the other way round)."""
    with pytest.raises(KVSimdValueError) as boundary:
        _kvsimd._rope_params(theta, "neox", 4, 4)
    with pytest.raises(KVSimdValueError) as config:
        cfg(rope_theta=theta)
    assert str(config.value) == "config.rope_theta" + str(boundary.value)[len("theta"):]
    assert "at least 1e-200" in str(config.value)


@pytest.mark.parametrize("theta", [1e-200, 1e-150, 0.5, 10000.0, 1e300])
def test_config_theta_the_kernels_take_prefills(theta):
    from test_streaming import random_decoder
    m = random_decoder(n_layers=1)
    m.cfg = cfg(vocab_size=m.cfg.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                ffn_gated=True, rope_theta=theta, rope_style="neox", max_positions=8192)
    logits = m.prefill([1, 2, 3], cache=m.new_cache(capacity=8))
    assert logits.shape == (m.cfg.vocab_size,) and np.isfinite(logits).all()


def test_config_rope_fields_named_with_the_boundary_rule():
    with pytest.raises(KVSimdValueError, match=r"^config\.rope_style must be 'gptj' or 'neox', got 'llama'$"):
        cfg(rope_style="llama")
    with pytest.raises(KVSimdValueError, match=r"^config\.rotary_dim must be even and in 2\.\.head_dim=4, got 3$"):
        cfg(rotary_dim=3)
    with pytest.raises(KVSimdValueError, match=r"^config\.head_dim \(last axis\) is 1024; at most 512"):
        cfg(d_model=2048, head_dim=1024)
    assert cfg(position="alibi", rope_theta=1e-300).rope_theta == 1e-300   # only read for RoPE


def test_gguf_rope_base_the_kernels_refuse_fails_at_load(tmp_path):
    import gguf
    from test_gguf import write_llama_gguf
    from kvsimd import Decoder
    path = str(tmp_path / "tiny_theta.gguf")
    write_llama_gguf(path, meta={"llama.rope.freq_base": (1e-300, gguf.GGUFValueType.FLOAT64)})
    from kvsimd.loaders.gguf import GGUFError
    with pytest.raises(GGUFError, match=r"tiny_theta.gguf: the metadata gives an unusable config: .*rope_theta must be "
                                        r"a positive finite number \(at least 1e-200\)"):
        Decoder.from_gguf(path)
